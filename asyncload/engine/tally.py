"""One load's statistics and clock: :class:`LoadTally`, held by the session
(:class:`asyncload.engine.session.LoadSession`), which starts one per load (``begin``).

The tally owns the load's :class:`~asyncload.common.stats.StatsRecorder` (the pipeline, the
storage boundary and the checks write into it), its
:class:`~asyncload.common.latency.LoadClock` (read and first-byte latencies, the timeout's
progress clock) and the load's start, from which ``seconds`` is counted; once the load has
finished, its final :class:`~asyncload.common.stats.LoadStats`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncload.common.latency import LoadClock
from asyncload.common.stats import LoadStats, StatsRecorder

__all__ = ["LoadTally"]


class LoadTally:
    """The statistics and clock of the load in progress, timed with ``now`` (the session's
    time source). Until :meth:`begin`, nothing has started: :attr:`started` is False and
    :meth:`live` counts no ``seconds``."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        #: What the load's stages count (replaced at each :meth:`begin`).
        self.recorder = StatsRecorder()
        #: The load's latency clock (replaced at each :meth:`begin`).
        self.clock = LoadClock(now)
        #: When the load started (``now()``), None before :meth:`begin`.
        self.t0: float | None = None
        #: The final statistics of the last load, once it has finished.
        self.stats: LoadStats | None = None

    def begin(self) -> None:
        """Start a load: fresh statistics and clock, its start taken now."""
        self.recorder = StatsRecorder()
        self.clock = LoadClock(self._now)
        self.t0 = self._now()
        self.recorder.started = self.t0
        self.stats = None

    def record(self, **fields: Any) -> None:
        """Set fields of this load's statistics."""
        self.recorder.set(**fields)

    @property
    def started(self) -> bool:
        return self.t0 is not None

    def live(self) -> LoadStats:
        """The statistics so far (``seconds``: since the load started); final once done."""
        if self.stats is not None:
            return self.stats
        snap = self.recorder.snapshot()
        if self.t0 is not None:
            snap.seconds = self._now() - self.t0
        return snap

    def finish(self) -> LoadStats:
        """The load has succeeded: freeze and return its statistics."""
        if self.t0 is not None:
            self.recorder.stats.seconds = self._now() - self.t0
        self.stats = self.recorder.snapshot()
        return self.stats
