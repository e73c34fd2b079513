"""Read a replicated checkpoint once across ranks, whatever their speed: ShardedLoadPlanner.

Every rank of a DDP-style job needs the whole model. With ``ShardedLoadPlanner`` the ranks
read each byte range of the checkpoint once between them and send it to the others over the
process group; work is handed out as ranks get to it (adaptive sharing), so a rank with a
slow link or a busy host reads less instead of holding the others up. Each rank here reaches
the checkpoint through its own path (a copy per rank, as a node-local cache or a mirror
would be): ranks share by the checkpoint's identity, not by its URL.

This script starts its own ranks (gloo on 127.0.0.1) and prints what each one read, sent,
received, took over and hedged. Under ``torchrun`` the same ``load_on_rank`` runs unchanged
on every rank of your job.

    python examples/sharded_load.py

Needs: torch only (its ranks use gloo on 127.0.0.1).
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import asyncload

SMALL = bool(os.environ.get("ASYNCLOAD_EXAMPLE_SMALL"))
RANKS = 2 if SMALL else 4


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = 4 if SMALL else 16
    return {
        f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(n)
    }  # 1 MiB each


def load_on_rank(url: str) -> asyncload.LoadStats:
    """What every rank of a job does: load the whole model from ``url`` into its own tensors."""
    state = {k: torch.zeros_like(v) for k, v in model().items()}
    stats = asyncload.load(state, url, planner=asyncload.ShardedLoadPlanner())
    want = model()
    assert all(torch.equal(state[k], want[k]) for k in want), (
        "loaded tensors differ from the saved ones"
    )
    return stats


def rank_main(rank: int, port: int, urls: list[str], results: Any) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=len(urls),
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        results.put((rank, load_on_rank(urls[rank]).to_dict()))
        # A rank returns from the load as soon as its own tensors are complete (a slower rank
        # falls behind alone); what it still owes slower ranks goes out in the background,
        # from copies, so the tensors are yours at once. Let those sends land before
        # destroying the group.
        asyncload.ShardedLoadPlanner.wait_for_background_sends()
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another still uses it
    finally:
        dist.destroy_process_group()


def main() -> None:
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    with tempfile.TemporaryDirectory() as tmp:
        first = os.path.join(tmp, "ckpt")
        dcp.save(model(), checkpoint_id=first, no_dist=True)
        urls = [first] + [
            shutil.copytree(first, os.path.join(tmp, f"copy-{r}")) for r in range(1, RANKS)
        ]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        mp.start_processes(
            rank_main, args=(port, urls, results), nprocs=RANKS, start_method="spawn"
        )
        stats = dict(results.get(timeout=60) for _ in range(RANKS))
    mib = 1 << 20
    total = sum(s["bytes_read"] for s in stats.values())
    print(
        f"{RANKS} ranks loaded {stats[0]['bytes_assembled'] / mib:.1f} MiB each, reading {total / mib:.1f} MiB in total:"
    )
    for rank in sorted(stats):
        s = stats[rank]
        print(
            f"  rank {rank}: read {s['bytes_read'] / mib:.2f} MiB, sent {s['bytes_sent'] / mib:.2f}, received "
            f"{s['bytes_received'] / mib:.2f}, took over {s['bytes_taken_over'] / mib:.2f}, "
            f"hedged {s['bytes_hedged'] / mib:.2f}"
        )
    print(asyncload.LoadStats.from_dict(stats[0]))


if __name__ == "__main__":
    main()
