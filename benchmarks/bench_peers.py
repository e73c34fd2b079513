"""Remote loads against the peers, side by side in one run (issue 12).

S3 on loopback (s3rver) behind a network model (``--network``, each in its own process):
``proxy`` (default), the FaultProxy adding ``--latency`` each way per request and per answer;
``delay-line``, a forwarder delivering each 256 KiB piece ``--latency`` after it arrived,
both ways (``asyncload.testing.delay_line``: a queueing delay that does not cap bandwidth);
``tbf``, a rate-capped link: s3rver in a network namespace of its own and every contender in
another (``asyncload.testing.netns``), the two joined through a bridge by veth links capped at
``--rate-mbit`` by ``tc qdisc ... tbf`` both ways, with the delay line (``--latency``, default 0
for this model: none) in front inside the contenders' namespace (netem does not exist on this
kernel). The namespaces are deleted on every exit path. Every contender runs in a fresh
process per round (``_peer_child.py``: imports and a touched destination before the clock),
rounds interleaved; the table gives the median
seconds, GiB/s, the ratio to the raw bound (s3fs ranged GETs of the same bytes, 8 MiB x 32,
data discarded), CPU seconds per GiB of the loading process and its peak RSS above the
destination. ``curl --parallel`` with the same ranged GETs and obstore's ranged GETs are
printed beside the raw bound as references.

Layouts: ``dcp-one-file`` (what ``dcp.save`` writes for one rank: one ``.distcp``),
``dcp-per-item`` (one file per item), ``safetensors`` (one file), ``safetensors-index``
(shards + ``model.safetensors.index.json``); tensorizer loads its own format of the same
tensors. Peers need the ``bench`` extra (``pip install -e '.[bench]'``); a peer that is not
installed is skipped with a note.

    python benchmarks/bench_peers.py --size-mib 256 --rounds 3
    python benchmarks/bench_peers.py --layouts dcp-one-file --contenders asyncload,s3torchconnector
    python benchmarks/bench_peers.py --network delay-line --layouts dcp-one-file,safetensors
    python benchmarks/bench_peers.py --network tbf --rate-mbit 800 --layouts dcp-one-file,safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_remote import Proxy, find_s3rver

from asyncload.testing import S3rverServer, configure_env

MiB = 1 << 20
GiB = 1 << 30
CHILD = str(Path(__file__).resolve().parent / "_peer_child.py")
SEED = 1234

#: contender -> (layouts it reads, the module it needs)
CONTENDERS: dict[str, tuple[set[str], str | None]] = {
    "raw_s3fs": ({"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"}, "s3fs"),
    "raw_obstore": (
        {"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"},
        "obstore",
    ),
    "curl": ({"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"}, None),
    "asyncload": (
        {"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"},
        "asyncload",
    ),
    "asyncload_fsspec": (
        {"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"},
        "asyncload",
    ),
    "asyncload_wire": (
        {"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"},
        "asyncload",
    ),
    "asyncload_obstore": (
        {"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"},
        "asyncload",
    ),
    #: asyncload imported from ``--baseline`` (another tree: a before/after in the same run)
    "asyncload_baseline": (
        {"dcp-one-file", "dcp-per-item", "safetensors", "safetensors-index"},
        "asyncload",
    ),
    "s3torchconnector": ({"dcp-one-file", "dcp-per-item"}, "s3torchconnector"),
    "torch_fsspec": ({"dcp-one-file", "dcp-per-item"}, "s3fs"),
    "runai": ({"safetensors"}, "runai_model_streamer"),
    "tensorizer": ({"tensorizer"}, "tensorizer"),
}

#: contender -> what a figure's legend calls it: the public name of the reader and how it reads
LEGEND = {
    "raw_s3fs": "s3fs ranged reads (bound)",
    "raw_obstore": "obstore ranged reads (bound)",
    "curl": "curl --parallel (bound)",
    "asyncload": "asyncload.load",
    "asyncload_fsspec": 'asyncload.load, transport="fsspec"',
    "asyncload_wire": 'asyncload.load, transport="wire"',
    "asyncload_obstore": 'asyncload.load, transport="obstore"',
    "asyncload_baseline": "asyncload.load (baseline tree)",
    "s3torchconnector": "s3torchconnector DCP reader",
    "torch_fsspec": "torch dcp.load + FsspecReader",
    "runai": "runai-model-streamer",
    "tensorizer": "tensorizer",
}
#: layout -> what a figure calls it
LAYOUT_NAMES = {
    "dcp-one-file": "DCP, one file",
    "dcp-per-item": "DCP, file per item",
    "safetensors": "safetensors, one file",
    "safetensors-index": "safetensors + index",
    "tensorizer": "tensorizer format",
}


def make_tensors(total: int, hidden: int) -> dict[str, Any]:
    """bf16 matrices of ``hidden`` x 4*hidden (8 MiB at 1024) up to ``total`` bytes, fp32 norms."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    out: dict[str, Any] = {}
    i = 0
    size = 0
    while size < total:
        w = torch.randn((hidden, 4 * hidden), generator=g).to(torch.bfloat16)
        n = torch.randn((hidden,), generator=g).to(torch.float32)
        out[f"layers.{i}.mlp.weight"] = w
        out[f"layers.{i}.norm.weight"] = n
        size += w.numel() * 2 + n.numel() * 4
        i += 1
    return out


def write_layouts(tensors: dict[str, Any], root: Path, layouts: list[str]) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    paths: dict[str, Path] = {}
    if "dcp-one-file" in layouts:
        p = root / "dcp-one-file"
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(str(p), single_file_per_rank=True),
            no_dist=True,
        )
        paths["dcp-one-file"] = p
    if "dcp-per-item" in layouts:
        p = root / "dcp-per-item"
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(str(p), single_file_per_rank=False),
            no_dist=True,
        )
        paths["dcp-per-item"] = p
    if "safetensors" in layouts:
        p = root / "safetensors"
        p.mkdir()
        save_file(tensors, str(p / "model.safetensors"))
        paths["safetensors"] = p
    if "safetensors-index" in layouts:
        p = root / "safetensors-index"
        p.mkdir()
        names = list(tensors)
        shards = [names[i::4] for i in range(4)]
        weight_map = {}
        for j, keys in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in keys}, str(p / fname))
            weight_map.update(dict.fromkeys(keys, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (p / "model.safetensors.index.json").write_text(json.dumps(index))
        paths["safetensors-index"] = p
    if "tensorizer" in layouts and importlib.util.find_spec("tensorizer"):
        from tensorizer import TensorSerializer

        p = root / "tensorizer"
        p.mkdir()
        ser = TensorSerializer(str(p / "model.tensors"))
        ser.write_state_dict(tensors)
        ser.close()
        paths["tensorizer"] = p
    return paths


def data_files(path: Path, layout: str) -> list[tuple[str, int]]:
    """The files whose bytes a load must read (what the raw bound fetches)."""
    pattern = {"tensorizer": "*.tensors"}.get(
        layout, "*.distcp" if layout.startswith("dcp") else "*.safetensors"
    )
    return sorted((p.name, p.stat().st_size) for p in path.glob(pattern))


class DelayLineProc:
    """The delay line (``asyncload.testing.delay_line``) in a child process: each 256 KiB
    piece delivered ``delay`` seconds after it arrived, both ways (``--network delay-line``)."""

    def __init__(self, upstream: str, delay: float, prefix: list[str] | None = None) -> None:
        # prefix: e.g. ``ip netns exec NS`` (the tbf model runs it beside the contenders)
        argv = [sys.executable, "-m", "asyncload.testing.delay_line", upstream, str(delay)]
        self.proc = subprocess.Popen(
            [*(prefix or []), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        try:
            self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"
        except BaseException:  # e.g. SIGTERM while it starts: it goes too
            self.proc.kill()
            self.proc.wait()
            raise

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: --network -> what the header line calls it
NETWORKS = {
    "proxy": "the FaultProxy adding {ms} ms one-way per request and per answer",
    "delay-line": "a delay line delivering each 256 KiB piece {ms} ms after it arrived, both ways",
    "tbf": "a link capped at {rate} Mbit/s both ways (tc tbf, queues 50 ms) between two network "
    "namespaces, {delay}",
}

#: where s3rver listens inside its namespace (the namespace is private: any port will do)
TBF_PORT = 9000


class Direct:
    """No link process: the contenders reach ``url`` as it is (``--network tbf --latency 0``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def close(self) -> None:
        pass


class TbfLink:
    """``--network tbf``: s3rver (serving ``data``, the loopback server's folder) in the
    ``storage`` namespace of :func:`asyncload.testing.netns.hosts`, the contenders in ``n0``,
    both links capped at ``rate_mbit``. A ``with`` block; the namespaces and the server go on
    every exit path."""

    def __init__(self, exe: str, data: Path, rate_mbit: float) -> None:
        self.exe, self.data, self.rate_mbit = exe, data, rate_mbit
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TbfLink:
        import time

        from asyncload.testing.netns import available, hosts

        why = available()
        if why is not None:
            sys.exit(f"--network tbf needs network namespaces: {why}")
        if threading.current_thread() is threading.main_thread():
            # SIGTERM too unwinds the with-blocks (the server, then the namespaces)
            old = signal.signal(signal.SIGTERM, _terminated)
            self._stack.callback(signal.signal, signal.SIGTERM, old)
        try:
            self.net = self._stack.enter_context(hosts(1, rate_mbit=self.rate_mbit))
            addr = self.net.addr("storage")
            argv = [self.exe, "-d", str(self.data), "-a", addr, "-p", str(TBF_PORT), "--silent"]
            proc = self.net.popen("storage", argv, stdout=subprocess.DEVNULL)
            self._stack.callback(_stop, proc)
            self.url = f"http://{addr}:{TBF_PORT}"
            probe = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", self.url + "/"]
            deadline = time.monotonic() + 30
            while True:
                out = self.net.run("n0", probe, capture_output=True, text=True, check=False)
                if out.stdout.strip() not in ("", "000"):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"s3rver did not start in its namespace ({out.stdout})")
                time.sleep(0.1)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def prefix(self) -> list[str]:
        """argv prefix running a command in the contenders' namespace."""
        return self.net.argv("n0", [])


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def link(
    network: str, upstream: str, latency: float, tbf: TbfLink | None = None
) -> Proxy | DelayLineProc | Direct:
    """A fresh link of the chosen network model in front of ``upstream``."""
    if network == "tbf":
        assert tbf is not None
        if latency <= 0:
            return Direct(tbf.url)
        return DelayLineProc(tbf.url, latency, tbf.prefix)
    if network == "delay-line":
        return DelayLineProc(upstream, latency)
    return Proxy(upstream, latency, None)


def run_child(
    cfg: dict[str, Any],
    timeout: float,
    pythonpath: str | None = None,
    prefix: list[str] | None = None,
) -> dict[str, Any] | None:
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    try:
        out = subprocess.run(
            [*(prefix or []), sys.executable, CHILD, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument(
        "--latency",
        type=float,
        default=None,
        help="one-way delay added by the proxy or the delay line, seconds (default 0.010; "
        "with --network tbf 0: no delay line)",
    )
    ap.add_argument(
        "--rate-mbit",
        type=float,
        default=800.0,
        help="--network tbf: the links' cap, Mbit/s (tc tbf, both ways)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--network",
        choices=sorted(NETWORKS),
        default="proxy",
        help="the network model in front of s3rver: proxy (the FaultProxy: --latency per "
        "request and per answer), delay-line (every 256 KiB piece --latency late, both ways) or "
        "tbf (s3rver in a network namespace behind links capped at --rate-mbit)",
    )
    ap.add_argument(
        "--layouts", default="dcp-one-file,dcp-per-item,safetensors,safetensors-index,tensorizer"
    )
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--timeout", type=float, default=300.0, help="per contender run, seconds")
    ap.add_argument("--json", help="also write the medians to this JSON file")
    ap.add_argument(
        "--plot",
        help="also draw the medians (GiB/s per layout and contender) into this PNG (matplotlib)",
    )
    ap.add_argument(
        "--plot-from", help="only draw --plot from the medians of an earlier run's --json file"
    )
    ap.add_argument(
        "--baseline",
        help="a source tree (e.g. `git archive` of an earlier commit) whose asyncload the asyncload_baseline "
        "contender imports (PYTHONPATH), for a before/after in the same interleaved run",
    )
    args = ap.parse_args()
    if args.plot_from:
        saved = json.loads(Path(args.plot_from).read_text())
        plot(
            saved["medians"],
            saved["meta"]["bytes"],
            saved["meta"],
            args.plot or "remote_peers.png",
        )
        return
    configure_env()
    from _common import ensure_bytecode

    ensure_bytecode()  # each contender's fresh process imports installed-like bytecode
    if args.baseline:
        ensure_bytecode(os.path.join(args.baseline, "asyncload"))
    if args.latency is None:
        args.latency = 0.0 if args.network == "tbf" else 0.010
    layouts = args.layouts.split(",")
    wanted = args.contenders.split(",")
    exe = find_s3rver()
    if exe is None:
        sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
    missing = [
        c
        for c in wanted
        if CONTENDERS[c][1] and importlib.util.find_spec(CONTENDERS[c][1]) is None
    ]
    if "curl" in wanted and shutil.which("curl") is None:
        missing.append("curl")
    for c in missing:
        print(f"note: {c} is not installed: skipped (pip install -e '.[bench]')")
    wanted = [c for c in wanted if c not in missing]
    if "asyncload_baseline" in wanted and not args.baseline:
        print("note: asyncload_baseline needs --baseline: skipped")
        wanted.remove("asyncload_baseline")
    tensors = make_tensors(args.size_mib * MiB, args.hidden)
    spec = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    print(
        f"{nbytes / MiB:.0f} MiB of tensors ({len(tensors)}), s3rver behind "
        f"{NETWORKS[args.network].format(ms=f'{args.latency * 1e3:.0f}', rate=f'{args.rate_mbit:g}', delay=f'a {args.latency * 1e3:.0f} ms delay line in front' if args.latency > 0 else 'no delay line')}, "
        f"{args.rounds} rounds interleaved, each run a fresh process; {os.cpu_count()} CPUs, "
        f"load average {' '.join(load_before)}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="asyncload-bench-peers-") as tmp,
        S3rverServer(executable=exe) as server,
        contextlib.ExitStack() as stack,
    ):
        paths = write_layouts(tensors, Path(tmp), layouts)
        del tensors
        urls = {layout: server.upload_dir(p, "peers", layout) for layout, p in paths.items()}
        tbf = None
        if args.network == "tbf":  # a second s3rver on the same (now read-only) folder
            tbf = stack.enter_context(TbfLink(exe, server.workdir / "data", args.rate_mbit))
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for layout, path in paths.items():
                files = [[f"{layout}/{n}", s] for n, s in data_files(path, layout)]
                for c in wanted:
                    if layout not in CONTENDERS[c][0]:
                        continue
                    proxy = link(args.network, server.endpoint_url, args.latency, tbf)
                    try:
                        url = urls[layout] + ("/model.safetensors" if c == "runai" else "")
                        url = url + ("/model.tensors" if c == "tensorizer" else "")
                        cfg: dict[str, Any] = {
                            "mode": c,
                            "layout": layout,
                            "url": url,
                            "endpoint": proxy.url,
                            "bucket": "peers",
                            "files": files,
                            "tensors": None if c.startswith("raw") or c == "curl" else spec,
                            "check": SEED if not (c.startswith("raw") or c == "curl") else None,
                            "env": {
                                "AWS_ENDPOINT_URL": proxy.url,
                                "AWS_ACCESS_KEY_ID": "S3RVER",
                                "AWS_SECRET_ACCESS_KEY": "S3RVER",
                                "AWS_DEFAULT_REGION": "us-east-1",
                                "AWS_REGION": "us-east-1",
                                "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                                "S3_ENDPOINT_URL": proxy.url,
                            },
                        }
                        if c == "asyncload_fsspec":
                            cfg["options"] = {"transport": "fsspec"}
                        if c == "asyncload_wire":
                            cfg["options"] = {"transport": "wire"}
                        if c == "asyncload_obstore":
                            cfg["options"] = {"transport": "obstore"}
                        pythonpath = args.baseline if c == "asyncload_baseline" else None
                        results.setdefault((layout, c), []).append(
                            run_child(cfg, args.timeout, pythonpath, tbf.prefix if tbf else None)
                            or {}
                        )
                    finally:
                        proxy.close()
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    for layout in paths:
        rows = [(c, results[(layout, c)]) for c in wanted if (layout, c) in results]
        raw = [r["seconds"] for c, rs in rows if c == "raw_s3fs" for r in rs if "seconds" in r]
        raw_med = statistics.median(raw) if raw else None
        print(f"\n== {layout} ==")
        print(
            f"{'contender':20s} {'seconds':>8s} {'GiB/s':>7s} {'x raw':>6s} {'CPU s/GiB':>9s} {'peak MiB':>9s}  note"
        )
        for c, rs in rows:
            good = [r for r in rs if "seconds" in r]
            if not good:
                print(f"{c:20s} {'-':>8s}  {rs[0].get('error')}")
                continue
            t = statistics.median(r["seconds"] for r in good)
            cpu = statistics.median(r["cpu"] for r in good)
            peak = max(r["peak"] for r in good) / MiB
            ratio = f"{raw_med / t:6.2f}" if raw_med else "     -"
            bad = [r for r in good if r.get("ok") is False]
            note = "WRONG BYTES" if bad else ""
            print(
                f"{c:20s} {t:8.2f} {nbytes / GiB / t:7.2f} {ratio} {cpu / (nbytes / GiB):9.2f} {peak:9.0f}  {note}"
            )
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)}")
    table = {
        layout: {
            c: {
                "seconds": statistics.median(r["seconds"] for r in rs if "seconds" in r),
                "cpu_s_per_gib": statistics.median(r["cpu"] for r in rs if "seconds" in r)
                / (nbytes / GiB),
                "peak_mib": max(r["peak"] for r in rs if "seconds" in r) / MiB,
            }
            for c in wanted
            if (rs := results.get((layout, c))) and any("seconds" in r for r in rs)
        }
        for layout in paths
    }
    meta = {
        "bytes": nbytes,
        "latency_s": args.latency,
        "network": args.network,
        "rate_mbit": args.rate_mbit if args.network == "tbf" else None,
        "rounds": args.rounds,
        "load": [load_before, load_after],
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "medians": table}, indent=1))
    if args.plot:
        plot(table, nbytes, meta, args.plot)


def plot(
    table: dict[str, dict[str, dict[str, float]]], nbytes: int, meta: dict[str, Any], out: str
) -> None:
    """Grouped bars: GiB/s of each contender on each layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(table)
    contenders = [c for c in CONTENDERS if any(c in table[la] for la in layouts)]
    fig, ax = plt.subplots(figsize=(11, 5.0))
    width = 0.8 / max(1, len(contenders))
    for i, c in enumerate(contenders):
        xs = [j + i * width for j, la in enumerate(layouts) if c in table[la]]
        ys = [nbytes / GiB / table[la][c]["seconds"] for la in layouts if c in table[la]]
        ax.bar(xs, ys, width, label=LEGEND.get(c, c))
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(layouts))],
        [LAYOUT_NAMES.get(la, la) for la in layouts],
    )
    ax.set_ylabel("GiB/s (median, fresh process per run)")
    ax.set_title(
        f"{nbytes / MiB:.0f} MiB from S3 (s3rver) behind {meta['latency_s'] * 1e3:.0f} ms one-way delay"
        + (f", {meta['rate_mbit']:g} Mbit/s tc tbf link, " if meta.get("rate_mbit") else ", ")
        + f"{meta['rounds']} rounds; load average {' '.join(meta['load'][0])}"
    )
    ax.legend(
        ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False
    )  # off the bars
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(__file__, {"sweep": "_peers_sweep.py"})
    main()
