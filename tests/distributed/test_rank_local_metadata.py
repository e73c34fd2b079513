"""Rank-local metadata: ``dcp.save(..., use_collectives=False)`` writes no ``.metadata`` but one
``__{rank}.metadata`` per rank; ``dcp.load`` then falls back to this rank's file, and so does
``asyncload.load`` (one process, and 2 ranks on gloo), bit for bit against what each rank saved
and against torch's own reader. Only a missing ``.metadata`` falls back: a damaged one is an error.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, random_tensor
from _dist import all_ok, run_ranks

import asyncload
from asyncload import CheckpointFormatError, CheckpointNotFoundError, PipelinedReader


def rank_model(rank: int) -> dict[str, Any]:
    """What rank ``rank`` saves: its own shapes and keys (rank-local metadata may differ)."""
    sd: dict[str, Any] = {
        "w": random_tensor((8 + 2 * rank, 5), torch.float32, 10 + rank),
        "emb": random_tensor((33, 7), torch.bfloat16, 20 + rank),
        "step": 100 + rank,
    }
    if rank == 1:
        sd["extra"] = {"q": random_tensor((17,), torch.int8, 30)}
    return sd


def zeros_of(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        out[k] = (
            zeros_of(v)
            if isinstance(v, dict)
            else torch.zeros_like(v)
            if isinstance(v, torch.Tensor)
            else None
        )
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's note on single-process dcp calls, silenced for the calls made here on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_rank_local(path: Path, sd: dict[str, Any]) -> None:
    with _quiet():
        dcp.save(sd, checkpoint_id=path, no_dist=True, use_collectives=False)


def test_single_process_falls_back_to_rank_0(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sd = rank_model(0)
    save_rank_local(path, sd)
    assert sorted(p.name for p in path.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    dest = zeros_of(sd)
    stats = asyncload.load(dest, path)
    assert_bitwise_equal(dest, sd)
    assert stats.files == 2  # __0.metadata and the data file
    dest = zeros_of(sd)
    with _quiet():
        dcp.load(dest, storage_reader=PipelinedReader(path), no_dist=True)  # torch's own fallback
    assert_bitwise_equal(dest, sd)


def test_neither_metadata_names_both(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sd = rank_model(0)
    save_rank_local(path, sd)
    (path / "__0.metadata").unlink()
    with pytest.raises(CheckpointNotFoundError) as ei:
        asyncload.load(zeros_of(sd), path)
    msg = str(ei.value)
    assert (
        ".metadata does not exist" in msg
        and "__0.metadata" in msg
        and "use_collectives=False" in msg
    )


def test_damaged_global_metadata_does_not_fall_back(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sd = rank_model(0)
    save_rank_local(path, sd)
    (path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    dest = zeros_of(sd)
    with pytest.raises(CheckpointFormatError, match=r"\.metadata"):
        asyncload.load(dest, path)
    assert not bool(dest["w"].any())


# --- 2 ranks on gloo -----------------------------------------------------------------------------


def w_save_and_load(rank: int, world: int, path: str, zstd: bool) -> dict[str, Any]:
    sd = rank_model(rank)
    if zstd:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._extension import ZStandard

        dcp.save(
            sd,
            storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]),
            use_collectives=False,
        )
    else:
        dcp.save(sd, checkpoint_id=path, use_collectives=False)
    dist.barrier()
    ours = zeros_of(sd)
    stats = asyncload.load(ours, path)
    theirs = zeros_of(sd)
    dcp.load(theirs, checkpoint_id=path)
    assert_bitwise_equal(ours, sd, where=f"rank {rank}")
    assert_bitwise_equal(ours, theirs, where=f"rank {rank} against torch")
    return {"files": stats.files, "bytes_assembled": stats.bytes_assembled}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zstd", [False, True], ids=["plain", "zstd"])
def test_two_ranks_each_read_their_own(tmp_path: Path, zstd: bool) -> None:
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        if not ZStandard.is_available():
            pytest.skip("needs the zstandard package (test extra)")
    path = tmp_path / "ckpt"
    values = all_ok(run_ranks(w_save_and_load, 2, str(path), zstd, timeout=90))
    names = sorted(p.name for p in path.iterdir())
    assert ".metadata" not in names and "__0.metadata" in names and "__1.metadata" in names
    for rank, v in enumerate(values):
        want = sum(t.numel() * t.element_size() for t in _tensors(rank_model(rank)))
        assert v["bytes_assembled"] == want
        assert v["files"] >= 2


def _tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in sd.values():
        if isinstance(v, dict):
            out.extend(_tensors(v))
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out
