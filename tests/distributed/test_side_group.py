"""Adaptive sharing for groups that match sends by order (issue 29, item 7): with NCCL the
load's group cannot match units claimed in any order, so ``ShardedLoadPlanner``
(``side_group="auto"``) moves the shared bytes over a gloo group of the same ranks, made once
per process group and reused, in host memory, copied once to CUDA destinations.

There is no GPU here: the tests run on gloo process groups of 2 to 4 processes
(``tests/_dist.py``) and simulate NCCL's order matching as the static path's tests do,
with ``ordered=True`` (the load's group is treated as order-matched); CUDA destinations go
through the very same staging path with :func:`asyncload.testing.fake_device`. Each rank
counts, with a spy on ``torch.distributed``, the point-to-point bytes it moved over each group
and the groups it made, so "the side group carried the bytes" and "made once" are observed,
not inferred. Everything loaded is compared bit for bit; no test asserts a timing.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import (
    _dtensors,
    _mesh,
    big_model,
    same_bits,
    save_single,
    stats_dict,
    tensor_bytes,
)

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.distributed.policy import sharing_policy
from asyncload.distributed.share_plan import plan_transfers
from asyncload.engine import resolve_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10
OPTIONS = LoadOptions(
    chunk_size=64 * KiB, min_chunk_size=16 * KiB, memory_budget=512 * KiB, collective_timeout=20.0
)


# --- a spy on torch.distributed (in the rank's own process) ---------------------------------------


def _spy() -> dict[str, Any]:
    """Count, from now on in this process: ``dist.new_group`` calls for gloo groups, and the
    bytes of point-to-point sends and receives per group (``"main"``: the default group)."""
    seen: dict[str, Any] = {"gloo_groups": 0, "sent": Counter(), "received": Counter()}
    real_new_group, real_isend, real_irecv = dist.new_group, dist.isend, dist.irecv

    def name(group: Any) -> str:
        pg = group if group is not None else dist.group.WORLD
        return "main" if pg is dist.group.WORLD else "other"

    def new_group(*args: Any, **kw: Any) -> Any:
        if kw.get("backend") == "gloo":
            seen["gloo_groups"] += 1
        return real_new_group(*args, **kw)

    def isend(tensor: torch.Tensor, *args: Any, group: Any = None, **kw: Any) -> Any:
        seen["sent"][name(group)] += tensor.numel()
        return real_isend(tensor, *args, group=group, **kw)

    def irecv(tensor: torch.Tensor, *args: Any, group: Any = None, **kw: Any) -> Any:
        seen["received"][name(group)] += tensor.numel()
        return real_irecv(tensor, *args, group=group, **kw)

    dist.new_group, dist.isend, dist.irecv = new_group, isend, irecv  # type: ignore[assignment]
    return seen


def _moved(seen: dict[str, Any], before: dict[str, int]) -> dict[str, int]:
    now = {
        "gloo_groups": seen["gloo_groups"],
        **{f"sent_{k}": v for k, v in seen["sent"].items()},
        **{f"received_{k}": v for k, v in seen["received"].items()},
    }
    keys = set(now) | set(before)
    return {k: now.get(k, 0) - before.get(k, 0) for k in keys}


def _snapshot(seen: dict[str, Any]) -> dict[str, int]:
    return _moved(seen, {})


# --- workers -------------------------------------------------------------------------------------


def w_side(
    rank: int,
    world: int,
    path: str,
    layout: str,
    loads: int,
    options: LoadOptions,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``loads`` loads in a row with ``ShardedLoadPlanner(ordered=True)`` (the load's group
    treated as order-matched, as NCCL's is). ``layout``: ``replicated`` (plain tensors saved
    by one process) or ``sharded`` (the ranks save DTensors ``Shard(0)`` with ``dcp.save``
    here, then load them replicated: every rank needs every byte). ``extra``:
    ``side_group`` (default ``"auto"``); ``fake``: destinations on the fake device (the CUDA
    staging path); ``slow=(rank, s)``: that rank's progress callback sleeps ``s`` at every
    chunk (a busy host); ``own_group``: pass a gloo group made here as ``side_group``;
    ``static_too``: one more load with ``side_group=None`` (the static plan on the load's
    group) at the end; ``ranks_per_node``: simulated nodes (``node_id``)."""
    extra = extra or {}
    side_group = extra.get("side_group", "auto")
    fake, slow = extra.get("fake", False), extra.get("slow")
    static_too = extra.get("static_too", False)
    per_node = extra.get("ranks_per_node")
    full = big_model()
    mesh = _mesh((world,)) if layout == "sharded" else None
    if layout == "sharded":
        dcp.save(_dtensors(full, mesh, "S0", zeros=False), checkpoint_id=path)
    group: Any = side_group
    if extra.get("own_group"):
        group = dist.new_group(list(range(world)), backend="gloo")
    seen = _spy()
    out: list[dict[str, Any]] = []
    for n in range(loads + static_too):
        if mesh is not None:
            sd: dict[str, Any] = _dtensors(full, mesh, "R", zeros=True)
        else:
            sd = {k: torch.zeros_like(v) for k, v in full.items()}

        def progress(done: int, total: int) -> None:
            if slow is not None and rank == slow[0]:
                time.sleep(slow[1])

        planner = ShardedLoadPlanner(
            sharing="always",
            ordered=True,
            unit_size=16 * KiB,
            side_group=group if n < loads else None,
            wait_for_peers=extra.get("wait_for_peers", False),
            node_id=None if per_node is None else f"node{rank // per_node}",
        )
        before = _snapshot(seen)
        device: dict[str, int] = {}
        with contextlib.ExitStack() as stack:
            if fake:
                from asyncload.testing import fake_device

                dev = stack.enter_context(fake_device())
            stats = asyncload.load(sd, path, options=options, planner=planner, progress=progress)
            if fake:
                device = {
                    "bytes_copied": dev.bytes_copied,
                    "pageable_sources": dev.pageable_sources,
                    "pinned_bytes": dev.pinned_bytes,
                }
        got = {k: (v.full_tensor() if mesh is not None else v) for k, v in sd.items()}
        out.append(
            {
                "bad": [k for k in full if not same_bits(got[k], full[k])],
                "stats": {**stats_dict(stats), "own_node": stats.bytes_from_own_node},
                "sharing_group": stats.sharing_group,
                "unit": stats.sharing_unit_size,
                "moved": _moved(seen, before),
                "device": device,
            }
        )
    asyncload.ShardedLoadPlanner.wait_for_background_sends(30.0)
    return out


def _check(
    values: list[list[dict[str, Any]]], n: int, total: int, static: int | None = None
) -> None:
    """Load ``n`` on every rank: bit for bit; every byte a rank did not read it received;
    every byte sent was received; every shared unit read once (hedges aside: as many bytes
    as the static plan reads, ``static``, when given); every point-to-point byte went over
    the side group, none over the load's group."""
    loads = [v[n] for v in values]
    for rank, v in enumerate(loads):
        assert v["bad"] == [], (rank, n)
        st = v["stats"]
        assert st["bytes_assembled"] == total
        assert st["bytes_read"] + st["bytes_received"] + st["own_node"] >= total, (rank, st)
        assert v["sharing_group"].startswith("side: "), v["sharing_group"]
        assert v["unit"] == 16 * KiB
        moved = v["moved"]
        assert moved.get("sent_main", 0) == 0 and moved.get("received_main", 0) == 0, moved
        assert moved.get("sent_other", 0) == st["bytes_sent"], (moved, st)
        assert moved.get("received_other", 0) == st["bytes_received"], (moved, st)
    sent = sum(v["stats"]["bytes_sent"] for v in loads)
    assert sent == sum(v["stats"]["bytes_received"] for v in loads) > 0
    once = sum(v["stats"]["bytes_read"] - v["stats"]["bytes_hedged"] for v in loads)
    if static is not None:
        assert once == static, (once, static)
    else:
        assert total <= once <= 1.05 * total, once


# --- the side group carries adaptive sharing -----------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_an_order_matched_group_shares_adaptively_over_a_side_group(
    tmp_path: Path, world: int
) -> None:
    """Replicated checkpoint, two loads in a row: the first makes the gloo side group (one
    ``new_group`` per rank), the second reuses it (none); in both, every byte between ranks
    went over it, units were claimed (adaptive: the unit size is set), bit for bit."""
    save_single(tmp_path / "ck", big_model())
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_side, world, str(tmp_path / "ck"), "replicated", 2, OPTIONS))
    for n in (0, 1):
        _check(values, n, total)
    for v in values:
        first, second = v
        assert first["moved"]["gloo_groups"] == 1, first["moved"]
        assert second["moved"]["gloo_groups"] == 0, second["moved"]
        assert first["sharing_group"].endswith("the side group was made for this load")
        assert second["sharing_group"].endswith(
            "the side group was made by an earlier load on this group, reused"
        )
        assert "ordered=True" in first["sharing_group"]


def test_a_checkpoint_saved_sharded_by_the_ranks(tmp_path: Path) -> None:
    """3 ranks save DTensors (``Shard(0)``) with ``dcp.save`` and load them replicated: the
    shared bytes go over the side group, bit for bit, and the ranks read exactly the bytes
    the static plan reads (one more load, ``side_group=None``)."""
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_side, 3, str(tmp_path / "ck"), "sharded", 1, OPTIONS, {"static_too": True})
    )
    static = [v[1] for v in values]
    assert all(s["bad"] == [] and s["sharing_group"].startswith("main: ") for s in static)
    _check(values, 0, total, sum(s["stats"]["bytes_read"] for s in static))


def test_cuda_destinations_get_one_host_to_device_copy(tmp_path: Path) -> None:
    """Destinations on the (fake) device: the bytes a rank received over the side group
    reach the device through the staging path like those it read, each byte copied to the
    device exactly once, always from pinned memory, nothing left pinned."""
    save_single(tmp_path / "ck", big_model())
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_side, 2, str(tmp_path / "ck"), "replicated", 1, OPTIONS, {"fake": True})
    )
    _check(values, 0, total)
    for v in values:
        assert v[0]["stats"]["bytes_received"] > 0
        assert v[0]["device"] == {"bytes_copied": total, "pageable_sources": 0, "pinned_bytes": 0}


def test_without_a_side_group_the_group_shares_statically(tmp_path: Path) -> None:
    """``side_group=None``: the behaviour before (NCCL's static, ordered sharing), its bytes
    over the load's own group, no group made, no units."""
    save_single(tmp_path / "ck", big_model())
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_side, 2, str(tmp_path / "ck"), "replicated", 1, OPTIONS, {"side_group": None})
    )
    for v in values:
        load = v[0]
        assert load["bad"] == []
        assert load["unit"] == 0
        assert load["moved"]["gloo_groups"] == 0
        assert load["moved"].get("sent_other", 0) == 0
        assert load["moved"].get("received_main", 0) == load["stats"]["bytes_received"] > 0
        assert load["sharing_group"].startswith("main: static sharing in one agreed order")
    assert total <= sum(v[0]["stats"]["bytes_read"] for v in values) <= 1.05 * total


def test_a_side_group_of_the_users_own(tmp_path: Path) -> None:
    """A gloo group the user made carries the bytes; asyncload makes none."""
    save_single(tmp_path / "ck", big_model())
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(
            w_side,
            2,
            str(tmp_path / "ck"),
            "replicated",
            1,
            OPTIONS,
            {"side_group": None, "own_group": True},
        )
    )
    _check(values, 0, total)
    for v in values:
        assert v[0]["moved"]["gloo_groups"] == 0
        assert v[0]["sharing_group"].startswith("side: the gloo group given")


def test_a_slow_host_takes_fewer_units_over_the_side_group(tmp_path: Path) -> None:
    """Rank 2's event loop stalls 30 ms at every chunk (a busy host, as in
    test_adaptive_sharing): claims over the side group still hand it less than the quarter
    the plan gave it, and less than the others on average."""
    save_single(tmp_path / "ck", big_model())
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(
            w_side,
            4,
            str(tmp_path / "ck"),
            "replicated",
            1,
            OPTIONS,
            {"slow": (2, 0.03)},
            timeout=90,
        )
    )
    _check(values, 0, total)
    once = [v[0]["stats"]["bytes_read"] - v[0]["stats"]["bytes_hedged"] for v in values]
    assert once[2] < total / 4, once
    assert once[2] < sum(once[r] for r in (0, 1, 3)) / 3, once
    assert sum(v[0]["stats"]["bytes_taken_over"] for v in values) > 0


def test_node_aware_sharing_over_the_side_group(tmp_path: Path) -> None:
    """4 ranks as 2 simulated nodes of 2 (``node_id``): every byte enters each node once,
    the bytes between nodes over the side group, bit for bit."""
    save_single(tmp_path / "ck", big_model())
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(
            w_side,
            4,
            str(tmp_path / "ck"),
            "replicated",
            1,
            OPTIONS,
            {"ranks_per_node": 2, "wait_for_peers": True},
            timeout=90,
        )
    )
    _check(values, 0, total)
    intake = []
    for node in (0, 1):
        mine = [values[r][0]["stats"] for r in (2 * node, 2 * node + 1)]
        # every byte enters the node once: from storage or from the other node (over the side
        # group: _check); each rank took from its node peer what it did not fetch itself
        intake.append(sum(s["bytes_read"] + s["bytes_received"] for s in mine))
        assert all(s["own_node"] > 0 for s in mine), mine
    assert intake[0] == intake[1] and total <= intake[0] <= 1.05 * total, intake


# --- failures ------------------------------------------------------------------------------------


def w_fail(rank: int, world: int, path: str, victim: int, mode: str) -> dict[str, Any]:
    """``victim`` raises (``raise``) or dies (``die``) from its progress callback once a third
    of its bytes landed, during the data phase shared over the side group."""
    import os

    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}

    def progress(done: int, total: int) -> None:
        if rank == victim and done >= total // 3:
            if mode == "die":
                os._exit(3)
            raise RuntimeError(f"injected failure on rank {rank}")

    planner = ShardedLoadPlanner(
        sharing="always", ordered=True, unit_size=16 * KiB, wait_for_peers=True
    )
    options = OPTIONS.replace(collective_timeout=4.0, concurrency=4)
    asyncload.load(sd, path, options=options, planner=planner, progress=progress)
    return {"bad": [k for k in full if not same_bits(sd[k], full[k])]}


@pytest.mark.parametrize("mode", ["raise", "die"])
def test_a_failure_on_one_rank_fails_every_rank(tmp_path: Path, mode: str) -> None:
    """Rank 1 raises (or dies) while the ranks share over the side group
    (``wait_for_peers=True``: nobody returns before the others): every other rank raises
    DistributedLoadError naming rank 1, within the bounds of the monitor."""
    save_single(tmp_path / "ck", big_model())
    results = run_ranks(w_fail, 4, str(tmp_path / "ck"), 1, mode, timeout=40)
    victim = results[1]
    if mode == "raise":
        assert victim.status == "error" and victim.message == "injected failure on rank 1"
    else:
        assert victim.status != "ok"
    for r in (results[0], results[2], results[3]):
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.rank,
            r.status,
            r.message,
            r.traceback,
        )
        assert "AsyncLoadError" in r.error_types
        assert r.attrs["rank"] == 1, r.message
        if mode == "raise":
            assert "RuntimeError: injected failure on rank 1" in r.message


def w_stuck_creation(rank: int, world: int, path: str, victim: int) -> None:
    """``victim``'s part of ``dist.new_group`` never returns (as when gloo cannot connect two
    ranks): the others wait in the group's rendezvous for it."""
    if rank == victim:
        real = dist.new_group

        def stuck(*args: Any, **kw: Any) -> Any:
            if kw.get("backend") == "gloo":
                time.sleep(3600)
            return real(*args, **kw)

        dist.new_group = stuck  # type: ignore[assignment]
    sd = {k: torch.zeros_like(v) for k, v in big_model().items()}
    planner = ShardedLoadPlanner(sharing="always", ordered=True, unit_size=16 * KiB)
    asyncload.load(sd, path, options=OPTIONS.replace(collective_timeout=3.0), planner=planner)


def test_a_side_group_that_cannot_be_made_fails_every_rank_in_bounded_time(
    tmp_path: Path,
) -> None:
    """Every rank arrived, but the group's creation never completes on rank 1: every rank
    raises DistributedLoadError within about collective_timeout (3 s), none waits for gloo's
    own timeout."""
    save_single(tmp_path / "ck", big_model())
    results = run_ranks(w_stuck_creation, 3, str(tmp_path / "ck"), 1, timeout=40)
    for r in results:
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.rank,
            r.status,
            r.message,
        )
        assert "gloo" in r.message and "side group" in r.message, r.message
        assert r.seconds < 20, r.seconds


def w_bad_side_group(rank: int, world: int, path: str) -> None:
    """A gloo group of the load's ranks in another order: refused on every rank."""
    side = dist.new_group(list(reversed(range(world))), backend="gloo", sort_ranks=False)
    sd = {k: torch.zeros_like(v) for k, v in big_model().items()}
    asyncload.load(sd, path, options=OPTIONS, planner=ShardedLoadPlanner(side_group=side))


def test_a_side_group_of_other_ranks_is_refused(tmp_path: Path) -> None:
    save_single(tmp_path / "ck", big_model())
    results = run_ranks(w_bad_side_group, 2, str(tmp_path / "ck"), timeout=40)
    for r in results:
        assert r.status == "error" and r.error_type == "AsyncLoadError", (r.rank, r.message)
        assert "the same ranks in the same order" in r.message, r.message


# --- the knobs (pure) ----------------------------------------------------------------------------


def _policy(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "transport": "poll",
        "ordered": None,
        "adaptive": None,
        "unit_size": None,
        "wait_for_peers": False,
        "collective_timeout": 5.0,
        "side_group": "auto",
        "backend": "nccl",
    }
    args.update(kw)
    return sharing_policy(resolve_config(LoadOptions()), **args)


def test_the_side_group_is_chosen_when_the_group_matches_by_order() -> None:
    auto = _policy()
    assert (auto.carrier, auto.adaptive, auto.ordered, auto.transport) == (
        "side",
        True,
        False,
        "thread",
    )
    assert auto.returns_early and auto.side_group is None
    # wait_for_peers=None (the default): a side group asyncload made waits for every rank
    # (an NCCL job's load ends as it did before, no sends left behind); elsewhere it does not
    assert not _policy(wait_for_peers=None).returns_early
    assert _policy(wait_for_peers=None, transport="thread", backend="gloo").returns_early
    assert auto.carrier_reason.startswith("side: the load's process group cannot share")
    assert "(nccl) matches sends to receives by order" in auto.carrier_reason
    # gloo matches by tag: no side group
    gloo = _policy(transport="thread", backend="gloo")
    assert (gloo.carrier, gloo.adaptive) == ("main", True)
    assert (
        gloo.carrier_reason
        == "main: the load's process group (gloo) matches sends to receives by tag"
    )
    # ordered=True on gloo stands for NCCL (how the tests simulate it)
    simulated = _policy(transport="thread", backend="gloo", ordered=True)
    assert simulated.carrier == "side" and "ordered=True" in simulated.carrier_reason
    # the static plan stays on the load's group, ordered
    for static in (
        _policy(adaptive=False),
        _policy(side_group=None),
        _policy(custom_plan=plan_transfers),
    ):
        assert (static.carrier, static.adaptive, static.ordered, static.transport) == (
            "main",
            False,
            True,
            "poll",
        )
    assert _policy(side_group=None).carrier_reason.endswith("side_group=None)")
    # a custom plan that asks for adaptive claims gets them over the side group
    assert _policy(custom_plan=plan_transfers, adaptive=True).carrier == "side"
    # a group of the user's carries the bytes whatever the load's group
    mine = object()
    given = _policy(transport="thread", backend="gloo", side_group=mine)
    assert (given.carrier, given.side_group, given.adaptive) == ("side", mine, True)
    with pytest.raises(asyncload.AsyncLoadError, match="without a side group"):
        _policy(side_group=None, adaptive=True)


def test_side_group_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="side_group='gloo'"):
        ShardedLoadPlanner(side_group="gloo")
    with pytest.raises(ValueError, match="side_group=5"):
        ShardedLoadPlanner(side_group=5)
    assert ShardedLoadPlanner().side_group == "auto"
    assert ShardedLoadPlanner(side_group=None).side_group is None
