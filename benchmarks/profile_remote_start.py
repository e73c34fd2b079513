"""Where a fresh-process remote load spends its time before the first data byte (issue 12).

One ``asyncload.load`` per layout, each in a fresh process (imports and a touched
destination before the clock), from s3rver on loopback behind a FaultProxy adding
``--latency`` each way. Every request the load makes to the store is timed in the child
(the obstore storage's calls, wrapped) and printed as a timeline relative to the call of
``asyncload.load``: set-up before the first request, the metadata requests, the record
probes, and when the first data request started and when its answer began.

    python benchmarks/profile_remote_start.py --size-mib 64
    python benchmarks/profile_remote_start.py --layouts dcp-per-item --rounds 3
    python benchmarks/profile_remote_start.py --layouts safetensors-file   # the URL of one .safetensors file

Layouts: those of ``bench_peers.py``, and ``safetensors-file``: its ``safetensors`` layout
loaded by the URL of the file itself, not of its directory.
"""

from __future__ import annotations

import argparse
import json
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
from asyncload.storage import FsspecStorage, ObstoreStorage

events = []
T0 = [0.0]

def wrap(cls, name, kind):
    orig = getattr(cls, name)
    async def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return await orig(self, *a, **k)
        finally:
            events.append((kind, a[0] if a else "", a[1:3], t - T0[0], time.perf_counter() - T0[0]))
    setattr(cls, name, timed)

for cls in (ObstoreStorage, FsspecStorage):
    wrap(cls, "read", "GET")
    wrap(cls, "size", "HEAD")
    wrap(cls, "sizes", "LIST")
wrap(ObstoreStorage, "_list", "LIST-request")
if hasattr(ObstoreStorage, "read_object"):
    wrap(ObstoreStorage, "read_object", "GET-whole")
if hasattr(ObstoreStorage, "read_prefix"):  # a file's first bytes and its size, one GET
    wrap(ObstoreStorage, "read_prefix", "GET-prefix")

first_byte = []
import obstore
orig_get = obstore.get_async
async def get_async(*a, **k):
    result = await orig_get(*a, **k)
    first_byte.append(time.perf_counter() - T0[0])  # the answer's headers are in
    return result
obstore.get_async = get_async

spec = cfg["tensors"]
dest = {k: torch.zeros(tuple(s), dtype=getattr(torch, d)) for k, (s, d) in spec.items()}
so = {"endpoint_url": cfg["endpoint"], "key": "S3RVER", "secret": "S3RVER", "skip_instance_cache": True}
T0[0] = time.perf_counter()
stats = asyncload.load(dest, cfg["url"], storage_options=so)
total = time.perf_counter() - T0[0]
print("RESULT " + json.dumps({"total": total, "events": events, "first_bytes": first_byte, "requests": len(events)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--latency", type=float, default=0.010)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layouts", default="dcp-one-file,dcp-per-item,safetensors")
    args = ap.parse_args()
    from _common import ensure_bytecode

    ensure_bytecode()  # the fresh children import bytecode, as from an installed package
    from bench_peers import make_tensors, write_layouts
    from bench_remote import Proxy, find_s3rver

    from asyncload.testing import S3rverServer, configure_env

    configure_env()
    layouts = args.layouts.split(",")
    tensors = make_tensors(args.size_mib * MiB, args.hidden)
    spec = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    exe = find_s3rver()
    if exe is None:
        sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
    with (
        tempfile.TemporaryDirectory(prefix="asyncload-profile-") as tmp,
        S3rverServer(executable=exe) as server,
    ):
        written = [x for x in layouts if x != "safetensors-file"]
        if "safetensors-file" in layouts and "safetensors" not in written:
            written.append("safetensors")
        paths = write_layouts(tensors, Path(tmp), written)
        urls = {k: server.upload_dir(p, "bench", k) for k, p in paths.items()}
        if "safetensors-file" in layouts:
            urls["safetensors-file"] = urls["safetensors"] + "/model.safetensors"
        proxy = Proxy(server.endpoint_url, args.latency, None)
        try:
            for layout in layouts:
                for r in range(args.rounds):
                    cfg = {"url": urls[layout], "endpoint": proxy.url, "tensors": spec}
                    out = subprocess.run(
                        [sys.executable, "-c", _CHILD, json.dumps(cfg)],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    line = next(
                        (x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None
                    )
                    if line is None:
                        print(layout, "failed:", out.stderr[-2000:])
                        continue
                    report(layout, r, json.loads(line[7:]))
        finally:
            proxy.close()


def report(layout: str, r: int, res: dict[str, Any]) -> None:
    events = sorted(res["events"], key=lambda e: e[3])
    total = res["total"]
    data = [e for e in events if e[0] == "GET" and len(e[2]) == 2 and e[2][1] - e[2][0] >= MiB]
    first_data = data[0] if data else None
    print(f"\n== {layout}, round {r + 1}: {total * 1e3:.0f} ms, {len(events)} requests ==")
    if not events:
        return
    print(f"  set-up before the first request: {events[0][3] * 1e3:.1f} ms")
    before = [e for e in events if first_data is None or e[3] < first_data[3]]
    kinds: dict[str, list[Any]] = {}
    for e in before:
        small = e[0] == "GET" and len(e[2]) == 2 and e[2][1] - e[2][0] < MiB
        kinds.setdefault(
            ("probe/metadata GET" if small else e[0]) if e[0] == "GET" else e[0], []
        ).append(e)
    for kind, es in kinds.items():
        print(
            f"  {kind:20s} {len(es):4d} requests, first {es[0][3] * 1e3:7.1f} ms, "
            f"last done {max(e[4] for e in es) * 1e3:7.1f} ms"
        )
    for e in events[:8]:
        rng = f"[{e[2][0]}, {e[2][1]})" if len(e[2]) == 2 else ""
        print(
            f"    {e[0]:5s} {str(e[1])[:40]:40s} {rng:24s} {e[3] * 1e3:7.1f} -> {e[4] * 1e3:7.1f} ms"
        )
    if first_data is not None:
        fb = [t for t in res["first_bytes"] if t >= first_data[3]]
        print(
            f"  first data request started at {first_data[3] * 1e3:.1f} ms"
            + (f", its answer began by {min(fb) * 1e3:.1f} ms" if fb else "")
            + f"; last data done {max(e[4] for e in data) * 1e3:.1f} ms; load returned {total * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
