"""``.metadata`` read once for the group against once per rank (``LoadOptions.share_metadata``).

A checkpoint of many small tensors (``--keys``; a large ``.metadata``, as a model saved on
many ranks has) is served by ``HTTPRangeServer`` behind one ``FaultProxy`` shared by every
rank (one node's link: ``--bandwidth-mib`` MiB/s and ``--latency-ms`` one way). ``--world``
ranks of a gloo group on 127.0.0.1 (fresh processes every run) each load their share of the
keys (rank r: every ``world``-th key from r, the first ``--keys-per-rank`` of them when
given: as a sharded model's ranks each need a part of the data but all of the metadata), with ``share_metadata=False`` (every rank reads
``.metadata``, as torch's ``dcp.load`` does) and ``True`` (rank 0 reads it and broadcasts its
bytes), alternated round by round.

Printed per variant (medians over rounds): the load's wall time (a barrier before the load
to the slowest rank's end), the ``.metadata`` GETs and the bytes the proxy forwarded for them
(from the proxy's log and its byte counts), the slowest rank's time to its plan
(``LoadStats.time_to_first_byte``), and whether every rank loaded what it should (a digest,
checked against the saved tensors).

Run:  python benchmarks/bench_distributed.py --part shared-metadata  # 4 ranks, 20,000 keys
      python benchmarks/bench_distributed.py --part shared-metadata --keys-per-rank 4 --bandwidth-mib 20 --rounds 5
      python benchmarks/bench_distributed.py --part shared-metadata --store s3 --keys 256 --keys-per-rank 4 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import join_gloo, loadavg, spawn_ranks


def model(keys: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layers.{i}.w": torch.randn(numel, generator=g) for i in range(keys)}


def rank_main(
    rank: int,
    world: int,
    port: int,
    out: Any,
    url: str,
    storage_options: dict[str, Any],
    keys: int,
    numel: int,
    per_rank: int,
    share: bool,
) -> None:
    import torch.distributed as dist

    import asyncload
    from asyncload import LoadOptions, ShardedLoadPlanner  # noqa: F401 - the faces: not on the clock

    try:
        join_gloo(rank, world, port)
        mine = [f"layers.{i}.w" for i in range(rank, keys, world)][: per_rank or None]
        sd = {k: torch.zeros(numel) for k in mine}
        options = LoadOptions(share_metadata=share)
        dist.barrier()
        t0 = time.monotonic()
        stats = asyncload.load(sd, url, storage_options=storage_options, options=options)
        seconds = time.monotonic() - t0
        full = model(keys, numel)
        ok = all(torch.equal(sd[k], full[k]) for k in mine)
        dist.barrier()
        out.put(
            (
                rank,
                {
                    "seconds": seconds,
                    "ok": ok,
                    "first_byte": stats.time_to_first_byte,
                    "shared": stats.metadata_shared,
                },
            )
        )
        dist.destroy_process_group()
    except BaseException as exc:  # pragma: no cover - reported by the parent
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run(
    url: str,
    storage_options: dict[str, Any],
    world: int,
    keys: int,
    numel: int,
    per_rank: int,
    share: bool,
) -> list[dict[str, Any]]:
    return spawn_ranks(
        rank_main, world, (url, storage_options, keys, numel, per_rank, share), timeout=600
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument(
        "--keys-per-rank",
        type=int,
        default=0,
        help="load only the first N of a rank's keys (0: all of its share)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bandwidth-mib", type=float, default=50.0)
    ap.add_argument("--latency-ms", type=float, default=10.0)
    ap.add_argument(
        "--store",
        choices=("http", "s3"),
        default="http",
        help="http: HTTPRangeServer; s3: moto's S3 server (the data files' listing too)",
    )
    args = ap.parse_args()

    import torch.distributed.checkpoint as dcp

    from asyncload.testing import FaultProxy, HTTPRangeServer, S3Server

    print(f"load average before: {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / "ck"
        dcp.save(model(args.keys, args.numel), checkpoint_id=str(ck), no_dist=True)
        md_size = (ck / ".metadata").stat().st_size
        total = sum(f.stat().st_size for f in ck.iterdir())
        print(
            f"checkpoint: {args.keys} tensors of {args.numel} float32, .metadata "
            f"{md_size / 2**20:.2f} MiB, {total / 2**20:.1f} MiB in all; {args.world} ranks, "
            f"one link of {args.bandwidth_mib:g} MiB/s and {args.latency_ms:g} ms one way"
        )
        server: Any = S3Server() if args.store == "s3" else HTTPRangeServer(root=Path(tmp))
        server.start()
        proxy = FaultProxy(
            server, latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mib * 2**20
        ).start()
        if args.store == "s3":
            url = server.upload_dir(ck, "bench", "ck")
            storage_options = server.storage_options(endpoint_url=proxy.endpoint_url)
        else:
            url = server.url("ck", endpoint_url=proxy.endpoint_url)
            storage_options = {}
        mp.get_context("forkserver").set_forkserver_preload(["torch", "asyncload"])
        rows: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        try:
            for i in range(args.rounds):
                for share in (False, True) if i % 2 == 0 else (True, False):
                    proxy.reset_counters()
                    res = run(
                        url,
                        storage_options,
                        args.world,
                        args.keys,
                        args.numel,
                        args.keys_per_rank,
                        share,
                    )
                    gets = sum(
                        1 for e in proxy.log if e.method == "GET" and e.path.endswith("/.metadata")
                    )
                    lists = sum(1 for e in proxy.log if e.method == "GET" and "prefix=" in e.query)
                    rows[share].append(
                        {
                            "wall": max(r["seconds"] for r in res),
                            "first_byte": max(r["first_byte"] for r in res),
                            "gets": gets,
                            "lists": lists,
                            "ok": all(r["ok"] for r in res),
                            "shared": sum(r["shared"] for r in res),
                        }
                    )
                    print(
                        f"  round {i + 1} share_metadata={share!s:5}: "
                        f"{rows[share][-1]['wall']:.3f} s, .metadata GETs {gets}, listings {lists}",
                        flush=True,
                    )
        finally:
            proxy.stop()
            server.stop()
    print()
    print(
        "| share_metadata | load s (median) | first data byte s | .metadata GETs | "
        ".metadata MiB from storage | listings | ranks that took rank 0's bytes | loaded ok |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for share in (False, True):
        rs = rows[share]
        gets = statistics.median(r["gets"] for r in rs)
        print(
            f"| {share} | {statistics.median(r['wall'] for r in rs):.3f} | "
            f"{statistics.median(r['first_byte'] for r in rs):.3f} | {gets:g} | "
            f"{gets * md_size / 2**20:.2f} | {statistics.median(r['lists'] for r in rs):g} | "
            f"{rs[0]['shared']} | {all(r['ok'] for r in rs)} |"
        )
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
