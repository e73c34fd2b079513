"""Which local read path and which event loop: the measurements behind asyncload's choices.

    python benchmarks/bench_io_paths.py --size-mib 1024 --rounds 3

1. Reading a file's bytes into already-touched destination memory in 16 MiB chunks,
   16 in flight, from asyncio: aiofiles ``seek``+``read`` (a new bytes object per
   chunk, then a copy), aiofiles ``seek``+``readinto`` (one shared file position, so
   reads serialise on a lock), and ``os.preadv`` in ``run_in_executor`` (asyncload's
   local backend: positional, straight into the destination, no lock).
2. A whole ``asyncload.load`` of a DCP checkpoint on the default asyncio loop and on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time

import aiofiles
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _common as C

import asyncload

CHUNK = 16 << 20
INFLIGHT = 16


async def via_aiofiles_read(path: str, dest: memoryview) -> None:
    size = len(dest)
    sem = asyncio.Semaphore(INFLIGHT)
    async with aiofiles.open(path, "rb") as f:
        lock = asyncio.Lock()

        async def one(off: int) -> None:
            async with sem:
                async with lock:  # one file position
                    await f.seek(off)
                    data = await f.read(min(CHUNK, size - off))
                dest[off : off + len(data)] = data

        await asyncio.gather(*(one(o) for o in range(0, size, CHUNK)))


async def via_aiofiles_readinto(path: str, dest: memoryview) -> None:
    size = len(dest)
    async with aiofiles.open(path, "rb", buffering=0) as f:
        lock = asyncio.Lock()

        async def one(off: int) -> None:
            async with lock:
                await f.seek(off)
                await f.readinto(dest[off : min(size, off + CHUNK)])

        await asyncio.gather(*(one(o) for o in range(0, size, CHUNK)))


async def via_preadv(path: str, dest: memoryview, ex: concurrent.futures.Executor) -> None:
    size = len(dest)
    fd = os.open(path, os.O_RDONLY)
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(INFLIGHT)
    try:

        async def one(off: int) -> None:
            async with sem:
                await loop.run_in_executor(
                    ex, os.preadv, fd, [dest[off : min(size, off + CHUNK)]], off
                )

        await asyncio.gather(*(one(o) for o in range(0, size, CHUNK)))
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="asyncload-iopaths-")
    try:
        path = os.path.join(tmp, "blob")
        with open(path, "wb") as f:
            for _ in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        size = os.path.getsize(path)
        dest_t = torch.zeros(size, dtype=torch.uint8)
        dest = memoryview(dest_t.numpy())
        ex = concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2))
        paths = {
            "aiofiles seek+read (+copy)": lambda: asyncio.run(via_aiofiles_read(path, dest)),
            "aiofiles seek+readinto": lambda: asyncio.run(via_aiofiles_readinto(path, dest)),
            "os.preadv in executor": lambda: asyncio.run(via_preadv(path, dest, ex)),
        }
        with open(path, "rb") as f:  # warm the cache
            while f.read(64 << 20):
                pass
        times = {k: [] for k in paths}
        for _ in range(args.rounds):
            for k, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        print(
            f"1) {size >> 20} MiB file, warm cache, {CHUNK >> 20} MiB chunks, {INFLIGHT} in flight, "
            f"median of {args.rounds}, {os.cpu_count()} CPUs"
        )
        for k, ts in times.items():
            t = C.median(ts)
            print(f"   {k:30s} {t:7.3f} s {size / t / (1 << 30):6.2f} GiB/s")
        ex.shutdown()

        sd = C.transformer_state_dict(args.size_mib << 20)
        ck = os.path.join(tmp, "ckpt")
        dcp.save(sd, checkpoint_id=ck)
        dst = C.zeros_like(sd)
        total = C.nbytes(sd)
        del sd
        loops = {
            "asyncio loop": asyncload.LoadOptions(use_uvloop=False),
            "uvloop": asyncload.LoadOptions(use_uvloop=True),
        }
        lt = {k: [] for k in loops}
        for _ in range(args.rounds + 1):
            for k, o in loops.items():
                t0 = time.perf_counter()
                asyncload.load(dst, ck, options=o)
                lt[k].append(time.perf_counter() - t0)
        print(
            f"2) asyncload.load of a {total / (1 << 30):.2f} GiB DCP checkpoint, median of {args.rounds + 1}"
        )
        for k, ts in lt.items():
            t = C.median(ts)
            print(f"   {k:30s} {t:7.3f} s {total / t / (1 << 30):6.2f} GiB/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
