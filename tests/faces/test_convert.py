"""convert / ``asyncload convert``: Hugging Face-style safetensors from every format asyncload
reads, checked with safetensors' own loader bit for bit; shards, index, keys, overwrite
refusal, atomic writes and the memory bound."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from _ckpt import (
    assert_bitwise_equal,
    asyncload_threads,
    iter_tensors,
    random_tensor,
    thread_baseline,  # noqa: F401 - autouse fixture
)
from _corrupt import flip_byte, record_of

from asyncload import CheckpointFormatError, LoadOptions
from asyncload.cli import main
from asyncload.faces.convert import convert

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    return {
        "embed": random_tensor((256, 128), torch.bfloat16, 1),  # 64 KiB
        "layers": {
            str(i): {"w": random_tensor((64, 64), torch.float32, 10 + i)} for i in range(6)
        },  # 16 KiB each
        "head": random_tensor((300, 100), torch.float16, 2),  # ~59 KiB
        "ids": random_tensor((50,), torch.int64, 3),
        "mask": random_tensor((33,), torch.bool, 4),
        "empty": torch.empty(0, 4),
        "step": 7,
        "config": {"name": "tiny"},
    }


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    """What safetensors' own loader reads from a converted directory."""
    index = d / "model.safetensors.index.json"
    if not index.exists():
        return safetensors.torch.load_file(str(d / "model.safetensors"))
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        out.update(safetensors.torch.load_file(str(d / shard)))
    assert set(out) == set(weight_map)
    return out


def _tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(iter_tensors({k: v for k, v in sd.items() if k not in ("step", "config")}))


def test_single_file_when_one_shard_fits(
    ckpt: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, saved = ckpt
    result = convert(path, tmp_path / "out")
    assert result.files == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert_bitwise_equal(_load_dir(tmp_path / "out"), _tensors(saved))
    assert sorted(result.skipped_objects) == ["config.name", "step"]
    assert result.total_size == sum(t.nbytes for t in _tensors(saved).values())
    assert asyncload_threads() == []


def test_shards_and_index(
    ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, saved = ckpt
    caplog.set_level(logging.INFO, logger="asyncload.stream")
    budget = 96 << 10
    result = convert(
        path, tmp_path / "out", max_shard_size=40_000, options=LoadOptions(memory_budget=budget)
    )
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    n = len(result.files) - 1
    assert n > 2 and names == sorted(result.files)
    assert [f for f in names if f != "model.safetensors.index.json"] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    want = _tensors(saved)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    assert set(index["weight_map"]) == set(want)
    got = _load_dir(tmp_path / "out")
    assert_bitwise_equal(got, want)
    for shard in set(
        index["weight_map"].values()
    ):  # no shard over the limit but a lone large tensor
        with safetensors.safe_open(str(tmp_path / "out" / shard), "pt") as f:
            keys = list(f.keys())
        size = sum(got[k].nbytes for k in keys)
        assert size <= 40_000 or len(keys) == 1
    # streamed: never more than the budget held (the 64 KiB tensor fits it)
    stats = [r.args[1] for r in caplog.records if r.name == "asyncload.stream"][-1]
    assert stats.peak_buffered_bytes <= budget


def test_other_formats_and_keys(tmp_path: Path) -> None:
    sd = {
        "a.weight": random_tensor((20, 10), torch.float32, 5),
        "b.bias": random_tensor((10,), torch.float16, 6),
    }
    torch.save(sd, tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "from_pt")
    assert_bitwise_equal(_load_dir(tmp_path / "from_pt"), sd)

    safetensors.torch.save_file(sd, str(tmp_path / "in.safetensors"))
    convert(tmp_path / "in.safetensors", tmp_path / "from_st", keys=["a.*"])
    assert_bitwise_equal(_load_dir(tmp_path / "from_st"), {"a.weight": sd["a.weight"]})


def test_refuses_to_overwrite_and_writes_atomically(ckpt_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        convert(ckpt_path, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    with pytest.raises(ValueError, match="holds the checkpoint being converted"):
        convert(ckpt_path, ckpt_path.parent, force=True)
    # a failure mid-way (keys=... selects nothing) leaves neither the output nor a partial one
    with pytest.raises(Exception, match="selects nothing"):
        convert(ckpt_path, out, keys=["nope"], force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    convert(ckpt_path, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left


def test_cli_convert(
    ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, saved = ckpt
    out = tmp_path / "hf"
    code = main(
        [
            "convert",
            str(path),
            str(out),
            "--max-shard-size",
            "40KB",
            "--keys",
            "layers",
            "embed",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "wrote 7 tensors" in captured.out
    want = {k: v for k, v in _tensors(saved).items() if k.startswith(("layers.", "embed"))}
    assert_bitwise_equal(_load_dir(out), want)
    code = main(["convert", str(path), str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and "--force" in captured.err
    code = main(["convert", str(path), str(out), "--force", "--no-progress", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    info = json.loads(captured.out)
    assert info["files"] == ["model.safetensors"] and sorted(info["skipped_objects"]) == [
        "config.name",
        "step",
    ]
    assert "skipped 2 objects" in captured.err
    assert_bitwise_equal(_load_dir(out), _tensors(saved))


def test_damage_mid_stream_leaves_no_output(
    fresh_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A checksum failure after some tensors were written: no DST, no temporary directory."""
    path, _ = fresh_ckpt
    rec = record_of(path, "head")  # not the first tensor in the file: others were written already
    flip_byte(path / rec.file, rec.data_start + 10)
    out = tmp_path / "out"
    with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
        convert(path, out, options=LoadOptions(verify=True, memory_budget=64 << 10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert asyncload_threads() == []
