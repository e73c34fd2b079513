"""LoadOptions: every knob of a load, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["LoadOptions", "KiB", "MiB", "GiB"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: The smallest memory budget accepted: header probes and small records must fit.
MIN_MEMORY_BUDGET = 64 * KiB


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load reads. Sizes are bytes, durations seconds, ``None`` means no limit.

    Vary with ``dataclasses.replace(options, field=value)``.
    """

    #: Largest single read request. Larger byte ranges are split into reads of this size
    #: that run concurrently. Clamped to ``memory_budget`` so one chunk always fits.
    chunk_size: int = 16 * MiB
    #: Neighbouring reads smaller than this are coalesced into one request (gaps
    #: between them up to this size are read and thrown away).
    min_chunk_size: int = 1 * MiB
    #: Seconds allowed for one attempt at one chunk; ``None`` = no limit.
    timeout: float | None = 30.0
    #: Multi-rank loads: seconds a rank may go without progress (no chunk read or shared,
    #: no step done, no heartbeat while it waits on others) before the other ranks give up
    #: on it and raise DistributedLoadError naming it; ``None`` = wait forever.
    collective_timeout: float | None = 300.0
    #: Extra attempts after the first failed one (0 = no retry).
    retries: int = 4
    #: First backoff delay in seconds; doubles per attempt, with full jitter.
    backoff: float = 0.2
    #: Longest backoff delay in seconds.
    max_backoff: float = 10.0
    #: Reads in flight at once, or ``"auto"`` to let the pipeline find its level.
    concurrency: Union[int, Literal["auto"]] = 16
    #: Hard bound on bytes read but not yet assembled.
    memory_budget: int = 512 * MiB
    #: Check the CRC-32 torch stores for each tensor record against the bytes read.
    verify: bool = False
    #: Re-issue a chunk that is much slower than its peers (remote stores only).
    hedge: bool = True
    #: A chunk becomes a straggler after ``max(hedge_min_delay, hedge_factor x p90 latency)``
    #: of recent comparable reads (``4 x hedge_min_delay`` before there are any; docs/remote.md).
    hedge_factor: float = 3.0
    #: Floor for the hedge delay, seconds.
    hedge_min_delay: float = 0.5
    #: Allow loading into a destination whose dtype differs from the saved one (cast on copy).
    allow_dtype_cast: bool = False
    #: Raise when the checkpoint holds keys the destination lacks (they are always
    #: listed in ``LoadStats.unexpected_keys``).
    strict_unexpected_keys: bool = False
    #: Run the event loop on uvloop when it is installed.
    use_uvloop: bool = True
    #: Threads for local positional reads and for assembly copies (``None``: from concurrency).
    io_threads: int | None = None
    #: Largest ``.metadata`` / header accepted, bytes (hostile-input guard).
    max_metadata_size: int = 1 * GiB

    def __post_init__(self) -> None:
        def bad(field: str, value: object, want: str) -> None:
            raise ValueError(f"LoadOptions.{field}={value!r} is invalid: {want}")

        for name in ("chunk_size", "min_chunk_size", "memory_budget", "max_metadata_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(name, v, "expected a positive int (bytes)")
        if self.min_chunk_size > self.chunk_size:
            bad("min_chunk_size", self.min_chunk_size, f"must not exceed chunk_size={self.chunk_size}")
        if self.memory_budget < MIN_MEMORY_BUDGET:
            bad("memory_budget", self.memory_budget, f"must be at least {MIN_MEMORY_BUDGET} bytes")
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
            or math.isinf(self.timeout)
        ):
            bad("timeout", self.timeout, "expected a positive number of seconds or None")
        ct = self.collective_timeout
        if ct is not None and (isinstance(ct, bool) or not isinstance(ct, (int, float)) or not ct > 0
                               or math.isinf(ct)):
            bad("collective_timeout", ct, "expected a positive number of seconds or None")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            bad("retries", self.retries, "expected an int >= 0")
        for name in ("backoff", "max_backoff", "hedge_min_delay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                bad(name, v, "expected a number of seconds >= 0")
        if isinstance(self.hedge_factor, bool) or not isinstance(self.hedge_factor, (int, float)) or not self.hedge_factor >= 1:
            bad("hedge_factor", self.hedge_factor, "expected a number >= 1")
        c = self.concurrency
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            bad("concurrency", c, 'expected an int >= 1 or "auto"')
        if self.io_threads is not None and (
            isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or self.io_threads < 1
        ):
            bad("io_threads", self.io_threads, "expected an int >= 1 or None")
        for name in ("verify", "hedge", "allow_dtype_cast", "strict_unexpected_keys", "use_uvloop"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "expected a bool")

    @property
    def effective_chunk_size(self) -> int:
        """``chunk_size`` clamped so that one chunk always fits in the budget."""
        return min(self.chunk_size, self.memory_budget)

    @property
    def max_in_flight(self) -> int:
        """The most reads in flight: the fixed ``concurrency``, or the ceiling for ``"auto"``."""
        return 64 if self.concurrency == "auto" else int(self.concurrency)

    @property
    def initial_concurrency(self) -> int:
        return 8 if self.concurrency == "auto" else int(self.concurrency)

    def replace(self, **changes: object) -> "LoadOptions":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
