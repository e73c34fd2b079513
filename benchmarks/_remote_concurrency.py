"""Is ``concurrency="auto"`` at least level with the fixed default? (issue 12)

S3 on loopback (s3rver) behind a FaultProxy, in three settings: 10 ms one-way delay; 10 ms
with a 100 MiB/s cap; 1 ms. Two layouts (``dcp-one-file``, ``safetensors``) of
``--size-mib``. Contenders are ``asyncload.load`` with each ``--variants`` value of
``LoadOptions.concurrency``, every run the first load of a fresh process
(``_peer_child.py``, as in ``bench_peers.py``), rounds interleaved, the order flipped every
other round. Prints each run and the medians, with the load average. Timing decides nothing
in the tests.

    python benchmarks/bench_remote.py --part concurrency --size-mib 256 --rounds 3
    python benchmarks/bench_remote.py --part concurrency --variants 16,auto,32,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import loadavg
from bench_peers import CHILD, SEED, make_tensors, write_layouts
from bench_remote import Proxy, find_s3rver

from asyncload.testing import S3rverServer, configure_env

MiB = 1 << 20
SETTINGS = [("10ms", 0.010, None), ("10ms-100MiB/s", 0.010, 100 * MiB), ("1ms", 0.001, None)]
LAYOUTS = ["dcp-one-file", "safetensors"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--variants", default="16,auto,32", help="LoadOptions.concurrency values, comma-separated"
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    variants: list[int | str] = [v if v == "auto" else int(v) for v in args.variants.split(",")]
    exe = find_s3rver()
    if exe is None:
        sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
    configure_env()
    tensors = make_tensors(args.size_mib * MiB, 1024)
    spec = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    before = loadavg()
    print(
        f"{args.size_mib} MiB, {args.rounds} rounds, variants {variants}; load average {before}",
        flush=True,
    )
    results: dict[tuple[str, str, str], list[float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="asyncload-bench-conc-") as tmp,
        S3rverServer(executable=exe) as server,
    ):
        paths = write_layouts(tensors, Path(tmp), LAYOUTS)
        del tensors
        urls = {la: server.upload_dir(p, "conc", la) for la, p in paths.items()}
        for r in range(args.rounds):
            for setting, latency, bandwidth in SETTINGS:
                for layout in paths:
                    for v in variants if r % 2 == 0 else variants[::-1]:
                        proxy = Proxy(server.endpoint_url, latency, bandwidth)
                        try:
                            cfg: dict[str, Any] = {
                                "mode": "asyncload",
                                "url": urls[layout],
                                "endpoint": proxy.url,
                                "bucket": "conc",
                                "files": [],
                                "tensors": spec,
                                "check": SEED,
                                "options": {"concurrency": v},
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
                        line = next(
                            (ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")),
                            None,
                        )
                        got = json.loads(line[7:]) if line else {}
                        if "seconds" not in got or got.get("ok") is False:
                            sys.exit(
                                f"{setting} {layout} concurrency={v}: {got or out.stderr[-500:]}"
                            )
                        results.setdefault((setting, layout, str(v)), []).append(got["seconds"])
                        print(
                            f"{setting:14s} {layout:13s} concurrency={v!s:5s} {got['seconds']:.3f} s",
                            flush=True,
                        )
    print(f"\nmedian seconds (load average before {before}, after {loadavg()})")
    print(f"{'setting':14s} {'layout':13s} " + " ".join(f"{v!s:>8s}" for v in variants))
    for setting, _, _ in SETTINGS:
        for layout in LAYOUTS:
            meds = [statistics.median(results[(setting, layout, str(v))]) for v in variants]
            print(f"{setting:14s} {layout:13s} " + " ".join(f"{m:8.3f}" for m in meds))


if __name__ == "__main__":
    main()
