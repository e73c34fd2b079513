"""Sharing bytes across ranks: :class:`ShardedLoadPlanner`, which reads each byte range
once and shares it over the process group (the multi-rank driver is :mod:`asyncload._driver`,
its bounded waits :mod:`asyncload._monitor`).

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
import bisect
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._assembly import assemble, copy_bytes, track
from ._chunks import Chunk
from ._dcp import PipelinedLoadPlanner
from ._errors import AsyncLoadError, DistributedLoadError, first_error
from ._monitor import Monitor
from ._options import LoadOptions
from ._pipeline import Pipeline
from ._session import LoadSession
from ._stats import _fmt_bytes

__all__ = ["ShardedLoadPlanner", "Transfer", "plan_transfers"]

log = logging.getLogger("asyncload.sharded")

_UNSET: Any = object()

#: Point-to-point tags: ``(load sequence % _TAG_LOADS) * _TAG_SPAN + transfer index``.
_TAG_SPAN = 2_000_000
_TAG_LOADS = 1000


class ShardedLoadPlanner(PipelinedLoadPlanner):
    """A :class:`PipelinedLoadPlanner` for multi-rank loads that reads every byte once.

    Before each read phase the ranks all-gather the byte ranges they need; every range
    that two or more ranks need is then read from storage by exactly one of them (chosen
    to balance bytes read per rank) and sent to the others over the process group, chunk
    by chunk as reads land, within ``memory_budget``. With 4 ranks loading a replicated
    model, the ranks together read the checkpoint about once instead of 4 times.

    ``process_group``: the group the load runs on (default: the world). ``asyncload.load``
    fills it in from its own ``process_group`` argument; with ``dcp.load`` on a subgroup,
    pass the same group here. ``collective_timeout``: seconds a rank may go without
    progress before the others give up on it (overrides ``LoadOptions.collective_timeout``).
    ``ordered``: issue the transfers between two ranks in one agreed order on both sides
    (needed by backends that match sends to receives by order, not by tag: ``None`` turns it
    on for NCCL only). Other keyword arguments are those of :class:`PipelinedLoadPlanner`.
    """

    def __init__(
        self,
        *,
        process_group: Any = None,
        collective_timeout: float | None = _UNSET,
        ordered: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.ordered = ordered
        if collective_timeout is not _UNSET:
            # validated like the LoadOptions field
            dataclasses.replace(self.options, collective_timeout=collective_timeout)
        self.process_group = process_group
        self._collective_timeout = collective_timeout

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
        return _ShareSession(group, monitor, options, ordered=self.ordered, plan=self.plan_transfers)


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

    ``needs[r]`` lists the half-open byte ranges ``(file, start, end)`` rank ``r`` needs;
    one rank's ranges do not overlap (they may touch). Returns the transfers, in global
    order (by file, then offset), and the bytes each rank will read from storage.

    Every byte that two or more ranks need is in exactly one transfer; its owner is one of
    the ranks that need it, chosen greedily (largest transfers first, to the consumer with
    the fewest bytes so far) to balance bytes read per rank. A transfer never crosses a
    range boundary of any of its consumers, so it lands inside one read request of each.
    """
    world = len(needs)
    load = [0] * world
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for r, ranges in enumerate(needs):
        for name, start, end in ranges:
            if end > start:
                by_file.setdefault(name, []).append((start, end, r))
    runs: list[tuple[str, int, int, tuple[int, ...]]] = []
    for name in sorted(by_file):
        events: dict[int, list[tuple[int, int]]] = {}
        for start, end, r in by_file[name]:
            events.setdefault(start, []).append((r, 1))
            events.setdefault(end, []).append((r, -1))
        points = sorted(events)
        active: dict[int, int] = {}
        cur: list[Any] | None = None  # [start, end, consumers]
        for i, p in enumerate(points):
            edge = set()
            for r, d in events[p]:
                edge.add(r)
                c = active.get(r, 0) + d
                if c:
                    active[r] = c
                else:
                    active.pop(r, None)
            if i + 1 == len(points):
                break
            q = points[i + 1]
            if not active:
                if cur is not None:
                    runs.append((name, cur[0], cur[1], cur[2]))
                    cur = None
                continue
            consumers = tuple(sorted(active))
            if cur is not None and cur[1] == p and cur[2] == consumers and not edge.intersection(consumers):
                cur[1] = q
                continue
            if cur is not None:
                runs.append((name, cur[0], cur[1], cur[2]))
            cur = [p, q, consumers]
        if cur is not None:
            runs.append((name, cur[0], cur[1], cur[2]))
    shared: list[tuple[str, int, int, tuple[int, ...]]] = []
    for name, start, end, consumers in runs:
        if len(consumers) == 1:
            load[consumers[0]] += end - start
        else:
            shared.append((name, start, end, consumers))
    owners: dict[tuple[str, int], int] = {}
    for name, start, end, consumers in sorted(shared, key=lambda s: (-(s[2] - s[1]), s[0], s[1])):
        owner = min(consumers, key=lambda c: (load[c], c))
        load[owner] += end - start
        owners[(name, start)] = owner
    transfers = [
        Transfer(i, name, start, end, owners[(name, start)], consumers)
        for i, (name, start, end, consumers) in enumerate(shared)
    ]
    return transfers, load


def _check_transfers(transfers: Sequence[Transfer], needs: Sequence[Sequence[tuple[str, int, int]]]) -> None:
    """A (custom) plan keeps the rules the reads rely on; raise AsyncLoadError otherwise."""
    for i, t in enumerate(transfers):
        if t.index != i:
            raise AsyncLoadError(f"plan_transfers returned transfer {t} at position {i}: index must be its position")
        if t.owner not in t.consumers or len(t.consumers) < 2:
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
            async with asyncio.TaskGroup() as tg:
                for c in members:
                    tg.create_task(self._read_and_assemble(c))
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

    async def _shared(self, chunk: Chunk, parts: list[_Part]) -> None:
        loop = asyncio.get_running_loop()
        # receive into a staging buffer, never into the destination: after a failure, a
        # transfer still pending can then only ever land in a buffer that was given up on
        direct = len(chunk.segments) == 1 and chunk.tiles_into() and all(p.kind != "recv" for p in parts)
        pooled: bytearray | None = None
        if direct:
            buf = chunk.segments[0].into
            assert buf is not None
        else:
            pooled = self._pool.get(chunk.nbytes)
            buf = memoryview(pooled)[: chunk.nbytes]
        state = {"pending": False}
        ok = False
        try:
            if len(parts) == 1:
                await self._part(chunk, parts[0], buf, state)
            else:
                async with asyncio.TaskGroup() as tg:
                    for p in parts:
                        tg.create_task(self._part(chunk, p, buf, state))
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
            # a buffer a failed transfer may still write into is never reused
            if pooled is not None and (ok or not state["pending"]):
                self._pool.put(pooled)
        self._count_assembled(chunk, t1)


# --- one rank's part of a sharded read ---------------------------------------------------------


class _ShareSession:
    """This rank's side of a :class:`ShardedLoadPlanner` load, created by the reader's
    ``read_data`` (through ``planner.share_session``); :meth:`run` replaces
    ``Pipeline.run`` for each read phase."""

    def __init__(
        self, group: Any, monitor: Monitor, options: LoadOptions, *, ordered: bool | None = None, plan: Any = None
    ) -> None:
        self.group = group
        self.monitor = monitor
        self.options = options
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.transport = _Transport(group, ordered=ordered)
        self.phase = 0
        self.doing = "reading data"
        self.planned_bytes: list[list[int]] = []
        self.plan = plan or plan_transfers

    def fail(self, exc: BaseException) -> None:
        """read_data failed on this rank: tell the others."""
        self.monitor.fail(exc, self.doing)

    def _set_doing(self, text: str) -> None:
        self.doing = text
        self.monitor.status(text)

    async def run(self, pipeline: Pipeline, chunks: Sequence[Chunk]) -> None:
        phase = self.phase
        self.phase += 1
        what = "record headers and small records" if phase == 0 else "tensor data"
        mine = sorted(chunks, key=lambda c: (c.name, c.start))
        adv = _advertise(mine)
        needs = [(c.name, a[0], a[1]) for c, a in zip(mine, adv) if a is not None]
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
                dist.all_gather_object(out, needs, group=group)
            return out

        all_needs = await loop.run_in_executor(None, gather)
        transfers, load = self.plan(all_needs)
        _check_transfers(transfers, all_needs)
        self.planned_bytes.append(load)
        self.transport.set_order(transfers, self.rank)
        parts = _parts_for(mine, adv, transfers, self.rank)
        by_id = {id(c): p for c, p in zip(mine, parts) if p is not None}
        tag_base = ((self.monitor.seq * 2 + phase) % _TAG_LOADS) * _TAG_SPAN
        shared = _SharedPipeline(pipeline, self, by_id, tag_base, len(mine))
        t1 = time.monotonic()
        self._set_doing(f"reading and sharing {what}")
        await _run_watched(shared.run(mine), self.monitor)
        log.debug(
            "rank %d, %s: planned in %.3f s (barrier, all_gather, plan), %d transfers, this rank reads %s; "
            "read and shared in %.3f s",
            self.rank,
            what,
            t1 - t0,
            len(transfers),
            _fmt_bytes(load[self.rank]),
            time.monotonic() - t1,
        )


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
