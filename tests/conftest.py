"""Shared fixtures. Storage servers (S3, GCS, HTTP on loopback) come from asyncload.testing.

Checkpoints written by torch's own ``dcp.save`` (see :func:`_ckpt.make_checkpoint`):

``ckpt`` (module) -> ``(path, state_dict)``
    ``ckpt_state_dict`` saved once per test module, in ``<tmp>/<module>N/ckpt``. Shared by
    the module's tests: read it, never change it.
``ckpt_path`` (module) -> ``Path``
    ``ckpt``'s directory alone.
``fresh_ckpt`` (function) -> ``(path, state_dict)``
    the same contents saved for one test alone, in ``tmp_path / "ckpt"``, for tests that
    damage the files; the state dict is the test's own copy.
``ckpt_state_dict`` (module) -> ``dict``
    what those hold: :func:`_ckpt.small_state_dict` unless the module overrides this
    fixture (module scope) with the state dict its tests are written against.

``storage`` (function) -> ``LocalStorage``
    over ``tmp_path``, 2 I/O threads (tests/storage/test_local_reads.py, test_mapped_copies.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest
from _ckpt import make_checkpoint, small_state_dict

from asyncload.storage import LocalStorage

try:  # the loopback servers' fixtures: s3_server, gcs_server, http_server
    from asyncload.testing.pytest_fixtures import *  # noqa: F403
except ImportError:  # pragma: no cover - only while asyncload.testing is being written
    pass


#: The clients a remote test runs with (``LoadOptions.transport``; "obstore" is deprecated and
#: reads as "auto" does, tests/storage/test_store_options.py).
TRANSPORTS = ["fsspec", "wire"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """``LoadOptions.transport`` for a remote test: each test runs once per client."""
    return str(request.param)


@pytest.fixture
def transport_options(
    request: pytest.FixtureRequest, transport: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The module's option constants (``TRANSPORT_OPTIONS``, default ``("OPTS",)``) with
    ``transport`` for this test (``pytestmark = pytest.mark.usefixtures("transport_options")``)."""
    for name in getattr(request.module, "TRANSPORT_OPTIONS", ("OPTS",)):
        monkeypatch.setattr(
            request.module, name, getattr(request.module, name).replace(transport=transport)
        )
    return transport


@pytest.fixture
def tmp_ckpt(tmp_path):
    """A fresh directory for one checkpoint."""
    d = tmp_path / "ckpt"
    return d


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    """The state dict that ``ckpt``, ``ckpt_path`` and ``fresh_ckpt`` hold (override per module)."""
    return small_state_dict()


@pytest.fixture(scope="module")
def ckpt(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    ckpt_state_dict: dict[str, Any],
) -> tuple[Path, dict[str, Any]]:
    """``(path, state_dict)``: ``ckpt_state_dict`` saved once for the test module (read only)."""
    stem = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    return make_checkpoint(
        tmp_path_factory.mktemp(stem) / "ckpt", ckpt_state_dict
    ), ckpt_state_dict


@pytest.fixture(scope="module")
def ckpt_path(ckpt: tuple[Path, dict[str, Any]]) -> Path:
    """The directory of ``ckpt``."""
    return ckpt[0]


@pytest.fixture
def fresh_ckpt(tmp_path: Path, ckpt_state_dict: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """``(path, state_dict)``: ``ckpt_state_dict`` saved for this test alone, which may damage it."""
    state_dict = copy.deepcopy(ckpt_state_dict)
    return make_checkpoint(tmp_path / "ckpt", state_dict), state_dict


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[LocalStorage]:
    """A LocalStorage over ``tmp_path`` with 2 I/O threads, closed afterwards."""
    ex = concurrent.futures.ThreadPoolExecutor(2)
    st = LocalStorage(str(tmp_path), ex)
    try:
        yield st
    finally:
        asyncio.run(st.aclose())
        ex.shutdown()
