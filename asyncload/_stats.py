"""LoadStats: what a load did, as numbers worth reading."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["LoadStats"]


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass
class LoadStats:
    """Counters of one load. ``bytes_read`` counts bytes fetched from storage (every
    attempt and hedge included); ``bytes_assembled`` bytes placed into destinations."""

    bytes_read: int = 0
    bytes_assembled: int = 0
    #: Read requests that delivered data (one per chunk; retries and hedges not counted).
    chunks: int = 0
    retries: int = 0
    timeouts: int = 0
    hedges: int = 0
    seconds: float = 0.0
    #: The most bytes held read-but-not-assembled at once (``<= memory_budget``).
    peak_buffered_bytes: int = 0
    #: Tensor records checked against their stored CRC-32 (``verify=True``).
    verified_records: int = 0
    #: Files the load opened or fetched from.
    files: int = 0
    #: Bytes shared with or received from other ranks instead of read (ShardedLoadPlanner).
    bytes_received: int = 0
    bytes_sent: int = 0
    #: Keys present in the checkpoint but absent from the destination.
    unexpected_keys: list[str] = field(default_factory=list)
    #: Retries by cause: ``timeout``, ``status_503``, ``connection``, ``short_read`` ...
    retries_by_cause: dict[str, int] = field(default_factory=dict)
    #: Per-chunk latency percentiles, seconds (successful attempts).
    latency_p50: float = 0.0
    latency_p90: float = 0.0
    latency_p99: float = 0.0
    latency_max: float = 0.0
    #: Time split: summed over readers waiting for storage, time the dispatcher waited for
    #: budget, and summed time spent assembling (copies, checksums).
    storage_wait_seconds: float = 0.0
    budget_wait_seconds: float = 0.0
    assembly_seconds: float = 0.0
    #: Highest number of reads in flight at once (useful with ``concurrency="auto"``).
    peak_concurrency: int = 0

    @property
    def throughput(self) -> float:
        """Bytes assembled per second of wall time."""
        return self.bytes_assembled / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(self.retries_by_cause.items())) or "none"
        return (
            f"Loaded {_fmt_bytes(self.bytes_assembled)} in {self.seconds:.3f} s "
            f"({_fmt_bytes(self.throughput)}/s) from {self.files} file(s): "
            f"{_fmt_bytes(self.bytes_read)} read in {self.chunks} chunks, "
            f"peak {_fmt_bytes(self.peak_buffered_bytes)} buffered, up to {self.peak_concurrency} reads in flight; "
            f"chunk latency p50 {self.latency_p50 * 1e3:.1f} ms, p90 {self.latency_p90 * 1e3:.1f} ms, "
            f"p99 {self.latency_p99 * 1e3:.1f} ms, max {self.latency_max * 1e3:.1f} ms; "
            f"{self.retries} retries ({causes}), {self.timeouts} timeouts, {self.hedges} hedges; "
            f"time waiting on storage {self.storage_wait_seconds:.3f} s, on budget {self.budget_wait_seconds:.3f} s, "
            f"assembling {self.assembly_seconds:.3f} s"
            + (f"; {self.verified_records} records verified" if self.verified_records else "")
            + (f"; {len(self.unexpected_keys)} unexpected keys in checkpoint" if self.unexpected_keys else "")
            + "."
        )


class StatsRecorder:
    """Thread-safe accumulator the pipeline writes into; ``snapshot()`` gives a LoadStats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stats = LoadStats()
        self._latencies: list[float] = []
        self._causes: Counter[str] = Counter()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def maximum(self, name: str, value: float) -> None:
        with self._lock:
            if value > getattr(self.stats, name):
                setattr(self.stats, name, value)

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append(seconds)

    def recent_latency_quantile(self, q: float, window: int = 256) -> float | None:
        with self._lock:
            recent = self._latencies[-window:]
        if len(recent) < 4:
            return None
        return _percentile(sorted(recent), q)

    def retry(self, cause: str) -> None:
        with self._lock:
            self.stats.retries += 1
            self._causes[cause] += 1
            if cause == "timeout":
                self.stats.timeouts += 1

    def snapshot(self) -> LoadStats:
        with self._lock:
            s = LoadStats(**{k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__})
            s.unexpected_keys = list(self.stats.unexpected_keys)
            s.retries_by_cause = dict(self._causes)
            lat = sorted(self._latencies)
        s.latency_p50 = _percentile(lat, 0.50)
        s.latency_p90 = _percentile(lat, 0.90)
        s.latency_p99 = _percentile(lat, 0.99)
        s.latency_max = lat[-1] if lat else 0.0
        return s
