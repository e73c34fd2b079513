"""Slow consumers (issue 13): with ``ShardedLoadPlanner``'s default (``wait_for_peers=False``)
a rank returns once its own destinations are complete, while a slower rank is still
assembling; what it still owes that rank goes out from private copies in the background.

The slow rank is made slow deterministically: its progress callback blocks (its event loop
and assembly stall) until every fast rank has written a file saying its load returned, with
a deadline only as a failure cut-off. So "the fast ranks returned before the slow rank's
assembly finished" is observed as an ordering, never as a timing. Every rank checks what it
loaded bit for bit; the fast ranks overwrite their tensors right after return (the next
training step), which must not reach the slow rank.

Multi-rank tests run on gloo process groups of 4 processes (``tests/_dist.py``) against a
checkpoint on local disk.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import big_model, same_bits, stats_dict, tensor_bytes

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.distributed.claims import _parse_claim
from asyncload.distributed.sends import COPIES, BackgroundSends, _wait_at_exit

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10
SLOW = 2
#: The rank that runs the interpreter-exit hook after its last load.
EXITS = 3
#: Big enough that every send copy fits (the budget bounds send copies too).
OPTIONS = LoadOptions(
    chunk_size=64 * KiB,
    min_chunk_size=16 * KiB,
    memory_budget=8 << 20,
    hedge_min_delay=0.05,
    collective_timeout=30.0,
)
#: Seconds the slow rank waits for the fast ranks' files at most (a failure cut-off).
CUT_OFF = 15.0


def save(path: Path) -> str:
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=str(path), no_dist=True)
    return str(path)


def _wait_for(files: list[Path], deadline: float) -> bool:
    end = time.monotonic() + deadline
    while not all(f.exists() for f in files):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class _LeaveOutTheSlowRank(ShardedLoadPlanner):
    """The slow rank far behind from the start (as once its pending copies fill half the
    budget): every unit is claimed with it left out, so it must read each unit itself, and
    the others still get the unit from a copy."""

    def share_session(self, session: Any, options: LoadOptions) -> Any:
        share = super().share_session(session, options)
        if share is not None and share.sends is not None:
            share.sends.behind = lambda peers, nbytes: [p for p in peers if p == SLOW]  # type: ignore[method-assign]
        return share


def w_slow_consumer(
    rank: int,
    world: int,
    path: str,
    flags: str,
    options: LoadOptions,
    loads: int = 1,
    die_after_return: int | None = None,
    leave_out: bool = False,
) -> list[dict[str, Any]]:
    """``loads`` loads in a row of the replicated model. Rank ``SLOW`` blocks in its progress
    callback, once a quarter of its bytes have landed, until every other rank's load has
    returned (files ``returned-<load>-<rank>``; ``CUT_OFF``). The others check their tensors,
    overwrite them at once, then write their file; ``die_after_return`` exits right after."""
    full = big_model()
    out: list[dict[str, Any]] = []
    others = [r for r in range(world) if r != SLOW]
    for n in range(loads):
        sd = {k: torch.zeros_like(v) for k, v in full.items()}
        seen: dict[str, bool] = {}

        def progress(done: int, total: int, seen: dict[str, bool] = seen, n: int = n) -> None:
            if rank == SLOW and "saw" not in seen and done >= total // 4:
                seen["saw"] = _wait_for(
                    [Path(flags) / f"returned-{n}-{r}" for r in others], CUT_OFF
                )

        planner = (_LeaveOutTheSlowRank if leave_out else ShardedLoadPlanner)(
            unit_size=16 * KiB, sharing="always"
        )
        stats = asyncload.load(sd, path, options=options, planner=planner, progress=progress)
        bad = [k for k in full if not same_bits(sd[k], full[k])]
        bg = planner.background_sends
        out.append(
            {
                "bad": bad,
                "stats": stats_dict(stats),
                "saw_returns": seen.get("saw"),
                "at_return": bg.bytes_at_return if bg is not None else None,
            }
        )
        if rank != SLOW:
            for t in sd.values():  # the next training step writes the tensors in place
                t.fill_(7)
            (Path(flags) / f"returned-{n}-{rank}").touch()
            if rank == die_after_return:
                os._exit(0)
    if bg is not None:
        if rank == EXITS:  # what interpreter exit runs: wait (bounded) for the sends to land
            _wait_at_exit()
            out[-1]["drained"] = bg.wait(0)
        else:
            out[-1]["drained"] = bg.wait(20.0)
        out[-1]["after_return"] = bg.bytes_sent_after_return
    return out


def _check_load(values: list[list[dict[str, Any]]], n: int, total: int) -> None:
    for rank, v in enumerate(values):
        st = v[n]["stats"]
        assert v[n]["bad"] == [], (rank, n)
        assert st["bytes_assembled"] == total
        assert st["bytes_read"] + st["bytes_received"] >= total, (rank, st)
    assert sum(v[n]["stats"]["bytes_sent"] for v in values) == sum(
        v[n]["stats"]["bytes_received"] for v in values
    )
    # hedged units aside, read about once in all (what is above the checkpoint's bytes is what
    # each rank reads for itself: record headers, and gaps read through between records)
    once = sum(v[n]["stats"]["bytes_read"] - v[n]["stats"]["bytes_hedged"] for v in values)
    assert total <= once <= 1.10 * total, once


def test_fast_ranks_return_while_a_slow_consumer_assembles(tmp_path: Path) -> None:
    """Two loads in a row on one process group. In each, the slow rank saw every fast
    rank's load return while it was still assembling; the fast ranks (together) still owed
    it bytes when they returned (sent after return from copies, so overwriting their tensors right
    away did not reach it); every rank bit for bit; every unit read once (hedges aside).
    The interpreter-exit hook, run on one fast rank, returns once what it owed has landed."""
    path = save(tmp_path / "ck")
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_slow_consumer, 4, path, str(tmp_path), OPTIONS, 2, timeout=100))
    for n in (0, 1):
        assert values[SLOW][n]["saw_returns"] is True, n
        _check_load(values, n, total)
        # the fast ranks together still owed the slow one bytes (which of them did depends
        # on which units each claimed, and on whether the slow rank's receive was already up)
        assert sum(values[r][n]["at_return"] for r in (0, 1, 3)) > 0, (n, values)
    for r in (0, 1, 3):
        assert values[r][-1]["drained"] is True
        owed = values[r][-1]["at_return"]
        assert (
            (0 < values[r][-1]["after_return"] <= owed)
            if owed
            else values[r][-1]["after_return"] == 0
        ), r
    # the exit hook returned once everything owed had landed
    assert values[EXITS][-1]["after_return"] == values[EXITS][-1]["at_return"]


def test_a_unit_left_out_for_the_slow_rank_is_read_from_storage(tmp_path: Path) -> None:
    """Units whose sends to the slow rank were not made (its copies over budget: here every
    unit) are read from storage by the slow rank itself; the fast ranks still exchange them."""
    path = save(tmp_path / "ck")
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_slow_consumer, 4, path, str(tmp_path), OPTIONS, 1, None, True, timeout=100)
    )
    assert values[SLOW][0]["saw_returns"] is True
    for rank, v in enumerate(values):
        assert v[0]["bad"] == [], rank
    slow = values[SLOW][0]["stats"]
    assert slow["bytes_received"] == 0, slow
    assert slow["bytes_read"] >= total
    # the fast ranks still exchanged what they read (and received what the slow rank read)
    stats = [v[0]["stats"] for v in values]
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
    assert all(stats[r]["bytes_received"] > 0 for r in (0, 1, 3))


def test_a_sender_that_dies_after_returning(tmp_path: Path) -> None:
    """Rank 1 exits right after its load returned, while it still owed the slow rank bytes:
    the slow rank reads those units from storage itself (or, had it been waiting on rank 1
    for something else, raises DistributedLoadError); never a hang."""
    path = save(tmp_path / "ck")
    options = OPTIONS.replace(collective_timeout=6.0)
    results = run_ranks(
        w_slow_consumer, 4, path, str(tmp_path), options, 1, 1, timeout=60, may_hang={1}
    )
    assert results[1].status == "timed_out"  # exited without reporting
    for r in (results[0], results[3]):
        assert r.ok and r.value[0]["bad"] == [], (r.rank, r.status, r.message)
    slow = results[SLOW]
    if slow.ok:
        assert slow.value[0]["saw_returns"] is True
        assert slow.value[0]["bad"] == []
        # every byte in place: what rank 1 still owed was read around (bytes_hedged), unless its
        # sends had landed between its return and its exit (gloo completes posted receives on
        # its own threads), so which of the two happened is not asserted
        assert slow.value[0]["stats"]["bytes_assembled"] == tensor_bytes(big_model())
    else:
        assert slow.error_type == "DistributedLoadError", (
            slow.status,
            slow.message,
            slow.traceback,
        )
        assert slow.attrs["rank"] == 1, slow.message


def test_wait_for_peers_holds_every_rank_until_the_slow_one(tmp_path: Path) -> None:
    """``wait_for_peers=True``: the fast ranks cannot return before the slow rank finishes, so
    its callback runs into its cut-off without seeing them; they still load bit for bit."""
    path = save(tmp_path / "ck")

    def run() -> Any:
        return run_ranks(w_wait_for_peers, 4, path, str(tmp_path), OPTIONS, timeout=100)

    values = all_ok(run())
    assert values[SLOW]["saw_returns"] is False
    assert all(v["bad"] == [] for v in values)
    assert all(v["background"] is None for v in values)


def w_wait_for_peers(
    rank: int, world: int, path: str, flags: str, options: LoadOptions
) -> dict[str, Any]:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    seen: dict[str, bool] = {}
    others = [Path(flags) / f"waited-{r}" for r in range(world) if r != SLOW]

    def progress(done: int, total: int) -> None:
        if rank == SLOW and "saw" not in seen and done >= total // 4:
            seen["saw"] = _wait_for(others, 3.0)

    planner = ShardedLoadPlanner(sharing="always", unit_size=16 * KiB, wait_for_peers=True)
    asyncload.load(sd, path, options=options, planner=planner, progress=progress)
    if rank != SLOW:
        (Path(flags) / f"waited-{rank}").touch()
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "saw_returns": seen.get("saw"),
        "background": planner.background_sends,
    }


def test_dcp_load_with_a_slow_consumer(tmp_path: Path) -> None:
    """Plain ``dcp.load`` with the default planner: torch's own final collective makes every
    rank wait for the slow one, and the copies sent in the background still land bit for bit."""
    path = save(tmp_path / "ck")
    values = all_ok(run_ranks(w_dcp_slow, 4, path, OPTIONS, timeout=60))
    assert all(v == [] for v in values)


def w_dcp_slow(rank: int, world: int, path: str, options: LoadOptions) -> list[str]:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    reader = asyncload.PipelinedReader(path, options=options)
    if rank == SLOW:
        reader.progress = lambda done, total: time.sleep(0.01)
    dcp.load(
        sd, storage_reader=reader, planner=ShardedLoadPlanner(sharing="always", unit_size=16 * KiB)
    )
    return [k for k in full if not same_bits(sd[k], full[k])]


# --- the pure parts ------------------------------------------------------------------------------


def test_parse_claim() -> None:
    assert _parse_claim("3", (0, 1, 3)) == (3, frozenset())
    assert _parse_claim("3!", (0, 1, 3)) == (3, frozenset({0, 1}))
    assert _parse_claim("3!1,0", (0, 1, 3)) == (3, frozenset({0, 1}))
    assert _parse_claim("0!2", (0, 1, 2, 3)) == (0, frozenset({2}))


class _FakeMonitor:
    rank = 0
    world = 4


def test_a_peer_falls_behind_only_against_the_others() -> None:
    """Once the copies fill the budget, a peer is left out of new units if its pending copies
    pass half of it and more than twice those of every other peer; peers late alike, or a
    single peer, never."""
    sends = BackgroundSends(_FakeMonitor(), 1000)  # type: ignore[arg-type]
    sends._to = {1: 600, 2: 100, 3: 0}
    assert sends.behind([1, 2, 3], 10) == []  # the copies do not fill the budget yet
    COPIES.set_capacity(1 << 40)
    assert COPIES.try_acquire(1000)  # they do now
    try:
        _check_behind(sends)
    finally:
        COPIES.release(1000)


def _check_behind(sends: BackgroundSends) -> None:
    sends._to = {1: 600, 2: 100, 3: 0}
    assert sends.behind([1, 2, 3], 10) == [1]
    assert sends.behind([2, 3], 10) == []  # rank 1 is not among this unit's consumers
    sends._to = {1: 600, 2: 500, 3: 0}
    assert sends.behind([1, 2, 3], 10) == []  # two late alike: neither is left out
    sends._to = {1: 900}
    assert sends.behind([1], 10) == []
    sends._to = {1: 300, 2: 0}
    assert sends.behind([1, 2], 10) == []  # under half the budget


def w_mixed(rank: int, world: int, path: str) -> None:
    sd = {k: torch.zeros_like(v) for k, v in big_model().items()}
    asyncload.load(
        sd,
        path,
        options=OPTIONS,
        planner=ShardedLoadPlanner(sharing="always", wait_for_peers=rank == 3),
    )


def test_ranks_that_disagree_on_wait_for_peers(tmp_path: Path) -> None:
    """A rank that would wait at the end for ranks that return early would wait in vain:
    every rank raises DistributedLoadError naming it, before any byte is shared."""
    results = run_ranks(w_mixed, 4, save(tmp_path / "ck"), timeout=40)
    for r in results:
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.rank,
            r.status,
            r.message,
        )
        assert "disagree on wait_for_peers (rank(s) [3] wait" in r.message, r.message
        assert r.attrs["rank"] == 3
