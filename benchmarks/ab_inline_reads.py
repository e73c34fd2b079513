"""Small local reads on the loop thread (``RWF_NOWAIT``) against an I/O thread hop, one
warmed process, the two alternated load by load (order flipped each round): a one-tensor
checkpoint (where the hop is most of a read) and a transformer-like one of ``--size-mib``.

    python benchmarks/ab_inline_reads.py --rounds 300 --size-mib 0     # the one-tensor checkpoint only
    python benchmarks/ab_inline_reads.py --rounds 30 --size-mib 1024

"hop" sets ``asyncload.storage.local.INLINE_READ`` below every read size, which sends each read
and each batch of probes and small records (``RetryingStorage.read_batch``) to an I/O thread
as before; "inline" is the default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, os.path.dirname(__file__))
import _common as C

import asyncload
from asyncload.storage import local


def ab(path: str, rounds: int) -> None:
    md = dcp.FileSystemReader(path).read_metadata()
    dest = {
        k: torch.zeros(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    default = local.INLINE_READ
    res: dict[str, list[float]] = {"hop": [], "inline": []}
    for _ in range(3):
        asyncload.load(dest, path)
    for r in range(rounds):
        for mode in ("hop", "inline") if r % 2 else ("inline", "hop"):
            local.INLINE_READ = -1 if mode == "hop" else default
            t = time.perf_counter()
            asyncload.load(dest, path)
            res[mode].append(time.perf_counter() - t)
    local.INLINE_READ = default
    wins = sum(b < a for a, b in zip(res["hop"], res["inline"]))
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    print(
        f"{len(dest)} tensors: hop {med['hop']:.3f} ms, inline {med['inline']:.3f} ms (medians of {rounds}); "
        f"inline faster in {wins} of {rounds} rounds"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument(
        "--size-mib",
        type=int,
        default=0,
        help="also a checkpoint of this size (0: only the tiny one)",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    print(
        f"load average (start): {' '.join(f'{x:.2f}' for x in os.getloadavg())}  [{time.strftime('%H:%M:%S')}]"
    )
    with tempfile.TemporaryDirectory(prefix="asyncload-ab-inline-") as tmp:
        tiny = os.path.join(tmp, "tiny")
        dcp.save({"w": torch.arange(16, dtype=torch.float32)}, checkpoint_id=tiny)
        ab(tiny, args.rounds)
        if args.size_mib:
            big = os.path.join(tmp, "big")
            dcp.save(C.transformer_state_dict(args.size_mib << 20), checkpoint_id=big)
            ab(big, max(1, args.rounds // 10))
    print(
        f"load average (end): {' '.join(f'{x:.2f}' for x in os.getloadavg())}  [{time.strftime('%H:%M:%S')}]"
    )


if __name__ == "__main__":
    main()
