"""Child of ``bench_peers.py``: one contender's load, in a fresh process, as a job does it.

    python benchmarks/_peer_child.py '<json config>'

Before the clock: imports (``torch.distributed.checkpoint`` too) and the destination (``torch.zeros``: touched memory). On the
clock: everything the contender does to end with the checkpoint's bytes in the destination
(a loader that returns new tensors pays the copy, as ``load_state_dict`` would). Prints one
line ``RESULT <json>``: seconds, CPU seconds of this process (user + sys, every thread), the
peak RSS above the destination (``VmHWM`` reset just before), and whether the bytes match.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")
cfg: dict[str, Any] = json.loads(sys.argv[1])
for k, v in cfg.get("env", {}).items():
    os.environ[k] = v

import torch

MiB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def _dest() -> dict[str, torch.Tensor]:
    spec = cfg["tensors"]  # name -> [shape, dtype]
    return {k: torch.zeros(tuple(s), dtype=getattr(torch, d)) for k, (s, d) in spec.items()}


def _s3_opts() -> dict[str, Any]:
    return {
        "endpoint_url": cfg["endpoint"],
        "key": "S3RVER",
        "secret": "S3RVER",
        "skip_instance_cache": True,
        "config_kwargs": {"max_pool_connections": 64},
    }


async def _raw_s3fs(files: list[list[Any]]) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(asynchronous=True, **_s3_opts())
    await fs.set_session()
    sem = asyncio.Semaphore(32)

    async def one(key: str, lo: int, hi: int) -> None:
        async with sem:
            data = await fs._cat_file(f"{cfg['bucket']}/{key}", start=lo, end=hi)
            assert len(data) == hi - lo

    await asyncio.gather(
        *(one(k, lo, min(n, lo + 8 * MiB)) for k, n in files for lo in range(0, n, 8 * MiB))
    )
    await fs._s3.close()


async def _raw_obstore(files: list[list[Any]]) -> None:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        cfg["bucket"],
        endpoint=cfg["endpoint"],
        access_key_id="S3RVER",
        secret_access_key="S3RVER",
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    sem = asyncio.Semaphore(32)

    async def one(key: str, lo: int, hi: int) -> None:
        async with sem:
            data = await obstore.get_range_async(store, key, start=lo, end=hi)
            assert len(memoryview(data)) == hi - lo

    await asyncio.gather(
        *(one(k, lo, min(n, lo + 8 * MiB)) for k, n in files for lo in range(0, n, 8 * MiB))
    )


def _curl(files: list[list[Any]]) -> None:
    """curl --parallel with the same ranged GETs (s3rver serves unsigned GETs). Each transfer
    is its own ``--next`` group (curl applies a later ``-r`` to every URL otherwise); the
    bytes each one got are counted and checked."""
    args = ["curl", "--parallel", "--parallel-max", "32"]
    want = 0
    first = True
    for k, n in files:
        for lo in range(0, n, 8 * MiB):
            hi = min(n, lo + 8 * MiB)
            want += hi - lo
            args += [] if first else ["--next"]
            args += [
                "-sS",
                "--fail",
                "-r",
                f"{lo}-{hi - 1}",
                "-o",
                "/dev/null",
                "-w",
                "%{size_download}\n",
            ]
            args.append(f"{cfg['endpoint']}/{cfg['bucket']}/{k}")
            first = False
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    got = sum(int(x) for x in out.stdout.split())
    assert got == want, (got, want)


def run(mode: str, dest: dict[str, torch.Tensor]) -> None:
    url = cfg["url"]
    if mode == "raw_s3fs":
        asyncio.run(_raw_s3fs(cfg["files"]))
    elif mode == "raw_obstore":
        asyncio.run(_raw_obstore(cfg["files"]))
    elif mode == "curl":
        _curl(cfg["files"])
    elif mode.startswith("asyncload"):
        import asyncload

        opts = asyncload.LoadOptions(**cfg.get("options", {}))
        before = set(sys.modules)
        stats = asyncload.load(dest, url, options=opts, storage_options=_s3_opts())
        if os.environ.get("ASYNCLOAD_BENCH_STATS"):  # a diagnosis: LoadStats, imports
            new = len(set(sys.modules) - before)
            with open(os.environ["ASYNCLOAD_BENCH_STATS"], "a") as f:
                f.write(f"{mode} {url}: {stats}; {new} modules imported on the clock\n")
    elif mode == "torch_fsspec":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(dest, storage_reader=FsspecReader(url, **_s3_opts()), no_dist=True)
    elif mode == "s3torchconnector":
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(
            "us-east-1", url, s3client_config=S3ClientConfig(force_path_style=True)
        )
        dcp.load(dest, storage_reader=reader, no_dist=True)
    elif mode == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_file(url)
            for name, tensor in streamer.get_tensors():
                dest[name].copy_(tensor)
    elif mode == "tensorizer":
        from tensorizer import TensorDeserializer

        with TensorDeserializer(url, device="cpu") as tensors:
            for name, tensor in tensors.items():
                dest[name].copy_(tensor)
    else:
        raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    mode = cfg["mode"]
    dest = _dest() if cfg.get("tensors") else {}
    if mode.startswith("asyncload"):
        # imports before the clock, as for every contender (the faces import on first use)
        from asyncload import load  # noqa: F401
    if cfg.get("tensors"):
        # torch's DCP (and what it brings: torch.distributed, torch.fx, sympy) imported
        # outside the clock for every contender that loads tensors: asyncload imports it on
        # a first load's clock since issue 45 item 4's change (seconds on a loaded 2-core
        # machine); what a first load imports is measured by that item's benchmark, this
        # one measures the wire
        importlib.import_module("torch.distributed.checkpoint")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    c0, t0 = _cpu(), time.perf_counter()
    run(mode, dest)
    seconds = time.perf_counter() - t0
    cpu = _cpu() - c0
    peak = _status("VmHWM:") - base
    ok = None
    if dest and cfg.get("check"):
        g = torch.Generator().manual_seed(cfg["check"])
        ok = all(
            torch.equal(t, torch.randn(t.shape, generator=g).to(t.dtype)) for t in dest.values()
        )
    print(
        "RESULT " + json.dumps({"seconds": seconds, "cpu": cpu, "peak": peak, "ok": ok}),
        flush=True,
    )


main()
