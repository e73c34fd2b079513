"""Where a warm local load spends its time, phase by phase (issue 12's warm-cache target).

One process, one DCP checkpoint (the transformer-like state dict of ``_common.py``, one
``.distcp`` file), warm page cache. Interleaved round by round: the destination-sized bound
(positional reads on 2 threads into one touched buffer) and ``asyncload.load`` with large
local reads handed to the I/O threads one by one (``_pipeline._DIRECT_RUNS = False``) and
in one run per file, each thread pulling the next read from one queue (the default). For each asyncload load, from the session's DEBUG
record and the storage's positional reads, timed on the load's own threads:

- ``start``: the call to the first data read (``.metadata``, planning, header probes and
  small records, each large record's layout);
- ``data``: the first data read to the last one's end;
- ``end``: the last data read's end to the return (checks, closing files and threads).

    python benchmarks/profile_local_start.py --size-mib 1024 --rounds 9
    python benchmarks/profile_local_start.py --dir /dev/shm --size-mib 256
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _common as C

import asyncload
from asyncload.engine import pipeline as _pipeline
from asyncload.storage import local as _local

MiB = 1 << 20


class _Reads:
    """Every positional read of a load: (start, end, bytes), perf_counter seconds."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, int]] = []
        self.lock = threading.Lock()
        orig = _local.LocalStorage._preadv
        reads = self

        def timed(storage: Any, name: str, start: int, buffers: Any) -> None:
            t0 = time.perf_counter()
            orig(storage, name, start, buffers)
            with reads.lock:
                reads.events.append((t0, time.perf_counter(), sum(len(b) for b in buffers)))

        _local.LocalStorage._preadv = timed  # type: ignore[method-assign]


def _phases(reads: _Reads, t0: float, t1: float, data_from: int) -> tuple[float, float, float]:
    data = [e for e in reads.events if e[2] >= data_from]
    if not data:
        return t1 - t0, 0.0, 0.0
    first, last = min(e[0] for e in data), max(e[1] for e in data)
    return first - t0, last - first, t1 - last


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="torch.distributed")
    print(f"asyncload: {asyncload.__file__}; load average (start): {C.loadavg()}")
    tmp = tempfile.mkdtemp(prefix="asyncload-phases-", dir=args.dir)
    try:
        sd = C.transformer_state_dict(args.size_mib * MiB)
        path = os.path.join(tmp, "ckpt")
        dcp.save(sd, checkpoint_id=path)
        dest = C.zeros_like(sd)
        del sd
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".distcp")]
        size = sum(os.path.getsize(f) for f in files)
        buf = torch.zeros(size, dtype=torch.uint8)
        mv = memoryview(buf.numpy())
        reads = _Reads()
        session_log: list[str] = []

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage().startswith("read "):
                    session_log.append(record.getMessage())

        slog = logging.getLogger("asyncload.session")
        slog.addHandler(_Keep())
        slog.setLevel(logging.DEBUG)
        slog.propagate = False
        variants = {"one by one": False, "in one run": True}
        times: dict[str, list[float]] = {"bound": [], **{k: [] for k in variants}}
        phases: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
        C.raw_into_destination(files, mv)  # warm the page cache
        for runs in variants.values():
            _pipeline._DIRECT_RUNS = runs
            asyncload.load(dest, path)
        for _ in range(args.rounds):
            t = time.perf_counter()
            C.raw_into_destination(files, mv)
            times["bound"].append(time.perf_counter() - t)
            for name, runs in variants.items():
                _pipeline._DIRECT_RUNS = runs
                reads.events.clear()
                t0 = time.perf_counter()
                asyncload.load(dest, path)
                t1 = time.perf_counter()
                times[name].append(t1 - t0)
                phases[name].append(_phases(reads, t0, t1, data_from=MiB))
        _pipeline._DIRECT_RUNS = True
        bound = statistics.median(times["bound"])
        print(
            f"\n{C.gib(size)} GiB in {len(files)} file(s), {len(dest)} keys, warm page cache, "
            f"median of {args.rounds} interleaved rounds, {os.cpu_count()} CPUs"
        )
        print(
            f"{'':28s} {'seconds':>8s} {'x bound':>8s} {'start ms':>9s} {'data ms':>8s} {'end ms':>7s}"
        )
        print(f"{'bound (into one buffer)':28s} {bound:8.4f} {1.0:8.2f}")
        for name in variants:
            t = statistics.median(times[name])
            s, d, e = (statistics.median(p[i] for p in phases[name]) * 1e3 for i in range(3))
            print(
                f"{'asyncload, ' + name:28s} {t:8.4f} {bound / t:8.2f} {s:9.1f} {d:8.1f} {e:7.1f}"
            )
        if session_log:
            print(f"\nlast load's phases (asyncload.session DEBUG): {session_log[-1]}")
        print(f"load average (end): {C.loadavg()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
