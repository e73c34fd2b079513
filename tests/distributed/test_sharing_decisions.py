"""Issue 29, items 1 and 5: ``ShardedLoadPlanner()``'s defaults decide whether sharing pays
(a local disk reads, an object store shares) and choose the work unit from what was measured;
and ranks asking for different keys share a byte only among the ranks that need it.

The cost model itself is pure (``decide_sharing``) and tested without processes; the loads run
on gloo process groups of 2-3 processes (``tests/_dist.py``) against checkpoints on local disk
and behind a real HTTP range server on 127.0.0.1. Every rank checks what it loaded bit for bit;
the tests assert decisions, bytes and consumers, never timings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import same_bits

import asyncload
from asyncload import ShardedLoadPlanner
from asyncload.distributed.policy import (
    LOCAL_RATE,
    MIN_SHARED_BYTES,
    REMOTE_RATE,
    UNIT_SIZE,
    RankEstimate,
    decide_sharing,
    sharing_policy,
)
from asyncload.engine import resolve_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB, MiB = 1 << 10, 1 << 20
KEYS = [f"k{i:02d}" for i in range(12)]


# --- the cost model (pure) -------------------------------------------------------------------


def _policy(**kw: Any) -> Any:
    knobs: dict[str, Any] = {
        "transport": "thread",
        "ordered": None,
        "adaptive": None,
        "unit_size": None,
        "wait_for_peers": False,
        "collective_timeout": None,
    }
    knobs.update(kw)
    return sharing_policy(resolve_config(asyncload.LoadOptions()), **knobs)


def _est(remote: bool, need: int, latency: float | None = None, rate: float | None = None) -> Any:
    return RankEstimate(remote=remote, latency=latency, stream_rate=rate, need=need)


def test_a_local_disk_reads_and_an_object_store_shares() -> None:
    local = decide_sharing(_policy(), [_est(False, 80 * MiB)] * 2, 16 * MiB)
    assert not local.share and local.reason.startswith("read: local file")
    remote = decide_sharing(_policy(), [_est(True, 80 * MiB)] * 4, 16 * MiB)
    assert remote.share and remote.reason.startswith("share: object store")
    # one remote rank among local ones: the slowest rank's storage is what sharing helps
    mixed = decide_sharing(_policy(), [_est(False, 80 * MiB), _est(True, 80 * MiB)], 16 * MiB)
    assert mixed.share
    assert LOCAL_RATE > (1 << 30) > REMOTE_RATE  # the model's premise (docs/distributed.md)


def test_the_knob_and_a_custom_plan_override_the_model() -> None:
    ests = [_est(False, 80 * MiB)] * 2
    assert decide_sharing(_policy(sharing="always"), ests, 16 * MiB).share
    assert not decide_sharing(_policy(sharing="never"), [_est(True, 80 * MiB)] * 2, 16 * MiB).share
    custom = decide_sharing(_policy(custom_plan=lambda needs: ([], [0])), ests, 16 * MiB)
    assert custom.share and "plan_transfers is overridden" in custom.reason
    # a later phase keeps the first phase's decision and its reason
    later = decide_sharing(_policy(), ests, 16 * MiB, share=True, why="because")
    assert later.share and later.why == "because"
    with pytest.raises(ValueError, match="sharing='sometimes'"):
        ShardedLoadPlanner(sharing="sometimes")


def test_the_unit_follows_latency_and_rate_within_its_bounds() -> None:
    policy = _policy()
    # 4 x 20 ms x 32 MiB/s = 2.5 MiB, under the cap of 80 MiB / (2 x 8) = 5 MiB
    got = decide_sharing(policy, [_est(True, 80 * MiB, 0.02, 32 * MiB)] * 2, 16 * MiB)
    assert got.unit_size == (int(4 * 0.02 * 32 * MiB) // 4096) * 4096
    # the slowest rank's latency counts
    slow = decide_sharing(
        policy,
        [_est(True, 80 * MiB, 0.002, 32 * MiB), _est(True, 80 * MiB, 0.02, 32 * MiB)],
        16 * MiB,
    )
    assert slow.unit_size == got.unit_size
    # capped: at least 8 units a rank's share, at most chunk_size, at least UNIT_SIZE
    assert (
        decide_sharing(policy, [_est(True, 80 * MiB, 1.0, 64 * MiB)] * 2, 16 * MiB).unit_size
        == 5 * MiB
    )
    assert (
        decide_sharing(policy, [_est(True, 800 * MiB, 1.0, 64 * MiB)] * 2, 4 * MiB).unit_size
        == 4 * MiB
    )
    assert (
        decide_sharing(policy, [_est(True, 80 * MiB, 1e-4, 1 * MiB)] * 2, 16 * MiB).unit_size
        == UNIT_SIZE
    )
    # an explicit unit_size is kept
    given = _policy(unit_size=64 * KiB, sharing="always")
    assert decide_sharing(given, [_est(False, 80 * MiB)] * 2, 16 * MiB).unit_size == 64 * KiB
    # a phase of a few KiB (record headers) is read alone; the load still shares
    small = decide_sharing(policy, [_est(True, MIN_SHARED_BYTES - 1)] * 2, 16 * MiB)
    assert small.share and small.unit_size == 0


def test_needs_are_pieces_and_gaps_others_need_are_not_read() -> None:
    """A chunk that reads through a gap announces only its pieces; its reads leave out the
    gap when another rank needs those bytes, and keep it when nobody does."""
    from asyncload.distributed.share_plan import Chunk, Piece, _advertise, _needs, _parts_for

    k = 64 * KiB  # gaps larger than HEADER_GAP (smaller ones are headers: announced too)
    c = Chunk("f", 0, 300 * k, [Piece("f", 0, 100 * k), Piece("f", 200 * k, 300 * k)])
    adv = _advertise([c])
    mine = [("f", 0, 100 * k), ("f", 200 * k, 300 * k)]
    assert _needs([c], adv) == mine
    parts = _parts_for([c], adv, [], 0, [mine, [("f", 120 * k, 180 * k)]])[0]
    assert parts is not None
    assert [(p.start, p.end, p.kind) for p in parts] == [
        (0, 100 * k, "read"),
        (200 * k, 300 * k, "read"),
    ]
    assert _parts_for([c], adv, [], 0, [mine, [("f", 400 * k, 500 * k)]]) == [None]
    # headers between pieces are needs: ranks reading both records share them
    h = Chunk("f", 0, 300, [Piece("f", 0, 100), Piece("f", 200, 300)])
    assert _needs([h], _advertise([h])) == [("f", 0, 300)]


# --- loads ------------------------------------------------------------------------------------


def _model(size: int = 256) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(29)
    return {k: torch.randn(size, size, generator=g) for k in KEYS}


def _save(path: Path, size: int = 256) -> str:
    dcp.save(_model(size), checkpoint_id=str(path), no_dist=True)
    return str(path)


def _extents(path: str) -> dict[str, tuple[int, int]]:
    """Each key's record: [offset, end) in the (single) data file."""
    md = dcp.FileSystemReader(path).read_metadata()
    return {i.fqn: (s.offset, s.offset + s.length) for i, s in md.storage_data.items()}


class _Recording(ShardedLoadPlanner):
    """Adaptive sharing (``adaptive=True``), default owners; keeps every phase's transfers."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(adaptive=True, **kw)
        self.seen: list[tuple[str, int, int, tuple[int, ...]]] = []

    def plan_transfers(self, needs: Any) -> Any:
        transfers, load = super().plan_transfers(needs)
        self.seen.extend((t.name, t.start, t.end, t.consumers) for t in transfers)
        return transfers, load


#: No gap read through (``max_over_read_ratio=1.0``): storage bytes are then exactly the keys'.
EXACT = asyncload.LoadOptions(max_over_read_ratio=1.0)


def w_keys(
    rank: int,
    world: int,
    urls: list[str],
    wanted: list[list[str]],
    size: int,
    kind: str,
    options: asyncload.LoadOptions | None = None,
) -> dict[str, Any]:
    full = _model(size)
    sd = {k: torch.zeros_like(full[k]) for k in wanted[rank]}
    planner: ShardedLoadPlanner
    if kind == "record":
        planner = _Recording(sharing="always")
    elif kind == "default":
        planner = ShardedLoadPlanner()
    else:
        planner = ShardedLoadPlanner(sharing=kind)
    stats = asyncload.load(sd, urls[rank], planner=planner, options=options)
    bad = [k for k in sd if not same_bits(sd[k], full[k])]
    planner.wait_for_background_sends(30)
    return {
        "bad": bad,
        "stats": dataclasses.asdict(stats),
        "seen": getattr(planner, "seen", []),
    }


def test_default_on_a_local_disk_reads_without_sharing(tmp_path: Path) -> None:
    """Warm local disk: gloo sends are slower than reading, so every rank reads its own bytes
    (as PipelinedLoadPlanner would) and LoadStats says why."""
    path = _save(tmp_path / "ck")
    values = all_ok(run_ranks(w_keys, 2, [path, path], [KEYS, KEYS], 256, "default"))
    whole = asyncload.load({k: torch.zeros(256, 256) for k in KEYS}, path).bytes_read
    for v in values:
        s = v["stats"]
        assert v["bad"] == []
        assert s["sharing_decision"] == "read" and "local file" in s["sharing_reason"]
        assert s["bytes_received"] == s["bytes_sent"] == 0
        assert s["bytes_read"] == whole


def test_default_on_an_object_store_shares_with_a_measured_unit(tmp_path: Path) -> None:
    """Over HTTP the default shares: the checkpoint is read about once in all, in units of at
    least UNIT_SIZE chosen from the latency measured in the header phase."""
    from asyncload.testing import HTTPRangeServer

    _save(tmp_path / "ck", size=512)  # 12 MiB: the data phase is worth sharing
    server = HTTPRangeServer(root=tmp_path).start()
    try:
        url = server.url("ck")
        values = all_ok(run_ranks(w_keys, 2, [url, url], [KEYS, KEYS], 512, "default"))
    finally:
        server.stop()
    total = sum(hi - lo for lo, hi in _extents(str(tmp_path / "ck")).values())
    stats = [v["stats"] for v in values]
    assert [v["bad"] for v in values] == [[], []]
    assert {s["sharing_decision"] for s in stats} == {"share"}, stats[0]["sharing_reason"]
    assert all("object store" in s["sharing_reason"] for s in stats)
    assert len({s["sharing_unit_size"] for s in stats}) == 1  # agreed
    assert stats[0]["sharing_unit_size"] >= UNIT_SIZE
    read = sum(s["bytes_read"] - s["bytes_hedged"] for s in stats)
    # the data once, plus each rank's own header probes (a phase too small to share)
    assert total <= read <= total * 1.05
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) > 0


def _check_consumers(
    seen: list[tuple[str, int, int, tuple[int, ...]]],
    wanted: list[list[str]],
    extents: dict[str, tuple[int, int]],
) -> None:
    """Every transfer's consumers are exactly the ranks that asked for a key whose record
    holds its bytes."""
    assert seen
    for _name, start, end, consumers in seen:
        need = {
            r
            for r, keys in enumerate(wanted)
            if any(extents[k][0] < end and start < extents[k][1] for k in keys)
        }
        assert set(consumers) == need, (start, end, consumers, need)


@pytest.mark.parametrize("world", [2, 3])
def test_key_subsets_share_only_among_ranks_that_need_them(tmp_path: Path, world: int) -> None:
    """Ranks ask for different keys (every key wanted by 1 to `world` ranks, some by none):
    each transfer's consumers are exactly the ranks whose keys hold it, a rank receives only
    bytes of its own keys, and every byte of the keys asked for is read from storage once (no
    gap read through: ``max_over_read_ratio=1.0``)."""
    path = _save(tmp_path / "ck")
    wanted = [
        [k for i, k in enumerate(KEYS) if i % (r + 2) != 1 and i != 11] for r in range(world)
    ]
    values = all_ok(run_ranks(w_keys, world, [path] * world, wanted, 256, "record", EXACT))
    extents = _extents(path)
    assert [v["bad"] for v in values] == [[]] * world
    for v in values:
        _check_consumers(v["seen"], wanted, extents)
    stats = [v["stats"] for v in values]
    for r, s in enumerate(stats):
        own = sum(extents[k][1] - extents[k][0] for k in wanted[r])
        assert s["bytes_received"] <= own
        assert s["bytes_read"] + s["bytes_received"] >= 256 * 256 * 4 * len(wanted[r])
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) > 0
    union = sorted({k for keys in wanted for k in keys})
    once = asyncload.load(
        {k: torch.zeros(256, 256) for k in union}, path, options=EXACT
    ).bytes_read
    assert sum(s["bytes_read"] - s["bytes_hedged"] for s in stats) == once


def test_a_gap_read_through_is_not_shared(tmp_path: Path) -> None:
    """Over HTTP a rank reads through a small gap (a key it did not ask for) rather than make
    one more request; the other ranks share that key between themselves, and the rank that
    reads through it is no consumer of it: it receives only bytes of its own keys."""
    from asyncload.testing import HTTPRangeServer

    _save(tmp_path / "ck", size=512)  # 1 MiB a key: under the gap the cost model reads through
    server = HTTPRangeServer(root=tmp_path).start()
    wanted = [KEYS, [k for k in KEYS if k != "k05"], KEYS]
    try:
        url = server.url("ck")
        values = all_ok(run_ranks(w_keys, 3, [url] * 3, wanted, 512, "record"))
    finally:
        server.stop()
    extents = _extents(str(tmp_path / "ck"))
    assert [v["bad"] for v in values] == [[]] * 3
    for v in values:
        _check_consumers(v["seen"], wanted, extents)
    k05 = extents["k05"]
    assert any(c == (0, 2) and s < k05[1] and k05[0] < e for _, s, e, c in values[0]["seen"])
    own = sum(extents[k][1] - extents[k][0] for k in wanted[1])
    assert values[1]["stats"]["bytes_received"] <= own
    # rank 1 does not read k05 itself beside the rank that reads it for ranks 0 and 2
    total = sum(hi - lo for lo, hi in extents.values())
    read = sum(v["stats"]["bytes_read"] - v["stats"]["bytes_hedged"] for v in values)
    assert total <= read < total + (k05[1] - k05[0])
