"""Which copy out of a warm page cache: the kernel's (``preadv``) or a user-space ``memmove``
out of a short-lived mapping (asyncload/storage/mapped.py), into aligned and unaligned memory.

    python benchmarks/bench_local.py --part copy-paths --size-mib 1024 --rounds 9
    python benchmarks/bench_local.py --part copy-paths --shifts --size-mib 256 --rounds 5

One process, one DCP checkpoint (``_common.transformer_state_dict``, one ``.distcp`` file),
warm page cache. asyncload's own large reads are captured from one load (their file offsets
and the destination tensors they land in), then replayed on 2 threads pulling from one
queue, interleaved round by round, the order rotated each round:

- ``preadv``, into one destination-sized buffer at the reads' file offsets (source and
  destination alike modulo 4096: the issue's bound), shifted by 1 byte (alike modulo
  nothing: what a tensor at an arbitrary address gets), and into the real destinations;
- the leased mapped copy (``_mapped.MappedCopies``), into the same three;
- asyncload's choice between the two (mapped only where the kernel's copy would alias:
  ``MappedCopies.aliasing``), into the shifted buffer and the destinations;
- whole ``asyncload.load`` calls with ``local_mapped_copies`` off and on, into the
  destinations and into destinations placed to alias (each a view into one buffer, 4-7 bytes
  past its bytes' file offset modulo 4096).

``--shifts`` measures instead one file of random bytes read in 16 MiB reads into one buffer
whose address is a given number of bytes past the file offset modulo 4096, for a range of
such shifts, ``preadv`` against the mapped copy (the measurement behind
``_mapped.ALIAS_WINDOW``).

Prints the median wall time, the ratio to the bound, CPU seconds (user + system, this
process's ``getrusage``) per GiB, and how many of the reads the kernel's copy would alias.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _common as C

import asyncload
from asyncload.storage import local as _local
from asyncload.storage import mapped as _mapped

MiB = 1 << 20
Read = tuple[str, int, list[memoryview]]


def _capture(dest: dict[str, torch.Tensor], path: str) -> list[Read]:
    """asyncload's positional reads of one load of at least 1 MiB: (file, offset, buffers)."""
    reads: list[Read] = []
    orig = _local.LocalStorage._preadv

    def rec(self: Any, name: str, start: int, buffers: Any) -> None:
        if sum(len(b) for b in buffers) >= MiB:
            reads.append((self._path(name), start, list(buffers)))
        orig(self, name, start, buffers)

    _local.LocalStorage._preadv = rec  # type: ignore[method-assign]
    try:
        asyncload.load(dest, path, options=asyncload.LoadOptions(local_mapped_copies=False))
    finally:
        _local.LocalStorage._preadv = orig  # type: ignore[method-assign]
    return reads


def _preadv(fd: int, f: str, off: int, bufs: list[memoryview]) -> None:
    os.preadv(fd, bufs, off)


def _leased(mapped: _mapped.MappedCopies) -> Callable[[int, str, int, list[memoryview]], None]:
    """The mapped copy of a whole read (every window must map: a warm page cache)."""

    def leased(fd: int, f: str, off: int, bufs: list[memoryview]) -> None:
        for b in bufs:
            if mapped.copy(fd, f, off, b) != len(b):
                raise RuntimeError(f"{f}: a window was not mapped (page cache not warm?)")
            off += len(b)

    return leased


def _replay(
    reads: list[Read], fds: dict[str, int], copy: Callable[[int, str, int, list[memoryview]], None]
) -> None:
    q = collections.deque(reads)

    def work() -> None:
        while True:
            try:
                f, off, bufs = q.popleft()
            except IndexError:
                return
            copy(fds[f], f, off, bufs)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


SHIFTS = [
    0,
    1,
    2,
    4,
    8,
    16,
    24,
    31,
    32,
    48,
    63,
    64,
    65,
    100,
    128,
    129,
    256,
    513,
    1000,
    2049,
    3001,
    4000,
    4064,
    4080,
    4095,
]


def shifts(size_mib: int, rounds: int) -> None:
    tmp = tempfile.mkdtemp(prefix="asyncload-shifts-")
    try:
        f = os.path.join(tmp, "blob")
        with open(f, "wb") as out:
            for _ in range(size_mib):
                out.write(os.urandom(MiB))
        fd = os.open(f, os.O_RDONLY)
        size = os.fstat(fd).st_size
        buf = torch.zeros(size + 8192, dtype=torch.uint8)
        mv = memoryview(buf.numpy())
        base = buf.data_ptr()
        mapped = _mapped.MappedCopies()

        def reads(shift: int) -> list[Read]:
            k = (shift - base) % 4096
            return [
                (f, o, [mv[k + o : k + o + min(16 * MiB, size - o)]])
                for o in range(0, size, 16 * MiB)
            ]

        preadv, leased = _preadv, _leased(mapped)

        jobs = {s: reads(s) for s in SHIFTS}
        variants = [
            (s, name, fn) for s in SHIFTS for name, fn in (("preadv", preadv), ("mapped", leased))
        ]
        for s, _, fn in variants:
            _replay(jobs[s], {f: fd}, fn)
        res: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
        for r in range(rounds):
            for s, name, fn in variants[r % len(variants) :] + variants[: r % len(variants)]:
                t = time.perf_counter()
                _replay(jobs[s], {f: fd}, fn)
                res[(s, name)].append(time.perf_counter() - t)
        os.close(fd)
        print(
            f"\n{size_mib} MiB of random bytes, warm page cache, 16 MiB reads on 2 threads into one buffer "
            f"SHIFT bytes past the file offset modulo 4096, median of {rounds} interleaved rounds"
        )
        print(f"{'shift':>6s} {'preadv ms':>10s} {'mapped ms':>10s}  aliasing")
        for s in SHIFTS:
            a, b = (statistics.median(res[(s, n)]) * 1e3 for n in ("preadv", "mapped"))
            print(f"{s:6d} {a:10.1f} {b:10.1f}  {'yes' if 0 < s < _mapped.ALIAS_WINDOW else ''}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _aliasing_destinations(
    dest: dict[str, torch.Tensor], reads: list[Read]
) -> dict[str, torch.Tensor]:
    """Destinations like ``dest``, each a view into one buffer at an address 4-7 bytes past
    its tensor bytes' file offset modulo 4096 (from the captured reads; aligned for its
    dtype): every large read is one the kernel's copy aliases."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, k) for k, t in dest.items())
    offset: dict[str, int] = {}  # each tensor's first byte's file offset
    for _, off, bufs in reads:
        for b in bufs:
            a = np.frombuffer(b, dtype=np.uint8).ctypes.data
            i = bisect.bisect_right(spans, (a, float("inf"), "")) - 1
            lo, hi, k = spans[i]
            if lo <= a < hi:  # the head probe may have read the first bytes: not at lo
                offset.setdefault(k, off - (a - lo))
            off += len(b)
    big = torch.empty(sum(t.nbytes + 8192 for t in dest.values()), dtype=torch.uint8)
    base, at, out = big.data_ptr(), 0, {}
    for k, t in dest.items():
        if k not in offset:  # a small record: wherever
            out[k] = torch.zeros_like(t)
            continue
        shift = 4 + (-offset[k]) % 4
        at += (offset[k] + shift - (base + at)) % 4096
        out[k] = big[at : at + t.nbytes].view(t.dtype).view(t.shape)
        at += t.nbytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--shifts", action="store_true", help="preadv against the mapped copy, shift by shift"
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="torch.distributed")
    why = _mapped.mapped_copies_available()
    if why is not None:
        sys.exit(f"no mapped copies on this machine: {why}")
    print(f"asyncload: {asyncload.__file__}; load average (start): {C.loadavg()}")
    if args.shifts:
        shifts(args.size_mib, args.rounds)
        print(f"load average (end): {C.loadavg()}")
        return
    tmp = tempfile.mkdtemp(prefix="asyncload-copy-")
    try:
        sd = C.transformer_state_dict(args.size_mib * MiB)
        path = os.path.join(tmp, "ckpt")
        dcp.save(sd, checkpoint_id=path)
        dest = C.zeros_like(sd)
        del sd
        reads = _capture(dest, path)
        files = sorted({f for f, _, _ in reads})
        fds = {f: os.open(f, os.O_RDONLY) for f in files}
        total = sum(len(b) for _, _, bs in reads for b in bs)
        span = max(off + sum(len(b) for b in bs) for _, off, bs in reads)
        buf = torch.zeros(span + 8192, dtype=torch.uint8)
        mv = memoryview(buf.numpy())
        base = buf.data_ptr()

        def into_buffer(shift: int) -> list[Read]:
            k = (shift - base) % 4096  # buffer address at file offset o: o + shift modulo 4096
            return [
                (f, off, [mv[k + off : k + off + sum(len(b) for b in bs)]]) for f, off, bs in reads
            ]

        aligned, shifted = into_buffer(0), into_buffer(1)
        alias = _aliasing_destinations(dest, reads)
        mapped = _mapped.MappedCopies()

        preadv, leased = _preadv, _leased(mapped)

        def choice(fd: int, f: str, off: int, bufs: list[memoryview]) -> None:
            for b in bufs:  # asyncload's: mapped where the kernel's copy would alias
                if mapped.aliasing(off, b):
                    leased(fd, f, off, [b])
                else:
                    os.preadv(fd, [b], off)
                off += len(b)

        variants: dict[str, Callable[[], None]] = {
            "preadv, buffer at file offsets (bound)": lambda: _replay(aligned, fds, preadv),
            "preadv, buffer shifted 1 byte": lambda: _replay(shifted, fds, preadv),
            "preadv, the destinations": lambda: _replay(reads, fds, preadv),
            "mapped, buffer at file offsets": lambda: _replay(aligned, fds, leased),
            "mapped, buffer shifted 1 byte": lambda: _replay(shifted, fds, leased),
            "mapped, the destinations": lambda: _replay(reads, fds, leased),
            "asyncload's choice, shifted 1 byte": lambda: _replay(shifted, fds, choice),
            "asyncload's choice, the destinations": lambda: _replay(reads, fds, choice),
            "asyncload.load, local_mapped_copies=False": lambda: asyncload.load(
                dest, path, options=asyncload.LoadOptions(local_mapped_copies=False)
            ),
            "asyncload.load (default)": lambda: asyncload.load(dest, path),
            "aliasing dests, local_mapped_copies=False": lambda: asyncload.load(
                alias, path, options=asyncload.LoadOptions(local_mapped_copies=False)
            ),
            "aliasing dests, asyncload.load (default)": lambda: asyncload.load(alias, path),
        }
        for fn in variants.values():  # warm the cache and every path
            fn()
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                a = resource.getrusage(resource.RUSAGE_SELF)
                t = time.perf_counter()
                variants[k]()
                wall = time.perf_counter() - t
                b = resource.getrusage(resource.RUSAGE_SELF)
                res[k].append((wall, b.ru_utime - a.ru_utime + b.ru_stime - a.ru_stime))
        for fd in fds.values():
            os.close(fd)
        rel = collections.Counter(mapped.aliasing(off, bs[0]) for _, off, bs in reads)
        print(
            f"\n{C.gib(total)} GiB in {len(reads)} reads of {len(files)} file(s), warm page cache, 2 threads, "
            f"median of {args.rounds} interleaved rounds, {os.cpu_count()} CPUs; "
            f"reads the kernel's copy would alias: {rel[True]} of {len(reads)}"
        )
        bound = statistics.median(w for w, _ in res[names[0]])
        print(f"{'':40s} {'seconds':>8s} {'x bound':>8s} {'CPU s/GiB':>10s}")
        for k, v in res.items():
            w = statistics.median(x for x, _ in v)
            cpu = statistics.median(c for _, c in v) / (total / (1 << 30))
            print(f"{k:40s} {w:8.4f} {bound / w:8.2f} {cpu:10.3f}")
        print(f"load average (end): {C.loadavg()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
