"""The symlink policy for local checkpoints (docs/integrity.md): names in metadata and
indexes are validated lexically (no ``..``, absolute paths or escapes), and a file that is
a symbolic link is followed, as torch's ``FileSystemReader``, safetensors and the Hugging
Face cache (whose snapshot directories are links into ``blobs/``) do. A link loop or a
link to something that is not a regular file is a clear error, never a hang."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import asyncload
from asyncload import StorageReadError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]


def test_a_dcp_data_file_that_links_out_of_the_directory_is_followed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(32, dtype=torch.float32)}, checkpoint_id=ckpt, no_dist=True)
    (data,) = [p for p in ckpt.iterdir() if p.suffix == ".distcp"]
    elsewhere = tmp_path / "store" / data.name
    elsewhere.parent.mkdir()
    data.rename(elsewhere)
    data.symlink_to(elsewhere)
    dest = {"w": torch.zeros(32)}
    asyncload.load(dest, ckpt)
    assert torch.equal(dest["w"], torch.arange(32, dtype=torch.float32))


def test_a_hugging_face_cache_snapshot_of_links_into_blobs_loads(tmp_path: Path) -> None:
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    tensors = {
        "a": torch.arange(8, dtype=torch.bfloat16),
        "b": torch.ones(3, 4, dtype=torch.int32),
    }
    save_file(tensors, str(blobs / "0f1e2d"))
    os.symlink(os.path.relpath(blobs / "0f1e2d", snap), snap / "model.safetensors")
    dest = {k: torch.zeros_like(v) for k, v in tensors.items()}
    asyncload.load(dest, snap)
    for k, v in tensors.items():
        assert torch.equal(dest[k], v) and dest[k].dtype == v.dtype


@pytest.mark.parametrize("kind", ["loop", "directory", "dangling"])
def test_a_data_file_link_that_leads_nowhere_readable_is_a_clear_error(
    tmp_path: Path, kind: str
) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(32, dtype=torch.float32)}, checkpoint_id=ckpt, no_dist=True)
    (data,) = [p for p in ckpt.iterdir() if p.suffix == ".distcp"]
    data.unlink()
    if kind == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        data.symlink_to(tmp_path / "a")
    elif kind == "directory":
        data.symlink_to(tmp_path)
    else:
        data.symlink_to(tmp_path / "missing")
    dest = {"w": torch.zeros(32)}
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(dest, ckpt)
    assert data.name in str(ei.value)
    assert torch.equal(dest["w"], torch.zeros(32))
