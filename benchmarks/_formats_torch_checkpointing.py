"""asyncload.load / read_state_dict against torch-checkpointing's own CheckpointManager.load.

    python benchmarks/bench_formats.py --part torch-checkpointing [--layers 32] [--rounds 4]

One 1-rank checkpoint written by torch-checkpointing 0.1.1 (``--layers`` bf16 2048 x 2048
tensors, 8 MiB each, in a ``model`` item with a resharder, plus a ``step``), local, warm page
cache (every file read once before the clock), the three loaders interleaved round by round in
one process: into destinations made by ``torch.zeros`` (``asyncload.load`` and
torch-checkpointing's ``load(into=...)``) or allocated by the loader (``read_state_dict``).
Every asyncload load is checked bit for bit. Prints the median and best of each.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

import asyncload

logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)


def manager() -> Any:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder())},
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    try:
        ckpt = tmp / "ck"
        g = torch.Generator().manual_seed(0)
        sd = {
            f"layers.{i}.w": torch.randn(2048, 2048, generator=g).bfloat16()
            for i in range(args.layers)
        }
        m = manager()
        m.save(str(ckpt), {"model": sd, "step": 5})
        m.close()
        for f in ckpt.iterdir():
            f.read_bytes()  # warm
        times: dict[str, list[float]] = {
            "torch-checkpointing load": [],
            "asyncload.load": [],
            "read_state_dict": [],
        }
        for _ in range(args.rounds):
            dest = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "step": 0}
            m = manager()
            t = time.perf_counter()
            m.load(str(ckpt), into=dest)
            times["torch-checkpointing load"].append(time.perf_counter() - t)
            m.close()
            dest = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}, "step": 0}
            t = time.perf_counter()
            asyncload.load(dest, ckpt)
            times["asyncload.load"].append(time.perf_counter() - t)
            assert all(torch.equal(dest["model"][k], sd[k]) for k in sd) and dest["step"] == 5
            t = time.perf_counter()
            out = asyncload.read_state_dict(ckpt)
            times["read_state_dict"].append(time.perf_counter() - t)
            assert all(torch.equal(out["model"][k], sd[k]) for k in sd) and out["step"] == 5
        gib = sum(v.numel() * v.element_size() for v in sd.values()) / 2**30
        print(f"{gib * 1024:.0f} MiB in {len(sd)} tensors, {args.rounds} rounds")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{name:26s} median {med * 1e3:8.1f} ms  best {min(ts) * 1e3:8.1f} ms  ({gib / med:.2f} GiB/s)"
            )
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
