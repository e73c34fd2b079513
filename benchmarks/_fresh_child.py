"""Child of ``bench_local.py --fresh``: one contender's FIRST load in a fresh process.

    python benchmarks/_fresh_child.py '<json config>'

Before the clock: the imports (torch; plus asyncload or torch.distributed.checkpoint for
the contender that needs it) and the destination (torch.zeros, so its memory is touched;
``"dest"``: ``untouched`` for torch.empty, ``to_empty`` for ``module.to_empty``).
The parent warms the page cache. Prints one line ``RESULT <json>``: seconds, peak RSS above
the destination (the kernel's high-water mark, reset just before the call), and, when
asked, the same call again in the same (now warm) process.

Modes: ``bound`` (positional reads into one destination-sized buffer), ``raw`` (the same
with ``"how"``: ``plain``, ``fadvise`` (``POSIX_FADV_SEQUENTIAL`` on open and
``POSIX_FADV_WILLNEED`` before each block) or ``direct`` (``O_DIRECT`` into a page-aligned
destination-sized buffer), for the cold-cache section), ``torch``
(``dcp.load`` + ``FileSystemReader``), ``asyncload`` (``asyncload.load``), ``timeline``
(``asyncload.load`` with a record of what happened when: file opens, positional reads,
DEBUG log records of the "asyncload" logger, modules imported during the call).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

cfg: dict[str, Any] = json.loads(sys.argv[1])
mode = cfg["mode"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# --- the timeline's probes go in before asyncload is imported, so ``from os import preadv`` is seen too
_events: list[tuple[float, str]] = []
_recording = [False]
if mode == "timeline":
    import logging

    def _wrap(name: str) -> None:
        orig = getattr(os, name, None)
        if orig is None:
            return
        seen = [0]

        def wrapper(*a: Any, **k: Any) -> Any:
            if _recording[0] and seen[0] < 3:
                seen[0] += 1
                _events.append((time.perf_counter(), f"os.{name} #{seen[0]} (fd {a[0]})"))
            return orig(*a, **k)

        setattr(os, name, wrapper)

    for _n in ("pread", "preadv", "read", "readv"):
        _wrap(_n)

    import threading as _threading

    _start = _threading.Thread.start

    def _thread_start(self: _threading.Thread) -> None:
        if _recording[0]:
            _events.append((time.perf_counter(), f"thread start {self.name}"))
        _start(self)

    _threading.Thread.start = _thread_start  # type: ignore[method-assign]

    _ckpt_dirs = tuple(os.path.realpath(p) for p in cfg.get("watch", []))

    def _audit(event: str, args: tuple[Any, ...]) -> None:
        if not _recording[0]:
            return
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            p = os.fsdecode(args[0])
            if _ckpt_dirs and os.path.realpath(p).startswith(_ckpt_dirs):
                _events.append((time.perf_counter(), f"open {os.path.basename(p)}"))
        elif event == "mmap.__new__":
            _events.append((time.perf_counter(), "mmap"))
        elif (
            event == "import" and args and isinstance(args[0], str) and args[0] not in sys.modules
        ):
            _events.append((time.perf_counter(), f"import {args[0]}"))

    sys.addaudithook(_audit)

    class _Rec(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if _recording[0]:
                _events.append(
                    (time.perf_counter(), f"log {record.name}: {record.getMessage()[:110]}")
                )

    _lg = logging.getLogger("asyncload")
    _lg.setLevel(logging.DEBUG)
    _lg.addHandler(_Rec())

import _common as C
import torch

al_file = None
if cfg.get(
    "import_uvloop"
):  # a program that imports uvloop itself: asyncload's local loads run on it
    import uvloop  # noqa: F401
if mode in ("asyncload", "timeline"):
    import asyncload
    from asyncload import load  # noqa: F401 - the faces import on first use: before the clock

    al_file = asyncload.__file__
    # bench_local --matrix: every import a load may make, before the clock
    if cfg.get("preimport"):
        import torch.distributed.checkpoint
if mode == "torch":
    import torch.distributed.checkpoint as dcp


def destination() -> dict[str, torch.Tensor]:
    """The destination tensors: ``cfg["dest"]`` ``touched`` (``torch.zeros``, the default),
    ``untouched`` (``torch.empty``: pages not yet faulted in) or ``to_empty`` (a module made on
    the meta device, then ``module.to_empty(device="cpu")``)."""
    with open(cfg["shapes"]) as f:
        shapes = json.load(f)
    how = cfg.get("dest", "touched")
    if how == "untouched":
        return {k: torch.empty(s, dtype=getattr(torch, dt)) for k, (s, dt) in shapes.items()}
    if how == "to_empty":
        module = torch.nn.Module()
        with torch.device("meta"):
            for i, (s, dt) in enumerate(shapes.values()):
                module.register_parameter(
                    f"p{i}", torch.nn.Parameter(torch.empty(s, dtype=getattr(torch, dt)), False)
                )
        module.to_empty(device="cpu")
        return {k: getattr(module, f"p{i}").data for i, k in enumerate(shapes)}
    return {k: torch.zeros(s, dtype=getattr(torch, dt)) for k, (s, dt) in shapes.items()}


def checksums(sd: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(sd[k].double().sum()) for k in cfg.get("check", {})}


def raw_reads(
    files: list[str], dest: memoryview, how: str, threads: int = 2, block: int = 8 << 20
) -> None:
    """Positional reads of every byte of ``files`` into ``dest`` on ``threads`` threads,
    ``block`` bytes each (as ``_common.raw_into_destination``): ``plain``, with ``fadvise``
    hints, or ``direct`` (``O_DIRECT``; ``dest`` page-aligned, each file's first block at a
    page boundary of ``dest``, each block rounded up to 4 KiB: the extra bytes of a file's
    tail land in ``dest``'s slack)."""
    import concurrent.futures
    import contextlib

    flags = os.O_RDONLY | (os.O_DIRECT if how == "direct" else 0)
    with contextlib.ExitStack() as stack:
        jobs: list[tuple[int, int, int, int]] = []  # (fd, file offset, dest offset, length)
        at = 0
        for f in files:
            fd = os.open(f, flags)
            stack.callback(os.close, fd)
            if how == "fadvise":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            at += -at % 4096
            size = os.path.getsize(f)
            jobs += [(fd, off, at + off, min(block, size - off)) for off in range(0, size, block)]
            at += size

        def work(share: list[tuple[int, int, int, int]]) -> None:
            for fd, off, pos, n in share:
                if how == "fadvise":
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                if how == "direct":
                    n += -n % 4096
                os.preadv(fd, [dest[pos : pos + n]], off)

        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(threads))
        for fut in [pool.submit(work, jobs[i::threads]) for i in range(threads)]:
            fut.result()


out: dict[str, Any] = {"mode": mode, "asyncload_file": al_file, "pid": os.getpid()}
fn: Callable[[], Any]
if mode == "raw":
    import mmap

    nbytes = sum(os.path.getsize(f) for f in cfg["files"])
    # page-aligned (O_DIRECT needs it), touched, with room for the last block rounded up
    # (and for each file's tail: blocks of every file are rounded up)
    raw_buf = mmap.mmap(-1, nbytes + 4096 * (len(cfg["files"]) + 1))
    for i in range(0, len(raw_buf), mmap.PAGESIZE):
        raw_buf[i] = 1
    raw_mv = memoryview(raw_buf)
    raw_files, how = cfg["files"], cfg["how"]

    def fn() -> Any:
        return raw_reads(raw_files, raw_mv, how)
elif mode == "bound":
    # "dest": "untouched": torch.empty, its pages faulted in by the reads (the default: touched)
    make = torch.empty if cfg.get("dest") == "untouched" else torch.zeros
    buf = make(sum(os.path.getsize(f) for f in cfg["files"]), dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    files = cfg["files"]

    def fn() -> Any:
        return C.raw_into_destination(files, mv)
else:
    dest = destination()
    path = cfg["path"]
    if mode == "torch":

        def fn() -> Any:
            return dcp.load(dest, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    else:
        o = cfg.get("options")
        opts = asyncload.LoadOptions(**o) if o else None

        def fn() -> Any:
            return (
                asyncload.load(dest, path, options=opts)
                if opts is not None
                else asyncload.load(dest, path)
            )


if cfg.get("drop_caches"):  # cold section: the imports above read libraries; drop again
    C.drop_caches()

if mode == "timeline":
    import threading

    mods0 = set(sys.modules)
    threads0 = threading.active_count()
    _recording[0] = True
    t0 = time.perf_counter()
    res = fn()
    t1 = time.perf_counter()
    _recording[0] = False
    out["seconds"] = t1 - t0
    out["events"] = [((t - t0) * 1e3, what) for t, what in _events]
    new = sorted(set(sys.modules) - mods0)
    out["modules_imported"] = new
    out["threads_left"] = threading.active_count() - threads0
else:
    import resource

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    dt, peak = C.measure(fn)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds (user, system) and minor page faults of the call, every thread
    out["utime"], out["stime"] = ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime
    out["minflt"] = ru1.ru_minflt - ru0.ru_minflt
    res = None
    if mode in ("torch", "asyncload", "bound") and cfg.get("dest", "touched") != "touched":
        # the destination's own pages became resident during the call: not above it
        peak -= (
            len(mv)
            if mode == "bound"
            else sum(t.numel() * t.element_size() for t in dest.values())
        )
    out["seconds"], out["peak"] = dt, peak
    if cfg.get("second"):
        out["seconds2"], out["peak2"] = C.measure(fn)
if mode in ("torch", "asyncload") and cfg.get("check"):
    out["check"] = checksums(dest)
if mode == "asyncload" and cfg.get("stats"):
    out["stats"] = str(fn())
print("RESULT " + json.dumps(out), flush=True)
