"""Load a torch-checkpointing (DCPv2) checkpoint with asyncload.

    python examples/load_torch_checkpointing.py [--ckpt-dir DIR]

Saves a small model and its step with ``torch_checkpointing.CheckpointManager`` (the
checkpointer torchtitan 0.3.0 uses: one ``<item>_<rank>.pt`` file per item and rank, plus
``metadata.pkl`` for the item that declares a resharder), then loads it into a fresh model with
``asyncload.load``: no pickle of the checkpoint is unpickled, everything is decoded by asyncload's
allow-list. The same call reads ``s3://``, ``gs://`` or ``https://`` URLs. Checks the weights bit
for bit. Set ASYNCLOAD_EXAMPLE_SMALL=1 for a tiny model.

Needs: torch and torch-checkpointing (``pip install torch-checkpointing==0.1.1``), to write the
checkpoint; asyncload reads it without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

import asyncload

WIDTH = 32 if os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1" else 1024

# torch-checkpointing logs a warning for every plain (non-DTensor) tensor of a resharded item
logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.LayerNorm(WIDTH)
    )


def save(path: Path, model: nn.Module, step: int) -> None:
    manager = CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder())},  # writes metadata.pkl too
            save=SyncCheckpointSaverConfig(),
            # O_DIRECT writes fail on some filesystems (ext4 with small pages, tmpfs)
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    try:
        manager.save(str(path), {"model": model.state_dict(), "step": step})
    finally:
        manager.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt-dir", help="where to save (default: a temporary directory, removed afterwards)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.ckpt_dir or tmp) / "step_100"
        trained = make_model(seed=0)
        save(path, trained, step=100)
        print("saved:", ", ".join(sorted(os.listdir(path))))

        fresh = make_model(seed=1)
        dest = {"model": fresh.state_dict(), "step": 0}
        stats = asyncload.load(dest, path)
        print(stats)
        assert dest["step"] == 100
        for key, want in trained.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], want), key
        print(f"resumed at step {dest['step']}: every weight equal bit for bit")


if __name__ == "__main__":
    main()
