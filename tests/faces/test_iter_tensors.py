"""iter_tensors / aiter_tensors: every tensor bit for bit, the memory bound (from the stats
and from the reads issued), back-pressure, and leaving early (break, close, cancel) with
nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt import (
    assert_bitwise_equal,
    asyncload_threads,
    iter_tensors,
    open_fds_under,
    random_tensor,
    thread_baseline,  # noqa: F401 - autouse fixture
)
from _corrupt import records as records_of

import asyncload
from asyncload import CheckpointFormatError, LoadOptions

pytestmark = pytest.mark.timeout(120)

BUDGET = 256 << 10
TENSOR = 64 << 10  # 16384 float32


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    """24 tensors of 64 KiB (six batches of two under a 256 KiB budget), one of 512 KiB, objects."""
    sd: dict[str, Any] = {
        f"t{i:02d}": random_tensor((128, 128), torch.float32, i) for i in range(24)
    }
    sd["nested"] = {
        "big": random_tensor((512, 256), torch.float32, 99),
        "small": random_tensor((5,), torch.int64, 7),
    }
    sd["step"] = 12
    return sd


class ReadLog(logging.Handler):
    """The bytes of every read request the pipeline issued (its DEBUG line per chunk)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.mu = threading.Lock()
        self.bytes = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("chunk ") and isinstance(record.args, tuple):
            with self.mu:
                self.bytes += int(record.args[3])


@pytest.fixture
def reads() -> Iterator[ReadLog]:
    handler = ReadLog()
    logger = logging.getLogger("asyncload.pipeline")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _stats(caplog: pytest.LogCaptureFixture) -> asyncload.LoadStats:
    found = [
        r.args[1]
        for r in caplog.records
        if r.name == "asyncload.stream" and isinstance(r.args, tuple)
    ]
    assert found, "no 'read ...' INFO line was logged"
    return found[-1]


def _nothing_left(path: Path) -> None:
    assert asyncload_threads() == []
    assert open_fds_under(path) == []


def test_batch_limits_start_small_and_double() -> None:
    """The first batches start at two chunks (or a sixteenth of the budget) and double up to
    half the budget; a budget whose half is below two chunks gives half-budget batches."""
    from asyncload.faces.streaming import batch_limits

    mib = 1 << 20
    got = batch_limits(32 * mib, mib)
    assert [next(got) for _ in range(6)] == [
        2 * mib,
        4 * mib,
        8 * mib,
        16 * mib,
        16 * mib,
        16 * mib,
    ]
    got = batch_limits(512 * mib, 16 * mib)
    assert [next(got) for _ in range(5)] == [32 * mib, 64 * mib, 128 * mib, 256 * mib, 256 * mib]
    got = batch_limits(BUDGET, 16 * mib)  # chunks larger than the budget: half of it throughout
    assert [next(got) for _ in range(3)] == [BUDGET // 2] * 3


def test_the_first_tensor_comes_from_a_small_first_batch(tmp_path: Path, reads: ReadLog) -> None:
    """16 tensors of 64 KiB under a 2 MiB budget in 64 KiB chunks: batches of 2, 4, 8 and 2
    tensors (a first batch of half the budget would hold all 16). A consumer that holds the
    first tensor has caused the reads of the first batch and of the two read ahead of it
    (two batches at once into CPU destinations), never of the fourth; every tensor arrives
    bit for bit, in file order."""
    import torch.distributed.checkpoint as dcp

    saved = {f"w{i:02d}": random_tensor((128, 128), torch.float32, 100 + i) for i in range(16)}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    opts = LoadOptions(memory_budget=2 << 20, chunk_size=TENSOR)
    from asyncload.faces.streaming import CheckpointStream

    stream = CheckpointStream(tmp_path, options=opts)
    try:
        asyncio.run(stream.aopen())
        assert [len(b) for b in stream.batches()] == [2, 4, 8, 2]
    finally:
        asyncio.run(stream.aclose())
    it = asyncload.iter_tensors(tmp_path, options=opts)
    name, first = next(it)
    time.sleep(0.3)  # the consumer holds the first tensor: batches 2 and 3 may be read
    # each record read whole: the tensor's bytes and torch.save's header (under 4 KiB)
    assert 2 * TENSOR <= reads.bytes <= 14 * (TENSOR + 4096)
    got = {name: first, **dict(it)}
    assert list(got) == list(saved)
    for k, v in saved.items():
        assert_bitwise_equal(got[k], v)


def test_every_tensor_bit_for_bit(
    ckpt: tuple[Path, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    path, saved = ckpt
    caplog.set_level(logging.INFO, logger="asyncload.stream")
    got = dict(asyncload.iter_tensors(path, options=LoadOptions(memory_budget=BUDGET)))
    want = dict(
        iter_tensors({k: v for k, v in saved.items() if k != "step"})
    )  # objects are not yielded
    assert_bitwise_equal(got, want)
    records = records_of(path)
    assert list(got) == sorted(
        got, key=lambda n: (records[n].file, records[n].offset)
    )  # file and offset order
    stats = _stats(caplog)
    big = saved["nested"]["big"].nbytes
    # the 512 KiB tensor was read and held alone; never more than the budget otherwise
    assert stats.peak_buffered_bytes == big
    assert stats.files == 2  # .metadata and the one data file, once across all batches
    _nothing_left(path)


def test_memory_bound_and_back_pressure(
    ckpt_path: Path, reads: ReadLog, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncload.stream")
    small = [f"t{i:02d}" for i in range(24)]
    it = asyncload.iter_tensors(ckpt_path, keys=small, options=LoadOptions(memory_budget=BUDGET))
    name, _first = next(it)
    assert name == "t00"
    time.sleep(0.3)  # a slow consumer: the stream must not read on while it holds the budget
    # batch 0 (two tensors) landed, batch 1 may be read ahead: within the budget, plus record headers
    assert 2 * TENSOR <= reads.bytes <= BUDGET + 4 * 2048
    names = [name] + [n for n, _ in it]
    assert names == small  # file and offset order
    stats = _stats(caplog)
    assert stats.peak_buffered_bytes <= BUDGET
    assert stats.bytes_assembled == 24 * TENSOR
    _nothing_left(ckpt_path)


def test_break_close_and_exceptions_stop_the_reads(ckpt_path: Path, reads: ReadLog) -> None:
    opts = LoadOptions(memory_budget=BUDGET)
    for _name, _t in asyncload.iter_tensors(ckpt_path, options=opts):
        break
    _nothing_left(ckpt_path)
    after_break = reads.bytes
    assert after_break <= BUDGET + 4 * 2048
    time.sleep(0.2)
    assert reads.bytes == after_break  # nothing reads on

    it = asyncload.iter_tensors(ckpt_path, options=opts)
    next(it)
    next(it)
    it.close()  # type: ignore[attr-defined]
    _nothing_left(ckpt_path)

    with pytest.raises(KeyError):
        for _name, _t in asyncload.iter_tensors(ckpt_path, options=opts):
            raise KeyError("the consumer failed")
    _nothing_left(ckpt_path)


def test_keys_meta_and_dtype(ckpt: tuple[Path, dict[str, Any]], reads: ReadLog) -> None:
    path, saved = ckpt
    got = dict(asyncload.iter_tensors(path, keys=["nested"], dtype=torch.float16))
    assert_bitwise_equal(
        got,
        {"nested.big": saved["nested"]["big"].half(), "nested.small": saved["nested"]["small"]},
    )
    before = reads.bytes
    meta = dict(asyncload.iter_tensors(path, keys=lambda n: n.startswith("t0"), device="meta"))
    assert reads.bytes == before  # no data read
    assert sorted(meta) == [f"t0{i}" for i in range(10)]
    assert all(t.device.type == "meta" and t.shape == (128, 128) for t in meta.values())


def test_async_bit_for_bit_and_aclose(ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, saved = ckpt

    async def main() -> tuple[dict[str, torch.Tensor], list[str]]:
        got = {
            n: t
            async for n, t in asyncload.aiter_tensors(
                path, options=LoadOptions(memory_budget=BUDGET)
            )
        }
        seen = []
        async with contextlib.aclosing(
            asyncload.aiter_tensors(path, options=LoadOptions(memory_budget=BUDGET))
        ) as it:
            async for n, _ in it:
                seen.append(n)
                if len(seen) == 3:
                    break
        return got, seen

    got, seen = asyncio.run(main())
    assert_bitwise_equal(got, dict(iter_tensors({k: v for k, v in saved.items() if k != "step"})))
    assert seen == ["t00", "t01", "t02"]
    _nothing_left(path)


def test_cancelling_the_consumer_stops_the_reads(ckpt_path: Path, reads: ReadLog) -> None:
    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in asyncload.aiter_tensors(
                ckpt_path, options=LoadOptions(memory_budget=BUDGET)
            ):
                first.set()
                await asyncio.sleep(3600)  # a consumer stuck on its first tensor

        task = asyncio.ensure_future(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _nothing_left(ckpt_path)
    after = reads.bytes
    assert after <= BUDGET + 4 * 2048
    time.sleep(0.2)
    assert reads.bytes == after


def test_damage_is_found_before_the_first_tensor(
    fresh_ckpt: tuple[Path, dict[str, Any]], reads: ReadLog
) -> None:
    path, _ = fresh_ckpt
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size - 100)
    it = asyncload.iter_tensors(path)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        next(it)
    assert reads.bytes == 0
    _nothing_left(path)


def test_remote_stream_over_s3(
    ckpt: tuple[Path, dict[str, Any]], s3_server: Any, bucket_name: str
) -> None:
    path, saved = ckpt
    url = s3_server.upload_dir(path, bucket_name, "run/it")
    got = dict(
        asyncload.iter_tensors(
            url,
            keys=["t1*", "nested.small"],
            options=LoadOptions(memory_budget=BUDGET),
            storage_options=s3_server.storage_options(),
        )
    )
    want = {f"t1{i}": saved[f"t1{i}"] for i in range(10)} | {
        "nested.small": saved["nested"]["small"]
    }
    assert_bitwise_equal(got, want)


_RSS_CHILD = """
import gc, json, sys
import asyncload

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

opts = asyncload.LoadOptions(memory_budget=int(sys.argv[2]))
for _ in asyncload.iter_tensors(sys.argv[1], options=opts):  # warm-up: page cache, threads, imports
    pass
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the current RSS
base = status("VmRSS:")
n = 0
for _name, tensor in asyncload.iter_tensors(sys.argv[1], options=opts):
    n += tensor.nbytes
    del tensor  # a consumer that keeps nothing
print(json.dumps({"peak_above_start": status("VmHWM:") - base, "bytes": n}))
"""


@pytest.mark.timeout(180)
def test_rss_stays_within_the_budget(tmp_path: Path) -> None:
    """Tensors handed over are freed when the consumer drops them: the process's peak RSS
    while streaming 96 MiB under a 32 MiB budget stays within the budget (nothing retained
    until a later garbage collection; it was all 96 MiB before the stream collected the
    planner's young reference cycles). glibc is told to map every tensor on its own, so
    that freed memory leaves the process and RSS counts live bytes only."""
    import json
    import subprocess
    import sys

    from _ckpt import make_checkpoint

    path = make_checkpoint(
        tmp_path / "big", {f"t{i:02d}": torch.full((2048, 1024), float(i)) for i in range(12)}
    )
    budget = 32 << 20
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(path), str(budget)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bytes"] == 12 * 8 << 20
    assert out["peak_above_start"] <= budget + (4 << 20), out


@pytest.mark.timeout(120)
def test_an_iterator_left_open_does_not_hang_the_exit(ckpt_path: Path) -> None:
    """A script that takes one tensor and exits without closing the iterator ends at once."""
    import subprocess
    import sys

    code = (
        "import asyncload\n"
        f"it = asyncload.iter_tensors({str(ckpt_path)!r}, options=asyncload.LoadOptions(memory_budget=256 << 10))\n"
        "print(next(it)[0])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "t00", res.stderr


_BIG_CHILD = """
import gc, json, sys
import asyncload

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

opts = asyncload.LoadOptions(memory_budget=int(sys.argv[2]))
keep = sys.argv[3] == "keep"
for _ in asyncload.iter_tensors(sys.argv[1], options=opts):  # warm-up: page cache, threads, imports
    pass
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the current RSS
base = status("VmRSS:")
n = 0
for _name, tensor in asyncload.iter_tensors(sys.argv[1], options=opts):
    n += tensor.nbytes
    if not keep:
        del tensor  # the loop holds nothing while the next tensor is read
print(json.dumps({"peak_above_start": status("VmHWM:") - base, "bytes": n}))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("consumer", ["drops", "keep"])
def test_tensors_over_the_budget_are_held_one_at_a_time(tmp_path: Path, consumer: str) -> None:
    """Issue 25, 3(d): tensors of 24 MiB under an 8 MiB budget. The next is read only when
    the loop asks for it: a loop that drops each tensor peaks at one tensor (it was two:
    the next was read while the loop held the current); a loop whose variable still holds
    the previous tensor while the next is read peaks at two, as iter_tensors documents."""
    import json
    import subprocess
    import sys

    from _ckpt import make_checkpoint

    tensor = 24 << 20
    path = make_checkpoint(
        tmp_path / "big", {f"t{i}": torch.full((tensor // 4,), float(i)) for i in range(4)}
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", _BIG_CHILD, str(path), str(8 << 20), consumer],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bytes"] == 4 * tensor
    held = 1 if consumer == "drops" else 2
    assert (held - 1) * tensor < out["peak_above_start"] <= held * tensor + (4 << 20), out
