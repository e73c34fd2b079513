"""How many copies of a broadcast each rank sends over gloo (the ``.metadata`` exchange,
:mod:`asyncload.engine.metadata_read`, is one ``dist.broadcast`` from rank 0).

Each of ``--world`` gloo ranks (fresh processes, loopback) broadcasts ``--mib`` MiB from
rank 0 and reports the bytes its process wrote meanwhile (``wchar`` of ``/proc/self/io``:
socket writes included) in copies of the message, and whether it received the bytes. gloo's
broadcast is a binomial tree: rank 0 sends ``ceil(log2(world))`` copies, the ranks that
received one forward it, half of the ranks send none.

Run:  python benchmarks/probe_gloo_broadcast.py --world 8
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from _common import join_gloo, spawn_ranks


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _rank(rank: int, world: int, port: int, out: Any, mib: int) -> None:
    try:
        join_gloo(rank, world, port)
        n = mib << 20
        buf = torch.full((n,), 7 if rank == 0 else 0, dtype=torch.uint8)
        dist.barrier()
        before = _wchar()
        dist.broadcast(buf, src=0)
        sent = _wchar() - before
        dist.barrier()
        out.put((rank, {"copies": sent / n, "received": bool((buf == 7).all())}))
        dist.destroy_process_group()
    except Exception as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    rows = spawn_ranks(_rank, args.world, (args.mib,), timeout=300, what="the broadcast")
    print(f"{args.world} gloo ranks, a {args.mib} MiB broadcast from rank 0")
    print("| rank | copies sent | received |")
    print("| ---: | ---: | --- |")
    for rank, row in enumerate(rows):
        print(f"| {rank} | {row['copies']:.2f} | {row['received']} |")


if __name__ == "__main__":
    main()
