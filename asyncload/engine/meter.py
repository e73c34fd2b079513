"""One meter type for every bounded resource of a load: :class:`Meter`.

A meter counts units held (bytes read but not yet assembled, reads in flight, bytes of
pinned staging, bytes queued for sends, work units claimed) against a ``capacity``. Waiters
are granted in order: by ``key`` when one is given (lowest first), FIFO among equal keys. A
waiter cancelled after its grant gives the units back; one cancelled before leaves the queue
and lets the next in. :meth:`Meter.statistics` returns a frozen snapshot, like anyio's
``CapacityLimiter.statistics()``.

Two policies are part of the type, because every bounded resource here needs one of them:

- ``oversize``: what an ``acquire(n)`` with ``n > capacity`` does. ``"raise"`` refuses it
  (``ValueError``); ``"alone"`` grants it only when nothing is held (torchsnapshot's rule for
  one oversized read), so that a single item larger than the whole budget still goes through.
- ``admit``: an extra condition ``admit(used, n) -> bool`` checked with the capacity (one
  holder is always admitted), for limits that move with a measurement (claims bounded by a
  measured rate).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Meter", "MeterStatistics"]


@dataclass(frozen=True)
class MeterStatistics:
    """A snapshot of a :class:`Meter`: what it bounds, how much is held now and at most,
    how many wait, and the seconds acquirers have spent waiting in all."""

    name: str
    capacity: int
    used: int
    peak: int
    waiting: int
    wait_seconds: float


class Meter:
    """Units held, bounded by ``capacity``; waiters granted lowest ``key`` first, FIFO among
    equals. Mutable state: ``used``, ``peak``, ``capacity`` (``set_capacity``), the waiter
    heap and the total wait; nothing outside this class sets them."""

    def __init__(
        self,
        capacity: int,
        *,
        name: str = "meter",
        oversize: Literal["raise", "alone"] = "raise",
        admit: Callable[[int, int], bool] | None = None,
        unit: str = "units",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a meter's capacity must be at least 1, not {capacity}")
        self.name = name
        #: What one unit is, in messages ("bytes", "reads").
        self.unit = unit
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        #: Grants not yet released (each grant one, each ``release`` ends one; meaningful where
        #: every grant is released whole): for an ``admit`` condition that bounds holders as
        #: well as units (adaptive sharing's claims of work units).
        self.holders = 0
        self._oversize = oversize
        self._admit = admit
        self._seq = itertools.count()
        self._waiters: list[tuple[Any, int, int, asyncio.Future[None]]] = []
        self._wait_seconds = 0.0

    # -- state ------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Acquirers waiting for a grant."""
        return sum(1 for w in self._waiters if not w[3].done())

    def statistics(self) -> MeterStatistics:
        return MeterStatistics(
            self.name, self.capacity, self.used, self.peak, self.waiting, self._wait_seconds
        )

    def __repr__(self) -> str:
        return (
            f"Meter({self.name!r}, capacity={self.capacity}, used={self.used}, "
            f"peak={self.peak}, waiting={self.waiting})"
        )

    # -- granting ---------------------------------------------------------------------------
    def _fits(self, n: int) -> bool:
        if not self.used:  # one holder always may (an oversized one only alone)
            return n <= self.capacity or self._oversize == "alone"
        if self.used + n > self.capacity:
            return False
        return self._admit is None or self._admit(self.used, n)

    def _take(self, n: int) -> None:
        self.used += n
        self.holders += 1
        if self.used > self.peak:
            self.peak = self.used

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` units now if they fit and nobody waits; False otherwise."""
        if not self._waiters and self._fits(n):
            self._take(n)
            return True
        return False

    async def acquire(self, n: int = 1, *, key: Any = 0) -> None:
        """Wait until ``n`` more units fit, then take them.

        Raised: ``ValueError`` when ``n`` exceeds the capacity and ``oversize="raise"``."""
        if n > self.capacity and self._oversize == "raise":
            raise ValueError(
                f"{n} {self.unit} cannot fit the {self.name}'s capacity of {self.capacity}"
            )
        if self.try_acquire(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (key, next(self._seq), n, fut)
        heapq.heappush(self._waiters, entry)
        started = time.monotonic()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                fut.cancel()
                self._wake()  # our place may have blocked smaller waiters behind it
            raise
        finally:
            self._wait_seconds += time.monotonic() - started

    def release(self, n: int = 1) -> None:
        """Give ``n`` units back and grant waiters that now fit."""
        self.used -= n
        self.holders -= 1
        if self.used < 0:  # pragma: no cover - a bookkeeping bug, never user input
            raise AssertionError(f"the {self.name} meter released more than it granted")
        self._wake()

    def set_capacity(self, capacity: int) -> None:
        """Change the capacity while in use (``concurrency="auto"``); at least 1."""
        self.capacity = max(1, capacity)
        self._wake()

    def wake(self) -> None:
        """Check the waiters again (after the ``admit`` condition's measurement moved)."""
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            _, _, n, fut = self._waiters[0]
            if fut.done():
                heapq.heappop(self._waiters)
                continue
            if not self._fits(n):
                return
            heapq.heappop(self._waiters)
            self._take(n)
            fut.set_result(None)

    @asynccontextmanager
    async def hold(self, n: int = 1, *, key: Any = 0) -> AsyncIterator[None]:
        """``async with meter.hold(n):`` acquire, and release on every exit."""
        await self.acquire(n, key=key)
        try:
            yield
        finally:
            self.release(n)
