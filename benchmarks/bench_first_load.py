"""A first load's fixed cost in a fresh process, per format (issue 45, item 4).

For each format (safetensors, torch.save, DCP) and face (``asyncload.load`` into a plain
state dict, ``read_state_dict``, and ``safe_open`` for safetensors), each round starts a
fresh Python process that imports torch before the clock, then times ``import asyncload``
plus the face's first call; a second, identical call in the same process gives the
warm cost of the same load, and ``first - second`` is what the first call pays beyond it
(imports, first-use tables, threads). Also reported: the part of the first call spent
making asyncload's dataclasses (Python compiles each one's generated methods when its module
is imported; ``dataclasses`` column, with their count), whether the call imported
``torch.distributed.checkpoint``, and, once per round, what importing
``torch.distributed.checkpoint`` alone costs after torch. The checkpoint is small (a few
MiB, page cache warm) so that the data's share is small. Rounds are interleaved; medians.

    python benchmarks/bench_first_load.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import gc, json, sys, time
import torch
cfg = json.loads(sys.argv[1])
# seconds spent in the garbage collector (any thread): a torch process's first full
# collection costs 70-120 ms here and lands in whichever call crosses its threshold
gc_seconds, gc_began = [0.0], [0.0]
def _gc(phase, info):
    if phase == "start":
        gc_began[0] = time.perf_counter()
    else:
        gc_seconds[0] += time.perf_counter() - gc_began[0]
gc.callbacks.append(_gc)
# seconds spent making asyncload's dataclasses (the class bodies' @dataclass: Python
# compiles __init__, __repr__, __eq__, ... for each), counted while the first call imports
import dataclasses
dc_seconds, dc_count = [0.0], [0]
_process_class = dataclasses._process_class
def _timed_process_class(cls, *args, **kwargs):
    t = time.perf_counter()
    try:
        return _process_class(cls, *args, **kwargs)
    finally:
        if cls.__module__.startswith("asyncload"):
            dc_seconds[0] += time.perf_counter() - t
            dc_count[0] += 1
dataclasses._process_class = _timed_process_class
t0 = time.perf_counter()
if cfg["face"] == "dcp-import":
    import torch.distributed.checkpoint  # noqa: F401
    print("RESULT " + json.dumps({"first": time.perf_counter() - t0}))
    raise SystemExit
import asyncload
path, face = cfg["path"], cfg["face"]

def call():
    if face == "load":
        dest = {k: torch.zeros(s, dtype=getattr(torch, d)) for k, (s, d) in cfg["shapes"].items()}
        t = time.perf_counter()
        asyncload.load(dest, path)
        return t
    if face == "read_state_dict":
        t = time.perf_counter()
        asyncload.read_state_dict(path)
        return t
    t = time.perf_counter()
    with asyncload.safe_open(path, framework="pt") as f:
        for k in f.keys():
            f.get_tensor(k)
    return t

call()
first = time.perf_counter() - t0
first_gc, gc_seconds[0] = gc_seconds[0], 0.0
t = call()
second = time.perf_counter() - t
print("RESULT " + json.dumps({
    "first": first, "second": second, "first_gc": first_gc, "second_gc": gc_seconds[0],
    "dataclasses": dc_seconds[0], "dataclass_count": dc_count[0],
    "dcp": "torch.distributed.checkpoint" in sys.modules,
}))
"""


def _make(folder: str) -> dict[str, tuple[str, dict[str, tuple[list[int], str]]]]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)}
    sd.update({f"layers.{i}.bias": torch.randn(256, generator=g) for i in range(8)})
    shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
    st = os.path.join(folder, "model.safetensors")
    save_file(sd, st)
    pt = os.path.join(folder, "model.pt")
    torch.save(sd, pt)
    ck = os.path.join(folder, "dcp")
    dcp.save(sd, checkpoint_id=ck, no_dist=True)
    return {"safetensors": (st, shapes), "torch.save": (pt, shapes), "dcp": (ck, shapes)}


def _run(cfg: dict[str, object]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, float] = json.loads(line[len("RESULT ") :])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import ensure_bytecode

    # the children import asyncload's bytecode, as from an installed package: with
    # PYTHONDONTWRITEBYTECODE=1 (this machine) and no bytecode, each first call compiled
    # every module it imported, inside the clock (270-465 ms against 40-80 ms, 2026-12-07)
    ensure_bytecode()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    with tempfile.TemporaryDirectory() as folder:
        files = _make(folder)
        cases = [
            (fmt, face)
            for fmt in files
            for face in ("load", "read_state_dict", "safe_open")
            if face != "safe_open" or fmt == "safetensors"
        ] + [("-", "dcp-import")]
        got: dict[tuple[str, str], list[dict[str, float]]] = {c: [] for c in cases}
        for _ in range(args.rounds):
            for fmt, face in cases:
                path, shapes = files.get(fmt, ("", {}))
                got[(fmt, face)].append(_run({"path": path, "shapes": shapes, "face": face}))
                time.sleep(0.05)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(
        f"{'format':12} {'face':16} {'first call':>11} {'(in gc)':>9} {'same call again':>16} "
        f"{'(in gc)':>9} {'first - again':>14} {'dataclasses':>16}  "
        "imports torch.distributed.checkpoint"
    )
    for (fmt, face), runs in got.items():
        first = statistics.median(r["first"] for r in runs) * 1e3
        if face == "dcp-import":
            print(f"{'(alone)':12} {'import dcp':16} {first:9.1f} ms")
            continue
        again = statistics.median(r["second"] for r in runs) * 1e3
        first_gc = statistics.median(r["first_gc"] for r in runs) * 1e3
        again_gc = statistics.median(r["second_gc"] for r in runs) * 1e3
        dcp = {bool(r["dcp"]) for r in runs}
        made = statistics.median(r["dataclasses"] for r in runs) * 1e3
        count = max(int(r["dataclass_count"]) for r in runs)
        print(
            f"{fmt:12} {face:16} {first:9.1f} ms {first_gc:6.1f} ms {again:14.1f} ms "
            f"{again_gc:6.1f} ms {first - again:12.1f} ms {made:6.1f} ms ({count:3d})  "
            f"{'yes' if dcp == {True} else 'no' if dcp == {False} else 'sometimes'}"
        )


if __name__ == "__main__":
    main()
