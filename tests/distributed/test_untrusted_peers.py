"""Sharing that cannot be fooled (issue 43): ranks that disagree on the settings that shape a
shared plan, values in the group's store that no rank of the load wrote, and ranks that claim
one node without sharing its memory. Every case ends the same way: every rank raises
:class:`DistributedLoadError` naming what is wrong, in bounded time (the harness kills what is
still running at its deadline and reports it as ``timed_out``), no destination is reported
loaded, and no shared-memory file is left behind.

Real gloo process groups of 2-4 ranks on loopback against a real DCP checkpoint on local disk;
nodes are simulated by ``ShardedLoadPlanner(node_id=...)`` on one host, and "two hosts' own
/dev/shm" by a directory per rank for the node files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import RankResult, run_ranks
from test_distributed import big_model, same_bits

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.common.errors import DistributedLoadError
from asyncload.distributed import nodes
from asyncload.distributed.claims import _parse_claim
from asyncload.distributed.identity import _check_settings
from asyncload.distributed.idle_watch import decode_idle
from asyncload.distributed.values import parse_rank

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10
MiB = 1 << 20
BASE_OPTIONS: dict[str, Any] = {
    "chunk_size": 64 * KiB,
    "min_chunk_size": 16 * KiB,
    "memory_budget": 8 * MiB,
    "collective_timeout": 20.0,
}
BASE_PLANNER: dict[str, Any] = {"sharing": "always", "unit_size": 16 * KiB}


def _save(tmp_path: Path) -> str:
    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=path, no_dist=True)
    return path


def _left_in_shm(where: str | None = None) -> set[str]:
    d = where or nodes.shm_dir()
    return {n for n in os.listdir(d) if n.startswith("asyncload-")}


def _load(rank: int, path: str, options: dict[str, Any], planner: dict[str, Any]) -> Any:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    kw = {**BASE_PLANNER, **planner}
    asyncload.load(
        sd, path, options=LoadOptions(**{**BASE_OPTIONS, **options}),
        planner=ShardedLoadPlanner(**kw),
    )  # fmt: skip
    return [k for k in full if not same_bits(sd[k], full[k])]


def w_settings(
    rank: int, world: int, path: str, per_rank: dict[int, tuple[dict[str, Any], dict[str, Any]]]
) -> Any:
    options, planner = per_rank.get(rank, ({}, {}))
    return _load(rank, path, options, planner)


def _all_raise(results: list[RankResult], *needles: str) -> None:
    for r in results:
        assert r.status == "error", (r.rank, r.status, r.value, r.traceback)
        assert "DistributedLoadError" in r.error_types, (r.rank, r.error_type, r.traceback)
        for needle in needles:
            assert needle in r.message, (r.rank, needle, r.message)


# --- item 1: ranks agree or fail together ---------------------------------------------------

MISMATCHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name in the error: (rank 1's options, rank 1's planner knobs)
    "LoadOptions.memory_budget": ({"memory_budget": 2 * MiB}, {}),
    "LoadOptions.chunk_size": ({"chunk_size": 128 * KiB}, {}),
    "LoadOptions.min_chunk_size": ({"min_chunk_size": 32 * KiB}, {}),
    "LoadOptions.verify": ({"verify": True}, {}),
    "ShardedLoadPlanner.unit_size": ({}, {"unit_size": 32 * KiB}),
    "ShardedLoadPlanner.sharing": ({}, {"sharing": "never"}),
    "ShardedLoadPlanner.adaptive": ({}, {"adaptive": False, "wait_for_peers": True}),
}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_a_setting_that_differs_fails_every_rank(tmp_path: Path, name: str) -> None:
    """Rank 1 of 2 differs in one setting that shapes the shared plan: both ranks raise
    DistributedLoadError naming the setting, both values and the ranks holding them, before
    any byte is shared (the ranks 0 and 1 both wait for all with ``adaptive``: that mismatch
    is the setting, not the ending)."""
    path = _save(tmp_path)
    before = _left_in_shm()
    options, planner = MISMATCHES[name]
    base_planner = {"wait_for_peers": True} if name == "ShardedLoadPlanner.adaptive" else {}
    per_rank = {0: ({}, base_planner), 1: (options, {**base_planner, **planner})}
    results = run_ranks(w_settings, 2, path, per_rank, timeout=60)
    _all_raise(results, f"disagree on {name}", "rank(s) [0]", "rank(s) [1]")
    for r in results:
        assert r.attrs["doing"] == "comparing the ranks' planner settings"
        assert r.attrs["rank"] in (0, 1)
    assert _left_in_shm() <= before


def w_nodes_budget(rank: int, world: int, path: str, wait: bool) -> Any:
    budget = 2 * MiB if rank == 1 else 8 * MiB
    return _load(
        rank, path, {"memory_budget": budget},
        {"node_id": "ab"[rank // 2], "wait_for_peers": wait},
    )  # fmt: skip


@pytest.mark.parametrize("wait", [False, True], ids=["returns-early", "waits"])
def test_the_issue_case_nodes_a_a_b_b_with_one_budget_apart(tmp_path: Path, wait: bool) -> None:
    """The issue's case: 4 ranks as nodes a, a, b, b, rank 1 with a 2 MiB memory budget, the
    others 8 MiB. It returned wrong tensors as success (``wait_for_peers=False``) or hung
    (``True``); now every rank raises, naming the budget and rank 1."""
    path = _save(tmp_path)
    before = _left_in_shm()
    results = run_ranks(w_nodes_budget, 4, path, wait, timeout=60)
    _all_raise(
        results,
        "disagree on LoadOptions.memory_budget",
        f"rank(s) [1]: {2 * MiB}",
        f"rank(s) [0, 2, 3]: {8 * MiB}",
    )
    assert all(r.attrs["rank"] == 1 for r in results)
    assert _left_in_shm() <= before


def test_check_settings_names_each_difference() -> None:
    same = (("a", 1), ("b", "x"))
    _check_settings([same, same, same])
    with pytest.raises(DistributedLoadError, match=r"disagree on b \(rank\(s\) \[0, 2\]: 'x'; "):
        _check_settings([same, (("a", 1), ("b", "y")), same])
    # a rank that sent no settings (another asyncload version) is a difference too
    with pytest.raises(DistributedLoadError, match=r"rank\(s\) \[1\]: \(not sent\)"):
        _check_settings([same, None])


# --- item 4 of the issue: store values are data to check -------------------------------------


def test_parse_claim_checks_every_rank_it_names() -> None:
    key = "asyncload/0/u/0/c0/7"
    assert _parse_claim("1!0", (0, 1), key) == (1, frozenset({0}))
    for value, why in [
        ("99", "rank 99 is not one of the ranks that may write it"),
        ("x", "not a rank"),
        ("-1", "not a rank"),
        ("", "not a rank"),
        ("1!5", "rank 5 is not one"),
        ("1!1", "also among those left out"),
        ("1!0,x", "not a rank"),
        ("9" * 40, "not a rank"),
    ]:
        with pytest.raises(DistributedLoadError, match="store holds") as info:
            _parse_claim(value, (0, 1), key)
        assert key in str(info.value) and why in str(info.value), (value, str(info.value))


def test_other_store_values_are_checked() -> None:
    assert parse_rank("k", b"3", range(4)) == 3
    with pytest.raises(DistributedLoadError, match="ranks 0 to 3"):
        parse_rank("wa/needs-0", b"7", range(4))
    with pytest.raises(ValueError):
        decode_idle(b"3|9:1.0", 4)  # a rank outside the group
    with pytest.raises(ValueError):
        decode_idle(b"3|1:-1.0", 4)
    with pytest.raises(ValueError):
        decode_idle(b"3|1:inf", 4)
    assert decode_idle(b"3|1:2.5", 4) == (3, {1: 2.5})


def _forge(keys: list[str], value: str) -> None:
    """Write ``value`` at ``keys`` of the first load's part of the group's store (before
    the load starts, as another job or a broken rank could)."""
    world = dist.group.WORLD
    assert world is not None
    store = dist.PrefixStore("asyncload/0/", dist.distributed_c10d._get_process_group_store(world))
    for key in keys:
        store.set(key, value)


def w_forged(rank: int, world: int, path: str, keys: list[str], value: str, node: bool) -> Any:
    if rank == 0:
        _forge(keys, value)
    planner: dict[str, Any] = {"wait_for_peers": True}
    if node:
        planner["node_id"] = "ab"[rank // 2]
    return _load(rank, path, {}, planner)


UNIT_KEYS = [f"u/{p}/c0/{i}" for p in (0, 1) for i in range(256)]
BLOCK_KEYS = [f"nb/{p}/{i}" for p in (0, 1) for i in range(256)]


@pytest.mark.parametrize(
    "value", ["99", "x", "-1", "0!7"], ids=["rank-99", "not-a-number", "negative", "left-out-99"]
)
def test_a_forged_claim_fails_every_rank(tmp_path: Path, value: str) -> None:
    """Every unit's claim key holds a value no rank of the load writes (rank 99 killed the
    ranks with SIGSEGV before; "x" ended in a raw ValueError): every rank raises
    DistributedLoadError naming the key, in bounded time."""
    path = _save(tmp_path)
    results = run_ranks(w_forged, 2, path, UNIT_KEYS, value, False, timeout=60)
    _all_raise(results, "store holds", "asyncload/0/u/")


def test_a_forged_node_claim_fails_every_rank(tmp_path: Path) -> None:
    """The same for node-aware sharing's block claims (4 ranks as nodes a, a, b, b): a block
    claimed by rank 99 would be waited on for ever."""
    path = _save(tmp_path)
    before = _left_in_shm()
    results = run_ranks(w_forged, 4, path, BLOCK_KEYS, "99", True, timeout=60)
    _all_raise(results, "store holds", "asyncload/0/nb/")
    assert _left_in_shm() <= before


def test_a_forged_barrier_watcher_fails_every_rank(tmp_path: Path) -> None:
    """A barrier's watcher outside the group (a get of its status would wait for ever)."""
    path = _save(tmp_path)
    keys = [f"wa/needs-{p}" for p in (0, 1)]
    results = run_ranks(w_forged, 2, path, keys, "99", False, timeout=60)
    _all_raise(results, "store holds", "asyncload/0/wa/needs-0", "the watcher of")


# --- item 2 of the issue: a node is proven, not assumed --------------------------------------


def w_own_shm(rank: int, world: int, path: str, base: str, per_rank: bool) -> Any:
    where = os.path.join(base, f"rank{rank}" if per_rank else f"node{rank // 2}")
    os.makedirs(where, exist_ok=True)
    nodes.shm_dir = lambda: where  # this rank's own "/dev/shm"
    return _load(rank, path, {}, {"node_id": "ab"[rank // 2], "wait_for_peers": True})


def test_one_node_id_over_two_shared_memories_fails_every_rank(tmp_path: Path) -> None:
    """4 ranks as nodes a, a, b, b where each rank has its own shared-memory directory (as
    containers on host networking each have their own /dev/shm under one host name): they
    hung past every timeout; now the ranks of each node find that they cannot see each
    other's proof in the ring and every rank raises DistributedLoadError naming a node id.
    Nothing is left in any of the directories."""
    path = _save(tmp_path)
    base = str(tmp_path / "shm")
    results = run_ranks(w_own_shm, 4, path, base, True, timeout=60)
    _all_raise(results, "do not share its memory", "ShardedLoadPlanner(node_id=...)")
    assert all("node 'a'" in r.message or "node 'b'" in r.message for r in results)
    for r in range(4):
        assert _left_in_shm(os.path.join(base, f"rank{r}")) == set()


def test_a_directory_per_node_is_proven_and_loads(tmp_path: Path) -> None:
    """The control: the same 4 ranks with one directory per node prove their nodes and load
    bit for bit."""
    path = _save(tmp_path)
    base = str(tmp_path / "shm")
    results = run_ranks(w_own_shm, 4, path, base, False, timeout=60)
    for r in results:
        assert r.ok and r.value == [], (r.rank, r.status, r.message, r.traceback)
    for n in range(2):
        assert _left_in_shm(os.path.join(base, f"node{n}")) == set()


# --- the ring's blocks: numbered alike on every node ----------------------------------------


def w_uneven_nodes(rank: int, world: int, path: str) -> Any:
    from test_distributed import narrow_model

    full = narrow_model()
    keys = ["m0"] if rank < 2 else sorted(full)  # node a needs 4 MiB, node b 16 MiB
    sd = {k: torch.zeros_like(full[k]) for k in keys}
    stats = asyncload.load(
        sd, path,
        options=LoadOptions(memory_budget=16 * MiB, collective_timeout=20.0),
        planner=ShardedLoadPlanner(
            node_id="ab"[rank // 2], sharing="always", unit_size=256 * KiB, wait_for_peers=True
        ),
    )  # fmt: skip
    return {
        "bad": [k for k in keys if not same_bits(sd[k], full[k])],
        "from_other_nodes": stats.bytes_from_other_nodes,
    }


def test_nodes_with_different_totals_number_their_blocks_alike(tmp_path: Path) -> None:
    """Node a needs 4 MiB of a 16 MiB checkpoint, node b all of it: each sized its blocks
    from its own total before (128 KiB against 512 KiB here), so the two nodes numbered the
    blocks they share differently (tags and claim keys of different bytes). The block size
    now follows from the largest node's total on every rank: bit for bit, the shared 4 MiB
    crossing between the nodes."""
    from test_distributed import narrow_model

    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in narrow_model().items()}, checkpoint_id=path, no_dist=True)
    results = run_ranks(w_uneven_nodes, 4, path, timeout=60)
    for r in results:
        assert r.ok, (r.rank, r.status, r.message, r.traceback)
        assert r.value["bad"] == [], r.rank
    assert sum(r.value["from_other_nodes"] for r in results) > 0


# --- item 5 of the issue: verify=True checks bytes from a peer -------------------------------


def w_verify(rank: int, world: int, path: str, mode: str, corrupt: bool) -> Any:
    if corrupt and rank == 0:  # rank 0 sends other bytes than it read (its own stay right)
        from asyncload.distributed.transport import _Transport

        real = _Transport.exchange

        async def damaged(self: Any, op: str, peers: Any, tag: int, index: int, view: Any,
                          keep: Any, *rest: Any) -> None:  # fmt: skip
            if op == "send":
                bad = bytearray(view)
                bad[len(bad) // 2] ^= 0x01
                view = keep = memoryview(bad)
            await real(self, op, peers, tag, index, view, keep, *rest)

        _Transport.exchange = damaged  # type: ignore[method-assign]
    planner: dict[str, Any] = {"wait_for_peers": True}
    if mode == "static":
        planner["adaptive"] = False
    if mode == "nodes":
        planner["node_id"] = "ab"[rank // 2]
    return _load(rank, path, {"verify": True}, planner)


VERIFY_MODES = {"adaptive": 2, "static": 2, "nodes": 4}


@pytest.mark.parametrize("mode", sorted(VERIFY_MODES))
def test_verify_passes_bytes_a_peer_read(tmp_path: Path, mode: str) -> None:
    """``verify=True`` on an honest shared load: every rank checks what it received against
    its sender's CRC-32 and loads bit for bit."""
    path = _save(tmp_path)
    results = run_ranks(w_verify, VERIFY_MODES[mode], path, mode, False, timeout=60)
    for r in results:
        assert r.ok and r.value == [], (r.rank, r.status, r.message, r.traceback)


@pytest.mark.parametrize("mode", sorted(VERIFY_MODES))
def test_verify_names_a_peer_that_sends_damaged_bytes(tmp_path: Path, mode: str) -> None:
    """Rank 0 flips a bit in every message it sends (after computing its CRC-32): a rank
    that receives from it raises DistributedLoadError naming rank 0 (``err.rank == 0``), and
    so does every other rank; nobody reports a load that holds those bytes."""
    path = _save(tmp_path)
    before = _left_in_shm()
    results = run_ranks(w_verify, VERIFY_MODES[mode], path, mode, True, timeout=60)
    _all_raise(results, "from rank 0, and they are not the bytes rank 0 read")
    assert all(r.attrs["rank"] == 0 for r in results), [r.attrs for r in results]
    assert _left_in_shm() <= before


def test_without_verify_damaged_bytes_from_a_peer_go_unseen(tmp_path: Path) -> None:
    """The control (what ``verify=True`` is for): the same damage without it loads the
    wrong bytes on the receiving rank, as success."""
    path = _save(tmp_path)
    results = run_ranks(w_damaged_plain, 2, path, timeout=60)
    assert all(r.ok for r in results), [(r.rank, r.message) for r in results]
    assert results[0].value == [] and results[1].value != []


def w_damaged_plain(rank: int, world: int, path: str) -> Any:
    if rank == 0:
        from asyncload.distributed.transport import _Transport

        real = _Transport.exchange

        async def damaged(self: Any, op: str, peers: Any, tag: int, index: int, view: Any,
                          keep: Any, *rest: Any) -> None:  # fmt: skip
            if op == "send":
                bad = bytearray(view)
                bad[len(bad) // 2] ^= 0x01
                view = keep = memoryview(bad)
            await real(self, op, peers, tag, index, view, keep, *rest)

        _Transport.exchange = damaged  # type: ignore[method-assign]
    return _load(rank, path, {}, {"wait_for_peers": True})
