"""The cost of a read plan: what a load may read beyond what its destinations need.

:class:`ReadBudget` holds the over-read bound (``LoadOptions.max_over_read_ratio``) and the
cost model (one more request's latency against reading a gap, :func:`break_even_gap`):
which records phase A reads whole and which it probes, which gaps are read through.
:class:`ForeignBytes` says which bytes of a gap count against the bound (other items'
data, never headers). docs/tuning.md has the rules and the figures.
"""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING, Any

from asyncload.common.options import CheckPolicy, ChunkPolicy
from asyncload.common.stats import StatsRecorder
from asyncload.engine.chunks import Chunk, Piece
from asyncload.engine.plan import break_even_gap, make_chunks

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload.engine.records import Record

# records and torchsave (torch.distributed.checkpoint) are imported where a load's records
# are priced: ReadBudget's gap rules alone (asyncload.safe_open's) need neither

__all__ = ["ForeignBytes", "ReadBudget", "unit_chunks"]

#: The cost model's assumptions until the load has measured its store (docs/tuning.md):
#: seconds one more request costs beyond its bytes, and bytes per second of one stream.
LOCAL_REQUEST_SECONDS = 20e-6
LOCAL_BANDWIDTH = 4 << 30
REMOTE_REQUEST_SECONDS = 20e-3
REMOTE_BANDWIDTH = 64 << 20


class ReadBudget:
    """What a load may read beyond what its destinations need (``max_over_read_ratio``),
    and what reading a gap is worth (:func:`asyncload.engine.plan.break_even_gap`): records read
    whole or probed, gaps read through or skipped. Unbounded (``None``, or ``verify=True``,
    which reads every byte of a storage anyway): the rules of ``min_chunk_size`` alone."""

    def __init__(self, ratio: float | None, remote: bool, needed: int, read_before: int) -> None:
        self.bounded = ratio is not None
        self.limit = int((ratio or 1.0) * needed)
        self.read_before = read_before
        self.latency = REMOTE_REQUEST_SECONDS if remote else LOCAL_REQUEST_SECONDS
        self.bandwidth = REMOTE_BANDWIDTH if remote else LOCAL_BANDWIDTH
        #: plan_tensor's gap limit: 0 under the bound (make_chunks joins within the budget)
        self.max_gap: int | None = 0 if self.bounded else None
        self._spare = 0

    @classmethod
    def for_load(
        cls, checks: CheckPolicy, remote: bool, records: list[Record], read_before: int
    ) -> ReadBudget:
        from asyncload.engine.records import needed

        ratio = None if checks.verify else checks.max_over_read_ratio
        return cls(ratio, remote, sum(needed(r) for r in records if not r.transforms), read_before)

    def whole_records(self, records: list[Record], small: int) -> set[int]:
        """ids of the records phase A reads whole (the others with tensors are probed)."""
        from asyncload.engine.records import needed
        from asyncload.formats import HEAD_PROBE, TAIL_PROBE

        whole: set[int] = set()
        candidates: list[tuple[int, Record]] = []
        spare = self.limit - sum(needed(r) for r in records if not r.transforms)
        for rec in records:
            if rec.entry is not None or rec.transforms:
                continue
            if rec.byte_items:
                whole.add(id(rec))
                continue
            probed = min(rec.length, HEAD_PROBE + TAIL_PROBE)
            if rec.length > small:
                spare -= probed
                continue
            extra = rec.length - needed(rec)
            if not self.bounded or extra <= probed:  # whole costs no more bytes than probing
                whole.add(id(rec))
                spare -= extra
                continue
            spare -= probed
            candidates.append((extra - probed, rec))
        # whole instead of probed: saves the probes' and the data's requests for ``cost`` bytes
        worth = 3 * break_even_gap(self.latency, self.bandwidth)
        for cost, rec in sorted(candidates, key=lambda c: c[0]):
            if cost > spare or cost > worth:
                break
            spare -= cost
            whole.add(id(rec))
        self._spare = max(0, spare)
        return whole

    def measure(self, recorder: StatsRecorder) -> None:
        """Use the latency measured so far (the requests' median), where there is one."""
        p50 = recorder.snapshot().latency_p50
        if p50 > 0:
            self.latency = p50

    def join_gap(self, min_chunk_size: int) -> int:
        """The largest gap make_chunks may read through."""
        if not self.bounded:
            return min_chunk_size
        return max(1, min(min_chunk_size, break_even_gap(self.latency, self.bandwidth)))

    def gap_allowance(
        self, read_now: int | None = None, pieces: list[Piece] | None = None
    ) -> int | None:
        """Bytes make_chunks may read through gaps: what phase A left (no arguments), or
        what is left once ``read_now`` bytes were read and ``pieces`` are still to read."""
        if not self.bounded:
            return None
        if read_now is None or pieces is None:
            return self._spare
        return max(0, self.limit - (read_now - self.read_before) - sum(p.nbytes for p in pieces))


class ForeignBytes:
    """``charge`` for make_chunks: the bytes of a gap that count against the over-read bound,
    those of saved items (tensors, objects) the load does not need. The headers of the
    records it reads (a zip's directory between two tensors it needs), and bytes the
    metadata describes no item in (torch.save's local headers between storages), are priced
    by the cost model alone: reading them never means reading another rank's data."""

    def __init__(self, metadata: Metadata | None, located: list[tuple[Record, Any]]) -> None:
        self._metadata = metadata
        self._located = located
        self._items: dict[str, Coverage] | None = None
        self._headers: dict[str, Coverage] = {}

    def __call__(self, name: str, start: int, end: int) -> int:
        found = self._items if self._items is not None else self._build()
        items, headers = found.get(name), self._headers.get(name)
        n = items.overlap(start, end) if items is not None else 0
        return max(0, n - (headers.overlap(start, end) if headers is not None else 0))

    def _build(self) -> dict[str, Coverage]:
        extents: dict[str, list[tuple[int, int]]] = {}
        storage_data = getattr(self._metadata, "storage_data", None) or {}
        for sinfo in storage_data.values():
            name, offset, length = (
                getattr(sinfo, a, None) for a in ("relative_path", "offset", "length")
            )
            if (
                isinstance(name, str)
                and isinstance(offset, int)
                and isinstance(length, int)
                and length > 0
            ):
                extents.setdefault(name, []).append((offset, offset + length))
        heads: dict[str, list[tuple[int, int]]] = {}
        for rec, loc in self._located:
            data_end = loc.data_start + loc.storage_nbytes
            for lo, hi in (
                (rec.offset, min(rec.end, loc.data_start)),
                (max(rec.offset, data_end), rec.end),
            ):
                if lo < hi:
                    heads.setdefault(rec.name, []).append((lo, hi))
        self._headers = {n: Coverage(v) for n, v in heads.items()}
        self._items = {n: Coverage(v) for n, v in extents.items()}
        return self._items


class Coverage:
    """Byte ranges of one file, merged; ``overlap(start, end)``: how many bytes of
    ``[start, end)`` they cover (a bisection)."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [lo for lo, _ in merged]
        self.ends = [hi for _, hi in merged]
        self.before = list(itertools.accumulate((hi - lo for lo, hi in merged), initial=0))

    def _covered(self, x: int) -> int:
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0:
            return 0
        return self.before[i] + min(x, self.ends[i]) - self.starts[i]

    def overlap(self, start: int, end: int) -> int:
        return self._covered(end) - self._covered(start)


def unit_chunks(pieces: list[Piece], chunking: ChunkPolicy, reads: ReadBudget) -> list[Chunk]:
    """Chunks of probes and whole records: not payload (each whole record's delivery, and
    each record's data read later, count their own bytes)."""
    chunks = make_chunks(
        pieces,
        chunk_size=chunking.chunk_size,
        min_chunk_size=reads.join_gap(chunking.min_chunk_size),
        max_over_read=reads.gap_allowance(),
    )
    for c in chunks:
        for seg in c.segments:
            seg.payload = False
    return chunks
