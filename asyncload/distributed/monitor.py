"""Monitored collectives: every wait of a multi-rank load on another rank is bounded.

A :class:`Monitor` keeps a few keys in the process group's store: each rank's status
("reading data: 12 of 40 chunks"), its failure if it had one, and barrier arrivals. A
rank that raises posts its error there at once and every other rank raises
:class:`DistributedLoadError` naming it; a rank that makes no progress for
``collective_timeout`` seconds is declared stalled by the first rank waiting on it, and
every rank raises an error naming it and its last status (a rank waiting on many peers reads
rank 0's digest of the idle ranks, one key, not each peer's status:
:mod:`asyncload.distributed.idle_watch`). Collectives themselves
(gather/scatter of plans, all_gather of needs) are only entered once a monitored
barrier has seen every rank arrive, so they cannot hang on a rank that has already
failed. While it runs, each rank also keeps a progress record there (bytes, rate, the storage
requests it has in flight: :mod:`asyncload.distributed.lateness`), which ``LoadHandle.rank_progress()``
reads, and a rank that has waited ``LoadOptions.late_rank_log_after`` seconds on others logs
a WARNING naming the slowest of them. Barriers are waited at through
:mod:`asyncload.distributed.barrier` (one watcher per barrier reads the missing ranks' keys;
the others poll one key), so that their traffic grows with the ranks, not ranks squared.
Used by the multi-rank driver (:mod:`asyncload.engine.driver`) and by byte sharing
(:mod:`asyncload.distributed.share_session`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from asyncload.common.errors import DistributedLoadError
from asyncload.distributed.barrier import (
    BEAT_INTERVAL,
    BarrierWait,
    arrive,
    poll_interval,
    read_present,
    silent_after,
)
from asyncload.distributed.idle_watch import IDLE_KEY, IdlePoster, IdleView, listed_after
from asyncload.distributed.lateness import (
    SHOWN_IN_FLIGHT,
    RankProgress,
    Rate,
    decode,
    encode,
    late_message,
)
from asyncload.distributed.values import fresh_of
from asyncload.storage import InFlight

__all__ = ["Monitor", "PeerWait"]

log = logging.getLogger("asyncload.monitor")

#: Seconds between checks for another rank's failure while reading.
_WATCH_INTERVAL = 0.1
#: Seconds between stall checks and heartbeats while waiting on another rank.
_BEAT_INTERVAL = BEAT_INTERVAL
#: A wait's deadline (:class:`PeerWait`) is ``collective_timeout`` plus this: where a peer
#: is silent (no heartbeat either), the stall check, which names it, ends the wait first.
DEADLINE_SLACK = 2 * BEAT_INTERVAL
#: A late-rank line reads the records of at most this many of the peers waited on (with
#: more, those rank 0's digest lists as idle longest: :mod:`asyncload.distributed.idle_watch`).
LATE_RECORDS = 64
#: Status updates during reading are written at most this often; so are progress records
#: (and only when they changed).
_PROGRESS_INTERVAL = 0.5
#: A progress record that showed bytes moving is written again after this many seconds even
#: when nothing else changed (a rank that stops shows its rate fall to 0).
_RATE_REFRESH = 2.0


def _group_store(group: Any) -> Any:
    pg: Any = group if group is not None else dist.group.WORLD
    try:
        return dist.distributed_c10d._get_process_group_store(pg)
    except Exception as exc:
        raise DistributedLoadError(
            "asyncload needs the process group's store to coordinate a multi-rank load and this "
            "group has none "
            f"({type(exc).__name__}: {exc})"
        ) from exc


_seq_lock = threading.Lock()
_seq: dict[str, int] = {}
#: Per group: the monitor of the load before this one (its keys go once every rank has
#: passed the next load's first barrier, which also tells its background sends that every
#: rank finished it).
_previous: dict[str, Monitor] = {}


def _group_name(group: Any) -> str:
    pg: Any = group if group is not None else dist.group.WORLD
    return str(getattr(pg, "group_name", "") or dist.distributed_c10d._get_process_group_name(pg))


def _next_seq(group: Any) -> tuple[str, int]:
    name = _group_name(group)
    with _seq_lock:
        n = _seq.get(name, 0)
        _seq[name] = n + 1
    return name, n


def _utc(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 10)} UTC"


def _remote_error(value: bytes | str) -> DistributedLoadError:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    rank_s, _, rest = text.partition("|")
    doing, _, message = rest.partition("|")
    try:
        rank: int | None = int(rank_s)
    except ValueError:
        rank, doing, message = None, "", text
    err = DistributedLoadError(message, rank=rank, doing=doing)
    err._asyncload_posted = True  # type: ignore[attr-defined]
    return err


class _GuardedStore:
    """The group's store, with its failures (the rank hosting it exited, the connection
    broke) raised as DistributedLoadError."""

    def __init__(self, store: Any, rank: int, prefix: str = "") -> None:
        self._store = store
        self._rank = rank
        self._prefix = prefix

    def key_name(self, key: str) -> str:
        """``key`` as the group's store names it (in errors)."""
        return self._prefix + key

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._store, name)(*args)
        except RuntimeError as exc:
            raise DistributedLoadError(
                f"rank {self._rank} lost the process group's store "
                f"({type(exc).__name__}: {str(exc)[:300]}); the rank that hosts it (the rendezvous "
                "master, usually rank 0) has probably exited or "
                "crashed",
                doing="hosting the store",
            ) from exc

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)


def _idle_listed(
    store: Any, world: int, timeout: float, peers: Sequence[int], listed: dict[int, float]
) -> tuple[int, float, str] | None:
    """The peer rank 0's digest lists as idle for ``timeout`` (:func:`silent_after`; the
    longest idle first), with its status read now (one key)."""
    over = [(s, r) for r in peers if (s := listed.get(r, 0.0)) >= silent_after(world, timeout)]
    if not over:
        return None
    seconds, rank = max(over)
    value = read_present(store, [f"st/{rank}"])[0]
    return rank, seconds, value.decode("utf-8", "replace").partition("|")[2]


class Monitor:
    """One load's view of the other ranks, through a few keys in the group's store.

    ``st/<r>``: rank r's status, ``"<counter>@<fresh>|<text>"`` (the counter moves on progress,
    phase changes and, while r waits on others, once a second; ``fresh``, wall-clock seconds,
    only on progress: r's own, or progress r saw on what it waits for (:class:`PeerWait`),
    never on a heartbeat); ``at/<barrier>/<r>``:
    ``arrived`` or, when r was given up on, ``aborted`` (set with compare-and-set so a
    rank cannot arrive after the others left without it); ``abort``: the first failure,
    ``"<rank>|<doing>|<message>"``, which every rank raises; ``pg/<r>``: rank r's progress
    record (:func:`~asyncload.distributed.lateness.encode`; not a sign of life: a rank whose
    reads hang keeps it current, and stall detection reads only ``st/<r>``).

    ``late_after``: ``LoadOptions.late_rank_log_after`` (:meth:`idle_peer` logs late ranks).
    The barriers' own keys and their watcher: :mod:`asyncload.distributed.barrier`.
    """

    def __init__(self, group: Any, timeout: float | None, late_after: float | None = 60.0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        self.group_name, self.seq = _next_seq(group)
        self.store = _GuardedStore(
            dist.PrefixStore(f"asyncload/{self.seq}/", _group_store(group)),
            self.rank,
            f"asyncload/{self.seq}/",
        )
        self._lock = threading.Lock()
        self._counter = 0
        #: Wall-clock time of the freshest progress this rank knows of on its waits' chain.
        self._fresh = time.time()
        self._text = ""
        self._last_write = 0.0
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._status_cache: dict[int, tuple[bytes, float]] = {}
        self._written: list[str] = []
        # this rank's progress record (guarded by _lock; written under _record_lock)
        self.late_after = late_after
        self._bytes: tuple[int, int | None] = (0, None)
        self._rate = Rate()
        self._own_progress_at = time.monotonic()
        self._late_logged_at: float | None = None
        self._in_flight: Callable[[], InFlight | None] | None = None
        self._record_lock = threading.Lock()
        self._record_state: tuple[Any, ...] | None = None
        self._record_at = 0.0
        self._record_rate = 0.0
        self._reporting: threading.Event | None = None
        self._idle_poster: IdlePoster | None = None
        self._idle_view = IdleView(self.world)
        #: Set from another thread to stop waiting (LoadHandle.cancel).
        self.cancelled: threading.Event | None = None
        #: Set by a sharing session that lets this rank return before the others finish
        #: (``ShardedLoadPlanner(wait_for_peers=False)``): :meth:`finish` then waits for nobody
        #: and calls ``after_return`` (which hands this rank's pending sends to the background).
        self.returns_early = False
        self.after_return: Callable[[], None] | None = None
        #: Set once every rank is known to have finished this load (a later load on the group
        #: passed its first barrier, or every rank arrived at "done").
        self.all_finished = threading.Event()
        with _seq_lock:
            # the previous load's keys go once every rank has passed this load's first barrier
            self._to_delete: Monitor | None = _previous.get(self.group_name)
            _previous[self.group_name] = self
        self.status("starting the load")

    def key_name(self, key: str) -> str:
        """``key`` of this load's part of the store as the group's store names it."""
        return self.store.key_name(key)

    # --- this rank's status ---------------------------------------------------------------

    def _write_status(self) -> None:
        key = f"st/{self.rank}"
        try:
            self.store.set(key, f"{self._counter}@{self._fresh:.3f}|{self._text}")
        except Exception:
            log.debug("could not write status", exc_info=True)
        self._last_write = time.monotonic()
        if key not in self._written:
            self._written.append(key)

    def status(self, text: str) -> None:
        """Say what this rank is doing now (also counts as progress)."""
        log.debug("rank %d: %s", self.rank, text)
        with self._lock:
            self._counter += 1
            self._text = text
            self._fresh = max(self._fresh, time.time())
            self._own_progress_at = time.monotonic()
            self._write_status()

    @property
    def doing(self) -> str:
        return self._text

    def progress(self, detail: str | None = None) -> None:
        """Count progress (rate-limited store write)."""
        with self._lock:
            self._counter += 1
            if detail is not None:
                self._text = detail
            self._fresh = max(self._fresh, time.time())
            now = self._own_progress_at = time.monotonic()
            if now - self._last_write >= _PROGRESS_INTERVAL:
                self._write_status()

    def relay(self, fresh: float) -> None:
        """Progress seen (at ``fresh``, wall clock) on what this rank waits for: this rank's
        own status carries it on (from its next write), so that ranks waiting on this one see
        a chain of waits that ends in progress as progress, and a cycle of waits as none."""
        with self._lock:
            if fresh > self._fresh:
                self._fresh = fresh

    def peer_wait(
        self,
        peers: Sequence[int],
        what: str,
        blame: Callable[[], list[int]] | None = None,
    ) -> PeerWait:
        """A deadline for one wait of this rank on ``peers`` (:class:`PeerWait`)."""
        return PeerWait(self, peers, what, blame)

    def beat(self) -> None:
        """A heartbeat while this rank waits on others: it is alive, not stalled."""
        with self._lock:
            if time.monotonic() - self._last_write >= _BEAT_INTERVAL:
                self._counter += 1
                self._write_status()

    # --- this rank's progress record --------------------------------------------------------

    def count_bytes(self, done: int, total: int | None) -> None:
        """``done`` of this rank's ``total`` destination bytes are in (progress). The record
        is written by the reporter thread (:meth:`start_reporting`), off the caller's thread,
        and here once all are in."""
        now = time.monotonic()
        with self._lock:
            self._bytes = (done, total)
            self._rate.add(done, now)
            self._fresh = max(self._fresh, time.time())
            self._own_progress_at = now
        if total is not None and done >= total:
            self.publish(force=True)

    def start_reporting(self, in_flight: Callable[[], InFlight | None]) -> None:
        """Keep this rank's progress record current, with the requests ``in_flight()``
        holds, from a thread of its own (``asyncload-progress-<rank>``: a rank whose reads or
        event loop hang still shows what it waits for) until :meth:`finish` or :meth:`fail`."""
        self._in_flight = in_flight
        if self._reporting is not None:
            return
        stop = self._reporting = threading.Event()
        threading.Thread(
            target=_report,
            args=(weakref.ref(self), stop),
            name=f"asyncload-progress-{self.rank}",
            daemon=True,
        ).start()

    def _stop_reporting(self) -> None:
        if self._reporting is not None:
            self._reporting.set()
        self.publish(force=True)

    def publish(self, force: bool = False) -> None:
        """Write this rank's progress record when it changed since the last one (bytes, the
        requests in flight, a rate still falling), or when ``force``."""
        source = self._in_flight
        registry = source() if source is not None else None
        now = time.monotonic()
        with self._lock:
            done, total = self._bytes
            rate = self._rate.rate(now)
        state = (done, total, registry.keys() if registry is not None else None)
        key = f"pg/{self.rank}"
        with self._record_lock:
            refresh = self._record_rate > 0 and now - self._record_at >= _RATE_REFRESH
            if not force and state == self._record_state and not refresh:
                return
            requests = registry.oldest(SHOWN_IN_FLIGHT) if registry is not None else []
            try:
                self.store.set(key, encode(done, total, rate, requests))
            except Exception:
                log.debug("could not write the progress record", exc_info=True)
                return
            self._record_state, self._record_at, self._record_rate = state, now, rate
            if key not in self._written:
                self._written.append(key)

    def own_progress(self) -> RankProgress:
        """This rank's progress now (not through the store)."""
        source = self._in_flight
        registry = source() if source is not None else None
        with self._lock:
            done, total = self._bytes
            rate = self._rate.rate()
            text = self._text
        requests = tuple(registry.oldest(SHOWN_IN_FLIGHT)) if registry is not None else ()
        return RankProgress(self.rank, done, total, rate, requests, text, 0.0)

    def records(self, ranks: Sequence[int]) -> list[RankProgress]:
        """The progress of ``ranks`` as their records in the store say (one round trip when
        every rank has written one)."""
        keys = [f"st/{r}" for r in ranks] + [f"pg/{r}" for r in ranks]
        values = read_present(self.store, keys)
        n = len(ranks)
        return [
            decode(
                r, values[n + i] or None, values[i].decode("utf-8", "replace").partition("|")[2]
            )
            for i, r in enumerate(ranks)
        ]

    def rank_progress(self) -> list[RankProgress]:
        """Every rank's progress, by rank (this one's as it is now, the others' as their last
        records say)."""
        others = self.records([r for r in range(self.world) if r != self.rank])
        return sorted([*others, self.own_progress()], key=lambda p: p.rank)

    @property
    def reports(self) -> bool:
        """Whether this rank keeps a progress record (:meth:`start_reporting`)."""
        return self._reporting is not None

    def late_wait(self, now: float) -> float | None:
        """Seconds this rank has waited without progress of its own, when a late-rank line
        is due (``late_after`` waited, and as long since the last line); else None."""
        after = self.late_after
        if after is None:
            return None
        waited = now - self._own_progress_at
        logged = self._late_logged_at
        if waited < after or (logged is not None and now - logged < after):
            return None
        return waited

    def logged_late(self, now: float) -> None:
        self._late_logged_at = now

    def _check_late(
        self, peers: Sequence[int], now: float, listed: dict[int, float] | None
    ) -> None:
        """Log (WARNING) the slowest of ``peers`` when this rank has waited on them, without
        progress of its own, for ``late_after`` seconds; again at most that often. ``listed``:
        rank 0's digest of the idle ranks as this beat read it (None: none read)."""
        waited = self.late_wait(now)
        if waited is None or not peers or self.late_after is None:
            return
        self.logged_late(now)
        read = list(peers)
        if len(read) > LATE_RECORDS:  # many peers: those rank 0's digest lists idle longest
            if listed is None:
                listed = self._idle_view.read(self.store, now) or {}
            read = sorted(read, key=lambda r: -listed.get(r, 0.0))[:LATE_RECORDS]
        try:
            records = self.records(read)
        except Exception:
            log.debug("could not read the other ranks' progress records", exc_info=True)
            return
        log.warning(
            "%s", late_message(self.rank, waited, self._text, self.late_after, records, peers)
        )

    # --- failures -------------------------------------------------------------------------

    def fail(self, exc: BaseException, doing: str) -> None:
        """Post this rank's failure (or a peer's that this rank found, such as a broken
        connection) so that every other rank raises at once."""
        self._stop_reporting()
        if getattr(exc, "_asyncload_posted", False):
            return  # read from the store, or posted when it was raised
        if (
            isinstance(exc, DistributedLoadError)
            and exc.rank is not None
            and exc.rank != self.rank
        ):
            value = f"{exc.rank}|{exc.doing}|{exc}"  # a peer's failure this rank saw first
        else:
            kind = (
                "the load was cancelled"
                if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
                else f"{type(exc).__name__}: {exc}"
            )
            value = f"{self.rank}|{doing}|rank {self.rank} failed while {doing}: {kind}"
        try:
            self.post_abort(value[:4000])
            exc._asyncload_posted = True  # type: ignore[attr-defined]
        except Exception:
            log.warning("could not post this rank's failure to the other ranks", exc_info=True)
        self.status(f"failed while {doing}")

    def post_abort(self, value: str) -> None:
        """Post a failure, ``"<rank>|<doing>|<message>"``, unless one is posted already, and
        move the event count that waiting ranks poll (:mod:`asyncload.distributed.barrier`)."""
        self._written.extend(["abort", "ev"])
        self.store.compare_set("abort", "", value)
        self.store.add("ev", 1)

    def check(self) -> None:
        """Raise DistributedLoadError if any rank failed or was given up on."""
        if self.store.check(["abort"]):
            err = _remote_error(self.store.get("abort"))
            if err.rank is not None and not 0 <= err.rank < self.world:
                err.rank = None  # a failure posted in the name of a rank outside the group
            raise err

    def _give_up(
        self, rank: int, barrier: str | None, idle: float, status: str, doing: str
    ) -> None:
        """Declare ``rank`` stalled (unless it arrives at ``barrier`` right now) and raise."""
        if barrier is not None:
            got = self.store.compare_set(f"at/{barrier}/{rank}", "", "aborted")
            if got == b"arrived":
                return
        what = status or "it had not started the load"
        message = (
            f"rank {rank} made no progress for {idle:.1f} s (LoadOptions.collective_timeout="
            f"{self.timeout}); its last status: {what}; rank {self.rank} gave up on it while "
            f"{doing}"
        )
        self.post_abort(f"{rank}|{what}|{message}")
        self.check()
        raise DistributedLoadError(
            message, rank=rank, doing=what
        )  # pragma: no cover - check() raised

    def start_idle_watch(self) -> None:
        """On the group's rank 0: post the idle ranks once a beat until the load is over
        (:mod:`asyncload.distributed.idle_watch`), for the ranks that wait on many peers."""
        if self.rank != 0 or self.world < 2 or self._idle_poster is not None:
            return
        self._idle_poster = IdlePoster(
            self.store, self.world, listed_after(self.world, self.timeout)
        )
        self._written.append(IDLE_KEY)
        self._idle_poster.start(self)

    def load_over(self) -> bool:
        """Every rank has finished this load, or one failed (the idle watch stops)."""
        if self.all_finished.is_set():
            return True
        store = self.store
        return bool(store.check(["abort"])) or int(store.add("n/done", 0)) >= self.world

    def idle_peer(self, peers: Sequence[int]) -> tuple[int, float, str] | None:
        """A peer whose status has not changed for ``timeout`` seconds, with its idle time and
        status. Logs the slowest of ``peers`` when this rank has waited on them long enough
        (``late_after``). Reads rank 0's digest of the idle ranks (one key) while it moves,
        else the peers' statuses."""
        now = time.monotonic()
        listed = None
        if self.timeout is not None:  # read once a beat, for the verdict and the late line
            listed = self._idle_view.read(self.store, now)
            if IDLE_KEY not in self._written:
                self._written.append(IDLE_KEY)
        self._check_late(peers, now, listed)
        if self.timeout is None:
            return None
        if listed is not None:
            return _idle_listed(self.store, self.world, self.timeout, peers, listed)
        for r, value in zip(peers, self.statuses(peers, now)):
            seen = self._seen.get(r)
            if seen is None or seen[0] != value:
                self._seen[r] = (value, now)
                continue
            idle = now - seen[1]
            if idle >= silent_after(self.world, self.timeout):
                return r, idle, value.decode("utf-8", "replace").partition("|")[2]
        return None

    def statuses(self, peers: Sequence[int], now: float) -> list[bytes]:
        """The status values of ``peers``, read now unless read within half a beat (one round
        trip for all of them; two when one has written no status yet)."""
        stale = [
            r
            for r in peers
            if (c := self._status_cache.get(r)) is None or now - c[1] >= 0.5 * _BEAT_INTERVAL
        ]
        if stale:
            for r, value in zip(stale, read_present(self.store, [f"st/{r}" for r in stale])):
                self._status_cache[r] = (value, now)
        return [self._status_cache[r][0] for r in peers]

    # --- barriers -------------------------------------------------------------------------

    def _passed(self) -> None:
        """After the first barrier every rank has finished the previous load: drop its keys."""
        prev, self._to_delete = self._to_delete, None
        if prev is not None:
            prev.all_finished.set()  # its background sends stop waiting for the other ranks
            for k in set(prev._written):
                try:
                    prev.store.delete_key(k)
                except Exception:
                    break

    def barrier(self, name: str, doing: str) -> None:
        """Wait (caller's thread) until every rank arrives; raise on a failure or a stall."""
        self.status(doing)
        wait = BarrierWait(self, name, doing)
        wait.arrive()
        delay = wait.first_delay
        while not wait.poll():
            time.sleep(delay)
            delay = min(wait.max_delay, delay * 2)
        self._passed()

    async def abarrier(self, name: str, doing: str) -> None:
        """:meth:`barrier` for the event loop."""
        self.status(doing)
        wait = BarrierWait(self, name, doing)
        wait.arrive()
        delay = wait.first_delay
        while not wait.poll():
            await asyncio.sleep(delay)
            delay = min(wait.max_delay, delay * 2)
        self._passed()

    def finish(self, doing: str) -> None:
        """This rank's end of the load (the driver's last step, caller's thread).

        By default every rank waits here for all the others ("done" barrier, then one
        collective, so that no rank (rank 0 hosts the store) leaves while another still
        reads the barrier's keys): a failure anywhere is raised everywhere. When the sharing
        session set :attr:`returns_early`, this rank waits for nobody: it raises any failure
        known by now, marks itself done (so peers stop waiting on its status) and calls
        :attr:`after_return`, which hands the bytes it still owes peers to the background."""
        self._stop_reporting()
        if not self.returns_early:
            self.barrier("done", doing)
            if self.world > 1:
                dist.barrier(group=self.group)
            self.all_finished.set()
            return
        self.check()
        arrive(self, "done")  # counted: the others' wait at "done" reads the count
        if self.after_return is not None:
            self.after_return()
        else:
            self.status("finished its load")

    def finished(self, rank: int) -> bool:
        """Whether ``rank`` has finished its part of the load (returned early or passed "done")."""
        return bool(self.store.check([f"at/done/{rank}"]))

    async def wait_on(self, fut: asyncio.Future[Any], peers: Sequence[int], doing: str) -> Any:
        """Await ``fut`` (an exchange with ``peers``); raise if one of them stalls, or makes
        no progress on its way to this exchange for ``timeout`` while it still beats
        (:class:`PeerWait`)."""
        wait = self.peer_wait(peers, doing)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=_BEAT_INTERVAL)
            if done:
                return fut.result()
            self.beat()
            idle = self.idle_peer(peers)
            if idle is not None:
                rank, seconds, status = idle
                self._give_up(rank, None, seconds, status, doing)
            wait.check()

    async def await_together(self, fut: asyncio.Future[Any], name: str, doing: str) -> Any:
        """Await ``fut``, this rank's part of a collective that every rank runs at once (on a
        thread of its own), then wait until every rank's part is done (barrier ``name``);
        its result. Waiting, this rank polls one key and beats; the barrier's watcher watches
        every rank whose part is not done and gives up on one without progress for
        ``timeout`` (:class:`~asyncload.distributed.barrier.BarrierWait`): O(W) store
        operations per beat for the group, where each rank watching every other one
        (:meth:`wait_on`) costs O(W x W). A failure posted by any rank ends the wait on every
        rank. Raises what ``fut`` raises."""
        wait = BarrierWait(self, name, doing)
        wait.enter()
        delay = wait.first_delay
        result: Any = None
        arrived = False
        while True:
            if not arrived and fut.done():
                result = fut.result()
                wait.arrive()
                arrived, delay = True, wait.first_delay
            if wait.poll():
                return result
            if arrived:
                await asyncio.sleep(delay)
            else:
                await asyncio.wait({fut}, timeout=delay)
            delay = min(wait.max_delay, delay * 2)

    async def watch(self) -> None:
        """Raise as soon as any rank posts a failure (runs beside the reads and sends; on
        rank 0 it starts the idle ranks' digest)."""
        self.start_idle_watch()
        interval = max(_WATCH_INTERVAL, poll_interval(self.world))
        while True:
            await asyncio.sleep(interval)
            self.check()


class PeerWait:
    """One wait of a rank on ``peers`` for ``what``, with a deadline measured from when the
    wait began: when ``collective_timeout`` passes without progress on what it waits for,
    the waiting rank posts a failure naming the rank it waits on (``blame()``, else the
    first of ``peers``), what it waited for and since when, and every rank raises it.

    Progress on what it waits for, which resets the deadline: :meth:`moved` (evidence the
    caller has: a ring's counters moved, a send landed), or a peer's ``fresh`` stamp
    (:func:`~asyncload.distributed.values.fresh_of`) rising past the wait's start and past
    what this wait saw of it before: the peer made progress of its own, or saw progress on what
    it waits for in turn (each wait relays it: :meth:`Monitor.relay`). A heartbeat moves no
    stamp: ranks that keep beating while they wait on each other in a cycle stop relaying
    once they have seen each other's last stamp, and the first deadline to pass ends the
    load. The deadline is ``collective_timeout`` + :data:`DEADLINE_SLACK` after the last
    progress; checked once a beat (:meth:`check`), so the error comes at most a beat and a
    round trip after it. The peers' stamps are read (one round trip, shared with the stall
    check's reads through the monitor's status cache) from ``timeout / 2`` after the wait
    began, every ``max(beat, timeout / 4)``, and at the deadline: a shorter wait costs no
    store operation (docs/distributed.md, "Every wait has a bound")."""

    def __init__(
        self,
        monitor: Monitor,
        peers: Sequence[int],
        what: str,
        blame: Callable[[], list[int]] | None = None,
    ) -> None:
        self.monitor = monitor
        self.peers = list(peers)
        self.what = what
        self.blame = blame
        self.began = time.time()
        self._began_at = time.monotonic()
        self.since = self._began_at
        self._since_wall = self.began
        self._base: dict[int, float] = {}
        self._read_at = self._began_at

    def moved(self) -> None:
        """Progress on what this wait waits for: its deadline starts again."""
        self.since = time.monotonic()
        self._since_wall = time.time()

    def check(self) -> None:
        """Read the peers' stamps (from the monitor's status cache when fresh); raise
        DistributedLoadError (posted for every rank) once the deadline passed."""
        m = self.monitor
        if m.timeout is None or not self.peers:
            return
        now = time.monotonic()
        limit = m.timeout + DEADLINE_SLACK
        due = now - self.since >= limit
        if not due and (
            now - self._began_at < m.timeout / 2
            or now - self._read_at < max(_BEAT_INTERVAL, m.timeout / 4)
        ):
            return  # stamps read from half the timeout on, every quarter, and at the deadline
        self._read_at = now
        values = m.statuses(self.peers, now)
        for r, value in zip(self.peers, values):
            f = fresh_of(value)
            if f is None:
                continue
            if f > self._base.get(r, self.began):  # progress since the wait began
                self._base[r] = f
                self.moved()
                m.relay(f)
        waited = now - self.since
        if waited < limit:
            return
        named = self.blame() if self.blame is not None else []
        named = [r for r in named if r in self.peers] or self.peers
        rank = named[0]
        status = values[self.peers.index(rank)].decode("utf-8", "replace").partition("|")[2]
        what = status or "it had not started the load"
        since = (
            f"since {_utc(self.began)}"
            if self._since_wall == self.began
            else f"since {_utc(self.began)}, the last progress on it at {_utc(self._since_wall)}"
        )
        message = (
            f"rank {m.rank} waited {now - self._began_at:.1f} s ({since}) for {self.what}: "
            f"rank(s) {named} made no progress on it for {waited:.1f} s "
            f"(LoadOptions.collective_timeout={m.timeout}) though still alive (ranks waiting on "
            f"each other in a cycle, or a rank stuck while its heartbeat runs); rank {rank}'s "
            f"last status: {what}"
        )
        m.post_abort(f"{rank}|{what}|{message}")
        m.check()
        raise DistributedLoadError(message, rank=rank, doing=what)  # pragma: no cover


def _report(ref: weakref.ReferenceType[Monitor], stop: threading.Event) -> None:
    """The reporter thread of :meth:`Monitor.start_reporting` (holds the monitor weakly)."""
    while not stop.wait(_PROGRESS_INTERVAL):
        monitor = ref()
        if monitor is None:
            return
        try:
            monitor.publish()
        except Exception:  # pragma: no cover - publish logs its own store errors
            log.debug("progress reporter failed", exc_info=True)
        del monitor
