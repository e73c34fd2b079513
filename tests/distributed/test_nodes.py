"""Node-aware sharing (``ShardedLoadPlanner(node_id=...)``): ranks grouped into nodes, every
byte entering each node once (from storage or from another node), handed to the node's
other ranks through shared memory (:mod:`asyncload.distributed.nodes`).

Multi-rank tests run 4 gloo processes as 2 simulated nodes of 2 (distinct ``node_id``s on
one host) against real checkpoints on local disk; every rank checks what it loaded bit for
bit, and the byte counters are asserted as bounds, never timings.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import big_model, same_bits, tensor_bytes

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.distributed.node_phase import RING_SLOTS, plan_windows, ring_geometry
from asyncload.distributed.nodes import NodeFiles, node_layout, plan_blocks, shm_dir
from asyncload.distributed.share_plan import _pack

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10
OPTIONS = LoadOptions(chunk_size=64 * KiB, min_chunk_size=16 * KiB, memory_budget=512 * KiB)
FIELDS = (
    "bytes_read",
    "bytes_sent",
    "bytes_received",
    "bytes_assembled",
    "bytes_from_other_nodes",
    "bytes_from_own_node",
    "bytes_taken_over",
)


def _left_in_shm() -> set[str]:
    return {n for n in os.listdir(shm_dir()) if n.startswith("asyncload-")}


def w_nodes(rank: int, world: int, url: str, ranks_per_node: int, adaptive: bool) -> Any:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    planner = ShardedLoadPlanner(
        node_id=f"node{rank // ranks_per_node}",
        sharing="always",  # local disk: the cost model would read, not share
        adaptive=adaptive,
        wait_for_peers=True,
        unit_size=16 * KiB,  # blocks of 64 KiB: the planned split within 5 % of half
    )
    stats = asyncload.load(sd, url, options=OPTIONS, planner=planner)
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "stats": {f: getattr(stats, f) for f in FIELDS},
    }


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
def test_two_nodes_of_two_read_once_and_take_half_across(tmp_path: Path, adaptive: bool) -> None:
    """The acceptance case: a replicated checkpoint on 2 simulated nodes of 2 ranks. Storage
    bytes at most 1.05x the checkpoint in total; each node takes at most 1.05x half of it
    from the other node; every rank's other bytes come from its own node's shared memory;
    bit for bit on every rank; no shared-memory file left behind."""
    before = _left_in_shm()
    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=path, no_dist=True)
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_nodes, 4, path, 2, adaptive, timeout=90))
    stats = [v["stats"] for v in values]
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert v["stats"]["bytes_assembled"] == total
    read = sum(s["bytes_read"] for s in stats)
    assert total <= read <= 1.05 * total, read
    intake = []
    for node in (0, 1):
        mine = stats[2 * node : 2 * node + 2]
        across = sum(s["bytes_from_other_nodes"] for s in mine)
        # every byte enters the node once: from storage or from the other node
        intake.append(sum(s["bytes_read"] for s in mine) + across)
        if not adaptive:  # the planned split (adaptive: a faster node takes over more)
            assert 0 < across <= 1.05 * total / 2, (node, across)
        # each rank took from its node peer what it did not fetch itself
        for s in mine:
            assert s["bytes_from_own_node"] > 0, s
    assert intake[0] == intake[1] and total <= intake[0] <= 1.05 * total, intake
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
    assert sum(s["bytes_received"] for s in stats) == sum(
        s["bytes_from_other_nodes"] for s in stats
    )
    assert _left_in_shm() <= before


def test_uneven_nodes_and_a_partial_layout(tmp_path: Path) -> None:
    """3 ranks as a node of 2 and a node of 1, each rank loading a different half of the
    keys: still bit for bit, storage read about once."""
    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=path, no_dist=True)
    values = all_ok(run_ranks(w_partial, 3, path, timeout=90))
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
    total = tensor_bytes(big_model())
    read = sum(v["stats"]["bytes_read"] for v in values)
    assert read <= 1.05 * total, read


def w_partial(rank: int, world: int, url: str) -> Any:
    full = big_model()
    keys = sorted(full)
    mine = keys[: len(keys) // 2] if rank == 1 else keys[len(keys) // 4 :]
    sd = {k: torch.zeros_like(full[k]) for k in mine}
    planner = ShardedLoadPlanner(node_id="a" if rank < 2 else "b", sharing="always")
    stats = asyncload.load(sd, url, options=OPTIONS, planner=planner, allow_partial_load=True)
    ShardedLoadPlanner.wait_for_background_sends(30)
    return {
        "bad": [k for k in mine if not same_bits(sd[k], full[k])],
        "stats": {f: getattr(stats, f) for f in FIELDS},
    }


def w_ring(rank: int, world: int, url: str, options: LoadOptions, adaptive: bool) -> Any:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    planner = ShardedLoadPlanner(
        node_id=f"node{rank // 2}", sharing="always", adaptive=adaptive, wait_for_peers=True
    )
    stats = asyncload.load(sd, url, options=options, planner=planner)
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "stats": {f: getattr(stats, f) for f in (*FIELDS, "node_shared_memory_bytes")},
    }


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
def test_node_shared_memory_stays_within_the_budget(tmp_path: Path, adaptive: bool) -> None:
    """A checkpoint 16x ``memory_budget`` on 2 simulated nodes of 2: each node stages its
    bytes in a ring of windows in shared memory that never holds more than the budget (the
    ring's size, ``LoadStats.node_shared_memory_bytes``, is all a node maps), yet every rank
    loads every byte bit for bit, the checkpoint enters each node once, and nothing is left
    in ``/dev/shm``."""
    before = _left_in_shm()
    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=path, no_dist=True)
    total = tensor_bytes(big_model())
    budget = 128 * KiB
    options = LoadOptions(chunk_size=32 * KiB, min_chunk_size=8 * KiB, memory_budget=budget)
    assert total >= 16 * budget
    values = all_ok(run_ranks(w_ring, 4, path, options, adaptive, timeout=90))
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        st = v["stats"]
        assert st["bytes_assembled"] == total
        assert 0 < st["node_shared_memory_bytes"] <= budget, (rank, st)
    stats = [v["stats"] for v in values]
    assert total <= sum(s["bytes_read"] for s in stats) <= 1.05 * total
    for node in (0, 1):
        mine = stats[2 * node : 2 * node + 2]
        intake = sum(s["bytes_read"] + s["bytes_from_other_nodes"] for s in mine)
        assert total <= intake <= 1.05 * total, (node, intake)
    assert _left_in_shm() <= before


def w_node_fails(rank: int, world: int, url: str, mode: str, victim: int) -> Any:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}

    def progress(done: int, total: int) -> None:
        if rank == victim and done >= total // 3:
            if mode == "raise":
                raise RuntimeError(f"injected failure on rank {rank}")
            if mode == "stall":
                time.sleep(3600)
            if mode == "die":
                os._exit(3)

    options = LoadOptions(
        chunk_size=32 * KiB,
        min_chunk_size=8 * KiB,
        memory_budget=128 * KiB,
        collective_timeout=4.0,
        concurrency=4,
    )
    planner = ShardedLoadPlanner(node_id=f"node{rank // 2}", sharing="always", wait_for_peers=True)
    asyncload.load(sd, url, options=options, planner=planner, progress=progress)
    return {"bad": [k for k in full if not same_bits(sd[k], full[k])]}


@pytest.mark.parametrize("mode", ["raise", "die", "stall"])
def test_a_failing_rank_on_the_node_path_fails_every_rank(tmp_path: Path, mode: str) -> None:
    """Rank 1 (node 0, its peer rank 0 waits on its windows) raises, exits or hangs once a
    third of its bytes landed: every other rank raises DistributedLoadError naming it within
    ``collective_timeout`` (4 s) plus a little, never a hang; no shared memory left."""
    before = _left_in_shm()
    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=path, no_dist=True)
    results = run_ranks(
        w_node_fails, 4, path, mode, 1, timeout=40, may_hang=set() if mode == "raise" else {1}
    )
    if mode == "raise":
        assert results[1].status == "error" and results[1].error_type == "RuntimeError"
    for r in (results[0], results[2], results[3]):
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.rank,
            r.status,
            r.message,
            r.traceback,
        )
        assert r.attrs["rank"] == 1, r.message
        assert r.seconds < 25
    assert _left_in_shm() <= before


# --- the pure parts ---------------------------------------------------------------------------


def test_node_layout() -> None:
    assert node_layout(["h"] * 4) is None  # one node: rank-to-rank sharing as before
    assert node_layout(["a", "b", "c"]) is None  # one rank per node: nothing to hand over
    assert node_layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert node_layout(["b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [4]]


def _covered(blocks: list[Any], node: int, name: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b in sorted(
        (b for b in blocks if node in b.nodes and b.name == name), key=lambda b: b.start
    ):
        if out and out[-1][1] == b.start:
            out[-1] = (out[-1][0], b.end)
        else:
            out.append((b.start, b.end))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_plan_blocks_on_random_layouts(seed: int) -> None:
    """Against the definition: each node's blocks cover exactly the union of its ranks'
    needs; blocks do not overlap, are at most ``block_size``; a block's nodes are exactly
    the nodes that need its bytes; fetchers belong to their node; the owner is one of the
    block's nodes; every rank of a node fetches within one block of the others."""
    rng = random.Random(seed)
    world = rng.randint(2, 9)
    ids = [rng.randrange(rng.randint(1, 4)) for _ in range(world)]
    nodes: list[list[int]] = []
    seen: dict[int, int] = {}
    for r, n in enumerate(ids):
        if n not in seen:
            seen[n] = len(nodes)
            nodes.append([])
        nodes[seen[n]].append(r)
    files = ["f0", "f1", "f2"][: rng.randint(1, 3)]
    needs = []
    for _ in range(world):
        mine = []
        for f in files:
            for _ in range(rng.randint(0, 3)):
                a = rng.randrange(0, 1000)
                mine.append((f, a, a + rng.randint(1, 300)))
        needs.append(mine)
    block = rng.choice([7, 64, 1000])
    blocks = plan_blocks(needs, nodes, block)
    for i, b in enumerate(blocks):
        assert b.seq == i and 0 < b.nbytes <= block
        assert b.owner in b.nodes
        for k, f in zip(b.nodes, b.fetchers):
            assert f in nodes[k]
    for f in files:
        spans = sorted((b.start, b.end) for b in blocks if b.name == f)
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))
        for k, ranks in enumerate(nodes):
            want: set[int] = set()
            for r in ranks:
                for name, a, e in needs[r]:
                    if name == f:
                        want.update(range(a, e))
            got = {x for s, e in _covered(blocks, k, f) for x in range(s, e)}
            assert got == want, (k, f)
    for k in range(len(nodes)):  # what one node's ranks plan: its part, numbered alike
        assert plan_blocks(needs, nodes, block, k) == [b for b in blocks if k in b.nodes]
    packed = [_pack(n) for n in needs]  # the all-gather's form plans the same
    assert plan_blocks(packed, nodes, block) == blocks


def test_plan_blocks_balances_a_replicated_file() -> None:
    """2 nodes of 2 ranks, one 10-block file all need: each node owns half of it (within
    half a block) and each rank fetches half of its node's blocks."""
    needs = [[("f", 0, 10 * 64)] for _ in range(4)]
    blocks = plan_blocks(needs, [[0, 1], [2, 3]], 64)
    assert len(blocks) == 10 and all(b.nodes == (0, 1) for b in blocks)
    assert [sum(b.nbytes for b in blocks if b.owner == k) for k in (0, 1)] == [320, 320]
    for r in range(4):
        assert sum(b.nbytes for b in blocks if r in b.fetchers) == 320


@pytest.mark.parametrize("count", [2, 4])
def test_plan_blocks_spreads_a_nodes_reads_over_its_ranks(count: int) -> None:
    """``count`` nodes of 2 ranks, one replicated file of 8 blocks per node: the owners
    alternate over the nodes, and each node's reads (the blocks it owns) and its receives
    are each spread evenly over its ranks. Fails on the rotation by block position alone,
    which gave all of a node's reads to one of its ranks."""
    n = 8 * count
    nodes = [[2 * k, 2 * k + 1] for k in range(count)]
    blocks = plan_blocks([[("f", 0, n * 64)] for _ in range(2 * count)], nodes, 64)
    assert len(blocks) == n
    for k, ranks in enumerate(nodes):
        for r in ranks:
            reads = [b for b in blocks if b.owner == k and b.fetcher(k) == r]
            receives = [b for b in blocks if b.owner != k and b.fetcher(k) == r]
            assert len(reads) == 4, (k, r, len(reads))
            assert len(receives) == 4 * (count - 1), (k, r, len(receives))


def test_node_files_are_removed_on_every_path() -> None:
    before = _left_in_shm()
    files = NodeFiles("test-unlink", {"a": 4096, "b": 0, "c": 10})
    assert {os.path.basename(p) for p in files.paths.values()} <= _left_in_shm()
    files.view("a", 0, 4)[:] = b"abcd"
    other = NodeFiles("test-unlink", {"a": 4096, "b": 0, "c": 10})  # the same node's peer
    v = other.view("a", 0, 4)
    assert bytes(v) == b"abcd"
    v.release()
    files.unlink()
    other.unlink()
    assert _left_in_shm() <= before
    files.close()
    other.close()
    with pytest.raises(OSError):
        NodeFiles("x/../../no/such/dir", {"a": 10})
    assert _left_in_shm() <= before


def test_windows_and_ring_geometry() -> None:
    """Windows take blocks in order up to a slot; the ring (``RING_SLOTS`` slots) is within
    the budget; a small phase is cut into several windows, a block never exceeds a slot."""
    assert plan_windows([4, 4, 4, 4, 4], 8) == [0, 0, 1, 1, 2]
    assert plan_windows([3, 6, 2, 8], 8) == [0, 1, 1, 2]
    assert plan_windows([], 8) == []
    for total, budget, unit in [(10 << 20, 512 << 10, 64 << 10), (1 << 30, 512 << 20, 8 << 20),
                                (1 << 20, 64 << 10, 1 << 20), (100, 64 << 10, 16)]:  # fmt: skip
        block, slot = ring_geometry(total, budget, unit)
        assert 0 < block <= slot and RING_SLOTS * slot <= budget, (total, budget, unit)
    assert ring_geometry(32 << 20, 512 << 20, 1 << 20) == (1 << 20, 8 << 20)
