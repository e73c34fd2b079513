"""Sharing's global plan at scale: each rank plans only its part (``_rank_plan``: the ranks it
shares files with, its component), and that part is the full plan's, bit for bit.

Pure tests check, on random layouts of many files and ranks, that ``plan_transfers`` matches
an independent reference (byte by byte: who needs what; plain greedy owners), and that every
rank's part equals its slice of the full plan (``plan_transfers``, or ``balance_units`` of
``split_units`` for adaptive sharing) renumbered within its component, from tuples and from
the packed all-gathered form. A multi-rank test (gloo, 4 processes) loads two pairs of ranks
that share nothing across pairs, whose units are numbered alike in each pair: the claims
stay apart, and every byte is read once in each pair, bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import same_bits, stats_dict, tensor_bytes

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.distributed.share_plan import (
    Transfer,
    _pack,
    _rank_plan,
    balance_units,
    plan_transfers,
    split_units,
)

KiB = 1 << 10

Needs = list[list[tuple[str, int, int]]]


def random_needs(rng: random.Random) -> Needs:
    """Ranks that each need ranges of a few of several files (so that some ranks share files
    and others do not): ranges that touch, gaps, and replicas of one rank's ranges."""
    world = rng.randint(1, 14)
    files = [f"__{i}_0.distcp" for i in range(rng.randint(1, 6))]
    needs: Needs = []
    for _ in range(world):
        if needs and rng.random() < 0.2:  # a replica of another rank
            needs.append(list(rng.choice(needs)))
            continue
        ranges = []
        for name in rng.sample(files, rng.randint(0, min(2, len(files)))):
            ranges += random_ranges(rng, name, 30, 400, 60, 20)
        needs.append(sorted(ranges))
    return needs


def random_ranges(
    rng: random.Random, name: str, first: int, stop: int, longest: int, gap: int
) -> list[tuple[str, int, int]]:
    """Ranges of ``name`` from a random start up to ``first`` until ``stop``: 70 % of the
    stretches of 1 to ``longest`` bytes, touching or (30 %) with gaps of 1 to ``gap`` bytes."""
    out = []
    pos = rng.randint(0, first)
    while pos < stop:
        n = rng.randint(1, longest)
        if rng.random() < 0.7:
            out.append((name, pos, pos + n))
        pos += n + (rng.randint(1, gap) if rng.random() < 0.3 else 0)
    return out


def reference_plan(
    needs: Needs,
) -> tuple[list[tuple[str, int, int, int, tuple[int, ...]]], list[int]]:
    """The plan by its definition, the slow way: who needs each byte; a transfer per stretch
    between two consecutive boundaries of any rank that two or more ranks need; owners by a
    plain greedy (largest first, then by file and offset; to the consumer with the fewest
    bytes, then the lowest rank)."""
    who: dict[tuple[str, int], set[int]] = {}
    cuts: dict[str, set[int]] = {}
    for r, ranges in enumerate(needs):
        for name, s, e in ranges:
            cuts.setdefault(name, set()).update((s, e))
            for b in range(s, e):
                who.setdefault((name, b), set()).add(r)
    load = [0] * len(needs)
    shared = []
    for name in sorted(cuts):
        points = sorted(cuts[name])
        for a, b in itertools.pairwise(points):
            consumers = tuple(sorted(who.get((name, a), ())))
            if len(consumers) == 1:
                load[consumers[0]] += b - a
            elif consumers:
                shared.append((name, a, b, consumers))
    owners = {}
    for name, a, b, consumers in sorted(shared, key=lambda t: (-(t[2] - t[1]), t[0], t[1])):
        owner = min(consumers, key=lambda c: (load[c], c))
        load[owner] += b - a
        owners[(name, a)] = owner
    return [(name, a, b, owners[(name, a)], consumers) for name, a, b, consumers in shared], load


def reference_balance(units: list[Transfer], load: list[int]) -> list[int]:
    """balance_units by its definition: from what each rank reads alone, each unit in order to
    the consumer with the fewest bytes so far (then the lowest rank)."""
    base = list(load)
    for u in units:
        base[u.owner] -= u.nbytes
    owners = []
    for u in units:
        owner = min(u.consumers, key=lambda c: (base[c], c))
        base[owner] += u.nbytes
        owners.append(owner)
    return owners


def components(needs: Needs) -> list[set[int]]:
    """The ranks that share files, directly or through others (union-find)."""
    parent = list(range(len(needs)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    first: dict[str, int] = {}
    for r, ranges in enumerate(needs):
        for name, _, _ in ranges:
            parent[root(r)] = root(first.setdefault(name, r))
    out: dict[int, set[int]] = {}
    for r in range(len(needs)):
        out.setdefault(root(r), set()).add(r)
    return list(out.values())


def rows(items: list[Transfer]) -> list[tuple[Any, ...]]:
    return [(t.index, t.name, t.start, t.end, t.owner, t.consumers) for t in items]


def slice_of(full: list[Transfer], ranks: set[int], rank: int) -> list[Transfer]:
    """The full plan's items of the component ``ranks``, numbered within it, that ``rank`` consumes."""
    inside = [t for t in full if set(t.consumers) <= ranks]
    assert all(not set(t.consumers) & ranks for t in full if t not in inside)
    return [dataclasses.replace(t, index=i) for i, t in enumerate(inside) if rank in t.consumers]


@pytest.mark.parametrize("seed", range(40))
def test_plan_transfers_matches_the_reference(seed: int) -> None:
    needs = random_needs(random.Random(seed))
    transfers, load = plan_transfers(needs)
    want, want_load = reference_plan(needs)
    assert [(t.name, t.start, t.end, t.owner, t.consumers) for t in transfers] == want
    assert load == want_load
    assert [t.index for t in transfers] == list(range(len(transfers)))
    assert plan_transfers([_pack(n) for n in needs]) == (transfers, load)


@pytest.mark.parametrize("seed", range(40))
def test_split_and_balance_units_match_the_reference(seed: int) -> None:
    needs = random_needs(random.Random(seed))
    transfers, load = plan_transfers(needs)
    units = split_units(transfers, 9)
    assert [(u.name, u.start, u.end) for u in units] == [
        (t.name, t.start + t.nbytes * k // n, t.start + t.nbytes * (k + 1) // n)
        for t in transfers
        for n in [-(-t.nbytes // 9)]
        for k in range(n)
    ]
    balanced = balance_units(units, load)
    assert [u.owner for u in balanced] == reference_balance(units, load)
    assert [(u.index, u.name, u.start, u.end, u.consumers) for u in balanced] == [
        (u.index, u.name, u.start, u.end, u.consumers) for u in units
    ]


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("unit_size", [None, 7, 25, 1000])
def test_each_rank_plans_its_slice_of_the_full_plan(seed: int, unit_size: int | None) -> None:
    """Transfers (static sharing) or balanced units (adaptive): each rank's part, from the
    tuples and from the packed form, equals the full plan's items it consumes, numbered in its
    component; its planned bytes are the full plan's; every rank of a component agrees."""
    needs = random_needs(random.Random(seed))
    transfers, load = plan_transfers(needs)
    full = (
        transfers if unit_size is None else balance_units(split_units(transfers, unit_size), load)
    )
    planned = list(load)  # with units: what a rank reads alone, plus the units it owns
    if unit_size is not None:
        for t in transfers:
            planned[t.owner] -= t.nbytes
        for u in full:
            planned[u.owner] += u.nbytes
    packed = [_pack(n) for n in needs]
    for ranks in components(needs):
        agreed: dict[tuple[str, int], tuple[int, int]] = {}
        for rank in sorted(ranks):
            part = _rank_plan(needs, rank, unit_size)
            want = slice_of(full, ranks, rank)
            assert rows(part.items) == rows(want), (rank, ranks)
            assert part.ranks == sorted(ranks)
            assert part.component == min(ranks)
            assert part.count == sum(1 for t in full if set(t.consumers) <= ranks)
            assert part.planned == planned[rank]
            assert rows(_rank_plan(packed, rank, unit_size).items) == rows(want)
            for t in part.items:  # the same number and owner on every consumer
                assert agreed.setdefault((t.name, t.start), (t.index, t.owner)) == (
                    t.index,
                    t.owner,
                )


def test_disjoint_groups_plan_alone() -> None:
    """8,192 ranks in groups of 8, each group reading its own file (FSDP loaded on 8x the
    ranks it was saved on): a rank's plan holds its group's units only, numbered from 0."""
    world, per = 8192, 8
    needs: Needs = [
        [(f"__{r // per}_0.distcp", i * 1000, i * 1000 + 900) for i in range(20)]
        for r in range(world)
    ]
    packed = [_pack(n) for n in needs]
    part = _rank_plan(packed, 4100, 256)
    assert part.ranks == list(range(4096, 4104)) and part.component == 4096
    assert part.count == len(part.items) == 20 * 4  # 900 bytes in 4 units of 225
    assert [u.index for u in part.items] == list(range(80))
    assert {u.name for u in part.items} == {"__512_0.distcp"}
    assert all(u.consumers == tuple(range(4096, 4104)) for u in part.items)
    owners = [u.owner for u in part.items]
    assert sorted(owners.count(r) for r in part.ranks) == [10] * 8  # balanced within the group
    assert part.planned == 10 * 225
    # the units of another group are numbered alike: their claim keys differ by the component
    other = _rank_plan(packed, 5, 256)
    assert other.component == 0 and [u.index for u in other.items] == list(range(80))


def test_a_rank_with_nothing_to_share() -> None:
    needs: Needs = [[("a", 0, 10)], [("b", 0, 10)], []]
    for rank in range(3):
        part = _rank_plan(needs, rank)
        assert (part.ranks, part.count, part.items) == ([rank], 0, [])
    assert _rank_plan(needs, 0).planned == 10 and _rank_plan(needs, 2).planned == 0


# --- two groups that share nothing, in one load --------------------------------------------------


def pair_model(pair: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + pair)
    return {
        f"p{pair}.w{i}": torch.randn(n, 96, generator=g, dtype=torch.float32)
        for i, n in enumerate((400, 130, 1, 257))
    }


def w_save_pairs(rank: int, world: int, path: str) -> None:
    """Rank r saves its own keys (``p<r>.*``): the checkpoint's files __0_0 and __1_0."""
    dcp.save(pair_model(rank), checkpoint_id=path)


def w_load_pairs(
    rank: int, world: int, path: str, adaptive: bool, options: LoadOptions
) -> dict[str, Any]:
    """Ranks 0, 1 load pair 0's tensors (file __0_0), ranks 2, 3 pair 1's (file __1_0)."""
    full = pair_model(rank // 2)
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    stats = asyncload.load(
        sd,
        path,
        options=options,
        planner=ShardedLoadPlanner(sharing="always", adaptive=adaptive, unit_size=8 * KiB),
    )
    return {"bad": [k for k in full if not same_bits(sd[k], full[k])], "stats": stats_dict(stats)}


@pytest.mark.timeout(90)
@pytest.mark.distributed
@pytest.mark.parametrize("adaptive", [True, False])
def test_groups_that_share_nothing_claim_apart(tmp_path: Path, adaptive: bool) -> None:
    """Each pair's units are numbered from 0 (each rank plans only its pair): the pairs'
    claims and transfers must not meet. Without hedging (a unit claimed in the wrong pair
    would wait for a transfer that never comes), every byte lands bit for bit, each pair reads
    its tensors once, and every send is received within the pair."""
    path = str(tmp_path / "ck")
    all_ok(run_ranks(w_save_pairs, 2, path))
    options = LoadOptions(
        chunk_size=64 * KiB,
        min_chunk_size=16 * KiB,
        memory_budget=512 * KiB,
        hedge=False,
        collective_timeout=30.0,
    )
    values = all_ok(run_ranks(w_load_pairs, 4, path, adaptive, options, timeout=80))
    for pair in (0, 1):
        total = tensor_bytes(pair_model(pair))
        st = [values[r]["stats"] for r in (2 * pair, 2 * pair + 1)]
        assert [values[r]["bad"] for r in (2 * pair, 2 * pair + 1)] == [[], []]
        assert all(s["bytes_assembled"] == total and s["bytes_hedged"] == 0 for s in st), st
        assert total <= sum(s["bytes_read"] for s in st) <= 1.05 * total + 2 * 64 * KiB, st
        assert sum(s["bytes_sent"] for s in st) == sum(s["bytes_received"] for s in st) > 0, st
