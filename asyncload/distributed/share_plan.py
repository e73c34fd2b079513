"""The plan of a sharded read phase: which rank reads which shared bytes. Pure and
deterministic (numpy, no process group): every rank computes the same answer from the same
all-gathered needs.

- :func:`plan_transfers`: the whole plan, one :class:`Transfer` per shared range, owners
  balanced by bytes; :func:`split_units` and :func:`balance_units` cut it into adaptive
  sharing's work units and balance their owners;
- :func:`_rank_plan`: one rank's part of either, without building the rest;
- :func:`_advertise` and :func:`_parts_for`: a rank's chunks as needs, and split by source;
- :func:`_pack` and :func:`_unpack`: the needs as the all-gather carries them.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncload.common.errors import AsyncLoadError
from asyncload.engine import Chunk, Piece

#: ``Chunk`` and ``Piece``: the engine's reads this plan takes in (named here for the wing's
#: tests).
__all__ = ["Chunk", "Piece", "Transfer", "balance_units", "plan_transfers", "split_units"]


@dataclass(frozen=True)
class Transfer:
    """Bytes ``[start, end)`` of file ``name`` that several ranks need: ``owner`` reads
    them from storage and sends them to the other ``consumers`` (group ranks)."""

    index: int
    name: str
    start: int
    end: int
    owner: int
    consumers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_transfers(
    needs: Sequence[Sequence[tuple[str, int, int]]],
) -> tuple[list[Transfer], list[int]]:
    """Which rank reads which shared bytes. Pure and deterministic: every rank computes
    the same answer from the same all-gathered ``needs``.

    ``needs[r]`` lists the half-open byte ranges ``(file, start, end)`` rank ``r`` needs
    (or holds them packed, as the all-gather carries them: ``{file: bytes}`` of little-endian
    int64 ``start, end, start, end ...``); one rank's ranges do not overlap (they may touch).
    Returns the transfers, in global order (by file, then offset), and the bytes each rank
    will read from storage.

    Every byte that two or more ranks need is in exactly one transfer; its owner is one of
    the ranks that need it, chosen greedily (largest transfers first, to the consumer with
    the fewest bytes so far) to balance bytes read per rank. A transfer never crosses a
    range boundary of any of its consumers, so it lands inside one read request of each.

    This is the whole plan, one object per transfer; a load plans only its own part of it
    (:func:`_rank_plan`: the same transfers and owners, numbered within the ranks it shares
    files with).
    """
    world = len(needs)
    shared = _sweep(needs, range(world))
    sets, set_of = _consumer_sets(shared)
    load = shared.alone.tolist()
    owners = _greedy(shared.end - shared.start, set_of, sets, load, largest_first=True)
    names = shared.names
    transfers = [
        Transfer(i, names[f], start, end, owner, sets[k])
        for i, (f, start, end, owner, k) in enumerate(
            zip(
                shared.file.tolist(),
                shared.start.tolist(),
                shared.end.tolist(),
                owners,
                set_of.tolist(),
            )
        )
    ]
    return transfers, load


@dataclass(frozen=True)
class _Shared:
    """What the sweep finds, as arrays (one entry per transfer, in global order: by file,
    then offset) instead of an object per transfer."""

    names: list[str]
    #: Per transfer: the index of its file in ``names``, its bytes ``[start, end)``.
    file: Any
    start: Any
    end: Any
    #: The consumers of transfer ``i`` are ``who[ptr[i]:ptr[i + 1]]`` (ascending).
    ptr: Any
    who: Any
    #: Per rank: the bytes it alone needs.
    alone: Any


def _sweep(needs: Sequence[Any], ranks: Iterable[int]) -> _Shared:
    """The shared pieces of the needs of ``ranks`` (``needs[r]``: packed, or tuples): a sorted
    sweep in numpy over all files at once (each file's offsets shifted past the files before
    it), cut at every rank's boundaries; a piece two or more ranks cover is one transfer
    (every boundary is a consumer's), a piece one rank covers is that rank's alone."""
    world = len(needs)
    names, starts, ends, rank, files = _ranges(needs, ranks)
    alone = np.zeros(world, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    keep = ends > starts
    starts, ends, rank, files = starts[keep], ends[keep], rank[keep], files[keep]
    if not len(starts):
        return _Shared(names, empty, empty, empty, np.zeros(1, dtype=np.int64), empty, alone)
    span = int(ends.max()) + 1
    if len(names) * span < 1 << 62:  # the same room for every file
        base = np.arange(len(names), dtype=np.int64) * span
    else:  # each file's own size (needed only past exabytes)
        top = np.zeros(len(names), dtype=np.int64)
        np.maximum.at(top, files, ends)
        base = np.concatenate([[0], np.cumsum(top + 1)[:-1]])
    # strictly increasing bases: no piece spans two files
    starts, ends = starts + base[files], ends + base[files]
    points = _sorted_unique(np.concatenate([starts, ends]))
    lo = np.searchsorted(points, starts)
    count = np.searchsorted(points, ends) - lo
    total = int(count.sum())
    piece = np.arange(total, dtype=np.int64) + np.repeat(lo - (np.cumsum(count) - count), count)
    pairs = _sorted_unique(piece * world + np.repeat(rank, count))
    piece, who = pairs // world, pairs % world
    first = np.flatnonzero(np.concatenate([[True], piece[1:] != piece[:-1]]))
    size = np.diff(np.append(first, len(piece)))
    pstart, pend = points[piece[first]], points[piece[first] + 1]
    single = size == 1
    np.add.at(alone, who[first[single]], (pend - pstart)[single])
    multi = ~single
    who = who[np.repeat(multi, size)]
    ptr = np.concatenate([[0], np.cumsum(size[multi])])
    pstart, pend = pstart[multi], pend[multi]
    file = np.searchsorted(base, pstart, side="right") - 1
    return _Shared(names, file, pstart - base[file], pend - base[file], ptr, who, alone)


def _consumer_sets(shared: _Shared) -> tuple[list[tuple[int, ...]], Any]:
    """The distinct sets of consumers, one tuple each, and the set of each transfer (an index
    into them), in numpy: per number of consumers, the rows of the consumer matrix hashed to
    one int64 each (checked: equal hashes must be equal rows), unique over the hashes."""
    sets: list[tuple[int, ...]] = []
    set_of = np.zeros(len(shared.start), dtype=np.int64)
    size = np.diff(shared.ptr)
    weights = np.random.default_rng(0x5EED).integers(
        1, 1 << 62, size=int(size.max(initial=0)), dtype=np.int64
    )
    for n in np.unique(size).tolist():
        which = np.flatnonzero(size == n)
        rows = shared.who[shared.ptr[which][:, None] + np.arange(n)]
        with np.errstate(over="ignore"):
            digest = (rows * weights[:n]).sum(axis=1)  # wraps around: a hash
        _, first, inverse = np.unique(digest, return_index=True, return_inverse=True)
        distinct = rows[first]
        if not np.array_equal(
            distinct[inverse], rows
        ):  # a collision (never seen): sort the rows themselves
            distinct, inverse = np.unique(rows, axis=0, return_inverse=True)
        set_of[which] = len(sets) + inverse.reshape(-1)
        sets.extend(tuple(r) for r in distinct.tolist())
    return sets, set_of


def _greedy(
    nbytes: Any,
    set_of: Any,
    sets: Sequence[tuple[int, ...]],
    load: list[int],
    *,
    largest_first: bool,
) -> list[int]:
    """An owner for each item (``nbytes[i]`` bytes, consumers ``sets[set_of[i]]``): the consumer
    with the fewest bytes so far (``load``, updated; ties: the lowest rank), items taken in
    order or (``largest_first``) largest first, ties in order. One lazy heap per set of
    consumers instead of a scan of every consumer each time: an entry is stale when its rank
    was given bytes through another set (loads only grow, so a fresh top is the least)."""
    n = len(nbytes)
    order = np.argsort(-np.asarray(nbytes), kind="stable").tolist() if largest_first else range(n)
    sizes = np.asarray(nbytes).tolist()
    which = np.asarray(set_of).tolist()
    heaps: list[list[tuple[int, int]] | None] = [None] * len(sets)
    owners = [0] * n
    replace = heapq.heapreplace
    for i in order:
        k = which[i]
        heap = heaps[k]
        if heap is None:
            heap = heaps[k] = [(load[c], c) for c in sets[k]]
            heapq.heapify(heap)
        top = heap[0]
        while top[0] != load[top[1]]:
            replace(heap, (load[top[1]], top[1]))
            top = heap[0]
        owner = top[1]
        got = load[owner] = top[0] + sizes[i]
        replace(heap, (got, owner))
        owners[i] = owner
    return owners


@dataclass(frozen=True)
class _RankPlan:
    """One rank's part of the global plan of a read phase (:func:`_rank_plan`)."""

    #: The lowest rank of the ranks it shares files with, directly or through others (its
    #: component): the items are numbered within the component, which names their claim keys.
    component: int
    #: Ranks in the component, and how many transfers (or units) it has in all.
    ranks: list[int]
    count: int
    #: The transfers (or units) this rank is a consumer of, in order, numbered in the component.
    items: list[Transfer]
    #: Bytes this rank is planned to read from storage (alone, and as owner).
    planned: int


def _rank_plan(needs: Sequence[Any], rank: int, unit_size: int | None = None) -> _RankPlan:
    """What ``rank`` needs of :func:`plan_transfers` (``unit_size=None``) or of adaptive
    sharing's balanced work units (``balance_units(split_units(...), load)``), without the
    rest of the plan: the same items, owners and order, numbered from 0 within its component.

    Exact because the greedy owner choices only ever compare the loads of one item's
    consumers, and the ranks that share a file are in one component: the components'
    choices do not depend on each other. Every rank of a component computes the same
    component plan (the same sweep over the same ranges); ranks of other components never
    exchange bytes with it, so numbering within the component keeps transfer tags and claim
    keys (which name the component) apart."""
    ranks = _component(needs, rank)
    shared = _sweep(needs, ranks)
    sets, set_of = _consumer_sets(shared)
    load = shared.alone.tolist()
    names = shared.names
    n = len(set_of)
    mine = np.zeros(n, dtype=bool)
    mine[np.repeat(np.arange(n), np.diff(shared.ptr))[shared.who == rank]] = True
    if unit_size is None:
        start, end, of = shared.start, shared.end, np.arange(n)
        owners = _greedy(end - start, set_of, sets, load, largest_first=True)
    else:  # split_units, then balance_units (whose starting loads are what each rank reads alone)
        start, end, of = _split(shared.start, shared.end, unit_size)
        owners = _greedy(end - start, set_of[of], sets, load, largest_first=False)
        mine = mine[of]
    file, unit_set = shared.file[of], set_of[of]
    items = [
        Transfer(i, names[file[i]], int(start[i]), int(end[i]), owners[i], sets[unit_set[i]])
        for i in np.flatnonzero(mine).tolist()
    ]
    return _RankPlan(ranks[0], ranks, len(start), items, load[rank])


def _split(start: Any, end: Any, unit_size: int) -> tuple[Any, Any, Any]:
    """:func:`split_units` on arrays: each ``[start, end)`` cut into equal parts of at most
    ``unit_size`` bytes; returns the parts' starts, ends and the index of the range each is of."""
    nbytes = end - start
    count = np.maximum(1, -(-nbytes // unit_size))
    of = np.repeat(np.arange(len(start)), count)
    k = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    s, n, c = start[of], nbytes[of], count[of]
    return s + n * k // c, s + n * (k + 1) // c, of


def _component(needs: Sequence[Any], rank: int) -> list[int]:
    """The ranks connected to ``rank`` through files they need (ascending): whoever needs a
    file that a rank of the component needs is in it."""
    files = [_files(item) for item in needs]
    readers: dict[str, list[int]] = {}
    for r, fs in enumerate(files):
        for f in fs:
            readers.setdefault(f, []).append(r)
    seen = {rank}
    todo = [rank]
    done: set[str] = set()
    while todo:
        for f in files[todo.pop()]:
            if f in done:
                continue
            done.add(f)
            for q in readers[f]:
                if q not in seen:
                    seen.add(q)
                    todo.append(q)
    return sorted(seen)


def _files(item: Any) -> set[str]:
    """The files one rank's needs (packed or tuples) have bytes of."""
    if isinstance(item, Mapping):
        return {name for name, raw in item.items() if raw}
    return {name for name, start, end in item if end > start}


def _ranges(needs: Sequence[Any], ranks: Iterable[int]) -> tuple[list[str], Any, Any, Any, Any]:
    """The ranges of ``ranks``' needs as int64 arrays: the files' names (sorted), then per
    range its start, end, rank and file (an index into the names). A rank's needs are
    ``(file, start, end)`` tuples, or the packed form :func:`_pack` makes (``{file: int64
    start, end, ...}``), whose bytes are joined and read as they are."""
    raw: list[bytes] = []
    owner: list[int] = []
    where: list[str] = []
    for r in ranks:
        item = needs[r]
        if not isinstance(item, Mapping):
            item = _pack(item)
        for name, b in item.items():
            raw.append(b)
            owner.append(r)
            where.append(name)
    names = sorted(set(where))
    fid = {name: i for i, name in enumerate(names)}
    counts = [len(b) // 16 for b in raw]
    flat = np.frombuffer(b"".join(raw), dtype="<i8").astype(np.int64, copy=False)
    ranks_ = np.repeat(np.asarray(owner, dtype=np.int64), counts)
    files = np.repeat(np.asarray([fid[n] for n in where], dtype=np.int64), counts)
    return names, flat[0::2], flat[1::2], ranks_, files


def _sorted_unique(a: Any) -> Any:
    """``np.unique`` by sorting (its hash-based path is slower on large int64 arrays)."""
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


def balance_units(units: Sequence[Transfer], load: Sequence[int]) -> list[Transfer]:
    """The units with owners chosen again, unit by unit in order, each to the consumer with
    the fewest bytes so far (``load``: the bytes each rank reads for itself alone and for
    units outside ``units``), so that every rank starts with a queue of about the same size."""
    base = list(load)
    for u in units:
        base[u.owner] -= u.nbytes
    sets: list[tuple[int, ...]] = []
    index: dict[
        int, int
    ] = {}  # by the tuple's id: the tuple is kept in ``sets``, so its id stays unique
    set_of = []
    for u in units:
        k = index.get(id(u.consumers))
        if k is None:
            k = index[id(u.consumers)] = len(sets)
            sets.append(u.consumers)
        set_of.append(k)
    owners = _greedy([u.nbytes for u in units], set_of, sets, base, largest_first=False)
    return [dataclasses.replace(u, owner=o) if o != u.owner else u for u, o in zip(units, owners)]


def split_units(transfers: Sequence[Transfer], unit_size: int) -> list[Transfer]:
    """The transfers cut into work units of at most ``unit_size`` bytes (equal parts of each
    transfer), numbered in order; each keeps its transfer's consumers and planned owner."""
    out: list[Transfer] = []
    for t in transfers:
        n = max(1, -(-t.nbytes // unit_size))
        for k in range(n):
            lo = t.start + t.nbytes * k // n
            hi = t.start + t.nbytes * (k + 1) // n
            out.append(Transfer(len(out), t.name, lo, hi, t.owner, t.consumers))
    return out


def _check_transfers(
    transfers: Sequence[Transfer], needs: Sequence[Sequence[tuple[str, int, int]]]
) -> None:
    """A (custom) plan keeps the rules the reads rely on; raise AsyncLoadError otherwise."""
    for i, t in enumerate(transfers):
        if t.index != i:
            raise AsyncLoadError(
                f"plan_transfers returned transfer {t} at position {i}: index must be its position"
            )
        k = bisect.bisect_left(t.consumers, t.owner)
        owner_ok = (k < len(t.consumers) and t.consumers[k] == t.owner) or t.owner in t.consumers
        if not owner_ok or len(t.consumers) < 2:
            raise AsyncLoadError(
                f"plan_transfers returned {t}: the owner must be one of two or more consumers"
            )
        if i and (transfers[i - 1].name, transfers[i - 1].end) > (t.name, t.start):
            raise AsyncLoadError(
                f"plan_transfers returned {t} out of order or overlapping the one before"
            )


@dataclass
class _Part:
    """A slice ``[start, end)`` of one of this rank's chunks and where its bytes come from."""

    start: int
    end: int
    #: ``read`` (this rank reads it for itself), ``own`` (reads it and sends it to the
    #: other consumers) or ``recv`` (receives it from the transfer's owner).
    kind: str
    transfer: Transfer | None = None


def _advertise(chunks: Sequence[Chunk]) -> list[tuple[int, int] | None]:
    """The part of each chunk (sorted by file and offset) not already covered by an
    earlier chunk of this rank: what this rank announces it needs. Overlaps (two reads of
    the same bytes on one rank, rare) are read locally again rather than shared."""
    out: list[tuple[int, int] | None] = []
    covered: dict[str, int] = {}
    for c in chunks:
        lo = max(c.start, covered.get(c.name, c.start))
        out.append((lo, c.end) if lo < c.end else None)
        covered[c.name] = max(covered.get(c.name, 0), c.end)
    return out


def _needs(
    chunks: Sequence[Chunk], adv: Sequence[tuple[int, int] | None]
) -> list[tuple[str, int, int]]:
    """What this rank announces it needs: of each chunk's advertised part (:func:`_advertise`),
    only the bytes its pieces cover (and the headers between them: :data:`HEADER_GAP`). Gaps a
    request reads through
    (the cost model's choice, bounded by ``max_over_read_ratio``) are not needs: a range is
    shared only among the ranks whose pieces need it, so a rank never receives, nor claims,
    bytes of keys it did not ask for (and reads no gap another rank needs:
    :func:`_skip_gaps`)."""
    return [(c.name, s, e) for c, a in zip(chunks, adv) if a is not None for s, e in _runs(c, *a)]


#: Gaps between a chunk's pieces up to this size are needs too: the headers between two
#: records' data (a torch.save record's zip directory and the next one's local headers: about
#: 1.5 KiB), which every rank reading both records reads through, are then shared as well.
HEADER_GAP = 8 << 10


def _runs(c: Chunk, lo: int, hi: int) -> list[tuple[int, int]]:
    """The bytes of ``[lo, hi)`` that chunk ``c``'s pieces cover, as runs of pieces at most
    :data:`HEADER_GAP` apart."""
    out: list[list[int]] = []
    for seg in sorted(c.segments, key=lambda p: p.start):
        s, e = max(seg.start, lo), min(seg.end, hi)
        if s >= e:
            continue
        if out and s <= out[-1][1] + HEADER_GAP:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _has_gap(c: Chunk, lo: int, hi: int) -> bool:
    """Whether chunk ``c`` reads bytes of ``[lo, hi)`` that none of its needs cover."""
    runs = _runs(c, lo, hi)
    return len(runs) > 1 or (bool(runs) and (runs[0][0] > lo or runs[-1][1] < hi))


def _others(needs: Sequence[Any], rank: int, files: set[str]) -> dict[str, tuple[Any, Any]]:
    """Per file of ``files``: the byte ranges other ranks need (packed or tuples), merged, as
    sorted arrays of starts and ends."""
    flat: dict[str, list[Any]] = {}
    for r, item in enumerate(needs):
        if r == rank:
            continue
        packed = item if isinstance(item, Mapping) else _pack(item)
        for name, raw in packed.items():
            if name in files and raw:
                flat.setdefault(name, []).append(np.frombuffer(raw, dtype="<i8"))
    out: dict[str, tuple[Any, Any]] = {}
    for name, parts in flat.items():
        a = np.concatenate(parts).astype(np.int64).reshape(-1, 2)
        a = a[np.argsort(a[:, 0], kind="stable")]
        ends = np.maximum.accumulate(a[:, 1])
        new = np.concatenate([[True], a[1:, 0] > ends[:-1]])
        idx = np.flatnonzero(new)
        out[name] = (a[idx, 0], np.maximum.reduceat(ends, idx))
    return out


def _needed_by_others(others: dict[str, tuple[Any, Any]], name: str, lo: int, hi: int) -> bool:
    """Whether another rank needs a byte of ``[lo, hi)`` of ``name`` (merged ranges: sorted
    and disjoint, so the last one starting before ``hi`` is the only candidate)."""
    got = others.get(name)
    if got is None:
        return False
    starts, ends = got
    i = int(np.searchsorted(starts, hi))
    return i > 0 and int(ends[i - 1]) > lo


def _skip_gaps(
    c: Chunk, lo: int, hi: int, parts: list[_Part], others: dict[str, tuple[Any, Any]]
) -> list[_Part]:
    """``parts`` with the gaps (bytes no piece of this rank needs) that another rank needs
    left out of this rank's reads: a byte another rank reads (or shares) is not read here too,
    so that storage serves every needed byte once."""
    runs = _runs(c, lo, hi)
    out: list[_Part] = []
    for p in parts:
        if p.kind != "read":
            out.append(p)
            continue
        inside = [(max(s, p.start), min(e, p.end)) for s, e in runs if s < p.end and e > p.start]
        keep: list[tuple[int, int]] = []
        pos = cut = p.start
        for s, e in [*inside, (p.end, p.end)]:
            # a gap [cut, s) between runs that another rank needs: not read here
            if s > cut and _needed_by_others(others, c.name, cut, s):
                if cut > pos:
                    keep.append((pos, cut))
                pos = s
            cut = max(cut, e)
        if p.end > pos:
            keep.append((pos, p.end))
        out.extend(_Part(a, b, "read") for a, b in keep)
    return out


def _parts_for(
    chunks: Sequence[Chunk],
    adv: Sequence[tuple[int, int] | None],
    transfers: Sequence[Transfer],
    rank: int,
    needs: Sequence[Any] | None = None,
) -> list[list[_Part] | None]:
    """Split each chunk into parts by source; None for a chunk this rank reads whole.
    ``needs``: every rank's (as all-gathered): gaps a chunk would read through that another
    rank needs are left out of this rank's reads (:func:`_skip_gaps`)."""
    out = _split_parts(chunks, adv, transfers, rank)
    # only chunks that read through a gap are looked at (none in most loads: no extra sweep)
    gappy = [
        (i, a) for i, (c, a) in enumerate(zip(chunks, adv)) if a is not None and _has_gap(c, *a)
    ]
    if needs is None or not gappy:
        return out
    others = _others(needs, rank, {chunks[i].name for i, _ in gappy})
    for i, (lo, hi) in gappy:
        c = chunks[i]
        parts = out[i] or [_Part(c.start, c.end, "read")]
        skipped = _skip_gaps(c, lo, hi, parts, others)
        if [(p.start, p.end, p.kind) for p in skipped] != [
            (p.start, p.end, p.kind) for p in parts
        ]:
            out[i] = skipped
    return out


def _split_parts(
    chunks: Sequence[Chunk],
    adv: Sequence[tuple[int, int] | None],
    transfers: Sequence[Transfer],
    rank: int,
) -> list[list[_Part] | None]:
    """Split each chunk into parts by source; None for a chunk this rank reads whole."""
    mine: dict[str, list[Transfer]] = {}
    for t in transfers:
        if rank in t.consumers:
            mine.setdefault(t.name, []).append(t)
    starts = {name: [t.start for t in ts] for name, ts in mine.items()}
    out: list[list[_Part] | None] = []
    for c, a in zip(chunks, adv):
        ts = mine.get(c.name)
        if a is None or not ts:
            out.append(None)
            continue
        lo, hi = a
        i = bisect.bisect_left(starts[c.name], lo)
        parts: list[_Part] = []
        pos = c.start
        while i < len(ts) and ts[i].start < hi:
            t = ts[i]
            if (
                t.start < lo or t.end > hi
            ):  # pragma: no cover - plan_transfers never crosses a boundary
                raise AsyncLoadError(
                    f"internal error: transfer {t} crosses a read of rank {rank} [{lo}, {hi})"
                )
            if t.start > pos:
                parts.append(_Part(pos, t.start, "read"))
            parts.append(_Part(t.start, t.end, "own" if t.owner == rank else "recv", t))
            pos = t.end
            i += 1
        if not parts:
            out.append(None)
            continue
        if pos < c.end:
            parts.append(_Part(pos, c.end, "read"))
        out.append(parts)
    return out


def _pack(needs: Sequence[tuple[str, int, int]]) -> dict[str, bytes]:
    """This rank's needed ranges, compact for the all-gather: per file, the flat
    ``start, end, start, end ...`` offsets as little-endian int64 bytes."""
    flat: dict[str, array.array[int]] = {}
    for name, start, end in needs:
        a = flat.get(name)
        if a is None:
            a = flat[name] = array.array("q")
        a.append(start)
        a.append(end)
    return {name: a.tobytes() for name, a in flat.items()}


def _unpack(packed: dict[str, bytes]) -> list[tuple[str, int, int]]:
    """The ranges :func:`_pack` packed, as ``(file, start, end)`` tuples, by file."""
    out: list[tuple[str, int, int]] = []
    for name in sorted(packed):
        a = array.array("q")
        a.frombytes(packed[name])
        out.extend((name, a[i], a[i + 1]) for i in range(0, len(a), 2))
    return out
