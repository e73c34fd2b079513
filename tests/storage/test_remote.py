"""Checkpoints written by torch's ``dcp.save``, uploaded to real S3 (moto), GCS
(fake-gcs-server) and HTTP Range servers on loopback, loaded bit for bit with
``asyncload.load("s3://..." / "gs://..." / "http://...")``; errors that retrying cannot
fix fail fast; sessions and connections are closed afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, zeros_like_tree
from _remote import BACKENDS, make_remote, no_unclosed_session_warnings, wait_closed

import asyncload
from asyncload import CheckpointNotFoundError, LoadOptions, StorageReadError
from asyncload.testing import status

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("transport_options")]

OPTS = LoadOptions(
    chunk_size=128 << 10, min_chunk_size=16 << 10, timeout=5, retries=2, backoff=0.05
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_bit_exact_and_everything_closed(request, backend, ckpt, bucket_name, fault_proxy):
    path, sd = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy, latency=0.002)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with no_unclosed_session_warnings():
        stats = asyncload.load(dst, r.url, options=OPTS, storage_options=r.storage_options)
    assert_bitwise_equal(dst, sd)
    assert stats.retries == 0 and stats.timeouts == 0
    assert stats.chunks >= 8  # several ranged reads per record at 128 KiB chunks
    assert r.proxy.requests_seen >= stats.chunks
    assert wait_closed(r.proxy.port) == []  # the session and its pooled connections are closed


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_load_with_pipelined_reader(
    request, backend, ckpt, bucket_name, fault_proxy, transport
):
    path, sd = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with no_unclosed_session_warnings():
        dcp.load(
            dst,
            storage_reader=asyncload.PipelinedReader(
                r.url, storage_options=r.storage_options, options=LoadOptions(transport=transport)
            ),
            planner=asyncload.PipelinedLoadPlanner(
                chunk_size=64 << 10,
                min_chunk_size=8 << 10,
                timeout=5,
                options=LoadOptions(transport=transport),
            ),
            no_dist=True,
        )
    assert_bitwise_equal(dst, sd)
    assert wait_closed(r.proxy.port) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_aload_auto_concurrency_leaves_no_task(
    request, backend, ckpt, bucket_name, fault_proxy
):
    path, sd = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy, latency=0.002)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with no_unclosed_session_warnings():
        stats = await asyncload.aload(
            dst, r.url, options=OPTS.replace(concurrency="auto"), storage_options=r.storage_options
        )
    assert_bitwise_equal(dst, sd)
    assert 1 <= stats.peak_concurrency <= OPTS.replace(concurrency="auto").max_in_flight
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert await asyncio.to_thread(wait_closed, r.proxy.port) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_checkpoint_fails_fast(request, backend, ckpt, bucket_name, fault_proxy):
    path, _ = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    url = r.url.rstrip("/") + "-does-not-exist"
    t0 = time.monotonic()
    with pytest.raises(CheckpointNotFoundError) as ei:
        asyncload.load({}, url, options=OPTS, storage_options=r.storage_options)
    assert time.monotonic() - t0 < 3.0
    assert "-does-not-exist" in str(ei.value)
    assert wait_closed(r.proxy.port) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_data_file_fails_fast_naming_it(
    request, backend, ckpt, bucket_name, fault_proxy, tmp_path
):
    import shutil

    path, sd = ckpt
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    victim = sorted(p.name for p in broken.glob("*.distcp"))[0]
    (broken / victim).unlink()
    r = make_remote(request, backend, broken, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(CheckpointNotFoundError) as ei:
        asyncload.load(dst, r.url, options=OPTS, storage_options=r.storage_options)
    assert victim in str(ei.value)
    assert [
        e for e in r.proxy.log if victim in e.path and e.range is not None
    ] == []  # no data read tried
    assert wait_closed(r.proxy.port) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("code", [403, 404])
def test_denied_or_vanished_object_fails_fast_without_retries(
    request, backend, code, ckpt, bucket_name, fault_proxy
):
    path, sd = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    rule = r.proxy.add_rule(status(code), data_only=True, path=".distcp", times=None)
    dst = zeros_like_tree(sd, object_placeholder=None)
    t0 = time.monotonic()
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(
            dst,
            r.url,
            options=OPTS.replace(retries=5, backoff=1.0),
            storage_options=r.storage_options,
        )
    assert time.monotonic() - t0 < 3.0  # five retries with 1 s backoff would take longer
    err = ei.value
    assert isinstance(err, CheckpointNotFoundError) == (code == 404)
    assert err.attempts == 1 and ".distcp" in err.path and err.byte_range is not None
    assert f"{err.byte_range[0]}, {err.byte_range[1]})" in str(err)
    assert (
        1 <= rule.fired <= OPTS.max_in_flight
    )  # reads already in flight may each see it once, none twice
    assert wait_closed(r.proxy.port) == []
