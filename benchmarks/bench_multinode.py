"""Several nodes on one machine (issue 29 item 3): N nodes x R ranks, each node a network
namespace with its own link capped by ``tc tbf`` (``asyncload.testing.netns``), the
checkpoint served over HTTP from a storage host on the same bridge, the ranks started per
node as torchrun would (``ip netns exec nK unshare --uts torchrun --nnodes N --node-rank K
--nproc-per-node R --rdzv-endpoint n0:PORT``; each node has its own host name, so
``ShardedLoadPlanner`` groups ranks by host name, its default).

Layouts: ``replicated`` (every rank loads the whole checkpoint) and ``sharded`` (FSDP-like:
every tensor ``Shard(0)`` over all ranks, DTensors on a CPU mesh). Contenders:
``PipelinedLoadPlanner``, ``ShardedLoadPlanner()`` (node-aware) and, with ``--contenders
...,static``, ``ShardedLoadPlanner(adaptive=False)``, run alternately in the same processes, ``--rounds`` rounds. Per load: wall seconds (the slowest rank, from a barrier),
the bound (every node must take in what it needs from outside the node through its link,
and the storage host, on a link of ``--storage-mbit``, by default nodes x the nodes' rate,
must send the checkpoint at least once: ``max(max over nodes of bytes the node needs /
link rate, checkpoint bytes / storage link rate)``), bytes from storage
(``LoadStats.bytes_read`` summed), bytes across node links (each node's ``eth0`` receive
counter, summed over nodes, storage included) and ``bound / wall``. Every rank checks its
tensors bit for bit.

Run (root, iproute2):  python benchmarks/bench_multinode.py --nodes 2 --per-node 2
      python benchmarks/bench_multinode.py --nodes 4 --per-node 2 --size-mib 48 --rate-mbit 200
      python benchmarks/bench_multinode.py --check ...   # exit 1 unless every load was bit-exact
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
HTTP_PORT, FWD_PORT, RDZV_PORT = 18000, 18080, 29400


def model(size_mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    n = max(1, size_mib // 2)  # tensors of 2 MiB (512 x 1024 float32)
    return {f"layers.{i}.w": torch.randn(512, 1024, generator=g) for i in range(n)}


def rx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/rx_bytes") as f:
        return int(f.read())


# --- a rank (run by torchrun inside a node) -------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import asyncload
    from asyncload import LoadOptions, PipelinedLoadPlanner, ShardedLoadPlanner

    trace = os.environ.get("BENCH_TRACE")
    if os.environ.get("BENCH_DEBUG") or trace:  # the sharing wing's timings
        import logging

        logging.basicConfig(format="%(created).4f %(threadName)s %(message)s")
        logging.getLogger("asyncload.sharded").setLevel(logging.DEBUG)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if trace:
        _trace_store(os.path.join(trace, f"rank{rank}.log"))
    local = int(os.environ["LOCAL_RANK"])
    full = model(args.size_mib)
    mesh = None
    if args.layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))

    def dest() -> dict[str, Any]:
        if mesh is None:
            return {k: torch.zeros_like(v) for k, v in full.items()}
        from torch.distributed.tensor import Shard, distribute_tensor

        return {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()
        }

    def check(sd: dict[str, Any]) -> list[str]:
        bad = []
        for k, v in full.items():
            got = sd[k]
            if mesh is not None:
                from torch.distributed.tensor import Shard, distribute_tensor

                want = distribute_tensor(v, mesh, [Shard(0)]).to_local()
                got = got.to_local()
            else:
                want = v
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                bad.append(k)
        return bad

    options = LoadOptions()
    out = []
    for rnd in range(args.rounds):
        for kind in args.contenders.split(","):
            planner = (
                ShardedLoadPlanner()
                if kind == "sharded"
                else ShardedLoadPlanner(adaptive=False)
                if kind == "static"
                else PipelinedLoadPlanner()
            )
            sd = dest()
            dist.barrier()
            rx0 = rx_bytes()
            if trace:
                logging.getLogger("asyncload.sharded").debug("trace start %d %s", rnd, kind)
            t0, c0 = time.perf_counter(), time.process_time()
            stats = asyncload.load(sd, args.url, options=options, planner=planner)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if trace:
                logging.getLogger("asyncload.sharded").debug("trace end %d %s", rnd, kind)
            if kind != "pipelined":
                ShardedLoadPlanner.wait_for_background_sends(60)
            dist.barrier()
            rx = rx_bytes() - rx0
            out.append(
                {
                    "round": rnd,
                    "kind": kind,
                    "rank": rank,
                    "node": int(os.environ["GROUP_RANK"]),
                    "local": local,
                    "wall": wall,
                    "cpu": cpu,
                    "rx": rx,
                    "bytes_read": stats.bytes_read,
                    "from_other_nodes": stats.bytes_from_other_nodes,
                    "from_own_node": stats.bytes_from_own_node,
                    "bad": check(sd),
                }
            )
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _trace_store(path: str) -> None:
    """``--trace``: every store operation of the load (its thread, key, start, seconds) and
    the sharing wing's debug lines, into ``path``."""
    import logging
    import threading

    from asyncload.distributed import monitor

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(created).4f %(threadName)s %(message)s"))
    logging.getLogger("asyncload.sharded").addHandler(handler)
    logging.getLogger("asyncload.sharded").propagate = False
    out = logging.getLogger("asyncload.sharded")
    inner = monitor._GuardedStore._call

    def timed(self: Any, name: str, *a: Any) -> Any:
        t0 = time.time()
        try:
            return inner(self, name, *a)
        finally:
            key = a[0] if a and isinstance(a[0], str) else str(a[0][:2]) if a else ""
            out.debug(
                "trace store op=%s key=%s thread=%s t0=%.4f dt=%.4f",
                name, key, threading.current_thread().name, t0, time.time() - t0,
            )  # fmt: skip

    monitor._GuardedStore._call = timed  # type: ignore[method-assign]


def _sample(net: Any, path: str, stop: Any) -> None:
    """``--trace``: every 0.5 s, each link's qdisc counters (both ways), each node's TCP
    counters (retransmits, timeouts) and its connections' ``ss -ti``, into ``path``."""
    import subprocess

    def sh(ns: str, *argv: str) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True
        ).stdout

    sw = f"{net.prefix}-sw"
    with open(path, "w") as f:
        while not stop.wait(0.5):
            rec: dict[str, Any] = {"t": time.time(), "sw": sh(sw, "tc", "-s", "qdisc", "show")}
            for h in net.names:
                ns = net.ns(h)
                rec[h] = {
                    "qdisc": sh(ns, "tc", "-s", "qdisc", "show", "dev", "eth0"),
                    "nstat": sh(
                        ns,
                        "nstat",
                        "-asz",
                        "TcpRetransSegs",
                        "TcpExtTCPTimeouts",
                        "TcpExtTCPLossProbes",
                        "TcpExtTCPSpuriousRTOs",
                        "TcpExtTCPFastRetrans",
                    ),
                    "ss": sh(ns, "ss", "-tin"),
                }
            f.write(json.dumps(rec) + "\n")
            f.flush()


# --- the orchestrator ------------------------------------------------------------------------------


def needed_per_node(size: int, layout: str, nodes: int) -> int:
    return size if layout == "replicated" else size // nodes


def run_layout(args: argparse.Namespace, net: Any, url: str, layout: str) -> list[dict[str, Any]]:
    results = tempfile.mkdtemp(prefix="asyncload-multinode-")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if args.trace:
        env["BENCH_TRACE"] = os.path.join(args.trace, layout)
        os.makedirs(env["BENCH_TRACE"], exist_ok=True)
    env.pop("MASTER_ADDR", None)
    procs = []
    for k in range(args.nodes):
        torchrun = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(args.nodes), "--node-rank", str(k),
            "--nproc-per-node", str(args.per_node),
            "--rdzv-backend", "static", "--master-addr", net.addr("n0"),
            "--master-port", str(RDZV_PORT),
            __file__, "--worker", "--layout", layout, "--url", url,
            "--size-mib", str(args.size_mib), "--rounds", str(args.rounds),
            "--contenders", args.contenders, "--results", results,
        ]  # fmt: skip
        cmd = ["unshare", "--uts", "--", "sh", "-c", f'hostname node{k} && exec "$@"', "sh"]
        procs.append(net.popen(f"n{k}", cmd + torchrun, env=env))
    try:
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"a node's torchrun failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows: list[dict[str, Any]] = []
    for name in sorted(os.listdir(results)):
        with open(os.path.join(results, name)) as f:
            rows.extend(json.load(f))
    return rows


def summarize(
    rows: list[dict[str, Any]], layout: str, args: argparse.Namespace, size: int
) -> list[dict[str, Any]]:
    rate = args.rate_mbit * 1e6 / 8
    need = needed_per_node(size, layout, args.nodes)
    bound = max(need / rate, size / (args.storage_mbit * 1e6 / 8))
    out = []
    keys = sorted({(r["round"], r["kind"]) for r in rows})
    for rnd, kind in keys:
        rs = [r for r in rows if r["round"] == rnd and r["kind"] == kind]
        wall = max(r["wall"] for r in rs)
        per_node_rx = {}
        for r in rs:
            if r["local"] == 0:
                per_node_rx[r["node"]] = r["rx"]
        out.append(
            {
                "layout": layout,
                "round": rnd,
                "kind": kind,
                "wall": wall,
                "bound": bound,
                "ratio": bound / wall,
                "cpu": sum(r["cpu"] for r in rs),
                "storage_mib": sum(r["bytes_read"] for r in rs) / MiB,
                "link_rx_mib": sum(per_node_rx.values()) / MiB,
                "max_node_rx_mib": max(per_node_rx.values()) / MiB,
                "other_nodes_mib": sum(r["from_other_nodes"] for r in rs) / MiB,
                "bad": sum(len(r["bad"]) for r in rs),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url")
    ap.add_argument("--results")
    ap.add_argument("--layout", default="replicated")
    ap.add_argument("--layouts", default="replicated,sharded")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument(
        "--storage-mbit", type=float, help="the storage host's link (default: nodes x rate)"
    )
    ap.add_argument(
        "--queue-ms", type=float, default=50.0, help="a link's longest queue (tc tbf latency)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--contenders", default="sharded,pipelined")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--check", action="store_true", help="exit 1 unless every load was exact")
    ap.add_argument("--json", help="write the summary rows here")
    ap.add_argument(
        "--trace",
        help="a directory: each rank's store operations, claims and reads (timestamps), and "
        "every 0.5 s the links' qdisc counters, TCP retransmits and ss -ti",
    )
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import torch.distributed.checkpoint as dcp

    from asyncload.testing.netns import available, hosts

    args.storage_mbit = args.storage_mbit or args.nodes * args.rate_mbit
    why = available()
    if why is not None:
        raise SystemExit(f"no network namespaces here: {why}")
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().strip()}", flush=True)
    root = tempfile.mkdtemp(prefix="asyncload-multinode-ck-")
    sd = model(args.size_mib)
    dcp.save(sd, checkpoint_id=os.path.join(root, "ck"), no_dist=True)
    size = sum(t.numel() * t.element_size() for t in sd.values())
    all_rows: list[dict[str, Any]] = []
    with hosts(
        args.nodes,
        rate_mbit=args.rate_mbit,
        storage_rate_mbit=args.storage_mbit,
        queue_ms=args.queue_ms,
    ) as net:
        st = net.addr("storage")
        serve = [sys.executable, "-P", str(ROOT / "asyncload/testing/_serve.py"),
                 "--http-range-server", "--root", root, "--port", str(HTTP_PORT)]  # fmt: skip
        fwd = [sys.executable, "-m", "asyncload.testing.netns", "--forward",
               f"{st}:{FWD_PORT}", f"127.0.0.1:{HTTP_PORT}"]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        servers = [net.popen("storage", serve, env=env), net.popen("storage", fwd, env=env)]
        stop = None
        if args.trace:
            import threading

            os.makedirs(args.trace, exist_ok=True)
            stop = threading.Event()
            sampler = threading.Thread(
                target=_sample, args=(net, os.path.join(args.trace, "net.jsonl"), stop)
            )
            sampler.start()
        try:
            time.sleep(2.0)
            url = f"http://{st}:{FWD_PORT}/ck"
            for layout in args.layouts.split(","):
                rows = run_layout(args, net, url, layout)
                all_rows.extend(summarize(rows, layout, args, size))
        finally:
            if stop is not None:
                stop.set()
                sampler.join()
            for p in servers:
                p.terminate()
                p.wait()
    print(
        f"{args.nodes} nodes x {args.per_node} ranks, {size / MiB:.0f} MiB checkpoint, "
        f"links {args.rate_mbit:g} Mbit/s each (queues {args.queue_ms:g} ms), the storage host's "
        f"{args.storage_mbit:g} Mbit/s"
    )
    print(
        f"{'layout':<11}{'round':>6} {'contender':<10}{'wall s':>8}{'bound s':>9}{'bound/wall':>11}"
        f"{'cpu s':>7}{'storage MiB':>12}{'node rx MiB':>12}{'max node rx':>12}{'from nodes':>11}"
        f"{'bad':>5}"
    )
    for r in all_rows:
        print(
            f"{r['layout']:<11}{r['round']:>6} {r['kind']:<10}{r['wall']:>8.2f}{r['bound']:>9.2f}"
            f"{r['ratio']:>11.2f}{r['cpu']:>7.2f}{r['storage_mib']:>12.1f}{r['link_rx_mib']:>12.1f}"
            f"{r['max_node_rx_mib']:>12.1f}{r['other_nodes_mib']:>11.1f}{r['bad']:>5}"
        )
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
    if args.check and any(r["bad"] for r in all_rows):
        raise SystemExit("some rank loaded wrong bytes")


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(__file__, {"raw": "_multinode_raw.py"})
    main()
