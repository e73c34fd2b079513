"""``asyncload.safe_open(...).get_slice(name)[a:b]`` against safetensors' own ``safe_open``.

    python benchmarks/bench_formats.py --part safe-open [--mib 256] [--rounds 3] [--latency 0.01]

One tensor-parallel rank's share (rank 0 of ``--ranks``, a block of rows) of every tensor of a
safetensors file, the way vLLM's and transformers' sharded loaders read it:

* local file: safetensors' ``safe_open`` (memory map) vs ``asyncload.safe_open``;
* remote file (an HTTP server with Range on 127.0.0.1, behind asyncload's FaultProxy adding
  ``--latency`` seconds per request): download the whole file first (fsspec), then safetensors'
  ``safe_open`` on it, vs ``asyncload.safe_open(url)`` reading only the slices' bytes.

Each contender runs in a fresh process per round (imports outside the clock: torch,
safetensors, and ``from asyncload import safe_open``, whose time is printed apart), contenders
interleaved; the page cache is warmed by reading the file once before the local rounds. Prints
seconds (median), bytes read, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS_LOCAL = ("safetensors-local", "asyncload-local")
CONTENDERS_REMOTE = ("download+safetensors", "asyncload-remote")


def _child(contender: str, where: str, ranks: int) -> dict[str, float]:
    import fsspec
    import torch  # noqa: F401
    from safetensors import safe_open as st_open

    t = time.perf_counter()
    from asyncload import safe_open as al_open  # the face's own imports, timed apart

    face_import = time.perf_counter() - t
    t0 = time.perf_counter()
    total = 0
    read = 0
    if contender in ("safetensors-local", "download+safetensors"):
        path = where
        if contender == "download+safetensors":
            fs = fsspec.filesystem("http")
            fd, path = tempfile.mkstemp(suffix=".safetensors")
            os.close(fd)
            fs.get_file(where, path)
            read = os.path.getsize(path)
        with st_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                s = f.get_slice(name)
                rows = s.get_shape()[0] // ranks
                total += s[0:rows].clone().nbytes  # a copy: the bytes really read
        if contender == "download+safetensors":
            os.unlink(path)
        else:
            read = total  # a memory map touches the slices' pages
    else:
        with al_open(where, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                s = f.get_slice(name)
                rows = s.get_shape()[0] // ranks
                total += s[0:rows].nbytes
            read = f.stats.bytes_read
    return {
        "seconds": time.perf_counter() - t0,
        "bytes": total,
        "read": read,
        "import": face_import if contender.startswith("asyncload") else 0.0,
    }


def _run(contender: str, where: str, ranks: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", contender, where, str(ranks)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _report(results: dict[str, list[dict[str, float]]], base: str) -> None:
    med = {c: statistics.median(r["seconds"] for r in rs) for c, rs in results.items()}
    for c, rs in results.items():
        print(
            f"  {c:22s} {med[c]:7.3f} s (median of {len(rs)})  read {rs[0]['read'] / 2**20:8.1f} MiB"
            f"  slices {rs[0]['bytes'] / 2**20:7.1f} MiB  {med[base] / med[c]:5.2f}x vs {base}"
            f"  (+ {statistics.median(r['import'] for r in rs):.3f} s importing the face)"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--latency", type=float, default=0.01)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from asyncload.testing import FaultProxy, HTTPRangeServer

    with tempfile.TemporaryDirectory() as tmp:
        n = max(1, args.mib // 32)
        g = torch.Generator().manual_seed(0)
        tensors = {f"layers.{i}.weight": torch.randn(4096, 2048, generator=g) for i in range(n)}
        path = Path(tmp) / "model.safetensors"
        save_file(tensors, str(path))
        del tensors
        os.chmod(path, 0o644)
        size = path.stat().st_size
        print(f"file: {size / 2**20:.0f} MiB, {n} tensors; rank 0 of {args.ranks} (rows)")
        path.read_bytes()  # warm page cache
        results: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS_LOCAL}
        for _ in range(args.rounds):
            for c in CONTENDERS_LOCAL:
                results[c].append(_run(c, str(path), args.ranks))
        print("local file (warm page cache):")
        _report(results, CONTENDERS_LOCAL[0])

        server = HTTPRangeServer(Path(tmp) / "www")
        server.start()
        proxy = FaultProxy(server, latency=args.latency).start()
        try:
            server.upload_dir(path.parent, "bench", "m")
            url = server.url("bench", "m/model.safetensors", endpoint_url=proxy.endpoint_url)
            results = {c: [] for c in CONTENDERS_REMOTE}
            for _ in range(args.rounds):
                for c in CONTENDERS_REMOTE:
                    results[c].append(_run(c, url, args.ranks))
            print(f"remote file (HTTP on loopback, +{args.latency * 1000:.0f} ms per request):")
            _report(results, CONTENDERS_REMOTE[0])
        finally:
            proxy.stop()
            server.stop()


if __name__ == "__main__":
    main()
