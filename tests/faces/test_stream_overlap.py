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
