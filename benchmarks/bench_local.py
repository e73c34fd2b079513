"""Local-disk load benchmark: the raw read bound, torch's dcp.load (FileSystemReader) and
asyncload.load, interleaved in one run on the same checkpoint, warm page cache.

    python benchmarks/bench_local.py --size-mib 1024 --rounds 3

Prints throughput (GiB/s of tensor bytes), ratios to the raw bound and peak RSS above
the destination tensors (the destination is allocated with torch.zeros before timing).
Peak RSS is the kernel's high-water mark, reset before each call; glibc may serve a reader
from memory an earlier reader freed, so the figure can understate a reader's allocations.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
import _common as C  # noqa: E402

import asyncload  # noqa: E402


_BUFS = [bytearray(8 << 20) for _ in range(2)]  # allocated and touched once, reused by every round


def raw_bound(files: list[str], threads: int = 2, block: int = 8 << 20) -> None:
    """Plain positional reads of every byte of the .distcp files on ``threads`` threads into
    already-touched buffers: what the page cache can deliver, nothing parsed or placed."""
    jobs = []
    for f in files:
        size = os.path.getsize(f)
        for off in range(0, size, block):
            jobs.append((f, off, min(block, size - off)))
    bufs = _BUFS[:threads]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    try:
        def work(i: int) -> None:
            mv = memoryview(bufs[i])
            for f, off, n in jobs[i::threads]:
                os.preadv(fds[f], [mv[:n]], off)

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)


def raw_into_destination(files: list[str], dest: memoryview, threads: int = 2, block: int = 8 << 20) -> None:
    """The same reads into one destination-sized, already-touched buffer: a loader's
    physical limit, since it must write every byte into DRAM-resident tensors."""
    jobs = []
    pos = 0
    for f in files:
        size = os.path.getsize(f)
        for off in range(0, size, block):
            n = min(block, size - off)
            jobs.append((f, off, pos, n))
            pos += n
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    try:
        def work(i: int) -> None:
            for f, off, at, n in jobs[i::threads]:
                os.preadv(fds[f], [dest[at : at + n]], off)

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument("--verify", action="store_true", help="also time asyncload with verify=True")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="asyncload-bench-", dir=args.dir)
    try:
        sd = C.transformer_state_dict(args.size_mib << 20)
        total = C.nbytes(sd)
        path = os.path.join(tmp, "ckpt")
        dcp.save(sd, checkpoint_id=path)
        del sd
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".distcp")]
        file_bytes = sum(os.path.getsize(f) for f in files)
        template = C.transformer_state_dict(args.size_mib << 20, seed=1)
        dest = C.zeros_like(template)
        del template
        opts = asyncload.LoadOptions(concurrency=args.concurrency, chunk_size=args.chunk_mib << 20,
                                     memory_budget=args.budget_mib << 20)
        raw_bound(files)  # warm the page cache
        big = torch.zeros(file_bytes, dtype=torch.uint8)
        big_mv = memoryview(big.numpy())
        competitors = {
            "raw bound (preadv, 2 threads)": lambda: raw_bound(files),
            "raw into destination-sized buffer": lambda: raw_into_destination(files, big_mv),
            "torch dcp.load FileSystemReader": lambda: dcp.load(dest, storage_reader=dcp.FileSystemReader(path),
                                                                no_dist=True),
            "asyncload.load": lambda: asyncload.load(dest, path, options=opts),
        }
        if args.verify:
            vopts = opts.replace(verify=True)
            competitors["asyncload.load verify=True"] = lambda: asyncload.load(dest, path, options=vopts)
        times: dict[str, list[float]] = {k: [] for k in competitors}
        peaks: dict[str, list[int]] = {k: [] for k in competitors}
        for _ in range(args.rounds):
            for name, fn in competitors.items():
                dt, peak = C.measure(fn)
                times[name].append(dt)
                peaks[name].append(peak)
        print(f"checkpoint: {C.gib(total)} GiB of tensors in {len(files)} file(s) ({C.gib(file_bytes)} GiB), "
              f"{len(dest)} keys; warm page cache; median of {args.rounds} interleaved rounds; "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs")
        print(f"asyncload options: concurrency={args.concurrency} chunk_size={args.chunk_mib} MiB "
              f"memory_budget={args.budget_mib} MiB")
        bound = C.median(times["raw bound (preadv, 2 threads)"])
        dbound = C.median(times["raw into destination-sized buffer"])
        print(f"{'reader':36s} {'seconds':>8s} {'GiB/s':>7s} {'x bound':>8s} {'x dest bound':>12s} "
              f"{'peak RSS above dest':>20s}")
        for name in competitors:
            t = C.median(times[name])
            print(f"{name:36s} {t:8.3f} {total / t / (1 << 30):7.2f} {bound / t:8.2f} {dbound / t:12.2f} "
                  f"{max(peaks[name]) / (1 << 20):17.1f} MiB")
        st = asyncload.load(dest, path, options=opts)
        print(f"\nasyncload stats: {st}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
