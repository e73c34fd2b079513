"""The sorted-sweep intersection (asyncload/engine/intersect.py) gives torch's read items bit
for bit: the same ``ReadItem`` s, in the same order, with the same offsets, lengths and
storage indexes, as ``create_read_items_for_chunk_list`` and ``DefaultLoadPlanner``, on
random layouts (hypothesis), on layouts of thousands of ranks, and on real DTensors saved
by ``dcp.save`` on two ranks."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import asyncload
from asyncload import PipelinedLoadPlanner, ShardedLoadPlanner
from asyncload.engine.intersect import _torch_order, read_items_for_chunks

Box = tuple[tuple[int, ...], tuple[int, ...]]

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def signature(items: list[Any]) -> list[tuple[Any, ...]]:
    """Every field of every read item, with the index hints (not part of MetadataIndex's
    equality) and the types of the offset fields."""
    return [
        (
            i.type,
            i.dest_index.fqn,
            i.dest_index.offset,
            i.dest_index.index,
            i.dest_offsets,
            i.storage_index.fqn,
            i.storage_index.offset,
            i.storage_index.index,
            i.storage_offsets,
            i.lengths,
            type(i.dest_offsets),
            type(i.storage_offsets),
            type(i.lengths),
        )
        for i in items
    ]


def chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box[0]), sizes=torch.Size(box[1]))


def tensor_md(shape: tuple[int, ...], boxes: list[Box]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size(shape),
        chunks=[chunk(b) for b in boxes],
    )


# --- layouts ----------------------------------------------------------------------------------


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk / DTensor Shard: ceil-sized parts; trailing parts may be empty (at ``n``)."""
    step = -(-n // parts) if n else 0
    return [(min(i * step, n), max(0, min(step, n - i * step))) for i in range(parts)]


def grid(shape: tuple[int, ...], cuts: list[list[tuple[int, int]]]) -> list[Box]:
    """The product of one list of ``(offset, length)`` per dimension, row-major."""
    boxes: list[Box] = [((), ())]
    for per_dim in cuts:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in per_dim]
    return boxes


@st.composite
def split_tiling(draw: Any, shape: tuple[int, ...]) -> list[Box]:
    """A tiling by random recursive cuts: uneven and not a grid."""
    boxes = [([0] * len(shape), list(shape))]
    for _ in range(draw(st.integers(0, 10))):
        if not shape:
            break
        k = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, len(shape) - 1))
        o, s = boxes[k]
        if s[d] < 2:
            continue
        cut = draw(st.integers(1, s[d] - 1))
        left = (list(o), list(s))
        right = (list(o), list(s))
        left[1][d] = cut
        right[0][d] += cut
        right[1][d] -= cut
        boxes[k : k + 1] = [left, right]
    return [(tuple(o), tuple(s)) for o, s in boxes]


@st.composite
def grid_tiling(draw: Any, shape: tuple[int, ...]) -> list[Box]:
    """A grid with random cut points in every dimension."""
    cuts = []
    for n in shape:
        points = (
            sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))) if n > 1 else []
        )
        edges = [0, *points, n]
        cuts.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    return grid(shape, cuts)


@st.composite
def mesh_tiling(draw: Any, shape: tuple[int, ...]) -> list[Box]:
    """DTensor-like: each dimension split evenly over a mesh dimension (empty trailing shards)."""
    return grid(shape, [even_split(n, draw(st.integers(1, 5))) for n in shape])


@st.composite
def layout(draw: Any, shape: tuple[int, ...]) -> list[Box]:
    """Saved chunks: a tiling of one of three kinds, sometimes with empty chunks, in any order."""
    kind = draw(st.sampled_from([split_tiling, grid_tiling, mesh_tiling]))
    boxes = list(draw(kind(shape)))
    if shape and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 2))):
            d = draw(st.integers(0, len(shape) - 1))
            o = tuple(draw(st.integers(0, n)) for n in shape)
            s = tuple(
                0 if i == d else draw(st.integers(0, shape[i] - o[i])) for i in range(len(shape))
            )
            boxes.insert(draw(st.integers(0, len(boxes))), (o, s))
    order = draw(st.sampled_from(["as is", "reversed", "shuffled"]))
    if order == "reversed":
        boxes.reverse()
    elif order == "shuffled":
        boxes = list(draw(st.permutations(boxes)))
    return boxes


@st.composite
def any_box(draw: Any, shape: tuple[int, ...]) -> Box:
    o = tuple(draw(st.integers(0, n)) for n in shape)
    return o, tuple(draw(st.integers(0, n - a)) for a, n in zip(o, shape))


@st.composite
def destination(draw: Any, shape: tuple[int, ...]) -> list[Box]:
    """What a rank holds: 1-4 chunks of another layout (a mesh rank's shards), sometimes
    with arbitrary boxes (ShardedTensor-like shards, overlapping or empty)."""
    other = draw(layout(shape))
    picks = draw(st.lists(st.integers(0, len(other) - 1), min_size=1, max_size=4, unique=True))
    boxes = [other[i] for i in picks]
    boxes += draw(st.lists(any_box(shape), max_size=2))
    return boxes


shapes = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)


def test_this_torch_order_is_known() -> None:
    """The sweep is in use (not a fallback to torch's own function): the tests below compare
    two implementations."""
    assert _torch_order() in ("sweep", "scan")


@SETTINGS
@given(st.data())
def test_read_items_equal_torchs(data: Any) -> None:
    shape = data.draw(shapes, "shape")
    saved = data.draw(layout(shape), "saved")
    local = data.draw(destination(shape), "local")
    md = tensor_md(shape, saved)
    chunks = [chunk(b) for b in local]
    want = create_read_items_for_chunk_list("w", md, chunks)
    assert signature(read_items_for_chunks("w", md, chunks)) == signature(want)


def test_read_items_edge_cases_equal_torchs() -> None:
    cases: list[tuple[tuple[int, ...], list[Box], list[Box]]] = [
        ((), [((), ())], [((), ())]),  # a scalar
        ((), [((), ()), ((), ())], [((), ()), ((), ())]),
        ((8,), [((0,), (8,))], []),  # nothing held here
        ((8,), [], [((0,), (8,))]),  # nothing saved
        (
            (8,),
            [((4,), (4,)), ((0,), (4,))],
            [((4,), (0,)), ((2,), (0,)), ((8,), (0,))],
        ),  # empty shards
        ((0, 5), [((0, 0), (0, 5))], [((0, 0), (0, 5))]),  # an empty tensor
        (
            (6, 6),
            [((0, 0), (6, 3)), ((0, 3), (6, 3))],
            [((0, 0), (3, 6)), ((3, 0), (3, 6))],
        ),  # columns -> rows
    ]
    for shape, saved, local in cases:
        md = tensor_md(shape, saved)
        chunks = [chunk(b) for b in local]
        want = signature(create_read_items_for_chunk_list("w", md, chunks))
        assert signature(read_items_for_chunks("w", md, chunks)) == want, (shape, saved, local)


def fsdp(shape: tuple[int, ...], ranks: int) -> list[Box]:
    """FSDP2 (``Shard(0)`` over ``ranks``)."""
    return grid(shape, [even_split(shape[0], ranks), *[[(0, n)] for n in shape[1:]]])


def fsdp_tp(shape: tuple[int, ...], dp: int, tp: int, tp_dim: int) -> list[Box]:
    """FSDP x TP on a (dp, tp) mesh: rank (i, j) holds dp shard i of TP shard j; TP along
    ``tp_dim`` (0: colwise, FSDP splits each TP shard again; 1: rowwise, a grid)."""
    if tp_dim == 1:
        return grid(shape, [even_split(shape[0], dp), even_split(shape[1], tp)])
    rows = []
    for a, n in even_split(shape[0], tp):
        rows += [(a + b, m) for b, m in even_split(n, dp)]
    order = [j * dp + i for i in range(dp) for j in range(tp)]  # rank order: dp-major
    return grid(shape, [[rows[k] for k in order], *[[(0, n)] for n in shape[1:]]])


@pytest.mark.parametrize(
    "shape",
    [(14336, 4096), (4096, 14336), (4096,), (128256, 4096), (1000, 3)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_thousands_of_ranks_equal_torchs(shape: tuple[int, ...]) -> None:
    """FSDP on 1,024 ranks loaded on 8,192 and on 256 ranks, FSDP x TP (128 x 8) loaded as
    FSDP on 8,192: sampled ranks' items equal torch's."""
    rng = random.Random(7)
    layouts = [(fsdp(shape, 1024), fsdp(shape, 8192)), (fsdp(shape, 1024), fsdp(shape, 256))]
    if len(shape) == 2:
        for tp_dim in (0, 1):
            layouts.append((fsdp_tp(shape, 128, 8, tp_dim), fsdp(shape, 8192)))
            layouts.append((fsdp(shape, 1024), fsdp_tp(shape, 1024, 8, tp_dim)))
    compared = 0
    for saved, dest in layouts:
        md = tensor_md(shape, saved)
        assert sum(math.prod(b[1]) for b in saved) == math.prod(shape)
        for r in sorted(
            {0, 1, 7, 8, len(dest) // 2, len(dest) - 1, *rng.sample(range(len(dest)), 6)}
        ):
            chunks = [chunk(dest[r])]
            want = create_read_items_for_chunk_list("w", md, chunks)
            got = read_items_for_chunks("w", md, chunks)
            assert signature(got) == signature(want), (shape, r)
            compared += len(want)
    assert compared >= 24


# --- the planner ----------------------------------------------------------------------------------


class Shards(torch.Tensor):
    """A destination that holds ``chunks`` of a tensor of the global shape on this rank:
    a tensor speaking DTensor's checkpoint protocol (``__create_chunk_list__``,
    ``to_local``), so that both planners resolve it as they resolve a DTensor."""

    _chunks: list[ChunkStorageMetadata]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> Shards:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape))
        t._chunks = chunks
        return t  # type: ignore[return-value]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def to_local(self) -> torch.Tensor:
        return torch.empty(sum(math.prod(c.sizes) for c in self._chunks))


@st.composite
def planner_case(draw: Any) -> tuple[dict[str, Any], Metadata, bool]:
    """A nested destination state dict, the checkpoint's metadata (flattened keys), and
    allow_partial_load: tensors held whole or in shards, objects, keys only on one side."""
    n = draw(st.integers(1, 4))
    model: dict[str, Any] = {}
    smd: dict[str, Any] = {}
    for i in range(n):
        shape = draw(shapes)
        saved = draw(layout(shape))
        smd[f"model.t{i}"] = tensor_md(
            shape, [b for b in saved if math.prod(b[1]) or not math.prod(shape)]
        )
        if draw(st.booleans()):
            model[f"t{i}"] = torch.empty(shape)
        else:
            model[f"t{i}"] = Shards(shape, [chunk(b) for b in draw(destination(shape))])
    if draw(st.booleans()):
        model["step"] = 7
        smd["model.step"] = BytesStorageMetadata()
    partial = draw(st.booleans())
    if partial:
        if draw(st.booleans()):
            smd["optim.lr"] = BytesStorageMetadata()  # in the checkpoint only
        if draw(st.booleans()):
            model["extra"] = torch.empty(3)  # in the destination only
    return {"model": model}, Metadata(state_dict_metadata=smd, storage_data={}), partial


def plan_items(planner: Any, state_dict: dict[str, Any], md: Metadata) -> list[tuple[Any, ...]]:
    planner.set_up_planner(state_dict, md, True)
    return signature(planner.create_local_plan().items)


@SETTINGS
@given(planner_case())
def test_planner_plans_equal_torchs(case: tuple[dict[str, Any], Metadata, bool]) -> None:
    state_dict, md, partial = case
    want = plan_items(DefaultLoadPlanner(allow_partial_load=partial), state_dict, md)
    assert plan_items(PipelinedLoadPlanner(allow_partial_load=partial), state_dict, md) == want
    assert plan_items(ShardedLoadPlanner(allow_partial_load=partial), state_dict, md) == want


def test_checkpoint_of_torch_before_2_4_is_rekeyed_like_torch() -> None:
    """torch < 2.4 saved a container of non-tensors as one object ("cfg"), torch >= 2.4
    flattens it ("cfg.lr"): the planner re-keys the destination as torch's does."""
    md = Metadata(
        state_dict_metadata={
            "w": tensor_md((4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))]),
            "cfg": BytesStorageMetadata(),
        },
        storage_data={},
    )
    planners = [DefaultLoadPlanner(), PipelinedLoadPlanner()]
    plans = [plan_items(p, {"w": torch.empty(4, 2), "cfg": {"lr": 0.1}}, md) for p in planners]
    assert plans[0] == plans[1]
    assert [p[1] for p in plans[1]] == ["w", "w", "cfg"]
    assert list(planners[1].state_dict) == list(planners[0].state_dict) == ["w", "cfg"]
    assert planners[1].mappings == planners[0].mappings


# --- real DTensors saved by dcp.save --------------------------------------------------------------


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return {
        "a": torch.randn(5, 7, generator=g),
        "b": torch.randn(9, generator=g).to(torch.bfloat16),
        "c": torch.randint(-100, 100, (3, 4, 5), generator=g, dtype=torch.int64),
    }


def w_save_then_plan(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save ``_full()`` as DTensors with Shard(0) (uneven), then plan and load it into
    DTensors with Shard of the last dimension: torch's plan and asyncload's, and the bits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    dcp.save(
        {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, checkpoint_id=path
    )
    md = dcp.FileSystemReader(path).read_metadata()

    def dest() -> dict[str, Any]:
        return {
            k: DTensor.from_local(
                torch.zeros_like(distribute_tensor(v, mesh, [Shard(v.dim() - 1)]).to_local()),
                mesh,
                [Shard(v.dim() - 1)],
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
            for k, v in full.items()
        }

    want = plan_items(DefaultLoadPlanner(), dest(), md)
    got = plan_items(PipelinedLoadPlanner(), dest(), md)
    sd = dest()
    asyncload.load(sd, path)
    expect = {
        k: distribute_tensor(v, mesh, [Shard(v.dim() - 1)]).to_local() for k, v in full.items()
    }
    bad = [
        k
        for k in full
        if sd[k].to_local().dtype != expect[k].dtype
        or not torch.equal(sd[k].to_local(), expect[k])
    ]
    chunks = {
        k: len(v.chunks)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    return {"same_plan": got == want, "items": len(got), "bad": bad, "chunks": chunks}


@pytest.mark.distributed
def test_real_dtensors_plan_equal_torchs_and_load_bit_for_bit(tmp_path: Path) -> None:
    values = all_ok(run_ranks(w_save_then_plan, 2, str(tmp_path / "ck"), timeout=120))
    for rank, v in enumerate(values):
        assert v["chunks"] == {"a": 2, "b": 2, "c": 2}, (rank, v)
        assert v["same_plan"] and v["items"] == 5 and v["bad"] == [], (rank, v)
