"""Multi-rank loading: DTensor, ShardedTensor and replicated tensors on gloo process groups
of 2 to 4 processes (spawned per test by ``tests/_dist.py``), resharding between rank
counts and meshes, narrow reads, ShardedLoadPlanner's read-once sharing, and failures
and stalls of one rank surfacing on every rank within a bounded time.

Every rank compares what it loaded with the full tensors that were saved, bit for bit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks

import asyncload
from asyncload import LoadOptions, PipelinedLoadPlanner, PipelinedReader, ShardedLoadPlanner
from asyncload.distributed.share_plan import plan_transfers

pytestmark = [pytest.mark.timeout(60), pytest.mark.distributed]

KiB = 1 << 10

# --- the saved model -----------------------------------------------------------------------------


def model_tensors() -> dict[str, torch.Tensor]:
    """Full tensors of a small model: several dtypes, shapes that split evenly and unevenly."""
    g = torch.Generator().manual_seed(1234)
    return {
        "emb": torch.randn(64, 48, generator=g),
        "w1": torch.randn(48, 64, generator=g).to(torch.bfloat16),
        "w2": torch.randint(-(2**31), 2**31 - 1, (50, 36), generator=g, dtype=torch.int64),
        "w3": torch.randn(36, 30, generator=g, dtype=torch.float64),
        "norm": torch.randn(64, generator=g),
    }


def big_model() -> dict[str, torch.Tensor]:
    """Replicated-load model: 8 matrices of 256 KiB and 8 small norms (about 2 MiB)."""
    g = torch.Generator().manual_seed(99)
    out: dict[str, torch.Tensor] = {}
    for i in range(8):
        out[f"layers.{i}.w"] = torch.randn(256, 256, generator=g)
        out[f"layers.{i}.norm"] = torch.randn(256, generator=g)
    return out


def narrow_model() -> dict[str, torch.Tensor]:
    """Four matrices of 4 MiB, for the bytes-read bounds of narrow reads."""
    g = torch.Generator().manual_seed(7)
    return {f"m{i}": torch.randn(1024, 1024, generator=g) for i in range(4)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))
    )


def tensor_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def stats_dict(s: asyncload.LoadStats) -> dict[str, int]:
    return {
        "bytes_read": s.bytes_read,
        "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received,
        "bytes_assembled": s.bytes_assembled,
        "peak_buffered_bytes": s.peak_buffered_bytes,
        "bytes_taken_over": s.bytes_taken_over,
        "bytes_hedged": s.bytes_hedged,
    }


def save_single(path: Path, sd: dict[str, torch.Tensor]) -> None:
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(path), no_dist=True)


# --- placements and meshes, named so that they pickle ---------------------------------------------


def _placements(spec: str, ndim: int) -> list[Any]:
    """``"S0,R"`` -> ``[Shard(0), Replicate()]``; a shard dim beyond ``ndim`` becomes the last dim."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(min(int(p[1:]), ndim - 1)) for p in spec.split(",")]


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _local_box(full: torch.Tensor, mesh: Any, placements: list[Any]) -> torch.Tensor:
    """This rank's piece of ``full`` under ``placements`` (torch's own rule, no communication)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _dtensors(
    full: dict[str, torch.Tensor], mesh: Any, spec: str, *, zeros: bool
) -> dict[str, Any]:
    """DTensors laid out as ``spec`` holding ``full`` (or zeros), built from local pieces."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in full.items():
        placements = _placements(spec, v.dim())
        local = _local_box(v, mesh, placements)
        local = torch.zeros_like(local) if zeros else local.clone()
        out[k] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=v.shape, stride=v.stride()
        )
    return out


def _expected_local(
    full: dict[str, torch.Tensor], mesh: Any, spec: str
) -> dict[str, torch.Tensor]:
    return {k: v.to_local() for k, v in _dtensors(full, mesh, spec, zeros=False).items()}


class Rank0ReadsEverything(ShardedLoadPlanner):
    """A custom plan: rank 0 owns every shared range (the others only receive)."""

    def plan_transfers(self, needs: Any) -> Any:
        import dataclasses

        transfers, load = super().plan_transfers(needs)
        moved = [dataclasses.replace(t, owner=0) if 0 in t.consumers else t for t in transfers]
        load = [0] * len(needs)
        for t in moved:
            load[t.owner] += t.nbytes
        return moved, load


def _make_planner(kind: str, **kw: Any) -> Any:
    if kind == "rank0":
        return Rank0ReadsEverything(**kw)
    if kind == "sharded":
        return ShardedLoadPlanner(sharing="always", **kw)
    if kind == "sharded-ordered":
        return ShardedLoadPlanner(sharing="always", ordered=True, side_group=None, **kw)
    if kind == "sharded-static":
        return ShardedLoadPlanner(sharing="always", adaptive=False, **kw)
    if kind == "sharded-wait":
        return ShardedLoadPlanner(sharing="always", wait_for_peers=True, **kw)
    return PipelinedLoadPlanner(**kw)


def _load_into(
    sd: dict[str, Any],
    path: str,
    entry: str,
    planner_kind: str,
    options: LoadOptions | None = None,
) -> asyncload.LoadStats:
    if entry == "load":
        return asyncload.load(sd, path, options=options, planner=_make_planner(planner_kind))
    if entry == "aload":
        import asyncio

        return asyncio.run(
            asyncload.aload(sd, path, options=options, planner=_make_planner(planner_kind))
        )
    kw = {}
    if options is not None:
        kw = {"options": options}
    reader = PipelinedReader(path, options=options)
    dcp.load(sd, storage_reader=reader, planner=_make_planner(planner_kind, **kw))
    assert reader.stats is not None
    return reader.stats


# --- workers (run on every rank; module level so that they pickle) ---------------------------------


def w_save_dtensor(
    rank: int, world: int, path: str, mesh_shape: tuple[int, ...], spec: str
) -> None:
    mesh = _mesh(mesh_shape)
    sd = _dtensors(model_tensors(), mesh, spec, zeros=False)
    dcp.save(sd, checkpoint_id=path)


def w_load_dtensor(
    rank: int,
    world: int,
    path: str,
    mesh_shape: tuple[int, ...],
    spec: str,
    variants: list[tuple[str, str]],
) -> dict[str, Any]:
    """Load ``path`` into zeroed DTensors laid out as ``spec`` on ``mesh_shape``, once per
    ``(entry, planner)`` variant; report which keys match the saved tensors bit for bit."""
    mesh = _mesh(mesh_shape)
    full = model_tensors()
    want = _expected_local(full, mesh, spec)
    out: dict[str, Any] = {}
    for entry, planner_kind in variants:
        sd = _dtensors(full, mesh, spec, zeros=True)
        stats = _load_into(sd, path, entry, planner_kind)
        bad = [k for k in full if not same_bits(sd[k].to_local(), want[k])]
        out[f"{entry}/{planner_kind}"] = {"bad": bad, "stats": stats_dict(stats)}
    return out


def w_load_narrow(
    rank: int,
    world: int,
    path: str,
    spec: str,
    options: LoadOptions | None,
    entry: str,
    planner_kind: str,
    mesh_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    mesh = _mesh(mesh_shape or (world,))
    full = narrow_model()
    want = _expected_local(full, mesh, spec)
    sd = _dtensors(full, mesh, spec, zeros=True)
    stats = _load_into(sd, path, entry, planner_kind, options)
    return {
        "bad": [k for k in full if not same_bits(sd[k].to_local(), want[k])],
        "stats": stats_dict(stats),
    }


def _share_threads(wait: float = 2.0) -> int:
    """asyncload's transfer-waiting threads still alive (none after a load that succeeded on
    every rank: background sends land and their drain ends once every rank has finished)."""
    import threading

    deadline = time.monotonic() + wait
    while True:
        n = sum(1 for t in threading.enumerate() if t.name.startswith("asyncload-share"))
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def w_load_replicated(
    rank: int, world: int, path: str, planner_kind: str, entry: str, options: LoadOptions | None
) -> dict[str, Any]:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    stats = _load_into(sd, path, entry, planner_kind, options)
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "stats": stats_dict(stats),
        "threads": _share_threads(),
    }


# --- resharding, bit for bit -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_4x_shard0(tmp_path_factory: pytest.TempPathFactory) -> str:
    """model_tensors() saved by 4 ranks as DTensors with Shard(0)."""
    path = str(tmp_path_factory.mktemp("dist") / "4x_shard0")
    all_ok(run_ranks(w_save_dtensor, 4, path, (4,), "S0"))
    assert sorted(p for p in os.listdir(path) if p.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(4)
    ]
    return path


def test_reshard_4_to_2_shard0_to_shard1(ckpt_4x_shard0: str) -> None:
    variants = [
        ("load", "pipelined"),
        ("load", "sharded"),
        ("dcp", "pipelined"),
        ("dcp", "sharded"),
    ]
    values = all_ok(run_ranks(w_load_dtensor, 2, ckpt_4x_shard0, (2,), "S1", variants))
    for rank, value in enumerate(values):
        for variant, res in value.items():
            assert res["bad"] == [], (rank, variant)


def test_reshard_4_to_1_plain_tensors(ckpt_4x_shard0: str) -> None:
    full = model_tensors()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    asyncload.load(sd, ckpt_4x_shard0)
    assert [k for k in full if not same_bits(sd[k], full[k])] == []


def test_reshard_1_to_4_shard0_and_replicated(tmp_path: Path) -> None:
    save_single(tmp_path / "ck", model_tensors())
    variants = [("load", "pipelined"), ("dcp", "sharded")]
    for spec in ("S0", "R"):
        values = all_ok(run_ranks(w_load_dtensor, 4, str(tmp_path / "ck"), (4,), spec, variants))
        for rank, value in enumerate(values):
            for variant, res in value.items():
                assert res["bad"] == [], (spec, rank, variant)


def test_reshard_2d_mesh(tmp_path: Path) -> None:
    """Saved on a 2x2 mesh as (Shard(0), Shard(1)); loaded on 2x2 as (Shard(1), Replicate())
    and on 2 ranks as Shard(0)."""
    path = str(tmp_path / "2d")
    all_ok(run_ranks(w_save_dtensor, 4, path, (2, 2), "S0,S1"))
    variants = [("load", "pipelined"), ("load", "sharded")]
    values = all_ok(run_ranks(w_load_dtensor, 4, path, (2, 2), "S1,R", variants))
    for rank, value in enumerate(values):
        for variant, res in value.items():
            assert res["bad"] == [], (rank, variant)
    values = all_ok(run_ranks(w_load_dtensor, 2, path, (2,), "S0", [("load", "sharded")]))
    assert [v["load/sharded"]["bad"] for v in values] == [[], []]


# --- narrow reads ----------------------------------------------------------------------------------


def test_narrow_reads_row_shards_read_a_quarter(tmp_path: Path) -> None:
    """A single-process checkpoint loaded on 4 ranks with Shard(0): each rank reads about a
    quarter of the tensor bytes (plus record header probes), not all of it."""
    full = narrow_model()
    save_single(tmp_path / "ck", full)
    total = tensor_bytes(full)
    probes = len(full) * 8 * KiB  # head and tail probe of each record
    values = all_ok(
        run_ranks(w_load_narrow, 4, str(tmp_path / "ck"), "S0", None, "load", "pipelined")
    )
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert total // 4 <= v["stats"]["bytes_read"] <= 0.30 * total + probes, (
            rank,
            v["stats"],
            total,
        )
        assert v["stats"]["bytes_received"] == 0 and v["stats"]["bytes_sent"] == 0


def test_narrow_reads_2d_mesh_replicas_share(tmp_path: Path) -> None:
    """On a 2x2 mesh with (Shard(0), Replicate()), ranks {0, 1} need the top half of every
    matrix and {2, 3} the bottom half. Each rank needs half of the bytes; with
    ShardedLoadPlanner each pair reads its half once between them: about a quarter per rank,
    the other quarter received from its partner, nothing from the other pair."""
    full = narrow_model()
    save_single(tmp_path / "ck", full)
    total = tensor_bytes(full)
    probes = len(full) * 8 * KiB
    values = all_ok(
        run_ranks(
            w_load_narrow,
            4,
            str(tmp_path / "ck"),
            "S0,R",
            SHARE_OPTIONS,
            "load",
            "sharded",
            (2, 2),
        )
    )
    for rank, v in enumerate(values):
        st = v["stats"]
        assert v["bad"] == [], rank
        assert st["bytes_read"] + st["bytes_received"] >= total // 2, (rank, st)
        assert st["bytes_read"] - st["bytes_hedged"] <= 0.50 * total + probes, (rank, st)
        assert st["peak_buffered_bytes"] <= SHARE_OPTIONS.memory_budget
    sent = sum(v["stats"]["bytes_sent"] for v in values)
    assert sent == sum(v["stats"]["bytes_received"] for v in values)
    for pair in ((0, 1), (2, 3)):
        # tensor data does not cross between the pairs (record headers, which all four need, may)
        received = sum(values[r]["stats"]["bytes_received"] for r in pair)
        assert received <= 0.50 * total + 2 * probes, (pair, received)
        # each pair reads its half once between them (adaptive sharing splits it by speed)
        once = sum(
            values[r]["stats"]["bytes_read"] - values[r]["stats"]["bytes_hedged"] for r in pair
        )
        assert total // 2 <= once <= 0.50 * total + 2 * probes, (pair, once)


def test_narrow_reads_column_shards(tmp_path: Path) -> None:
    """Shard(1) on 4 ranks: each row of a saved 1024-column matrix is 4 KiB, a rank's columns
    1 KiB of it. With min_chunk_size below the 3 KiB gaps each rank reads only its columns;
    by default (max_over_read_ratio=1.15) gaps are read through only within that bound; without
    the bound (None) min_chunk_size's rule reads through them: each rank reads about everything."""
    full = narrow_model()
    save_single(tmp_path / "ck", full)
    total = tensor_bytes(full)
    probes = len(full) * 8 * KiB
    narrow = LoadOptions(min_chunk_size=1 * KiB, chunk_size=256 * KiB)
    values = all_ok(
        run_ranks(w_load_narrow, 4, str(tmp_path / "ck"), "S1", narrow, "load", "pipelined")
    )
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert total // 4 <= v["stats"]["bytes_read"] <= 0.30 * total + probes, (rank, v["stats"])
    values = all_ok(
        run_ranks(w_load_narrow, 4, str(tmp_path / "ck"), "S1", None, "load", "pipelined")
    )
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert total // 4 <= v["stats"]["bytes_read"] <= 1.15 * (total // 4), (rank, v["stats"])
    unbounded = LoadOptions(max_over_read_ratio=None)
    values = all_ok(
        run_ranks(w_load_narrow, 4, str(tmp_path / "ck"), "S1", unbounded, "load", "pipelined")
    )
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert v["stats"]["bytes_read"] >= 0.70 * total, (rank, v["stats"])


# --- ShardedLoadPlanner: read once, share --------------------------------------------------------


SHARE_OPTIONS = LoadOptions(chunk_size=64 * KiB, min_chunk_size=16 * KiB, memory_budget=512 * KiB)


@pytest.mark.parametrize(
    "planner_kind,entry",
    [
        ("sharded", "load"),
        ("sharded", "dcp"),
        ("sharded", "aload"),
        ("sharded-wait", "load"),
        ("sharded-ordered", "load"),
        ("sharded-static", "dcp"),
    ],
)
def test_sharded_replicated_reads_each_byte_once(
    tmp_path: Path, planner_kind: str, entry: str
) -> None:
    full = big_model()
    save_single(tmp_path / "ck", full)
    total = tensor_bytes(full)
    values = all_ok(
        run_ranks(w_load_replicated, 4, str(tmp_path / "ck"), planner_kind, entry, SHARE_OPTIONS)
    )
    reads = [v["stats"]["bytes_read"] for v in values]
    for rank, v in enumerate(values):
        assert v["bad"] == [], rank
        assert v["stats"]["bytes_assembled"] == total
        assert v["stats"]["peak_buffered_bytes"] <= SHARE_OPTIONS.memory_budget
        assert v["threads"] == 0
    assert total <= sum(reads) <= 1.05 * total, reads
    if planner_kind not in (
        "sharded",
        "sharded-wait",
    ):  # the static plan balances bytes; adaptive: by speed
        assert max(reads) <= 1.10 * min(reads), reads
    sent = sum(v["stats"]["bytes_sent"] for v in values)
    received = sum(v["stats"]["bytes_received"] for v in values)
    assert sent == received
    # every rank needs everything: what it did not read, it received
    for v in values:
        assert v["stats"]["bytes_read"] + v["stats"]["bytes_received"] >= total


def w_load_in_subgroups(rank: int, world: int, path: str, options: LoadOptions) -> dict[str, Any]:
    """Ranks {0, 1} and {2, 3} each load the replicated model on their own process group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    stats = asyncload.load(
        sd,
        path,
        options=options,
        planner=ShardedLoadPlanner(sharing="always"),
        process_group=group,
    )
    return {"bad": [k for k in full if not same_bits(sd[k], full[k])], "stats": stats_dict(stats)}


def test_sharded_on_subgroups(replicated_ckpt: str) -> None:
    total = tensor_bytes(big_model())
    values = all_ok(run_ranks(w_load_in_subgroups, 4, replicated_ckpt, SHARE_OPTIONS))
    for pair in ((0, 1), (2, 3)):
        reads = [values[r]["stats"]["bytes_read"] for r in pair]
        assert total <= sum(reads) <= 1.05 * total, reads
        assert [values[r]["bad"] for r in pair] == [[], []]


def test_custom_plan_transfers(replicated_ckpt: str) -> None:
    """plan_transfers is an extension point: rank 0 reads everything, the others receive it."""
    total = tensor_bytes(big_model())
    values = all_ok(
        run_ranks(w_load_replicated, 4, replicated_ckpt, "rank0", "load", SHARE_OPTIONS)
    )
    assert [v["bad"] for v in values] == [[], [], [], []]
    assert values[0]["stats"]["bytes_read"] >= total
    assert [v["stats"]["bytes_read"] for v in values[1:]] == [0, 0, 0]
    assert values[0]["stats"]["bytes_sent"] == 3 * values[0]["stats"]["bytes_read"]


def test_pipelined_replicated_reads_everything_on_every_rank(tmp_path: Path) -> None:
    full = big_model()
    save_single(tmp_path / "ck", full)
    total = tensor_bytes(full)
    values = all_ok(
        run_ranks(w_load_replicated, 4, str(tmp_path / "ck"), "pipelined", "load", SHARE_OPTIONS)
    )
    for v in values:
        assert v["bad"] == []
        assert v["stats"]["bytes_read"] >= total
        assert v["stats"]["bytes_received"] == 0


# --- the plan itself (pure) ----------------------------------------------------------------------


def test_plan_transfers_every_shared_byte_once_and_balanced() -> None:
    mib = 1 << 20
    # 4 ranks need all of a 16 MiB file as 1 MiB reads; rank 3's reads are offset by half a MiB
    needs: list[list[tuple[str, int, int]]] = [
        [("f", i * mib, (i + 1) * mib) for i in range(16)] for _ in range(3)
    ]
    needs.append(
        [("f", 0, mib // 2)]
        + [("f", mib // 2 + i * mib, min(16 * mib, mib // 2 + (i + 1) * mib)) for i in range(16)]
    )
    needs.append([("g", 0, 100)])  # rank 4 alone needs file g
    transfers, load = plan_transfers(needs)
    covered: dict[int, int] = {}
    for t in transfers:
        assert t.name == "f" and len(t.consumers) == 4 and t.owner in t.consumers
        for r in t.consumers:  # never crosses one of its consumers' read boundaries
            assert any(s <= t.start and t.end <= e for _f, s, e in needs[r])
        covered[t.start] = t.end
    pos = 0
    for start in sorted(covered):
        assert start == pos
        pos = covered[start]
    assert pos == 16 * mib
    assert [t.index for t in transfers] == list(range(len(transfers)))
    assert load[4] == 100
    assert sum(load[:4]) == 16 * mib and max(load[:4]) - min(load[:4]) <= mib // 2


def test_plan_transfers_subsets_and_exclusive() -> None:
    # ranks 0,1 share [0,100); ranks 2,3 share [100,200); rank 0 alone needs [200, 250)
    needs = [
        [("f", 0, 100), ("f", 200, 250)],
        [("f", 0, 100)],
        [("f", 100, 200)],
        [("f", 100, 200)],
    ]
    transfers, load = plan_transfers(needs)
    assert [(t.start, t.end, t.consumers) for t in transfers] == [
        (0, 100, (0, 1)),
        (100, 200, (2, 3)),
    ]
    assert transfers[0].owner == 1  # rank 0 already reads 50 bytes alone
    assert sum(load) == 250


# --- ShardedTensor (still in torch 2.13) ---------------------------------------------------------


def _sharded_tensors(
    full: dict[str, torch.Tensor], world: int, dim: int, *, zeros: bool
) -> dict[str, Any]:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    out = {}
    for k, v in full.items():
        d = min(dim, v.dim() - 1)
        spec = ChunkShardingSpec(dim=d, placements=[f"rank:{r}/cpu" for r in range(world)])
        st = sharded_tensor.empty(spec, *v.shape, dtype=v.dtype)
        for shard in st.local_shards():
            md = shard.metadata
            box = v[tuple(slice(o, o + n) for o, n in zip(md.shard_offsets, md.shard_sizes))]
            shard.tensor.copy_(torch.zeros_like(box) if zeros else box)
        out[k] = st
    return out


def w_save_sharded_tensor(rank: int, world: int, path: str, dim: int) -> None:
    dcp.save(_sharded_tensors(model_tensors(), world, dim, zeros=False), checkpoint_id=path)


def w_load_sharded_tensor(
    rank: int, world: int, path: str, dim: int, variants: list[tuple[str, str]]
) -> dict[str, list[str]]:
    full = model_tensors()
    want = _sharded_tensors(full, world, dim, zeros=False)
    out = {}
    for entry, planner_kind in variants:
        sd = _sharded_tensors(full, world, dim, zeros=True)
        _load_into(sd, path, entry, planner_kind)
        bad = []
        for k in full:
            got, exp = sd[k].local_shards(), want[k].local_shards()
            if len(got) != len(exp) or not all(
                same_bits(a.tensor, b.tensor) for a, b in zip(got, exp)
            ):
                bad.append(k)
        out[f"{entry}/{planner_kind}"] = bad
    return out


def test_sharded_tensor_2_to_4_other_dim(tmp_path: Path) -> None:
    path = str(tmp_path / "st")
    all_ok(run_ranks(w_save_sharded_tensor, 2, path, 0))
    variants = [("load", "pipelined"), ("load", "sharded"), ("dcp", "pipelined")]
    values = all_ok(run_ranks(w_load_sharded_tensor, 4, path, 1, variants))
    for rank, value in enumerate(values):
        assert value == {f"{e}/{p}": [] for e, p in variants}, rank
    # and back into plain tensors in one process
    full = model_tensors()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    asyncload.load(sd, path)
    assert [k for k in full if not same_bits(sd[k], full[k])] == []


# --- one rank fails: every rank raises, in bounded time ------------------------------------------


def w_one_rank_fails(
    rank: int,
    world: int,
    path: str,
    planner_kind: str,
    entry: str,
    mode: str,
    victim: int,
    options: LoadOptions,
) -> dict[str, Any]:
    """Load the replicated model; ``victim`` raises (``raise``), hangs (``stall``) or dies
    (``die``) from its progress callback once a third of its bytes have landed."""
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}

    def progress(done: int, total: int) -> None:
        if (
            rank == victim and mode == "raise-first"
        ):  # in the first read phase: before any rank can return
            raise RuntimeError(f"injected failure on rank {rank}")
        if rank == victim and done >= total // 3:
            if mode == "raise":
                raise RuntimeError(f"injected failure on rank {rank}")
            if mode == "stall":
                time.sleep(3600)
            if mode == "die":
                os._exit(3)

    if entry == "load":
        asyncload.load(
            sd, path, options=options, planner=_make_planner(planner_kind), progress=progress
        )
    else:
        reader = PipelinedReader(path, options=options)
        reader.progress = progress
        dcp.load(sd, storage_reader=reader, planner=_make_planner(planner_kind))
    return {"bad": [k for k in full if not same_bits(sd[k], full[k])]}


FAIL_OPTIONS = LoadOptions(
    chunk_size=64 * KiB,
    min_chunk_size=16 * KiB,
    memory_budget=512 * KiB,
    collective_timeout=4.0,
    concurrency=4,
)


@pytest.fixture(scope="module")
def replicated_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("dist") / "replicated"
    save_single(path, big_model())
    return str(path)


@pytest.mark.parametrize(
    "planner_kind,when",
    [
        ("sharded", "raise-first"),
        ("sharded", "raise"),
        ("sharded-wait", "raise"),
        ("pipelined", "raise"),
    ],
)
def test_a_rank_that_raises_fails_every_rank(
    replicated_ckpt: str, planner_kind: str, when: str
) -> None:
    """Rank 1 raises from its progress callback: at its first bytes (the first read phase,
    which every rank must finish before any can read tensor data: no rank can have returned)
    or once a third of its bytes landed. Every other rank raises DistributedLoadError naming
    it; returning early (``sharded``), a rank that already had every byte of its own when
    rank 1 failed late may instead return them, bit for bit."""
    results = run_ranks(
        w_one_rank_fails,
        4,
        replicated_ckpt,
        planner_kind,
        "load",
        when,
        1,
        FAIL_OPTIONS,
        timeout=30,
    )
    victim = results[1]
    assert victim.status == "error" and victim.error_type == "RuntimeError", victim
    assert victim.message == "injected failure on rank 1"
    for r in (results[0], results[2], results[3]):
        if planner_kind == "sharded" and when == "raise" and r.status == "ok":
            assert r.value == {"bad": []}, r.rank
            continue
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.status,
            r.message,
            r.traceback,
        )
        assert "AsyncLoadError" in r.error_types
        assert r.attrs["rank"] == 1
        assert r.message.startswith("rank 1 failed while "), r.message
        assert "RuntimeError: injected failure on rank 1" in r.message
        assert r.seconds < 20


def test_a_rank_that_raises_under_dcp_load_fails_every_rank(replicated_ckpt: str) -> None:
    """With plain dcp.load the errors come out of DCP's own collective as CheckpointException;
    the other ranks' entries are DistributedLoadError naming rank 1."""
    results = run_ranks(
        w_one_rank_fails,
        4,
        replicated_ckpt,
        "sharded",
        "dcp",
        "raise",
        1,
        FAIL_OPTIONS,
        timeout=30,
    )
    for r in results:
        assert r.status == "error" and r.error_type == "CheckpointException", (
            r.rank,
            r.status,
            r.message,
        )
        assert "injected failure on rank 1" in r.message
        assert r.seconds < 20


def _named_the_stalled_rank(r: Any) -> None:
    assert r.status == "error" and r.error_type == "DistributedLoadError", (
        r.status,
        r.message,
        r.traceback,
    )
    assert r.attrs["rank"] == 2
    assert r.message.startswith("rank 2 made no progress for "), r.message
    assert "collective_timeout=4.0" in r.message and "its last status: reading" in r.message
    assert r.seconds < 20


@pytest.mark.parametrize("planner_kind", ["sharded-wait", "pipelined"])
def test_a_stalled_rank_is_named_on_every_other_rank(
    replicated_ckpt: str, planner_kind: str
) -> None:
    """Rank 2 hangs (its progress callback sleeps for an hour): within collective_timeout
    (4 s) plus a little, every other rank raises DistributedLoadError naming it and what it
    was doing. Rank 2 itself is killed by the harness."""
    results = run_ranks(
        w_one_rank_fails,
        4,
        replicated_ckpt,
        planner_kind,
        "load",
        "stall",
        2,
        FAIL_OPTIONS,
        timeout=25,
        may_hang={2},
    )
    assert results[2].status == "timed_out"
    for r in (results[0], results[1], results[3]):
        _named_the_stalled_rank(r)


def test_a_stalled_rank_with_ranks_that_return_early(replicated_ckpt: str) -> None:
    """ShardedLoadPlanner's default (``wait_for_peers=False``): a rank that has every byte of
    its own (the stalled rank's units read from storage once late) returns with them bit for
    bit; one that still waits on the stalled rank raises the error naming it. Never a hang."""
    results = run_ranks(
        w_one_rank_fails,
        4,
        replicated_ckpt,
        "sharded",
        "load",
        "stall",
        2,
        FAIL_OPTIONS,
        timeout=25,
        may_hang={2},
    )
    assert results[2].status == "timed_out"
    for r in (results[0], results[1], results[3]):
        if r.status == "ok":
            assert r.value == {"bad": []}, r.rank
        else:
            _named_the_stalled_rank(r)


@pytest.mark.parametrize("planner_kind", ["sharded", "sharded-wait"])
def test_a_rank_that_dies_fails_every_other_rank(replicated_ckpt: str, planner_kind: str) -> None:
    """Rank 2 exits mid-load. Waiting for peers, every other rank raises DistributedLoadError
    naming it; returning early (the default), a rank may instead have had every byte of its
    own already (then they are bit for bit), never a hang."""
    results = run_ranks(
        w_one_rank_fails,
        4,
        replicated_ckpt,
        planner_kind,
        "load",
        "die",
        2,
        FAIL_OPTIONS,
        timeout=25,
        may_hang={2},
    )
    assert results[2].status == "timed_out" and results[2].exitcode == 3
    for r in (results[0], results[1], results[3]):
        if planner_kind == "sharded" and r.status == "ok":
            assert r.value == {"bad": []}, r.rank
            continue
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.status,
            r.message,
            r.traceback,
        )
        assert r.attrs["rank"] == 2, r.message
        assert r.seconds < 20


# --- errors of the planning steps: this rank's own, a DistributedLoadError elsewhere --------------


def w_bad_destination(rank: int, world: int, path: str, bad_rank: int, what: str) -> None:
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    if rank == bad_rank and what == "shape":
        sd["layers.3.w"] = torch.zeros(256, 255)
    if rank == bad_rank and what == "path":
        path = path + "-missing"
    asyncload.load(sd, path, planner=ShardedLoadPlanner(sharing="always", collective_timeout=10))


@pytest.mark.parametrize(
    "what,error,doing",
    [
        ("shape", "StateDictMismatchError", "making its local plan"),
        ("path", "CheckpointNotFoundError", "reading the checkpoint metadata"),
    ],
)
def test_a_planning_error_on_one_rank(
    replicated_ckpt: str, what: str, error: str, doing: str
) -> None:
    results = run_ranks(w_bad_destination, 3, replicated_ckpt, 1, what, timeout=25)
    assert results[1].status == "error" and results[1].error_type == error, results[1]
    for r in (results[0], results[2]):
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.status,
            r.message,
        )
        assert r.attrs == {"rank": 1, "doing": doing}
        assert r.message.startswith(f"rank 1 failed while {doing}: {error}: "), r.message
