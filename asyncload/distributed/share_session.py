"""One rank's part of a sharded read: :func:`open_share` starts it (``ShardedLoadPlanner``'s
reading hook calls it) and :class:`_ShareSession` runs each read phase in place of
``Pipeline.run``.

How a multi-rank load runs (``asyncload.load`` with ``torch.distributed`` initialised; the
driver is :mod:`asyncload.engine.driver`)::

    every rank                      coordinator (group rank 0)
    read .metadata, local plan  --> gather plans --> create_global_plan
    <-- scatter plans -------------------------------'
    read_data(final plan)
       PipelinedLoadPlanner: each rank reads the byte ranges its own shards need
       ShardedLoadPlanner:   per phase (record headers, then tensor data):
           all_gather(needed byte ranges)  -> the same plan on every rank
           (asyncload.distributed.share_plan): a range two or more ranks need is read by one of
           them (bytes balanced) and sent to the others point to point, chunk by chunk, as
           reads land (asyncload.distributed.shared), or claimed unit by unit as ranks get
           to it (asyncload.distributed.adaptive, the default)
    barrier "done"

Every wait on another rank goes through a :class:`Monitor`
(:mod:`asyncload.distributed.monitor`): a few keys in the process group's store hold each
rank's status ("reading data: 12 of 40 chunks"), its failure if it had one, and barrier
arrivals. A rank that raises posts its error there at once and every other rank raises
:class:`DistributedLoadError` naming it; a rank that makes no progress for
``collective_timeout`` seconds is declared stalled by the first rank waiting on it, and
every rank raises an error naming it and its last status. Collectives themselves (gather
and scatter of plans, all_gather of needs) are only entered once a monitored barrier has
seen every rank arrive, so they cannot hang on a rank that has already failed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asyncload._version import __version__
from asyncload.common.errors import first_error
from asyncload.common.stats import _fmt_bytes
from asyncload.distributed.adaptive import _AdaptivePipeline
from asyncload.distributed.claims import Claims, _unit_keys
from asyncload.distributed.identity import (
    _check_identities,
    _check_same_ending,
    _check_settings,
    file_identities,
)
from asyncload.distributed.monitor import Monitor
from asyncload.distributed.node_phase import _HEAD, RING_SLOTS, run_node_phase
from asyncload.distributed.nodes import BLOCK_UNITS, node_layout
from asyncload.distributed.policy import (
    PlanFn,
    RankEstimate,
    SharingPolicy,
    decide_sharing,
    sharing_policy,
)
from asyncload.distributed.sends import BackgroundSends
from asyncload.distributed.share_plan import (
    _advertise,
    _check_transfers,
    _needs,
    _pack,
    _parts_for,
    _rank_plan,
    _unpack,
    split_units,
)
from asyncload.distributed.shared import _SharedPipeline
from asyncload.distributed.side_group import (
    cached_side_group,
    check_side_group,
    make_side_group,
    side_group_name,
)
from asyncload.distributed.transport import _nullcontext, _Transport, _transport_kind
from asyncload.engine import Chunk, LoadSession, Pipeline

__all__ = ["open_share"]

log = logging.getLogger("asyncload.sharded")

_T = TypeVar("_T")

#: Point-to-point tags: ``(load sequence % _TAG_LOADS) * _TAG_SPAN + transfer index``.
_TAG_SPAN = 2_000_000
_TAG_LOADS = 1000


def open_share(
    load_session: LoadSession,
    *,
    process_group: Any,
    collective_timeout: float | None,
    ordered: bool | None,
    adaptive: bool | None,
    unit_size: int | None,
    wait_for_peers: bool | None,
    custom_plan: PlanFn | None,
    node_id: str | None = None,
    sharing: str = "auto",
    side_group: Any = None,
) -> _ShareSession | None:
    """A share session that takes over this rank's reads of ``load_session``, or None when
    there is nobody to share with (no process group, or a group of one). The group is
    ``process_group``, else the one the load session was made with; so is its monitor.
    ``node_id``: this rank's node (default: its host name), for node-aware sharing.
    ``side_group``: ``"auto"``, None or a gloo group of the same ranks, the group that
    carries the shared bytes when the load's group matches sends by order
    (:func:`sharing_policy`, :mod:`asyncload.distributed.side_group`).

    Raised: ``AsyncLoadError`` for knobs that cannot run together (:func:`sharing_policy`)
    and for a ``side_group`` that cannot carry the group's bytes (:func:`check_side_group`)."""
    group = process_group if process_group is not None else load_session.group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) <= 1:
        return None
    config = load_session.config
    monitor = load_session.monitor
    if monitor is None or monitor.group is not group:
        monitor = Monitor(group, collective_timeout, config.ranks.late_rank_log_after)
    if side_group is not None and not isinstance(side_group, str):
        check_side_group(side_group, group)
    policy = sharing_policy(
        config,
        transport=_transport_kind(group)[0],
        ordered=ordered,
        adaptive=adaptive,
        unit_size=unit_size,
        wait_for_peers=wait_for_peers,
        collective_timeout=collective_timeout,
        custom_plan=custom_plan,
        send_budget=config.memory.sends,
        sharing=sharing,
        side_group=side_group,
        backend=str(dist.get_backend(group)),
    )
    share = _ShareSession(group, monitor, policy, load_session)
    share.node_id = socket.gethostname() if node_id is None else str(node_id)
    return share


class _ShareSession:
    """This rank's side of a ``ShardedLoadPlanner`` load, created by the reader's
    ``read_data`` (through ``planner.share_session``); :meth:`run` replaces
    ``Pipeline.run`` for each read phase."""

    def __init__(
        self,
        group: Any,
        monitor: Monitor,
        policy: SharingPolicy,
        load_session: LoadSession | None = None,
    ) -> None:
        self.group = group
        self.monitor = monitor
        self.policy = policy
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        #: The device the load's group's collectives run on (its all-gathers of needs).
        self.device = _transport_kind(group)[1]
        #: Point-to-point sends and receives of shared bytes: over the load's group, or over
        #: the side group (the user's now, or the one made or reused before the first read
        #: phase that shares: :meth:`_side_ready`).
        self.transport = _Transport(
            group if policy.side_group is None else policy.side_group, ordered=policy.ordered
        )
        self._side: Any = policy.side_group
        #: ``LoadStats.sharing_group`` once bytes are shared.
        self._carrier = policy.carrier_reason
        self.phase = 0
        self.doing = "reading data"
        #: Per read phase, the bytes this rank was planned to read from storage.
        self.planned_bytes: list[int] = []
        self.load_session = load_session
        #: Returning before the peers (adaptive sharing without wait_for_peers): this load's
        #: sends, which may outlive it; the monitor's finish then waits for nobody.
        self.sends: BackgroundSends | None = None
        if policy.returns_early:
            self.sends = BackgroundSends(monitor, policy.send_budget)
            monitor.returns_early = True
            monitor.after_return = self.sends.after_return
        self._identity: dict[str, str] | None = None
        #: This rank's node (node-aware sharing, :mod:`asyncload.distributed.nodes`).
        self.node_id = ""
        #: Whether this load shares (decided by every rank alike before its first read phase:
        #: :func:`decide_sharing`); None before.
        self.sharing: bool | None = None
        self._why = ""

    def fail(self, exc: BaseException) -> None:
        """read_data failed on this rank: tell the others."""
        self.monitor.fail(exc, self.doing)
        if self.sends is not None:
            self.sends.abandon()

    def settings(self, pipeline: Pipeline) -> tuple[tuple[str, Any], ...]:
        """What shapes the shared plan and the node rings, as ``(name, value)`` pairs: sent
        with the first all-gather of every read phase and compared (:func:`_check_settings`);
        docs/distributed.md, "What must match across ranks"."""
        policy = self.policy
        custom = policy.custom_plan
        config, chunking = pipeline.config, pipeline.chunking
        return (
            ("asyncload's version", __version__),
            ("LoadOptions.memory_budget", config.memory.budget),
            ("LoadOptions.chunk_size", chunking.chunk_size),
            ("LoadOptions.min_chunk_size", chunking.min_chunk_size),
            ("LoadOptions.verify (peers' bytes checked)", config.checks.verify),
            ("ShardedLoadPlanner.unit_size", policy.unit_size),
            ("ShardedLoadPlanner.sharing", policy.sharing),
            ("ShardedLoadPlanner.adaptive", policy.adaptive),
            ("ShardedLoadPlanner.wait_for_peers (returns before its peers)", policy.returns_early),
            ("ShardedLoadPlanner.ordered", policy.ordered),
            ("the transport (carrier, waits)", (policy.carrier, policy.transport)),
            (
                "ShardedLoadPlanner.plan_transfers",
                "default" if custom is None else getattr(custom, "__qualname__", repr(custom)),
            ),
            (
                "the node ring's layout (slots, head bytes a rank, units a block)",
                (RING_SLOTS, _HEAD, BLOCK_UNITS),
            ),
        )

    def _set_doing(self, text: str) -> None:
        self.doing = text
        self.monitor.status(text)

    def identity(self, files: Iterable[str]) -> dict[str, str]:
        """The digests of ``files`` (those this rank needs bytes of) in this rank's metadata."""
        if self._identity is None:
            md = self.load_session.metadata if self.load_session is not None else None
            self._identity = file_identities(md)
        return {f: self._identity.get(f, "") for f in sorted(set(files))}

    async def _side_ready(self, names: Sequence[str], cached: Any, phase: int) -> None:
        """Before the first read phase that shares bytes (every rank at once, having decided
        alike): the gloo side group that carries them, the one made by an earlier load when
        every rank still has it (``names``: each rank's, all-gathered; ``cached``: this
        rank's), else a new one (:func:`make_side_group`, a collective)."""
        if cached is not None and all(n == names[0] for n in names) and names[0]:
            side, how = cached, "made by an earlier load on this group, reused"
        else:
            self._set_doing("making the gloo side group for adaptive sharing")
            # its waits poll the failures themselves (a watch beside them would poll again)
            side = await make_side_group(self.group, self.monitor, phase)
            how = "made for this load"
        self._side = side
        self.transport = _Transport(side, ordered=False)
        self._carrier = f"{self.policy.carrier_reason}; the side group was {how}"

    async def run(self, pipeline: Pipeline, chunks: Sequence[Chunk]) -> None:
        phase = self.phase
        self.phase += 1
        what = "record headers and small records" if phase == 0 else "tensor data"
        if self.sharing is False:  # every rank decided to read its own bytes: no exchange
            await _run_watched(pipeline.run(chunks), self.monitor)
            return
        mine = sorted(chunks, key=lambda c: (c.name, c.start))
        adv = _advertise(mine)
        needs = _needs(mine, adv)
        estimate = RankEstimate.measure(pipeline.storage, sum(e - s for _, s, e in needs))
        # the side group this rank made for the load's group before (a later load reuses it
        # when every rank has the same one; else every rank makes a new one)
        cached = None
        if self.policy.carrier == "side" and self._side is None:
            cached = cached_side_group(self.group)
        payload = (
            self.identity(n for n, _, _ in needs),
            _pack(needs),
            self.sends is not None,
            estimate,
            (self.node_id, secrets.token_hex(8)),
            side_group_name(cached) if cached is not None else "",
            self.settings(pipeline),
        )
        t0 = time.monotonic()
        self._set_doing(f"exchanging which {what} it needs")
        await self.monitor.abarrier(
            f"needs-{phase}", f"waiting for the other ranks to plan reading {what}"
        )
        loop = asyncio.get_running_loop()
        device = self.device
        group = self.group
        world = self.world

        def gather() -> list[Any]:
            out: list[Any] = [None] * world
            with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
                dist.all_gather_object(out, payload, group=group)
            return out

        # watched: a rank that arrived at the barrier and failed before its part of the
        # all-gather (posting its failure) ends this wait too, not gloo's timeout
        gathered = await _run_watched(loop.run_in_executor(None, gather), self.monitor)
        _check_identities([g[0] for g in gathered], self.rank)
        _check_same_ending([g[2] for g in gathered])
        _check_settings([g[6] if len(g) > 6 else None for g in gathered])
        tag_base = ((self.monitor.seq * 2 + phase) % _TAG_LOADS) * _TAG_SPAN
        policy = self.policy
        decision = decide_sharing(
            policy,
            [g[3] for g in gathered],
            pipeline.chunking.chunk_size,
            share=self.sharing,
            why=self._why,
        )
        if decision.why:  # decided (else: nothing to read yet, the next phase decides)
            self.sharing, self._why = decision.share, decision.why
        pipeline.stats.set(
            sharing_decision="share" if decision.share else "read",
            sharing_reason=decision.reason,
            sharing_unit_size=decision.unit_size if decision.share and policy.adaptive else 0,
        )
        if not decision.share or not decision.unit_size:  # read alone (the load, or this phase)
            log.debug("rank %d, %s: %s", self.rank, what, decision.reason)
            self._set_doing(f"reading {what}")
            await _run_watched(pipeline.run(chunks), self.monitor)
            return
        unit = decision.unit_size
        if self._side is None and policy.carrier == "side":
            await self._side_ready([g[5] for g in gathered], cached, phase)
        pipeline.stats.set(sharing_group=self._carrier)
        nodes = node_layout([g[4][0] for g in gathered])
        if nodes is not None and policy.custom_plan is None and policy.transport == "thread":
            # several nodes: every byte enters each node once, handed over inside it through
            # shared memory
            self._set_doing(f"reading and sharing {what} between nodes")
            token = gathered[0][4][1]
            await _run_watched(
                run_node_phase(
                    self,
                    pipeline,
                    mine,
                    [g[1] for g in gathered],
                    nodes,
                    token,
                    phase,
                    tag_base,
                    unit,
                    policy.adaptive,
                    what,
                    [g[4][1] for g in gathered],
                ),
                self.monitor,
            )
            return
        if policy.custom_plan is not None:
            # the override's whole plan, as tuples; its owners are where each rank starts
            all_needs: list[Any] = [_unpack(g[1]) for g in gathered]
            transfers, load = policy.custom_plan(all_needs)
            _check_transfers(transfers, all_needs)
            items = split_units(transfers, unit) if policy.adaptive else transfers
            scope, n, planned = "", len(items), load[self.rank]
        else:  # the default plan: only this rank's part of it, from the packed ranges as they came
            part = _rank_plan(
                [g[1] for g in gathered], self.rank, unit if policy.adaptive else None
            )
            items, n, planned = part.items, part.count, part.planned
            scope = f"c{part.component}/"  # items are numbered within the component
        self.planned_bytes.append(planned)
        shared: _SharedPipeline
        if policy.adaptive:
            keys = _unit_keys(items, self.rank)
            parts = _parts_for(mine, adv, items, self.rank, [g[1] for g in gathered])
            by_id = {id(c): p for c, p in zip(mine, parts) if p is not None}
            # own planned units first, then chunks only this rank reads, then the others' units
            rank_of = {
                id(c): min(keys[q.transfer.index] for q in p if q.transfer is not None)
                for c, p in zip(mine, parts)
                if p
            }
            order = sorted(range(len(mine)), key=lambda i: rank_of.get(id(mine[i]), (1, i, 0)))
            mine = [mine[i] for i in order]
            claims = Claims(self, policy, keys, f"u/{phase}/{scope}")
            shared = _AdaptivePipeline(pipeline, self, by_id, tag_base, len(mine), claims, policy)
        else:
            self.transport.set_order(items, self.rank)
            parts = _parts_for(mine, adv, items, self.rank, [g[1] for g in gathered])
            by_id = {id(c): p for c, p in zip(mine, parts) if p is not None}
            shared = _SharedPipeline(pipeline, self, by_id, tag_base, len(mine))
        t1 = time.monotonic()
        self._set_doing(f"reading and sharing {what}")
        await _run_watched(shared.run(mine), self.monitor)
        log.debug(
            "rank %d, %s: planned in %.3f s (barrier, all_gather, plan), %d %s, this rank "
            "planned to read %s; "
            "read and shared in %.3f s",
            self.rank,
            what,
            t1 - t0,
            n,
            "units" if policy.adaptive else "transfers",
            _fmt_bytes(planned),
            time.monotonic() - t1,
        )


async def _run_watched(coro: Awaitable[_T], monitor: Monitor) -> _T:
    """Run ``coro`` while watching for another rank's failure; its result."""
    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(monitor.watch())
            try:
                result = await coro
            finally:
                watcher.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return result
