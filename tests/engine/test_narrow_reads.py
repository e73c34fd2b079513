"""Narrow reads: a rank that needs a slice of each saved tensor reads at most
``LoadOptions.max_over_read_ratio`` (1.15 by default) times the bytes it needs.

A single-process checkpoint, loaded as rank ``r`` of ``N`` would load a ``Shard(0)`` (rows)
or ``Shard(1)`` (columns) slice of every tensor: a planner that asks for that slice of each
saved chunk into a plain tensor (no process group needed). Tiny (~1 MiB) and larger (~64 MiB)
checkpoints, from local disk and over HTTP on loopback; every slice compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import LoadPlan, ReadItem
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

import asyncload
from asyncload import LoadOptions
from asyncload.engine.chunks import Piece
from asyncload.engine.plan import break_even_gap, make_chunks

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10
MiB = 1 << 20


def tiny_model() -> dict[str, torch.Tensor]:
    """About 1 MiB: four 256x256 fp32 matrices, a bf16 one, two norms."""
    g = torch.Generator().manual_seed(3)
    out = {f"attn.{n}": torch.randn(256, 256, generator=g) for n in "qkv"}
    out["mlp"] = torch.randn(256, 512, generator=g).to(torch.bfloat16)
    out["norm1"] = torch.randn(256, generator=g)
    out["norm2"] = torch.randn(256, generator=g)
    return out


def large_model() -> dict[str, torch.Tensor]:
    """About 64 MiB: eight 1024x2048 fp32 matrices."""
    g = torch.Generator().manual_seed(4)
    return {f"layers.{i}.w": torch.randn(1024, 2048, generator=g) for i in range(8)}


def shard_box(shape: torch.Size, dim: int, rank: int, world: int) -> tuple[list[int], list[int]]:
    """Offsets and lengths of ``rank``'s slice along ``dim`` (torch's Shard rule: ceil-sized pieces)."""
    d = min(dim, len(shape) - 1)
    n = shape[d]
    step = -(-n // world)
    lo, hi = min(n, rank * step), min(n, (rank + 1) * step)
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[d], lengths[d] = lo, hi - lo
    return offsets, lengths


class ShardPlanner(asyncload.PipelinedLoadPlanner):
    """Loads ``rank``'s ``Shard(dim)`` slice of every saved tensor into ``dests`` (plain tensors)."""

    def __init__(
        self, dests: dict[str, torch.Tensor], dim: int, rank: int, world: int, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.dests, self.dim, self.rank, self.world = dests, dim, rank, world

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for key in self.dests:
            smd = self.metadata.state_dict_metadata[key]
            assert isinstance(smd, TensorStorageMetadata) and len(smd.chunks) == 1
            offsets, lengths = shard_box(smd.size, self.dim, self.rank, self.world)
            if 0 in lengths:
                continue
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(key, torch.Size(offsets)),
                    dest_offsets=torch.Size([0] * len(offsets)),
                    storage_index=MetadataIndex(key, torch.Size([0] * len(offsets)), 0),
                    storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths),
                )
            )
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dests[read_item.dest_index.fqn]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def load_shard(
    url: str,
    full: dict[str, torch.Tensor],
    dim: int,
    rank: int,
    world: int,
    options: LoadOptions | None = None,
) -> tuple[asyncload.LoadStats, int]:
    """Load ``rank``'s slice of every tensor from ``url``; check it bit for bit; return the
    stats and the bytes needed (the slices' bytes)."""
    want = {}
    for k, v in full.items():
        offsets, lengths = shard_box(v.shape, dim, rank, world)
        want[k] = v[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    dests = {k: torch.zeros_like(w) for k, w in want.items()}
    reader = asyncload.PipelinedReader(url, options=options)
    planner = ShardPlanner(dests, dim, rank, world, options=options)
    dcp.load(
        {k: torch.empty(0) for k in full}, storage_reader=reader, planner=planner, no_dist=True
    )
    stats = reader.stats
    assert stats is not None
    for k, w in want.items():
        got = dests[k]
        assert got.dtype == w.dtype and got.shape == w.shape, k
        assert torch.equal(
            got.view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)
        ), k
    needed = sum(w.numel() * w.element_size() for w in want.values())
    return stats, needed


def save(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = tiny_model()
    return save(tmp_path_factory.mktemp("narrow") / "tiny", sd), sd


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = large_model()
    return save(tmp_path_factory.mktemp("narrow") / "large", sd), sd


@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns"])
@pytest.mark.parametrize("size", ["tiny", "large"])
def test_local_narrow_reads_within_the_bound(
    size: str, dim: int, request: pytest.FixtureRequest
) -> None:
    path, full = request.getfixturevalue(size)
    for rank in range(4):
        stats, needed = load_shard(str(path), full, dim, rank, 4)
        assert needed <= stats.bytes_read <= 1.15 * needed, (
            size,
            dim,
            rank,
            stats.bytes_read,
            needed,
        )
        assert stats.bytes_assembled == needed


@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns"])
@pytest.mark.parametrize("size", ["tiny", "large"])
def test_remote_narrow_reads_within_the_bound(
    size: str, dim: int, request: pytest.FixtureRequest, http_server: Any, bucket_name: str
) -> None:
    path, full = request.getfixturevalue(size)
    http_server.upload_dir(path, bucket_name, size)
    url = http_server.url(bucket_name, size)
    for rank in (0, 3) if dim == 0 else (1,):
        stats, needed = load_shard(url, full, dim, rank, 4)
        read = (
            stats.bytes_read - stats.bytes_hedged
        )  # a hedged duplicate is the store's delay, not the plan
        assert needed <= read <= 1.15 * needed, (size, dim, rank, stats.bytes_read, needed)
        assert stats.bytes_assembled == needed


# --- the option, the cost model and the budget -----------------------------------------------------


def test_no_bound_reads_through_the_gaps(tiny: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """``max_over_read_ratio=None``: the ``min_chunk_size`` rule alone, gaps read through (what
    the bound prevents): one request, every byte of the file."""
    path, full = tiny
    stats, needed = load_shard(str(path), full, 1, 1, 4, LoadOptions(max_over_read_ratio=None))
    assert stats.bytes_read >= 3.5 * needed
    bounded, _ = load_shard(str(path), full, 1, 1, 4)
    assert bounded.chunks > stats.chunks and bounded.bytes_read <= 1.15 * needed


def test_a_looser_bound_buys_fewer_requests(tiny: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """With room in the bound the cost model joins the column slice's rows through their
    768-byte gaps (far below a local request's break-even gap): fewer requests, within the bound."""
    path, full = tiny
    tight, needed = load_shard(str(path), full, 1, 2, 4, LoadOptions(max_over_read_ratio=1.0))
    loose, _ = load_shard(str(path), full, 1, 2, 4, LoadOptions(max_over_read_ratio=4.5))
    assert loose.bytes_read <= 4.5 * needed and loose.chunks < tight.chunks / 10, (loose, tight)
    # 1.0 allows no gap: only the records' fixed costs (header probes) above what is needed
    assert tight.bytes_read <= needed + 7 * 8 * KiB


def test_verify_reads_and_checks_every_byte_of_a_narrow_read(
    tiny: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """verify=True checksums whole storages: the bound does not apply, every saved tensor byte is read."""
    path, full = tiny
    stats, needed = load_shard(str(path), full, 1, 3, 4, LoadOptions(verify=True))
    total = sum(v.numel() * v.element_size() for v in full.values())
    assert stats.bytes_read >= total and stats.verified_records == len(full)
    assert stats.bytes_assembled == needed


def test_progress_counts_the_bytes_taken_from_the_probes(
    tiny: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Rank 0's first rows (and rank 3's last) arrive with the records' header probes and are
    copied from them, not read twice; progress still ends at the destination's bytes."""
    path, full = tiny
    seen: list[tuple[int, int]] = []
    for rank in (0, 3):
        seen.clear()
        opts = LoadOptions()
        want = {}
        for k, v in full.items():
            offsets, lengths = shard_box(v.shape, 0, rank, 4)
            want[k] = v[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        dests = {k: torch.zeros_like(w) for k, w in want.items()}
        reader = asyncload.PipelinedReader(str(path), options=opts)
        reader.progress = lambda done, total: seen.append((done, total))
        planner = ShardPlanner(dests, 0, rank, 4, options=opts)
        dcp.load(
            {k: torch.empty(0) for k in full}, storage_reader=reader, planner=planner, no_dist=True
        )
        assert all(torch.equal(dests[k], want[k]) for k in full)
        needed = sum(w.numel() * w.element_size() for w in want.values())
        assert seen and seen[-1] == (needed, needed)
        assert [d for d, _ in seen] == sorted({d for d, _ in seen})
        assert reader.stats is not None and reader.stats.bytes_assembled == needed


def test_make_chunks_spends_the_budget_on_the_smallest_gaps() -> None:
    """Gaps are joined smallest first while they fit ``max_over_read``; equal gaps spread out."""
    ps = [Piece("f", s, s + 100) for s in (0, 110, 300, 1000, 1120)]  # gaps 10, 90, 600, 20
    joined = make_chunks(ps, chunk_size=1 << 20, min_chunk_size=1 << 10, max_over_read=30)
    assert [(c.start, c.end) for c in joined] == [(0, 210), (300, 400), (1000, 1220)]
    unbounded = make_chunks(
        ps, chunk_size=1 << 20, min_chunk_size=1 << 10
    )  # min_chunk_size's rule
    assert [(c.start, c.end) for c in unbounded] == [(0, 1100), (1120, 1220)]
    assert len(make_chunks(ps, chunk_size=1 << 20, min_chunk_size=1 << 10, max_over_read=0)) == 5
    rows = [Piece("f", 100 * i, 100 * i + 25) for i in range(8)]  # equal gaps of 75
    spread = make_chunks(rows, chunk_size=1 << 20, min_chunk_size=1 << 10, max_over_read=150)
    assert [c.nbytes for c in spread] == [25, 125, 125, 25, 25, 25]


def test_make_chunks_charges_only_what_charge_says() -> None:
    """Header bytes between two needed tensors cost nothing against the bound (``charge``
    says 0): joined even with no budget left; another item's bytes are charged in full."""
    ps = [Piece("f", 0, 100), Piece("f", 150, 250), Piece("f", 400, 500)]

    def charge(name: str, start: int, end: int) -> int:
        return 0 if (start, end) == (100, 150) else end - start

    chunks = make_chunks(
        ps, chunk_size=1 << 20, min_chunk_size=1 << 10, max_over_read=0, charge=charge
    )
    assert [(c.start, c.end) for c in chunks] == [(0, 250), (400, 500)]


def test_break_even_gap() -> None:
    assert break_even_gap(20e-3, 64 << 20) == int(20e-3 * (64 << 20))  # remote: about 1.3 MB
    assert break_even_gap(20e-6, 4 << 30) < 100_000  # local: tens of KB
    assert break_even_gap(0.0, 1e9) == 0 and break_even_gap(1.0, 0.0) == 0


@pytest.mark.parametrize("bad", [0.5, 0, -1.0, float("nan"), float("inf"), True, "1.2"])
def test_max_over_read_ratio_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match=r"max_over_read_ratio="):
        LoadOptions(max_over_read_ratio=bad)  # type: ignore[arg-type]
    assert LoadOptions(max_over_read_ratio=1).max_over_read_ratio == 1
    assert LoadOptions(max_over_read_ratio=None).max_over_read_ratio is None
