"""A Ctrl-C before every line of asyncload that a sync face runs on the calling thread.

    python scripts/interrupt_probe.py load|dcp|read|iter|safe_open [--start N] [--dir DIR]

Runs the face once to count the lines of asyncload's code it runs on this thread, then once
per line N, raising KeyboardInterrupt (from a trace function) before the N-th; after each,
prints a line where files under the checkpoint stayed open or tasks stayed on the library's
loop. The tests (``tests/engine/test_robustness.py``) do this for the driver's frames and
``safe_open``; this covers every frame, which takes minutes (docs/integrity.md, Robustness).

One line kind is skipped: the exit of a ``with lock:`` block (``loop_thread``), where a trace
function can raise before the lock is released but a signal cannot (Python checks for one
after the release's call, not before it).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import asyncload
from asyncload.testing.interrupts import (
    dcp_load,
    interrupted,
    open_files_under,
    tasks_on_library_loops,
)

PACKAGE = str(Path(asyncload.__file__).parent) + os.sep
SKIPPED = frozenset({"loop_thread"})


def face(name: str, ckpt: Path) -> Callable[[], None]:
    keys = [f"t{i}" for i in range(4)]

    def load() -> None:
        asyncload.load({k: torch.zeros(64, 64) for k in keys}, str(ckpt))

    def load_with_dcp() -> None:
        dcp_load({k: torch.zeros(64, 64) for k in keys}, ckpt)

    def read() -> None:
        asyncload.read_state_dict(str(ckpt))

    def iterate() -> None:
        for _k, t in asyncload.iter_tensors(str(ckpt)):
            t.clone()

    def safe_open() -> None:
        with asyncload.safe_open(ckpt / "m.safetensors", framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open's API
                f.get_tensor(k)

    return {
        "load": load,
        "dcp": load_with_dcp,
        "read": read,
        "iter": iterate,
        "safe_open": safe_open,
    }[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("face", choices=["load", "dcp", "read", "iter", "safe_open"])
    ap.add_argument("--start", type=int, default=1, help="first line to interrupt at")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint")
    args = ap.parse_args()
    # dcp.save and dcp.load without a process group say so each time
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    tensors = {f"t{i}": torch.full((64, 64), float(i)) for i in range(4)}
    ckpt = (args.dir or Path(tempfile.mkdtemp(prefix="interrupt-probe-"))) / "ckpt"
    dcp.save(tensors, checkpoint_id=str(ckpt), no_dist=True)
    if args.face == "safe_open":
        from safetensors.torch import save_file

        save_file(tensors, str(ckpt / "m.safetensors"))
    run = face(args.face, ckpt)

    def traced(code: Any) -> bool:
        return bool(code.co_filename.startswith(PACKAGE))

    def once(n: int) -> tuple[int, str | None]:
        return interrupted(run, traced, n, skip=SKIPPED)

    once(0)  # lines that run once per process (imports, caches)
    lines, _ = once(0)
    print(f"{args.face}: {lines} lines of asyncload on the calling thread", flush=True)
    left = open_files_under(ckpt)
    tasks = tasks_on_library_loops()
    found = 0
    for n in range(args.start, lines + 1):
        faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where, and ends
        _, where = once(n)
        faulthandler.cancel_dump_traceback_later()
        time.sleep(0.005)
        now_left, now_tasks = open_files_under(ckpt), tasks_on_library_loops()
        if len(now_left) > len(left) or now_tasks > tasks:
            found += 1
            extra = len(now_left) - len(left)
            print(f"line {n} ({where}): {extra} file(s) left open, {now_tasks} task(s)")
            left, tasks = now_left, now_tasks
    tried = max(0, lines - args.start + 1)
    print(f"{args.face}: {found} of {tried} interrupts left something open")


if __name__ == "__main__":
    main()
