"""A/B of two asyncload trees on one multi-rank load of a local checkpoint: ``--world`` gloo
ranks on 127.0.0.1 (fresh processes every run, the load faces imported before the clock),
each loading the whole checkpoint (``asyncload.load`` with its defaults: the replicated,
every-rank-reads-its-own case of one machine), the trees alternated round by round (order
flipped each round). The time of a run is its slowest rank's, from a barrier before the load.

    python benchmarks/ab_distributed_local.py --a /path/to/old/tree --b /path/to/new/tree

A tree is a directory that holds the ``asyncload`` package (``git archive REV | tar -x -C
DIR``, or a checkout). Prints each tree's median and every round's time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C
import torch
import torch.multiprocessing as mp


def model(tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.w": torch.randn(256, 256, generator=g) for i in range(tensors)}


def rank_main(rank: int, world: int, port: int, out: Any, path: str, tree: str, n: int) -> None:
    sys.path.insert(0, tree)
    import torch.distributed as dist

    import asyncload
    from asyncload import ShardedLoadPlanner  # noqa: F401 - the faces: not on the clock

    try:
        if not asyncload.__file__ or not asyncload.__file__.startswith(tree):
            raise RuntimeError(f"imported {asyncload.__file__}, not the tree {tree}")
        C.join_gloo(rank, world, port)
        sd = {f"layers.{i}.w": torch.zeros(256, 256) for i in range(n)}
        dist.barrier()
        t0 = time.monotonic()
        asyncload.load(sd, path)
        seconds = time.monotonic() - t0
        ok = all(torch.equal(sd[k], v) for k, v in model(n).items())
        out.put((rank, {"seconds": seconds, "ok": ok}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # pragma: no cover - reported by the parent
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run(path: str, tree: str, world: int, n: int) -> float:
    results = C.spawn_ranks(rank_main, world, (path, tree, n), timeout=120)
    if not all(v["ok"] for v in results):
        raise SystemExit(f"{tree}: a rank loaded wrong bytes")
    return max(v["seconds"] for v in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the tree before")
    ap.add_argument("--b", required=True, help="the tree after")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=8, help="tensors of 256 KiB")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    trees = [os.path.abspath(args.a), os.path.abspath(args.b)]
    if trees[0] == trees[1]:
        ap.error("--a and --b name the same tree: copy one (git worktree add, git archive)")
    import torch.distributed.checkpoint as dcp

    print(f"load average before: {C.loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ck")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(model(args.tensors), checkpoint_id=path, no_dist=True)
        mp.get_context("forkserver").set_forkserver_preload(["torch"])
        times: dict[str, list[float]] = {t: [] for t in trees}
        for i in range(args.rounds):
            for t in trees if i % 2 == 0 else trees[::-1]:
                times[t].append(run(path, t, args.world, args.tensors))
    print(
        f"{args.world} ranks, {args.tensors} tensors of 256 KiB each, local, {args.rounds} rounds"
    )
    for name, t in zip(("A", "B"), trees):
        xs = times[t]
        print(
            f"{name} {t}: median {statistics.median(xs):.4f} s  "
            + " ".join(f"{x:.3f}" for x in xs)
        )
    print(f"load average after: {C.loadavg()}")


if __name__ == "__main__":
    main()
