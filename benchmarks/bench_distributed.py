"""Multi-rank loading: bytes read per rank and wall time, torch's dcp.load against asyncload.

Two scenarios (``--scenario``):

``speeds`` (default; issue 13): ranks that differ in speed. A replicated checkpoint served
by one ``HTTPRangeServer``; each rank reaches it through its own ``FaultProxy`` capped at
``--rank-bandwidth-mib`` MiB/s (each rank its own link). Settings: all equal; one rank
(rank 1) at 1/4 of the others' bandwidth; one rank (rank 2) whose assembly is slowed to
``--slow-assembly-mib`` MiB/s (asyncload: its progress callback sleeps for each chunk's
bytes, stalling its event loop; torch: its planner's ``commit_tensor`` sleeps for each
tensor's bytes). For torch ``dcp.load`` (``FsspecReader``), ``PipelinedLoadPlanner``,
static sharing (``ShardedLoadPlanner(adaptive=False)``) and adaptive sharing (the
default): wall time, bytes read / sent / received / taken over / hedged per rank, and the
ratio of each setting's wall time to the all-equal one.

``--settings ...,slowlat``: the ranks of ``--slow-ranks`` (default 1) get
``--slow-latency-ms`` more one-way latency on every request, same bandwidth; with
``--nodes-of N`` the ranks are simulated nodes of N (``ShardedLoadPlanner(node_id=...)``:
node-aware sharing on one host), e.g. ``--nodes-of 2 --slow-ranks 2,3`` for a slow node.

``layouts``: the cases below, every rank behind one shared proxy.

Cases of ``layouts`` (each in fresh processes: ``--world`` ranks of a gloo process group on 127.0.0.1):

* replicated: every rank loads the whole model into plain tensors (DDP-style), with
  torch's ``dcp.load`` (``FileSystemReader`` locally, ``FsspecReader`` over HTTP),
  ``asyncload.load`` with ``PipelinedLoadPlanner`` and with ``ShardedLoadPlanner``;
* 1->N: a single-process checkpoint loaded into DTensors with ``Shard(0)`` on N ranks
  (torch ``dcp.load``, asyncload with each planner).

Stores (``--store``):

* ``local`` - the checkpoint directory on local disk (warm page cache);
* ``http`` (default) - a loopback object store with a bandwidth cap: asyncload.testing's
  ``HTTPRangeServer`` (exact ``Range``) behind a ``FaultProxy`` with ``bandwidth`` set to
  ``--bandwidth-mib`` MiB/s for all ranks together: the ranks of one node sharing its
  network link, where bytes not read are time saved;
* ``s3`` - moto's S3 server behind the same proxy (correct but slow: moto reads the whole
  object for every ranged GET, see docs/TESTBED; keep ``--size-mib`` small).

Bytes read: asyncload's ``LoadStats.bytes_read``; for torch (which has no counter), from
local disk the growth of ``rchar`` in ``/proc/self/io`` during the load (every byte its
process read through ``read()``: the files, plus its few small collectives), over HTTP
the bytes its Python sockets received (response headers included).
Wall time: from a barrier before the load to the slowest rank's end. Peak RSS: the
most any rank's resident memory grew above what it held just before the load.
Every rank hashes what it loaded; all variants must agree (checked, printed ``ok``).

Run:  python benchmarks/bench_distributed.py                       # speeds: 28 MiB, 8 MiB/s per rank
      python benchmarks/bench_distributed.py --scenario layouts       # http at 50 MiB/s, 64 MiB, 4 ranks
      python benchmarks/bench_distributed.py --scenario layouts --store local --size-mib 256
      python benchmarks/bench_distributed.py --contenders ordered,side,sharded \
          --settings equal,slowlink --rounds 3   # NCCL's order matching simulated (ordered=True):
          # static (side_group=None) against adaptive over the gloo side group (issue 29, item 7)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.multiprocessing as mp
from _common import join_gloo, spawn_ranks

MiB = 1 << 20


# --- the model -----------------------------------------------------------------------------------


def shapes(size_mib: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Transformer-like: per layer 4 attention matrices (512x512), 2 MLP matrices (512x2048),
    2 norms (512); about 12 MiB per layer in float32."""
    d = 512
    layers = max(1, round(size_mib / 12))
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"embed": ((2048, d), torch.float32)}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            out[f"layers.{i}.attn.{name}"] = ((d, d), torch.float32)
        out[f"layers.{i}.mlp.up"] = ((4 * d, d), torch.float32)
        out[f"layers.{i}.mlp.down"] = ((d, 4 * d), torch.float32)
        out[f"layers.{i}.norm1"] = ((d,), torch.float32)
        out[f"layers.{i}.norm2"] = ((d,), torch.float32)
    return out


def model(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dt) for k, (s, dt) in shapes(size_mib).items()}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


# --- one rank ------------------------------------------------------------------------------------


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


_socket_bytes = [0]


def _count_socket_reads() -> None:
    """Count bytes received on Python sockets (fsspec's asyncio loop reads HTTP through them;
    gloo and the TCPStore use their own C++ sockets, so they are not counted)."""
    import socket as _s

    recv, recv_into = _s.socket.recv, _s.socket.recv_into

    def counted_recv(self: Any, *a: Any, **k: Any) -> bytes:
        data = recv(self, *a, **k)
        _socket_bytes[0] += len(data)
        return data

    def counted_recv_into(self: Any, *a: Any, **k: Any) -> int:
        n = recv_into(self, *a, **k)
        _socket_bytes[0] += n
        return n

    _s.socket.recv = counted_recv  # type: ignore[method-assign]
    _s.socket.recv_into = counted_recv_into  # type: ignore[method-assign]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _digest(sd: dict[str, Any]) -> str:
    h = hashlib.sha1()
    for k in sorted(sd):
        t = sd[k]
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(k.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class _SlowCommitPlanner:
    """Mix-in for torch's planner: ``commit_tensor`` sleeps for each tensor's bytes (a slow assembly)."""

    rate: float = 0.0

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        time.sleep(tensor.numel() * tensor.element_size() / self.rate)
        super().commit_tensor(read_item, tensor)  # type: ignore[misc]


def _planner(how: str, rank: int = 0) -> Any:
    import asyncload

    nodes_of = int(os.environ.get("BENCH_NODES_OF", "0"))
    # --nodes-of N: ranks as simulated nodes of N (node-aware sharing on one host)
    node: dict[str, Any] = {"node_id": f"node{rank // nodes_of}"} if nodes_of else {}
    if how == "sharded":
        unit = os.environ.get("BENCH_UNIT_KIB")
        kw = {"wait_for_peers": True} if os.environ.get("BENCH_WAIT_FOR_PEERS") else {}
        return asyncload.ShardedLoadPlanner(
            unit_size=int(unit) << 10 if unit else None, **kw, **node
        )
    if how == "static":
        return asyncload.ShardedLoadPlanner(adaptive=False, **node)
    if how == "side":  # the group treated as NCCL's: adaptive over the gloo side group
        return asyncload.ShardedLoadPlanner(ordered=True)
    if how == "ordered":  # the group treated as NCCL's, no side group: static, ordered
        return asyncload.ShardedLoadPlanner(ordered=True, side_group=None)
    if how == "always":  # sharing forced on (the cost model left out)
        return asyncload.ShardedLoadPlanner(sharing="always")
    return asyncload.PipelinedLoadPlanner()


def rank_main(
    rank: int,
    world: int,
    port: int,
    out: Any,
    case: str,
    urls: list[str],
    size_mib: int,
    storage_options: dict[str, Any],
    slow_assembly: tuple[int, float] | None = None,
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import asyncload
    from asyncload import ShardedLoadPlanner  # noqa: F401 - the faces load on first use: not on the clock

    try:
        join_gloo(rank, world, port)
        url = urls[rank]
        layout, _, how = case.partition(":")
        slow_rate = (
            slow_assembly[1] if slow_assembly is not None and slow_assembly[0] == rank else None
        )
        sd: dict[str, Any] = {}
        if layout == "replicated":
            sd = {k: torch.zeros(s, dtype=dt) for k, (s, dt) in shapes(size_mib).items()}
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            mesh = init_device_mesh("cpu", (world,))
            for k, (s, dt) in shapes(size_mib).items():
                local_shape, _ = compute_local_shape_and_global_offset(s, mesh, [Shard(0)])
                sd[k] = DTensor.from_local(
                    torch.zeros(local_shape, dtype=dt),
                    mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=torch.Size(s),
                    stride=_contiguous_stride(s),
                )
        remote = url.startswith(("http://", "https://", "s3://"))
        if how == "torch" and remote:
            _count_socket_reads()
        rss0 = _rss()
        rchar0 = _rchar()
        dist.barrier()
        t0 = time.perf_counter()
        seconds_ = 0.0
        if how == "torch":
            if remote:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

                reader: Any = FsspecReader(url, **storage_options)
            else:
                reader = dcp.FileSystemReader(url)
            torch_planner: Any = None
            if slow_rate is not None:
                from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

                torch_planner = type(
                    "SlowCommit", (_SlowCommitPlanner, DefaultLoadPlanner), {"rate": slow_rate}
                )()
            dcp.load(sd, storage_reader=reader, planner=torch_planner)
            read = _socket_bytes[0] if remote else _rchar() - rchar0
            counts = {"received": 0, "sent": 0, "taken_over": 0, "hedged": 0, "at_return": 0}
            counts.update(decision="", unit=0, budget_wait=0.0)
        else:
            progress = None
            if slow_rate is not None:
                rate = slow_rate
                last = [0]

                def progress(done: int, total: int) -> None:
                    time.sleep((done - last[0]) / rate)
                    last[0] = done

            planner = _planner(how, rank)
            stats = asyncload.load(
                sd, url, planner=planner, storage_options=storage_options, progress=progress
            )
            seconds_ = time.perf_counter() - t0
            read = stats.bytes_read
            bg = getattr(planner, "background_sends", None)
            counts = {
                "received": stats.bytes_received,
                "sent": stats.bytes_sent,
                "taken_over": stats.bytes_taken_over,
                "hedged": stats.bytes_hedged,
                "at_return": bg.bytes_at_return if bg is not None else 0,
                "decision": stats.sharing_decision,
                "unit": stats.sharing_unit_size,
                "budget_wait": stats.budget_wait_seconds,
            }
        seconds = seconds_ if how != "torch" else time.perf_counter() - t0
        dist.barrier()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
        out.put(
            (
                rank,
                {
                    "read": read,
                    **counts,
                    "seconds": seconds,
                    "peak": max(0, peak),
                    "digest": _digest(sd),
                },
            )
        )
    except BaseException as exc:
        import traceback

        out.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))
    finally:
        out.close()
        out.join_thread()
        time.sleep(0.5)  # rank 0 hosts the store: let the others leave first
        os._exit(0)


# --- the parent ----------------------------------------------------------------------------------


def run_case(
    case: str,
    url: str | list[str],
    world: int,
    size_mib: int,
    timeout: float,
    storage_options: dict[str, Any],
    slow_assembly: tuple[int, float] | None = None,
) -> list[dict[str, Any]]:
    urls = [url] * world if isinstance(url, str) else url
    args = (case, urls, size_mib, storage_options, slow_assembly)
    return spawn_ranks(rank_main, world, args, timeout, what=case)


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


NAMES = {
    "torch": "torch dcp.load",
    "pipelined": "asyncload PipelinedLoadPlanner",
    "static": "asyncload static sharing",
    "sharded": "asyncload adaptive sharing",
    "always": "asyncload sharing='always'",
    "side": "ordered=True, gloo side group",
    "ordered": "ordered=True, side_group=None",
}


def _per_rank(res: list[dict[str, Any]], key: str) -> str:
    return "/".join(_mib(r[key]) for r in res)


def _decision(res: list[dict[str, Any]]) -> str:
    """The sharing decision, the unit (KiB) and the budget wait (s) of each rank."""
    return " ".join(
        f"{r.get('decision') or '-'}/{r.get('unit', 0) >> 10}/{r.get('budget_wait', 0.0):.2f}"
        for r in res
    )


def _print_medians(
    runs: dict[tuple[Any, str], list[tuple[float, int]]], ckpt_bytes: int, rounds: int
) -> None:
    """Per setting: each contender's median wall time over the rounds, its ratio to
    PipelinedLoadPlanner's, and its bytes read against the checkpoint."""
    print(f"medians over {rounds} interleaved round(s), fresh processes each:")
    for (setting, how), got in runs.items():
        walls = sorted(w for w, _ in got)
        med = walls[len(walls) // 2]
        base = runs.get((setting, "pipelined"))
        ratio = ""
        if base is not None:
            b = sorted(w for w, _ in base)[len(base) // 2]
            ratio = f", {b / med:.2f}x the speed of PipelinedLoadPlanner ({med / b:.2f}x its time)"
        print(
            f"  {setting}: {NAMES[how]}: {med:.2f} s (runs {', '.join(f'{w:.2f}' for w in walls)})"
            f"{ratio}; storage bytes {max(t for _, t in got) / ckpt_bytes:.2f}x the checkpoint"
        )


def speeds(args: argparse.Namespace, work: str, ckpt_bytes: int, files: int) -> None:
    """The ``speeds`` scenario: every rank behind its own capped proxy; equal, one slow link,
    one slow assembly; each contender's wall time against its own all-equal time."""
    from asyncload.testing import FaultProxy, HTTPRangeServer

    bw = args.rank_bandwidth_mib * MiB
    server = HTTPRangeServer(root=work).start()
    proxies = [
        FaultProxy(server, bandwidth=bw, latency=args.latency_ms / 1000).start()
        for _ in range(args.world)
    ]
    try:
        urls = [server.url("ckpt", endpoint_url=p.endpoint_url) for p in proxies]
        print(
            f"checkpoint: {_mib(ckpt_bytes)} MiB in {files} data file(s), replicated on {args.world} ranks "
            f"(gloo, 127.0.0.1); http on 127.0.0.1, each rank through its own FaultProxy at "
            f"{args.rank_bandwidth_mib:g} MiB/s, {args.latency_ms:g} ms one-way; slow assembly {args.slow_assembly_mib:g} MiB/s; "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs; per-rank columns: MiB on ranks 0/1/2/3"
        )
        header = (
            f"{'setting':<26} {'contender':<31} {'wall s':>7} {'x equal':>7} {'fast s':>7} {'x eq':>5} "
            f"{'slow s':>7} {'x eq':>5} {'read MiB':>9} {'x ckpt':>6}  {'wall s per rank':<23} "
            f"{'read per rank':<23} {'sent per rank':<23} {'received per rank':<23} {'taken over':<23} "
            f"{'hedged':<23} {'owed at return':<23} decision, unit KiB, budget wait s per rank"
        )
        print(header)
        print("-" * len(header))
        slow_ranks = [int(r) for r in args.slow_ranks.split(",")]
        # (key, label, the rank at 1/4 bandwidth, the slow assembly's rank and rate)
        settings: list[tuple[str, str, int | None, tuple[int, float] | None]] = [
            ("equal", "all equal", None, None),
            ("slowlink", "rank 1 at 1/4 bandwidth", 1, None),
            ("slowasm", "rank 2 slow assembly", None, (2, args.slow_assembly_mib * MiB)),
            ("slowlat", f"rank(s) {args.slow_ranks} +{args.slow_latency_ms:g} ms", None, None),
        ]
        chosen = args.settings.split(",")
        settings = [st for st in settings if st[0] in chosen]
        equal: dict[str, float] = {}
        digests: list[str] | None = None
        summary: list[str] = []
        runs: dict[tuple[str, str], list[tuple[float, int]]] = {}
        for key, setting, slow_link, slow_assembly in settings:
            late = slow_ranks if key == "slowlat" else []  # more latency, same bandwidth
            for i, p in enumerate(proxies):
                p.bandwidth = bw / 4 if i == slow_link else bw
                p.latency = (args.latency_ms + (args.slow_latency_ms if i in late else 0.0)) / 1000
            hows = args.contenders.split(",")
            rounds = [
                hows[k % len(hows) :] + hows[: k % len(hows)] for k in range(args.rounds)
            ]  # interleaved, each round starting with the next contender
            for how in [h for order in rounds for h in order]:
                res = run_case(
                    f"replicated:{how}",
                    urls,
                    args.world,
                    args.size_mib,
                    args.timeout,
                    {},
                    slow_assembly,
                )
                wall = max(r["seconds"] for r in res)
                # the slow rank (the slow link's, the slow assembly's or the first late one)
                # and the others apart
                slow_rank = (
                    slow_link
                    if slow_link is not None
                    else slow_assembly[0]
                    if slow_assembly
                    else late[0]
                    if late
                    else None
                )
                fast = max(r["seconds"] for i, r in enumerate(res) if i != slow_rank)
                slow = res[slow_rank]["seconds"] if slow_rank is not None else fast
                equal.setdefault(how, wall)
                total = sum(r["read"] for r in res)
                walls = "/".join(f"{r['seconds']:.2f}" for r in res)
                print(
                    f"{setting:<26} {NAMES[how]:<31} {wall:>7.2f} {wall / equal[how]:>7.2f} {fast:>7.2f} "
                    f"{fast / equal[how]:>5.2f} {slow:>7.2f} {slow / equal[how]:>5.2f} {_mib(total):>9} "
                    f"{total / ckpt_bytes:>6.2f}  {walls:<23} {_per_rank(res, 'read'):<23} "
                    f"{_per_rank(res, 'sent'):<23} {_per_rank(res, 'received'):<23} "
                    f"{_per_rank(res, 'taken_over'):<23} {_per_rank(res, 'hedged'):<23} {_per_rank(res, 'at_return'):<23} "
                    f"{_decision(res)}",
                    flush=True,
                )
                runs.setdefault((setting, how), []).append((wall, total))
                got = [r["digest"] for r in res]
                if digests is not None and got != digests:
                    raise SystemExit(
                        f"{setting} / {how}: loaded tensors differ from the first case"
                    )
                digests = got
                if slow_link is not None and how in ("static", "sharded"):
                    summary.append(
                        f"{NAMES[how]}, one rank at 1/4 bandwidth: {wall / equal[how]:.2f}x its all-equal time, "
                        f"{total / ckpt_bytes:.2f}x the checkpoint read in total"
                    )
                if slow_assembly is not None and how in equal:
                    summary.append(
                        f"{NAMES[how]}, rank {slow_rank} slow assembly: fast ranks {fast:.2f} s "
                        f"({fast / equal[how]:.2f}x all-equal), the slow rank {slow:.2f} s ({slow / equal[how]:.2f}x)"
                    )
        print("every contender loaded identical tensors on every rank in every setting: ok")
        for line in summary:
            print(line)
        _print_medians(runs, ckpt_bytes, args.rounds)
    finally:
        for p in proxies:
            p.stop()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", choices=("speeds", "layouts"), default="speeds")
    ap.add_argument(
        "--store",
        choices=("http", "local", "s3"),
        default="http",
        help="layouts: where the checkpoint is",
    )
    ap.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help="checkpoint size (default: 24 speeds, 64 layouts)",
    )
    ap.add_argument(
        "--rank-bandwidth-mib", type=float, default=8.0, help="speeds: each rank's link, MiB/s"
    )
    ap.add_argument(
        "--slow-assembly-mib",
        type=float,
        default=16.0,
        help="speeds: the slow rank's assembly, MiB/s",
    )
    ap.add_argument(
        "--contenders", default="torch,pipelined,static,sharded", help="speeds: which loaders"
    )
    ap.add_argument(
        "--settings",
        default="equal,slowlink,slowasm",
        help="speeds: which settings (equal, slowlink, slowasm, slowlat)",
    )
    ap.add_argument(
        "--slow-ranks",
        default="1",
        help="speeds, slowlat: the ranks whose requests take --slow-latency-ms more (e.g. 2,3)",
    )
    ap.add_argument(
        "--slow-latency-ms",
        type=float,
        default=150.0,
        help="speeds, slowlat: one-way latency added for --slow-ranks (default 150)",
    )
    ap.add_argument(
        "--nodes-of",
        type=int,
        default=0,
        help="ShardedLoadPlanner(node_id=...): the ranks as simulated nodes of this many "
        "(node-aware sharing on one host; default 0: one host)",
    )
    ap.add_argument(
        "--wait-for-peers",
        action="store_true",
        help="sharing: ShardedLoadPlanner(wait_for_peers=True)",
    )
    ap.add_argument(
        "--unit-kib",
        type=int,
        default=None,
        help="adaptive sharing's unit_size, KiB (default: its own)",
    )
    ap.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    ap.add_argument(
        "--bandwidth-mib",
        type=float,
        default=50.0,
        help="http/s3: the store's bandwidth cap for all ranks together, MiB/s (default 50)",
    )
    ap.add_argument(
        "--latency-ms", type=float, default=0.0, help="http/s3: one-way latency added per request"
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="interleaved rounds of every contender (default 1)"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per case")
    ap.add_argument(
        "--cases",
        default="replicated:torch,replicated:pipelined,replicated:sharded,shard0:torch,shard0:pipelined,shard0:sharded",
    )
    args = ap.parse_args()
    if args.size_mib is None:
        args.size_mib = 24 if args.scenario == "speeds" else 64
    if args.unit_kib is not None:
        os.environ["BENCH_UNIT_KIB"] = str(
            args.unit_kib
        )  # read by the ranks (forkserver children inherit it)
    if args.wait_for_peers:
        os.environ["BENCH_WAIT_FOR_PEERS"] = "1"
    if args.nodes_of:
        os.environ["BENCH_NODES_OF"] = str(args.nodes_of)

    mp.get_context("forkserver").set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.distributed",
            "torch.distributed.checkpoint",
            "torch.distributed.tensor",
            "asyncload",
        ]
    )
    work = tempfile.mkdtemp(prefix="asyncload-bench-dist-")
    servers: list[Any] = []
    try:
        import torch.distributed.checkpoint as dcp

        ckpt = os.path.join(work, "ckpt")
        sd = model(args.size_mib)
        with warnings.catch_warnings():  # torch warns on every single-process save
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(sd, checkpoint_id=ckpt, no_dist=True)
        del sd
        ckpt_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        if args.scenario == "speeds":
            speeds(args, work, ckpt_bytes, len(os.listdir(ckpt)) - 1)
            return
        url = ckpt
        storage_options: dict[str, Any] = {}
        where = "local disk (warm page cache)"
        if args.store != "local":
            from asyncload.testing import FaultProxy, HTTPRangeServer, S3Server, configure_env

            configure_env()
            server: Any = HTTPRangeServer(root=work) if args.store == "http" else S3Server()
            server.start()
            servers.append(server)
            proxy = FaultProxy(
                server, bandwidth=args.bandwidth_mib * MiB, latency=args.latency_ms / 1000
            ).start()
            servers.append(proxy)
            if args.store == "http":
                url = server.url("ckpt", endpoint_url=proxy.endpoint_url)
            else:
                url = server.upload_dir(ckpt, "bench", "ckpt")
                storage_options = server.storage_options(proxy.endpoint_url)
            where = (
                f"{args.store} on 127.0.0.1 behind a FaultProxy: {args.bandwidth_mib:g} MiB/s for all ranks "
                f"together, {args.latency_ms:g} ms one-way latency"
            )

        print(
            f"checkpoint: {_mib(ckpt_bytes)} MiB in {len(os.listdir(ckpt)) - 1} data file(s); {args.world} ranks "
            f"(gloo, 127.0.0.1); store: {where}; torch {torch.__version__}, {os.cpu_count()} CPUs"
        )
        header = (
            f"{'case':<44} {'total read MiB':>14} {'x ckpt':>7} {'per-rank read MiB':>26} {'max/min':>8} "
            f"{'recv MiB/rank':>13} {'wall s':>7} {'peak RSS +MiB':>13}  decision/unit KiB/budget wait s"
        )
        print(header)
        print("-" * len(header))
        names = {**NAMES, "sharded": "asyncload ShardedLoadPlanner"}
        digests: dict[str, list[str]] = {}
        rows: dict[str, tuple[float, float]] = {}
        cases = args.cases.split(",")
        order = [
            c
            for k in range(args.rounds)
            for c in cases[k % len(cases) :] + cases[: k % len(cases)]
        ]  # interleaved rounds
        runs: dict[tuple[str, str], list[tuple[float, int]]] = {}
        for case in order:
            layout, _, how = case.partition(":")
            if args.store == "local":  # warm: every file read once outside the clock
                for f in os.listdir(ckpt):
                    with open(os.path.join(ckpt, f), "rb") as fh:
                        while fh.read(16 << 20):
                            pass
            res = run_case(case, url, args.world, args.size_mib, args.timeout, storage_options)
            reads = [r["read"] for r in res]
            total = sum(reads)
            wall = max(r["seconds"] for r in res)
            label = f"{'replicated' if layout == 'replicated' else f'1->{args.world} Shard(0)'}: {names[how]}"
            per_rank = " ".join(_mib(x) for x in reads)
            ratio = max(reads) / max(1, min(reads))
            recv = sum(r["received"] for r in res) / len(res)
            peak = max(r["peak"] for r in res)
            print(
                f"{label:<44} {_mib(total):>14} {total / ckpt_bytes:>7.2f} {per_rank:>26} {ratio:>8.2f} "
                f"{_mib(recv):>13} {wall:>7.2f} {_mib(peak):>13}  {_decision(res)}",
                flush=True,
            )
            rows[case] = (total, wall)
            runs.setdefault((layout, how), []).append((wall, total))
            got = [r["digest"] for r in res]
            if layout in digests and digests[layout] != got:
                raise SystemExit(f"{case}: loaded tensors differ from the first {layout} case")
            digests.setdefault(layout, got)
        print("every variant loaded identical tensors on every rank: ok")
        _print_medians(runs, ckpt_bytes, args.rounds)
        for layout in ("replicated", "shard0"):
            base = rows.get(f"{layout}:torch")
            if base is None:
                continue
            for how in ("pipelined", "sharded"):
                r = rows.get(f"{layout}:{how}")
                if r is not None:
                    print(
                        f"{layout} {names[how]} vs torch: {r[0] / base[0]:.2f}x the bytes, "
                        f"{base[1] / r[1]:.2f}x the speed"
                    )
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(
        __file__,
        {"narrow": "_distributed_narrow.py", "shared-metadata": "_distributed_shared_metadata.py"},
    )
    main()
