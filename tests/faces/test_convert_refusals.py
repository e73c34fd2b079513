"""``convert`` refuses what safetensors cannot read back, before writing anything (issue 25,
item 6): a tensor named ``__metadata__``, a name with a lone surrogate, a shard header over
safetensors' 100 MB limit; and a destination that is a symbolic link (dangling, or to an
empty directory) is an existing destination: replaced only with ``--force``.

Inputs are real ``dcp.save`` / ``torch.save`` outputs; what the refusal promises (nothing
written, no temporary left, the link and its target untouched) is checked on disk.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from asyncload.cli import EXIT_LOAD_ERROR, EXIT_USAGE, main
from asyncload.faces import convert as _convert
from asyncload.faces.convert import SAFETENSORS_MAX_HEADER, convert

pytestmark = pytest.mark.timeout(120)


def _dcp(path: Path, sd: dict[str, Any]) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def _nothing_written(parent: Path, src: str) -> None:
    assert sorted(p.name for p in parent.iterdir()) == [src]  # no output, no temporary


@pytest.mark.parametrize("fmt", ["dcp", "torch.save"])
def test_a_tensor_named_metadata_is_refused(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = {"w": torch.ones(3), "__metadata__": torch.zeros(2)}
    if fmt == "dcp":
        src = _dcp(tmp_path / "src", sd)
    else:
        src = tmp_path / "src"
        torch.save(sd, src)
    with pytest.raises(ValueError) as info:
        convert(src, tmp_path / "out")
    assert str(info.value) == (
        "key '__metadata__' is the name safetensors reserves for a file's metadata, not a tensor: "
        "leave it out (keys=...) or rename it"
    )
    _nothing_written(tmp_path, "src")
    assert main(["convert", str(src), str(tmp_path / "out"), "--no-progress"]) == EXIT_LOAD_ERROR
    assert "key '__metadata__' is the name safetensors reserves" in capsys.readouterr().err
    _nothing_written(tmp_path, "src")
    convert(src, tmp_path / "out", keys=["w"])  # what the message suggests works
    assert torch.equal(
        safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))["w"], sd["w"]
    )


def test_a_lone_surrogate_is_refused(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "src", {"ok": torch.ones(2), "half\udc80": torch.ones(2)})
    with pytest.raises(ValueError) as info:
        convert(src, tmp_path / "out")
    assert str(info.value) == (
        "key 'half\\udc80' holds '\\udc80' at 4, a lone surrogate, which is not UTF-8: "
        "safetensors' header is UTF-8 JSON; leave the key out (keys=...) or rename it"
    )
    _nothing_written(tmp_path, "src")


def test_safetensors_reads_no_header_over_the_limit(tmp_path: Path) -> None:
    """The limit is safetensors' own: a header of exactly SAFETENSORS_MAX_HEADER bytes loads,
    8 bytes more do not."""
    for extra, ok in ((0, True), (8, False)):
        body = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
        body += b" " * (SAFETENSORS_MAX_HEADER + extra - len(body))
        f = tmp_path / f"h{extra}.safetensors"
        f.write_bytes(struct.pack("<Q", len(body)) + body + struct.pack("<f", 1.5))
        del body
        if ok:
            assert safetensors.torch.load_file(str(f))["w"].item() == 1.5
        else:
            with pytest.raises(safetensors.SafetensorError, match="header too large"):
                safetensors.torch.load_file(str(f))
        f.unlink()


def test_a_header_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys enough to pass the limit (lowered here, so that the checkpoint stays small)."""
    src = _dcp(tmp_path / "src", {f"layer.{i:03d}.weight": torch.ones(1) for i in range(40)})
    monkeypatch.setattr(_convert, "SAFETENSORS_MAX_HEADER", 1000)
    with pytest.raises(ValueError) as info:
        convert(src, tmp_path / "out")
    text = str(info.value)
    assert text.startswith("model.safetensors's header would be ")
    assert (
        "(40 tensors, the first 'layer.000.weight'), over the 1000 bytes safetensors reads: lower max_shard_size"
        in text
    )
    _nothing_written(tmp_path, "src")
    convert(src, tmp_path / "out", max_shard_size=40)  # ten tensors a shard: each header fits
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 4


@pytest.mark.parametrize("target", ["empty dir", "dangling"])
def test_a_symlink_destination_is_an_existing_one(
    tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _dcp(tmp_path / "src", {"w": torch.arange(4.0)})
    aim = tmp_path / "aim"
    if target == "empty dir":
        aim.mkdir()
    link = tmp_path / "link"
    link.symlink_to(aim)
    with pytest.raises(
        FileExistsError, match=f"{link} exists \\(a symbolic link to {aim}\\): pass --force"
    ):
        convert(src, link)
    assert main(["convert", str(src), str(link), "--no-progress"]) == EXIT_USAGE
    assert "a symbolic link to" in capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == str(aim)
    assert (aim.is_dir() and not any(aim.iterdir())) if target == "empty dir" else not aim.exists()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == (["aim", "link", "src"] if target == "empty dir" else ["link", "src"])
    convert(src, link, force=True)  # the link is replaced, not followed
    assert not link.is_symlink() and (link / "model.safetensors").is_file()
    assert (aim.is_dir() and not any(aim.iterdir())) if target == "empty dir" else not aim.exists()
