"""LoadStats: what a load did, as numbers worth reading."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from asyncload.common.latency import percentile
from asyncload.common.options import FieldDoc, FieldsDoc

__all__ = ["LoadStats"]


def _fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units; bytes without decimals)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_seconds(s: float) -> str:
    """A duration for people: ``0.0042`` -> ``"4.2 ms"``, ``12.3`` -> ``"12.30 s"``."""
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"  # every word used here takes a plain "s"


@dataclass
class LoadStats:
    """Counters of one load. ``bytes_read`` counts the bytes storage delivered to the load
    (each successful read once: the bytes of failed attempts and of the losing request of a
    hedge are not counted; ``retries`` and ``hedges`` count those requests), the checkpoint's
    ``.metadata`` left out; ``bytes_assembled`` bytes placed into destinations."""

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
    #: Files the load opened or fetched from: the data files and the metadata file (a DCP
    #: checkpoint's ``.metadata``), as ``asyncload inspect`` counts them (``file_count``).
    files: int = 0
    #: Bytes shared with or received from other ranks instead of read (ShardedLoadPlanner).
    bytes_received: int = 0
    bytes_sent: int = 0
    #: Adaptive sharing (ShardedLoadPlanner): bytes of shared ranges this rank read that the
    #: plan had given to another rank (it got there first), and bytes it read from storage
    #: itself because a transfer from another rank was late (the later copy is discarded).
    bytes_taken_over: int = 0
    bytes_hedged: int = 0
    #: Keys present in the checkpoint but absent from the destination.
    unexpected_keys: list[str] = field(default_factory=list)
    #: The top-level name the destination's keys were loaded from under (``"model"`` for a
    #: ``{"model": ..., "optim": ...}`` checkpoint loaded into ``model.state_dict()``), or
    #: ``""`` when the keys matched as they are (docs/formats.md). Keys outside that prefix
    #: are not listed in ``unexpected_keys``.
    key_prefix: str = ""
    #: Destination keys the checkpoint lacks, left as they were (``allow_partial_load=True``), sorted.
    missing_keys: list[str] = field(default_factory=list)
    #: Tied destination keys (the same memory as another key's tensor: same storage, offset,
    #: shape, stride and dtype) -> the key whose load filled them (``lm_head.weight`` ->
    #: ``model.embed_tokens.weight``). Where the checkpoint holds both, their values were
    #: compared and found bit for bit equal.
    tied_keys: dict[str, str] = field(default_factory=dict)
    #: Retries by cause: ``timeout``, ``status_503``, ``connection``, ``short_read`` ...
    retries_by_cause: dict[str, int] = field(default_factory=dict)
    #: Latency percentiles of storage requests, seconds: successful attempts of chunk reads (and of the
    #: few metadata, size and header requests a load makes besides).
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
    #: Node-aware sharing (ShardedLoadPlanner on several nodes): bytes this rank received from
    #: ranks on other nodes (for its node), and bytes of its own chunks that another rank of
    #: its node fetched and handed over through shared memory.
    bytes_from_other_nodes: int = 0
    bytes_from_own_node: int = 0
    #: ShardedLoadPlanner: ``"share"`` (shared ranges read once and sent over the process
    #: group) or ``"read"`` (every rank read its own bytes: sharing would not pay); ``""``
    #: without sharing. ``sharing_reason``: why (the cost model's figures, or the knob that
    #: decided); ``sharing_unit_size``: adaptive sharing's work unit in the data phase, bytes.
    sharing_decision: str = ""
    sharing_reason: str = ""
    sharing_unit_size: int = 0
    #: Seconds from the call to the first byte of the checkpoint's data files (header probes
    #: included, the ``.metadata`` file left out): when the answer to the first such read began
    #: (remote stores that tell: wire) or the read ended (the others). 0.0: none read.
    time_to_first_byte: float = 0.0
    #: Multi-rank loads: ``.metadata`` was read once, by the group's rank 0, and its bytes
    #: broadcast to the other ranks (``LoadOptions.share_metadata``); False on a rank that
    #: read its own.
    metadata_shared: bool = False
    #: Node-aware sharing: bytes of shared memory (``/dev/shm``) the node's ring of windows
    #: held in the largest read phase, at most ``memory_budget`` (the node's ranks copy one
    #: window out while the next is fetched into the other).
    node_shared_memory_bytes: int = 0
    #: ShardedLoadPlanner, when bytes were shared: the group that carried them and why:
    #: ``"main: ..."`` (the load's process group) or ``"side: ..."`` (a gloo group of the same
    #: ranks, for a load whose group matches sends by order, such as NCCL:
    #: ``ShardedLoadPlanner(side_group=...)``); ``""`` when no byte was shared.
    sharing_group: str = ""
    #: Wall-clock seconds the dispatcher waited for a free read slot (``concurrency`` reads
    #: already in flight), beside ``budget_wait_seconds`` (waits on an exhausted budget only).
    slot_wait_seconds: float = 0.0
    #: The client that read a remote checkpoint and why where ``transport="auto"`` chose
    #: (``"wire"``; ``"fsspec"``; ``"fsspec (wire cannot honour ...)"``); ``"local"`` for a
    #: local one; ``""`` before the store is opened.
    transport: str = ""

    @property
    def throughput(self) -> float:
        """Bytes assembled per second of wall time."""
        return self.bytes_assembled / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_concurrency(self) -> float:
        """Storage reads in flight on average over the load: ``storage_wait_seconds`` (summed
        over concurrent reads) divided by the wall time ``seconds``."""
        return self.storage_wait_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field plus ``throughput`` (bytes/s) and ``mean_concurrency``, as plain
        JSON-serialisable values."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                v = list(v)
            elif isinstance(v, dict):
                v = dict(v)
            out[f.name] = v
        out["throughput"] = self.throughput
        out["mean_concurrency"] = self.mean_concurrency
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadStats:
        """The inverse of :meth:`to_dict` (unknown keys, such as ``throughput``, are ignored;
        fields it lacks keep their defaults)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def __str__(self) -> str:
        """One readable paragraph: what was loaded, how fast, where the time went, what went wrong."""
        parts = [
            (
                f"Loaded {_fmt_bytes(self.bytes_assembled)} in {self.seconds:.3f} s ({_fmt_bytes(self.throughput)}/s) "
                f"from {_plural(self.files, 'file')}: {_fmt_bytes(self.bytes_read)} read in {_plural(self.chunks, 'request')}, "
                f"up to {self.peak_concurrency} in flight, at most {_fmt_bytes(self.peak_buffered_bytes)} buffered."
            )
        ]
        if self.chunks:
            parts.append(
                f"Request latency p50 {_fmt_seconds(self.latency_p50)}, p90 {_fmt_seconds(self.latency_p90)}, "
                f"p99 {_fmt_seconds(self.latency_p99)}, max {_fmt_seconds(self.latency_max)}."
            )
        parts.append(
            f"Time summed over concurrent requests: {self.storage_wait_seconds:.3f} s waiting for storage "
            f"({self.mean_concurrency:.1f} in flight on average), {self.assembly_seconds:.3f} s assembling. "
            f"Wall-clock waits before a read: {self.budget_wait_seconds:.3f} s for memory budget (full), "
            f"{self.slot_wait_seconds:.3f} s for a read slot (concurrency limit)."
        )
        if self.retries or self.timeouts or self.hedges:
            causes = ", ".join(f"{k} {v}" for k, v in sorted(self.retries_by_cause.items()))
            parts.append(
                (f"{self.retries} retries" if self.retries != 1 else "1 retry")
                + (f" ({causes})" if causes else "")
                + f", {_plural(self.timeouts, 'timeout')}, {_plural(self.hedges, 'hedged request')}."
            )
        else:
            parts.append("No retries, timeouts or hedged requests.")
        if self.verified_records:
            parts.append(
                f"{_plural(self.verified_records, 'record')} verified against stored CRC-32."
            )
        if self.bytes_received or self.bytes_sent:
            parts.append(
                f"{_fmt_bytes(self.bytes_received)} received from and {_fmt_bytes(self.bytes_sent)} "
                "sent to other ranks."
            )
        if self.sharing_reason:
            parts.append(f"Sharing: {self.sharing_reason}.")
        if self.unexpected_keys:
            shown = ", ".join(self.unexpected_keys[:3]) + (
                ", ..." if len(self.unexpected_keys) > 3 else ""
            )
            parts.append(
                f"{_plural(len(self.unexpected_keys), 'checkpoint key')} not in the destination ({shown})."
            )
        if self.missing_keys:
            shown = ", ".join(self.missing_keys[:3]) + (
                ", ..." if len(self.missing_keys) > 3 else ""
            )
            parts.append(
                f"{_plural(len(self.missing_keys), 'destination key')} not in the checkpoint, left as they were ({shown})."
            )
        if self.tied_keys:
            ties = list(self.tied_keys.items())
            shown = ", ".join(f"{k} -> {v}" for k, v in ties[:3]) + (
                ", ..." if len(ties) > 3 else ""
            )
            parts.append(
                f"{_plural(len(ties), 'tied key')} (the same memory as another key's) filled through that key ({shown})."
            )
        return " ".join(parts)


class StatsRecorder:
    """Thread-safe accumulator the pipeline writes into; ``snapshot()`` gives a LoadStats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stats = LoadStats()
        self._latencies: list[float] = []
        self._causes: Counter[str] = Counter()
        #: when the load was called (the load clock), for ``time_to_first_byte``
        self.started: float | None = None

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def set(self, **values: Any) -> None:
        """Set fields (those that are not counters: ``sharing_decision`` ...)."""
        with self._lock:
            for k, v in values.items():
                setattr(self.stats, k, v)

    def maximum(self, name: str, value: float) -> None:
        with self._lock:
            if value > getattr(self.stats, name):
                setattr(self.stats, name, value)

    def first_data(self, at: float) -> None:
        """The answer to a read of data began at ``at`` (the load clock): the first one sets
        ``time_to_first_byte``, counted from ``started`` (set by the session at the call)."""
        with self._lock:
            if not self.stats.time_to_first_byte and self.started is not None:
                self.stats.time_to_first_byte = max(at - self.started, 1e-9)

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append(seconds)

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
            s.missing_keys = list(self.stats.missing_keys)
            s.tied_keys = dict(self.stats.tied_keys)
            s.retries_by_cause = dict(self._causes)
            lat = sorted(self._latencies)
        s.latency_p50 = percentile(lat, 0.50, min_samples=1) or 0.0
        s.latency_p90 = percentile(lat, 0.90, min_samples=1) or 0.0
        s.latency_p99 = percentile(lat, 0.99, min_samples=1) or 0.0
        s.latency_max = lat[-1] if lat else 0.0
        return s


class SharedRecorder(StatsRecorder):
    """A view of ``inner`` for one of several reads of a load that run at once: whatever it
    records lands in ``inner`` (the same statistics, lock, latencies and causes), and the
    bytes this read assembled are also counted apart (:attr:`assembled`), for its own check
    that every destination byte it was given was written."""

    def __init__(self, inner: StatsRecorder) -> None:  # shares inner's state: no super()
        self._inner = inner
        self._lock = inner._lock
        self.stats = inner.stats
        self._latencies = inner._latencies
        self._causes = inner._causes
        #: ``bytes_assembled`` recorded through this view.
        self.assembled = 0

    @property
    def started(self) -> float | None:
        return self._inner.started

    @started.setter
    def started(self, value: float | None) -> None:
        self._inner.started = value

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)
            self.assembled += int(deltas.get("bytes_assembled", 0))


STATS_DOCS: dict[str, FieldDoc] = {
    "bytes_read": FieldDoc(
        "Bytes storage delivered to the load (each successful read once; failed attempts, the "
        "losing request of a hedge and the .metadata file not counted).",
        "bytes",
    ),
    "bytes_assembled": FieldDoc("Bytes placed into the destination's tensors.", "bytes"),
    "chunks": FieldDoc(
        "Read requests that delivered data (retries and hedges not counted).", "count"
    ),
    "retries": FieldDoc("Attempts repeated after a failed one (retries_by_cause: why).", "count"),
    "timeouts": FieldDoc("Attempts that ran out of LoadOptions.timeout.", "count"),
    "hedges": FieldDoc("Duplicate requests sent for straggling chunks.", "count"),
    "seconds": FieldDoc("Wall-clock time of the load, from the call to its return.", "seconds"),
    "peak_buffered_bytes": FieldDoc(
        "The most bytes held read-but-not-assembled at once (at most memory_budget).", "bytes"
    ),
    "verified_records": FieldDoc(
        "Tensor records checked against their stored CRC-32 (verify=True).", "count"
    ),
    "files": FieldDoc(
        "Files the load opened or fetched from: the data files and the metadata file.", "count"
    ),
    "bytes_received": FieldDoc(
        "Bytes received from other ranks instead of read (ShardedLoadPlanner).", "bytes"
    ),
    "bytes_sent": FieldDoc("Bytes this rank sent to other ranks (ShardedLoadPlanner).", "bytes"),
    "bytes_taken_over": FieldDoc(
        "Adaptive sharing: bytes of shared ranges this rank read that the plan had given to "
        "another rank (it got there first).",
        "bytes",
    ),
    "bytes_hedged": FieldDoc(
        "Adaptive sharing: bytes this rank read itself because a transfer from another rank was "
        "late.",
        "bytes",
    ),
    "unexpected_keys": FieldDoc(
        "Checkpoint keys the destination lacks (not loaded).", "list of keys"
    ),
    "key_prefix": FieldDoc(
        "The top-level name the destination's keys were loaded from under ('model' for a "
        "{'model': ..., 'optim': ...} checkpoint loaded into model.state_dict()); '' when the "
        "keys matched as they are.",
        "key prefix",
    ),
    "missing_keys": FieldDoc(
        "Destination keys the checkpoint lacks, left as they were (allow_partial_load=True), "
        "sorted.",
        "list of keys",
    ),
    "tied_keys": FieldDoc(
        "Tied destination keys (the same memory as another key's tensor) -> the key whose load "
        "filled them.",
        "dict of keys",
    ),
    "retries_by_cause": FieldDoc(
        "Retries by cause: timeout, status_503, connection, short_read ...", "dict of counts"
    ),
    "latency_p50": FieldDoc("Median latency of successful storage requests.", "seconds"),
    "latency_p90": FieldDoc("90th percentile latency of storage requests.", "seconds"),
    "latency_p99": FieldDoc("99th percentile latency of storage requests.", "seconds"),
    "latency_max": FieldDoc("Slowest successful storage request.", "seconds"),
    "storage_wait_seconds": FieldDoc(
        "Time reads spent waiting for storage, SUMMED over concurrent reads: it exceeds the "
        "wall time when reads overlap; divided by seconds it is mean_concurrency.",
        "seconds (summed over reads)",
    ),
    "budget_wait_seconds": FieldDoc(
        "Wall-clock time the dispatcher waited because the memory budget was full (the next "
        "read did not fit memory_budget); 0 when the budget never ran out.",
        "seconds (wall clock)",
    ),
    "assembly_seconds": FieldDoc(
        "Time spent assembling read bytes into tensors (copies, checksums), SUMMED over reads.",
        "seconds (summed over reads)",
    ),
    "peak_concurrency": FieldDoc(
        "The most reads in flight at once (useful with concurrency='auto').", "count"
    ),
    "bytes_from_other_nodes": FieldDoc(
        "Node-aware sharing: bytes this rank received from ranks on other nodes.", "bytes"
    ),
    "bytes_from_own_node": FieldDoc(
        "Node-aware sharing: bytes of this rank's chunks another rank of its node fetched and "
        "handed over through shared memory.",
        "bytes",
    ),
    "sharing_decision": FieldDoc(
        "ShardedLoadPlanner: 'share' (shared ranges read once and sent) or 'read' (every rank "
        "read its own); '' without sharing.",
        "name",
    ),
    "sharing_reason": FieldDoc(
        "Why sharing_decision was taken (the cost model's figures, or the knob that decided).",
        "text",
    ),
    "sharing_unit_size": FieldDoc("Adaptive sharing's work unit in the data phase.", "bytes"),
    "time_to_first_byte": FieldDoc(
        "From the call to the first byte of the data files (.metadata left out); 0.0: none read.",
        "seconds",
    ),
    "metadata_shared": FieldDoc(
        "Multi-rank loads: .metadata was read once by rank 0 and broadcast "
        "(LoadOptions.share_metadata).",
        "bool",
    ),
    "node_shared_memory_bytes": FieldDoc(
        "Node-aware sharing: shared memory (/dev/shm) the node's ring of windows held, at most "
        "memory_budget.",
        "bytes",
    ),
    "sharing_group": FieldDoc(
        "ShardedLoadPlanner, when bytes were shared: the group that carried them and why "
        "('main: ...' or 'side: ...'); '' when none was.",
        "text",
    ),
    "slot_wait_seconds": FieldDoc(
        "Wall-clock time the dispatcher waited for a free read slot (concurrency reads already "
        "in flight): the store, not the budget, set the pace.",
        "seconds (wall clock)",
    ),
    "transport": FieldDoc(
        "The client that read the checkpoint: 'wire', 'fsspec', or 'fsspec (wire cannot "
        "honour ...)' where transport='auto' fell back and why; 'local' for local files.",
        "text",
    ),
}

LoadStats.__doc__ = FieldsDoc(  # type: ignore[assignment]
    LoadStats.__doc__, STATS_DOCS, "Fields (meaning, unit, default)"
)
