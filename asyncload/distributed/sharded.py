"""Sharing bytes across ranks: :class:`ShardedLoadPlanner`, which reads each byte range
once and shares it over the process group (the multi-rank driver is :mod:`asyncload.engine.driver`,
its bounded waits :mod:`asyncload.distributed.monitor`).

How a multi-rank load runs (``asyncload.load`` with ``torch.distributed`` initialised)::

    every rank                      coordinator (group rank 0)
    read .metadata, local plan  --> gather plans --> create_global_plan
    <-- scatter plans -------------------------------'
    read_data(final plan)
       PipelinedLoadPlanner: each rank reads the byte ranges its own shards need
       ShardedLoadPlanner:   per phase (record headers, then tensor data):
           all_gather(needed byte ranges)  -> the same plan_transfers() on every rank:
           a range two or more ranks need is read by one of them (bytes balanced)
           and sent to the others point to point, chunk by chunk, as reads land
    barrier "done"

Every wait on another rank goes through a :class:`Monitor`: a few keys in the
process group's store hold each rank's status ("reading data: 12 of 40 chunks"), its
failure if it had one, and barrier arrivals. A rank that raises posts its error there
at once and every other rank raises :class:`DistributedLoadError` naming it; a rank
that makes no progress for ``collective_timeout`` seconds is declared stalled by the
first rank waiting on it, and every rank raises an error naming it and its last
status. Collectives themselves (gather/scatter of plans, all_gather of needs) are only
entered once a monitored barrier has seen every rank arrive, so they cannot hang on a
rank that has already failed.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import dataclasses
import hashlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from asyncload._dcp import PipelinedLoadPlanner
from asyncload._errors import AsyncLoadError, DistributedLoadError, first_error
from asyncload._options import LoadOptions
from asyncload._stats import _fmt_bytes
from asyncload.distributed.monitor import Monitor
from asyncload.engine.assembly import assemble, copy_bytes, track
from asyncload.engine.chunks import Chunk
from asyncload.engine.pipeline import Pipeline, _DirectRun, direct_run
from asyncload.engine.session import LoadSession

__all__ = [
    "BackgroundSends",
    "ShardedLoadPlanner",
    "Transfer",
    "balance_units",
    "checkpoint_identity",
    "file_identities",
    "plan_transfers",
    "split_units",
    "wait_for_background_sends",
]

log = logging.getLogger("asyncload.sharded")

_UNSET: Any = object()
_T = TypeVar("_T")

#: Point-to-point tags: ``(load sequence % _TAG_LOADS) * _TAG_SPAN + transfer index``.
_TAG_SPAN = 2_000_000
_TAG_LOADS = 1000


class ShardedLoadPlanner(PipelinedLoadPlanner):
    """A :class:`PipelinedLoadPlanner` for multi-rank loads that reads every byte once.

    Before each read phase the ranks all-gather the byte ranges they need; every range
    that two or more ranks need is then read from storage by exactly one of them (the
    first to get to it, by default; see ``adaptive``) and sent to the others over the
    process group as reads land, within ``memory_budget``. With 4 ranks loading a replicated
    model, the ranks together read the checkpoint about once instead of 4 times.

    ``process_group``: the group the load runs on (default: the world). ``asyncload.load``
    fills it in from its own ``process_group`` argument; with ``dcp.load`` on a subgroup,
    pass the same group here. ``collective_timeout``: seconds a rank may go without
    progress before the others give up on it (overrides ``LoadOptions.collective_timeout``).
    ``ordered``: issue the transfers between two ranks in one agreed order on both sides
    (needed by backends that match sends to receives by order, not by tag: ``None`` turns it
    on for NCCL only).

    ``adaptive`` (default ``None``: on, except with ``ordered`` or NCCL, which need the
    fixed order, and for a subclass that overrides :meth:`plan_transfers`, whose owners are
    kept): hand out the shared ranges as ranks get to them instead of fixing their
    owners before reading. Shared ranges are cut into work units of at most ``unit_size``
    bytes (default ``min(256 KiB, chunk_size)``); the first rank that needs a unit and has a
    free reader claims it through an atomic compare-and-set in the group's store, reads
    it and sends it to the other ranks that need it. Each rank starts with the units
    ``plan_transfers`` gave it and then takes over, from the back, units that other ranks
    have not started; a rank whose transfer is late (past the hedge delay of
    :class:`LoadOptions`, ``hedge=True``) reads it from storage itself and the first copy
    wins. ``adaptive=False``: the static plan (owners fixed before reading).

    ``wait_for_peers`` (default ``False``; adaptive sharing only): whether a rank waits at
    the end of the load until every rank has finished. By default a rank returns as soon
    as its own destinations are complete and every failure known by then has been raised,
    so that a slow consumer (a busy GPU, a slow host) falls behind alone. Bytes it still
    owes slower peers are sent from private copies (never from the destinations, which the
    caller may overwrite at once), at most ``memory_budget`` of them per process; once they
    fill it, a peer far behind reads new units from storage itself and the others get them
    from the destination (waited for before the load returns). The copies
    drain in the background (:attr:`background_sends`, :func:`wait_for_background_sends`),
    bounded by ``collective_timeout``: a receiver that stops making progress is declared
    stalled, as during the load. The trade-off: a failure on a peer after this rank returned
    is raised on that peer (naming it) and only logged here, and this rank's destinations
    are complete and correct either way. ``wait_for_peers=True`` keeps the behaviour where
    every rank waits for all, sends come straight from destination memory, and any
    failure is raised on every rank. The static plan (``adaptive=False``, NCCL) always waits.
    Other keyword arguments are those of :class:`PipelinedLoadPlanner`.
    """

    def __init__(
        self,
        *,
        process_group: Any = None,
        collective_timeout: float | None = _UNSET,
        ordered: bool | None = None,
        adaptive: bool | None = None,
        unit_size: int | None = None,
        wait_for_peers: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(wait_for_peers, bool):
            raise ValueError(f"ShardedLoadPlanner(wait_for_peers={wait_for_peers!r}) is invalid: expected a bool")
        if adaptive is not None and not isinstance(adaptive, bool):
            raise ValueError(f"ShardedLoadPlanner(adaptive={adaptive!r}) is invalid: expected a bool or None")
        if unit_size is not None and (isinstance(unit_size, bool) or not isinstance(unit_size, int) or unit_size <= 0):
            raise ValueError(f"ShardedLoadPlanner(unit_size={unit_size!r}) is invalid: expected a positive int (bytes)")
        self.ordered = ordered
        self.adaptive = adaptive
        self.unit_size = unit_size
        self.wait_for_peers = wait_for_peers
        #: The last load's sends that may outlive it (``wait_for_peers=False``), or None.
        self.background_sends: BackgroundSends | None = None
        if collective_timeout is not _UNSET:
            # validated like the LoadOptions field
            dataclasses.replace(self.options, collective_timeout=collective_timeout)
        self.process_group = process_group
        self._collective_timeout = collective_timeout

    @staticmethod
    def wait_for_background_sends(timeout: float | None = None) -> bool:
        """Wait until every load of this process that returned before its peers has
        delivered what it owed them (or given up on a stalled or failed receiver): see
        :func:`wait_for_background_sends`. Call it before ``dist.destroy_process_group()``."""
        return wait_for_background_sends(timeout)

    def collective_timeout_for(self, options: LoadOptions) -> float | None:
        """This planner's ``collective_timeout`` if it was given one, else the options'."""
        return options.collective_timeout if self._collective_timeout is _UNSET else self._collective_timeout

    def plan_transfers(self, needs: Sequence[Sequence[tuple[str, int, int]]]) -> tuple[list[Transfer], list[int]]:
        """Who reads which shared bytes: an extension point. Called on every rank, between
        the all-gather of ``needs`` and the reads, once per read phase; every rank must
        return the same answer for the same ``needs``.

        ``needs[r]``: the byte ranges ``(file, start, end)`` group rank ``r`` needs. Return
        the transfers (see :func:`plan_transfers`, which this default calls) and the bytes
        each rank reads. An override may choose other owners (``dataclasses.replace(t,
        owner=...)`` with ``owner in t.consumers``: ranks on a faster link, or fewer
        readers) but must keep the transfers' ranges, consumers and order; that is checked.
        """
        return plan_transfers(needs)

    def _custom_plan(self) -> bool:
        """A subclass chose its own owners (``plan_transfers`` overridden): keep them, unless
        it asked for ``adaptive=True`` (then they are only where each rank starts)."""
        return type(self).plan_transfers is not ShardedLoadPlanner.plan_transfers

    def share_session(self, session: LoadSession, options: LoadOptions) -> _ShareSession | None:
        """The reading hook: a share session that takes over this rank's reads of the load
        ``session``, or None when there is nobody to share with (no process group, or a
        group of one). asyncload's driver puts its process group and monitor on ``session``."""
        group = self.process_group if self.process_group is not None else session.group
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size(group) <= 1:
            return None
        monitor = session.monitor
        if monitor is None or monitor.group is not group:
            monitor = Monitor(group, self.collective_timeout_for(options))
        share = _ShareSession(
            group,
            monitor,
            options,
            ordered=self.ordered,
            plan=self.plan_transfers,
            adaptive=self.adaptive if self.adaptive is not None or not self._custom_plan() else False,
            unit_size=self.unit_size,
            load_session=session,
            wait_for_peers=self.wait_for_peers,
        )
        self.background_sends = share.sends
        return share


# --- the plan: who reads which bytes -------------------------------------------------------


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


def plan_transfers(needs: Sequence[Sequence[tuple[str, int, int]]]) -> tuple[list[Transfer], list[int]]:
    """Which rank reads which shared bytes. Pure and deterministic: every rank computes
    the same answer from the same all-gathered ``needs``.

    ``needs[r]`` lists the half-open byte ranges ``(file, start, end)`` rank ``r`` needs
    (or holds them packed, as the all-gather carries them: ``{file: bytes}`` of little-endian
    int64 ``start, end, start, end ...``); one rank's ranges do not overlap (they may touch). Returns the transfers, in global
    order (by file, then offset), and the bytes each rank will read from storage.

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
            zip(shared.file.tolist(), shared.start.tolist(), shared.end.tolist(), owners, set_of.tolist())
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
    weights = np.random.default_rng(0x5EED).integers(1, 1 << 62, size=int(size.max(initial=0)), dtype=np.int64)
    for n in np.unique(size).tolist():
        which = np.flatnonzero(size == n)
        rows = shared.who[shared.ptr[which][:, None] + np.arange(n)]
        with np.errstate(over="ignore"):
            digest = (rows * weights[:n]).sum(axis=1)  # wraps around: a hash
        _, first, inverse = np.unique(digest, return_index=True, return_inverse=True)
        distinct = rows[first]
        if not np.array_equal(distinct[inverse], rows):  # a collision (never seen): sort the rows themselves
            distinct, inverse = np.unique(rows, axis=0, return_inverse=True)
        set_of[which] = len(sets) + inverse.reshape(-1)
        sets.extend(tuple(r) for r in distinct.tolist())
    return sets, set_of


def _greedy(
    nbytes: Any, set_of: Any, sets: Sequence[tuple[int, ...]], load: list[int], *, largest_first: bool
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
    index: dict[int, int] = {}  # by the tuple's id: the tuple is kept in ``sets``, so its id stays unique
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


def _check_transfers(transfers: Sequence[Transfer], needs: Sequence[Sequence[tuple[str, int, int]]]) -> None:
    """A (custom) plan keeps the rules the reads rely on; raise AsyncLoadError otherwise."""
    for i, t in enumerate(transfers):
        if t.index != i:
            raise AsyncLoadError(f"plan_transfers returned transfer {t} at position {i}: index must be its position")
        k = bisect.bisect_left(t.consumers, t.owner)
        owner_ok = (k < len(t.consumers) and t.consumers[k] == t.owner) or t.owner in t.consumers
        if not owner_ok or len(t.consumers) < 2:
            raise AsyncLoadError(f"plan_transfers returned {t}: the owner must be one of two or more consumers")
        if i and (transfers[i - 1].name, transfers[i - 1].end) > (t.name, t.start):
            raise AsyncLoadError(f"plan_transfers returned {t} out of order or overlapping the one before")


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


def _parts_for(
    chunks: Sequence[Chunk], adv: Sequence[tuple[int, int] | None], transfers: Sequence[Transfer], rank: int
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
            if t.start < lo or t.end > hi:  # pragma: no cover - plan_transfers never crosses a boundary
                raise AsyncLoadError(f"internal error: transfer {t} crosses a read of rank {rank} [{lo}, {hi})")
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


# --- moving bytes between ranks ----------------------------------------------------------------


def _transport_kind(group: Any) -> tuple[str, torch.device]:
    """``("thread", cpu)`` for gloo and other CPU backends (waits run in a thread: gloo's
    point-to-point works only complete inside ``wait()``), ``("poll", cuda)`` for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return "thread", torch.device("cpu")
    return "poll", torch.device("cuda", torch.cuda.current_device())


#: Buffers of point-to-point operations abandoned after a failure (NCCL): kept alive until
#: the operation completes, so that a late transfer never writes into freed memory.
_orphans: list[tuple[list[Any], Any]] = []


class _Transport:
    """Point-to-point sends and receives of byte ranges over the process group.

    With NCCL the bytes travel through a CUDA buffer on the caller's current device; with
    ``ordered`` (always for NCCL) the operations between two ranks are issued in transfer
    order on both sides, so that NCCL's in-order matching pairs them correctly.
    """

    def __init__(self, group: Any, *, ordered: bool | None = None) -> None:
        self.group = group
        self.kind, self.device = _transport_kind(group)
        self.ordered = self.kind == "poll" if ordered is None else ordered
        self._turns: dict[int, list[int]] = {}
        self._next: dict[int, int] = {}
        self._cond: asyncio.Condition | None = None

    def set_order(self, transfers: Sequence[Transfer], rank: int) -> None:
        """The transfers this rank takes part in, per peer, in the order both sides issue them."""
        self._turns = {}
        self._next = {}
        for t in transfers:
            if rank not in t.consumers:
                continue
            peers = [c for c in t.consumers if c != rank] if t.owner == rank else [t.owner]
            for p in peers:
                self._turns.setdefault(p, []).append(t.index)
        for p in self._turns:
            self._next[p] = 0

    async def _my_turn(self, peer: int, index: int) -> None:
        if not self.ordered:
            return
        if self._cond is None:
            self._cond = asyncio.Condition()
        turns = self._turns[peer]
        async with self._cond:
            await self._cond.wait_for(lambda: turns[self._next[peer]] == index)

    async def _done_turn(self, peer: int) -> None:
        if not self.ordered:
            return
        assert self._cond is not None
        async with self._cond:
            self._next[peer] += 1
            self._cond.notify_all()

    def _tensor(self, view: memoryview) -> torch.Tensor:
        return torch.frombuffer(view, dtype=torch.uint8)

    async def exchange(
        self,
        op: str,
        peers: Sequence[int],
        tag: int,
        index: int,
        view: memoryview,
        keep: Any,
        monitor: Monitor,
        doing: str,
    ) -> None:
        """Send ``view`` to every rank in ``peers`` (``op="send"``) or receive it from the one
        peer (``op="recv"``), then wait, watching the peers for a stall."""
        loop = asyncio.get_running_loop()
        works: list[Any] = []
        buffers: list[Any] = []
        dev: torch.Tensor | None = None
        current: int | None = None
        try:
            for peer in peers:
                await self._my_turn(peer, index)
                current = peer
                try:
                    if dev is None:
                        cpu = torch.frombuffer(view, dtype=torch.uint8)
                        if self.kind == "poll":
                            dev = (
                                cpu.to(self.device)
                                if op == "send"
                                else torch.empty(len(view), dtype=torch.uint8, device=self.device)
                            )
                        else:
                            dev = cpu
                        buffers.append(dev)
                    with torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext():
                        if op == "send":
                            works.append(dist.isend(dev, group=self.group, group_dst=peer, tag=tag))
                        else:
                            works.append(dist.irecv(dev, group=self.group, group_src=peer, tag=tag))
                finally:
                    await self._done_turn(peer)
            current = None
            fut: asyncio.Future[None] = loop.create_future()
            if self.kind == "thread":
                _wait_in_thread(works, (buffers, keep), loop, fut)
            else:
                poller = loop.create_task(_poll_works(works, fut))
                _pollers.add(poller)  # a reference until it ends (the loop keeps only a weak one)
                poller.add_done_callback(_pollers.discard)
            await monitor.wait_on(fut, peers, doing)
            if self.kind == "poll" and op == "recv" and dev is not None:
                copy_bytes(view, dev.cpu().numpy().data)
            works = []
        except BaseException as exc:
            if works and self.kind == "poll":
                _orphans.append((buffers, keep))
            cause: BaseException = exc
            if isinstance(exc, _WorkFailed):
                current, cause = peers[exc.index], exc.cause
            elif current is None and len(peers) == 1:
                current = peers[0]
            if isinstance(cause, RuntimeError) and not isinstance(cause, AsyncLoadError):  # gloo/NCCL: peer gone
                who = f"rank {current}" if current is not None else f"rank(s) {list(peers)}"
                raise DistributedLoadError(
                    f"rank {monitor.rank} lost its connection to {who} while {doing}: {cause}",
                    rank=current,
                    doing=doing,
                ) from cause
            if cause is not exc:
                raise cause from None
            raise


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _WorkFailed(Exception):
    """Work number ``index`` of an exchange raised ``cause``."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(index, cause)
        self.index = index
        self.cause = cause


def _wait_in_thread(works: list[Any], keep: Any, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Wait for gloo works on a daemon thread (it holds ``keep``, the buffers, until they finish)."""

    def settle(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def run() -> None:
        err: BaseException | None = None
        for i, w in enumerate(works):
            try:
                w.wait()
            except BaseException as exc:
                err = _WorkFailed(i, exc)
                break
        try:
            loop.call_soon_threadsafe(settle, err)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass
        _ = keep

    threading.Thread(target=run, name="asyncload-share-wait", daemon=True).start()


_pollers: set[asyncio.Task[None]] = set()


async def _poll_works(works: list[Any], fut: asyncio.Future[None]) -> None:
    """Wait for NCCL works by polling (their ``is_completed`` is non-blocking and exact)."""
    delay = 0.0002
    for i, w in enumerate(works):
        try:
            while not w.is_completed():
                if fut.done():
                    return
                await asyncio.sleep(delay)
                delay = min(0.005, delay * 2)
            w.wait()
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(_WorkFailed(i, exc))
            return
    if not fut.done():
        fut.set_result(None)


#: Loads whose sends outlive them (returned early) and still drain: waited for at exit.
_live_sends: set[BackgroundSends] = set()
_live_lock = threading.Lock()
_exit_hook: list[bool] = []
#: Seconds between the drain's checks of stalled peers (the monitor's heartbeat interval).
_BEAT = 1.0
#: Seconds interpreter exit waits at most for background sends (also when collective_timeout is None).
_EXIT_WAIT = 300.0
#: Bytes held in send copies by every load of this process together (at most one memory_budget).
_copy_lock = threading.Lock()
_copy_held = [0]


#: How often a late unit whose hedge found every slot taken looks again, seconds.
_HEDGE_SLOT_POLL = 0.05


class BackgroundSends:
    """The sends of one load on this rank under ``ShardedLoadPlanner(wait_for_peers=False)``:
    every unit this rank sends goes out from a private copy of its bytes (never from the
    destination, which the caller may overwrite as soon as the load returns), so the load
    can return while slower peers still have to post their receives.

    The copies are bounded: at most one ``memory_budget`` per process; once they fill it, a
    peer far behind (:meth:`behind`) is left out of new units (it reads them from storage
    itself, counted in its ``bytes_hedged``). After the load returned, a daemon
    thread keeps this rank's status alive while sends are pending (so peers do not declare
    it stalled), declares a receiver that makes no progress for ``collective_timeout``
    stalled (posting the failure that rank and the others still loading raise), logs a
    failure a peer posts after this rank returned, and ends once every rank has finished
    the load. Interpreter exit waits for it, bounded by those same rules.

    Attributes (bytes count once per peer): ``bytes_posted`` (every send of the load),
    ``bytes_at_return`` (still on their way when the load returned), ``bytes_sent_after_return``
    (of those, delivered since), ``error`` (a send that failed, or the failure that stopped
    the drain), ``returned``.
    """

    def __init__(self, monitor: Monitor, budget: int) -> None:
        self.monitor = monitor
        self.rank = monitor.rank
        self.budget = budget
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        #: Per peer: copies waiting for it (FIFO, one waiter thread per peer at most).
        self._queues: dict[int, list[tuple[Any, int, list[Any]]]] = {}
        self._waiters: set[int] = set()
        self._to: dict[int, int] = {}
        self._held = 0
        self.bytes_posted = 0
        self.bytes_at_return = 0
        self.bytes_sent_after_return = 0
        self.returned = False
        self.abandoned = False
        self.error: BaseException | None = None
        self._drained = threading.Event()

    # --- during the load (the event loop's thread) ------------------------------------------

    def behind(self, peers: Sequence[int], nbytes: int) -> list[int]:
        """The peers far behind, once the copies fill the budget (no room for ``nbytes``
        more; before that, nobody): those whose pending copies pass half of it and more than
        twice what any other peer of this rank holds (one clear straggler; peers late alike
        are never left out, and with a single peer there is nobody to fall behind)."""
        with _copy_lock:
            if _copy_held[0] + nbytes <= self.budget:
                return []
        with self._lock:
            if len(self._to) < 2:
                return []
            top = sorted(self._to.values(), reverse=True)
            held = [self._to.get(p, 0) for p in peers]
        half = self.budget // 2
        return [p for p, h in zip(peers, held) if h + nbytes > half and h == top[0] and h > 2 * top[1] + nbytes]

    def reserve(self, nbytes: int) -> bool:
        """Room for a copy of ``nbytes`` within the budget (every load of the process together)."""
        with self._lock:
            if self.abandoned:  # the load failed: its copies no longer count, so none is made
                return False
            with _copy_lock:
                if _copy_held[0] + nbytes > self.budget:
                    return False
                _copy_held[0] += nbytes
            self._held += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            if self.abandoned:
                return
            self._held -= nbytes
        with _copy_lock:
            _copy_held[0] -= nbytes

    def post(self, group: Any, peers: Sequence[int], tag: int, copy: bytearray) -> None:
        """Send ``copy`` (room reserved) to ``peers``; a waiter thread per peer sees it land."""
        n = len(copy)
        tensor = torch.frombuffer(copy, dtype=torch.uint8)
        # the copy is freed (and its room given back) when its last peer has it
        left = [len(peers), copy]
        works: list[tuple[int, Any]] = []
        for p in peers:
            try:
                works.append((p, dist.isend(tensor, group=group, group_dst=p, tag=tag)))
            except RuntimeError as exc:  # gloo: the peer's connection closed (it died)
                # not this rank's failure: that peer reads the unit itself or fails on its own,
                # and the monitor tells the others; the send is simply not made
                log.warning("rank %d: no send to rank %d, its connection is gone: %s", self.rank, p, exc)
        left[0] = len(works)
        if not works:
            self.unreserve(n)
            return
        with self._lock:
            for p, w in works:
                self._queues.setdefault(p, []).append((w, n, left))
                self._to[p] = self._to.get(p, 0) + n
                self.bytes_posted += n
                if p not in self._waiters:
                    self._waiters.add(p)
                    threading.Thread(
                        target=self._wait_peer, args=(p,), name="asyncload-share-send", daemon=True
                    ).start()

    def _wait_peer(self, peer: int) -> None:
        while True:
            with self._lock:
                q = self._queues.get(peer)
                if not q:
                    self._waiters.discard(peer)
                    self._cond.notify_all()
                    return
                work, n, left = q[0]
            err: BaseException | None = None
            try:
                work.wait()
            except BaseException as exc:
                err = exc
            with self._lock:
                q.pop(0)
                self._to[peer] -= n
                if self.returned and err is None:
                    self.bytes_sent_after_return += n
                left[0] -= 1
                last = left[0] == 0
                self._cond.notify_all()
            if last:
                left[1] = None  # the copy
                self.unreserve(n)
            if err is not None:
                self._failed(peer, err)

    def _failed(self, peer: int, exc: BaseException) -> None:
        try:
            gone_after_done = self.monitor.finished(peer)
        except Exception:
            gone_after_done = False
        if gone_after_done:  # it finished its load (it hedged this unit) and left: nothing is lost
            log.debug("rank %d: a send to rank %d, which had finished its load, failed: %s", self.rank, peer, exc)
            return
        err = DistributedLoadError(
            f"rank {self.rank} lost its connection to rank {peer} while sending it shared bytes: {exc}",
            rank=peer,
            doing="receiving shared bytes",
        )
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
            returned = self.returned
        if returned:
            if first:
                log.warning("rank %d, after its load returned: %s", self.rank, err)
            return
        try:  # the load is still running here: every rank still loading raises it
            self.monitor.fail(err, err.doing)
        except Exception:  # pragma: no cover - the store is gone too
            log.debug("could not post a send failure", exc_info=True)

    def abandon(self) -> None:
        """The load failed or the drain gave up: stop counting the pending copies against the
        budget (their sends stay posted; the threads waiting for them keep the memory alive)."""
        with self._lock:
            if self.abandoned:
                return
            self.abandoned = True
            held, self._held = self._held, 0
            self._cond.notify_all()
        with _copy_lock:
            _copy_held[0] -= held

    @property
    def bytes_pending(self) -> int:
        """Bytes (once per peer) posted and not yet delivered."""
        with self._lock:
            return sum(self._to.values())

    def pending_peers(self) -> list[int]:
        with self._lock:
            return sorted(p for p, n in self._to.items() if n > 0)

    # --- after the load returned ------------------------------------------------------------

    def after_return(self) -> None:
        """The load returned (``Monitor.finish``): raise a send failure known by now; else
        drain the rest in the background."""
        with self._lock:
            self.returned = True
            self.bytes_at_return = sum(self._to.values())
            error = self.error
        if error is not None:
            self.abandon()
            raise error
        peers = self.pending_peers()
        what = f"; sending {_fmt_bytes(self.bytes_at_return)} to rank(s) {peers}" if peers else ""
        self.monitor.status(f"finished its load{what}")
        with _live_lock:
            _live_sends.add(self)
            if not _exit_hook:
                _exit_hook.append(True)
                atexit.register(_wait_at_exit)
        threading.Thread(target=self._drain, name="asyncload-share-drain", daemon=True).start()

    def _drain(self) -> None:
        m = self.monitor
        keys = [f"at/done/{r}" for r in range(m.world)]
        delay = 0.005
        checked = 0.0
        try:
            while True:
                peers = self.pending_peers()
                if not peers and (m.all_finished.is_set() or m.store.check(keys)):
                    m.all_finished.set()
                    return
                if m.store.check(["abort"]):
                    err = m.store.get("abort").decode("utf-8", "replace").partition("|")[2].partition("|")[2]
                    log.warning("rank %d, after its load returned: another rank failed: %s", self.rank, err)
                    self._stop(DistributedLoadError(err))
                    return
                if peers:
                    m.beat()  # receivers waiting on this rank see it alive
                now = time.monotonic()
                if now - checked >= _BEAT:
                    checked = now
                    waiting = peers or [r for r, k in enumerate(keys) if not m.store.check([k])]
                    idle = m.idle_peer(waiting)
                    if idle is not None:
                        rank, seconds, status = idle
                        message = (
                            f"rank {rank} made no progress for {seconds:.1f} s (LoadOptions.collective_timeout="
                            f"{m.timeout}); its last status: {status or 'none'}; rank {self.rank} gave up on it "
                            "after its own load had returned"
                        )
                        m.store.compare_set("abort", "", f"{rank}|{status}|{message}")
                        log.warning("rank %d: %s", self.rank, message)
                        self._stop(DistributedLoadError(message, rank=rank, doing=status))
                        return
                time.sleep(delay)
                delay = min(0.05, delay * 2)
        except Exception as exc:  # the store is gone (its host exited): nothing left to coordinate
            log.debug("rank %d: background sends stop watching: %s", self.rank, exc)
            self._stop(exc)
        finally:
            self._drained.set()
            with self._lock:
                self._cond.notify_all()
            with _live_lock:
                _live_sends.discard(self)

    def _stop(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc
        self.abandon()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every send has landed and (once the load returned) the drain ended or
        gave up; True if so, False at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._drained.is_set() if self.returned else self.abandoned or not any(self._to.values()):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(left, 0.1))


def wait_for_background_sends(timeout: float | None = None) -> bool:
    """Wait until the sends of every load of this process that returned before its peers
    (``ShardedLoadPlanner(wait_for_peers=False)``) have landed or were given up on (a
    receiver stalled or failed); True if so, False at ``timeout``. Call it before
    ``dist.destroy_process_group()``: with gloo, destroying the group while a send is still on
    its way aborts the process at exit."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _live_lock:
        live = list(_live_sends)
    for rec in live:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not rec.wait(left):
            return False
    return True


def _wait_at_exit() -> None:
    """Interpreter exit: let background sends land (bounded: the drain declares a receiver
    that stops progressing stalled; at most ``_EXIT_WAIT`` s in all)."""
    with _live_lock:
        live = list(_live_sends)
    if live:
        log.debug("waiting for %d load(s)' background sends before exit", len(live))
        wait_for_background_sends(_EXIT_WAIT)


class _SharedPipeline(Pipeline):
    """The reader pool, where a chunk's bytes may come from storage, from another rank, or
    both; bytes this rank owns are sent on as soon as they are read."""

    def __init__(
        self, base: Pipeline, session: _ShareSession, parts: dict[int, list[_Part]], tag_base: int, total_chunks: int
    ) -> None:
        super().__init__(base.storage, base.options, base.stats, base.executor, budget=base.budget)
        self.on_progress = base.on_progress
        # chunks for CUDA destinations: unshared ones go through the pinned ring as usual;
        # shared ones are assembled from host memory (the stager bounces them into pinned memory)
        self.staging = base.staging
        self.session = session
        self.parts = parts
        self.tag_base = tag_base
        self.total = total_chunks
        self.done = 0

    async def _read_and_assemble(self, chunk: Chunk) -> None:
        members: list[Chunk] | None = getattr(chunk, "members", None)  # the base pipeline's batch of tiny reads
        if members is not None and any(id(c) in self.parts for c in members):
            # shared members one by one; a run's others still as a run (of their own)
            rest = [c for c in members if id(c) not in self.parts] if isinstance(chunk, _DirectRun) else []
            async with asyncio.TaskGroup() as tg:
                for c in members:
                    if id(c) in self.parts or not rest:
                        tg.create_task(self._read_and_assemble(c))
                if rest:
                    tg.create_task(super()._read_and_assemble(direct_run(rest, chunk.nbytes)))
            if rest:
                self.done += len(rest)
                self.session.monitor.progress(f"{self.session.doing}: {self.done} of {self.total} chunks done")
            return
        parts = self.parts.get(id(chunk))
        if parts is None:
            await super()._read_and_assemble(chunk)
        else:
            await self._shared(chunk, parts)
        self.done += len(members) if members is not None else 1
        self.session.monitor.progress(f"{self.session.doing}: {self.done} of {self.total} chunks done")

    async def _read_part(self, chunk: Chunk, part: _Part, view: memoryview) -> None:
        t0 = time.monotonic()
        await self.storage.readinto(chunk.name, part.start, [view])
        self.stats.add(chunks=1, storage_wait_seconds=time.monotonic() - t0)

    async def _part(self, chunk: Chunk, part: _Part, buf: memoryview, state: dict[str, bool]) -> None:
        view = buf[part.start - chunk.start : part.end - chunk.start]
        t = part.transfer
        if part.kind == "read":
            await self._read_part(chunk, part, view)
            return
        assert t is not None
        session = self.session
        tag = self.tag_base + t.index
        where = f"bytes [{t.start}, {t.end}) of {t.name}"
        if part.kind == "own":
            await self._read_part(chunk, part, view)
            peers = [c for c in t.consumers if c != session.rank]
            state["pending"] = True
            await session.transport.exchange(
                "send", peers, tag, t.index, view, chunk, session.monitor, f"sending {where} to rank(s) {peers}"
            )
            self.stats.add(bytes_sent=t.nbytes * len(peers))
        else:
            state["pending"] = True
            await session.transport.exchange(
                "recv",
                [t.owner],
                tag,
                t.index,
                view,
                chunk,
                session.monitor,
                f"waiting for {where} from rank {t.owner}",
            )
            self.stats.add(bytes_received=t.nbytes)

    def _direct(self, chunk: Chunk, parts: list[_Part]) -> bool:
        """Whether the chunk's bytes land straight in its destination: one contiguous CPU
        view, and nothing received (receive into a staging buffer, never into the
        destination: after a failure, a transfer still pending can then only ever land in a
        buffer that was given up on)."""
        return len(chunk.segments) == 1 and chunk.tiles_into() and all(p.kind != "recv" for p in parts)

    async def _run_parts(
        self, chunk: Chunk, parts: list[_Part], buf: memoryview, direct: bool, state: dict[str, Any]
    ) -> None:
        if len(parts) == 1:
            await self._part(chunk, parts[0], buf, state)
        else:
            async with asyncio.TaskGroup() as tg:
                for p in parts:
                    tg.create_task(self._part(chunk, p, buf, state))

    async def _shared(self, chunk: Chunk, parts: list[_Part]) -> None:
        loop = asyncio.get_running_loop()
        direct = self._direct(chunk, parts)
        pooled: bytearray | None = None
        if direct:
            buf = chunk.segments[0].into
            assert buf is not None
        else:
            pooled = self._pool.get(chunk.nbytes)
            buf = memoryview(pooled)[: chunk.nbytes]
        #: pending: a transfer into ``buf`` was started; tainted: one may still land after the chunk is done
        state: dict[str, Any] = {"pending": False, "tainted": False}
        ok = False
        try:
            await self._run_parts(chunk, parts, buf, direct, state)
            t1 = time.monotonic()
            if direct:
                if chunk.trackers:
                    await loop.run_in_executor(self.executor, track, chunk, [buf])
            else:
                await loop.run_in_executor(self.executor, assemble, chunk, buf)
            ok = True
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            # a buffer a transfer may still write into (a hedged unit's late copy, or after a
            # failure) is never reused: the thread waiting for it keeps it alive until it lands
            if pooled is not None and not state["tainted"] and (ok or not state["pending"]):
                self._pool.put(pooled)
        self._count_assembled(chunk, t1)


# --- adaptive sharing: units claimed as ranks get to them ----------------------------------------


#: Default size of a work unit of adaptive sharing (``ShardedLoadPlanner(unit_size=...)``).
_UNIT_SIZE = 256 << 10
#: Seconds of reading a rank may have claimed ahead at its own measured rate: a slow rank
#: holds few units at a time, so little is left on it when the others run out of work.
_CLAIM_HORIZON = 0.1


class _Slots:
    """At most ``n`` holders at once, and (once a rate is known) at most ``rate x
    _CLAIM_HORIZON`` bytes among them (one holder always may); waiters are served lowest
    ``key`` first, not FIFO, so that a rank claims its own planned units before it takes
    over other ranks'. ``rate``: the bytes per second of time with a holder, measured."""

    def __init__(self, n: int) -> None:
        self.n = self.free = n
        self.active_bytes = 0
        self._waiters: list[tuple[Any, int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._done_bytes = 0
        self._busy = 0.0
        self._busy_since = 0.0

    @property
    def rate(self) -> float | None:
        busy = self._busy + (time.monotonic() - self._busy_since if self.active_bytes else 0.0)
        return self._done_bytes / busy if self._done_bytes and busy > 0 else None

    def _fits(self, nbytes: int) -> bool:
        if self.free <= 0:
            return False
        rate = self.rate
        if rate is None:  # nothing measured yet: two at a time
            return self.n - self.free < 2
        return not self.active_bytes or self.active_bytes + nbytes <= rate * _CLAIM_HORIZON

    def _grant(self, nbytes: int) -> None:
        if not self.active_bytes:
            self._busy_since = time.monotonic()
        self.free -= 1
        self.active_bytes += nbytes

    async def acquire(self, key: Any, nbytes: int = 0) -> None:
        if not self._waiters and self._fits(nbytes):
            self._grant(nbytes)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (key, next(self._seq), nbytes, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: pass it on
                self.release(nbytes, done=False)
            raise

    def release(self, nbytes: int = 0, *, done: bool = False) -> None:
        """Give a slot back; ``done``: its ``nbytes`` were read (they count for the rate)."""
        self.free += 1
        self.active_bytes -= nbytes
        if done:
            self._done_bytes += nbytes
        if not self.active_bytes:
            self._busy += time.monotonic() - self._busy_since
        while self._waiters:
            _, _, n, fut = self._waiters[0]
            if fut.done():
                heapq.heappop(self._waiters)
                continue
            if not self._fits(n):
                return
            heapq.heappop(self._waiters)
            self._grant(n)
            fut.set_result(None)


def _unit_keys(units: Sequence[Transfer], rank: int) -> dict[int, tuple[int, int, int]]:
    """Claim priority of each unit this rank needs (lower first): the units the plan gave
    it, in order; then other ranks' units from the back of each one's queue, round-robin
    over the owners, so that a rank taking over work meets the slow owner in the middle."""
    queues: dict[int, list[int]] = {}
    for u in units:
        if rank in u.consumers:
            queues.setdefault(u.owner, []).append(u.index)
    keys: dict[int, tuple[int, int, int]] = {}
    for owner, q in queues.items():
        for pos, i in enumerate(q):
            keys[i] = (0, pos, 0) if owner == rank else (2, len(q) - 1 - pos, owner)
    return keys


def _parse_claim(value: str, consumers: Sequence[int]) -> tuple[int, frozenset[int]]:
    """A claim's value: the claimant and the consumers that read the unit themselves
    (``"3"``: none; ``"3!"``: all; ``"3!1,2"``: ranks 1 and 2)."""
    who, bang, rest = value.partition("!")
    winner = int(who)
    if not bang:
        return winner, frozenset()
    if not rest:
        return winner, frozenset(c for c in consumers if c != winner)
    return winner, frozenset(int(x) for x in rest.split(","))


class _AdaptivePipeline(_SharedPipeline):
    """The reader pool of adaptive sharing: each shared unit is claimed by the first rank
    that needs it and has a free unit reader (``compare_set`` on the unit's key in the
    group's store: the winner's rank), read by it and sent to the other consumers; they
    receive it from the winner, or, when it is late, read it themselves (first copy wins).

    Why it cannot deadlock under any budget: a unit is claimed only when its claimant starts
    reading it, so a receive waits only on a storage read already in flight on the claimant;
    sends never hold memory a receive needs and never hold up the sender's chunks (they run
    in the background, from destination memory or from a copy whose room was reserved at
    the claim; without room the unit is claimed "without sending" and each consumer reads
    it). Every consumer that did not claim a unit posts exactly one receive for it (unless
    it was claimed without sending), so every send is matched.
    """

    def __init__(
        self,
        base: Pipeline,
        session: _ShareSession,
        parts: dict[int, list[_Part]],
        tag_base: int,
        total_chunks: int,
        keys: dict[int, tuple[int, int, int]],
        claims: str,
    ) -> None:
        super().__init__(base, session, parts, tag_base, total_chunks)
        self.keys = keys
        #: The prefix of the units' claim keys in the store (the phase, and the component
        #: their numbers are within): ``<claims><unit index>``.
        self.claims = claims
        opts = base.options
        self.slots = _Slots(max(2, min(16, opts.initial_concurrency // 2)))
        self.hedge = opts.hedge_policy
        self.hedging = 0
        #: Bytes of send copies (units claimed in staged chunks) allowed at once.
        self.send_room = opts.memory_budget
        #: Returning before the peers (``wait_for_peers=False``): every send from a private
        #: copy, handed to this load's BackgroundSends.
        self.sends: BackgroundSends | None = session.sends
        #: Seconds per byte of this rank's own unit reads (moving average), for the hedge delay.
        self.read_cost: float | None = None
        self._bg: asyncio.TaskGroup | None = None

    async def run(self, chunks: Iterable[Chunk]) -> None:
        # background sends (from destination memory) and late copies of hedged units are
        # awaited here, before the phase ends; a failure of one cancels the phase
        try:
            async with asyncio.TaskGroup() as tg:
                self._bg = tg
                await super().run(chunks)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            self._bg = None

    def _background(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        assert self._bg is not None
        return self._bg.create_task(coro)

    def _hedge_delay(self, nbytes: int) -> float:
        h = self.hedge
        if self.read_cost is None:
            return 4 * h.min_delay
        return max(h.min_delay, h.factor * self.read_cost * nbytes)

    async def _claim(self, unit: Transfer, send_bytes: int, direct_ok: bool = False) -> tuple[int, frozenset[int], int]:
        """Who reads ``unit``, which of its consumers read it themselves instead of receiving
        it, and the bytes of send copy reserved: ``(this rank, ...)`` when it claims it now
        (holding a unit slot, which the caller releases), else the claimant's rank.

        A claimant that would send from a copy (a staged chunk; every unit when returning
        before the peers) needs ``send_bytes`` of send memory, so that the chunk does not
        wait for slow consumers; without that room it claims the unit without sending (value
        ``"<rank>!"``) and every consumer reads it itself: sends never wait for memory, so they
        never hold up a receive. Returning before the peers, a consumer far behind
        (:meth:`BackgroundSends.behind`) is left out (``"<rank>!<peer>,<peer>"``): it reads the
        unit itself; the others receive it from a copy or, without room, from the destination
        (``direct_ok``; sent in the background and waited for at the end of the phase)."""
        session = self.session
        rank = session.rank
        await self.slots.acquire(self.keys.get(unit.index, (3, 0, 0)), unit.nbytes)
        peers = [c for c in unit.consumers if c != rank]
        reserved = 0
        skip: list[int] = []
        sends = self.sends
        if sends is not None and peers:
            # without room for a copy, a peer far behind (holding this rank's copies) reads it
            # itself; the others get a copy if there is room, else the destination's bytes
            # (waited for before the load returns) or, from a staging buffer, nothing (each
            # reads it)
            skip = sends.behind(peers, unit.nbytes)
            if len(skip) < len(peers) and sends.reserve(unit.nbytes):
                reserved = unit.nbytes
            elif not direct_ok:
                skip = peers
        elif send_bytes and send_bytes <= self.send_room:
            reserved = send_bytes
            self.send_room -= reserved
        elif send_bytes:
            skip = peers
        try:
            key = f"{self.claims}{unit.index}"
            mark = (
                str(rank)
                if not skip
                else f"{rank}!"
                if len(skip) == len(peers)
                else f"{rank}!" + ",".join(map(str, skip))
            )
            got = session.monitor.store.compare_set(key, "", mark).decode()
            winner, left_out = _parse_claim(got, unit.consumers)
        except BaseException:
            self._unreserve(reserved)
            self.slots.release(unit.nbytes)
            raise
        if winner == rank:
            session.monitor._written.append(key)
        else:
            self._unreserve(reserved)
            reserved = 0
            if rank not in left_out:
                self.slots.release(unit.nbytes)  # a transfer is coming; else: read it under this slot
        return winner, left_out, reserved

    def _unreserve(self, nbytes: int) -> None:
        if not nbytes:
            return
        if self.sends is not None:
            self.sends.unreserve(nbytes)
        else:
            self.send_room += nbytes

    async def _claimed(self, chunk: Chunk, part: _Part, view: memoryview, unit: Transfer) -> None:
        """Read a unit under the slot ``_claim`` left held; keep the moving average of its cost."""
        done = False
        try:
            t0 = time.monotonic()
            await self._read_part(chunk, part, view)
            cost = (time.monotonic() - t0) / max(1, unit.nbytes)
            self.read_cost = cost if self.read_cost is None else 0.7 * self.read_cost + 0.3 * cost
            done = True
        finally:
            self.slots.release(unit.nbytes, done=done)

    async def _send_copy(self, unit: Transfer, copy: bytearray, peers: list[int]) -> None:
        try:
            await self._send(unit, memoryview(copy), copy, peers)
        finally:
            self.send_room += len(copy)

    async def _send(self, unit: Transfer, view: memoryview, keep: Any, peers: list[int]) -> None:
        session = self.session
        where = f"bytes [{unit.start}, {unit.end}) of {unit.name}"
        await session.transport.exchange(
            "send",
            peers,
            self.tag_base + unit.index,
            unit.index,
            view,
            keep,
            session.monitor,
            f"sending {where} to rank(s) {peers}",
        )
        self.stats.add(bytes_sent=unit.nbytes * len(peers))

    async def _recv(self, unit: Transfer, owner: int, view: memoryview, keep: Any) -> BaseException | None:
        """Receive ``unit`` from ``owner`` (counted once posted: a late copy of a hedged unit
        lands too, in memory nobody reads). Returning before the peers, a failure is returned,
        not raised (the caller decides: a sender that returned and died is read around)."""
        session = self.session
        where = f"bytes [{unit.start}, {unit.end}) of {unit.name}"
        self.stats.add(bytes_received=unit.nbytes)
        try:
            await session.transport.exchange(
                "recv",
                [owner],
                self.tag_base + unit.index,
                unit.index,
                view,
                keep,
                session.monitor,
                f"waiting for {where} from rank {owner}",
            )
        except Exception as exc:
            if self.sends is None:
                raise
            return exc
        return None

    async def _own_copy(self, chunk: Chunk, unit: Transfer) -> memoryview:
        """A unit read from storage into memory of its own (a cross-rank hedge)."""
        if self.storage.supports_readinto:
            buf = memoryview(bytearray(unit.nbytes))
            await self.storage.readinto(chunk.name, unit.start, [buf])
            return buf
        return await self.storage.read(chunk.name, unit.start, unit.end)

    async def _unit(self, chunk: Chunk, part: _Part, buf: memoryview, direct: bool, state: dict[str, Any]) -> None:
        unit = part.transfer
        assert unit is not None
        view = buf[part.start - chunk.start : part.end - chunk.start]
        rank = self.session.rank
        peers = len(unit.consumers) - 1
        owner, left_out, reserved = await self._claim(unit, 0 if direct else unit.nbytes if peers else 0, direct)
        if owner == rank:
            try:
                await self._claimed(chunk, part, view, unit)
            except BaseException:
                self._unreserve(reserved)
                raise
            if unit.owner != rank:
                self.stats.add(bytes_taken_over=unit.nbytes)
            to = [c for c in unit.consumers if c != rank and c not in left_out]
            if reserved and self.sends is not None:  # from a copy that may outlive the load
                self.sends.post(self.session.group, to, self.tag_base + unit.index, bytearray(view))
                self.stats.add(bytes_sent=unit.nbytes * len(to))
            elif to and direct:  # from the destination's memory, ready and unchanging: the chunk does not wait
                self._background(self._send(unit, view, chunk, to))
            elif to:  # from a copy (room reserved at the claim), so the chunk does not wait either
                self._background(self._send_copy(unit, bytearray(view), to))
            return
        if rank in left_out:  # claimed without a send to this rank (its memory for sends was full): read it
            await self._claimed(chunk, part, view, unit)
            self.stats.add(bytes_hedged=unit.nbytes)
            return
        # receive: into the staging buffer, or (direct chunks) into memory of its own, never
        # into a destination; a receive that may still land keeps that memory alive
        target = view if not direct else memoryview(bytearray(unit.nbytes))
        state["pending"] = True
        recv = self._background(self._recv(unit, owner, target, chunk))
        hedge: asyncio.Task[memoryview] | None = None
        try:
            if self.hedge.enabled:
                await asyncio.wait({recv}, timeout=self._hedge_delay(unit.nbytes))
                # late, with every hedge slot taken: wait for one to free, not for the owner
                # alone (an owner that stalls must not hold this unit up for ever)
                while not recv.done() and self.hedging >= self.hedge.max_in_flight:
                    await asyncio.wait({recv}, timeout=_HEDGE_SLOT_POLL)
            if not recv.done() and self.hedge.enabled and self.hedging < self.hedge.max_in_flight:
                self.hedging += 1
                try:
                    hedge = asyncio.ensure_future(self._own_copy(chunk, unit))
                    await asyncio.wait({recv, hedge}, return_when=asyncio.FIRST_COMPLETED)
                    if not recv.done() and hedge.done() and hedge.exception() is None:
                        view[:] = hedge.result()  # first copy wins; the late one lands in `target`
                        self.stats.add(bytes_hedged=unit.nbytes)
                        state["tainted"] = True
                        log.debug(
                            "rank %d read %s [%d, %d) itself: rank %d was late",
                            rank,
                            unit.name,
                            unit.start,
                            unit.end,
                            owner,
                        )
                        if self.sends is not None:
                            # nobody waits for the late copy: its receive stays posted (so the
                            # owner's send is matched) and its thread keeps `target` alive
                            recv.cancel()
                        return
                finally:
                    self.hedging -= 1
            failed = await recv
            if failed is not None:
                await self._sender_lost(chunk, unit, owner, view, failed)
                return
            if direct:
                view[:] = target
        finally:
            if hedge is not None and not hedge.done():
                hedge.cancel()
                await asyncio.wait({hedge})
            if hedge is not None and hedge.done() and not hedge.cancelled():
                hedge.exception()  # retrieved: a failed hedge only means waiting for the transfer

    async def _sender_lost(
        self, chunk: Chunk, unit: Transfer, owner: int, view: memoryview, exc: BaseException
    ) -> None:
        """A receive failed while returning before the peers: when its sender had already
        finished its load (and then exited, or destroyed its group), read the unit from
        storage; anything else is this load's failure."""
        monitor = self.session.monitor
        if not (isinstance(exc, DistributedLoadError) and exc.rank == owner and monitor.finished(owner)):
            raise exc
        log.info(
            "rank %d read %s [%d, %d) itself: rank %d finished its load and can no longer send it (%s)",
            self.session.rank,
            unit.name,
            unit.start,
            unit.end,
            owner,
            exc,
        )
        view[:] = await self._own_copy(chunk, unit)
        self.stats.add(bytes_hedged=unit.nbytes)

    def _direct(self, chunk: Chunk, parts: list[_Part]) -> bool:
        # who sends is only known at the claims: received units land in memory of their own
        return len(chunk.segments) == 1 and chunk.tiles_into()

    async def _run_parts(
        self, chunk: Chunk, parts: list[_Part], buf: memoryview, direct: bool, state: dict[str, Any]
    ) -> None:
        order = sorted(parts, key=lambda p: self.keys.get(p.transfer.index, (3, 0, 0)) if p.transfer else (-1, 0, 0))
        async with asyncio.TaskGroup() as tg:
            for p in order:
                if p.transfer is None:
                    tg.create_task(self._read_part(chunk, p, buf[p.start - chunk.start : p.end - chunk.start]))
                else:
                    tg.create_task(self._unit(chunk, p, buf, direct, state))


def file_identities(metadata: Any) -> dict[str, str]:
    """Per file of the checkpoint, a digest of what the metadata says it holds: the saved
    items in it (key, saved chunk, byte range, and the key's dtype and shape) and the save's
    id. Independent of the URL the checkpoint was reached through: two ranks share the bytes
    of a file only when they agree on its digest."""
    if metadata is None:
        return {}
    sdm = metadata.state_dict_metadata
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    per_file: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        name = str(getattr(info, "relative_path", ""))
        md = sdm.get(index.fqn)
        props = getattr(md, "properties", None)
        shape = (str(props.dtype), tuple(md.size)) if props is not None else type(md).__name__
        item = (index.fqn, tuple(index.offset or ()), index.index, getattr(info, "offset", 0), info.length, shape)
        per_file.setdefault(name, []).append(repr(item))
    out = {}
    for name, items in per_file.items():
        h = hashlib.sha256(repr(save_id).encode())
        for text in sorted(items):
            h.update(text.encode())
        out[name] = h.hexdigest()[:32]
    return out


def checkpoint_identity(metadata: Any) -> str:
    """One digest of :func:`file_identities`: the same for every URL of one checkpoint."""
    h = hashlib.sha256()
    for name, digest in sorted(file_identities(metadata).items()):
        h.update(f"{name}={digest};".encode())
    return h.hexdigest()


def _check_identities(identities: Sequence[dict[str, str]], rank: int) -> None:
    """Ranks that need bytes of one file agree on what it holds (the same checkpoint, any
    URL); raise DistributedLoadError otherwise."""
    by_file: dict[str, dict[str, list[int]]] = {}
    for r, files in enumerate(identities):
        for name, digest in files.items():
            by_file.setdefault(name, {}).setdefault(digest, []).append(r)
    for name in sorted(by_file):
        groups = by_file[name]
        if len(groups) <= 1:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        odd = ordered[1][1]
        shown = "; ".join(f"ranks {rs}: {digest[:12]}" for digest, rs in ordered)
        raise DistributedLoadError(
            f"the ranks are not loading the same checkpoint: their metadata says different things about {name} "
            f"({shown}, as digests of what it holds); ShardedLoadPlanner shares bytes between ranks that load "
            f"identical metadata, through whatever URL each reaches it: point rank(s) {odd} at the same checkpoint",
            rank=odd[0],
            doing="comparing the checkpoint's metadata",
        )


def _check_same_ending(early: Sequence[bool]) -> None:
    """Every rank ends the load the same way: returning before its peers, or waiting for
    all (a rank that waits would otherwise wait at the end for ranks that never come)."""
    if len(set(early)) <= 1:
        return
    waits = [r for r, e in enumerate(early) if not e]
    odd = waits if len(waits) <= len(early) - len(waits) else [r for r, e in enumerate(early) if e]
    raise DistributedLoadError(
        f"the ranks' ShardedLoadPlanner disagree on wait_for_peers (rank(s) {waits} wait for all ranks at the "
        f"end of the load, the others return before their peers): give every rank the same planner settings",
        rank=odd[0],
        doing="comparing the ranks' planner settings",
    )


# --- one rank's part of a sharded read ---------------------------------------------------------


class _ShareSession:
    """This rank's side of a :class:`ShardedLoadPlanner` load, created by the reader's
    ``read_data`` (through ``planner.share_session``); :meth:`run` replaces
    ``Pipeline.run`` for each read phase."""

    def __init__(
        self,
        group: Any,
        monitor: Monitor,
        options: LoadOptions,
        *,
        ordered: bool | None = None,
        plan: Any = None,
        adaptive: bool | None = None,
        unit_size: int | None = None,
        load_session: LoadSession | None = None,
        wait_for_peers: bool = True,
    ) -> None:
        self.group = group
        self.monitor = monitor
        self.options = options
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.transport = _Transport(group, ordered=ordered)
        self.phase = 0
        self.doing = "reading data"
        #: Per read phase, the bytes this rank was planned to read from storage.
        self.planned_bytes: list[int] = []
        self.plan = plan or plan_transfers
        # adaptive needs tag matching in any order: not with ordered (NCCL) transports
        self.adaptive = (not self.transport.ordered) if adaptive is None else adaptive
        if self.adaptive and self.transport.ordered:
            raise AsyncLoadError(
                "ShardedLoadPlanner(adaptive=True) cannot run with ordered transfers (ordered=True, or NCCL): "
                "pass adaptive=False"
            )
        self.unit_size = unit_size
        self.load_session = load_session
        #: Returning before the peers (adaptive sharing without wait_for_peers): this load's
        #: sends, which may outlive it; the monitor's finish then waits for nobody.
        self.sends: BackgroundSends | None = None
        if self.adaptive and not wait_for_peers and self.transport.kind == "thread":
            self.sends = BackgroundSends(monitor, options.memory_budget)
            monitor.returns_early = True
            monitor.after_return = self.sends.after_return
        #: plan_transfers was overridden: its owners are kept as where each rank starts.
        self.custom_plan = plan is not None and getattr(plan, "__func__", None) is not ShardedLoadPlanner.plan_transfers
        self._identity: dict[str, str] | None = None

    def fail(self, exc: BaseException) -> None:
        """read_data failed on this rank: tell the others."""
        self.monitor.fail(exc, self.doing)
        if self.sends is not None:
            self.sends.abandon()

    def _set_doing(self, text: str) -> None:
        self.doing = text
        self.monitor.status(text)

    def identity(self, files: Iterable[str]) -> dict[str, str]:
        """The digests of ``files`` (those this rank needs bytes of) in this rank's metadata."""
        if self._identity is None:
            md = self.load_session.metadata if self.load_session is not None else None
            self._identity = file_identities(md)
        return {f: self._identity.get(f, "") for f in sorted(set(files))}

    async def run(self, pipeline: Pipeline, chunks: Sequence[Chunk]) -> None:
        phase = self.phase
        self.phase += 1
        what = "record headers and small records" if phase == 0 else "tensor data"
        mine = sorted(chunks, key=lambda c: (c.name, c.start))
        adv = _advertise(mine)
        needs = [(c.name, a[0], a[1]) for c, a in zip(mine, adv) if a is not None]
        payload = (self.identity(n for n, _, _ in needs), _pack(needs), self.sends is not None)
        t0 = time.monotonic()
        self._set_doing(f"exchanging which {what} it needs")
        await self.monitor.abarrier(f"needs-{phase}", f"waiting for the other ranks to plan reading {what}")
        loop = asyncio.get_running_loop()
        device = self.transport.device
        group = self.group
        world = self.world

        def gather() -> list[Any]:
            out: list[Any] = [None] * world
            with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
                dist.all_gather_object(out, payload, group=group)
            return out

        gathered = await loop.run_in_executor(None, gather)
        _check_identities([g[0] for g in gathered], self.rank)
        _check_same_ending([g[2] for g in gathered])
        tag_base = ((self.monitor.seq * 2 + phase) % _TAG_LOADS) * _TAG_SPAN
        unit = self.unit_size or min(_UNIT_SIZE, pipeline.options.effective_chunk_size)
        if self.custom_plan:  # the override's whole plan, as tuples; its owners are where each rank starts
            all_needs: list[Any] = [_unpack(g[1]) for g in gathered]
            transfers, load = self.plan(all_needs)
            _check_transfers(transfers, all_needs)
            items = split_units(transfers, unit) if self.adaptive else transfers
            scope, n, planned = "", len(items), load[self.rank]
        else:  # the default plan: only this rank's part of it, from the packed ranges as they came
            part = _rank_plan([g[1] for g in gathered], self.rank, unit if self.adaptive else None)
            items, n, planned = part.items, part.count, part.planned
            scope = f"c{part.component}/"  # items are numbered within the component
        self.planned_bytes.append(planned)
        shared: _SharedPipeline
        if self.adaptive:
            keys = _unit_keys(items, self.rank)
            parts = _parts_for(mine, adv, items, self.rank)
            by_id = {id(c): p for c, p in zip(mine, parts) if p is not None}
            # own planned units first, then chunks only this rank reads, then the others' units
            rank_of = {
                id(c): min(keys[q.transfer.index] for q in p if q.transfer is not None)
                for c, p in zip(mine, parts)
                if p
            }
            order = sorted(range(len(mine)), key=lambda i: rank_of.get(id(mine[i]), (1, i, 0)))
            mine = [mine[i] for i in order]
            shared = _AdaptivePipeline(pipeline, self, by_id, tag_base, len(mine), keys, f"u/{phase}/{scope}")
        else:
            self.transport.set_order(items, self.rank)
            parts = _parts_for(mine, adv, items, self.rank)
            by_id = {id(c): p for c, p in zip(mine, parts) if p is not None}
            shared = _SharedPipeline(pipeline, self, by_id, tag_base, len(mine))
        t1 = time.monotonic()
        self._set_doing(f"reading and sharing {what}")
        await _run_watched(shared.run(mine), self.monitor)
        log.debug(
            "rank %d, %s: planned in %.3f s (barrier, all_gather, plan), %d %s, this rank planned to read %s; "
            "read and shared in %.3f s",
            self.rank,
            what,
            t1 - t0,
            n,
            "units" if self.adaptive else "transfers",
            _fmt_bytes(planned),
            time.monotonic() - t1,
        )


def _pack(needs: Sequence[tuple[str, int, int]]) -> dict[str, bytes]:
    """This rank's needed ranges, compact for the all-gather: per file, the flat
    ``start, end, start, end ...`` offsets as little-endian int64 bytes."""
    import array

    flat: dict[str, array.array[int]] = {}
    for name, start, end in needs:
        a = flat.get(name)
        if a is None:
            a = flat[name] = array.array("q")
        a.append(start)
        a.append(end)
    return {name: a.tobytes() for name, a in flat.items()}


def _unpack(packed: dict[str, bytes]) -> list[tuple[str, int, int]]:
    import array

    out: list[tuple[str, int, int]] = []
    for name in sorted(packed):
        a = array.array("q")
        a.frombytes(packed[name])
        out.extend((name, a[i], a[i + 1]) for i in range(0, len(a), 2))
    return out


async def _run_watched(coro: Awaitable[None], monitor: Monitor) -> None:
    """Run ``coro`` while watching for another rank's failure."""
    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(monitor.watch())
            try:
                await coro
            finally:
                watcher.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
