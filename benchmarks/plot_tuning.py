"""Tuning curves: load throughput against chunk_size, concurrency, memory_budget and
min_chunk_size, on local disk and on a loopback S3 store with added latency; drawn as PNGs.

    pip install matplotlib            # only this script needs it
    python benchmarks/plot_tuning.py  # about 2-3 minutes on 2 cores

Writes docs/img/tuning_local.png, docs/img/tuning_remote.png and the numbers behind them,
docs/img/tuning.json (quoted in docs/tuning.md). Each point is the median wall time of
``asyncload.load`` into zero-filled (already touched) destinations, metadata read included.

* local: a transformer-like checkpoint of --local-mib (default 512) MiB in 4 files, warm
  page cache;
* remote: a --remote-mib (default 192) MiB checkpoint in files of at most 16 MiB on an
  S3-protocol server on 127.0.0.1 (s3rver when installed, else moto) behind
  asyncload.testing.FaultProxy adding --latency-ms (default 10) ms each way, so every
  request pays a 20 ms round trip, like a store in the same region;
* min_chunk_size: 1500 tensors of 64 KiB on the same remote store. A record no larger than
  min_chunk_size is read whole with its neighbours in a few requests; a larger one costs a
  probe of its header, then a read of its data: two round trips per record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _common as C

import asyncload
from asyncload import LoadOptions

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parents[1]


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def save(sd: dict[str, Any], path: Path, files: int) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=files))


def timed_load(
    dest: dict[str, Any],
    url: str,
    options: LoadOptions,
    storage_options: dict[str, Any] | None,
    repeats: int,
) -> float:
    """Median wall seconds of ``repeats`` loads."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        asyncload.load(dest, url, options=options, storage_options=storage_options)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def options(chunk: int, conc: int, **kw: Any) -> LoadOptions:
    return LoadOptions(
        chunk_size=chunk,
        min_chunk_size=min(kw.pop("min_chunk_size", MiB), chunk),
        concurrency=conc,
        **kw,
    )


def sweep(
    label: str,
    dest: dict[str, Any],
    url: str,
    nbytes: int,
    chunks: list[int],
    concs: list[int],
    storage_options: dict[str, Any] | None,
    repeats: int,
    **kw: Any,
) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        for conc in concs:
            s = timed_load(dest, url, options(chunk, conc, **kw), storage_options, repeats)
            out.append(
                {"chunk_size": chunk, "concurrency": conc, "seconds": s, "gib_s": nbytes / GiB / s}
            )
            print(
                f"  {label:<6} chunk {size_label(chunk):>8}  concurrency {conc:>3}: {s:7.3f} s  "
                f"{nbytes / GiB / s:6.2f} GiB/s",
                flush=True,
            )
    return out


def start_store() -> Any:
    from asyncload.testing import S3rverServer, S3Server, ServerNotAvailableError, configure_env

    configure_env()
    try:
        return S3rverServer().start()
    except ServerNotAvailableError:
        return S3Server().start()


def small_tensors(n: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"block{i // 6}.norm{i % 6}": torch.randn(size // 4, generator=g) for i in range(n)}


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    written = []
    # titles name the program a reader knows, not the test helper's class
    SERVER_NAMES = {"S3rverServer": "s3rver", "S3Server": "moto"}

    def log2_axis(ax: Any, values: list[float], labels: list[str]) -> None:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(values))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels(labels)
        ax.set_ylim(bottom=0)

    def grid_panels(axes: Any, points: list[dict[str, Any]], unit: str, ylabel: str) -> None:
        chunks = sorted({p["chunk_size"] for p in points})
        concs = sorted({p["concurrency"] for p in points})
        value = {(p["chunk_size"], p["concurrency"]): p[unit] for p in points}
        ax = axes[0]
        for conc in concs:
            ax.plot(
                [c / MiB for c in chunks],
                [value[(c, conc)] for c in chunks],
                marker="o",
                label=f"concurrency {conc}",
            )
        log2_axis(ax, [c / MiB for c in chunks], [size_label(c) for c in chunks])
        ax.set_xlabel("chunk_size")
        ax.set_ylabel(ylabel)
        ax.set_title("throughput against chunk_size")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1]
        for chunk in chunks:
            ax.plot(
                concs,
                [value[(chunk, c)] for c in concs],
                marker="o",
                label=f"chunk_size {size_label(chunk)}",
            )
        log2_axis(ax, concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency (reads in flight)")
        ax.set_ylabel(ylabel)
        ax.set_title("throughput against concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)

    local = results["local"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    grid_panels(axes, local["grid"], "gib_s", "GiB/s")
    ax = axes[2]
    budgets = local["budget"]
    ax.plot(
        [b["memory_budget"] / MiB for b in budgets],
        [b["gib_s"] for b in budgets],
        marker="o",
        color="C3",
    )
    log2_axis(
        ax,
        [b["memory_budget"] / MiB for b in budgets],
        [size_label(b["memory_budget"]) for b in budgets],
    )
    ax.set_xlabel("memory_budget")
    ax.set_ylabel("GiB/s")
    ax.set_title(
        f"throughput against memory_budget\n(chunk_size {size_label(local['budget_chunk'])}, "
        f"concurrency {local['budget_concurrency']})"
    )
    ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"Local disk, warm page cache: {local['mib']} MiB checkpoint in {local['files']} files, {results['machine']}"
    )
    fig.tight_layout()
    path = out_dir / "tuning_local.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    remote = results["remote"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    grid_panels(
        axes, remote["grid"], "gib_s", "GiB/s"
    )  # the unit of the local figure and of LoadStats
    ax = axes[2]
    mins = remote["min_chunk"]
    ax.bar(
        [size_label(m["min_chunk_size"]) for m in mins], [m["seconds"] for m in mins], color="C2"
    )
    for i, m in enumerate(mins):
        ax.text(i, m["seconds"], f"{m['requests']} req", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("min_chunk_size")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"{remote['small_count']} tensors of {size_label(remote['small_size'])}: load time\n"
        f"against min_chunk_size (concurrency {remote['min_chunk_concurrency']})"
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"Loopback S3 ({SERVER_NAMES.get(remote['server'], remote['server'])}) with {remote['latency_ms']:.0f} ms added each way: "
        f"{remote['mib']} MiB checkpoint in {remote['files']} files, {results['machine']}"
    )
    fig.tight_layout()
    path = out_dir / "tuning_remote.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local-mib", type=int, default=512)
    parser.add_argument("--remote-mib", type=int, default=192)
    parser.add_argument(
        "--latency-ms", type=float, default=10.0, help="added each way per request"
    )
    parser.add_argument("--repeats", type=int, default=5, help="loads per local point (median)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw from the existing tuning.json"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "tuning.json"
    if args.plot_only:
        for p in plot(json.loads(json_path.read_text()), args.out):
            print(f"wrote {p}")
        return

    from asyncload.testing import FaultProxy

    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPU cores",
        "command": " ".join(sys.argv),
    }
    tmp = Path(tempfile.mkdtemp(prefix="asyncload-tuning-"))
    store = proxy = None
    try:
        # --- local -------------------------------------------------------------------------
        sd = C.transformer_state_dict(args.local_mib * MiB, hidden=1024)
        nbytes = C.nbytes(sd)
        save(sd, tmp / "local", files=4)
        dest = C.zeros_like(sd)
        del sd
        url = str(tmp / "local")
        asyncload.load(dest, url)  # warm-up: page cache, threads
        print(f"local: {nbytes / MiB:.0f} MiB in 4 files", flush=True)
        grid = sweep(
            "local",
            dest,
            url,
            nbytes,
            [256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB],
            [1, 2, 4, 8, 16, 32],
            None,
            args.repeats,
        )
        budgets = []
        for budget in (16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 512 * MiB):
            s = timed_load(
                dest, url, options(16 * MiB, 16, memory_budget=budget), None, args.repeats
            )
            budgets.append({"memory_budget": budget, "seconds": s, "gib_s": nbytes / GiB / s})
            print(
                f"  local  memory_budget {size_label(budget):>8}: {s:7.3f} s  {nbytes / GiB / s:6.2f} GiB/s",
                flush=True,
            )
        results["local"] = {
            "mib": round(nbytes / MiB),
            "files": 4,
            "grid": grid,
            "budget": budgets,
            "budget_chunk": 16 * MiB,
            "budget_concurrency": 16,
        }
        del dest

        # --- remote, with latency ----------------------------------------------------------
        store = start_store()
        proxy = FaultProxy(store, latency=args.latency_ms / 1000).start()
        storage_options = store.storage_options(proxy.endpoint_url)
        sd = C.transformer_state_dict(args.remote_mib * MiB, hidden=512)
        nbytes = C.nbytes(sd)
        files = max(1, math.ceil(nbytes / (16 * MiB)))
        save(sd, tmp / "remote", files=files)
        rurl = store.upload_dir(tmp / "remote", "tuning", "remote")
        dest = C.zeros_like(sd)
        del sd
        asyncload.load(dest, rurl, storage_options=storage_options)  # warm-up: connections
        print(
            f"remote ({type(store).__name__}, +{args.latency_ms:.0f} ms each way): {nbytes / MiB:.0f} MiB in "
            f"{files} files",
            flush=True,
        )
        rgrid = sweep(
            "remote",
            dest,
            rurl,
            nbytes,
            [MiB, 4 * MiB, 16 * MiB],
            [1, 4, 16, 64],
            storage_options,
            1,
            hedge=False,
        )
        small = small_tensors(1500, 64 * KiB)
        save(small, tmp / "small", files=1)
        surl = store.upload_dir(tmp / "small", "tuning", "small")
        sdest = {k: torch.zeros_like(v) for k, v in small.items()}
        mins = []
        for m in (16 * KiB, 64 * KiB, 256 * KiB, MiB):
            opts = LoadOptions(chunk_size=16 * MiB, min_chunk_size=m, concurrency=16, hedge=False)
            t0 = time.perf_counter()
            st = asyncload.load(sdest, surl, options=opts, storage_options=storage_options)
            s = time.perf_counter() - t0
            mins.append({"min_chunk_size": m, "seconds": s, "requests": st.chunks})
            print(
                f"  small  min_chunk_size {size_label(m):>8}: {s:7.3f} s, {st.chunks} requests",
                flush=True,
            )
        results["remote"] = {
            "mib": round(nbytes / MiB),
            "files": files,
            "server": type(store).__name__,
            "latency_ms": args.latency_ms,
            "grid": rgrid,
            "min_chunk": mins,
            "small_count": len(small),
            "small_size": 64 * KiB,
            "min_chunk_concurrency": 16,
        }
    finally:
        if proxy is not None:
            proxy.stop()
        if store is not None:
            store.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    json_path.write_text(json.dumps(results, indent=1))
    print(f"wrote {json_path} ({results['seconds']} s)")
    for p in plot(results, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
