"""The device path (pinned staging ring + side stream) on a CPU-only machine.

``asyncload.testing.fake_device()`` makes chosen CPU destinations take exactly the code path
CUDA destinations take - ring slots, deliverers, events, the pipeline hook - with a fake
copier whose "stream" is a worker thread that runs each copy later (after a delay), so a
slot handed back before its copies ran, or a load returning before they finished, shows
up as wrong bytes. The copier also checks that every copy's source is pinned (a ring slot
or a bounce buffer), never the destination's pageable neighbour or an mmap.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, random_tensor
from safetensors.torch import save as st_save
from safetensors.torch import save_file

import asyncload
from asyncload import LoadOptions
from asyncload.engine.config import ring_geometry
from asyncload.testing import fake_device

SMALL = LoadOptions(
    chunk_size=16 << 10, min_chunk_size=2 << 10, memory_budget=64 << 10, concurrency=8
)


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "big": random_tensor((200, 160), torch.float32, seed),  # many slots' worth
        "bf16": random_tensor((300, 50), torch.bfloat16, seed + 1),
        "norm": random_tensor((160,), torch.float16, seed + 2),
        "fp8": random_tensor((33, 17), torch.float8_e4m3fn, seed + 3),
        "flags": random_tensor((100,), torch.bool, seed + 4),
        "scalar": random_tensor((), torch.float64, seed + 5),
        "empty": torch.empty(0, 4),
    }


def zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def write(fmt: str, root: Path, sd: dict[str, torch.Tensor]) -> Path:
    if fmt == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=root / "dcp", no_dist=True)
        return root / "dcp"
    if fmt == "safetensors":
        save_file(sd, str(root / "model.safetensors"))
        return root / "model.safetensors"
    torch.save(sd, root / "model.pt")
    return root / "model.pt"


def assert_clean(fake: Any) -> None:
    """Every copy came from pinned memory; nothing pinned or pending is left behind."""
    assert fake.pageable_sources == 0
    assert fake.pinned_bytes == 0
    assert fake._pending == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "torch.save"])
@pytest.mark.parametrize(
    "options",
    [SMALL, LoadOptions(memory_budget=64 << 10, concurrency=1), None],
    ids=["small-c8", "tiny-budget-c1", "default"],
)
def test_device_destinations_bit_exact(
    tmp_path: Path, fmt: str, options: LoadOptions | None
) -> None:
    sd = state()
    ckpt = write(fmt, tmp_path, sd)
    with fake_device(delay=0.0005) as fake:
        dest = zeros(sd)
        stats = asyncload.load(dest, ckpt, options=options)
        # read after load() returned: every device copy must have finished by then
        assert_bitwise_equal(dest, sd)
        assert_clean(fake)
        assert fake.begun == 1 and fake.synchronized >= 1
        assert fake.copies >= 6
        assert fake.bytes_copied >= sum(v.numel() * v.element_size() for v in sd.values())
        o = options or LoadOptions()
        budget = o.memory_budget
        slots, slot = ring_geometry(budget, o.effective_chunk_size)
        assert slots * slot <= budget
        if fmt != "dcp":  # everything through the ring, nothing bounced
            assert fake.peak_pinned_bytes == slots * slot
        assert stats.peak_buffered_bytes <= budget


@pytest.mark.timeout(60)
def test_slots_are_reused_only_after_their_copies_ran(tmp_path: Path) -> None:
    """A 64 KiB budget gives two 32 KiB slots for 128 KiB of data, and each copy runs 5 ms
    after it was queued: reusing a slot early would overwrite bytes not yet copied."""
    sd = {"w": random_tensor((256, 128), torch.float32, 9)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    opts = LoadOptions(
        chunk_size=32 << 10, min_chunk_size=1 << 10, memory_budget=64 << 10, concurrency=16
    )
    assert ring_geometry(opts.memory_budget, opts.effective_chunk_size) == (2, 32 << 10)
    with fake_device(delay=0.005) as fake:
        dest = zeros(sd)
        asyncload.load(dest, path, options=opts)
        assert_bitwise_equal(dest, sd)
        assert fake.copies == 4
        assert fake.peak_pinned_bytes == 64 << 10
        assert_clean(fake)


@pytest.mark.timeout(60)
def test_mixed_cpu_and_device_destinations(tmp_path: Path) -> None:
    sd = state(1)
    path = write("torch.save", tmp_path, sd)
    dest = zeros(sd)
    on_device = {dest["big"].data_ptr(), dest["fp8"].data_ptr()}
    with fake_device(claim=lambda t: t.data_ptr() in on_device) as fake:
        asyncload.load(dest, path, options=SMALL)
        assert_bitwise_equal(dest, sd)
        assert_clean(fake)
        device_bytes = 200 * 160 * 4 + 33 * 17
        assert fake.bytes_copied == device_bytes  # the CPU destinations were filled directly


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_non_contiguous_and_cast_destinations_on_device(tmp_path: Path, fmt: str) -> None:
    """Strided views and dtype casts are done on the device from raw bytes (scratch + one copy)."""
    sd = {
        "w": random_tensor((64, 48), torch.bfloat16, 3),
        "m": random_tensor((40, 30), torch.float32, 4),
    }
    ckpt = write(fmt, tmp_path, sd)
    dest = {
        "w": torch.zeros(64, 48),
        "m": torch.zeros(30, 40).t(),
    }  # cast bf16 -> f32; transposed view
    with fake_device() as fake:
        asyncload.load(
            dest,
            ckpt,
            options=LoadOptions(
                allow_dtype_cast=True,
                chunk_size=8 << 10,
                min_chunk_size=1 << 10,
                memory_budget=64 << 10,
            ),
        )
        assert_bitwise_equal(dest["w"], sd["w"].float())  # the same cast torch does on the host
        assert_bitwise_equal(dest["m"].contiguous(), sd["m"])
        assert_clean(fake)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "torch.save"])
def test_remote_source_through_the_ring(tmp_path: Path, fmt: str) -> None:
    sd = state(2)
    local = write(fmt, tmp_path, sd)
    fs = fsspec.filesystem("memory")
    root = f"/cuda-{fmt}"
    if local.is_dir():
        for p in local.iterdir():
            fs.pipe(f"{root}/ck/{p.name}", p.read_bytes())
        url = f"memory://{root}/ck"
    else:
        fs.pipe(f"{root}/{local.name}", local.read_bytes())
        url = f"memory://{root}/{local.name}"
    try:
        with fake_device(delay=0.0002) as fake:
            dest = zeros(sd)
            asyncload.load(dest, url, options=SMALL)
            assert_bitwise_equal(dest, sd)
            assert_clean(fake)
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.timeout(60)
def test_failed_load_leaves_nothing_pinned_or_in_flight(tmp_path: Path) -> None:
    sd = {
        "a": random_tensor((128, 128), torch.float32, 1),
        "b": random_tensor((128, 128), torch.float32, 2),
    }
    raw = st_save(sd)
    fs = fsspec.filesystem("memory")
    # the header promises more than the file holds: the read of b's bytes comes back short
    fs.pipe("/cuda-cut/model.safetensors", raw[: len(raw) - 1000])
    try:
        with fake_device(delay=0.001) as fake:
            with pytest.raises(asyncload.CheckpointFormatError):
                asyncload.load(
                    zeros(sd),
                    "memory://cuda-cut/model.safetensors",
                    options=LoadOptions(
                        retries=0,
                        chunk_size=8 << 10,
                        min_chunk_size=1 << 10,
                        memory_budget=64 << 10,
                    ),
                )
            assert_clean(fake)
    finally:
        fs.rm("/cuda-cut", recursive=True)


@pytest.mark.timeout(60)
def test_aload_and_dcp_load_take_the_device_path(tmp_path: Path) -> None:
    import asyncio

    sd = state(3)
    path = write("safetensors", tmp_path, sd)
    with fake_device(delay=0.0002) as fake:
        dest = zeros(sd)
        asyncio.run(asyncload.aload(dest, path, options=SMALL))
        assert_bitwise_equal(dest, sd)
        dest = zeros(sd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                dest,
                storage_reader=asyncload.PipelinedReader(path),
                planner=asyncload.PipelinedLoadPlanner(),
                no_dist=True,
            )
        assert_bitwise_equal(dest, sd)
        assert fake.begun == 2
        assert_clean(fake)


@pytest.mark.parametrize(
    "budget, chunk, expect",
    [
        (64 << 10, 16 << 20, (2, 32 << 10)),
        (512 << 20, 16 << 20, (8, 16 << 20)),
        (48 << 20, 16 << 20, (3, 16 << 20)),
        (1 << 20, 256 << 10, (4, 256 << 10)),
    ],
)
def test_ring_geometry_stays_within_the_budget(
    budget: int, chunk: int, expect: tuple[int, int]
) -> None:
    opts = LoadOptions(memory_budget=budget, chunk_size=chunk, min_chunk_size=min(chunk, 1 << 20))
    slots, slot = ring_geometry(budget, opts.effective_chunk_size)
    assert (slots, slot) == expect
    assert 2 <= slots <= 8 and slots * slot <= budget and slot <= opts.effective_chunk_size
