"""Latency yardsticks shared by every wing: one percentile definition, the load's clock
(:class:`LoadClock`: read and first-byte latencies, the timeout's progress clock) and the one
hedging rule (:func:`hedge_delay`), used for storage reads (:mod:`asyncload.storage.retrying`)
and for transfers between ranks (:mod:`asyncload.distributed`) alike."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from asyncload.common.options import HedgePolicy

__all__ = [
    "HEDGE_COLD_FACTOR",
    "HEDGE_DERIVED_FLOOR",
    "HEDGE_OVERTAKEN",
    "HEDGE_POLL",
    "LoadClock",
    "hedge_delay",
    "percentile",
]

#: Fewer samples than this give no quantile for hedging decisions.
MIN_SAMPLES = 4


def percentile(
    sorted_values: Sequence[float], q: float, *, min_samples: int = MIN_SAMPLES
) -> float | None:
    """Nearest-rank percentile of ``sorted_values``: the smallest value with at least ``q`` of
    the values at or below it; None with fewer than ``min_samples`` values. The one definition
    used by hedging and by :class:`asyncload.LoadStats`."""
    n = len(sorted_values)
    if n < max(1, min_samples):
        return None
    rank = math.ceil(q * n - 1e-9)
    return sorted_values[min(n - 1, max(0, rank - 1))]


class LoadClock:
    """What the reads of one load share: when a read last finished (the timeout's
    progress clock), recent read latencies by size and recent first-byte latencies (the
    hedge's yardsticks), and how many hedged requests are in flight. One per
    :class:`StatsRecorder` (one per load)."""

    WINDOW = 256
    #: Reads at least this large give a per-stream transfer rate (smaller ones are latency).
    RATE_MIN_BYTES = 256 << 10

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        #: The clock itself (``time.monotonic``; a test gives a synthetic one).
        self.now = now
        self.last_progress = now()
        self.samples: deque[tuple[float, int]] = deque(maxlen=self.WINDOW)
        self.hedges_in_flight = 0
        #: Reads finished so far (``samples`` keeps only the last WINDOW).
        self.total_samples = 0
        #: Seconds from each request's start until its answer began (stores that tell:
        #: :func:`asyncload.storage.base.first_byte`), and when each of those requests started.
        self.first_bytes: deque[float] = deque(maxlen=self.WINDOW)
        self.first_byte_starts: deque[float] = deque(maxlen=self.WINDOW)
        #: Bytes per second of one stream once its answer had begun (reads of RATE_MIN_BYTES or more).
        self.stream_rates: deque[float] = deque(maxlen=self.WINDOW)

    def finished(self, seconds: float, nbytes: int, body_seconds: float | None = None) -> None:
        """A read of ``nbytes`` took ``seconds`` (``body_seconds`` of them after its answer began)."""
        self.last_progress = self.now()
        self.samples.append((seconds, nbytes))
        self.total_samples += 1
        if body_seconds is not None and nbytes >= self.RATE_MIN_BYTES:
            self.stream_rates.append(nbytes / max(body_seconds, 1e-4))

    def answered(self, seconds: float, started: float) -> None:
        """The answer to a request started at ``started`` began after ``seconds``."""
        self.first_bytes.append(seconds)
        self.first_byte_starts.append(started)

    def deadline(self, started: float, timeout: float) -> float:
        """When an attempt started at ``started`` times out, as things stand."""
        return max(started, self.last_progress) + timeout

    def straggler_time(self, nbytes: int, q: float = 0.9) -> float | None:
        """The ``q`` quantile of recent comparable read times, scaled to ``nbytes``; None
        with fewer than 4 comparable reads (same size or up to 4x smaller)."""
        lo = nbytes / 4
        times = sorted(
            t * max(1.0, nbytes / n) if n > 0 else t for t, n in self.samples if n >= lo
        )
        return percentile(times, q)

    def first_byte_time(self, q: float = 0.9) -> float | None:
        """The ``q`` quantile of recent first-byte latencies; None with fewer than 4."""
        return percentile(sorted(self.first_bytes), q)

    def expected_time(self, nbytes: int) -> float | None:
        """How long a read of ``nbytes`` should take on this load's link as measured so far:
        the median first-byte latency plus ``nbytes`` at the median per-stream rate; None
        before both are known."""
        latency = self.first_byte_time(0.5)
        rate = percentile(sorted(self.stream_rates), 0.5)
        if latency is None or rate is None:
            return None
        return latency + nbytes / rate

    def overtaken(self, started: float) -> int:
        """Requests started after ``started`` whose answers have begun (among the recent ones)."""
        return sum(1 for s in self.first_byte_starts if s > started)


#: Explicit ``hedge_min_delay``: the delay before any comparable read has finished, in its units.
HEDGE_COLD_FACTOR = 4.0
#: Derived floor: no read is hedged sooner than this, seconds (a hiccup of the client's own
#: event loop or a GC pause must not look like a straggling store).
HEDGE_DERIVED_FLOOR = 0.05
#: A request still waiting for its answer is a straggler only once this many requests
#: started after it have had theirs (on a uniformly slow link, answers come in order).
HEDGE_OVERTAKEN = 2
#: How often a waiting read re-checks whether it has become a straggler, seconds.
HEDGE_POLL = 0.05


def hedge_delay(
    policy: HedgePolicy, clock: LoadClock, nbytes: int = 0, *, waiting_since: float | None = None
) -> float | None:
    """Seconds after which a read of ``nbytes`` still running is hedged (None: not yet,
    as things stand; ask again as reads finish).

    The body rule: ``max(floor, factor x p90)`` of recent comparable reads. With an
    explicit ``min_delay`` the floor is it, and before 4 comparable reads have finished the
    delay is ``4 x min_delay``. Derived (``min_delay=None``), the floor is
    ``max(HEDGE_DERIVED_FLOOR, factor x expected)``, the expected time of ``nbytes`` at this
    load's measured first-byte latency and per-stream rate (:meth:`LoadClock.expected_time`),
    and before 4 comparable reads have finished this rule hedges nothing: the first reads of
    a load share the link and finish together however long they take (a fixed cold delay
    would hedge every one of them on a congested link).

    The first-byte rule (``waiting_since``: the request started then and its answer has
    not begun, on a store that tells): ``max(floor, factor x p90)`` of recent first-byte
    latencies (floor: ``min_delay``, or ``HEDGE_DERIVED_FLOOR``), once ``HEDGE_OVERTAKEN``
    requests started after it have had their answers. The earlier of the two rules wins.
    """
    if not policy.enabled:
        return None
    factor = policy.factor
    explicit = policy.min_delay if not policy.derived else None
    p90 = clock.straggler_time(nbytes)
    body: float | None
    if explicit is not None:
        body = explicit * HEDGE_COLD_FACTOR if p90 is None else max(explicit, factor * p90)
    elif p90 is None:
        body = None
    else:
        expected = clock.expected_time(nbytes)
        body = max(
            HEDGE_DERIVED_FLOOR, 0.0 if expected is None else factor * expected, factor * p90
        )
    if waiting_since is None:
        return body
    ttfb = clock.first_byte_time()
    if ttfb is None or clock.overtaken(waiting_since) < HEDGE_OVERTAKEN:
        return body
    floor = explicit if explicit is not None else HEDGE_DERIVED_FLOOR
    first = max(floor, factor * ttfb)
    return first if body is None else min(body, first)
