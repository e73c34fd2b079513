"""The reader pool's two limits: :class:`ByteBudget` (bytes read but not yet assembled)
and :class:`Limiter` (reads in flight, a limit that may change while in use).

Both grant waiters in FIFO order, give back what a cancelled waiter was granted, and
report a frozen :meth:`statistics` snapshot (like anyio's ``CapacityLimiter``).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

__all__ = ["BudgetStatistics", "ByteBudget", "Limiter", "LimiterStatistics"]


@dataclass(frozen=True)
class BudgetStatistics:
    """A snapshot of a :class:`ByteBudget`."""

    capacity: int
    used: int
    peak: int
    waiting: int


@dataclass(frozen=True)
class LimiterStatistics:
    """A snapshot of a :class:`Limiter`."""

    limit: int
    active: int
    peak: int
    waiting: int


class ByteBudget:
    """Bytes read but not yet assembled, bounded by ``capacity``; FIFO waiters.

    ``acquire(n)`` waits until ``n`` more bytes fit; ``release(n)`` gives them back.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def acquire(self, n: int) -> None:
        if n > self.capacity:
            raise ValueError(f"a chunk of {n} bytes cannot fit a budget of {self.capacity} bytes")
        if not self._waiters and self.used + n <= self.capacity:
            self._take(n)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self._wake()
            raise

    def _take(self, n: int) -> None:
        self.used += n
        if self.used > self.peak:
            self.peak = self.used

    def release(self, n: int) -> None:
        self.used -= n
        if self.used < 0:  # pragma: no cover - a bookkeeping bug, never user input
            raise AssertionError("byte budget released more than it reserved")
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            n, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._take(n)
            fut.set_result(None)

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(self.capacity, self.used, self.peak, len(self._waiters))

    def __repr__(self) -> str:
        return f"ByteBudget(capacity={self.capacity}, used={self.used}, peak={self.peak}, waiting={len(self._waiters)})"


class Limiter:
    """A semaphore whose limit can change while it is in use (for ``concurrency="auto"``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self.peak = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if not self._waiters and self.active < self.limit:
            self._enter()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    @property
    def waiting(self) -> int:
        """Acquirers waiting for a slot."""
        return len(self._waiters)

    def _enter(self) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)

    def release(self) -> None:
        self.active -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.active < self.limit:
            fut = self._waiters.popleft()
            if not fut.done():
                self._enter()
                fut.set_result(None)

    def statistics(self) -> LimiterStatistics:
        return LimiterStatistics(self.limit, self.active, self.peak, len(self._waiters))

    def __repr__(self) -> str:
        return f"Limiter(limit={self.limit}, active={self.active}, peak={self.peak}, waiting={len(self._waiters)})"
