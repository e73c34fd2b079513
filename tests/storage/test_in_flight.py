"""The error boundary's in-flight bookkeeping (``RetryingStorage.in_flight``): a request is
listed, with its file, byte range, attempt and hedge flag, from the moment it is sent until
it ends, whatever the end: success, a failed attempt (then the retry is listed as attempt
2), a final failure, a cancel, the losing copy of a hedge; reads into caller memory on I/O
threads (a local load's ``readinto_shared``) each on their own.

The store is scripted at the interface (``Storage``): each request waits on an event the
test sets, so "in flight" is observed by order, never by timing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from asyncload import LoadOptions
from asyncload.common.stats import StatsRecorder
from asyncload.storage import RetryingStorage, Storage
from asyncload.storage.in_flight import InFlight, InFlightRequest

pytestmark = [pytest.mark.timeout(30)]

DATA = bytes(range(256)) * 16  # 4 KiB
ROOT = "scripted://user:secret@bucket/ckpt"
URL = "scripted://user:***@bucket/ckpt/f"  # what the listing shows: the password redacted
OPTS = LoadOptions(retries=2, backoff=0, max_backoff=0, timeout=10.0, hedge=False)
CUT_OFF = 10.0  # seconds a step may take at most (a failure cut-off, not a measurement)


class Gated(Storage):
    """A store whose n-th read (from 1) waits for ``release[n]`` and then does what
    ``script[n]`` says: ``"ok"`` (the bytes), ``"reset"`` (a connection reset: retryable),
    ``"missing"`` (FileNotFoundError: not retryable). ``started[n]`` is set when it begins."""

    supports_readinto = True

    def __init__(self, script: Sequence[str], *, hedgeable: bool = False) -> None:
        super().__init__(ROOT)
        self.script = list(script)
        self.hedgeable = hedgeable  # type: ignore[misc]
        self.calls = 0
        self._lock = threading.Lock()
        self.started = [threading.Event() for _ in range(len(script) + 1)]
        self.release = [threading.Event() for _ in range(len(script) + 1)]

    def _next(self) -> int:
        with self._lock:
            self.calls += 1
            return self.calls

    async def read(self, name: str, start: int, end: int) -> bytes:
        n = self._next()
        self.started[n].set()
        # a threading.Event (readinto_sync waits on the same kind on I/O threads), polled so
        # that a cancel ends the wait at once
        while not self.release[n].is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        return self._answer(n, start, end)

    def readinto_sync(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        n = self._next()
        self.started[n].set()
        assert self.release[n].wait(CUT_OFF)
        end = start + sum(len(b) for b in buffers)
        data = self._answer(n, start, end)
        pos = 0
        for b in buffers:
            b[:] = data[pos : pos + len(b)]
            pos += len(b)

    def _answer(self, n: int, start: int, end: int) -> bytes:
        what = self.script[n - 1]
        if what == "reset":
            raise ConnectionResetError("connection reset by peer")
        if what == "missing":
            raise FileNotFoundError("no such object")
        return DATA[start:end]


@pytest.fixture
def executor():
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-in-flight")
    yield pool
    pool.shutdown(wait=True)


def boundary(store: Storage, executor: Any, **changes: Any) -> RetryingStorage:
    return RetryingStorage.for_options(store, OPTS.replace(**changes), StatsRecorder(), executor)


async def started(store: Gated, n: int) -> None:
    """Wait (without blocking the loop) until the store's n-th request has begun."""
    ok = await asyncio.to_thread(store.started[n].wait, CUT_OFF)
    assert ok, f"request {n} never started"


def listing(rs: RetryingStorage) -> list[tuple[str, tuple[int, int] | None, int, bool]]:
    return [(r.path, r.byte_range, r.attempt, r.hedge) for r in rs.in_flight.oldest(10)]


@pytest.mark.asyncio
async def test_a_request_is_listed_until_it_succeeds(executor) -> None:
    store = Gated(["ok"])
    rs = boundary(store, executor)
    task = asyncio.ensure_future(rs.read("f", 100, 228))
    await started(store, 1)
    assert listing(rs) == [(URL, (100, 228), 1, False)]
    (req,) = rs.in_flight.oldest()
    assert isinstance(req, InFlightRequest) and req.seconds >= 0
    assert req.describe().startswith(f"bytes [100, 228) of {URL} for ")
    store.release[1].set()
    assert bytes(await task) == DATA[100:228]
    assert listing(rs) == [] and len(rs.in_flight) == 0


@pytest.mark.asyncio
async def test_a_failed_attempt_leaves_and_its_retry_is_listed_as_attempt_2(executor) -> None:
    store = Gated(["reset", "ok"])
    rs = boundary(store, executor)
    task = asyncio.ensure_future(rs.read("f", 0, 64))
    await started(store, 1)
    assert listing(rs) == [(URL, (0, 64), 1, False)]
    store.release[1].set()
    await started(store, 2)
    assert listing(rs) == [(URL, (0, 64), 2, False)]
    store.release[2].set()
    assert bytes(await task) == DATA[0:64]
    assert listing(rs) == []


@pytest.mark.asyncio
async def test_a_final_failure_leaves_nothing_listed(executor) -> None:
    store = Gated(["missing"])
    rs = boundary(store, executor)
    task = asyncio.ensure_future(rs.read("f", 0, 64))
    await started(store, 1)
    assert len(rs.in_flight) == 1
    store.release[1].set()
    with pytest.raises(FileNotFoundError):
        await task
    assert listing(rs) == []


@pytest.mark.asyncio
async def test_a_cancelled_request_leaves_the_listing(executor) -> None:
    store = Gated(["ok"])
    rs = boundary(store, executor)
    task = asyncio.ensure_future(rs.read("f", 0, 64))
    await started(store, 1)
    assert len(rs.in_flight) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert listing(rs) == []


@pytest.mark.asyncio
async def test_a_hedge_is_listed_beside_its_original_and_both_leave(executor) -> None:
    """The original never answers; its hedged duplicate (sent after the cold floor) wins;
    the original is cancelled. Both are listed while both are in flight."""
    store = Gated(["ok", "ok"], hedgeable=True)
    rs = boundary(store, executor, hedge=True, hedge_min_delay=0.01)
    task = asyncio.ensure_future(rs.read("f", 0, 1024))
    await started(store, 2)  # the hedge has been sent
    assert sorted(listing(rs), key=lambda e: e[3]) == [
        (URL, (0, 1024), 1, False),
        (URL, (0, 1024), 1, True),
    ]
    store.release[2].set()
    assert bytes(await task) == DATA[:1024]
    assert listing(rs) == []
    assert rs.stats.stats.hedges == 1


@pytest.mark.asyncio
async def test_reads_on_io_threads_are_listed_one_by_one(executor) -> None:
    store = Gated(["ok", "ok"])
    rs = boundary(store, executor)
    a, b = bytearray(100), bytearray(50)
    task = asyncio.ensure_future(
        rs.readinto_shared([("f", 0, [memoryview(a)]), ("f", 1000, [memoryview(b)])], jobs=2)
    )
    await started(store, 1)
    await started(store, 2)
    assert sorted(listing(rs)) == [(URL, (0, 100), 1, False), (URL, (1000, 1050), 1, False)]
    store.release[1].set()
    store.release[2].set()
    await task
    assert bytes(a) == DATA[:100] and bytes(b) == DATA[1000:1050]
    assert listing(rs) == []


def test_copies_for_each_pipeline_share_one_listing(executor) -> None:
    rs = boundary(Gated([]), executor)
    assert rs.with_throttle(lambda: None).in_flight is rs.in_flight


def test_the_registry_alone() -> None:
    now = [10.0]
    reg = InFlight(lambda name: f"/ckpt/{name}", now=lambda: now[0])
    k1 = reg.add("a", (0, 10), 1)
    now[0] = 11.0
    k2 = reg.add("b", None, 3, hedge=True)
    now[0] = 12.5
    assert reg.oldest() == [
        InFlightRequest("/ckpt/a", (0, 10), 1, 2.5, False),
        InFlightRequest("/ckpt/b", None, 3, 1.5, True),
    ]
    assert reg.oldest(1) == [InFlightRequest("/ckpt/a", (0, 10), 1, 2.5, False)]
    assert reg.keys() == {k1, k2}
    reg.remove(k1)
    reg.remove(k1)  # twice is harmless
    assert [r.path for r in reg.oldest()] == ["/ckpt/b"]
    assert reg.oldest()[0].describe() == "/ckpt/b for 1.5 s (attempt 3, hedge)"
    reg.remove(k2)
    assert len(reg) == 0 and reg.oldest() == []
