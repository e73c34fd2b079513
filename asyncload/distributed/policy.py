"""How a multi-rank load shares bytes, decided once: :class:`SharingPolicy`, made by
:func:`sharing_policy` from a ``ShardedLoadPlanner``'s knobs, the load's options and the
process group's backend. Everything in :mod:`asyncload.distributed` reads the policy, never
the planner's attributes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncload.common.errors import AsyncLoadError
from asyncload.common.latency import percentile
from asyncload.common.options import HedgePolicy
from asyncload.engine import (
    LOCAL_BANDWIDTH,
    LOCAL_REQUEST_SECONDS,
    REMOTE_BANDWIDTH,
    REMOTE_REQUEST_SECONDS,
    LoadConfig,
)

__all__ = [
    "SHARING_MODES",
    "SIDE_GROUP_AUTO",
    "UNIT_SIZE",
    "PlanFn",
    "RankEstimate",
    "SharingDecision",
    "SharingPolicy",
    "decide_sharing",
    "sharing_policy",
]

#: The smallest work unit of adaptive sharing chosen by default
#: (``ShardedLoadPlanner(unit_size=...)`` given explicitly is kept as it is).
UNIT_SIZE = 256 << 10
#: ``ShardedLoadPlanner(sharing=...)``: decide from the cost model, always share, never share.
SHARING_MODES = ("auto", "always", "never")
#: ``ShardedLoadPlanner(side_group=...)``: make a gloo side group of the load's ranks when the
#: load's group matches sends by order (NCCL) and the sharing is adaptive
#: (:mod:`asyncload.distributed.side_group`); ``None``: never; a group: that one.
SIDE_GROUP_AUTO = "auto"

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
    #: ``unit_size`` as given (None: :func:`decide_sharing` derives it from the measured
    #: latency and rate).
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
    #: ``ShardedLoadPlanner(sharing=...)``: ``"auto"`` (:func:`decide_sharing`'s cost model),
    #: ``"always"`` or ``"never"``.
    sharing: str = "auto"
    #: Which group carries the shared bytes: ``"main"`` (the load's process group) or
    #: ``"side"`` (a gloo group of the same ranks: the user's, :attr:`side_group`, or made by
    #: :func:`asyncload.distributed.side_group.make_side_group` when it is None).
    carrier: str = "main"
    #: The side group given as ``ShardedLoadPlanner(side_group=<group>)``, or None.
    side_group: Any = None
    #: ``LoadStats.sharing_group``: the carrier and why.
    carrier_reason: str = ""


def sharing_policy(
    config: LoadConfig,
    *,
    transport: str,
    ordered: bool | None,
    adaptive: bool | None,
    unit_size: int | None,
    wait_for_peers: bool | None,
    collective_timeout: float | None,
    custom_plan: PlanFn | None = None,
    send_budget: int | None = None,
    sharing: str = "auto",
    side_group: Any = None,
    backend: str = "",
) -> SharingPolicy:
    """The one place a sharded load's knobs are resolved (see ``ShardedLoadPlanner``).

    ``transport``: the load's process group's (``"poll"``: NCCL); ``backend``: its name, for
    the words of ``carrier_reason``. ``side_group``: ``"auto"`` (adaptive sharing on a group
    that matches sends by order moves the bytes over a gloo side group of the same ranks),
    ``None`` (never: such a group shares statically) or the user's own gloo group (it carries
    the bytes, adaptively by default).

    Raised: ``AsyncLoadError`` for ``adaptive=True`` with ordered transfers (NCCL, or
    ``ordered=True``) and no side group, which cannot match units claimed in any order."""
    main_ordered = transport == "poll" if ordered is None else ordered
    wants_adaptive = adaptive if adaptive is not None else custom_plan is None
    on = f" ({backend})" if backend else ""
    why_ordered = (
        "ordered=True" if ordered else f"its backend{on} matches sends to receives by order"
    )
    side_given = None
    if side_group is not None and not isinstance(side_group, str):
        carrier, side_given = "side", side_group
        reason = "side: the gloo group given as ShardedLoadPlanner(side_group=...)"
    elif side_group == SIDE_GROUP_AUTO and main_ordered and wants_adaptive:
        carrier = "side"
        reason = (
            f"side: the load's process group cannot share adaptively ({why_ordered}), so the "
            "bytes travel over a gloo group of the same ranks (side_group='auto')"
        )
    elif main_ordered:
        carrier = "main"
        knob = "side_group=None" if side_group is None else "adaptive=False"
        reason = f"main: static sharing in one agreed order ({why_ordered}; {knob})"
    else:
        carrier = "main"
        reason = f"main: the load's process group{on} matches sends to receives by tag"
    made_side = carrier == "side" and side_given is None
    if carrier == "side":  # gloo: tags match in any order, waits on a thread
        transport, is_ordered = "thread", False
    else:
        is_ordered = main_ordered
    if adaptive is None:  # a custom plan keeps its owners unless adaptive=True was asked for
        adaptive = False if custom_plan is not None else not is_ordered
    if adaptive and is_ordered:
        raise AsyncLoadError(
            "ShardedLoadPlanner(adaptive=True) cannot run with ordered transfers (ordered=True, "
            "or NCCL) without a side group: pass adaptive=False, or side_group='auto' (a gloo "
            "group of the same ranks carries the bytes)"
        )
    return SharingPolicy(
        transport=transport,
        ordered=is_ordered,
        adaptive=adaptive,
        unit_size=unit_size,
        # wait_for_peers=None: a side group asyncload made (the job's group is NCCL) waits,
        # so that an NCCL job's load ends as it did before the side group: no sends left
        returns_early=adaptive
        and transport == "thread"
        and not (wait_for_peers if wait_for_peers is not None else made_side),
        collective_timeout=collective_timeout,
        custom_plan=custom_plan,
        hedge=dataclasses.replace(config.hedge, derived=False),
        claim_slots=max(2, min(16, config.concurrency.initial // 2)),
        send_budget=config.memory.budget if send_budget is None else send_budget,
        sharing=sharing,
        carrier=carrier,
        side_group=side_given,
        carrier_reason=reason,
    )


# --- whether sharing pays, and the work unit: the cost model ----------------------------------

#: Bytes per second a rank receives over the process group's transport (gloo on the loopback of
#: a 2-core host: 1.0-1.2 GiB/s for messages of 4-16 MiB, 0.45 GiB/s for 256 KiB; about the same
#: as a 10 GbE link). docs/distributed.md ("when sharing pays").
TRANSPORT_RATE = 1 << 30
#: Bytes per second one rank reads from its storage, as the model assumes: a local file (warm
#: page cache: 4-10 GiB/s measured here) and an object store (four streams at the engine's
#: assumed per-stream rate, :data:`asyncload.engine.cost.REMOTE_BANDWIDTH`).
LOCAL_RATE = LOCAL_BANDWIDTH
REMOTE_RATE = 4 * REMOTE_BANDWIDTH
#: Sharing is chosen when the model says it takes less than the reads alone divided by this
#: (it costs two collectives per phase, a claim per unit and the copies of the sends).
SHARE_MARGIN = 1.25
#: A work unit carries this many times the bytes one request's latency costs at the stream's
#: rate (the engine's break-even gap, :func:`asyncload.engine.plan.break_even_gap`), so that
#: the latency of a unit's own request costs at most a fifth of its time ...
UNIT_LATENCIES = 4
#: ... and is no larger than a share of this many units per rank, so that ranks of different
#: speeds can still even out.
MIN_UNITS_PER_RANK = 8
#: ``sharing="auto"``: a read phase whose largest need is smaller is read by every rank alone
#: (record headers: a few KiB a record): the bytes saved cost less than its claims' round trips.
MIN_SHARED_BYTES = 4 << 20


@dataclass(frozen=True)
class RankEstimate:
    """What one rank tells the others before a read phase (all-gathered with its needs): its
    storage's kind, the latency and per-stream rate measured so far (None: not yet), and the
    bytes it needs in the phase. Every rank decides from the same gathered estimates."""

    remote: bool
    latency: float | None
    stream_rate: float | None
    need: int

    @classmethod
    def measure(cls, storage: Any, need: int) -> RankEstimate:
        """This rank's estimate: ``storage`` is the load's ``RetryingStorage`` (its clock)."""
        clock = getattr(storage, "clock", None)
        latency = rate = None
        if clock is not None:
            latency = clock.first_byte_time(0.5)
            rate = percentile(sorted(clock.stream_rates), 0.5)
        return cls(bool(getattr(storage, "hedgeable", False)), latency, rate, need)


@dataclass(frozen=True)
class SharingDecision:
    """What a read phase does (:func:`decide_sharing`): share or read, the work unit (0: the
    load shares, but this phase is read by every rank alone), and why
    (``LoadStats.sharing_decision``, ``sharing_reason``, ``sharing_unit_size``)."""

    share: bool
    unit_size: int
    #: What this phase does and why (``LoadStats.sharing_reason``) ...
    reason: str
    #: ... and why the load shares or reads (carried to the next phase).
    why: str


def _rate_of(e: RankEstimate) -> float:
    return REMOTE_RATE if e.remote else LOCAL_RATE


def decide_sharing(
    policy: SharingPolicy,
    estimates: Sequence[RankEstimate],
    chunk_size: int,
    *,
    share: bool | None = None,
    why: str = "",
) -> SharingDecision:
    """Whether sharing pays, and the work unit, from every rank's :class:`RankEstimate`
    (the same on every rank: pure). ``share``: already decided (by an earlier phase, for
    the reason ``why``); a first phase where no rank needs a byte leaves the decision to the
    next (its ``why`` is empty).

    The model: ``N`` the most bytes a rank needs, ``W`` ranks, ``S`` a rank's storage rate
    (:data:`LOCAL_RATE`, :data:`REMOTE_RATE`), ``G`` the transport's (:data:`TRANSPORT_RATE`).
    Reading alone takes ``N / S``; sharing at worst (every byte shared) ``N / (W S) + N (W - 1)
    / (W G)``. Sharing is chosen when it is :data:`SHARE_MARGIN` times faster: an object store
    (256 MiB/s a rank) shares, a local disk (4 GiB/s, faster than gloo) reads.

    The unit (adaptive sharing, ``unit_size`` not given): :data:`UNIT_LATENCIES` x the latency
    (the slowest rank's median first byte) x the per-stream rate (the ranks' median), both
    measured where known, else the engine's assumptions for the storage kind; at least
    :data:`UNIT_SIZE`, at most ``chunk_size`` and ``N / (W x MIN_UNITS_PER_RANK)``. With
    ``"auto"``, a phase under :data:`MIN_SHARED_BYTES` a rank is read alone (unit 0)."""
    world = max(1, len(estimates))
    need = max((e.need for e in estimates), default=0)
    unit, unit_why = _unit(policy, estimates, chunk_size, need, world)
    read_s = max((e.need / _rate_of(e) for e in estimates), default=0.0)
    share_s = (
        max(
            (e.need / world / _rate_of(e) + e.need * (world - 1) / world / TRANSPORT_RATE)
            for e in estimates
        )
        if estimates
        else 0.0
    )
    kinds = sorted({"object store" if e.remote else "local file" for e in estimates})
    model = (
        f"{' and '.join(kinds)} at {_fmt_rate(min(map(_rate_of, estimates), default=LOCAL_RATE))}"
        f" a rank, the process group at {_fmt_rate(TRANSPORT_RATE)}: reading alone "
        f"{read_s:.3f} s, sharing {share_s:.3f} s (modelled)"
    )
    if share is None and not need:  # nothing to read: the next phase decides
        return SharingDecision(True, 0, "share: nothing to read in this phase", "")
    if share is not None:
        why = why or "decided before the first read phase"
    elif policy.sharing != "auto":
        share, why = policy.sharing == "always", f"ShardedLoadPlanner(sharing={policy.sharing!r})"
    elif policy.custom_plan is not None:
        share, why = True, "plan_transfers is overridden"
    else:
        share = share_s * SHARE_MARGIN < read_s
        why = model
    if not share:
        return SharingDecision(False, unit, f"read: {why}", why)
    if policy.sharing == "auto" and policy.custom_plan is None and need < MIN_SHARED_BYTES:
        # this phase only: the load still shares (a later phase decides again)
        return SharingDecision(
            True,
            0,
            f"share, but not this phase: at most {need} bytes a rank, under {MIN_SHARED_BYTES}",
            why,
        )
    return SharingDecision(True, unit, f"share: {why}; {unit_why}", why)


def _unit(
    policy: SharingPolicy,
    estimates: Sequence[RankEstimate],
    chunk_size: int,
    need: int,
    world: int,
) -> tuple[int, str]:
    if policy.unit_size is not None:
        return policy.unit_size, f"unit {policy.unit_size} bytes (given)"
    if not policy.adaptive:
        return min(UNIT_SIZE, chunk_size), "static plan"
    remote = any(e.remote for e in estimates)
    latencies = [e.latency for e in estimates if e.latency is not None]
    rates = sorted(e.stream_rate for e in estimates if e.stream_rate is not None)
    latency = (
        max(latencies)
        if latencies
        else REMOTE_REQUEST_SECONDS
        if remote
        else LOCAL_REQUEST_SECONDS
    )
    rate = rates[len(rates) // 2] if rates else REMOTE_BANDWIDTH if remote else LOCAL_BANDWIDTH
    model = int(UNIT_LATENCIES * latency * rate)
    cap = need // (world * MIN_UNITS_PER_RANK)
    unit = min(chunk_size, max(UNIT_SIZE, min(model, cap)))
    unit = max(1, unit - unit % 4096 if unit > 4096 else unit)
    return unit, (
        f"unit {unit} bytes ({UNIT_LATENCIES} x {latency * 1e3:.1f} ms x {_fmt_rate(rate)}"
        f"{', measured' if latencies else ', assumed'}; at most {MIN_UNITS_PER_RANK} units "
        f"a rank's share, {UNIT_SIZE} to chunk_size {chunk_size})"
    )


def _fmt_rate(rate: float) -> str:
    return f"{rate / (1 << 30):.2f} GiB/s" if rate >= 1 << 30 else f"{rate / (1 << 20):.0f} MiB/s"
