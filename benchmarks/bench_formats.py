"""safetensors and torch.save files: the usual loaders against asyncload, side by side.

Local (warm page cache), interleaved rounds of:

* ``safetensors.torch.load_file`` + ``copy_`` into the destination,
* ``torch.load(mmap=True, weights_only=True)`` + ``copy_`` into the destination,
* ``asyncload.load`` of the same ``model.safetensors`` and of the same ``model.pt``.

Remote (``--remote``, the default when the s3rver program is found): the same two files on a
loopback S3 server (s3rver) behind :class:`asyncload.testing.FaultProxy` in its own process,
adding ``--latency-ms`` one way to every request and response, against:

* the usual "download it, then load it": s3fs ``cat_file`` of the whole object, then
  ``safetensors.torch.load(bytes)`` / ``torch.load(BytesIO)`` + ``copy_``,
* ``asyncload.load`` of the ``s3://`` URLs (ranged reads straight into the destination).

Destinations are made by ``torch.zeros`` (memory already touched). Every asyncload load is
checked bit for bit against the saved tensors. Peak RSS is the high-water mark above the
RSS before the call (``/proc/self/clear_refs``); for ``mmap=True`` it includes the mapped
file pages it touched.

    python benchmarks/bench_formats.py                 # ~1 GiB model
    python benchmarks/bench_formats.py --size-mib 128  # quick
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import measure, nbytes, transformer_state_dict, zeros_like

import asyncload

S3RVER_DEFAULT = os.path.expanduser("~/.cache/asyncload-s3rver/node_modules/.bin/s3rver")


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def copy_into(dest: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    for k, v in dest.items():
        v.copy_(loaded[k])


def check(dest: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], what: str) -> None:
    for k, v in sd.items():
        if not torch.equal(dest[k].view(torch.int16), v.view(torch.int16)):
            raise SystemExit(f"{what}: {k} differs from what was saved")


def run_rounds(
    methods: list[tuple[str, Callable[[], Any]]],
    rounds: int,
    dest: dict[str, torch.Tensor],
    sd: dict[str, torch.Tensor],
) -> dict[str, list[tuple[float, int]]]:
    out: dict[str, list[tuple[float, int]]] = {name: [] for name, _ in methods}
    for r in range(rounds):
        for name, fn in methods:
            for t in dest.values():
                t.zero_()
            gc.collect()
            _trim()  # hand memory the previous method freed back to the OS: RSS deltas then mean what they say
            dt, peak = measure(fn)
            out[name].append((dt, peak))
            if name.startswith("asyncload"):
                check(dest, sd, name)
            print(f"  round {r + 1}: {name:<44} {dt:7.3f} s", flush=True)
    return out


def table(
    title: str, results: dict[str, list[tuple[float, int]]], total: int, ref: str
) -> list[str]:
    """Best and median of the rounds, GiB/s of the best, both ratios to ``ref``, the largest peak RSS."""
    best = {k: min(t for t, _ in v) for k, v in results.items()}
    med = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
    peak = {k: max(p for _, p in v) for k, v in results.items()}
    lines = [
        f"\n{title}",
        (
            f"{'method':<46} {'best s':>7} {'median s':>9} {'GiB/s':>6} {'best/ref':>9} {'median/ref':>11} "
            f"{'peak RSS MiB':>13}"
        ),
    ]
    for name in results:
        lines.append(
            f"{name:<46} {best[name]:7.3f} {med[name]:9.3f} {total / best[name] / (1 << 30):6.2f} "
            f"{best[name] / best[ref]:8.2f}x {med[name] / med[ref]:10.2f}x {peak[name] / (1 << 20):13.0f}"
        )
    lines.append(f"(ref = {ref}; {len(next(iter(results.values())))} interleaved rounds)")
    return lines


def start_proxy(upstream: str, latency: float) -> tuple[subprocess.Popen[str], str]:
    """A FaultProxy in its own process (its relaying must not share our GIL)."""
    code = (
        "import sys, time\n"
        "from asyncload.testing import FaultProxy\n"
        f"p = FaultProxy({upstream!r}, latency={latency!r}, flavor='s3').start()\n"
        "print(p.endpoint_url, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise SystemExit(f"the fault proxy did not start (said {url!r})")
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size-mib", type=int, default=1024, help="model size (bf16), MiB (default 1024)"
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of the local methods"
    )
    ap.add_argument("--remote-rounds", type=int, default=3)
    ap.add_argument(
        "--latency-ms", type=float, default=5.0, help="one-way latency the proxy adds (ms)"
    )
    ap.add_argument("--remote", dest="remote", action="store_true", default=None)
    ap.add_argument("--no-remote", dest="remote", action="store_false")
    ap.add_argument("--s3rver", default=os.environ.get("ASYNCLOAD_S3RVER", S3RVER_DEFAULT))
    ap.add_argument(
        "--workdir", default=None, help="where to write the files (default: a temporary directory)"
    )
    args = ap.parse_args()

    total_target = args.size_mib << 20
    hidden = 2048 if args.size_mib >= 512 else 1024
    print(
        f"making a ~{args.size_mib} MiB bf16 transformer state dict (hidden {hidden}) ...",
        flush=True,
    )
    sd = transformer_state_dict(total_target, hidden=hidden, dtype=torch.bfloat16)
    total = nbytes(sd)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="asyncload-bench-formats-"))
    work.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load as st_load_bytes
    from safetensors.torch import load_file, save_file

    st_path, pt_path = work / "model.safetensors", work / "model.pt"
    save_file(sd, str(st_path))
    torch.save(sd, pt_path)
    print(f"{len(sd)} tensors, {total / (1 << 30):.2f} GiB; files in {work}", flush=True)
    for p in (st_path, pt_path):  # warm page cache
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    dest = zeros_like(sd)
    lines = [
        (
            f"asyncload {asyncload.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; model "
            f"{total / (1 << 30):.2f} GiB bf16 in {len(sd)} tensors; destinations made by torch.zeros"
        )
    ]

    local = [
        ("safetensors.load_file + copy_", lambda: copy_into(dest, load_file(str(st_path)))),
        (
            "torch.load(mmap=True) + copy_",
            lambda: copy_into(dest, torch.load(pt_path, mmap=True, weights_only=True)),
        ),
        ("asyncload.load(model.safetensors)", lambda: asyncload.load(dest, st_path)),
        ("asyncload.load(model.pt)", lambda: asyncload.load(dest, pt_path)),
    ]
    print("local, warm page cache:", flush=True)
    res = run_rounds(local, args.rounds, dest, sd)
    lines += table("local (warm page cache)", res, total, "asyncload.load(model.safetensors)")

    s3rver = Path(args.s3rver) if args.s3rver else None
    remote = args.remote if args.remote is not None else bool(s3rver and s3rver.is_file())
    if remote:
        from asyncload.testing import S3rverServer

        lat = args.latency_ms / 1e3
        with S3rverServer(executable=str(s3rver)) as server:
            st_url = server.put_object("bench", "model.safetensors", st_path.read_bytes())
            pt_url = server.put_object("bench", "model.pt", pt_path.read_bytes())
            proxy, endpoint = start_proxy(server.endpoint_url, lat)
            try:
                opts = server.storage_options(endpoint)
                import s3fs

                fs = s3fs.S3FileSystem(
                    **opts
                )  # one client for every download, like a job would keep

                def cat(url: str) -> bytes:
                    return fs.cat_file(url)

                methods = [
                    (
                        "s3fs cat_file + safetensors.load + copy_",
                        lambda: copy_into(dest, st_load_bytes(cat(st_url))),
                    ),
                    (
                        "s3fs cat_file + torch.load + copy_",
                        lambda: copy_into(
                            dest, torch.load(io.BytesIO(cat(pt_url)), weights_only=True)
                        ),
                    ),
                    (
                        "asyncload.load(s3://.../model.safetensors)",
                        lambda: asyncload.load(dest, st_url, storage_options=opts),
                    ),
                    (
                        "asyncload.load(s3://.../model.pt)",
                        lambda: asyncload.load(dest, pt_url, storage_options=opts),
                    ),
                ]
                print(
                    f"remote: s3rver behind a proxy adding {args.latency_ms} ms each way:",
                    flush=True,
                )
                res = run_rounds(methods, args.remote_rounds, dest, sd)
                lines += table(
                    f"s3rver on loopback, +{args.latency_ms:g} ms each way per request (FaultProxy)",
                    res,
                    total,
                    "asyncload.load(s3://.../model.safetensors)",
                )
            finally:
                proxy.kill()
                proxy.wait()
    else:
        lines.append(
            "\n(remote part skipped: s3rver not found; npm install --prefix ~/.cache/asyncload-s3rver "
            "s3rver@3.7.1, or pass --s3rver PATH)"
        )
    print("\n".join(lines))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(
        __file__,
        {
            "safe-open": "_formats_safe_open.py",
            "torch-checkpointing": "_formats_torch_checkpointing.py",
        },
    )
    t0 = time.monotonic()
    main()
    print(f"\n(benchmark took {time.monotonic() - t0:.0f} s)")
