"""Narrow reads: bytes read per rank against the bytes it needs.

A single-process checkpoint (tiny ~1 MiB, large ~64 MiB) loaded as rank r of 4 would load
a ``Shard(0)`` (rows) or ``Shard(1)`` (columns) slice of every tensor, from local disk and
over HTTP on loopback (asyncload's aiohttp Range server). Each case runs with the default
bound (``max_over_read_ratio=1.15``) and without it (``None``: the ``min_chunk_size`` rule
alone, what the library did before). Every slice is checked bit for bit; the seconds are
information only (one load each, this machine shared), the bytes are the result::

    python benchmarks/bench_distributed.py --part narrow [--ranks 0,3] [--sizes tiny,large]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine"))

from test_narrow_reads import large_model, load_shard, save, tiny_model

from asyncload import LoadOptions
from asyncload.testing.servers import HTTPRangeServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="0,3", help="ranks of 4 to load (comma-separated)")
    ap.add_argument("--sizes", default="tiny,large")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    models = {"tiny": tiny_model, "large": large_model}
    with tempfile.TemporaryDirectory() as tmp, HTTPRangeServer() as http:
        print(
            f"{'checkpoint':<8} {'shard':<8} {'store':<6} {'bound':<6} {'rank':>4} "
            f"{'needed KiB':>11} {'read KiB':>11} {'ratio':>6} {'requests':>8} {'seconds':>8}"
        )
        for size in args.sizes.split(","):
            full = models[size]()
            path = save(Path(tmp) / size, full)
            http.upload_dir(path, "b", size)
            stores = {"local": str(path), "http": http.url("b", size)}
            for dim, shard in ((0, "rows"), (1, "columns")):
                for store, url in stores.items():
                    for bound in (1.15, None):
                        opts = LoadOptions(max_over_read_ratio=bound)
                        for rank in ranks:
                            t0 = time.perf_counter()
                            stats, needed = load_shard(url, full, dim, rank, 4, opts)
                            dt = time.perf_counter() - t0
                            print(
                                f"{size:<8} {shard:<8} {store:<6} {bound!s:<6} {rank:>4} {needed / 1024:>11.1f} "
                                f"{stats.bytes_read / 1024:>11.1f} {stats.bytes_read / needed:>6.3f} "
                                f"{stats.chunks:>8} {dt:>8.3f}"
                            )
        print("every slice loaded bit for bit: ok")


if __name__ == "__main__":
    main()
