"""Several ranks under ``torchrun``: every rank loads the whole checkpoint, read once between them.

What each rank of a data-parallel job does (docs/quickstart.md, "Several ranks")::

    torchrun --nproc-per-node 2 examples/torchrun_load.py /path/to/checkpoint

``init_process_group`` first; ``asyncload.load`` with ``ShardedLoadPlanner`` on every rank (each
byte range is read by one rank and sent to the others over the group); then
``wait_for_background_sends()`` (what this rank still owes slower ranks) before
``destroy_process_group()``.

Needs: torch only (gloo on this machine's loopback). Run without arguments, it saves a small
checkpoint into a temporary directory and starts itself under ``torchrun`` with 2 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

import asyncload


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)
    }  # 256 KiB each


def rank_main(checkpoint: str) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        state = {k: torch.zeros_like(v) for k, v in model().items()}  # your model's state_dict()
        stats = asyncload.load(state, checkpoint, planner=asyncload.ShardedLoadPlanner())
        want = model()
        assert all(torch.equal(state[k], want[k]) for k in want), (
            "loaded tensors differ from the saved ones"
        )
        if dist.get_rank() == 0:
            print(stats)
        print(
            f"rank {dist.get_rank()}: read {stats.bytes_read} bytes, received {stats.bytes_received}"
            # a remote checkpoint: rank 0 read .metadata and sent its bytes (docs/distributed.md)
            f"; .metadata from rank 0: {stats.metadata_shared}",
            flush=True,
        )
        # a rank returns once its own tensors are complete; what it still owes slower ranks
        # goes out in the background: let it land before the group goes away
        asyncload.wait_for_background_sends()
    finally:
        dist.destroy_process_group()


def main() -> None:
    """No checkpoint given: save one, and run this script under torchrun with 2 ranks."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        with warnings.catch_warnings():  # torch's note that this save runs in one process
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(model(), checkpoint_id=ckpt, no_dist=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ]
        cmd += [
            "--log-dir",
            os.path.join(tmp, "logs"),
        ]  # torchrun's own logs, removed with the rest
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        subprocess.run([*cmd, __file__, ckpt], check=True, env=env)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(sys.argv[1])
    else:
        main()
