"""Loaders side by side on the same tensors, local disk, warm page cache, in one run.

    python benchmarks/compare_loaders.py --size-mib 1024 --rounds 3

The same transformer-like state dict (bf16 matrices, fp32 norms) saved three ways: a DCP
checkpoint (``dcp.save``), one ``model.safetensors`` file and one ``torch.save`` file. Each
loader's job is what a resume does: end with the bytes in the job's own, already-allocated
tensors (zero-filled before timing). Loaders that return new tensors pay for the copy into
the destination, as ``model.load_state_dict`` would. Rounds are interleaved; the table
shows the median seconds, GiB/s of tensor bytes, the ratio to torch's ``dcp.load`` and the
largest peak RSS above the destination. Quoted in docs/comparison.md.
"""

from __future__ import annotations

import os
import sys

if (
    __name__ == "__main__"
    and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    and sys.platform.startswith("linux")
):
    # glibc raises its mmap threshold after large frees, and then keeps freed buffers in the
    # heap: one loader's garbage would hide the next one's peak RSS. A fixed threshold makes
    # every large buffer go back to the system when freed, so the peaks compare fairly.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from demo import PeakRSS, make_state_dict, model_shape

import asyncload

GiB, MiB = 1 << 30, 1 << 20


def flat(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in sd["model"].items()}


def copy_into(dest: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for k, t in dest.items():
        t.copy_(got[k])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file

    tmp = Path(tempfile.mkdtemp(prefix="asyncload-compare-"))
    try:
        sd = flat(make_state_dict(model_shape(args.size_mib * MiB)))
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp / "dcp"), thread_count=4))
        save_file(sd, str(tmp / "model.safetensors"))
        torch.save(sd, tmp / "model.pt")
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        del sd
        print(
            f"{nbytes / GiB:.2f} GiB of tensors in {len(dest)} keys; DCP in 4 files, safetensors and torch.save "
            "in one file each; warm page cache",
            flush=True,
        )

        loaders: dict[str, Callable[[], None]] = {
            "torch dcp.load (FileSystemReader)": lambda: dcp.load(
                dest, checkpoint_id=str(tmp / "dcp")
            ),
            "asyncload.load (DCP)": lambda: asyncload.load(dest, tmp / "dcp"),
            "safetensors load_file + copy": lambda: copy_into(
                dest, load_file(str(tmp / "model.safetensors"))
            ),
            "torch.load(mmap=True) + copy": lambda: copy_into(
                dest, torch.load(tmp / "model.pt", mmap=True, weights_only=True)
            ),
            "torch.load + copy": lambda: copy_into(
                dest, torch.load(tmp / "model.pt", weights_only=True)
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in loaders}
        rss: dict[str, int] = dict.fromkeys(loaders, 0)
        for fn in loaders.values():  # warm-up: page cache, threads, imports
            fn()
        for r in range(args.rounds):
            for name, fn in loaders.items():
                for t in dest.values():
                    t.zero_()
                with PeakRSS() as meter:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                rss[name] = max(rss[name], meter.above)
            print(
                f"round {r + 1}: "
                + ", ".join(f"{k.split(' ')[0]} {v[-1]:.3f}s" for k, v in times.items()),
                flush=True,
            )
        base = statistics.median(times["torch dcp.load (FileSystemReader)"])
        print(
            f"\n{'loader':<36}{'seconds':>9}{'GiB/s':>8}{'vs dcp.load':>13}{'peak RSS above dest':>21}"
        )
        for name in loaders:
            s = statistics.median(times[name])
            print(
                f"{name:<36}{s:>9.3f}{nbytes / GiB / s:>8.2f}{base / s:>12.2f}x{rss[name] / MiB:>17.0f} MiB"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
