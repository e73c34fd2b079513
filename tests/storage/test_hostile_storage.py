"""Hostile and misconfigured stores over real loopback servers: a server that ignores
``Range`` (detected after about the requested bytes, one attempt, a clear error), a
connection reset that the HTTP client would have re-sent unseen (counted in
``LoadStats.retries``), and a checkpoint whose names escape its directory with
percent-escapes (refused before the outside file is requested)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncload
from asyncload import CheckpointFormatError, LoadOptions, StorageReadError
from asyncload.common.stats import StatsRecorder
from asyncload.storage import FsspecStorage, RangeIgnoredError, RetryingStorage
from asyncload.testing import faults
from asyncload.testing.servers import HTTPRangeServer

pytestmark = pytest.mark.timeout(120)

BIG = 64 << 20  # the file a probe must not download


@pytest.fixture
def executor():
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-hostile-storage")
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture
def no_range_server(tmp_path):
    server = HTTPRangeServer(tmp_path / "root", ignore_range=True)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "ckpt").mkdir()
    (tmp_path / "root" / "ckpt" / "big.bin").write_bytes(bytes(range(256)) * (BIG // 256))
    server.start()
    yield server
    server.stop()


def _boundary(url: str, executor: Any, **opts: Any) -> tuple[RetryingStorage, StatsRecorder]:
    stats = StatsRecorder()
    options = LoadOptions(
        **{"retries": 3, "backoff": 0, "max_backoff": 0, "timeout": 30.0, "hedge": False, **opts}
    )
    raw = FsspecStorage(url, "http", {}, executor)
    return RetryingStorage.for_options(raw, options, stats, executor), stats


@pytest.mark.asyncio
@pytest.mark.parametrize("start", [1024, 0], ids=["mid-file", "from-0"])
async def test_a_server_that_ignores_range_fails_at_once_without_downloading_the_file(
    no_range_server, executor, start
):
    url = f"{no_range_server.endpoint_url}/ckpt"
    rs, stats = _boundary(url, executor)
    try:
        with pytest.raises(StorageReadError) as ei:
            await rs.read("big.bin", start, start + 4096)
    finally:
        await rs.aclose()
    err = ei.value
    assert type(err) is StorageReadError and type(err.__cause__) is RangeIgnoredError
    assert (err.path, err.byte_range, err.attempts, err.status) == (
        f"{url}/big.bin",
        (start, start + 4096),
        1,
        200,
    )
    assert str(err) == (
        f"reading {url}/big.bin bytes [{start}, {start + 4096}) failed after 1 attempt: the server ignores "
        f"Range requests (asked for bytes [{start}, {start + 4096}) of {url}/big.bin, got HTTP 200 with a "
        f"{BIG}-byte body: the server ignores Range requests); serve the checkpoint from a server that "
        "supports HTTP range requests"
    )
    assert stats.snapshot().retries == 0
    gets = _logged(no_range_server, "/big.bin")
    assert len(gets) == 1  # one attempt (the client saw the 200: err.status above)
    assert gets[0]["range"] == f"bytes={start}-{start + 4095}"
    # the client stopped reading: the server got only as far as the socket buffers took
    assert gets[0]["sent"] < BIG // 4, gets[0]


@pytest.mark.asyncio
async def test_a_reset_the_http_client_would_resend_is_counted(http_server, fault_proxy, executor):
    data = bytes(range(256)) * 64
    http_server.put_object("hostile", "ckpt/f.bin", data)
    proxy = fault_proxy(http_server)
    url = http_server.url("hostile", "ckpt", endpoint_url=proxy.endpoint_url)
    rs, stats = _boundary(url, executor)
    await _reset_once_between_two_reads(rs, stats, proxy, data)


async def _reset_once_between_two_reads(
    rs: RetryingStorage, stats: StatsRecorder, proxy: Any, data: bytes
) -> None:
    """Read once (a pooled connection), reset the next request once: the re-send is ours, counted."""
    try:
        assert bytes(await rs.read("f.bin", 0, 100)) == data[:100]
        proxy.add_rule(faults.reset(), times=1)
        assert bytes(await rs.read("f.bin", 100, 4000)) == data[100:4000]
    finally:
        await rs.aclose()
    s = stats.snapshot()
    assert (s.retries, s.retries_by_cause) == (1, {"connection": 1})
    assert proxy.faults_applied == 1
    assert [e.range for e in proxy.log if e.range is not None] == [
        "bytes=0-99",
        "bytes=100-3999",
        "bytes=100-3999",
    ]


def _logged(server: HTTPRangeServer, suffix: str) -> list[dict[str, Any]]:
    """The requests for ``suffix`` in the server's log; the server writes an entry when its
    handler ends, which for a client that left is just after the client saw the answer."""
    deadline = time.monotonic() + 30
    while True:
        found = [r for r in server.requests() if r["path"].endswith(suffix)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _save_dcp(path: Path) -> None:
    dcp.save({"w": torch.arange(16, dtype=torch.float32)}, checkpoint_id=str(path))


def test_percent_escaped_name_outside_the_checkpoint_is_never_requested(
    http_server, tmp_path, transport
):
    """A ``.metadata`` whose storage file name is ``%2e%2e/%2e%2e/other/__0_0.distcp`` (the
    same server serves a real ``other/__0_0.distcp`` there): refused, never fetched."""
    import pickle

    src = tmp_path / "src"
    _save_dcp(src)
    other = tmp_path / "other"
    _save_dcp(other)
    with open(src / ".metadata", "rb") as f:
        meta = pickle.load(f)
    evil = "%2e%2e/%2e%2e/other/__0_0.distcp"
    for info in meta.storage_data.values():
        info.relative_path = evil
    with open(src / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    http_server.upload_dir(src, "pct", "a/ckpt")
    http_server.upload_dir(other, "pct", "other")
    url = http_server.url("pct", "a/ckpt")
    before = len(http_server.requests())
    with pytest.raises(CheckpointFormatError) as ei:
        asyncload.load(
            {"w": torch.zeros(16)}, url, options=LoadOptions(retries=0, transport=transport)
        )
    assert "%2e%2e" in str(ei.value)
    seen = [r["path"] for r in http_server.requests()[before:]]
    assert seen and all("other" not in p and "%2e" not in p.lower() for p in seen), seen


@pytest.mark.parametrize(
    "evil",
    [
        "%2e%2e/%2e%2e/other/model.safetensors",
        "..%2f..%2fother/model.safetensors",
        "%2E%2E/%2E%2E/other/model.safetensors",
        "../../other/model.safetensors",
        "/pct/other/model.safetensors",
        "..\\..\\other\\model.safetensors",
        "http://127.0.0.1:1/other/model.safetensors",
        "model.safetensors%00.txt",
    ],
)
def test_a_safetensors_index_naming_a_file_outside_the_checkpoint_is_refused(
    http_server, tmp_path, evil, transport
):
    """The same through ``model.safetensors.index.json``'s ``weight_map`` (a real file of the
    same name is served where the name would lead): refused before anything of it is fetched."""
    from safetensors.torch import save_file

    src, other = tmp_path / "src", tmp_path / "other"
    src.mkdir()
    other.mkdir()
    save_file({"w": torch.arange(16, dtype=torch.float32)}, str(src / "model.safetensors"))
    save_file({"w": -torch.arange(16, dtype=torch.float32)}, str(other / "model.safetensors"))
    index = {"metadata": {"total_size": 64}, "weight_map": {"w": evil}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "model.safetensors").unlink()  # only the index names the data
    bucket = f"pct-st-{abs(hash(evil)) % 10**6}"
    http_server.upload_dir(src, bucket, "a/ckpt")
    http_server.upload_dir(other, bucket, "other")
    before = len(http_server.requests())
    dest = {"w": torch.zeros(16)}
    with pytest.raises(CheckpointFormatError) as ei:
        asyncload.load(
            dest,
            http_server.url(bucket, "a/ckpt"),
            options=LoadOptions(retries=0, transport=transport),
        )
    assert "model.safetensors" in str(ei.value)
    seen = [r["path"] for r in http_server.requests()[before:]]
    assert seen and all("/other" not in p and "%2e" not in p.lower() for p in seen), seen
    assert torch.equal(dest["w"], torch.zeros(16))


def test_request_log_is_json_lines(http_server):
    http_server.put_object("log", "x", b"abc")
    asyncio.run(_get(http_server.url("log", "x")))
    last = _logged(http_server, "/log/x")[-1]
    assert json.dumps(last)
    assert (last["method"], last["path"].endswith("/log/x"), last["sent"]) == ("GET", True, 3)


async def _get(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        await r.read()


@pytest.mark.asyncio
async def test_a_reset_the_s3_client_would_resend_is_counted(
    s3_server, fault_proxy, executor, bucket_name
):
    """The same over s3fs: aiobotocore's aiohttp session would re-send the GET on a fresh
    connection unseen; asyncload's policy re-sends it instead, and counts it."""
    data = bytes(range(256)) * 64
    s3_server.put_object(bucket_name, "ckpt/f.bin", data)
    proxy = fault_proxy(s3_server)
    stats = StatsRecorder()
    options = LoadOptions(retries=3, backoff=0, max_backoff=0, timeout=30.0, hedge=False)
    raw = FsspecStorage(
        f"s3://{bucket_name}/ckpt", "s3", s3_server.storage_options(proxy.endpoint_url), executor
    )
    rs = RetryingStorage.for_options(raw, options, stats, executor)
    await _reset_once_between_two_reads(rs, stats, proxy, data)
