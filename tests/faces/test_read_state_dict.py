"""read_state_dict / aread_state_dict: loads without a prebuilt state dict, from every format
asyncload reads, checked bit for bit against what was saved; keys, devices, dtypes, the
size checks before allocation, and the state after a failure."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from _ckpt import (
    assert_bitwise_equal,
    asyncload_threads,
    make_checkpoint,
    open_fds_under,
    random_tensor,
    small_state_dict,
    thread_baseline,  # noqa: F401 - autouse fixture
    total_tensor_bytes,
)
from _corrupt import mutate_metadata, records

import asyncload
from asyncload import CheckpointFormatError, LoadOptions, StateDictMismatchError
from asyncload.testing import fake_device

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    sd = small_state_dict()
    sd["blocks"] = [
        random_tensor((32, 16), torch.float32, 9),
        {"b": random_tensor((7,), torch.float64, 10)},
    ]
    return sd


def _stats(caplog: pytest.LogCaptureFixture) -> asyncload.LoadStats:
    """The LoadStats of the last read (its INFO line carries them)."""
    found = [
        r.args[1]
        for r in caplog.records
        if r.name == "asyncload.stream" and isinstance(r.args, tuple)
    ]
    assert found, "no 'read ...' INFO line was logged"
    stats = found[-1]
    assert isinstance(stats, asyncload.LoadStats)
    return stats


def test_dcp_nested_with_objects_bit_for_bit(ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, saved = ckpt
    out = asyncload.read_state_dict(path)
    assert_bitwise_equal(out, saved)  # nested dicts and lists as saved, objects decoded
    assert isinstance(out["blocks"], list) and out["step"] == 4000 and out["name"] == "run7"


def test_async_face(ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, saved = ckpt
    out = asyncio.run(asyncload.aread_state_dict(path))
    assert_bitwise_equal(out, saved)
    assert asyncload_threads() == []


def test_keys_read_only_their_bytes(
    ckpt: tuple[Path, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    path, saved = ckpt
    caplog.set_level(logging.INFO, logger="asyncload.stream")
    asyncload.read_state_dict(path)
    everything = _stats(caplog).bytes_read
    recs = records(path)

    out = asyncload.read_state_dict(path, keys=["w"])
    assert list(out) == ["w"]
    assert_bitwise_equal(out["w"], saved["w"])
    w_read = _stats(caplog).bytes_read
    assert saved["w"].nbytes <= w_read <= recs["w"].length < everything

    # a name selects what is saved under it; patterns; a callable
    out = asyncload.read_state_dict(path, keys=["layers"])
    assert_bitwise_equal(out, {"layers": saved["layers"]})
    out = asyncload.read_state_dict(path, keys=["layers.*.q", "e*"])
    assert_bitwise_equal(
        out, {"emb": saved["emb"], "layers": {"0": {"q": saved["layers"]["0"]["q"]}}}
    )
    # both records, and at most the small gap between them (neighbours are coalesced)
    span = recs["layers.0.q"].offset + recs["layers.0.q"].length - recs["emb"].offset
    assert (
        recs["emb"].length + recs["layers.0.q"].length - 2048 <= _stats(caplog).bytes_read <= span
    )
    out = asyncload.read_state_dict(
        path, keys=lambda name: name.startswith("blocks.") or name == "step"
    )
    assert_bitwise_equal(out, {"blocks": saved["blocks"], "step": 4000})
    out = asyncload.read_state_dict(path, keys=["blocks.1"])  # a list keeps its length
    assert_bitwise_equal(out, {"blocks": [None, saved["blocks"][1]]})


def test_keys_that_select_nothing_are_an_error(ckpt_path: Path) -> None:
    with pytest.raises(StateDictMismatchError, match=r"keys='wq' selects nothing"):
        asyncload.read_state_dict(ckpt_path, keys=["w", "wq"])
    with pytest.raises(TypeError, match="keys must be names"):
        asyncload.read_state_dict(ckpt_path, keys=[3])  # type: ignore[list-item]


def test_meta_reads_no_data(
    ckpt: tuple[Path, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    path, saved = ckpt
    caplog.set_level(logging.INFO, logger="asyncload.stream")
    out = asyncload.read_state_dict(path, device="meta")
    stats = _stats(caplog)
    assert stats.bytes_read == 0 and stats.chunks == 0
    assert "step" not in out and "name" not in out  # objects are data: not read
    assert out["layers"]["0"]["q"].device.type == "meta"
    assert out["emb"].shape == saved["emb"].shape and out["emb"].dtype == torch.bfloat16
    assert out["blocks"][1]["b"].dtype == torch.float64


def test_dtype_converts_floating_tensors_only(ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, saved = ckpt
    out = asyncload.read_state_dict(
        path, keys=["w", "emb", "layers", "mask", "c"], dtype=torch.bfloat16
    )
    assert_bitwise_equal(out["w"], saved["w"].to(torch.bfloat16))
    assert_bitwise_equal(out["emb"], saved["emb"])
    assert_bitwise_equal(
        out["layers"]["0"]["norm"], saved["layers"]["0"]["norm"].to(torch.bfloat16)
    )
    assert_bitwise_equal(out["layers"]["0"]["q"], saved["layers"]["0"]["q"])  # int8 kept
    assert_bitwise_equal(out["mask"], saved["mask"])  # bool kept
    assert_bitwise_equal(out["c"], saved["c"])  # complex kept
    with pytest.raises(ValueError, match="must be a floating dtype"):
        asyncload.read_state_dict(path, dtype=torch.int32)


def test_device_path(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Destinations the device copier claims go through the pinned ring (a fake device here)."""
    path, saved = ckpt
    with fake_device(delay=0.0005) as fake:
        out = asyncload.read_state_dict(
            path, options=LoadOptions(memory_budget=256 << 10, chunk_size=64 << 10)
        )
    assert_bitwise_equal(out, saved)
    assert fake.copies > 0 and fake.bytes_copied >= total_tensor_bytes(saved)
    assert fake.pageable_sources == 0 and fake.pinned_bytes == 0
    with pytest.raises(ValueError, match="device='tpu'"):
        asyncload.read_state_dict(path, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            asyncload.read_state_dict(path, device="cuda:0")


def test_safetensors_single_and_indexed(tmp_path: Path) -> None:
    a = {
        "model.embed.weight": random_tensor((64, 32), torch.bfloat16, 1),
        "model.norm": random_tensor((32,), torch.float32, 2),
    }
    b = {"lm_head.weight": random_tensor((16, 32), torch.float16, 3)}
    single = tmp_path / "one.safetensors"
    safetensors.torch.save_file({**a, **b}, str(single))
    assert_bitwise_equal(asyncload.read_state_dict(single), {**a, **b})

    d = tmp_path / "sharded"
    d.mkdir()
    safetensors.torch.save_file(a, str(d / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file(b, str(d / "model-00002-of-00002.safetensors"))
    weight_map = dict.fromkeys(a, "model-00001-of-00002.safetensors") | dict.fromkeys(
        b, "model-00002-of-00002.safetensors"
    )
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    out = asyncload.read_state_dict(d, keys=["model.*"])
    assert_bitwise_equal(out, a)  # flat names stay flat
    out = asyncload.read_state_dict(d, dtype=torch.float32)
    assert_bitwise_equal(out, {k: v.to(torch.float32) for k, v in {**a, **b}.items()})


def test_torch_save_file(tmp_path: Path) -> None:
    sd = {
        "w": random_tensor((40, 30), torch.float32, 4),
        "q": random_tensor((9,), torch.int16, 5),
        "epoch": 3,
    }
    f = tmp_path / "model.pt"
    torch.save(sd, f)
    assert_bitwise_equal(asyncload.read_state_dict(f), sd)


def test_a_nested_torch_save_file_comes_back_nested_as_torch_load_gives_it(tmp_path: Path) -> None:
    sd = {
        "model": {
            "w": random_tensor((8, 3), torch.bfloat16, 7),
            "layers": [random_tensor((5,), torch.float32, 8)],
        },
        "optim": {"lr": 0.1, "step": 12},
        "epoch": 3,
    }
    f = tmp_path / "nested.pt"
    torch.save(sd, f)
    out = asyncload.read_state_dict(f)
    assert_bitwise_equal(out, torch.load(f, weights_only=True))
    assert_bitwise_equal(out, sd)
    # selected by flattened name, nested back
    assert_bitwise_equal(
        asyncload.read_state_dict(f, keys=["model.w"]), {"model": {"w": sd["model"]["w"]}}
    )


def test_from_s3(ckpt: tuple[Path, dict[str, Any]], s3_server: Any, bucket_name: str) -> None:
    path, saved = ckpt
    url = s3_server.upload_dir(path, bucket_name, "run/rsd")
    out = asyncload.read_state_dict(
        url, keys=["w", "layers"], storage_options=s3_server.storage_options()
    )
    assert_bitwise_equal(out, {"w": saved["w"], "layers": saved["layers"]})


def _forged(tmp_path: Path) -> Path:
    """A real 1.6 KiB save whose .metadata claims one 8 GiB tensor."""
    path = make_checkpoint(tmp_path / "forged", {"big": random_tensor((400,), torch.float32, 6)})

    def claim(md: Any) -> None:
        smd = md.state_dict_metadata["big"]
        smd.size = torch.Size([1 << 31])
        smd.chunks[0].sizes = torch.Size([1 << 31])

    mutate_metadata(path, claim)
    return path


def test_claims_checked_against_files_before_allocating(tmp_path: Path) -> None:
    path = _forged(tmp_path)
    # the child has 2 GiB of address space to spare: allocating the 8 GiB claimed would fail in torch
    code = textwrap.dedent(
        f"""
        import resource, sys, asyncload, torch
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
        try:
            asyncload.read_state_dict({str(path)!r})
        except asyncload.CheckpointFormatError as exc:
            print("typed:", exc)
            sys.exit(0)
        sys.exit(5)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "'big'" in res.stdout and "8589934592 bytes" in res.stdout and "record of" in res.stdout
    with pytest.raises(CheckpointFormatError, match=r"claims a chunk of shape \[2147483648\]"):
        asyncload.read_state_dict(path)
    assert asyncload_threads() == [] and open_fds_under(path) == []


def test_truncated_file_is_found_before_allocating(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = fresh_ckpt
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        asyncload.read_state_dict(path)
    assert asyncload_threads() == [] and open_fds_under(path) == []


def test_cancelled_async_read_leaves_nothing(ckpt_path: Path) -> None:
    """Cancelled once the first bytes landed (1 of about 300 reads): CancelledError, and no
    thread or file of the read is left."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        landed = asyncio.Event()
        task = asyncio.ensure_future(
            asyncload.aread_state_dict(
                ckpt_path,
                options=LoadOptions(chunk_size=4096, min_chunk_size=4096, concurrency=1),
                progress=lambda done, total: loop.call_soon_threadsafe(landed.set),
            )
        )
        await landed.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert asyncload_threads() == [] and open_fds_under(ckpt_path) == []


def test_progress_moves_forward_to_the_total(ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, saved = ckpt
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        with lock:
            seen.append((done, total))

    out = asyncload.read_state_dict(
        path, keys="layers", progress=progress, options=LoadOptions(chunk_size=16 << 10)
    )
    assert_bitwise_equal(
        out, {"layers": saved["layers"]}
    )  # a single string is one name or pattern
    want = total_tensor_bytes(saved["layers"])
    assert seen and all(total == want for _, total in seen)
    done = [d for d, _ in seen]
    assert done == sorted(set(done)) and done[-1] == want
