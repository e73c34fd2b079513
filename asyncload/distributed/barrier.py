"""The monitor's barriers at thousands of ranks: waiting traffic that grows with the ranks,
not with ranks squared (docs/distributed.md#waits-at-scale).

Every rank of a multi-rank load waits at a few barriers
(:meth:`~asyncload.distributed.monitor.Monitor.barrier`), all on one store: rank 0's, which
serves one operation at a time. A waiting rank must still learn at once that the barrier is
done or that a rank failed, a stalled rank must still be given up on by name, and a rank
that waits long must still log who is late. Keys, beside the monitor's own (inside its
prefix):

``at/<b>/<r>``  rank r's arrival: ``arrived``, or ``aborted`` when the others gave up on it
                (compare-and-set, so a rank cannot arrive after the others left without it)
``n/<b>``       arrivals so far (``add``)
``wa/<b>``      the watcher, the one rank that reads the missing ranks' keys: the first to
                arrive; a waiter takes over (compare-and-set) when the watcher's status
                stands still for :data:`TAKEOVER_BEATS` beats
``late/<b>``    the watcher's digest of the missing ranks' records
                (:func:`~asyncload.distributed.lateness.digest`): what every waiter's late-rank
                line says
``ev``          the load's event count, moved by the last arrival of every barrier and by
                every failure posted (:meth:`Monitor.post_abort`)

A waiting rank polls ``ev`` alone (one operation of one key) and reads the count and
``abort`` only when it moved; once per beat it writes its status (the heartbeat) and reads
the watcher's. Only the watcher reads other ranks' keys, once per beat: the arrivals it has
not seen yet (:func:`present`: one ``check`` per run of keys that all exist), then the
missing ranks' statuses and progress records in one round trip. So W waiting ranks cost
O(W) operations per beat, where every rank reading every rank's keys cost O(W x W). Polls
slow down with the group (:func:`poll_interval`) so that the group's polls stay under
:data:`POLLS_PER_SECOND` together.

A rank may also wait before it arrives (:meth:`BarrierWait.enter`, then
:meth:`BarrierWait.arrive` once its part is done): so every rank waits on a collective that
runs on a thread of its own (:meth:`Monitor.await_together`: the making of the gloo side
group), the watcher watching every rank whose part is not done, at the same O(W) cost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from asyncload.common.errors import DistributedLoadError
from asyncload.distributed.lateness import decode, digest, digest_message, late_message
from asyncload.distributed.values import fresh_of, parse_rank

__all__ = [
    "BEAT_INTERVAL",
    "POLLS_PER_SECOND",
    "BarrierWait",
    "arrive",
    "beat_interval",
    "first_poll",
    "poll_interval",
    "present",
    "read_present",
    "silent_after",
]

log = logging.getLogger("asyncload.monitor")

#: Seconds between heartbeats (and the watcher's checks) while a rank waits on others.
BEAT_INTERVAL = 1.0
#: Longest sleep between polls of a small group's barrier.
MAX_POLL = 0.05
#: The polls of a whole group stay under this many per second (each poll is one store
#: operation): a rank of W sleeps up to ``W / POLLS_PER_SECOND`` seconds between polls.
POLLS_PER_SECOND = 10_000.0
#: The group's heartbeats (one status write and one read of the watcher's status per
#: waiting rank) stay under this many per second: beats every ``W / BEATS_PER_SECOND``
#: seconds at least.
BEATS_PER_SECOND = 2_000.0
#: A waiter takes over the watching after the watcher's status stood still this many beats
#: (a watcher's own beats move it every one or two).
TAKEOVER_BEATS = 4
#: Arrival keys checked in one operation by the watcher (then halved where one is missing).
CHUNK = 64


def poll_interval(world: int) -> float:
    """The longest sleep between two polls of a rank in a group of ``world``."""
    return max(MAX_POLL, world / POLLS_PER_SECOND)


def first_poll(world: int) -> float:
    """The first sleep of a rank at a barrier (then doubled up to :func:`poll_interval`):
    0.5 ms up to 64 ranks, longer in larger groups, whose arrivals alone keep the store busy
    for longer than a few fast polls would wait."""
    return min(poll_interval(world), 0.0005 * max(1.0, world / 64))


def beat_interval(world: int) -> float:
    """Seconds between a waiting rank's heartbeats in a group of ``world``."""
    return max(BEAT_INTERVAL, world / BEATS_PER_SECOND)


def silent_after(world: int, timeout: float) -> float:
    """How long a rank's status must stand still before the stall rule gives up on it:
    ``timeout`` (``collective_timeout``), and at least two of its heartbeats, so that a rank
    that beats while it waits is never taken for a silent one, whatever the timeout."""
    return max(timeout, 2 * beat_interval(world))


def present(store: Any, keys: Sequence[str]) -> list[bool]:
    """Which of ``keys`` exist: one ``check`` per run of :data:`CHUNK` keys that all exist,
    halving the runs where one is missing (a few operations for a few missing keys, never
    more than about two per key)."""
    found = [False] * len(keys)

    def visit(lo: int, hi: int) -> None:
        if store.check(list(keys[lo:hi])):
            found[lo:hi] = [True] * (hi - lo)
        elif hi - lo > 1:
            mid = (lo + hi) // 2
            visit(lo, mid)
            visit(mid, hi)

    for lo in range(0, len(keys), CHUNK):
        visit(lo, min(len(keys), lo + CHUNK))
    return found


def read_present(store: Any, keys: Sequence[str]) -> list[bytes]:
    """The values of ``keys``, ``b""`` for those that do not exist: one ``check`` and one
    ``multi_get`` when all exist."""
    if not keys:
        return []
    if store.check(list(keys)):
        return list(store.multi_get(list(keys)))
    found = present(store, keys)
    there = [k for k, f in zip(keys, found) if f]
    values = iter(store.multi_get(there) if there else [])
    return [next(values) if f else b"" for f in found]


class _Host(Protocol):
    """What a barrier wait uses of its :class:`~asyncload.distributed.monitor.Monitor`."""

    rank: int
    world: int
    timeout: float | None
    late_after: float | None
    store: Any
    cancelled: Any
    _written: list[str]
    _seen: dict[int, tuple[bytes, float]]

    @property
    def doing(self) -> str: ...
    @property
    def reports(self) -> bool: ...
    def beat(self) -> None: ...
    def check(self) -> None: ...
    def late_wait(self, now: float) -> float | None: ...
    def logged_late(self, now: float) -> None: ...
    def _give_up(
        self, rank: int, barrier: str | None, idle: float, status: str, doing: str
    ) -> None: ...


def arrive(host: _Host, name: str) -> int:
    """Mark this rank arrived at ``name`` and count it; the arrivals so far (with this one).
    The last arrival moves ``ev``. Raises when the others gave up on this rank."""
    store = host.store
    key = f"at/{name}/{host.rank}"
    got = store.compare_set(key, "", "arrived")
    host._written.append(key)
    if got != b"arrived":
        host.check()
        raise DistributedLoadError(
            f"rank {host.rank} arrived at {name!r} after the other ranks gave up on it",
            rank=host.rank,
            doing=name,
        )
    n = int(store.add(f"n/{name}", 1))
    if n == 1:  # the first arrival drops the barrier's shared keys with its own
        host._written.extend([f"n/{name}", f"wa/{name}", f"late/{name}", "ev"])
    if n >= host.world:
        store.add("ev", 1)
    return n


class BarrierWait:
    """One rank's wait at one barrier: :meth:`arrive`, then :meth:`poll` until it returns
    True (it raises when a rank failed, was given up on, or the load was cancelled).

    A rank may wait before it arrives: :meth:`enter`, polls, then :meth:`arrive` once its
    part is done; or after it arrived without waiting (:func:`arrive`): :meth:`arrived_before`.

    State: ``_ev`` (the event count last seen), ``_watcher`` (its rank) and
    ``_watcher_seen`` (its status and since when), ``_arrived`` (other ranks the watcher has
    seen arrive; arrivals are never undone), ``_here`` (1 once this rank arrived),
    ``_beat_at`` (the last beat), ``_digest_posted`` (the watcher's digest exists)."""

    def __init__(self, host: _Host, name: str, doing: str) -> None:
        self.host = host
        self.name = name
        self.doing = doing
        self.done = False
        self.max_delay = poll_interval(host.world)
        self.first_delay = first_poll(host.world)
        self._beat_every = beat_interval(host.world)
        self._ev = 0
        self._watcher = -1
        self._watcher_seen: tuple[bytes, float] | None = None
        self._arrived: set[int] = set()
        self._here = 0
        self._beat_at = time.monotonic()
        self._digest_posted = False
        #: The watcher's view of each missing rank's progress stamp: (stamp, seen since, the
        #: status value then).
        self._fresh: dict[int, tuple[float, float, bytes]] = {}

    def __repr__(self) -> str:
        return (
            f"<BarrierWait {self.name!r} rank={self.host.rank} done={self.done} "
            f"watcher={self._watcher} ev={self._ev}>"
        )

    def arrive(self) -> None:
        """Arrive (and wait from now on, unless this is the last arrival)."""
        host, store = self.host, self.host.store
        entered = self._watcher >= 0
        self._here = 1
        if arrive(host, self.name) >= host.world:
            self.done = True
            return
        if entered:  # waited before arriving (enter): the last arrival moves ev
            return
        self._join()
        self.done = int(store.add(f"n/{self.name}", 0)) >= host.world

    def arrived_before(self) -> None:
        """Wait from now on, this rank having arrived already (with :func:`arrive`, as a
        rank whose load returns before the others' does at "done")."""
        self._here = 1
        self._join()
        self.done = int(self.host.store.add(f"n/{self.name}", 0)) >= self.host.world

    def enter(self) -> None:
        """Wait before arriving: this rank's part is not done yet (it arrives with
        :meth:`arrive` when it is); until then it polls, beats and watches (when elected) like
        a rank that arrived, and the watcher watches every other rank that has not arrived."""
        self._join()

    def _join(self) -> None:
        host, store = self.host, self.host.store
        key = f"wa/{self.name}"
        self._watcher = self._rank_at(key, store.compare_set(key, "", str(host.rank)))
        # ev is read before the count: an arrival or failure after that read moves it again
        self._ev = int(store.add("ev", 0))
        host.check()

    def poll(self) -> bool:
        """One poll (one store operation unless something happened or a beat is due)."""
        host, store = self.host, self.host.store
        if host.cancelled is not None and host.cancelled.is_set():
            raise asyncio.CancelledError()
        if self.done:
            return True
        ev = int(store.add("ev", 0))
        if ev != self._ev:
            self._ev = ev
            host.check()
            if int(store.add(f"n/{self.name}", 0)) >= host.world:
                self.done = True
                return True
        now = time.monotonic()
        watching = self._watcher == host.rank
        if now - self._beat_at >= (BEAT_INTERVAL if watching else self._beat_every):
            self._beat_at = now
            host.beat()
            if watching:
                self._watch(now)
            else:
                self._mind_watcher(now)
                self._log_late(now)
        return False

    def _rank_at(self, key: str, value: bytes) -> int:
        """The barrier's watcher as ``key`` holds it: a rank of the group, checked (a
        watcher outside it would be waited on for ever)."""
        host = self.host
        name = getattr(host, "key_name", str)(key)
        return parse_rank(name, value, range(host.world), what=f"the watcher of {self.name!r}")

    # --- the watcher's beat ---------------------------------------------------------------

    def _missing(self) -> list[int]:
        host = self.host
        unknown = [r for r in range(host.world) if r not in self._arrived and r != host.rank]
        # arrivals are counted: when none is new, or all are, one operation tells which
        # (a group waiting before it arrives (enter) has all its ranks missing at first,
        # where checking each key costs two operations a key)
        new = int(host.store.add(f"n/{self.name}", 0)) - len(self._arrived) - self._here
        if new <= 0:
            return unknown
        if new >= len(unknown):
            self._arrived.update(unknown)
            return []
        found = present(host.store, [f"at/{self.name}/{r}" for r in unknown])
        self._arrived.update(r for r, f in zip(unknown, found) if f)
        return [r for r, f in zip(unknown, found) if not f]

    def _watch(self, now: float) -> None:
        """Check the ranks that have not arrived: give up on one idle for ``timeout``; post
        their digest for the waiters' late-rank lines."""
        host = self.host
        if host.timeout is None and host.late_after is None:
            return
        missing = self._missing()
        if not missing:
            return
        n = len(missing)
        keys = [f"st/{r}" for r in missing]
        if host.late_after is not None and host.reports:
            keys += [f"pg/{r}" for r in missing]
        values = read_present(host.store, keys)
        statuses = values[:n]
        if host.timeout is not None:
            for r, value in zip(missing, statuses):
                self._still(r, value, now)
                seen = host._seen.get(r)
                if seen is None or seen[0] != value:
                    host._seen[r] = (value, now)
                    continue
                idle = now - seen[1]
                if idle >= silent_after(host.world, host.timeout):
                    status = value.decode("utf-8", "replace").partition("|")[2]
                    host._give_up(r, self.name, idle, status, self.doing)
        if host.late_after is None:
            return
        records = [
            decode(
                r,
                (values[n + i] or None) if len(values) > n else None,
                statuses[i].decode("utf-8", "replace").partition("|")[2],
            )
            for i, r in enumerate(missing)
        ]
        host.store.set(f"late/{self.name}", digest(records))
        waited = host.late_wait(now)
        if waited is not None:
            host.logged_late(now)
            log.warning(
                "%s", late_message(host.rank, waited, host.doing, host.late_after, records)
            )

    def _still(self, r: int, value: bytes, now: float) -> None:
        """Give up on missing rank ``r`` when its progress stamp (``fresh``, which heartbeats
        do not move) stood still for ``timeout``: alive, but neither working nor waiting on
        anything that moves (a cycle of waits, or stuck while its heartbeat runs)."""
        assert self.host.timeout is not None
        f = fresh_of(value)
        if f is None:
            return
        seen = self._fresh.get(r)
        if seen is None or f > seen[0]:
            self._fresh[r] = (f, now, value)
            return
        idle = now - seen[1]
        # beating (else the stall rule, which fires first); one beat later than the stall
        # rule, so that a silent rank is named by it
        if idle >= self.host.timeout + 2 * BEAT_INTERVAL and value != seen[2]:
            status = value.decode("utf-8", "replace").partition("|")[2]
            self.host._give_up(
                r, self.name, idle, f"{status} (alive, but no progress since "
                f"{time.strftime('%H:%M:%S', time.gmtime(f))} UTC)", self.doing,
            )  # fmt: skip

    # --- a waiter's beat ------------------------------------------------------------------

    def _mind_watcher(self, now: float) -> None:
        """Take over the watching when the watcher's status stood still for a while (its
        process died, or its thread is stuck)."""
        host = self.host
        if host.timeout is None and host.late_after is None:
            return
        value = host.store.get(f"st/{self._watcher}")  # written before it arrived
        seen = self._watcher_seen
        if seen is None or seen[0] != value:
            self._watcher_seen = (value, now)
            return
        if now - seen[1] < TAKEOVER_BEATS * self._beat_every:
            return
        got = host.store.compare_set(f"wa/{self.name}", str(self._watcher), str(host.rank))
        log.debug(
            "rank %d: the watcher of %r (rank %d) stood still for %.1f s; now rank %s watches",
            host.rank,
            self.name,
            self._watcher,
            now - seen[1],
            got.decode(),
        )
        # a watcher that had not arrived (it waited before arriving: enter) is watched from
        # now on as idle since this rank last saw its status move (one that arrived is not)
        known = host._seen.get(self._watcher)
        if known is None or known[0] != seen[0]:
            host._seen[self._watcher] = seen
        self._watcher, self._watcher_seen = self._rank_at(f"wa/{self.name}", got), None

    def _log_late(self, now: float) -> None:
        """The late-rank line, from the watcher's digest (nothing before it posted one)."""
        host = self.host
        if host.late_after is None:
            return
        waited = host.late_wait(now)
        if waited is None:
            return
        key = f"late/{self.name}"
        if not self._digest_posted:  # once there, it stays (a get would wait for it)
            if not host.store.check([key]):
                return  # not posted yet: at the next beat
            self._digest_posted = True
        line = digest_message(host.rank, waited, host.doing, host.late_after, host.store.get(key))
        host.logged_late(now)
        log.warning("%s", line)
