"""The storage wing's interface (``asyncload.storage``): every name it exports is there, the
optional backends (fsspec, aiohttp) are imported only when a name of theirs is first used, and
the factory picks the store a checkpoint needs; obstore is never imported (it is retired)."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncload
import asyncload.storage
from asyncload.storage import (
    FsspecStorage,
    LocalStorage,
    WireStorage,
    open_storage,
)

pytestmark = pytest.mark.timeout(60)

# the storage wing alone, without the package's own imports (torch, the engine, the formats)
_ALONE = r"""
import sys, types
pkg = types.ModuleType("asyncload")
pkg.__path__ = [sys.argv[1]]
sys.modules["asyncload"] = pkg
OPTIONAL = {"fsspec", "aiohttp", "obstore", "s3fs", "gcsfs", "aiobotocore", "botocore", "torch"}

def loaded():
    return sorted({m.split(".")[0] for m in sys.modules} & OPTIONAL)

import asyncload.storage
print(loaded())
asyncload.storage.FsspecStorage
print(loaded())
asyncload.storage.plan_store
print("obstore" in sys.modules)
"""


def test_the_wing_imports_no_optional_backend_until_one_is_used() -> None:
    package = str(Path(asyncload.__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _ALONE, package], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[]", "['fsspec']", "False"], out.stdout


def test_every_exported_name_is_there() -> None:
    for name in asyncload.storage.__all__:
        assert getattr(asyncload.storage, name) is not None, name
    assert asyncload.storage.FsspecStorage.__module__ == "asyncload.storage.fsspec"
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        asyncload.storage.Nothing  # noqa: B018
    with pytest.raises(AttributeError, match="removed with obstore: .* WireStorage"):
        asyncload.storage.ObstoreStorage  # noqa: B018
    assert "ObstoreStorage" not in asyncload.storage.__all__


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        yield ex


@pytest.mark.asyncio
async def test_the_factory_picks_the_store(tmp_path, http_server, executor) -> None:
    """A local path or ``file://`` URL: local files; ``s3://``, ``gs://`` and ``http(s)://``:
    wire unless another transport is asked for (HTTP directory listings through fsspec); every
    other protocol: fsspec."""
    (tmp_path / "a").write_bytes(b"1")
    local = open_storage(tmp_path, None, executor)
    assert type(local) is LocalStorage and await local.listdir() == ["a"]
    assert type(open_storage(f"file://{tmp_path}", None, executor)) is LocalStorage
    assert type(open_storage("memory://x", None, executor, transport="wire")) is FsspecStorage
    http_server.put_object("iface", "c/a.bin", b"12")
    http_server.put_object("iface", "c/b.bin", b"345")
    url = http_server.url("iface", "c")
    for transport, cls in (
        ("auto", WireStorage),
        ("wire", WireStorage),
        ("fsspec", FsspecStorage),
    ):
        store = open_storage(url, {}, executor, transport=transport)
        try:
            assert type(store) is cls
            assert await store.listdir() == ["a.bin", "b.bin"]
            assert bytes(await store.read("b.bin", 1, 3)) == b"45"
        finally:
            await store.aclose()
