"""Remote loads side by side: an S3-protocol server on loopback behind the FaultProxy.

One run compares, on the same checkpoint (torch's ``dcp.save``, one file per item):

* **raw bound** - s3fs ranged reads of the same ``.distcp`` bytes, 8 MiB each, 32 in
  flight, nothing assembled (what the store and link can give);
* **torch** - ``dcp.load`` with torch's ``FsspecReader``;
* **asyncload** - ``asyncload.load`` (fixed concurrency and ``"auto"``);
* **stragglers** - the first two tensor-data requests stall for 5 s (asyncload and torch).

Settings: the proxy adds ``--latency`` seconds each way (10 ms: +20 ms per request), then
the same with a ``--bandwidth-mib`` cap. The proxy runs in its own process (its own GIL).
The server is s3rver when installed (``npm install --prefix .s3rver s3rver@3.7.1``; found in
``.s3rver/``, ``$ASYNCLOAD_S3RVER`` or on PATH), else moto (slower per request: it reads the
whole object for every ranged GET, so files are kept at 16 MiB or less).

    python benchmarks/bench_remote.py                       # 256 MiB, 10 ms, then 10 ms + 100 MiB/s
    python benchmarks/bench_remote.py --size-mib 512 --server moto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncload.testing import S3rverServer, S3Server, configure_env

configure_env()

import torch
import torch.distributed.checkpoint as dcp
from _common import nbytes, transformer_state_dict

import asyncload

warnings.filterwarnings("ignore")
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]

_PROXY_CHILD = r"""
import json, sys
from asyncload.testing import FaultProxy, stall
cfg = json.loads(sys.argv[1])
p = FaultProxy(cfg["upstream"], flavor="s3", latency=cfg["latency"], bandwidth=cfg["bandwidth"]).start()
if cfg["stalls"]:
    p.add_rule(stall(cfg["stall_s"]), times=cfg["stalls"], path=".distcp", range_only=True, data_only=True)
print(p.port, flush=True)
sys.stdin.read()
p.stop()
"""


class Proxy:
    """A FaultProxy in a child process (so its relaying does not compete for our GIL)."""

    def __init__(
        self,
        upstream: str,
        latency: float,
        bandwidth: float | None,
        stalls: int = 0,
        stall_s: float = 5.0,
    ) -> None:
        cfg = {
            "upstream": upstream,
            "latency": latency,
            "bandwidth": bandwidth,
            "stalls": stalls,
            "stall_s": stall_s,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROXY_CHILD, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def find_s3rver() -> str | None:
    local = REPO / ".s3rver" / "node_modules" / ".bin" / "s3rver"
    return S3rverServer.find_executable(str(local) if local.exists() else None)


_SESSION: list[Any] = []


async def raw_bound(
    url: str, so: dict[str, Any], files: list[tuple[str, int]], block: int, conc: int
) -> None:
    import aiobotocore.session
    import s3fs

    if (
        not _SESSION
    ):  # reused across runs, as asyncload reuses its own: no service-model parsing per run
        _SESSION.append(aiobotocore.session.AioSession())
    fs = s3fs.S3FileSystem(asynchronous=True, session=_SESSION[0], **so)
    await fs.set_session()
    sem = asyncio.Semaphore(conc)
    base = url[len("s3://") :].rstrip("/")

    async def one(name: str, lo: int, hi: int) -> None:
        async with sem:
            data = await fs._cat_file(f"{base}/{name}", start=lo, end=hi)
            assert len(data) == hi - lo

    try:
        await asyncio.gather(
            *(
                one(n, lo, min(size, lo + block))
                for n, size in files
                for lo in range(0, size, block)
            )
        )
    finally:
        creator = getattr(fs, "_s3creator", None)
        if creator is not None:
            await creator.__aexit__(None, None, None)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_setting(
    label: str,
    server: Any,
    url: str,
    sd: dict[str, torch.Tensor],
    files: list[tuple[str, int]],
    args: argparse.Namespace,
    bandwidth: float | None,
    straggle: bool,
) -> list[tuple[str, float]]:
    data_bytes = sum(s for _, s in files)
    opts = asyncload.LoadOptions(chunk_size=args.chunk_mib * MiB, concurrency=args.concurrency)
    rows: list[tuple[str, float]] = []
    #: row name -> LoadStats.hedges of each asyncload run (hedges must stay ~0 without stalls)
    hedges: dict[str, list[int]] = {}

    def with_proxy(stalls: int, fn: Callable[[dict[str, Any]], Any]) -> float:
        proxy = Proxy(server.endpoint_url, args.latency, bandwidth, stalls)
        try:
            so = server.storage_options(endpoint_url=proxy.url)
            return timed(lambda: fn(so))
        finally:
            proxy.close()

    dst = {k: torch.zeros_like(v) for k, v in sd.items()}

    def torch_load(so: dict[str, Any]) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(dst, storage_reader=FsspecReader(url, **so), no_dist=True)

    def al_load(options: asyncload.LoadOptions, row: str) -> Callable[[dict[str, Any]], Any]:
        def go(so: dict[str, Any]) -> None:
            stats = asyncload.load(dst, url, options=options, storage_options=so)
            hedges.setdefault(row, []).append(stats.hedges)

        return go

    for _r in range(args.rounds):
        rows.append(
            (
                "raw bound (s3fs 8 MiB x 32)",
                with_proxy(0, lambda so: asyncio.run(raw_bound(url, so, files, 8 * MiB, 32))),
            )
        )
        rows.append(("torch dcp.load + FsspecReader", with_proxy(0, torch_load)))
        name = f"asyncload concurrency={args.concurrency}"
        rows.append((name, with_proxy(0, al_load(opts, name))))
        for k in sd:
            assert torch.equal(dst[k], sd[k]), k
        name = "asyncload concurrency=auto"
        rows.append((name, with_proxy(0, al_load(opts.replace(concurrency="auto"), name))))
        if straggle:
            name = f"asyncload concurrency={args.concurrency}, 2 stalls of 5 s"
            rows.append((name, with_proxy(2, al_load(opts, name))))
            name = "asyncload concurrency=auto, 2 stalls of 5 s"
            rows.append((name, with_proxy(2, al_load(opts.replace(concurrency="auto"), name))))
            if not args.skip_torch_stall:
                rows.append(
                    ("torch dcp.load + FsspecReader, 2 stalls of 5 s", with_proxy(2, torch_load))
                )
    # report: median per row name
    by: dict[str, list[float]] = {}
    for name, t in rows:
        by.setdefault(name, []).append(t)
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    raw = med["raw bound (s3fs 8 MiB x 32)"]
    clean = {
        "asyncload": med[f"asyncload concurrency={args.concurrency}"],
        "asyncload auto": med["asyncload concurrency=auto"],
        "torch": med["torch dcp.load + FsspecReader"],
    }
    print(
        f"\n== {label}: {data_bytes / MiB:.0f} MiB of .distcp data in {len(files)} files (median of {args.rounds}) =="
    )
    print(f"{'':52s} {'seconds':>8s} {'MiB/s':>8s} {'x raw':>6s}  note")
    for name, t in med.items():
        note = ""
        if "stalls" in name:
            ref = (
                clean["torch"]
                if name.startswith("torch")
                else clean["asyncload auto" if "auto" in name else "asyncload"]
            )
            note = f"{t / ref:.2f}x its clean run"
        if name in hedges:
            note = (note + "; " if note else "") + f"hedges {hedges[name]}"
        print(f"{name:52s} {t:8.2f} {data_bytes / MiB / t:8.1f} {raw / t:6.2f}  {note}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument(
        "--hidden", type=int, default=1024, help="model width (matrices of 4-16 MiB at 1024)"
    )
    ap.add_argument(
        "--latency", type=float, default=0.010, help="one-way delay added by the proxy, seconds"
    )
    ap.add_argument(
        "--bandwidth-mib", type=float, default=100.0, help="cap of the second setting (0: skip it)"
    )
    ap.add_argument("--server", choices=("auto", "s3rver", "moto"), default="auto")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip-torch-stall", action="store_true", help="skip torch's straggler run")
    args = ap.parse_args()

    exe = find_s3rver() if args.server in ("auto", "s3rver") else None
    if args.server == "s3rver" and exe is None:
        sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
    server = S3rverServer(executable=exe) if exe else S3Server()
    sd = transformer_state_dict(args.size_mib * MiB, hidden=args.hidden)
    with tempfile.TemporaryDirectory(prefix="asyncload-bench-remote-") as tmp, server:
        path = Path(tmp) / "ckpt"
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False),
            no_dist=True,
        )
        files = sorted((p.name, p.stat().st_size) for p in path.glob("*.distcp"))
        url = server.upload_dir(path, "bench", "ckpt")
        print(
            f"server: {type(server).__name__} ({'s3rver' if exe else 'moto'}), checkpoint {nbytes(sd) / MiB:.0f} MiB "
            f"of tensors, {len(files)} .distcp files up to {max(s for _, s in files) / MiB:.1f} MiB; "
            f"torch {torch.__version__}, asyncload {asyncload.__version__}, {os.cpu_count()} CPUs"
        )
        run_setting(
            f"{args.latency * 1e3:.0f} ms one-way delay", server, url, sd, files, args, None, True
        )
        if args.bandwidth_mib > 0:
            run_setting(
                f"{args.latency * 1e3:.0f} ms one-way delay, {args.bandwidth_mib:.0f} MiB/s cap",
                server,
                url,
                sd,
                files,
                args,
                args.bandwidth_mib * MiB,
                False,
            )


if __name__ == "__main__":
    from _parts import run_part  # --part NAME: a folded-in part (benchmarks/README.md)

    run_part(__file__, {"concurrency": "_remote_concurrency.py"})
    main()
