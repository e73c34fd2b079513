"""The one storage error boundary (:class:`RetryingStorage`): timeout, retries with backoff
and jitter, hedging of stragglers, and the one place where storage errors become asyncload
errors (what they mean and what they become: :mod:`asyncload.storage.classify`).

The policy (the same for every store: the fsspec filesystems' own retry loops are
turned off in :mod:`asyncload.storage.fsspec`; the wire transport has none of its own):

* **Timeout with a shared, progress-extended deadline.** An attempt fails with a
  timeout once ``LoadOptions.timeout`` seconds have passed both since it started and
  since *any* read of the same load last finished. A dead store (nothing finishes)
  fails an attempt after exactly ``timeout`` seconds; a slow store that keeps
  delivering (a bandwidth-capped link with many reads queued behind each other) does
  not fail however long one chunk takes. One slow request among fast ones is the
  hedging's job, not the timeout's.
* **Retries**: ``LoadOptions.retries`` more attempts per chunk for retryable failures
  (timeouts, 5xx, 429/SlowDown, connection resets, bodies cut short), after a full-jitter
  exponential backoff (``backoff`` doubling up to ``max_backoff``), at least the
  server's ``Retry-After``. Counted in ``LoadStats.retries`` and ``retries_by_cause``.
  403/404/missing objects and other 4xx fail at once; nothing answering at the endpoint
  (refused, host not found) gets :data:`UNREACHABLE_ATTEMPTS` attempts at most.
* **Hedging**: an attempt still running after its hedge delay gets one duplicate request;
  the first to succeed wins, the other is cancelled (its connection closed). Counted in
  ``LoadStats.hedges``; at most ``HedgePolicy.max_in_flight`` duplicates at once. Two
  rules, the earlier wins (:func:`hedge_delay`):

  - *body*: ``max(floor, hedge_factor x p90)`` of recent comparable reads (same size or
    larger, scaled to this chunk's size), the cold delay before 4 of them have finished;
  - *first byte* (stores that tell when an answer begins: wire): a request whose
    answer has not begun after ``max(floor, hedge_factor x p90)`` of recent first-byte
    latencies, while requests asked for after it have had theirs (a stalled GET is
    caught after a few round trips, not after the whole chunk's time).

  The floor is ``hedge_min_delay`` (cold: ``4 x`` it) or, with ``hedge_min_delay=None``
  (the default), derived from this load: ``hedge_factor x`` the expected time of the
  chunk at the measured first-byte latency and per-stream rate, at least 0.05 s; derived,
  the body rule waits for 4 comparable reads to finish (no cold delay). Each rule
  compares a read with its peers on the same link now, so a uniformly slow or congested
  link hedges nothing. The delay is re-evaluated while the attempt waits, so reads that
  started before any history existed are hedged as soon as their peers show they are
  stragglers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from asyncload.common.errors import AsyncLoadError, CheckpointFormatError, redact_text
from asyncload.common.latency import HEDGE_POLL, LoadClock, hedge_delay
from asyncload.common.options import HedgePolicy, LoadOptions, RetryPolicy
from asyncload.common.stats import StatsRecorder
from asyncload.storage.base import REQUEST, Listed, Storage
from asyncload.storage.classify import classify, translate
from asyncload.storage.in_flight import InFlight

__all__ = [
    "BATCH_INLINE",
    "RetryingStorage",
    "call_with_retry",
]

log = logging.getLogger("asyncload.retry")
T = TypeVar("T")

#: What an attempt's requests are entered under in the load's :class:`InFlight`: the
#: registry, the file name, the byte range and the attempt's number.
_Track = tuple[InFlight, str, "tuple[int, int] | None", int]

#: Bytes of a :meth:`RetryingStorage.read_batch` read on the loop thread where the store
#: can without waiting (a local file's cached pages: ``Storage.readinto_cached``).
BATCH_INLINE = 1 << 20
#: :meth:`RetryingStorage.when_sent`: seconds after which work for the wait runs where the
#: store cannot say when its requests left (their connections take a loop iteration or two
#: on loopback, their answers at least a round trip); how often a store that can say is
#: asked; the longest it is waited for.
WARM_AFTER = 0.002
WARM_POLL = 0.0002
WARM_WAIT = 0.05


class _Request:
    """One request to the store (an attempt's original or its hedged duplicate): when it
    started and when its answer began. Stores tell through :func:`asyncload.storage.base.first_byte`."""

    __slots__ = ("clock", "first_byte", "key", "started")

    def __init__(self, clock: LoadClock) -> None:
        self.clock = clock
        self.started = clock.now()
        self.first_byte: float | None = None
        #: Its key in the load's :class:`InFlight` (when the attempt is tracked).
        self.key = -1

    def answered(self) -> None:
        if self.first_byte is None:
            self.first_byte = self.clock.now()
            self.clock.answered(self.first_byte - self.started, self.started)


async def _cancel_and_wait(tasks: set[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except BaseException:
            pass


async def _attempt(
    op: Callable[[], Awaitable[T]],
    limit: float | None,
    hedge: HedgePolicy | None,
    stats: StatsRecorder,
    clock: LoadClock,
    nbytes: int,
    track: _Track | None = None,
) -> tuple[T, _Request]:
    """One attempt, with at most one hedged duplicate; the first success wins (returned
    with its request: when it started, when its answer began). Each request is in
    ``track``'s registry from its start until it ends or is cancelled.

    Raises ``asyncio.TimeoutError`` when ``limit`` seconds pass without progress (see the
    module docstring), or the error of the last request to fail."""
    started = clock.now()
    first = _Request(clock)
    requests: dict[asyncio.Future[Any], _Request] = {}
    registry = track[0] if track is not None else None

    def start(req: _Request, hedge: bool = False) -> asyncio.Future[Any]:
        token = REQUEST.set(
            req
        )  # the request's task copies it: the store's first_byte() reaches req
        try:
            fut = asyncio.ensure_future(op())
        finally:
            REQUEST.reset(token)
        requests[fut] = req
        if track is not None:
            req.key = track[0].add(track[1], track[2], track[3], hedge)
        return fut

    pending: set[asyncio.Future[Any]] = {start(first)}
    hedged = False
    last_exc: BaseException | None = None
    try:
        while pending:
            now = clock.now()
            wait: float | None = None
            if limit is not None:
                deadline = clock.deadline(started, limit)
                if now >= deadline:
                    raise TimeoutError()
                wait = deadline - now
            if hedge is not None and not hedged:
                waiting = first.started if first.first_byte is None and clock.first_bytes else None
                after = hedge_delay(hedge, clock, nbytes, waiting_since=waiting)
                if after is None:  # no yardstick yet: look again as peers answer and finish
                    step = HEDGE_POLL if waiting is not None else HEDGE_POLL * 4
                    wait = step if wait is None else min(wait, step)
                else:
                    if now - started >= after and clock.hedges_in_flight < hedge.max_in_flight:
                        hedged = True
                        stats.add(hedges=1)
                        clock.hedges_in_flight += 1
                        log.debug(
                            "hedging a read of %d bytes still running after %.3f s (delay %.3f s, %s)",
                            nbytes,
                            now - started,
                            after,
                            "no answer yet" if first.first_byte is None else "answer begun",
                        )
                        dup = start(_Request(clock), hedge=True)
                        dup.add_done_callback(lambda _f: _hedge_done(clock))
                        pending.add(dup)
                        continue
                    # re-check soon: the delay shrinks as peers finish and build history
                    step = (
                        max(HEDGE_POLL, after - (now - started))
                        if now - started < after
                        else HEDGE_POLL
                    )
                    step = min(step, HEDGE_POLL * 4)
                    wait = step if wait is None else min(wait, step)
            done, pending = await asyncio.wait(
                pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            for t in done:
                if registry is not None:
                    registry.remove(requests[t].key)
                if t.exception() is None:
                    return t.result(), requests[t]
                last_exc = t.exception()
        assert last_exc is not None
        raise last_exc
    finally:
        if pending:
            await _cancel_and_wait(pending)  # type: ignore[arg-type]
        if registry is not None:
            for req in requests.values():
                registry.remove(req.key)  # again for those removed above: harmless


def _hedge_done(clock: LoadClock) -> None:
    clock.hedges_in_flight -= 1


async def call_with_retry(
    op: Callable[[], Awaitable[T]],
    *,
    retry: RetryPolicy,
    stats: StatsRecorder,
    clock: LoadClock,
    url: str,
    byte_range: tuple[int, int] | None,
    hedge: HedgePolicy | None = None,
    on_throttle: Callable[[], None] | None = None,
    timed: bool = True,
    culprit: Callable[[], tuple[str, tuple[int, int]] | None] | None = None,
    data: bool = False,
    in_flight: tuple[InFlight, str] | None = None,
) -> T:
    """Run ``op`` (one storage call about ``byte_range`` of ``url``; ``None``: the whole
    file) with the load's timeout, retry and hedge policy (module docstring), measured on
    the load's ``clock``; translate the final error. Only :class:`RetryingStorage` calls it.

    Raised: :class:`ChunkTimeoutError` when every attempt timed out (it names the URL,
    byte range and attempts), :class:`CheckpointNotFoundError` / :class:`StorageReadError`
    / :class:`CheckpointFormatError` for other failures, at once when retrying cannot help.
    A call of many reads: ``timed=False``, ``op`` records their latencies itself (the call
    only counts as progress); ``culprit()``, the URL and byte range its error names instead
    of ``url`` and ``byte_range`` (the read that failed, or those in flight when the attempt
    timed out). ``in_flight``: the registry and file name its requests are entered under.
    """
    attempts = retry.attempts
    nbytes = max(0, byte_range[1] - byte_range[0]) if byte_range else 0
    for attempt in range(1, attempts + 1):
        t0 = time.monotonic()
        try:
            track = None if in_flight is None else (*in_flight, byte_range, attempt)
            result, request = await _attempt(op, retry.timeout, hedge, stats, clock, nbytes, track)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = classify(exc)
            if failure.throttle and on_throttle is not None:
                on_throttle()
            if not failure.retryable or attempt >= min(attempts, failure.max_attempts or attempts):
                if failure.cause == "timeout":
                    stats.add(timeouts=1)
                where = culprit() if culprit is not None else None
                url, byte_range = where if where is not None else (url, byte_range)
                raise translate(
                    exc,
                    url=url,
                    byte_range=byte_range,
                    attempts=attempt,
                    failure=failure,
                    timeout=retry.timeout,
                ) from exc
            stats.retry(failure.cause)
            delay = min(retry.max_backoff, retry.backoff * (2 ** (attempt - 1)))
            delay = random.uniform(0, delay)  # full jitter
            if failure.retry_after is not None:
                delay = max(delay, min(failure.retry_after, retry.max_backoff))
            log.debug(
                "retrying %s %s after %s (attempt %d of %d) in %.3f s",
                url,
                byte_range,
                failure.cause,
                attempt,
                attempts,
                delay,
            )
            await asyncio.sleep(delay)
        else:
            if data:  # a read of the checkpoint's data: LoadStats.time_to_first_byte
                stats.first_data(
                    request.first_byte if request.first_byte is not None else clock.now()
                )
            now = time.monotonic()
            elapsed = now - t0
            if byte_range is not None and timed:
                stats.latency(elapsed)
                body = None if request.first_byte is None else now - request.first_byte
                clock.finished(elapsed, nbytes, body)
            else:
                clock.last_progress = time.monotonic()
            return result
    raise AssertionError("unreachable")  # pragma: no cover


def _group_span(ranges: Sequence[tuple[str, int, int]]) -> tuple[int, int]:
    """The byte range that a group of reads (``(name, start, end)`` each, read in one thread
    hop) names in its errors: all of them when they are of one file, else the first."""
    name, start, end = ranges[0]
    if all(r[0] == name for r in ranges):
        return min(r[1] for r in ranges), max(r[2] for r in ranges)
    return start, end


class RetryingStorage:
    """The one storage error boundary: every call a load makes to its storage (sizes,
    listings, fingerprints, metadata, probes, data, batched local reads) goes through
    here, and only here are timeout, retry, hedge, classification and translation
    applied. Above it, code sees asyncload errors only; below it, raw ones.

    Reads (:meth:`read`, :meth:`readinto`, :meth:`read_batch`) count ``LoadStats.bytes_read``
    (all but the ``.metadata`` read); hedging applies to remote stores only.

    The policy is fixed when the boundary is made: a load that changes its policy (a
    planner's knobs under a plain ``dcp.load``) makes a new boundary around the same store;
    nothing changes this one's. Every call measures on the load's ``clock``.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        retry: RetryPolicy,
        hedge: HedgePolicy,
        stats: StatsRecorder,
        executor: concurrent.futures.Executor,
        clock: LoadClock | None = None,
        on_throttle: Callable[[], None] | None = None,
        in_flight: InFlight | None = None,
    ) -> None:
        self.raw = storage
        self.retry = retry
        self._hedge_policy = hedge
        self.hedge = hedge if storage.hedgeable and hedge.enabled else None
        self.stats = stats
        if storage.transport:
            stats.set(transport=storage.transport)
        self.executor = executor
        #: The load's clock: the timeout's progress, latencies that drive hedging.
        self.clock = clock if clock is not None else LoadClock()
        #: Called when the store asks to slow down (``concurrency="auto"`` backs off).
        self.on_throttle = on_throttle
        #: The requests of this load not ended yet (shared with :meth:`with_throttle`'s copies).
        self.in_flight = in_flight if in_flight is not None else InFlight(storage.url)

    @classmethod
    def for_options(
        cls,
        storage: Storage,
        options: LoadOptions,
        stats: StatsRecorder,
        executor: concurrent.futures.Executor,
        clock: LoadClock | None = None,
    ) -> RetryingStorage:
        """A boundary with ``options``' retry and hedge policies (a fresh clock unless given)."""
        return cls(
            storage,
            retry=options.retry_policy,
            hedge=options.hedge_policy,
            stats=stats,
            executor=executor,
            clock=clock,
        )

    def with_throttle(self, on_throttle: Callable[[], None]) -> RetryingStorage:
        """The same store, policy, statistics and clock, telling ``on_throttle`` when the
        store asks to slow down (each pipeline its own)."""
        return RetryingStorage(
            self.raw,
            retry=self.retry,
            hedge=self._hedge_policy,
            stats=self.stats,
            executor=self.executor,
            clock=self.clock,
            on_throttle=on_throttle,
            in_flight=self.in_flight,
        )

    @property
    def root(self) -> str:
        return self.raw.root

    @property
    def supports_readinto(self) -> bool:
        return self.raw.supports_readinto

    @property
    def receives_into(self) -> bool:
        return self.raw.receives_into

    @property
    def hedgeable(self) -> bool:
        return self.raw.hedgeable

    def url(self, name: str) -> str:
        return self.raw.url(name)

    async def _call(
        self,
        op: Callable[[], Awaitable[T]],
        name: str,
        byte_range: tuple[int, int] | None,
        *,
        hedge: bool = False,
        timed: bool = True,
        culprit: Callable[[], tuple[str, tuple[int, int]] | None] | None = None,
        data: bool = False,
        tracked: bool = True,
    ) -> T:
        return await call_with_retry(
            op,
            retry=self.retry,
            stats=self.stats,
            clock=self.clock,
            url=self.raw.url(name),
            byte_range=byte_range,
            hedge=self.hedge if hedge else None,
            on_throttle=self.on_throttle,
            timed=timed,
            culprit=culprit,
            data=data,
            in_flight=(self.in_flight, name) if tracked else None,
        )

    async def read(
        self, name: str, start: int, end: int, *, hedge: bool = True, counted: bool = True
    ) -> memoryview:
        """Exactly bytes ``[start, end)`` of file ``name`` (``counted``: in ``bytes_read``,
        which leaves out the checkpoint's ``.metadata``)."""
        if end <= start:
            return memoryview(b"")
        raw = self.raw
        data = await self._call(
            lambda: raw.read(name, start, end), name, (start, end), hedge=hedge, data=counted
        )
        if counted:
            self.stats.add(bytes_read=end - start)
        return memoryview(data).cast("B") if not isinstance(data, memoryview) else data

    @property
    def supports_read_object(self) -> bool:
        return self.raw.supports_read_object

    async def read_object(self, name: str, max_size: int) -> tuple[memoryview | None, int]:
        """The whole of file ``name`` and its size in one request (``supports_read_object``;
        not counted in ``bytes_read``: the checkpoint's ``.metadata``). ``(None, size)`` when
        it is larger than ``max_size``."""
        raw = self.raw
        return await self._call(lambda: raw.read_object(name, max_size), name, None, hedge=True)

    async def read_prefix(self, name: str, n: int) -> tuple[memoryview, int]:
        """The first ``n`` bytes of file ``name`` (all of it when shorter) and its size: one
        request where the store can (wire), a size and a read otherwise. Counted in
        ``bytes_read``."""
        raw = self.raw
        data, size = await self._call(
            lambda: raw.read_prefix(name, n), name, (0, n), hedge=True, data=True
        )
        self.stats.add(bytes_read=len(data))
        return data, int(size)

    async def readinto(
        self,
        name: str,
        start: int,
        buffers: Sequence[memoryview],
        *,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Fill ``buffers`` with the bytes from ``start`` on. A store that reads into caller
        memory does it on an I/O thread and runs ``then`` (a checksum) in the same hop."""
        raw = self.raw
        n = sum(len(b) for b in buffers)
        if raw.supports_readinto:
            loop = asyncio.get_running_loop()

            def job() -> None:
                raw.readinto_sync(name, start, buffers)
                if then is not None:
                    then()

            await self._call(
                lambda: loop.run_in_executor(self.executor, job),
                name,
                (start, start + n),
                data=True,
            )
        else:
            await self._call(
                lambda: raw.readinto(name, start, buffers),
                name,
                (start, start + n),
                hedge=True,
                data=True,
            )
            if then is not None:
                then()
        self.stats.add(bytes_read=n)

    async def read_batch(
        self, reads: Sequence[tuple[str, int, int, Callable[[memoryview], None]]]
    ) -> None:
        """Several tiny reads of a store that reads into caller memory, without a thread hop
        as far as the store can read them on the loop (``Storage.readinto_cached``: a local
        file's cached pages, at most :data:`BATCH_INLINE` bytes), the rest in one hop to an
        I/O thread; each ``(name, start, end, deliver)`` hands its bytes to ``deliver`` on the
        thread that read them, in order. A failure retries the whole batch (its deliveries
        are idempotent copies)."""
        raw = self.raw
        loop = asyncio.get_running_loop()

        def job(todo: Sequence[tuple[str, int, int, Callable[[memoryview], None]]]) -> None:
            for name, start, end, deliver in todo:
                buf = bytearray(end - start)
                raw.readinto_sync(name, start, [memoryview(buf)])
                deliver(memoryview(buf))

        async def attempt() -> None:
            # what the page cache holds is read here, on the loop, without a thread hop (at
            # most BATCH_INLINE bytes); the rest from the first read that is not, on an I/O thread
            i, left = 0, BATCH_INLINE
            while i < len(reads) and reads[i][2] - reads[i][1] <= left:
                name, start, end, deliver = reads[i]
                buf = bytearray(end - start)
                if not raw.readinto_cached(name, start, [memoryview(buf)]):
                    break
                deliver(memoryview(buf))
                left -= end - start
                i += 1
            if i < len(reads):
                await loop.run_in_executor(self.executor, job, reads[i:])

        span = _group_span([(name, start, end) for name, start, end, _ in reads])
        await self._call(attempt, reads[0][0], span, data=True)
        self.stats.add(bytes_read=sum(r[2] - r[1] for r in reads))

    async def readinto_shared(
        self,
        reads: Sequence[tuple[str, int, Sequence[memoryview]]],
        *,
        jobs: int,
        landed: Callable[[int, float], None] | None = None,
    ) -> None:
        """Reads straight into caller memory (a store that reads into it), each ``(name,
        start, buffers)``, by ``jobs`` I/O threads that pull them from one queue: one thread
        hop per thread, not per read. ``landed(i, seconds)`` runs on the I/O thread once read
        ``i`` has landed: once per read, whatever the attempts; an error it raises ends the
        reads and is raised as it is. Each landing is progress for the timeout. A failed read
        stops the other threads after their current read; the next attempt reads what has not
        landed (refilling a buffer is idempotent). The error names the file and byte range of
        the read that failed (a timeout: of the reads in flight)."""
        if not reads:
            return
        raw = self.raw
        loop = asyncio.get_running_loop()
        clock = self.clock
        todo: deque[int] = deque(range(len(reads)))
        sizes = [sum(len(b) for b in buffers) for _, _, buffers in reads]
        lock = threading.Lock()
        times: list[tuple[float, int]] = []
        refused: list[BaseException] = []  # what ``landed`` raised
        culprit: list[tuple[str, tuple[int, int]] | None] = [
            None
        ]  # what the last failed attempt's error is about
        readinto, monotonic = raw.readinto_sync, time.monotonic
        ends = [(name, start, start + n) for (name, start, _), n in zip(reads, sizes)]
        in_flight = self.in_flight
        tries = [0]  # the attempt in progress (each read is in ``in_flight`` on its own)

        def about(ids: list[int]) -> tuple[str, tuple[int, int]] | None:
            """The file of the first of ``ids`` and the span of those of that file."""
            if not ids:
                return None
            name = reads[ids[0]][0]
            return raw.url(name), _group_span([ends[i] for i in ids if ends[i][0] == name])

        async def attempt() -> None:
            stop = False
            taken: set[int] = set()  # popped by this attempt's threads, not landed yet
            failed: list[int] = []  # the read whose error ended this attempt
            tries[0] += 1
            number = tries[0]

            def job() -> None:
                while True:
                    with lock:
                        if stop or refused or not todo:
                            return
                        i = todo.popleft()
                        taken.add(i)
                    name, start, buffers = reads[i]
                    t0 = monotonic()
                    key = in_flight.add(name, (start, ends[i][2]), number)
                    try:
                        readinto(name, start, buffers)
                    except BaseException:
                        with lock:
                            failed.append(i)
                        raise
                    finally:
                        in_flight.remove(key)
                    seconds = monotonic() - t0
                    with lock:
                        if stop:  # the attempt has ended: the read went back to the queue
                            return
                        taken.discard(i)
                        times.append((seconds, sizes[i]))
                    clock.last_progress = clock.now()
                    if landed is not None:
                        try:
                            landed(i, seconds)
                        except BaseException as exc:
                            with lock:
                                refused.append(exc)
                            return

            futures = [
                loop.run_in_executor(self.executor, job) for _ in range(min(jobs, len(todo)))
            ]
            try:
                await asyncio.gather(*futures)
            except BaseException:
                with lock:  # the read that failed; else (a timeout) those still in flight
                    culprit[0] = about(failed[:1] or sorted(taken))
                raise
            finally:
                with lock:
                    stop = True
                    todo.extendleft(sorted(taken, reverse=True))
                    taken.clear()

        await self._call(
            attempt,
            reads[0][0],
            _group_span(ends),
            timed=False,
            culprit=lambda: culprit[0],
            data=True,
            tracked=False,
        )
        if refused:
            raise refused[0]
        for seconds, nbytes in times:
            self.stats.latency(seconds)
            clock.finished(seconds, nbytes)
        self.stats.add(bytes_read=sum(sizes))

    async def _stat(self, op: Callable[[], Awaitable[T]], name: str) -> T:
        """``size`` or ``fingerprint``: of a store whose calls finish inline (a local file's
        ``stat``), once as it is (a tenth of the retrying call's cost); after an error, and
        for every other store, through :meth:`_call`."""
        if self.raw.calls_inline:
            try:
                value = await op()
            except Exception:
                pass  # again below, with retries and translation
            else:
                self.clock.last_progress = time.monotonic()
                return value
        return await self._call(op, name, None)

    async def size(self, name: str) -> int:
        raw = self.raw
        return int(await self._stat(lambda: raw.size(name), name))

    def prefetch_sizes(self) -> bool:
        """Let the store start listing the checkpoint's files now, where it can (a hint:
        :meth:`sizes` uses the listing, and waits for it only where it would list anyway).
        Whether a listing was started."""
        prefetch = getattr(self.raw, "prefetch_sizes", None)
        return bool(prefetch()) if prefetch is not None else False

    async def listing_for_peers(self, wait: float | None) -> list[Listed] | None:
        """The store's listing of the checkpoint's files (:meth:`prefetch_sizes`), for the
        other ranks of a load: waited for up to ``wait`` seconds; None where there is none."""
        given = getattr(self.raw, "listing_for_peers", None)
        return await given(wait) if given is not None else None

    def use_listing(self, entries: list[Listed]) -> bool:
        """Take another rank's listing of the checkpoint's files as this store's own (no
        listing request of its own); whether the store could."""
        use = getattr(self.raw, "use_listing", None)
        return bool(use(entries)) if use is not None else False

    def when_sent(self, requests: int, work: Callable[[], None]) -> None:
        """Run ``work`` (and the store's own :meth:`~Storage.warm`) on the loop while the
        load's first requests are on the wire: once ``requests`` more of them have been
        written, so that it never holds one of them back; where the store cannot tell (its
        client sends on threads of its own), ``WARM_AFTER`` seconds from now."""
        loop = asyncio.get_running_loop()
        raw = self.raw
        start = raw.requests_sent()

        def run() -> None:
            raw.warm()
            work()

        if start is None:
            loop.call_later(WARM_AFTER, run)
            return
        deadline = loop.time() + WARM_WAIT

        def check() -> None:
            sent = raw.requests_sent()
            if sent is not None and sent < start + requests and loop.time() < deadline:
                loop.call_later(WARM_POLL, check)
            else:
                run()

        loop.call_soon(check)

    async def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """Sizes of several files in one listing where the store can (an optimisation: the
        names it could not list are left out, ask :meth:`size` for those)."""
        try:
            return await asyncio.wait_for(self.raw.sizes(names), self.retry.timeout)
        except Exception as exc:
            log.debug(
                "listing %s failed (%s); asking for each file's size instead",
                self.raw.url(""),
                redact_text(f"{type(exc).__name__}: {exc}"),
            )
            return {}

    @property
    def fingerprints(self) -> bool:
        """Whether the store can give :meth:`fingerprint`s (the remote stores pin versions
        on every read instead)."""
        return type(self.raw).fingerprint is not Storage.fingerprint

    async def fingerprint(self, name: str) -> object | None:
        raw = self.raw
        if not self.fingerprints:
            return None
        return await self._stat(lambda: raw.fingerprint(name), name)

    async def listdir(self) -> list[str]:
        """Names of the plain files directly under the root (``[]`` when it cannot be listed)."""
        raw = self.raw
        try:
            return await self._call(raw.listdir, "", None)
        except CheckpointFormatError:  # a listing larger than max_metadata_size: say so
            raise
        except AsyncLoadError as exc:  # a listing is a last resort: say why, find nothing
            log.debug("listing %s failed: %r", raw.url(""), exc)
            return []

    async def aclose(self) -> None:
        await self.raw.aclose()
