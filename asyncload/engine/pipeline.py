"""The reader pool: chunks dispatched under a byte budget and a concurrency limit,
read with timeouts/retries/hedges, handed to assembly off the event loop.

Invariants (each has a test):

- The budget is reserved before a chunk's read starts and released only after its
  bytes are assembled, so ``peak_buffered_bytes <= memory_budget`` always. No chunk
  is larger than the budget (chunks are cut to ``LoadOptions.effective_chunk_size``).
- Chunks are assembled one by one, independently: no chunk waits for another, so the
  budget cannot deadlock.
- A short read is an error (retried), never a smaller tensor.
- Every task started is awaited or cancelled on every path (one TaskGroup); after an
  error or a cancel the budget is whole again.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from asyncload.common.errors import first_error
from asyncload.common.options import ChunkPolicy
from asyncload.common.stats import StatsRecorder
from asyncload.engine.assembly import StagingPool, assemble, track
from asyncload.engine.chunks import Chunk
from asyncload.engine.meter import Meter
from asyncload.storage import RetryingStorage, Storage

if TYPE_CHECKING:
    from asyncload.engine.config import LoadConfig

__all__ = ["Pipeline"]

log = logging.getLogger("asyncload.pipeline")


class Pipeline:
    """Reads chunks from one storage with ``concurrency`` reads in flight under a budget."""

    def __init__(
        self,
        storage: RetryingStorage | Storage,
        config: LoadConfig,
        stats: StatsRecorder,
        executor: concurrent.futures.Executor,
        budget: Meter | None = None,
        *,
        chunking: ChunkPolicy | None = None,
        staging: Any = None,
        on_progress: Callable[[int], None] | None = None,
        limiter: Meter | None = None,
    ) -> None:
        if not isinstance(storage, RetryingStorage):  # a bare store: give it the load's policy
            storage = RetryingStorage(
                storage, retry=config.retry, hedge=config.hedge, stats=stats, executor=executor
            )
        # the same store and policy, telling this pipeline when the store asks to slow down
        self.storage = storage.with_throttle(self._note_throttle)
        #: The load's config without its planner's terms: the store's throttle callback
        #: makes a reference cycle of the pipeline, which must not keep the planner (and the
        #: destinations it holds) alive until a garbage collection.
        self.config = config.without_planner()
        #: How this pipeline's chunks were cut (``config.staged`` for a load into device
        #: tensors, else ``config.chunking``).
        self.chunking = chunking if chunking is not None else config.chunking
        self.stats = stats
        self.executor = executor
        #: Bytes read but not yet assembled (``memory_budget``: the read share of the memory
        #: plan, :mod:`asyncload.engine.config`), and reads in flight (``concurrency``).
        self.budget = budget or Meter(config.memory.budget, name="read budget", unit="bytes")
        #: ``budget`` and ``limiter`` may be shared by pipelines that run at once (a
        #: stream's batches read ahead: :class:`asyncload.faces.streaming.CheckpointStream`),
        #: which then stay within one budget and one ``concurrency`` together.
        self.limiter = (
            limiter
            if limiter is not None
            else Meter(config.concurrency.initial, name="reads in flight", unit="reads")
        )
        self._pool = StagingPool(min(config.memory.budget, 4 * self.chunking.chunk_size))
        self._throttled = 0
        #: ``concurrency="auto"``: (time, new limit, why) for every change.
        self.limit_history: list[tuple[float, int, str]] = []
        self._tuner: _AutoTuner | None = None
        #: ``on_progress(bytes)``: destination bytes assembled (from the loop and I/O threads).
        self.on_progress = on_progress
        #: Hook for chunks feeding device destinations (``_cuda.DeviceStager``): reads them
        #: through its pinned ring and waits for their device copies.
        self.staging = staging
        #: Set while the session reads header probes and small records (many reads, each
        #: assembled from a buffer): local ones of up to ``_BATCH_STAGED_CHUNK`` are grouped.
        self.headers = False

    def _note_throttle(self) -> None:
        self._throttled += 1

    async def run(self, chunks: Iterable[Chunk]) -> None:
        """Read and assemble every chunk; raise the first error (others are cancelled)."""
        if self.storage.supports_readinto:
            # Local reads: tiny ones (header probes, small records) and large ones straight
            # into destinations go to the I/O threads several at a time, one thread hop per
            # group. Same budget; errors translated the same way.
            chunks = _group(
                list(chunks),
                self.budget.capacity,
                _workers(self.executor),
                direct_ok=self.staging is None,
                staged_limit=_BATCH_STAGED_CHUNK if self.headers else _BATCH_CHUNK,
            )
        if self.storage.hedgeable:
            chunks = self._spread(chunks)
        await self._run(_aiter(chunks))

    async def run_stream(self, chunks: AsyncIterator[Chunk]) -> None:
        """:meth:`run` for a source that yields chunks as they become known (a record's data
        once its header probes have landed), dispatched in its order; an error the source
        raises fails the run like a failed read. A generator source is closed on every path."""
        try:
            await self._run(chunks)
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    async def _run(self, chunks: AsyncIterable[Chunk]) -> None:
        error: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                tuner = tg.create_task(self._autotune()) if self.config.concurrency.auto else None
                async for chunk in chunks:
                    # wall-clock waits of this one dispatcher: for the budget only when the
                    # chunk did not fit it (try_acquire), then for a read slot (concurrency)
                    if not self.budget.try_acquire(chunk.nbytes):
                        t0 = time.monotonic()
                        await self.budget.acquire(chunk.nbytes)
                        self.stats.add(budget_wait_seconds=time.monotonic() - t0)
                    try:
                        if not self.limiter.try_acquire():
                            t0 = time.monotonic()
                            await self.limiter.acquire()
                            self.stats.add(slot_wait_seconds=time.monotonic() - t0)
                    except BaseException:
                        self.budget.release(chunk.nbytes)
                        raise
                    self.stats.maximum("peak_concurrency", self.limiter.used)
                    self._dispatch(tg, chunk)
                if tuner is not None:
                    tuner.cancel()
        except BaseExceptionGroup as group:
            error = first_error(group)  # the first real error, not the cancellations it caused
        finally:
            self.stats.maximum("peak_buffered_bytes", self.budget.peak)
        if error is not None:
            raise error.with_traceback(error.__traceback__)

    @staticmethod
    def _spread(chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        """Dispatch order for remote stores: round-robin over files (each file's chunks in
        order). Reads are spread over objects (and so over the store's partitions and
        per-object limits) instead of piling onto one object at a time; a chunk that
        stalls holds only its own slot while the other readers move on (and is hedged)."""
        queues: dict[str, collections.deque[Chunk]] = {}
        for c in chunks:
            queues.setdefault(c.name, collections.deque()).append(c)
        ring = collections.deque(queues.values())
        while ring:
            q = ring.popleft()
            yield q.popleft()
            if q:
                ring.append(q)

    async def _autotune(self) -> None:
        """``concurrency="auto"``: adjust the limiter every few ticks (see :class:`_AutoTuner`)."""
        if self._tuner is None:  # one per pipeline: its state carries over the load's phases
            self._tuner = _AutoTuner(self)
        while True:
            await asyncio.sleep(_AutoTuner.TICK)
            self._tuner.tick()

    def _set_limit(self, limit: int, why: str) -> None:
        old = self.limiter.capacity
        if limit == old:
            return
        self.limiter.set_capacity(limit)
        self.limit_history.append((time.monotonic(), limit, why))
        log.debug("concurrency %d -> %d: %s", old, limit, why)

    def _dispatch(self, tg: asyncio.TaskGroup, chunk: Chunk) -> None:
        """Start reading ``chunk`` (its budget and slot are held). They are given back when
        the task ends, by a done callback: a task that a failing TaskGroup cancels before
        it first runs never enters its own ``finally``, and ``create_task`` itself raises
        once the group is shutting down."""
        coro = self._one(chunk)
        try:
            task = tg.create_task(coro)
        except BaseException:
            coro.close()
            self._release(chunk)
            raise
        task.add_done_callback(lambda _t: self._release(chunk))

    def _release(self, chunk: Chunk) -> None:
        self.budget.release(chunk.nbytes)
        self.limiter.release()

    async def _one(self, chunk: Chunk) -> None:
        await self._read_and_assemble(chunk)
        if chunk.landed is not None:
            chunk.landed()

    async def _read_and_assemble(self, chunk: Chunk) -> None:
        if isinstance(chunk, _Batch):
            await self._run_batch(chunk)
            return
        if self.staging is not None and chunk.needs_pinned:
            await self.staging.read_and_assemble(self, chunk)
            return
        loop = asyncio.get_running_loop()
        storage = self.storage
        t0 = time.monotonic()
        if (storage.supports_readinto or storage.receives_into) and chunk.tiles_into():
            views = [
                s.into for s in chunk.segments if s.into is not None
            ]  # all of them: tiles_into
            # verify=True: checksummed on the I/O thread, in the same hop
            then = functools.partial(track, chunk, views) if chunk.trackers else None
            await storage.readinto(chunk.name, chunk.start, views, then=then)
            t1 = time.monotonic()
            self.stats.add(chunks=1, storage_wait_seconds=t1 - t0)
            self._count_assembled(chunk, t1, t0)
            return

        pooled: bytearray | None = None
        if storage.supports_readinto:
            pooled = self._pool.get(chunk.nbytes)
            data = memoryview(pooled)[: chunk.nbytes]
            await storage.readinto(chunk.name, chunk.start, [data])
        else:
            data = await storage.read(chunk.name, chunk.start, chunk.end)
        t1 = time.monotonic()
        self.stats.add(chunks=1, storage_wait_seconds=t1 - t0)
        try:
            await loop.run_in_executor(self.executor, assemble, chunk, data)
        finally:
            if pooled is not None:
                self._pool.put(pooled)
        self._count_assembled(chunk, t1, t0)

    async def _run_batch(self, batch: _Batch) -> None:
        t0 = time.monotonic()
        if isinstance(batch, _DirectRun):
            await self._run_direct(batch)
            return
        await self.storage.read_batch(
            [(c.name, c.start, c.end, functools.partial(assemble, c)) for c in batch.members]
        )
        self.stats.add(chunks=len(batch.members), storage_wait_seconds=time.monotonic() - t0)
        for c in batch.members:
            self._count_assembled(c, time.monotonic())

    async def _run_direct(self, run: _DirectRun) -> None:
        """Read a run's members (every segment has its destination: ``_direct``) on as many
        I/O threads as the concurrency limit allows, each pulling the next read from one
        queue; each member is counted (bytes, progress) on its thread as its last read lands."""
        members = run.members
        jobs = max(1, min(_workers(self.executor), self.limiter.capacity))
        reads, owner = _run_reads(members, jobs)
        left = [0] * len(members)
        for i in owner:
            left[i] += 1
        payloads = [_payload(m) for m in members]
        lock = threading.Lock()
        waited = [0.0]
        t0 = time.monotonic()
        debug = log.isEnabledFor(logging.DEBUG)
        add, progress = self.stats.add, self.on_progress
        self.stats.maximum("peak_concurrency", self.limiter.used - 1 + min(jobs, len(reads)))

        def landed(i: int, seconds: float) -> None:
            m = owner[i]
            with lock:
                waited[0] += seconds
                left[m] -= 1
                if left[m]:
                    return
            if debug:
                self._count_assembled(members[m], time.monotonic(), t0)
                return
            add(bytes_assembled=payloads[m])
            if progress is not None and payloads[m]:
                progress(payloads[m])

        await self.storage.readinto_shared(reads, jobs=jobs, landed=landed)
        self.stats.add(chunks=len(members), storage_wait_seconds=waited[0])

    def _count_assembled(self, chunk: Chunk, t1: float, t0: float | None = None) -> None:
        payload = _payload(chunk)
        t2 = time.monotonic()
        self.stats.add(bytes_assembled=payload, assembly_seconds=t2 - t1)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "chunk %s [%d, %d) %d bytes in %d segments: read %.2f ms, assembled %.2f ms",
                chunk.name,
                chunk.start,
                chunk.end,
                chunk.nbytes,
                len(chunk.segments),
                (t1 - (t1 if t0 is None else t0)) * 1e3,
                (t2 - t1) * 1e3,
            )
        if self.on_progress is not None and payload:
            self.on_progress(payload)


class _AutoTuner:
    """``concurrency="auto"``: find the number of reads in flight (docs/remote.md).

    Each window (>= 0.2 s with >= 4 reads finished) it compares throughput with the last
    window's. Throttling (429/503/SlowDown) halves the limit at once and holds it for a
    second. Otherwise, only when the limiter (not the memory budget, not the plan) was
    what held reads back: a gain of 10% or more grows the limit (doubling until the first
    window without gain, then +25%); no gain with the median latency per byte up by half
    over the best seen (reads queue behind each other: the link is full) shrinks it by a
    fifth. Always within 1 and ``LoadOptions.max_in_flight``.
    """

    TICK = 0.05
    WINDOW = 0.2

    def __init__(self, pipeline: Pipeline) -> None:
        self.p = pipeline
        self.clock = pipeline.storage.clock
        self.slow_start = True
        self.prev_rate: float | None = None
        self.base_cost: float | None = None
        self.hold_until = 0.0
        self._new_window()

    def _new_window(self) -> None:
        self.t_w = time.monotonic()
        self.bytes_w = self.p.stats.stats.bytes_read
        self.done_w = self.clock.total_samples
        self.ticks = self.saturated = 0

    def tick(self) -> None:
        p = self.p
        now = time.monotonic()
        limit = p.limiter.capacity
        self.ticks += 1
        if p.limiter.used >= limit or p.limiter.waiting:
            self.saturated += 1
        if p._throttled:
            p._throttled = 0
            p._set_limit(max(1, limit // 2), "throttled")
            self.slow_start = False
            self.hold_until = now + 1.0
            self.prev_rate = None
            self._new_window()
            return
        finished = self.clock.total_samples - self.done_w
        if now - self.t_w < self.WINDOW or (finished < 4 and now - self.t_w < 10 * self.WINDOW):
            return
        rate = (p.stats.stats.bytes_read - self.bytes_w) / (now - self.t_w)
        recent = (
            sorted(t / n for t, n in list(self.clock.samples)[-finished:] if n > 0)
            if finished
            else []
        )
        cost = recent[len(recent) // 2] if recent else None
        was_saturated = self.saturated * 2 >= self.ticks
        self._new_window()
        if now < self.hold_until or not was_saturated:
            return
        if cost is not None:
            self.base_cost = cost if self.base_cost is None else min(self.base_cost, cost)
        if self.prev_rate is None or rate >= self.prev_rate * 1.10:
            new = limit * 2 if self.slow_start else limit + max(1, limit // 4)
            p._set_limit(
                min(p.config.concurrency.max_in_flight, new),
                f"throughput {rate / 2**20:.1f} MiB/s rising",
            )
        else:
            self.slow_start = False
            if (
                cost is not None
                and self.base_cost is not None
                and cost > 1.5 * self.base_cost
                and limit > 1
            ):
                p._set_limit(
                    max(1, limit - max(1, limit // 5)),
                    f"throughput flat at {rate / 2**20:.1f} MiB/s, latency rising",
                )
        self.prev_rate = rate


async def _aiter(chunks: Iterable[Chunk]) -> AsyncIterator[Chunk]:
    for c in chunks:
        yield c


#: Local chunks of up to this many bytes are read several to a thread hop (``_Batch``),
#: each into a buffer of its own and assembled from there ...
_BATCH_CHUNK = 64 << 10
#: ... and, while the session reads header probes and small records (``Pipeline.headers``),
#: those assembled from a buffer anyway (not straight into a destination) up to this many:
#: a small record read whole is up to ``min_chunk_size`` plus its probes.
_BATCH_STAGED_CHUNK = 2 << 20
_BATCH_BYTES = 4 << 20


class _Batch(Chunk):
    """Several tiny local chunks read together: on the loop from the page cache, or in one
    thread hop (:meth:`RetryingStorage.read_batch`)."""

    members: list[Chunk]


class _DirectRun(_Batch):
    """The large local chunks that each read straight into their destinations, read by
    several I/O threads that pull them from one queue (:meth:`Pipeline._run_direct`).
    Its ``nbytes`` is the budget it holds: what can be in flight at once."""


#: Large local reads straight into destinations go to the I/O threads as one run (of every
#: file): each thread pulls the next read from a shared queue until none is left. One thread hop
#: per thread for the whole run (instead of one per read, or per group of reads), every
#: thread busy until the end, and the loop idle while they copy: on 2 cores the loop's work
#: per hop runs beside page-cache copies that evict its caches (docs/performance.md).
#: False: one hop per read (docs/performance.md compares the two).
_DIRECT_RUNS = True
#: The last reads of a run are cut into pieces of this size, so that the threads finish
#: together: a thread left without work while another copies a whole chunk idles a core.
_TAIL_PIECE = 4 << 20


def _workers(executor: concurrent.futures.Executor) -> int:
    n = getattr(executor, "_max_workers", None)
    return n if isinstance(n, int) and n > 0 else 1


def _group(
    chunks: list[Chunk],
    budget: int,
    workers: int,
    *,
    direct_ok: bool,
    staged_limit: int = _BATCH_CHUNK,
) -> list[Chunk]:
    """Local chunks in dispatch order, grouped: consecutive tiny ones (up to
    ``_BATCH_CHUNK``, or ``staged_limit`` when assembled from a buffer anyway; no device
    staging) into :class:`_Batch` es of up to ``_BATCH_BYTES``; large ones that each read
    straight into their destinations (no checksum; ``direct_ok``: no device staging) into
    one :class:`_DirectRun`, where the first of them was (holding ``workers`` reads' worth
    of the budget). Others stay as they are."""
    tiny_limit = min(budget, _BATCH_BYTES)
    out: list[Chunk] = []
    cur: list[Chunk] = []
    size = 0
    direct: list[Chunk] = []
    run_at = 0  # where the run goes: where the first of its members was

    def flush() -> None:
        nonlocal cur, size
        if cur:
            b = _Batch(cur[0].name, 0, size, [])
            b.members = cur
            out.append(b)
        cur, size = [], 0

    for c in chunks:
        if c.landed is not None:  # counted in on its own (Chunk.landed)
            flush()
            out.append(c)
            continue
        if not c.needs_pinned and (
            c.nbytes <= _BATCH_CHUNK
            or (c.nbytes <= staged_limit and (c.trackers or not c.tiles_into()))
        ):
            if cur and size + c.nbytes > tiny_limit:
                flush()
            cur.append(c)
            size += c.nbytes
            continue
        flush()
        if _DIRECT_RUNS and direct_ok and _direct(c):
            if not direct:
                run_at = len(out)
            direct.append(c)
        else:
            out.append(c)
    flush()
    if direct:
        reserve = min(
            budget, sum(m.nbytes for m in direct), workers * max(m.nbytes for m in direct)
        )
        out.insert(run_at, direct_run(direct, reserve))
    return out


def direct_run(members: list[Chunk], reserve: int) -> _DirectRun:
    """A :class:`_DirectRun` of ``members`` (large chunks that each read straight into their
    destinations) holding ``reserve`` bytes of the budget."""
    run = _DirectRun(members[0].name, 0, reserve, [])
    run.members = members
    return run


def _run_reads(
    members: list[Chunk], jobs: int
) -> tuple[list[tuple[str, int, list[memoryview]]], list[int]]:
    """A run's reads, in order: each member whole, except that (``jobs`` > 1) the members in
    the last ``2 x jobs`` largest members' worth of bytes are cut into :data:`_TAIL_PIECE`
    pieces; and the member each read belongs to."""
    tail = (
        2 * jobs * max(m.nbytes for m in members) if jobs > 1 else 0
    )  # one thread: nothing to even out
    reads: list[tuple[str, int, list[memoryview]]] = []
    owner: list[int] = []
    after = sum(m.nbytes for m in members)
    for i, m in enumerate(members):
        views = [s.into for s in m.segments if s.into is not None]  # all of them: tiles_into
        after -= m.nbytes
        if after >= tail or m.nbytes <= _TAIL_PIECE:
            reads.append((m.name, m.start, views))
            owner.append(i)
            continue
        pos, cur, n = m.start, [], 0
        for v in views:
            while len(v):
                take = min(len(v), _TAIL_PIECE - n)
                cur.append(v[:take])
                v, n = v[take:], n + take
                if n == _TAIL_PIECE:
                    reads.append((m.name, pos, cur))
                    owner.append(i)
                    pos, cur, n = pos + n, [], 0
        if cur:
            reads.append((m.name, pos, cur))
            owner.append(i)
    return reads, owner


def _payload(chunk: Chunk) -> int:
    """The destination bytes a chunk fills (counted in ``bytes_assembled``)."""
    return sum(
        s.end - s.start if s.useful is None else s.useful for s in chunk.segments if s.payload
    )


def _direct(c: Chunk) -> bool:
    return not c.trackers and not c.needs_pinned and c.tiles_into()
