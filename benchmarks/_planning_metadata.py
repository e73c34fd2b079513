"""Reading a huge DCP ``.metadata``: ``pickle.loads`` (what torch's reader does) against
asyncload's allow-list decoder, at 10k, 100k and 1M chunks.

The metadata is the model of ``bench_planning.py`` (1,002 tensors, about 97 B parameters)
saved FSDP-sharded on 10, 100 and 1,024 ranks, built as ``dcp.save`` writes it and pickled
as torch's ``FileSystemWriter`` does (``pickle.dump``, the default protocol). Each figure
comes from a fresh child process that reads the file, then runs one of:

* ``pickle.loads``;
* ``decode_metadata`` (``asyncload.formats.decode_metadata``: the allow-list machine, the
  version check, ``check_metadata``, the safetensors marking): what a load runs;
* ``check_metadata`` alone, on the value ``pickle.loads`` gave.

and reports its seconds (wall clock, garbage collections included, also those the call
leaves for later: the child allocates a little afterwards and that time is added) and its
peak memory (growth of the peak RSS over the RSS after reading the file; /proc/self/status
VmHWM, reset first).

Run:  python benchmarks/bench_planning.py --part metadata  # 10k, 100k, 1M (about 5 min, 2 cores)
      python benchmarks/bench_planning.py --part metadata --ranks 10 100  # the small sizes only
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 1 << 20

_CHILD = r"""
import gc, json, pickle, sys, time
sys.path.insert(0, {root!r})
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
import torch
from asyncload.decoding.allowlist import check_metadata
from asyncload.formats.dcp import decode_metadata
raw = open({path!r}, "rb").read()
what = {what!r}
arg = pickle.loads(raw) if what == "check_metadata" else None
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
t0 = time.perf_counter()
if what == "pickle.loads":
    out = pickle.loads(raw)
elif what == "decode_metadata":
    out = decode_metadata(raw, "bench/.metadata", max_size=len(raw))
else:
    check_metadata(arg, "bench/.metadata")
t1 = time.perf_counter()
later = [[i] for i in range(100000)]  # collections the call left for later run here
t2 = time.perf_counter()
print(json.dumps({{"s": (t1 - t0) + max(0.0, (t2 - t1) - {alloc_s}), "peak": status("VmHWM") - base}}))
"""


def child(path: str, what: str, alloc_s: float) -> dict[str, float]:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    code = _CHILD.format(root=root, path=path, what=what, alloc_s=alloc_s)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def alloc_baseline() -> float:
    """Seconds the child's follow-up allocation takes on its own (subtracted)."""
    t0 = time.perf_counter()
    later = [[i] for i in range(100000)]
    del later
    return time.perf_counter() - t0


def main() -> None:
    from bench_planning import Mesh, build_checkpoint, loadavg, model

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ranks", type=int, nargs="+", default=[10, 100, 1024], help="saving ranks per size"
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="children per figure (the best is kept)"
    )
    args = ap.parse_args()
    print(f"load average before: {loadavg()}", flush=True)
    base = alloc_baseline()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            md = build_checkpoint(model(111), Mesh(ranks)).md
            chunks = sum(len(v.chunks) for v in md.state_dict_metadata.values())
            path = os.path.join(tmp, f"{ranks}.metadata")
            with open(path, "wb") as f:
                pickle.dump(md, f)  # as torch's FileSystemWriter writes it
            del md
            size = os.path.getsize(path)
            row: dict[str, float] = {"chunks": chunks, "bytes": size}
            for what in ("pickle.loads", "decode_metadata", "check_metadata"):
                runs = [child(path, what, base) for _ in range(args.repeats)]
                row[what + " s"] = min(r["s"] for r in runs)
                row[what + " peak"] = min(r["peak"] for r in runs)
            rows.append(row)
            print(
                f"{chunks:>9,} chunks, {size / MiB:6.1f} MiB: pickle.loads {row['pickle.loads s']:.2f} s "
                f"({row['pickle.loads peak'] / MiB:,.0f} MiB), decode_metadata {row['decode_metadata s']:.2f} s "
                f"({row['decode_metadata peak'] / MiB:,.0f} MiB; {row['decode_metadata s'] / row['pickle.loads s']:.2f}x, "
                f"+{row['decode_metadata s'] - row['pickle.loads s']:.2f} s), of which check_metadata "
                f"{row['check_metadata s']:.2f} s",
                flush=True,
            )
            os.remove(path)
    print(f"load average after: {loadavg()}")
    print()
    print(
        "| chunks | .metadata | pickle.loads | decode_metadata | ratio | check_metadata alone | peak RSS: pickle.loads | decode_metadata |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['chunks']:,.0f} | {r['bytes'] / MiB:.1f} MiB | {r['pickle.loads s']:.2f} s | "
            f"{r['decode_metadata s']:.2f} s | {r['decode_metadata s'] / r['pickle.loads s']:.2f}x | "
            f"{r['check_metadata s']:.2f} s | {r['pickle.loads peak'] / MiB:,.0f} MiB | "
            f"{r['decode_metadata peak'] / MiB:,.0f} MiB |"
        )


if __name__ == "__main__":
    main()
