"""The cost of ``LoadOptions(verify=True)``: a local ~512 MiB transformer-like DCP
checkpoint (a few large matrices per layer, small norms, an embedding), warm page cache,
loads with verify off and on interleaved, median of ``--repeats`` each.

    python benchmarks/verify_cost.py [--dir /tmp/verify-ckpt] [--repeats 3]

Prints each time, the medians, throughput, the ratio verify-on / verify-off, and, for
reference, zlib.crc32's own speed on this machine (one thread, 512 MiB in memory).
With ISA-L installed (``pip install isal``: asyncload uses its crc32 then), verify=True is
also measured with zlib's crc32 in its place, for the figure without it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import asyncload
import asyncload.engine.crc as crc_module

MiB = 1 << 20


def make_state(layers: int = 8, hidden: int = 1024, vocab: int = 32000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            sd[p + f"attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g)
        sd[p + "mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        sd[p + "mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=g)
        sd[p + "norm1.weight"] = torch.randn(hidden, generator=g)
        sd[p + "norm2.weight"] = torch.randn(hidden, generator=g)
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dir", type=Path, default=None, help="checkpoint directory (written if missing)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "ckpt"
    sd = make_state()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    if not (path / ".metadata").exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=path, no_dist=True)
    for f in path.iterdir():  # warm the page cache
        f.read_bytes()
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # touched memory
    del sd

    impls = {"off": None, f"on ({crc_module.CRC32_IMPL})": crc_module.crc32}
    if crc_module.CRC32_IMPL != "zlib":
        impls["on (zlib)"] = zlib.crc32
    times: dict[str, list[float]] = {k: [] for k in impls}
    verified = 0
    default = crc_module.crc32
    for _ in range(args.repeats):
        for label, impl in impls.items():
            crc_module.crc32 = impl or default
            t0 = time.perf_counter()
            stats = asyncload.load(
                dest, path, options=asyncload.LoadOptions(verify=impl is not None)
            )
            times[label].append(time.perf_counter() - t0)
            if impl is not None:
                verified = stats.verified_records
    crc_module.crc32 = default
    buf = bytearray(512 * MiB)
    t0 = time.perf_counter()
    zlib.crc32(buf)
    crc_speed = len(buf) / (time.perf_counter() - t0)

    print(
        f"checkpoint: {nbytes / MiB:.0f} MiB in {len(dest)} tensors, {path}; {verified} records verified"
    )
    off = statistics.median(times["off"])
    for label, ts in times.items():
        med = statistics.median(ts)
        print(
            f"verify {label:12s}: {', '.join(f'{t:.3f}' for t in ts)} s -> median {med:.3f} s "
            f"({nbytes / med / (1 << 30):.2f} GiB/s), {med / off:.2f}x the time of verify=False"
        )
    print(f"zlib.crc32 alone, one thread: {crc_speed / (1 << 30):.2f} GiB/s")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
