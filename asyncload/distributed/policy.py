"""How a multi-rank load shares bytes, decided once: :class:`SharingPolicy`, made by
:func:`sharing_policy` from a ``ShardedLoadPlanner``'s knobs, the load's options and the
process group's backend. Everything in :mod:`asyncload.distributed` reads the policy, never
the planner's attributes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncload._errors import AsyncLoadError
from asyncload._options import HedgePolicy, LoadOptions

__all__ = ["UNIT_SIZE", "PlanFn", "SharingPolicy", "sharing_policy"]

#: Default size of a work unit of adaptive sharing (``ShardedLoadPlanner(unit_size=...)``).
UNIT_SIZE = 256 << 10

#: A ``plan_transfers`` override: all ranks' needs -> (transfers, bytes each rank reads).
PlanFn = Callable[[Sequence[Sequence[tuple[str, int, int]]]], tuple[list[Any], list[int]]]


@dataclass(frozen=True, kw_only=True)
class SharingPolicy:
    """What a sharded load does, resolved: the transport's order, static or adaptive
    sharing, the work unit, how the load ends, and the limits the sharing code uses."""

    #: ``"thread"`` (gloo and other CPU backends: waits in a thread) or ``"poll"`` (NCCL).
    transport: str
    #: Transfers between two ranks issued in one agreed order on both sides.
    ordered: bool
    #: Units claimed as ranks get to them (else the static plan, owners fixed before reading).
    adaptive: bool
    #: ``unit_size`` as given (None: :meth:`unit_for` derives it from the chunk size).
    unit_size: int | None
    #: Returning before the peers (adaptive sharing, ``wait_for_peers=False``, CPU transport):
    #: sends from private copies that may outlive the load (``BackgroundSends``).
    returns_early: bool
    #: The monitor's bound on a rank without progress, seconds (None: none).
    collective_timeout: float | None
    #: A ``plan_transfers`` override whose owners are kept (None: the default plan).
    custom_plan: PlanFn | None
    #: Hedging of late transfers: the storage reads' policy, its floor explicit (the floor of
    #: a transfer is ``hedge_min_delay`` or its default, never derived from the link).
    hedge: HedgePolicy
    #: Unit reads in flight at once on this rank (claims hold one each).
    claim_slots: int
    #: Bytes of send copies allowed at once (the memory plan's ``sends`` share: one
    #: ``memory_budget``).
    send_budget: int

    def unit_for(self, chunk_size: int) -> int:
        """The work unit for reads of at most ``chunk_size`` bytes (the pipeline's, which CUDA
        staging may make smaller than the options')."""
        return self.unit_size or min(UNIT_SIZE, chunk_size)


def sharing_policy(
    options: LoadOptions,
    *,
    transport: str,
    ordered: bool | None,
    adaptive: bool | None,
    unit_size: int | None,
    wait_for_peers: bool,
    collective_timeout: float | None,
    custom_plan: PlanFn | None = None,
    send_budget: int | None = None,
) -> SharingPolicy:
    """The one place a sharded load's knobs are resolved (see ``ShardedLoadPlanner``).

    Raised: ``AsyncLoadError`` for ``adaptive=True`` with ordered transfers (NCCL, or
    ``ordered=True``), which cannot match units claimed in any order."""
    is_ordered = transport == "poll" if ordered is None else ordered
    if adaptive is None:  # a custom plan keeps its owners unless adaptive=True was asked for
        adaptive = False if custom_plan is not None else not is_ordered
    if adaptive and is_ordered:
        raise AsyncLoadError(
            "ShardedLoadPlanner(adaptive=True) cannot run with ordered transfers (ordered=True, "
            "or NCCL): pass adaptive=False"
        )
    return SharingPolicy(
        transport=transport,
        ordered=is_ordered,
        adaptive=adaptive,
        unit_size=unit_size,
        returns_early=adaptive and not wait_for_peers and transport == "thread",
        collective_timeout=collective_timeout,
        custom_plan=custom_plan,
        hedge=dataclasses.replace(options.hedge_policy, derived=False),
        claim_slots=max(2, min(16, options.initial_concurrency // 2)),
        send_budget=options.memory_budget if send_budget is None else send_budget,
    )
