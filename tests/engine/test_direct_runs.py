"""Runs of large local reads straight into destinations (``RetryingStorage.readinto_shared``,
``Pipeline._run_direct``): several I/O threads pull the reads of one file from one queue.

What must hold, whatever the threads' order: every read lands exactly once (bytes, counts
and ``landed`` callbacks), across retries and after a timed-out attempt's thread finishes
late; a failed attempt's next one reads only what has not landed; an error names the read
that failed (a timeout: the reads in flight); each landing is progress for the timeout; an
error from ``landed`` (a progress callback) is raised as it is, not retried; a cancelled run
stops its threads after their current read. Then loads through runs, bit for bit, with the
last reads cut small and with one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal

import asyncload
from asyncload import ChunkTimeoutError, LoadOptions, StorageReadError
from asyncload.common.stats import StatsRecorder
from asyncload.storage import RetryingStorage, Storage

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]

DATA = os.urandom(1 << 20)
ROOT = "scripted://bucket/run"
OPTS = LoadOptions(retries=3, backoff=0, max_backoff=0, timeout=10.0, hedge=False)


class Store(Storage):
    """Reads ``DATA``; ``fail(start, call)`` is called before every read (the read's start,
    how many reads of that start came before it) and may raise or sleep."""

    supports_readinto = True

    def __init__(self, fail: Callable[[int, int], None] | None = None) -> None:
        super().__init__(ROOT)
        self.fail = fail
        self.calls: Counter[int] = Counter()
        self.lock = threading.Lock()

    def readinto_sync(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        with self.lock:
            n = self.calls[start]
            self.calls[start] += 1
        if self.fail is not None:
            self.fail(start, n)
        pos = start
        for b in buffers:
            b[:] = DATA[pos : pos + len(b)]
            pos += len(b)


@pytest.fixture
def executor():
    pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="test-runs")
    yield pool
    pool.shutdown(wait=True)


def _reads(
    n: int, size: int = 4096, names: str = "f"
) -> tuple[list[tuple[str, int, list[memoryview]]], bytearray]:
    """``n`` reads of ``size`` bytes (each into two buffers) covering ``DATA[: n * size]``,
    of the files ``names`` in turn (each file holds ``DATA``)."""
    dest = bytearray(n * size)
    mv = memoryview(dest)
    half = size // 3
    return [
        (
            names[i % len(names)],
            i * size,
            [mv[i * size : i * size + half], mv[i * size + half : (i + 1) * size]],
        )
        for i in range(n)
    ], dest


def _eio_once(starts: set[int], pause: float = 0.0) -> Callable[[int, int], None]:
    """A ``Store.fail`` that fails the first read of each of ``starts`` with EIO (every read
    paused ``pause`` seconds first)."""

    def fail(start: int, n: int) -> None:
        if pause:
            time.sleep(pause)
        if start in starts and n == 0:
            raise OSError(errno.EIO, "Input/output error")

    return fail


def _boundary(store: Storage, executor, **changes) -> tuple[RetryingStorage, StatsRecorder]:
    stats = StatsRecorder()
    return RetryingStorage.for_options(store, OPTS.replace(**changes), stats, executor), stats


@pytest.mark.asyncio
@pytest.mark.parametrize("jobs", [1, 2, 3])
async def test_every_read_lands_once_bit_exact(executor, jobs):
    reads, dest = _reads(40)
    landed: Counter[int] = Counter()
    store = Store()
    rs, stats = _boundary(store, executor)
    await rs.readinto_shared(reads, jobs=jobs, landed=lambda i, _s: landed.update([i]))
    assert bytes(dest) == DATA[: len(dest)]
    assert landed == Counter(range(40)) and store.calls == Counter(start for _, start, _ in reads)
    s = stats.snapshot()
    assert (s.bytes_read, s.retries) == (len(dest), 0)


@pytest.mark.asyncio
async def test_a_failed_attempt_is_followed_by_one_that_reads_only_what_has_not_landed(executor):
    reads, dest = _reads(12)
    bad = 7 * 4096
    landed: Counter[int] = Counter()
    store = Store(_eio_once({bad}))
    rs, stats = _boundary(store, executor)
    await rs.readinto_shared(reads, jobs=1, landed=lambda i, _s: landed.update([i]))
    assert bytes(dest) == DATA[: len(dest)]
    # reads 0-6 landed in the first attempt; the second read 7 (again) and 8-11 only
    assert store.calls == Counter({**{s: 1 for _, s, _ in reads}, bad: 2})
    assert landed == Counter(range(12))
    s = stats.snapshot()
    assert (s.retries, s.retries_by_cause, s.bytes_read) == (1, {"io_error": 1}, len(dest))


@pytest.mark.asyncio
async def test_with_several_threads_a_retry_still_lands_every_read_once(executor):
    reads, dest = _reads(60)
    failing = {5 * 4096, 20 * 4096, 41 * 4096}
    landed: Counter[int] = Counter()
    store = Store(_eio_once(failing, pause=0.001))
    rs, stats = _boundary(store, executor)
    await rs.readinto_shared(reads, jobs=3, landed=lambda i, _s: landed.update([i]))
    assert bytes(dest) == DATA[: len(dest)]
    assert landed == Counter(range(60))
    assert all(store.calls[s] >= 1 for _, s, _ in reads) and all(
        store.calls[s] == 2 for s in failing
    )
    assert stats.snapshot().bytes_read == len(dest)


@pytest.mark.asyncio
async def test_the_error_names_the_read_that_failed_after_every_attempt(executor):
    reads, _ = _reads(10)

    def fail(start: int, n: int) -> None:
        if start == 6 * 4096:
            raise OSError(errno.EIO, "Input/output error")

    store = Store(fail)
    rs, stats = _boundary(store, executor, retries=2)
    with pytest.raises(StorageReadError) as ei:
        await rs.readinto_shared(reads, jobs=2)
    err = ei.value
    assert (err.path, err.byte_range, err.attempts) == (f"{ROOT}/f", (6 * 4096, 7 * 4096), 3)
    assert str(err).startswith(
        f"reading {ROOT}/f bytes [{6 * 4096}, {7 * 4096}) failed after 3 attempts"
    )
    assert store.calls[6 * 4096] == 3
    assert stats.snapshot().bytes_read == 0  # a call that failed counts nothing


@pytest.mark.asyncio
async def test_a_run_over_several_files_names_the_file_of_the_read_that_failed(executor):
    reads, dest = _reads(12, names="fgh")  # files f, g, h in turn
    bad = 7 * 4096  # read 7: file g

    def fail(start: int, n: int) -> None:
        if start == bad:
            raise OSError(errno.EIO, "Input/output error")

    rs, stats = _boundary(Store(fail), executor, retries=1)
    with pytest.raises(StorageReadError) as ei:
        await rs.readinto_shared(reads, jobs=2)
    assert (ei.value.path, ei.value.byte_range, ei.value.attempts) == (
        f"{ROOT}/g",
        (bad, bad + 4096),
        2,
    )
    # and without the failure, every file's reads land where they belong
    reads, dest = _reads(12, names="fgh")
    rs, stats = _boundary(Store(), executor)
    await rs.readinto_shared(reads, jobs=3)
    assert bytes(dest) == DATA[: len(dest)] and stats.snapshot().bytes_read == len(dest)


@pytest.mark.asyncio
async def test_reads_that_keep_landing_do_not_time_out_however_long_the_run(executor):
    reads, dest = _reads(12)
    store = Store(lambda _start, _n: time.sleep(0.03))
    rs, stats = _boundary(store, executor, timeout=0.1, retries=0)
    t0 = time.monotonic()
    await rs.readinto_shared(reads, jobs=1)  # 12 x 0.03 s: longer than the timeout
    assert time.monotonic() - t0 > 0.3
    assert bytes(dest) == DATA[: len(dest)]
    s = stats.snapshot()
    assert (s.timeouts, s.retries) == (0, 0)
    assert s.latency_p50 >= 0.03  # each read's own latency, not the run's


@pytest.mark.asyncio
async def test_a_stalled_read_times_out_and_its_late_landing_is_not_counted_twice(executor):
    reads, dest = _reads(8)
    stalled = 3 * 4096
    released = threading.Event()

    def fail(start: int, n: int) -> None:
        if start == stalled and n == 0:
            time.sleep(0.5)  # the first attempt's thread finishes long after the timeout
            released.set()

    landed: Counter[int] = Counter()
    store = Store(fail)
    rs, stats = _boundary(store, executor, timeout=0.1, retries=1)
    await rs.readinto_shared(reads, jobs=1, landed=lambda i, _s: landed.update([i]))
    assert bytes(dest) == DATA[: len(dest)]
    assert await asyncio.to_thread(released.wait, 5)
    await asyncio.sleep(0.05)  # the stale thread has returned by now
    assert landed == Counter(range(8)) and store.calls[stalled] == 2
    s = stats.snapshot()
    assert (s.timeouts, s.retries_by_cause, s.bytes_read) == (1, {"timeout": 1}, len(dest))


@pytest.mark.asyncio
async def test_a_read_that_never_returns_names_the_reads_in_flight(executor):
    reads, _ = _reads(6)
    stuck = threading.Event()

    def fail(start: int, _n: int) -> None:
        if start == 2 * 4096:
            stuck.wait(5)

    store = Store(fail)
    rs, _ = _boundary(store, executor, timeout=0.1, retries=1)
    try:
        with pytest.raises(ChunkTimeoutError) as ei:
            await rs.readinto_shared(reads, jobs=1)
        assert (ei.value.byte_range, ei.value.attempts) == ((2 * 4096, 3 * 4096), 2)
    finally:
        stuck.set()


@pytest.mark.asyncio
async def test_an_error_from_landed_is_raised_as_it_is_and_not_retried(executor):
    reads, _ = _reads(30)

    class Stop(Exception):
        pass

    def landed(i: int, _s: float) -> None:
        if i == 4:
            raise Stop("from a progress callback")

    store = Store(lambda _start, _n: time.sleep(0.001))
    rs, stats = _boundary(store, executor)
    with pytest.raises(Stop):
        await rs.readinto_shared(reads, jobs=2, landed=landed)
    assert (
        sum(store.calls.values()) < 30 and max(store.calls.values()) == 1
    )  # stopped, nothing retried
    assert stats.snapshot().retries == 0


@pytest.mark.asyncio
async def test_a_cancelled_run_stops_its_threads_after_their_current_read(executor):
    reads, _ = _reads(200)
    started = threading.Event()

    def fail(_start: int, _n: int) -> None:
        started.set()
        time.sleep(0.005)

    store = Store(fail)
    rs, _ = _boundary(store, executor)
    task = asyncio.create_task(rs.readinto_shared(reads, jobs=2))
    assert await asyncio.to_thread(started.wait, 5)
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    at_cancel = sum(store.calls.values())
    await asyncio.sleep(0.1)
    assert sum(store.calls.values()) <= at_cancel + 2 < 200  # at most the reads in flight


# --- loads through runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    sd = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(10)}  # 10 x 4 MiB
    sd["b"] = torch.randn(1000, generator=g)
    sd["h"] = torch.randn(3 << 20, generator=g).to(torch.bfloat16)  # 6 MiB
    path = tmp_path_factory.mktemp("runs") / "ckpt"
    dcp.save(sd, checkpoint_id=str(path))
    return path, sd


@pytest.mark.parametrize(
    "options",
    [
        LoadOptions(
            chunk_size=8 << 20
        ),  # runs of 8 MiB reads, the last 32 MiB cut into 4 MiB pieces
        LoadOptions(chunk_size=1 << 20, io_threads=3),
        LoadOptions(chunk_size=8 << 20, concurrency=1),  # one thread: nothing cut
        LoadOptions(chunk_size=16 << 20, memory_budget=16 << 20),  # the budget below two reads
    ],
    ids=["8MiB", "1MiB-3-threads", "one-thread", "small-budget"],
)
def test_loads_through_runs_are_bit_exact(ckpt, options):
    path, sd = ckpt
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    calls: list[int] = []
    stats = asyncload.load(
        dest, path, options=options, progress=lambda done, _t: calls.append(done)
    )
    assert_bitwise_equal(dest, sd)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    assert calls == sorted(calls) and calls[-1] == total and len(calls) > 2
    assert stats.bytes_assembled == total and stats.peak_buffered_bytes <= options.memory_budget
