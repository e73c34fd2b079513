"""Ranks that stand still, watched by one rank for the whole group.

A rank waiting for bytes from, or sends to, many peers must notice one that stalled (its
status, ``st/<r>``, has not moved for ``collective_timeout``). Reading every peer's status
once a beat on every waiting rank costs the group W x W keys a beat: under static sharing
of a replicated checkpoint every owner sends each unit to every other rank, and at 8,192
ranks that is 67 million keys a second, more than a store serves. Instead, the group's rank
0 reads every rank's status once a beat (:class:`IdlePoster`, a thread of its own from the
start of the load's sharing) and posts the ranks whose status has not moved for half of
``collective_timeout`` or more (:func:`listed_after`), with for how long (key ``idle``:
``"<counter>|<rank>:<seconds>,..."``); a waiting rank reads that one key (:class:`IdleView`)
and gives up on a peer it lists as idle for ``collective_timeout``. The group's traffic is W
keys a beat at rank 0 and one key a beat per waiting rank.

A digest that stops moving (rank 0's thread is gone, or its process holds the GIL in a
stuck call) is ignored after :data:`STALE_BEATS` of its beats, and the waiting ranks read
their peers' statuses themselves again, as before: a stalled rank is still given up on, at
most those beats and one ``collective_timeout`` later. The verdict is the same
(``Monitor._give_up``: the same error on every rank).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Protocol

from asyncload.distributed.barrier import beat_interval, read_present

__all__ = [
    "IDLE_KEY",
    "STALE_BEATS",
    "IdlePoster",
    "IdleView",
    "decode_idle",
    "encode_idle",
    "listed_after",
]

log = logging.getLogger("asyncload.monitor")

IDLE_KEY = "idle"
#: A digest whose counter stood still this many of its beats is stale.
STALE_BEATS = 4


def listed_after(world: int, timeout: float | None) -> float:
    """From how long idle a rank is listed: half the verdict's ``timeout`` (and two beats at
    least; two beats when no verdict is ever given, for the late-rank lines' order)."""
    floor = 2 * beat_interval(world)
    return floor if timeout is None else max(floor, 0.5 * timeout)


def encode_idle(counter: int, idle: dict[int, float]) -> str:
    return f"{counter}|" + ",".join(f"{r}:{s:.2f}" for r, s in sorted(idle.items()))


def decode_idle(value: bytes, world: int | None = None) -> tuple[int, dict[int, float]]:
    """``(counter, {rank: idle seconds})``; ValueError on a value that is not a digest (with
    ``world``: also one naming a rank outside the group, or seconds that are not a finite
    number of zero or more)."""
    counter_s, _, body = value.decode("ascii").partition("|")
    idle: dict[int, float] = {}
    for item in filter(None, body.split(",")):
        rank_s, _, seconds_s = item.partition(":")
        rank, seconds = int(rank_s), float(seconds_s)
        if world is not None and not (0 <= rank < world and 0.0 <= seconds < float("inf")):
            raise ValueError(f"rank {rank} idle {seconds} s: outside the group of {world}")
        idle[rank] = seconds
    return int(counter_s), idle


class _Owner(Protocol):
    def load_over(self) -> bool: ...


class IdlePoster:
    """Rank 0's side: every ``beat_interval(world)`` seconds, read every rank's status and
    post the ranks idle for ``listed_after`` seconds or more (:func:`listed_after`: half of
    ``collective_timeout``, so that ranks that only beat slowly, as barrier waiters of a
    large group do, keep the digest short). Runs on a daemon thread (it holds its monitor
    weakly) until the monitor's ``load_over()`` says every rank finished the load, or one
    failed."""

    def __init__(self, store: Any, world: int, listed_after: float) -> None:
        self.store = store
        self.world = world
        self.interval = beat_interval(world)
        self.listed_after = listed_after
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._counter = 0

    def post(self, now: float) -> None:
        """One beat: read the statuses, post the digest."""
        values = read_present(self.store, [f"st/{r}" for r in range(self.world)])
        idle: dict[int, float] = {}
        for r, value in enumerate(values):
            seen = self._seen.get(r)
            if seen is None or seen[0] != value:
                self._seen[r] = (value, now)
                continue
            if now - seen[1] >= self.listed_after:
                idle[r] = now - seen[1]
        self._counter += 1
        self.store.set(IDLE_KEY, encode_idle(self._counter, idle))

    def start(self, owner: _Owner) -> None:
        ref = weakref.ref(owner)
        threading.Thread(
            target=self._run, args=(ref,), name="asyncload-idle-watch", daemon=True
        ).start()

    def _run(self, ref: weakref.ReferenceType[_Owner]) -> None:
        while True:
            owner = ref()
            if owner is None:
                return
            try:
                over = owner.load_over()
                del owner
                if over:
                    return
                self.post(time.monotonic())
            except Exception:  # the store is gone (its host exited): the waiters see it too
                log.debug("the idle ranks' digest could not be posted", exc_info=True)
                return
            time.sleep(self.interval)


class IdleView:
    """A waiting rank's side: the digest as last read, and whether it is still moving."""

    def __init__(self, world: int) -> None:
        self.interval = beat_interval(world)
        self.world = world
        self._counter = -1
        self._moved_at = 0.0

    def read(self, store: Any, now: float) -> dict[int, float] | None:
        """The idle ranks and for how long, or None when there is no digest or it stopped
        moving (read the peers' statuses instead). One store operation; a rank that calls it
        deletes :data:`IDLE_KEY` with its other keys."""
        # compare-and-set of "" to "": the value when there is one, else an empty key (a
        # plain get would wait for the key to appear)
        value = store.compare_set(IDLE_KEY, "", "")
        if not value:
            return None
        try:
            counter, idle = decode_idle(value, self.world)
        except (ValueError, UnicodeDecodeError):
            # not a digest rank 0 wrote (or one naming ranks outside the group): nothing is
            # taken from it, the peers' own statuses are read instead
            log.debug("ignored a value of %r that is not a digest: %r", IDLE_KEY, value[:80])
            return None
        if counter != self._counter:
            self._counter, self._moved_at = counter, now
        if now - self._moved_at > STALE_BEATS * self.interval:
            return None
        return idle
