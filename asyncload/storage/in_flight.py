"""The requests a load has sent to its store and not yet seen end (:class:`InFlight`), kept
by the error boundary (:class:`~asyncload.storage.retrying.RetryingStorage`) so that a load
can say, while it runs, what it is waiting for (``LoadHandle.rank_progress()``, the monitor's
log line naming a late rank: docs/distributed.md#watching-a-multi-rank-load).

The bookkeeping is one dict insertion when a request starts and one removal when it ends
(success, failure, timeout, cancel, the losing copy of a hedge), each atomic under the GIL:
no lock, on the event loop and on I/O threads alike. Only a reader copies the dict.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["InFlight", "InFlightRequest"]


@dataclass(frozen=True)
class InFlightRequest:
    """One storage request that had not ended when it was looked at (an element of
    :attr:`RankProgress.in_flight <asyncload.distributed.RankProgress.in_flight>`).

    ``path``: the file's URL or local path (a password or signature shown as ``***``);
    ``byte_range``: half-open ``(start, end)``, ``None`` for a whole-file call (a size, a
    listing, the ``.metadata``); ``attempt``: 1 for the first try, 2 for the first retry...;
    ``seconds``: how long it had been in flight; ``hedge``: the duplicate request of a hedged
    read (docs/remote.md).
    """

    path: str
    byte_range: tuple[int, int] | None
    attempt: int
    seconds: float
    hedge: bool = False

    def describe(self) -> str:
        """``bytes [0, 1048576) of URL for 12.3 s (attempt 1)``: as log lines show it."""
        where = (
            f"bytes [{self.byte_range[0]}, {self.byte_range[1]}) of {self.path}"
            if self.byte_range is not None
            else self.path
        )
        hedge = ", hedge" if self.hedge else ""
        return f"{where} for {self.seconds:.1f} s (attempt {self.attempt}{hedge})"


#: (file name, byte range, attempt, hedge, start time)
_Entry = tuple[str, "tuple[int, int] | None", int, bool, float]


class InFlight:
    """The storage requests of one load that have started and not ended.

    ``url(name)`` (the store's :meth:`~asyncload.storage.base.Storage.url`, which redacts)
    names a file when the requests are looked at, not when they start; ``now`` is the
    clock of their ages. Mutable state: ``_entries`` (key -> entry), ``_keys``."""

    __slots__ = ("_entries", "_keys", "_now", "_url")

    def __init__(
        self, url: Callable[[str], str], now: Callable[[], float] = time.monotonic
    ) -> None:
        self._url = url
        self._now = now
        self._entries: dict[int, _Entry] = {}
        self._keys = itertools.count()

    def add(
        self, name: str, byte_range: tuple[int, int] | None, attempt: int, hedge: bool = False
    ) -> int:
        """A request about ``byte_range`` of file ``name`` starts; the key to :meth:`remove`."""
        key = next(self._keys)
        self._entries[key] = (name, byte_range, attempt, hedge, self._now())
        return key

    def remove(self, key: int) -> None:
        """The request of ``key`` has ended (removing it twice is harmless)."""
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> frozenset[int]:
        """The keys of the requests in flight now (a cheap way to see that the set changed)."""
        return frozenset(self._entries.copy())

    def oldest(self, n: int = 4) -> list[InFlightRequest]:
        """The ``n`` requests in flight longest, oldest first."""
        entries = self._entries.copy()
        now = self._now()
        picked = heapq.nsmallest(n, entries.values(), key=lambda e: e[4])
        return [
            InFlightRequest(self._url(name), rng, attempt, max(0.0, now - t0), hedge)
            for name, rng, attempt, hedge, t0 in picked
        ]

    def __repr__(self) -> str:
        return f"<InFlight {len(self._entries)} requests>"
