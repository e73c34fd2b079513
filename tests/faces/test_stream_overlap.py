"""CheckpointStream reads batch k + 1 while batch k is still reading (issue 45 item 2): the
link does not idle between two batches, the tensors come out bit for bit and in order, and
the memory stays within ``memory_budget``. Shown by the requests a FaultProxy saw, not by time."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asyncload import LoadOptions
from asyncload.faces.streaming import CheckpointStream

KiB = 1024
TENSOR = 64 * KiB  # 16384 float32
BUDGET = 256 * KiB  # batches of 128 KiB: two tensors each
COUNT = 12  # six batches


def _saved() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(45)
    return {f"w{i:02d}": torch.randn(TENSOR // 4, generator=g) for i in range(COUNT)}


@pytest.fixture(scope="module")
def model_url(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> str:
    root: Path = tmp_path_factory.mktemp("overlap")
    save_file(_saved(), str(root / "model.safetensors"))
    bucket = "overlap-bucket"
    return str(s3_server.upload_dir(root, bucket, "m"))


def _starts(proxy: Any) -> list[int]:
    """The first byte of each ranged request the proxy has seen, in the order sent."""
    out = []
    for entry in proxy.log:
        m = re.match(r"bytes=(\d+)-", entry.range or "")
        if m:
            out.append(int(m.group(1)))
    return out


async def _until(pred: Callable[[], bool]) -> bool:
    """A guard, not a clock: ``pred`` became true (False if it never did)."""
    for _ in range(4000):
        if pred():
            return True
        await asyncio.sleep(0.005)
    return pred()


async def _stream(url: str, storage_options: dict[str, Any], proxy: Any) -> dict[str, Any]:
    stream = CheckpointStream(
        url, options=LoadOptions(memory_budget=BUDGET), storage_options=storage_options
    )
    got: dict[str, torch.Tensor] = {}
    landed_before_next: list[bool] = []
    try:
        await stream.aopen()
        batches = stream.batches()
        assert [len(b) for b in batches] == [2] * (COUNT // 2)
        of_batch = {fqn: k for k, b in enumerate(batches) for fqn in b}
        # each batch's bytes in the file: [first, end)
        spans = []
        for b in batches:
            offsets = [stream._where(f)[1] for f in b]
            spans.append((min(offsets), max(offsets) + TENSOR))
        real = stream.session.aread

        async def aread(records: Any, *args: Any, **kwargs: Any) -> None:
            fqns = {item.dest_index.fqn for r in records for item, _ in r.tensor_items}
            (k,) = {of_batch[f] for f in fqns}
            await real(records, *args, **kwargs)
            if k + 1 < len(batches):
                # batch k lands only once the next batch's first request has been sent: a
                # stream that reads one batch at a time never gets here (the guard gives up)
                lo, hi = spans[k + 1]
                landed_before_next.append(
                    await _until(lambda: any(lo <= s < hi for s in _starts(proxy)))
                )

        stream.session.aread = aread  # type: ignore[method-assign]
        async with contextlib.aclosing(stream.abatches()) as tensors:
            async for name, tensor in tensors:
                got[name] = tensor.clone()
                del tensor
        stats = stream.finish()
    finally:
        await stream.aclose()
    return {"got": got, "landed": landed_before_next, "stats": stats, "stream": stream}


def test_batches_overlap_within_the_budget(
    model_url: str, s3_server: Any, fault_proxy: Any
) -> None:
    proxy = fault_proxy(s3_server)
    out = asyncio.run(_stream(model_url, s3_server.storage_options(proxy.endpoint_url), proxy))
    saved = _saved()
    got = out["got"]
    assert list(got) == sorted(saved)  # file order, every tensor
    for name, want in saved.items():
        assert torch.equal(got[name].view(torch.int32), want.view(torch.int32)), name
    # every batch's successor sent its first request before the batch landed
    assert out["landed"] == [True] * (COUNT // 2 - 1)
    stream = out["stream"]
    assert stream.read_ahead() == 2
    assert stream.overlaps[0] == 0 and all(n >= 1 for n in stream.overlaps[1:])
    stats = out["stats"]
    assert stats.bytes_assembled == COUNT * TENSOR
    assert stream.peak_held_bytes <= BUDGET
    assert stats.peak_buffered_bytes <= BUDGET
    assert stats.peak_concurrency <= LoadOptions().max_in_flight  # one limit for both


def test_one_batch_at_a_time_where_it_cannot_overlap() -> None:
    assert CheckpointStream("x", options=LoadOptions(concurrency="auto")).read_ahead() == 1
    assert CheckpointStream("x", device="meta").read_ahead() == 1
    assert CheckpointStream("x", progress=lambda done, total: None).read_ahead() == 1
    assert CheckpointStream("x").read_ahead() == 2


async def _until_error(
    url: str, storage_options: dict[str, Any], proxy: Any
) -> tuple[dict[str, torch.Tensor], BaseException | None, CheckpointStream]:
    """Take the first tensor, then make every later data request fail for good (403): the
    batches read ahead meanwhile may have landed, the later ones fail."""
    from asyncload.testing import status

    stream = CheckpointStream(
        url,
        options=LoadOptions(memory_budget=BUDGET, retries=1, backoff=0.01),
        storage_options=storage_options,
    )
    got: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        await stream.aopen()
        async with contextlib.aclosing(stream.abatches()) as tensors:
            try:
                async for name, tensor in tensors:
                    if not got:
                        proxy.add_rule(status(403), range_only=True, times=None)
                    got[name] = tensor.clone()
                    del tensor
            except Exception as exc:
                error = exc
        assert not stream._pending  # every batch read ahead has stopped
    finally:
        await stream.aclose()
    return got, error, stream


def test_a_batch_read_ahead_that_fails_raises_after_the_tensors_before_it(
    model_url: str, s3_server: Any, fault_proxy: Any
) -> None:
    from asyncload import StorageReadError

    proxy = fault_proxy(s3_server)
    got, error, stream = asyncio.run(
        _until_error(model_url, s3_server.storage_options(proxy.endpoint_url), proxy)
    )
    saved = _saved()
    # the tensors that came out are a prefix of the file's, each bit for bit
    assert list(got) == sorted(saved)[: len(got)]
    assert 1 <= len(got) < COUNT
    for name, tensor in got.items():
        assert torch.equal(tensor.view(torch.int32), saved[name].view(torch.int32)), name
    # the failed batch's error, typed and naming the file and the answer
    assert isinstance(error, StorageReadError), repr(error)
    assert "model.safetensors" in str(error) and "403" in str(error)
    # the batches after the error never started: at most two were being read at once
    started = len(stream.overlaps)
    assert started <= -(-len(got) // 2) + 2


def test_closing_a_stream_while_a_batch_read_ahead_stalls_stops_it(
    model_url: str, s3_server: Any, fault_proxy: Any
) -> None:
    """The consumer takes the first batch, then every later data request stalls at the proxy
    (for good): the batch read ahead after it is stuck on the wire when the consumer stops.
    Closing the stream cancels it and returns (a guard of 20 s against a hang, not a
    clock); nothing is left running, and what came out is bit for bit."""
    from asyncload.testing import stall

    proxy = fault_proxy(s3_server)

    async def run() -> tuple[dict[str, torch.Tensor], CheckpointStream]:
        stream = CheckpointStream(
            model_url,
            options=LoadOptions(memory_budget=BUDGET),
            storage_options=s3_server.storage_options(proxy.endpoint_url),
        )
        got: dict[str, torch.Tensor] = {}
        try:
            await stream.aopen()
            async with contextlib.aclosing(stream.abatches()) as tensors:
                async for name, tensor in tensors:
                    got[name] = tensor.clone()
                    del tensor
                    if len(got) == 2:  # the first batch taken: what is read next stalls
                        # (once the second batch, read ahead from the start, has landed)
                        assert await _until(
                            lambda: bool(stream._pending) and stream._pending[0].done()
                        )
                        proxy.add_rule(stall(), range_only=True, times=None)
                    if len(got) == 3:
                        # a batch after the second has started, and its requests stall
                        assert await _until(lambda: proxy.faults_applied >= 1)
                        break
        finally:
            await asyncio.wait_for(stream.aclose(), 20)
        return got, stream

    got, stream = asyncio.run(run())
    assert not stream._pending
    assert len(stream.overlaps) >= 3
    saved = _saved()
    assert list(got) == sorted(saved)[:3]
    for name, tensor in got.items():
        assert torch.equal(tensor.view(torch.int32), saved[name].view(torch.int32)), name
