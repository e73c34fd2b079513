"""The reader pool's building blocks: the Meter invariants (the byte budget and the limit of
reads in flight are both meters), and Pipeline.run
against a real file (budget bound, state after success, failure and cancellation)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest
from _ckpt import open_fds_under

from asyncload import AsyncLoadError, LoadOptions
from asyncload.common.stats import StatsRecorder
from asyncload.engine import resolve_config
from asyncload.engine.chunks import Chunk, Piece
from asyncload.engine.meter import Meter, MeterStatistics
from asyncload.engine.pipeline import Pipeline
from asyncload.storage import LocalStorage

pytestmark = pytest.mark.timeout(30)


def _budget(capacity: int) -> Meter:
    """The pipeline's byte budget (Pipeline.budget)."""
    return Meter(capacity, name="read budget", unit="bytes")


def _limiter(limit: int) -> Meter:
    """The pipeline's limit of reads in flight (Pipeline.limiter)."""
    return Meter(limit, name="reads in flight", unit="reads")


async def _settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# --- the byte budget: a Meter ------------------------------------------------------------


@pytest.mark.asyncio
async def test_budget_take_release_peak_and_statistics():
    b = _budget(100)
    await b.acquire(60)
    await b.acquire(40)
    assert (b.used, b.peak) == (100, 100)
    b.release(70)
    await b.acquire(10)
    st = b.statistics()
    assert isinstance(st, MeterStatistics)
    assert (st.capacity, st.used, st.peak, st.waiting) == (100, 40, 100, 0)
    b.release(40)
    assert b.used == 0 and b.peak == 100


@pytest.mark.asyncio
async def test_budget_rejects_a_request_larger_than_capacity():
    b = _budget(100)
    with pytest.raises(ValueError, match="101 bytes.*100"):
        await b.acquire(101)
    assert b.used == 0
    await b.acquire(100)  # exactly the capacity is fine
    assert b.used == 100


@pytest.mark.asyncio
async def test_budget_waiters_are_served_fifo_and_small_ones_do_not_overtake():
    b = _budget(100)
    await b.acquire(90)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await b.acquire(n)
        order.append(name)

    big = asyncio.create_task(take("big", 50))
    await _settle()
    small = asyncio.create_task(take("small", 5))  # fits now, but must queue behind "big"
    await _settle()
    assert order == [] and b.statistics().waiting == 2 and b.used == 90
    b.release(40)  # 50 used: big is granted (100); small (105) must wait for the next release
    await _settle()
    assert order == ["big"] and b.used == 100
    b.release(5)
    await _settle()
    assert order == ["big", "small"] and b.used == 100
    await asyncio.gather(big, small)
    assert b.peak == 100


@pytest.mark.asyncio
async def test_budget_cancelled_waiter_leaves_queue_and_unblocks_the_next():
    b = _budget(100)
    await b.acquire(60)
    head = asyncio.create_task(b.acquire(50))  # does not fit
    await _settle()
    nxt = asyncio.create_task(b.acquire(30))  # would fit, waits behind head (FIFO)
    await _settle()
    assert b.statistics().waiting == 2 and not nxt.done()
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    await _settle()
    assert nxt.done() and nxt.exception() is None
    assert b.used == 90 and b.statistics().waiting == 0


@pytest.mark.asyncio
async def test_budget_waiter_cancelled_right_after_its_grant_gives_the_bytes_back():
    b = _budget(100)
    await b.acquire(80)
    waiter = asyncio.create_task(b.acquire(50))
    await _settle()
    b.release(80)  # grants the waiter synchronously: used 50 ...
    assert b.used == 50
    waiter.cancel()  # ... but it is cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert b.used == 0 and b.statistics().waiting == 0


@pytest.mark.asyncio
async def test_budget_never_exceeds_capacity_under_churn():
    b = _budget(1000)
    sizes = [(i * 37) % 400 + 1 for i in range(300)]
    high = 0

    async def worker(n: int) -> None:
        nonlocal high
        await b.acquire(n)
        high = max(high, b.used)
        assert b.used <= b.capacity
        await asyncio.sleep(0)
        b.release(n)

    await asyncio.gather(*(worker(n) for n in sizes))
    assert b.used == 0 and b.peak == high and 0 < high <= 1000


# --- reads in flight: a Meter ------------------------------------------------------------


@pytest.mark.asyncio
async def test_limiter_bounds_active_and_tracks_peak():
    lim = _limiter(2)
    await lim.acquire()
    await lim.acquire()
    third = asyncio.create_task(lim.acquire())
    await _settle()
    assert not third.done() and lim.used == 2
    lim.release()
    await _settle()
    assert third.done() and lim.used == 2 and lim.peak == 2


@pytest.mark.asyncio
async def test_limiter_is_fifo():
    lim = _limiter(1)
    await lim.acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await lim.acquire()
        order.append(i)

    tasks = [asyncio.create_task(take(i)) for i in range(5)]
    await _settle()
    for _ in range(5):
        lim.release()
        await _settle()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


@pytest.mark.asyncio
async def test_limiter_set_limit_wakes_waiters_and_clamps_to_one():
    lim = _limiter(1)
    await lim.acquire()
    waiters = [asyncio.create_task(lim.acquire()) for _ in range(3)]
    await _settle()
    assert lim.used == 1
    lim.set_capacity(3)
    await _settle()
    assert lim.used == 3 and sum(w.done() for w in waiters) == 2
    lim.set_capacity(0)
    assert lim.capacity == 1
    for _ in range(3):
        lim.release()
    await _settle()
    # the last waiter got in once active dropped below the new limit of 1
    assert all(w.done() for w in waiters) and lim.used == 1 and lim.peak == 3


@pytest.mark.asyncio
async def test_limiter_cancelled_waiter_is_removed():
    lim = _limiter(1)
    await lim.acquire()
    a = asyncio.create_task(lim.acquire())
    bb = asyncio.create_task(lim.acquire())
    await _settle()
    a.cancel()
    await _settle()
    lim.release()
    await _settle()
    assert a.cancelled() and bb.done() and lim.used == 1


@pytest.mark.asyncio
async def test_limiter_waiter_cancelled_right_after_its_grant_releases():
    lim = _limiter(1)
    await lim.acquire()
    w = asyncio.create_task(lim.acquire())
    await _settle()
    lim.release()  # grants w synchronously
    assert lim.used == 1
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert lim.used == 0


# --- Pipeline against a real file ----------------------------------------------------------


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(1 << 20)
    (tmp_path / "f.bin").write_bytes(data)
    return tmp_path, data


def _chunks_into(
    dest: bytearray, name: str, size: int, chunk: int, staged_every: int = 0
) -> list[Chunk]:
    out = []
    mv = memoryview(dest)
    for i, lo in enumerate(range(0, size, chunk)):
        hi = min(size, lo + chunk)
        if staged_every and i % staged_every == 0:

            def deliver(part: memoryview, lo: int = lo, hi: int = hi) -> None:
                mv[lo:hi] = part

            seg = Piece("f.bin", lo, hi, deliver=deliver)
        else:
            seg = Piece("f.bin", lo, hi, into=mv[lo:hi])
        out.append(Chunk(name, lo, hi, [seg]))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("concurrency", [1, 4, 64])
async def test_pipeline_reads_everything_within_budget(data_file, concurrency):
    root, data = data_file
    opts = LoadOptions(
        chunk_size=4096, min_chunk_size=1024, memory_budget=64 << 10, concurrency=concurrency
    )
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="test-io") as ex:
        storage = LocalStorage(str(root), ex)
        rec = StatsRecorder()
        pipe = Pipeline(storage, resolve_config(opts), rec, ex)
        dest = bytearray(len(data))
        await pipe.run(_chunks_into(dest, "f.bin", len(data), 4096, staged_every=3))
        await storage.aclose()
    assert bytes(dest) == data
    s = rec.snapshot()
    assert s.chunks == len(data) // 4096
    assert s.bytes_read == len(data) and s.bytes_assembled == len(data)
    assert 0 < s.peak_buffered_bytes <= opts.memory_budget
    assert s.peak_concurrency <= concurrency
    assert pipe.budget.used == 0 and pipe.limiter.used == 0
    assert open_fds_under(root) == []


@pytest.mark.asyncio
async def test_pipeline_error_leaves_budget_and_limiter_whole(data_file):
    root, data = data_file
    opts = LoadOptions(
        chunk_size=4096, min_chunk_size=1024, memory_budget=64 << 10, concurrency=4, retries=0
    )
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        storage = LocalStorage(str(root), ex)
        pipe = Pipeline(storage, resolve_config(opts), StatsRecorder(), ex)
        dest = bytearray(len(data) + 4096)
        chunks = _chunks_into(
            dest, "f.bin", len(data) + 4096, 4096
        )  # the last one runs past the end
        with pytest.raises(AsyncLoadError) as ei:
            await pipe.run(chunks)
        assert "f.bin" in str(ei.value)
        assert pipe.budget.used == 0 and pipe.limiter.used == 0
        await storage.aclose()
    assert open_fds_under(root) == []


@pytest.mark.asyncio
async def test_pipeline_missing_file_is_checkpoint_not_found(data_file):
    from asyncload import CheckpointNotFoundError

    root, _ = data_file
    opts = LoadOptions(retries=0)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        storage = LocalStorage(str(root), ex)
        pipe = Pipeline(storage, resolve_config(opts), StatsRecorder(), ex)
        with pytest.raises(CheckpointNotFoundError, match="nope.bin"):
            await pipe.run(_chunks_into(bytearray(100), "nope.bin", 100, 100))
        assert pipe.budget.used == 0
        await storage.aclose()


@pytest.mark.asyncio
async def test_pipeline_cancelled_mid_run_leaves_budget_and_limiter_whole(data_file):
    root, data = data_file
    opts = LoadOptions(chunk_size=4096, min_chunk_size=1024, memory_budget=64 << 10, concurrency=2)
    entered = threading.Event()
    unblock = threading.Event()
    dest = bytearray(len(data))
    mv = memoryview(dest)
    chunks = _chunks_into(dest, "f.bin", len(data), 4096)

    def blocking_deliver(part: memoryview) -> None:  # a scripted slow assembly step
        entered.set()
        unblock.wait(10)
        mv[40960:45056] = part

    chunks[10] = Chunk(
        "f.bin", 40960, 45056, [Piece("f.bin", 40960, 45056, deliver=blocking_deliver)]
    )
    ex = concurrent.futures.ThreadPoolExecutor(2)
    try:
        storage = LocalStorage(str(root), ex)
        rec = StatsRecorder()
        pipe = Pipeline(storage, resolve_config(opts), rec, ex)
        task = asyncio.create_task(pipe.run(chunks))
        assert await asyncio.to_thread(entered.wait, 10)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pipe.budget.used == 0 and pipe.limiter.used == 0
        assert pipe.budget.statistics().waiting == 0
        assert rec.snapshot().chunks < len(chunks)
        assert 0 < rec.snapshot().peak_buffered_bytes <= opts.memory_budget
    finally:
        unblock.set()
        ex.shutdown(wait=True)
    await storage.aclose()
    assert open_fds_under(root) == []


# --- local chunks grouped into thread hops ---------------------------------------------------


def _members(c: Chunk) -> list[Chunk]:
    return list(getattr(c, "members", [c]))


def _direct_large(c: Chunk) -> bool:
    from asyncload.engine import pipeline as P

    return c.nbytes > P._BATCH_CHUNK and P._direct(c)


def test_local_chunks_are_grouped_in_order_within_their_limits():
    from asyncload.engine import pipeline as P

    KiB = 1 << 10
    dest = memoryview(bytearray(64 << 20))
    pos = 0

    def chunk(n: int, kind: str = "direct") -> Chunk:
        nonlocal pos
        lo, pos = pos, pos + n
        if kind == "direct":
            seg = Piece("f", lo, lo + n, into=dest[lo : lo + n])
        else:
            seg = Piece("f", lo, lo + n, deliver=lambda _d: None, pinned=kind == "pinned")
        return Chunk("f", lo, lo + n, [seg], trackers=(object(),) if kind == "tracked" else ())

    chunks = (
        [chunk(4 * KiB) for _ in range(3)]  # tiny, straight into a destination
        + [chunk(100 * KiB, "staged") for _ in range(2)]  # small records read whole
        + [chunk(300 * KiB) for _ in range(20)]  # large, straight into destinations
        + [chunk(300 * KiB, "tracked")]  # verify=True: read on its own (its checksum)
        + [chunk(300 * KiB) for _ in range(5)]
        + [chunk(2 << 20, "pinned")]  # a device destination's staged read
        + [chunk(4 * KiB, "pinned")]
    )
    groups = P._group(
        chunks, budget=4 << 20, workers=2, direct_ok=True, staged_limit=P._BATCH_STAGED_CHUNK
    )
    # every chunk once; in the order given, but for a run, which takes its file's direct
    # chunks where the first of them was
    flat = [m for g in groups for m in _members(g)]
    assert len(flat) == len(chunks) and {id(m) for m in flat} == {id(c) for c in chunks}
    assert [m for m in flat if not _direct_large(m)] == [c for c in chunks if not _direct_large(c)]
    kinds = [type(g).__name__ for g in groups]
    assert kinds[0] == "_Batch" and [len(_members(g)) for g in groups[:1]] == [
        5
    ]  # tiny + staged together
    # the 25 large direct chunks of the file: one run, where the first of them was, holding
    # two reads' worth of the budget (2 workers), whatever the checksummed read between them
    runs = [g for g in groups if isinstance(g, P._DirectRun)]
    assert len(runs) == 1 and kinds.index("_DirectRun") == 1
    assert runs[0].members == chunks[5:25] + chunks[26:31]
    assert runs[0].nbytes == 2 * 300 * KiB
    # a device destination's read is never grouped; a checksummed one only with tiny reads
    # assembled on the I/O thread (where its bytes are checksummed), never in a run
    assert all(g is m for g in groups for m in _members(g) if m.needs_pinned)
    assert all(not m.trackers and m.tiles_into() for m in runs[0].members)
    tracked = next(g for g in groups for m in _members(g) if m.trackers)
    assert type(tracked).__name__ == "_Batch"
    # the budget bounds the reservation: a run never holds more than the whole budget
    small = P._group(chunks[5:25], budget=500 * KiB, workers=4, direct_ok=True)
    assert len(small) == 1 and small[0].nbytes == 500 * KiB and small[0].members == chunks[5:25]
    # device destinations (direct_ok=False): large chunks stay one by one
    assert not any(
        isinstance(g, P._DirectRun) for g in P._group(chunks, 4 << 20, 2, direct_ok=False)
    )
    # outside the header phase, only reads of up to _BATCH_CHUNK are grouped with tiny ones
    data_phase = P._group(chunks, budget=4 << 20, workers=2, direct_ok=True)
    assert [len(_members(g)) for g in data_phase[:3]] == [3, 1, 1]
    # one run for every file, the reads of each in the order given
    other = [
        Chunk("g", c.start, c.end, [Piece("g", s.start, s.end, into=s.into) for s in c.segments])
        for c in chunks[5:8]
    ]
    mixed = P._group(
        [chunks[5], other[0], chunks[6], other[1], other[2]], 4 << 20, 2, direct_ok=True
    )
    assert len(mixed) == 1 and mixed[0].members == [
        chunks[5],
        other[0],
        chunks[6],
        other[1],
        other[2],
    ]
    reads, _ = P._run_reads(mixed[0].members, 2)
    assert [(name, start) for name, start, _ in reads] == [
        (c.name, c.start) for c in mixed[0].members
    ]


def test_a_runs_reads_cover_its_members_in_order_the_last_ones_cut_small():
    from asyncload.engine import pipeline as P

    piece = P._TAIL_PIECE
    dest = memoryview(bytearray(200 << 20))
    members, pos = [], 0
    for n in [16 << 20] * 9 + [5 << 20, 1 << 20]:
        # two segments per member (two destinations), tiling it
        cut = pos + n // 3
        members.append(
            Chunk(
                "f",
                pos,
                pos + n,
                [
                    Piece("f", pos, cut, into=dest[pos:cut]),
                    Piece("f", cut, pos + n, into=dest[cut : pos + n]),
                ],
            )
        )
        pos += n
    for jobs in (1, 2, 3):
        reads, owner = P._run_reads(members, jobs)
        assert len(owner) == len(reads) and owner == sorted(owner)
        # contiguous, in order, exactly the members' bytes, each read inside its member
        at = 0
        for (name, start, views), i in zip(reads, owner):
            assert name == "f"
            assert start == at and members[i].start <= start
            n = sum(len(v) for v in views)
            assert start + n <= members[i].end
            at += n
        assert at == pos
        # each view a slice of the members' own destinations, in order
        flat = [v for _, _, views in reads for v in views]
        assert b"".join(bytes(v) for v in flat) == bytes(dest[:pos])
        spans = [(start, start + sum(len(v) for v in views)) for _, start, views in reads]
        tail = 2 * jobs * (16 << 20) if jobs > 1 else 0
        for (lo, hi), i in zip(spans, owner):
            whole = (members[i].start, members[i].end)
            if pos - members[i].end >= tail or members[i].nbytes <= piece:
                assert (lo, hi) == whole  # before the tail (and small members): whole
            else:
                assert hi - lo <= piece  # in the tail: cut
        if jobs == 1:
            assert spans == [(m.start, m.end) for m in members]
        else:
            assert max(hi - lo for lo, hi in spans[-4:]) <= piece


class _CountingPool(concurrent.futures.ThreadPoolExecutor):
    def __init__(self, n: int) -> None:
        super().__init__(n, thread_name_prefix="test-io")
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.asyncio
async def test_large_local_chunks_read_in_one_run_are_bit_exact_and_counted(tmp_path):
    data = os.urandom((4 << 20) + 12345)
    (tmp_path / "f.bin").write_bytes(data)
    opts = LoadOptions(chunk_size=128 << 10, memory_budget=8 << 20, concurrency=4)
    with _CountingPool(2) as ex:
        storage = LocalStorage(str(tmp_path), ex)
        rec = StatsRecorder()
        dest = bytearray(len(data))
        chunks = _chunks_into(dest, "f.bin", len(data), 128 << 10)
        await Pipeline(storage, resolve_config(opts), rec, ex).run(chunks)
        await storage.aclose()
    assert bytes(dest) == data
    s = rec.snapshot()
    assert (s.chunks, s.bytes_read, s.bytes_assembled) == (len(chunks), len(data), len(data))
    # 32 chunks of 128 KiB in one run on 2 threads (one hop each) and the last, tiny one
    # in a batch, read on the loop from the page cache (just written): 2 hops instead of 33
    assert ex.jobs == 2
    # in flight at once: the run's two reads (two reads' worth of the budget) and the batch
    assert s.peak_concurrency == 3 and s.peak_buffered_bytes == 2 * (128 << 10) + 12345


@pytest.mark.asyncio
async def test_a_run_that_reads_past_the_end_of_its_file_names_the_file_and_the_read(tmp_path):
    from asyncload import CheckpointFormatError

    data = os.urandom(4 << 20)
    (tmp_path / "f.bin").write_bytes(data[: (4 << 20) - 1000])  # truncated under the plan
    opts = LoadOptions(chunk_size=128 << 10, memory_budget=8 << 20, concurrency=4, retries=1)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        storage = LocalStorage(str(tmp_path), ex)
        pipe = Pipeline(storage, resolve_config(opts), StatsRecorder(), ex)
        dest = bytearray(len(data))
        with pytest.raises(CheckpointFormatError) as ei:
            await pipe.run(_chunks_into(dest, "f.bin", len(data), 128 << 10))
        assert pipe.budget.used == 0 and pipe.limiter.used == 0
        await storage.aclose()
    msg = str(ei.value)
    # the read that failed: the last chunk of 128 KiB, [3.875 MiB, 4 MiB)
    assert "f.bin" in msg and f"bytes [{31 << 17}, {4 << 20})" in msg, msg
    assert open_fds_under(tmp_path) == []
