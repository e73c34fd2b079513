"""A remote object rewritten during a load (issue 11, item 7): each object is pinned to the
version first seen (S3 ETag, GCS generation, HTTP ETag / Last-Modified), every ranged read
is conditional on it (``If-Match``, ``ifGenerationMatch``) and every answer is compared, so
a change mid-load ends in :class:`CheckpointChangedError` naming the object, never in a mix
of two saves reported as success.

The object is replaced from the load's own progress callback after the first chunk landed,
with one read in flight at a time: the rest of the reads must meet the new version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _remote import BACKENDS, make_remote

import asyncload
from asyncload import CheckpointChangedError, CheckpointFormatError, LoadOptions

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
    pytest.mark.usefixtures("transport_options"),
]
TRANSPORT_OPTIONS = ("SLOW",)

N = 256 << 10  # float32 elements: 1 MiB of data, 16 chunks of 64 KiB
SLOW = LoadOptions(
    chunk_size=64 << 10, min_chunk_size=64 << 10, concurrency=1, hedge=False, retries=2, backoff=0
)


def _save_two(tmp_path: Path) -> tuple[Path, Path, str]:
    """Two saves of the same layout with different values; the name of their data file."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    dcp.save({"w": torch.arange(N, dtype=torch.float32)}, checkpoint_id=v1, no_dist=True)
    dcp.save({"w": -torch.arange(N, dtype=torch.float32)}, checkpoint_id=v2, no_dist=True)
    (name,) = [p.name for p in v1.iterdir() if p.suffix == ".distcp"]
    assert (v1 / name).stat().st_size == (v2 / name).stat().st_size
    return v1, v2, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_object_rewritten_mid_load_is_a_clear_error(
    request, backend, tmp_path, bucket_name, fault_proxy
):
    v1, v2, name = _save_two(tmp_path)
    remote = make_remote(request, backend, v1, bucket_name, fault_proxy)
    replaced: list[int] = []

    def progress(done: int, total: int) -> None:
        if not replaced:
            replaced.append(done)
            remote.server.put_object(bucket_name, f"ckpt/{name}", (v2 / name).read_bytes())

    dest = {"w": torch.zeros(N)}
    with pytest.raises(CheckpointChangedError) as ei:
        asyncload.load(
            dest,
            remote.url,
            storage_options=remote.storage_options,
            options=SLOW,
            progress=progress,
        )
    err = ei.value
    assert replaced, "the object was never replaced: the test did not run its case"
    assert isinstance(err, CheckpointFormatError)  # what callers of older versions catch
    assert err.path.endswith(f"ckpt/{name}") and name in str(err)
    assert (
        err.byte_range is not None and 0 < err.byte_range[1] - err.byte_range[0] <= 64 << 10
    )  # one chunk
    assert err.seen and err.seen.split()[0] in {"etag", "generation"}
    assert "load again" in str(err)
    # the pinned version went with every read: the store refused, or its answer was compared
    assert err.now is None or err.now != err.seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unchanged_object_loads_bit_exactly_with_the_version_pinned(
    request, backend, tmp_path, bucket_name, fault_proxy
):
    v1, _, name = _save_two(tmp_path)
    remote = make_remote(request, backend, v1, bucket_name, fault_proxy)
    before = len(remote.server.requests()) if backend == "http" else 0
    dest = {"w": torch.zeros(N)}
    stats = asyncload.load(dest, remote.url, storage_options=remote.storage_options, options=SLOW)
    assert torch.equal(dest["w"], torch.arange(N, dtype=torch.float32))
    assert stats.retries == 0
    if backend == "http":  # every data read carried the ETag the HEAD reported
        data = [
            r
            for r in remote.server.requests()[before:]
            if r["path"].endswith(name) and r["method"] == "GET"
        ]
        assert len(data) >= 16  # the 16 chunks, and the record probes
        assert all(r["if_match"] and r["if_match"].startswith('"') for r in data)
        assert all(r["status"] == 206 for r in data)


def test_http_precondition_refusal_is_not_retried(http_server, tmp_path, fault_proxy):
    """The server answers 412 to the reads after the rewrite: one attempt each, no retry."""
    v1, v2, name = _save_two(tmp_path)
    http_server.upload_dir(v1, "changed412", "ckpt")
    target = http_server.root / "changed412" / "ckpt" / name
    url = http_server.url("changed412", "ckpt")
    before = len(http_server.requests())
    replaced: list[int] = []

    def progress(done: int, total: int) -> None:
        if not replaced:
            replaced.append(done)
            target.unlink()  # a new file, not a write into the uploaded one's inode
            target.write_bytes((v2 / name).read_bytes())

    with pytest.raises(CheckpointChangedError) as ei:
        asyncload.load({"w": torch.zeros(N)}, url, options=SLOW, progress=progress)
    assert ei.value.now is None or ei.value.now != ei.value.seen
    refused = [r for r in http_server.requests()[before:] if r["status"] == 412]
    assert len(refused) == 1, refused  # the first refusal ends the load: no retry of it
    assert refused[0]["range"] is not None


def test_local_rewrite_is_the_same_error_class(tmp_path):
    v1, v2, name = _save_two(tmp_path)
    replaced: list[int] = []

    def progress(done: int, total: int) -> None:
        if not replaced:
            replaced.append(done)
            (v1 / name).unlink()
            (v1 / name).write_bytes((v2 / name).read_bytes())

    with pytest.raises(CheckpointChangedError) as ei:
        asyncload.load({"w": torch.zeros(N)}, v1, options=SLOW, progress=progress)
    assert ei.value.path.endswith(name)
