"""The sharing planner: :class:`ShardedLoadPlanner`, a :class:`PipelinedLoadPlanner` for
multi-rank loads that reads every byte once and shares it over the process group. Its knobs
become one :class:`~asyncload.distributed.policy.SharingPolicy` when a load starts
(:func:`asyncload.distributed.share_session.open_share`); the sharing itself is
:mod:`asyncload.distributed`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch.distributed import ProcessGroup

from asyncload.common.options import LoadOptions
from asyncload.distributed import (
    SHARING_MODES,
    SIDE_GROUP_AUTO,
    BackgroundSends,
    Transfer,
    _ShareSession,
    open_share,
    plan_transfers,
    wait_for_background_sends,
)
from asyncload.engine import LoadSession, PlannerTerms
from asyncload.faces.dcp_reader import PipelinedLoadPlanner

__all__ = ["BackgroundSends", "ShardedLoadPlanner", "wait_for_background_sends"]

_UNSET: Any = object()


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

    ``adaptive`` (default ``None``: on, except for a subclass that overrides
    :meth:`plan_transfers`, whose owners are kept; with ``ordered`` or NCCL the bytes then
    travel over a gloo side group, see ``side_group``, or, with ``side_group=None``, it is
    off: they need the fixed order): hand out the shared ranges as ranks get to them instead of fixing their
    owners before reading. Shared ranges are cut into work units of at most ``unit_size``
    bytes (default: chosen per read phase from the latency and rate measured so far, as
    chunks are: 4 x latency x rate, from 256 KiB to ``chunk_size`` and at most an eighth of
    a rank's share; ``LoadStats.sharing_unit_size``); the first rank that needs a unit and has a
    free reader claims it through an atomic compare-and-set in the group's store, reads
    it and sends it to the other ranks that need it. Each rank starts with the units
    ``plan_transfers`` gave it and then takes over, from the back, units that other ranks
    have not started; a rank whose transfer is late (past the hedge delay of
    :class:`LoadOptions`, ``hedge=True``) reads it from storage itself and the first copy
    wins. ``adaptive=False``: the static plan (owners fixed before reading).

    ``wait_for_peers`` (default ``None``: ``False``, except where the bytes travel over a
    side group asyncload made because the load's group is NCCL: ``True`` there, so that an
    NCCL job ends its load as it always has, with no sends left behind; adaptive sharing
    only): whether a rank waits at the end of the load until every rank has finished.
    Without waiting a rank returns as soon
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
    ``node_id`` (default: the host name): the node this rank runs on. When the ranks sit on
    two or more nodes and some node holds several of them, every byte enters each node once
    (from storage or from one rank of another node) and is handed to the node's other ranks
    through shared memory (:mod:`asyncload.distributed.nodes`); tests pass distinct
    ``node_id`` values to simulate nodes on one host.
    ``sharing`` (default ``"auto"``): whether to share at all. Before its first read phase
    every rank tells the others its storage's kind and what it measured; they decide alike
    from a cost model (:func:`asyncload.distributed.policy.decide_sharing`): reading from an
    object store, share; from a local disk, which reads faster than the process group
    sends, every rank reads its own bytes (as :class:`PipelinedLoadPlanner` would). A
    ``plan_transfers`` override always shares. ``"always"`` / ``"never"`` override the model.
    ``LoadStats.sharing_decision`` (``"share"`` or ``"read"``) and ``sharing_reason`` say
    what was decided and why.
    ``side_group`` (default ``"auto"``): the group that carries the shared bytes when the
    load's process group matches sends to receives by order (NCCL, or ``ordered=True``), which
    adaptive sharing cannot use. ``"auto"``: a gloo group of the same ranks, made by every rank
    at once before the first read phase that shares (``dist.new_group(ranks,
    backend="gloo")``, bounded like every other wait) and kept for every later load on that
    process group; the bytes travel in host memory and are copied to CUDA destinations once,
    through the staging path. ``None``: no side group; such a group shares statically, in
    one agreed order (as before). A ``ProcessGroup`` of your own (gloo, the load's ranks in
    the same order): it carries the bytes, whatever the load's group. ``adaptive=False``
    keeps the static plan on the load's group. ``LoadStats.sharing_group`` says which group
    carried the bytes and why.
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
        wait_for_peers: bool | None = None,
        node_id: str | None = None,
        sharing: str = "auto",
        side_group: Any = SIDE_GROUP_AUTO,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sharing not in SHARING_MODES:
            raise ValueError(
                f"ShardedLoadPlanner(sharing={sharing!r}) is invalid: expected one of "
                + ", ".join(map(repr, SHARING_MODES))
            )
        if not (
            side_group is None
            or side_group == SIDE_GROUP_AUTO
            or isinstance(side_group, ProcessGroup)
        ):
            raise ValueError(
                f"ShardedLoadPlanner(side_group={side_group!r}) is invalid: expected "
                f"{SIDE_GROUP_AUTO!r}, None or a gloo ProcessGroup of the load's ranks"
            )
        if wait_for_peers is not None and not isinstance(wait_for_peers, bool):
            raise ValueError(
                f"ShardedLoadPlanner(wait_for_peers={wait_for_peers!r}) is invalid: expected a "
                "bool or None"
            )
        if adaptive is not None and not isinstance(adaptive, bool):
            raise ValueError(
                f"ShardedLoadPlanner(adaptive={adaptive!r}) is invalid: expected a bool or None"
            )
        if unit_size is not None and (
            isinstance(unit_size, bool) or not isinstance(unit_size, int) or unit_size <= 0
        ):
            raise ValueError(
                f"ShardedLoadPlanner(unit_size={unit_size!r}) is invalid: "
                "expected a positive int (bytes)"
            )
        if node_id is not None and not isinstance(node_id, str):
            raise ValueError(
                f"ShardedLoadPlanner(node_id={node_id!r}) is invalid: expected a str or None"
            )
        self.ordered = ordered
        self.adaptive = adaptive
        self.unit_size = unit_size
        self.wait_for_peers = wait_for_peers
        self.node_id = node_id
        self.sharing = sharing
        self.side_group = side_group
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
        if self._collective_timeout is _UNSET:
            return options.collective_timeout
        return self._collective_timeout

    def plan_transfers(
        self, needs: Sequence[Sequence[tuple[str, int, int]]]
    ) -> tuple[list[Transfer], list[int]]:
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

    def _load_terms(self) -> PlannerTerms:
        """:class:`PipelinedLoadPlanner`'s, with this planner's collective timeout and its
        sharing (:meth:`share_session`)."""
        return dataclasses.replace(
            super()._load_terms(),
            collective_timeout=self._load_collective_timeout,
            share=self._share_for,
        )

    def _load_collective_timeout(self, own: float | None) -> float | None:
        """:meth:`collective_timeout_for` a load whose options say ``own``."""
        return self.collective_timeout_for(
            dataclasses.replace(self.options, collective_timeout=own)
        )

    def _share_for(self, session: LoadSession) -> _ShareSession | None:
        """:meth:`share_session` with the options the load's config was resolved from (the
        face gave them to the session; this planner's own where it gave none)."""
        return self.share_session(session, session.options or self.options)

    def share_session(self, session: LoadSession, options: LoadOptions) -> _ShareSession | None:
        """The reading hook: a share session that takes over this rank's reads of the load
        ``session``, or None when there is nobody to share with (no process group, or a
        group of one). ``session`` was made with its process group and monitor."""
        share = open_share(
            session,
            process_group=self.process_group,
            collective_timeout=self.collective_timeout_for(options),
            ordered=self.ordered,
            adaptive=self.adaptive,
            unit_size=self.unit_size,
            wait_for_peers=self.wait_for_peers,
            custom_plan=self.plan_transfers if self._custom_plan() else None,
            node_id=self.node_id,
            sharing=self.sharing,
            side_group=self.side_group,
        )
        if share is not None:
            self.background_sends = share.sends
        return share
