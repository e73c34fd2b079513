"""Adaptive sharing (``ShardedLoadPlanner``, the default): shared ranges cut into units that
the first rank to get there claims through the group's store, a straggler's share taken
over by the others, late transfers read from storage by the consumer itself (first copy
wins), sharing keyed on the checkpoint's identity (not its URL), and the pure parts (the
plan's sweep, units, claim order, the compact all-gather payload).

Multi-rank tests run on gloo process groups of 4 processes (``tests/_dist.py``) against
real checkpoints on local disk and behind real HTTP servers and fault proxies on
127.0.0.1; every rank checks what it loaded bit for bit. They assert bytes and
exactly-once properties, never timings.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import big_model, same_bits, stats_dict, tensor_bytes
from test_sharded_plan import random_ranges

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.distributed.claims import ClaimSlots, _unit_keys
from asyncload.distributed.identity import _check_identities, checkpoint_identity, file_identities
from asyncload.distributed.policy import sharing_policy
from asyncload.distributed.share_plan import Transfer, _pack, _unpack, plan_transfers, split_units
from asyncload.engine import resolve_config
from asyncload.formats import decode_metadata

pytestmark = [pytest.mark.timeout(90), pytest.mark.distributed]

KiB = 1 << 10
OPTIONS = LoadOptions(chunk_size=64 * KiB, min_chunk_size=16 * KiB, memory_budget=512 * KiB)


def save(path: Path) -> str:
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=str(path), no_dist=True)
    return str(path)


def _planner(kind: str, unit_size: int | None) -> ShardedLoadPlanner:
    return ShardedLoadPlanner(sharing="always", adaptive=kind == "adaptive", unit_size=unit_size)


def w_load(
    rank: int,
    world: int,
    urls: list[str],
    kinds: list[str],
    options: LoadOptions,
    unit_size: int | None = None,
    slow_progress: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """Load the replicated model from ``urls[rank]`` once per planner kind (``static`` or
    ``adaptive``); ``slow_progress=(rank, seconds)`` makes that rank's progress callback
    sleep (a slow host: its event loop stalls at every chunk)."""
    import time

    full = big_model()
    out: dict[str, Any] = {}
    for kind in kinds:
        sd = {k: torch.zeros_like(v) for k, v in full.items()}

        def progress(done: int, total: int) -> None:
            if slow_progress is not None and rank == slow_progress[0]:
                time.sleep(slow_progress[1])

        stats = asyncload.load(
            sd, urls[rank], options=options, planner=_planner(kind, unit_size), progress=progress
        )
        out[kind] = {
            "bad": [k for k in full if not same_bits(sd[k], full[k])],
            "stats": stats_dict(stats),
        }
    return out


def _column(values: list[dict[str, Any]], kind: str, field: str) -> list[int]:
    return [v[kind]["stats"][field] for v in values]


def _check_exactly_once(
    values: list[dict[str, Any]], kind: str, total: int, probes: int = 0
) -> None:
    """Bit for bit everywhere; every shared unit read from storage by exactly one rank
    (hedged copies aside); every byte sent was received; every rank got everything."""
    for rank, v in enumerate(values):
        assert v[kind]["bad"] == [], (rank, kind)
        st = v[kind]["stats"]
        assert st["bytes_assembled"] == total
        assert st["bytes_read"] + st["bytes_received"] >= total, (rank, st)
        assert st["peak_buffered_bytes"] <= OPTIONS.memory_budget
        assert st["bytes_taken_over"] <= st["bytes_read"] - st["bytes_hedged"], (rank, st)
    assert sum(_column(values, kind, "bytes_sent")) == sum(_column(values, kind, "bytes_received"))
    once = sum(_column(values, kind, "bytes_read")) - sum(_column(values, kind, "bytes_hedged"))
    assert total <= once <= 1.05 * total + len(values) * probes, once


# --- the same checkpoint through different URLs ---------------------------------------------------


def test_adaptive_reads_each_unit_once_through_different_urls(tmp_path: Path) -> None:
    """Each rank reaches the checkpoint through its own path (copies of one directory: the
    same metadata). The ranks share by identity, so the checkpoint is read once in total,
    and exactly as many bytes as the static plan reads (units claimed once each)."""
    first = save(tmp_path / "ck")
    urls = [first] + [shutil.copytree(first, tmp_path / f"copy{r}") for r in (1, 2, 3)]
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_load, 4, [str(u) for u in urls], ["static", "adaptive"], OPTIONS, 16 * KiB)
    )
    for kind in ("static", "adaptive"):
        _check_exactly_once(values, kind, total)
    static = sum(_column(values, "static", "bytes_read"))
    adaptive = sum(_column(values, "adaptive", "bytes_read")) - sum(
        _column(values, "adaptive", "bytes_hedged")
    )
    assert adaptive == static
    assert sum(_column(values, "static", "bytes_taken_over")) == 0
    assert sum(_column(values, "static", "bytes_hedged")) == 0


def test_adaptive_sharing_of_a_safetensors_file(tmp_path: Path) -> None:
    """A safetensors file (metadata synthesised from its header) is shared the same way:
    each rank through its own copy, read once in total, bit for bit."""
    from safetensors.torch import save_file

    first = tmp_path / "model.safetensors"
    save_file(big_model(), str(first))
    urls = [str(first)]
    for r in (1, 2, 3):  # a mirror keeps the file's name; the directory differs
        (tmp_path / f"mirror{r}").mkdir()
        urls.append(str(shutil.copy(first, tmp_path / f"mirror{r}" / "model.safetensors")))
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_load, 4, urls, ["static", "adaptive"], OPTIONS, 16 * KiB))
    for kind in ("static", "adaptive"):  # each rank probes the file's header itself (64 KiB) first
        _check_exactly_once(values, kind, total, probes=64 * KiB)
    static = sum(_column(values, "static", "bytes_read"))
    assert (
        sum(_column(values, "adaptive", "bytes_read"))
        - sum(_column(values, "adaptive", "bytes_hedged"))
        == static
    )


def test_mismatched_metadata_is_an_error_on_every_rank(tmp_path: Path) -> None:
    """Rank 3 points at another save of the same model (same shapes, another save): every
    rank raises DistributedLoadError naming it, before any byte is shared."""
    good = save(tmp_path / "ck")
    other = save(tmp_path / "other")
    results = run_ranks(w_load, 4, [good, good, good, other], ["adaptive"], OPTIONS, timeout=40)
    for r in results:
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.rank,
            r.status,
            r.message,
        )
        assert "not loading the same checkpoint" in r.message, r.message
        assert "point rank(s) [3] at the same checkpoint" in r.message, r.message
        assert r.attrs["rank"] == 3


# --- ranks that differ in speed ------------------------------------------------------------------


@pytest.fixture
def per_rank_proxies(tmp_path: Path) -> Any:
    """One HTTPRangeServer with the checkpoint; each of 4 ranks reaches it through its own FaultProxy."""
    from asyncload.testing import FaultProxy, HTTPRangeServer

    save(tmp_path / "ck")
    server = HTTPRangeServer(root=tmp_path).start()
    proxies = [FaultProxy(server).start() for _ in range(4)]
    try:
        yield server, proxies
    finally:
        for p in proxies:
            p.stop()
        server.stop()


def test_a_slow_rank_gets_a_smaller_share_and_late_transfers_are_hedged(
    per_rank_proxies: Any,
) -> None:
    """Rank 1's link adds 1 s to every data request. The others take over the units it has
    not started (its share shrinks well below the quarter the plan gave it) and read the
    ones it is still reading themselves once they are late (hedged); every unit is still
    read once apart from those hedges, and every byte lands once in each destination."""
    from asyncload.testing import delay

    server, proxies = per_rank_proxies
    proxies[1].add_rule(delay(1.0), data_only=True, times=None)
    urls = [server.url("ck", endpoint_url=p.endpoint_url) for p in proxies]
    options = OPTIONS.replace(hedge_min_delay=0.05, timeout=20.0)
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_load, 4, urls, ["adaptive"], options, None, timeout=80))
    for rank, v in enumerate(values):
        assert v["adaptive"]["bad"] == [], rank
        st = v["adaptive"]["stats"]
        assert st["bytes_read"] + st["bytes_received"] >= total, (rank, st)
    reads = _column(values, "adaptive", "bytes_read")
    hedged = _column(values, "adaptive", "bytes_hedged")
    once = [r - h for r, h in zip(reads, hedged)]
    assert once[1] < 0.7 * (total / 4), once  # the plan gave it a quarter
    assert once[1] < min(once[r] for r in (0, 2, 3)), once
    assert sum(_column(values, "adaptive", "bytes_taken_over")) > 0
    assert sum(h for r, h in enumerate(hedged) if r != 1) > 0, (
        values
    )  # the others read its late units
    assert total <= sum(once) <= 1.05 * total, once
    assert sum(_column(values, "adaptive", "bytes_sent")) == sum(
        _column(values, "adaptive", "bytes_received")
    )


def test_a_slow_host_falls_behind_alone(tmp_path: Path) -> None:
    """Rank 2's event loop stalls 30 ms at every chunk it assembles (a busy host): it claims
    less than the quarter the plan gave it and less than the other ranks on average, and
    everything still lands bit for bit. (Which of the fast ranks takes over what varies:
    since ranks return before their peers, they no longer wait for each other's sends, so
    one of them may take over much of another's queue.)"""
    path = save(tmp_path / "ck")
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_load, 4, [path] * 4, ["adaptive"], OPTIONS, 16 * KiB, (2, 0.03), timeout=80)
    )
    _check_exactly_once(values, "adaptive", total)
    once = [
        r - h
        for r, h in zip(
            _column(values, "adaptive", "bytes_read"), _column(values, "adaptive", "bytes_hedged")
        )
    ]
    assert once[2] < total / 4, once
    assert once[2] < sum(once[r] for r in (0, 1, 3)) / 3, once


def test_adaptive_under_the_smallest_memory_budget(tmp_path: Path) -> None:
    """memory_budget at its minimum (64 KiB: one chunk in flight) with 16 KiB units: no
    deadlock, bit for bit, every unit read once."""
    path = save(tmp_path / "ck")
    total = tensor_bytes(big_model())
    tiny = OPTIONS.replace(memory_budget=64 * KiB, concurrency=2)
    values = all_ok(run_ranks(w_load, 4, [path] * 4, ["adaptive"], tiny, 16 * KiB, timeout=80))
    _check_exactly_once(values, "adaptive", total)


# --- the pure parts --------------------------------------------------------------------------------


def _brute_force(
    needs: list[list[tuple[str, int, int]]],
) -> dict[tuple[str, int], tuple[int, ...]]:
    """Who needs each byte of each file, byte by byte."""
    out: dict[tuple[str, int], set[int]] = {}
    for r, ranges in enumerate(needs):
        for name, s, e in ranges:
            for b in range(s, e):
                out.setdefault((name, b), set()).add(r)
    return {k: tuple(sorted(v)) for k, v in out.items()}


@pytest.mark.parametrize("seed", range(12))
def test_plan_transfers_on_random_layouts(seed: int) -> None:
    """Against a byte-by-byte reference: every byte two or more ranks need is in exactly one
    transfer whose consumers are exactly those ranks; no transfer crosses a range boundary
    of a consumer; bytes one rank needs are that rank's own read; the owner is a consumer."""
    rng = random.Random(seed)
    world = rng.randint(2, 9)
    needs: list[list[tuple[str, int, int]]] = []
    for _ in range(world):
        needs.append([r for name in ("a", "b") for r in random_ranges(rng, name, 20, 300, 40, 15)])
    who = _brute_force(needs)
    transfers, load = plan_transfers(needs)
    seen: dict[tuple[str, int], int] = {}
    for t in transfers:
        assert t.owner in t.consumers and len(t.consumers) >= 2
        for b in range(t.start, t.end):
            assert (t.name, b) not in seen
            seen[(t.name, b)] = t.index
            assert who[(t.name, b)] == t.consumers
        for r in t.consumers:
            assert any(n == t.name and s <= t.start and t.end <= e for n, s, e in needs[r]), (t, r)
    assert set(seen) == {k for k, v in who.items() if len(v) >= 2}
    assert plan_transfers([_pack(n) for n in needs]) == (
        transfers,
        load,
    )  # the packed form, as gathered
    alone = [0] * world
    for v in who.values():
        if len(v) == 1:
            alone[v[0]] += 1
    owned = [0] * world
    for t in transfers:
        owned[t.owner] += t.nbytes
    assert load == [a + o for a, o in zip(alone, owned)]
    assert [t.index for t in transfers] == list(range(len(transfers)))
    assert [(t.name, t.start) for t in transfers] == sorted((t.name, t.start) for t in transfers)


def test_plan_transfers_replicated_many_ranks_shares_one_consumer_tuple() -> None:
    """512 ranks needing the same 64 ranges: 64 transfers, owners spread evenly, and the
    consumers of every transfer are one shared tuple (sorted once, not once per range)."""
    needs = [[("f", i * 100, (i + 1) * 100) for i in range(64)] for _ in range(512)]
    transfers, load = plan_transfers(needs)
    assert len(transfers) == 64
    assert all(t.consumers is transfers[0].consumers for t in transfers)
    assert transfers[0].consumers == tuple(range(512))
    assert sorted({t.owner for t in transfers}) == list(range(64))
    assert sum(load) == 6400


def test_split_units() -> None:
    t = [Transfer(0, "f", 0, 10, 1, (0, 1)), Transfer(1, "f", 10, 13, 0, (0, 1, 2))]
    units = split_units(t, 4)
    assert [(u.index, u.start, u.end, u.owner, u.consumers) for u in units] == [
        (0, 0, 3, 1, (0, 1)),
        (1, 3, 6, 1, (0, 1)),
        (2, 6, 10, 1, (0, 1)),
        (3, 10, 13, 0, (0, 1, 2)),
    ]


def test_unit_keys_own_queue_first_then_others_from_the_back() -> None:
    units = [Transfer(i, "f", i, i + 1, i % 2, (0, 1)) for i in range(6)]
    keys = _unit_keys(units, 0)
    assert sorted(keys, key=keys.__getitem__) == [0, 2, 4, 5, 3, 1]
    assert _unit_keys(units, 2) == {}


def test_slots_serve_the_lowest_key_first() -> None:
    async def main() -> list[int]:
        slots = ClaimSlots(1)
        got: list[int] = []
        await slots.acquire(0)

        async def take(key: int) -> None:
            await slots.acquire(key)
            got.append(key)
            slots.release()

        tasks = [asyncio.create_task(take(k)) for k in (5, 3, 9, 1)]
        cancelled = asyncio.create_task(take(0))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.statistics().used == 0
        return got

    assert asyncio.run(main()) == [1, 3, 5, 9]


def test_payload_round_trip_and_size() -> None:
    needs = [("__0_0.distcp", i * 1000, i * 1000 + 700) for i in range(1000)] + [("x", 5, 9)]
    packed = _pack(needs)
    assert _unpack(packed) == sorted(needs)
    assert sum(len(v) for v in packed.values()) == 16 * len(needs)


def test_checkpoint_identity_follows_the_metadata_not_the_path(tmp_path: Path) -> None:
    a = save(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "b")
    c = save(tmp_path / "c")
    mds = [
        decode_metadata((Path(p) / ".metadata").read_bytes(), str(p), max_size=1 << 30)
        for p in (a, b, c)
    ]
    ids = [checkpoint_identity(md) for md in mds]
    assert ids[0] == ids[1] != ids[2]
    files = [file_identities(md) for md in mds]
    assert sorted(files[0]) == ["__0_0.distcp"]
    _check_identities([files[0], files[1], files[0]], 0)
    _check_identities(
        [files[0], {}, files[2] and {"other.distcp": "x"}], 0
    )  # no file in common: nothing to compare
    with pytest.raises(
        asyncload.distributed.DistributedLoadError,
        match=r"point rank\(s\) \[2\] at the same checkpoint",
    ) as err:
        _check_identities([files[0], files[0], files[2]], 1)
    assert err.value.rank == 2
    assert "different things about __0_0.distcp" in str(err.value)


def test_planner_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="unit_size=0"):
        ShardedLoadPlanner(sharing="always", unit_size=0)
    with pytest.raises(ValueError, match="adaptive='yes'"):
        ShardedLoadPlanner(sharing="always", adaptive="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wait_for_peers=1"):
        ShardedLoadPlanner(sharing="always", wait_for_peers=1)  # type: ignore[arg-type]


def _policy(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "transport": "thread",
        "ordered": None,
        "adaptive": None,
        "unit_size": None,
        "wait_for_peers": False,
        "collective_timeout": 5.0,
    }
    args.update(kw)
    options = args.pop("options", LoadOptions(hedge_min_delay=None))
    return sharing_policy(resolve_config(options), **args)


def test_sharing_policy_resolves_the_knobs_once() -> None:
    p = _policy()
    assert (p.adaptive, p.ordered, p.returns_early) == (True, False, True)
    # the unit is decided per phase from measured figures (test_sharing_decisions.py)
    assert p.unit_size is None and _policy(unit_size=1000).unit_size == 1000
    # the floor of a transfer's hedge is explicit (hedge_min_delay or its default), never derived
    assert not p.hedge.derived and p.hedge.min_delay == 0.5
    nccl = _policy(transport="poll")
    assert (nccl.adaptive, nccl.ordered, nccl.returns_early) == (False, True, False)
    assert not _policy(wait_for_peers=True).returns_early
    custom = _policy(custom_plan=plan_transfers)
    assert not custom.adaptive and _policy(custom_plan=plan_transfers, adaptive=True).adaptive
    with pytest.raises(asyncload.AsyncLoadError, match=r"adaptive=True\) cannot run with ordered"):
        _policy(transport="poll", adaptive=True)


def test_a_late_transfer_is_hedged_by_the_storage_reads_rule() -> None:
    """Cross-rank transfers are hedged by ``asyncload.common.latency.hedge_delay`` over this rank's
    own unit reads: four times the floor before four reads, then factor x their p90."""
    from asyncload.common.latency import LoadClock, hedge_delay

    hedge = _policy().hedge
    clock = LoadClock()
    assert hedge_delay(hedge, clock, 16 * KiB) == 4 * hedge.min_delay
    for _ in range(4):
        clock.finished(1.0, 16 * KiB)
    assert hedge_delay(hedge, clock, 16 * KiB) == hedge.factor * 1.0
    assert hedge_delay(_policy(options=LoadOptions(hedge=False)).hedge, clock, 16 * KiB) is None
