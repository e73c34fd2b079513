"""Claims at scale: the store traffic of adaptive sharing's claims, and node-aware sharing's
plan, against the number of ranks (issue 29 item 4).

Two parts:

* ``claims`` (default): a replicated checkpoint (``--ckpt-mib``, 1 GiB by default, in 16
  files) loaded on 64 ... 1,024 ranks as nodes of ``--per-node`` (8) ranks. The store
  operations each scheme makes are counted from the real plans: rank-to-rank adaptive
  sharing (one ``compare_set`` per work unit and rank that needs it: ``_rank_plan``'s units,
  256 KiB) and node-aware sharing (one per block and node that needs it:
  ``asyncload.distributed.nodes.plan_blocks``, blocks of 4 units). The traffic itself is
  then replayed against a real ``TCPStore`` (the server in this process, as on rank 0;
  ``--clients`` client processes, each with its own connection, issuing the simulated ranks'
  ``compare_set`` calls unit by unit, so they race on the same keys as ranks do): wall
  seconds, and operations per second. A scheme whose traffic passes ``--max-ops`` is replayed
  for its first ``--max-ops`` operations and its time projected at the measured rate
  (marked ``~``). Also the seconds one rank spends planning it (best of 3).
* ``exchange`` (``--exchange``): the plan exchange of node-aware sharing at 8,192 ranks, on
  ``bench_planning.py``'s simulated 1,002-tensor FSDP checkpoint saved on 1,024 ranks,
  loaded on 8,192 ranks as 1,024 nodes of 8: per read phase, every rank's packed needs
  unpickled (what the session does after the all-gather) and ``plan_blocks`` over them,
  for the whole plan and for what a rank plans (its node's part, ``node=``; the slowest
  of nodes 0, middle and last); seconds and heap peak (tracemalloc), both phases summed.

Run:  python benchmarks/bench_planning.py --part claims  # the claims table (~1-2 min, 2 cores)
      python benchmarks/bench_planning.py --part claims --exchange  # the 8,192-rank exchange (~3 min)
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import pickle
import sys
import time
import tracemalloc
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist

from asyncload.distributed import BLOCK_UNITS, plan_blocks
from asyncload.distributed import share_plan as sharded

MiB = 1 << 20
UNIT = 256 * 1024


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def best_of(fn: Any, n: int = 3) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def heap_peak(fn: Any) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- the claim traffic --------------------------------------------------------------------------


def replicated_needs(world: int, ckpt: int, files: int) -> list[list[tuple[str, int, int]]]:
    per = ckpt // files
    return [[(f"__{i}_0.distcp", 0, per) for i in range(files)] for _ in range(world)]


def rank_ops(needs: list[list[tuple[str, int, int]]]) -> tuple[list[tuple[int, int]], float]:
    """Rank-to-rank adaptive sharing: (unit, rank) per compare_set, and one rank's planning
    seconds (``_rank_plan``)."""
    packed = [sharded._pack(n) for n in needs]
    t, part = best_of(lambda: sharded._rank_plan(packed, 0, UNIT))
    ops = [(u.index, r) for u in part.items for r in u.consumers]
    return ops, t


def node_ops(
    needs: list[list[tuple[str, int, int]]], per_node: int
) -> tuple[list[tuple[int, int]], float]:
    """Node-aware sharing: (block, fetching rank) per compare_set (blocks several nodes
    need, one per node), and one rank's planning seconds (``plan_blocks``)."""
    world = len(needs)
    nodes = [list(range(k, min(world, k + per_node))) for k in range(0, world, per_node)]
    t, blocks = best_of(lambda: plan_blocks(needs, nodes, BLOCK_UNITS * UNIT))
    ops = [(b.seq, f) for b in blocks if len(b.nodes) > 1 for f in b.fetchers]
    return ops, t


def _client(port: int, prefix: str, ops: list[tuple[int, int]], start: Any, out: Any) -> None:
    store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
    out.put("ready")
    start.wait()
    t0 = time.perf_counter()
    for key, rank in ops:
        store.compare_set(f"u/{key}", "", str(rank))
    out.put(time.perf_counter() - t0)


def replay(port: int, prefix: str, ops: list[tuple[int, int]], clients: int) -> float:
    """Wall seconds for ``clients`` processes to issue ``ops`` (each a simulated rank's claim
    of a key), the simulated ranks dealt round-robin to the clients, in unit order."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    per: list[list[tuple[int, int]]] = [[] for _ in range(clients)]
    for key, rank in ops:
        per[rank % clients].append((key, rank))
    procs = [ctx.Process(target=_client, args=(port, prefix, p, start, out)) for p in per]
    for p in procs:
        p.start()
    for _ in procs:  # started and connected
        assert out.get(timeout=120) == "ready"
    start.set()
    wall = max(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return wall


def claims(args: argparse.Namespace) -> None:
    ckpt = args.ckpt_mib * MiB
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(
        f"replicated {args.ckpt_mib} MiB in {args.files} files, units {UNIT >> 10} KiB, node "
        f"blocks {BLOCK_UNITS * UNIT >> 10} KiB, nodes of {args.per_node}; {args.clients} store "
        f"clients; load average {loadavg()}"
    )
    rows = []
    for world in args.ranks:
        needs = replicated_needs(world, ckpt, args.files)
        row: dict[str, Any] = {"ranks": world, "nodes": -(-world // args.per_node)}
        for name, fn in (("rank", rank_ops), ("node", lambda n: node_ops(n, args.per_node))):
            ops, plan_s = fn(needs)
            n = len(ops)
            run = ops[: args.max_ops]
            wall = replay(server.port, f"{name}{world}/", run, args.clients)
            row[f"{name}_ops"] = n
            row[f"{name}_plan_s"] = plan_s
            row[f"{name}_rate"] = len(run) / wall
            row[f"{name}_s"] = wall * n / len(run)
            row[f"{name}_projected"] = len(run) < n
            del ops, run
        rows.append(row)
        print(
            f"  {world} ranks: rank-to-rank {row['rank_ops']:,} ops "
            f"{'~' if row['rank_projected'] else ''}{row['rank_s']:.2f} s, node-aware "
            f"{row['node_ops']:,} ops {'~' if row['node_projected'] else ''}{row['node_s']:.2f} s",
            flush=True,
        )
    print()
    print(
        "| ranks | nodes | rank-to-rank: store ops | ops/unit | store s | plan s | "
        "node-aware: store ops | ops/unit | store s | plan s | ops ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    units = ckpt // UNIT
    for r in rows:
        print(
            f"| {r['ranks']:,} | {r['nodes']:,} | {r['rank_ops']:,} | {r['rank_ops'] / units:.0f} | "
            f"{'~' if r['rank_projected'] else ''}{r['rank_s']:.2f} | {r['rank_plan_s']:.3f} | "
            f"{r['node_ops']:,} | {r['node_ops'] / units:.2f} | "
            f"{'~' if r['node_projected'] else ''}{r['node_s']:.2f} | {r['node_plan_s']:.3f} | "
            f"{r['rank_ops'] / max(1, r['node_ops']):.0f}x |"
        )
    print(f"\nload average after: {loadavg()}")


# --- the plan exchange at 8,192 ranks -------------------------------------------------------------


def exchange(args: argparse.Namespace) -> None:
    import bench_planning as bp

    from asyncload import LoadOptions

    tensors = bp.model(args.layers)
    options = LoadOptions()
    mesh = bp.Mesh(args.world)
    print(f"load average {loadavg()}", flush=True)
    ck = bp.build_checkpoint(tensors, bp.Mesh(bp.SAVED_RANKS))
    groups: dict[tuple[tuple[int, ...], str], list[str]] = {}
    for name, shape, kind in tensors:
        groups.setdefault((shape, kind), []).append(name)
    items = bp.group_items(ck, groups, mesh)
    identity = bp.identities(ck.md)
    all_needs: list[list[Any]] = [[], []]
    for rank in range(mesh.world):
        needs, _ = bp.rank_needs(ck, groups, items, rank, options)
        for phase in (0, 1):
            all_needs[phase].append(needs[phase])
    del ck, items
    gc.collect()
    nodes = [list(range(k, k + args.per_node)) for k in range(0, mesh.world, args.per_node)]
    block = BLOCK_UNITS * min(UNIT, options.effective_chunk_size)
    total_s = 0.0
    peak = 0
    for phase in (0, 1):
        blobs = [bp.encode(ns, identity) for ns in all_needs[phase]]

        def plan(blobs: list[bytes] = blobs, node: int | None = None) -> Any:
            gathered = [pickle.loads(b) for b in blobs]
            return plan_blocks([g[1] for g in gathered], nodes, block, node)

        whole_s, blocks = best_of(plan, 1)
        multi = sum(1 for b in blocks if len(b.nodes) > 1)
        del blocks
        # what a rank plans: its node's part (nodes 0, middle, last: the slowest)
        t, h, mine = 0.0, 0, 0
        for node in sorted({0, len(nodes) // 2, len(nodes) - 1}):
            tn, part = best_of(lambda node=node: plan(node=node), 1)
            t = max(t, tn)
            mine = max(mine, len(part))
            h = max(h, heap_peak(lambda node=node: plan(node=node)))
        print(
            f"phase {phase}: {sum(map(len, blobs)) / MiB:.1f} MiB gathered; the whole plan "
            f"{whole_s:.2f} s ({multi:,} blocks needed by several nodes); a node's part: "
            f"{mine:,} blocks, decode + plan {t:.2f} s, heap {h / MiB:.0f} MiB",
            flush=True,
        )
        total_s += t
        peak = max(peak, h)
        del blobs
        gc.collect()
    print(
        f"{mesh.world} ranks as {len(nodes)} nodes of {args.per_node}: node-aware plan exchange "
        f"{total_s:.2f} s and at most {peak / MiB:.0f} MiB of heap per rank (both phases)"
    )
    print(f"load average after: {loadavg()}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", default="64,128,256,512,1024")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--ckpt-mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-ops", type=int, default=200_000)
    ap.add_argument("--exchange", action="store_true")
    ap.add_argument("--world", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=111)
    args = ap.parse_args()
    args.ranks = [int(x) for x in str(args.ranks).split(",")]
    if args.exchange:
        exchange(args)
    else:
        claims(args)


if __name__ == "__main__":
    main()
