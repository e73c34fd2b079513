"""Concurrency x chunk size on the wire transport: throughput and CPU per GiB (issue 30, item 4).

S3 on loopback (s3rver) behind a FaultProxy adding ``--latency`` each way (10 ms: a 20 ms
round trip). For each layout, each ``LoadOptions.concurrency`` in ``--concurrency`` and each
``chunk_size`` in ``--chunk-mib``, one ``asyncload.load(..., transport="wire")`` in a fresh
process (``_peer_child.py``, as in ``bench_peers.py``: imports and a touched destination
before the clock; CPU seconds of the loading process, every thread), cells in a shuffled
order each round. Prints each run, then per layout two grids of medians (GiB/s, CPU s/GiB)
and a text chart of both against concurrency, one line per chunk size, ready to paste into
docs/performance.md; with ``--plot`` also a PNG (needs matplotlib, which asyncload does not
depend on). The machine's 2 cores are shared by the loader, the proxy and s3rver: the CPU
column is what a node would spend per GiB; the GiB/s column is this machine's.

    python benchmarks/bench_peers.py --part sweep --size-mib 128 --rounds 1
    python benchmarks/bench_peers.py --part sweep --layouts safetensors --concurrency 4,16,64 --chunk-mib 4,16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_bytecode, loadavg
from bench_peers import CHILD, SEED, make_tensors, write_layouts
from bench_remote import Proxy, find_s3rver

from asyncload.testing import S3rverServer, configure_env

MiB = 1 << 20
GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--latency", type=float, default=0.010, help="one-way delay, seconds")
    ap.add_argument("--layouts", default="safetensors,dcp-one-file")
    ap.add_argument("--concurrency", default="2,4,8,16,32,64")
    ap.add_argument("--chunk-mib", default="2,8,32")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", help="also write every run to this JSON file")
    ap.add_argument("--plot", help="also draw the grids into this PNG (matplotlib)")
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    chunks = [int(c) for c in args.chunk_mib.split(",")]
    layouts = args.layouts.split(",")
    exe = find_s3rver()
    if exe is None:
        sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
    configure_env()
    ensure_bytecode()
    tensors = make_tensors(args.size_mib * MiB, 1024)
    spec = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    before = loadavg()
    print(
        f"{nbytes / MiB:.0f} MiB, {args.latency * 1e3:.0f} ms one-way, {args.rounds} round(s), "
        f"concurrency {concs} x chunk_size {chunks} MiB; load average {before}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    rng = random.Random(30)
    with (
        tempfile.TemporaryDirectory(prefix="asyncload-bench-sweep-") as tmp,
        S3rverServer(executable=exe) as server,
    ):
        paths = write_layouts(tensors, Path(tmp), layouts)
        del tensors
        urls = {la: server.upload_dir(p, "sweep", la) for la, p in paths.items()}
        for r in range(args.rounds):
            cells = [(la, c, k) for la in layouts for c in concs for k in chunks]
            rng.shuffle(cells)
            for layout, conc, chunk in cells:
                got = _run(server, urls[layout], spec, args, conc, chunk)
                runs.append(
                    {"layout": layout, "concurrency": conc, "chunk_mib": chunk, "round": r, **got}
                )
                print(
                    f"{layout:13s} concurrency={conc:<3d} chunk={chunk:>3d} MiB "
                    f"{got['seconds']:.3f} s  {got['cpu'] / (nbytes / GiB):.2f} CPU s/GiB",
                    flush=True,
                )
    after = loadavg()
    print(f"\nload average before {before}, after {after}")
    for layout in layouts:
        print(f"\n### {layout}, {nbytes / MiB:.0f} MiB, median of {args.rounds} round(s)\n")
        speed = _grid(runs, layout, concs, chunks, lambda r: nbytes / GiB / r["seconds"])
        cpu = _grid(runs, layout, concs, chunks, lambda r: r["cpu"] / (nbytes / GiB))
        print(_table("GiB/s", speed, concs, chunks))
        print()
        print(_table("CPU s/GiB", cpu, concs, chunks))
        print()
        print(_chart(f"{layout}: GiB/s", speed, concs, chunks))
        print()
        print(_chart(f"{layout}: CPU s/GiB", cpu, concs, chunks))
    if args.json:
        meta = {"bytes": nbytes, "latency_s": args.latency, "load": [before, after]}
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    if args.plot:
        _plot(runs, layouts, concs, chunks, nbytes, args.plot)


def _run(
    server: Any, url: str, spec: dict[str, Any], args: Any, conc: int, chunk: int
) -> dict[str, Any]:
    proxy = Proxy(server.endpoint_url, args.latency, None)
    try:
        cfg: dict[str, Any] = {
            "mode": "asyncload_wire",
            "url": url,
            "endpoint": proxy.url,
            "bucket": "sweep",
            "files": [],
            "tensors": spec,
            "check": SEED,
            "options": {"transport": "wire", "concurrency": conc, "chunk_size": chunk * MiB},
            "env": {
                "AWS_ENDPOINT_URL": proxy.url,
                "AWS_ACCESS_KEY_ID": "S3RVER",
                "AWS_SECRET_ACCESS_KEY": "S3RVER",
                "AWS_DEFAULT_REGION": "us-east-1",
            },
        }
        out = subprocess.run(
            [sys.executable, CHILD, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=args.timeout,
            check=False,
        )
    finally:
        proxy.close()
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    got = json.loads(line[7:]) if line else {}
    if "seconds" not in got or got.get("ok") is False:
        sys.exit(f"concurrency={conc} chunk={chunk} MiB: {got or out.stderr[-500:]}")
    return got


def _grid(
    runs: list[dict[str, Any]], layout: str, concs: list[int], chunks: list[int], f: Any
) -> dict[tuple[int, int], float]:
    out = {}
    for c in concs:
        for k in chunks:
            vals = [
                f(r)
                for r in runs
                if r["layout"] == layout and r["concurrency"] == c and r["chunk_mib"] == k
            ]
            if vals:
                out[(c, k)] = statistics.median(vals)
    return out


def _table(
    what: str, grid: dict[tuple[int, int], float], concs: list[int], chunks: list[int]
) -> str:
    head = f"| {what}: chunk_size \\ concurrency | " + " | ".join(str(c) for c in concs) + " |"
    rule = "| --- | " + " | ".join("---:" for _ in concs) + " |"
    rows = [
        f"| {k} MiB | " + " | ".join(f"{grid[(c, k)]:.2f}" for c in concs) + " |" for k in chunks
    ]
    return "\n".join([head, rule, *rows])


def _chart(
    title: str, grid: dict[tuple[int, int], float], concs: list[int], chunks: list[int]
) -> str:
    """A text chart: concurrency across, the value up, one mark per chunk size."""
    marks = "ox+*#@"
    height = 12
    top = max(grid.values()) * 1.05
    col = 8
    lines = [
        f"```\n{title} (marks: "
        + ", ".join(f"{marks[i % len(marks)]} = {k} MiB" for i, k in enumerate(chunks))
        + ")"
    ]
    for row in range(height, 0, -1):
        lo, hi = top * (row - 1) / height, top * row / height
        cells = []
        for c in concs:
            here = [
                marks[i % len(marks)]
                for i, k in enumerate(chunks)
                if lo < grid[(c, k)] <= hi or (row == 1 and grid[(c, k)] <= hi)
            ]
            cells.append("".join(here).center(col))
        lines.append(f"{hi:6.2f} |" + "".join(cells))
    lines.append("       +" + "-" * (col * len(concs)))
    lines.append("        " + "".join(str(c).center(col) for c in concs) + "  concurrency\n```")
    return "\n".join(lines)


def _plot(
    runs: list[dict[str, Any]],
    layouts: list[str],
    concs: list[int],
    chunks: list[int],
    nbytes: int,
    out: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(layouts), figsize=(5 * len(layouts), 7), squeeze=False)
    for j, layout in enumerate(layouts):
        speed = _grid(runs, layout, concs, chunks, lambda r: nbytes / GiB / r["seconds"])
        cpu = _grid(runs, layout, concs, chunks, lambda r: r["cpu"] / (nbytes / GiB))
        for i, (grid, label) in enumerate(((speed, "GiB/s"), (cpu, "CPU s/GiB"))):
            ax = axes[i][j]
            for k in chunks:
                ax.plot(concs, [grid[(c, k)] for c in concs], marker="o", label=f"{k} MiB")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(layout)
            ax.legend(title="chunk_size", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
