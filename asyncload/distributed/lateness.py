"""Who is late, while it is late: each rank's progress record and the log line of a rank
that waits on slower ones (docs/distributed.md#watching-a-multi-rank-load).

A rank's record (:func:`encode`, kept by :class:`~asyncload.distributed.monitor.Monitor` in
the store as ``pg/<rank>``) holds its bytes done and total, its rate over the last
:data:`RATE_WINDOW` seconds and its oldest storage requests in flight (at most
:data:`SHOWN_IN_FLIGHT`, from :class:`~asyncload.storage.in_flight.InFlight`), with the wall
time it was written. :func:`decode` makes it a :class:`RankProgress` whose ages are counted to
now; :func:`late_message` is the WARNING a waiting rank logs.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from asyncload.common.errors import redact_text
from asyncload.common.stats import _fmt_bytes
from asyncload.distributed.values import bad_store_value
from asyncload.storage import InFlightRequest

__all__ = [
    "RATE_WINDOW",
    "SHOWN_IN_FLIGHT",
    "RankProgress",
    "Rate",
    "decode",
    "digest",
    "digest_message",
    "encode",
    "late_message",
    "slowest_first",
]

#: Seconds of history a rank's rate is measured over.
RATE_WINDOW = 10.0
#: The oldest requests in flight a record shows.
SHOWN_IN_FLIGHT = 4
#: Ranks a late-rank log line describes (the slowest first).
SHOWN_RANKS = 3


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress in a load, as ``LoadHandle.rank_progress()`` returns it.

    ``bytes_done`` / ``bytes_total``: bytes of its destinations filled so far and in all
    (``None`` while its plan is not made: the pair ``LoadHandle.progress`` has on that
    rank); ``rate``: bytes per second over the last 10 seconds; ``in_flight``: its oldest
    storage requests not yet answered (at most 4, oldest first, each with how long it has
    been in flight); ``status``: what it says it is doing (``"reading data: 3.0 MiB of
    8.0 MiB"``); ``age``: seconds since the rank wrote this record (0 for the rank asked;
    ``None`` when it has written none yet). A request's ``seconds`` are counted to now,
    assuming it is still in flight.
    """

    rank: int
    bytes_done: int
    bytes_total: int | None
    rate: float
    in_flight: tuple[InFlightRequest, ...]
    status: str
    age: float | None

    @property
    def oldest_in_flight(self) -> float:
        """Seconds the oldest request in flight has waited (0 when none)."""
        return max((r.seconds for r in self.in_flight), default=0.0)

    def describe(self) -> str:
        """One line, as the late-rank log shows a rank."""
        total = _fmt_bytes(self.bytes_total) if self.bytes_total is not None else "?"
        age = f"record {self.age:.1f} s old" if self.age is not None else "no record yet"
        head = (
            f"rank {self.rank}: {_fmt_bytes(self.bytes_done)} of {total} done, "
            f"{_fmt_bytes(int(self.rate))}/s, {self.status or 'no status'} ({age})"
        )
        if not self.in_flight:
            return f"{head}; nothing in flight"
        return f"{head}; in flight: " + "; ".join(r.describe() for r in self.in_flight)


class Rate:
    """Bytes per second over the last :data:`RATE_WINDOW` seconds, from ``(time, bytes
    done)`` samples (:meth:`add`, any thread under the caller's lock), counted from
    ``start`` (0 bytes then: the load's start)."""

    __slots__ = ("_samples",)

    def __init__(self, start: float | None = None) -> None:
        t0 = time.monotonic() if start is None else start
        self._samples: deque[tuple[float, int]] = deque([(t0, 0)])

    def add(self, done: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        s = self._samples
        if len(s) >= 2 and now - s[-2][0] < 0.25:
            s[-1] = (now, done)  # at most about four samples a second
        else:
            s.append((now, done))
        self._trim(now)

    def _trim(self, now: float) -> None:
        s = self._samples
        while len(s) >= 2 and s[1][0] <= now - RATE_WINDOW:
            s.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        s = self._samples
        t0, d0 = s[0]
        span = now - t0
        return (s[-1][1] - d0) / span if span > 0 else 0.0


def encode(done: int, total: int | None, rate: float, in_flight: Sequence[InFlightRequest]) -> str:
    """A rank's record as the store keeps it (compact JSON, with the wall time of writing)."""
    return json.dumps(
        {
            "w": round(time.time(), 3),
            "d": done,
            "t": total,
            "r": round(rate, 1),
            "f": [
                [
                    r.path,
                    list(r.byte_range) if r.byte_range else None,
                    r.attempt,
                    round(r.seconds, 3),
                    int(r.hedge),
                ]
                for r in in_flight
            ],
        },
        separators=(",", ":"),
    )


def decode(rank: int, record: bytes | None, status: str) -> RankProgress:
    """``rank``'s :class:`RankProgress` from its stored record (``None``: none written yet)
    and status; ages and the requests' seconds counted to now (wall clock)."""
    if not record:
        return RankProgress(rank, 0, None, 0.0, (), status, None)
    try:
        return _decode(rank, record, status)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as exc:
        raise bad_store_value(
            f"pg/{rank}",
            record,
            f"not a progress record ({type(exc).__name__}: {exc})",
            writer=f"rank {rank} (its progress record) or an unknown writer",
        ) from None


def _decode(rank: int, record: bytes, status: str) -> RankProgress:
    value = json.loads(record)
    age = max(0.0, time.time() - float(value["w"]))
    requests = tuple(
        InFlightRequest(
            str(path), (int(rng[0]), int(rng[1])) if rng else None, int(attempt), s + age, bool(h)
        )
        for path, rng, attempt, s, h in value["f"]
    )
    total = value["t"]
    return RankProgress(
        rank,
        int(value["d"]),
        None if total is None else int(total),
        float(value["r"]),
        requests,
        status,
        age,
    )


def slowest_first(records: Sequence[RankProgress]) -> list[RankProgress]:
    """The ranks most behind first: the smallest share of their bytes done, then the oldest
    request in flight."""

    def key(p: RankProgress) -> tuple[float, float, int]:
        share = p.bytes_done / p.bytes_total if p.bytes_total else 0.0
        return (share, -p.oldest_in_flight, p.rank)

    return sorted(records, key=key)


def late_message(
    rank: int,
    waited: float,
    doing: str,
    late_after: float,
    records: Sequence[RankProgress],
    waited_on: Sequence[int] | None = None,
) -> str:
    """The WARNING of ``rank``, which has waited ``waited`` seconds (while ``doing``) on the
    ranks of ``records`` (or on ``waited_on``, of which ``records`` were read): the slowest
    of them, with what they have in flight. URLs redacted."""
    ranked = slowest_first(records)
    ranks = sorted(waited_on if waited_on is not None else (p.rank for p in records))
    return _line(rank, waited, doing, late_after, len(ranks), ranks, ranked)


def _line(
    rank: int,
    waited: float,
    doing: str,
    late_after: float,
    count: int,
    ranks: Sequence[int],
    ranked: Sequence[RankProgress],
) -> str:
    """The late-rank line: ``count`` ranks waited on, the first of them by rank (at least 9
    of them when there are more than 8), the slowest first (at least :data:`SHOWN_RANKS`)."""
    who = (
        f"rank {ranks[0]}"
        if count == 1
        else f"{count} ranks ({', '.join(map(str, ranks[:8]))}" + (", ...)" if count > 8 else ")")
    )
    shown = ranked[:SHOWN_RANKS]
    slowest = "slowest: " if count > 1 else ""
    more = f" (and {count - len(shown)} more)" if count > len(shown) else ""
    return redact_text(
        f"rank {rank} has waited {waited:.1f} s for {who} while {doing or 'waiting'} "
        f"(LoadOptions.late_rank_log_after={late_after}); {slowest}"
        + " | ".join(p.describe() for p in shown)
        + more
    )


def digest(records: Sequence[RankProgress]) -> str:
    """What a late-rank line needs of ``records`` (the ranks a barrier waits for), as the
    barrier's watcher posts it for every waiter (:mod:`asyncload.distributed.barrier`): their
    count, the first 9 by rank, and the :data:`SHOWN_RANKS` slowest, with the wall time of
    writing (a reader counts the ages and the requests' seconds on to its now)."""
    shown = slowest_first(records)[:SHOWN_RANKS]
    return json.dumps(
        {
            "w": round(time.time(), 3),
            "n": len(records),
            "r": sorted(p.rank for p in records)[:9],
            "s": [
                [
                    p.rank,
                    p.bytes_done,
                    p.bytes_total,
                    round(p.rate, 1),
                    p.status,
                    None if p.age is None else round(p.age, 3),
                    [
                        [
                            r.path,
                            list(r.byte_range) if r.byte_range else None,
                            r.attempt,
                            round(r.seconds, 3),
                            int(r.hedge),
                        ]
                        for r in p.in_flight
                    ],
                ]
                for p in shown
            ],
        },
        separators=(",", ":"),
    )


def digest_message(
    rank: int, waited: float, doing: str, late_after: float, posted: bytes | str
) -> str:
    """:func:`late_message` from a :func:`digest` (ages counted on to now): the same line
    as from the records themselves."""
    try:
        return _digest_message(rank, waited, doing, late_after, posted)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as exc:
        raise bad_store_value(
            "late/<barrier>",
            posted,
            f"not a digest of late ranks ({type(exc).__name__}: {exc})",
            writer="the barrier's watcher or an unknown writer",
        ) from None


def _digest_message(
    rank: int, waited: float, doing: str, late_after: float, posted: bytes | str
) -> str:
    value = json.loads(posted)
    later = max(0.0, time.time() - float(value["w"]))
    shown = [
        RankProgress(
            int(r),
            int(done),
            None if total is None else int(total),
            float(rate),
            tuple(
                InFlightRequest(
                    str(path),
                    (int(rng[0]), int(rng[1])) if rng else None,
                    int(attempt),
                    float(s) + later,
                    bool(h),
                )
                for path, rng, attempt, s, h in flights
            ),
            str(status),
            None if age is None else float(age) + later,
        )
        for r, done, total, rate, status, age, flights in value["s"]
    ]
    return _line(rank, waited, doing, late_after, int(value["n"]), value["r"], shown)
