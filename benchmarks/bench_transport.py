"""The object-store clients side by side: raw ranged GETs through s3fs, gcsfs, fsspec's HTTP
filesystem and obstore, then ``asyncload.load`` of a DCP checkpoint with
``LoadOptions(transport="fsspec")`` against ``transport="obstore"``.

* **raw** - one object of ``--size-mib``, read as ``--block-mib`` ranged GETs with
  ``--concurrency`` in flight, the data discarded: S3 on s3rver (``find_s3rver`` of
  bench_remote.py; moto without it), GCS on fake-gcs-server, HTTP on the aiohttp Range
  server. obstore is called the way ``ObstoreStorage`` calls it (``get_async`` with a range,
  then ``bytes_async``), s3fs / gcsfs / HTTP the way ``FsspecStorage`` reads (``_cat_file``).
  Each client builds its session and makes one small GET before the clock starts.
* **load** - a checkpoint of the same size written by ``dcp.save`` (one file per item) on
  the same S3 server, loaded into ``torch.zeros`` destinations (allocated before the clock)
  with ``chunk_size=8 MiB``, ``concurrency=32``.

Every contender runs in a fresh child process, contenders interleaved round by round (the
order flipped every other round); wall seconds, GiB/s and CPU seconds per GiB (user + sys
from ``resource.getrusage`` of the child around the reads) are printed per run, then the
medians, with the load average. Timing decides nothing in the tests.

    python benchmarks/bench_transport.py                      # 256 MiB, 3 rounds, raw then load
    python benchmarks/bench_transport.py --size-mib 128 --rounds 5 --part raw
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
from asyncload.testing import GCSServer, HTTPRangeServer, S3rverServer, S3Server, configure_env

configure_env()
import bench_remote as BR
from _common import loadavg

GiB = 1 << 30

_RAW_CHILD = r"""
import asyncio, json, os, resource, sys, time
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
cfg = json.loads(sys.argv[1])
size, block, conc = cfg["size"], cfg["block"], cfg["conc"]

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def fsspec_client():
    if cfg["kind"] == "s3":
        import s3fs
        fs = s3fs.S3FileSystem(asynchronous=True, **cfg["so"])
        path = cfg["path"]
    elif cfg["kind"] == "gcs":
        import gcsfs
        fs = gcsfs.GCSFileSystem(asynchronous=True, **cfg["so"])
        path = cfg["path"]
    else:
        from fsspec.implementations.http import HTTPFileSystem
        fs = HTTPFileSystem(asynchronous=True, **cfg["so"])
        path = cfg["url"]
    await (getattr(fs, "set_session", None) or fs._set_session)()
    async def get(lo, hi):
        return await fs._cat_file(path, start=lo, end=hi)
    return get

async def obstore_client():
    import obstore
    from obstore.store import from_url
    url, _, name = cfg["url"].rpartition("/")
    so = cfg["so"]
    if url.startswith("s3://"):
        conf = {"endpoint": so["endpoint_url"], "access_key_id": so["key"],
                "secret_access_key": so["secret"],
                "region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}
    elif url.startswith(("gs://", "gcs://")):
        conf = {"base_url": so["endpoint_url"], "skip_signature": True}
    else:
        conf = {}
    # asyncload no longer maps options onto obstore (retired in issue 41): built here
    store = from_url(url, config=conf, client_options={"allow_http": True},
                     retry_config={"max_retries": 0})
    async def get(lo, hi):
        r = await obstore.get_async(store, name, options={"range": (lo, hi)})
        return await r.bytes_async()
    return get

async def main():
    get = await (obstore_client() if cfg["client"] == "obstore" else fsspec_client())
    assert len(await get(0, 4096)) == 4096  # session, connection, credentials: before the clock
    sem = asyncio.Semaphore(conc)
    async def one(lo):
        async with sem:
            hi = min(size, lo + block)
            data = await get(lo, hi)
            assert len(data) == hi - lo
    c0, t0 = cpu(), time.perf_counter()
    await asyncio.gather(*(one(lo) for lo in range(0, size, block)))
    return time.perf_counter() - t0, cpu() - c0

t, c = asyncio.run(main())
print(json.dumps({"t": t, "cpu": c}))
"""

_LOAD_CHILD = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["bench"])
from _common import transformer_state_dict, zeros_like
import asyncload
sd = zeros_like(transformer_state_dict(cfg["size"], hidden=1024, seed=1))
opts = asyncload.LoadOptions(chunk_size=8 << 20, concurrency=32, transport=cfg["transport"])
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
st = asyncload.load(sd, cfg["url"], options=opts, storage_options=cfg["so"])
t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"t": t, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "bytes": st.bytes_read}))
"""


def _child(code: str, cfg: dict[str, Any]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True, cwd=HERE
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"child failed ({cfg.get('client') or cfg.get('transport')}, rc {out.returncode}):\n{out.stderr[-3000:]}{out.stdout[-2000:]}"
        )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _rounds(
    contenders: dict[str, tuple[str, dict[str, Any]]], rounds: int, nbytes: int
) -> dict[str, list[Any]]:
    """Each contender once per round in a fresh child, the order flipped every other round."""
    res: dict[str, list[Any]] = {k: [] for k in contenders}
    names = list(contenders)
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            code, cfg = contenders[name]
            r = _child(code, cfg)
            res[name].append((r["t"], r["cpu"]))
            gib = nbytes / GiB
            print(
                f"  round {rnd + 1} {name:<22} {r['t']:.3f} s  {gib / r['t']:.2f} GiB/s  "
                f"{r['cpu'] / gib:.2f} CPU s/GiB",
                flush=True,
            )
    return res


def _table(title: str, res: dict[str, list[Any]], nbytes: int, ref: dict[str, str]) -> None:
    gib = nbytes / GiB
    print(f"\n{title} (medians of {len(next(iter(res.values())))}; load average {loadavg()})")
    print("| contender | seconds | GiB/s | CPU s/GiB | vs its fsspec peer |")
    print("| --- | ---: | ---: | ---: | ---: |")
    med = {
        k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        for k, v in res.items()
    }
    for name, (t, c) in med.items():
        peer = ref.get(name)
        vs = (
            f"{med[peer][0] / t:.2f}x faster, {med[peer][1] / c:.2f}x less CPU"
            if peer in med
            else ""
        )
        print(f"| {name} | {t:.3f} | {gib / t:.2f} | {c / gib:.2f} | {vs} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--block-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--part", choices=["raw", "load", "both"], default="both")
    args = ap.parse_args()
    from _common import ensure_bytecode

    ensure_bytecode()  # the fresh children import bytecode, as from an installed package
    size = args.size_mib << 20
    exe = BR.find_s3rver()
    s3: Any = S3rverServer(executable=exe) if exe is not None else S3Server()
    print(
        f"S3 server: {type(s3).__name__}; {args.size_mib} MiB; load average {loadavg()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp, s3:
        if args.part in ("raw", "both"):
            _raw(args, size, s3, Path(tmp))
        if args.part in ("load", "both"):
            _load(args, size, s3, Path(tmp))


def _raw(args: argparse.Namespace, size: int, s3: Any, tmp: Path) -> None:
    blob = os.urandom(size)
    common = {"size": size, "block": args.block_mib << 20, "conc": args.concurrency}
    contenders: dict[str, tuple[str, dict[str, Any]]] = {}
    s3.put_object("bench", "raw/big.bin", blob)
    s3so = s3.storage_options(config_kwargs={"max_pool_connections": 128})
    for client in ("s3fs", "obstore"):
        cfg = {
            **common,
            "kind": "s3",
            "client": client,
            "so": s3so,
            "url": "s3://bench/raw/big.bin",
        }
        contenders[f"S3 {client}"] = (_RAW_CHILD, {**cfg, "path": "bench/raw/big.bin"})
    gcs = GCSServer()
    http = HTTPRangeServer(tmp / "http")
    with gcs, http:
        gcs.put_object("bench", "raw/big.bin", blob)
        http.put_object("bench", "raw/big.bin", blob)
        for client in ("gcsfs", "obstore"):
            cfg = {
                **common,
                "kind": "gcs",
                "client": client,
                "so": gcs.storage_options(),
                "url": "gs://bench/raw/big.bin",
            }
            contenders[f"GCS {client}"] = (_RAW_CHILD, {**cfg, "path": "bench/raw/big.bin"})
        for client in ("fsspec-http", "obstore"):
            url = http.url("bench", "raw/big.bin")
            cfg = {
                **common,
                "kind": "http",
                "client": client,
                "so": http.storage_options(),
                "url": url,
            }
            contenders[f"HTTP {client}"] = (_RAW_CHILD, cfg)
        del blob
        print(f"raw ranged GETs: {args.block_mib} MiB x {args.concurrency} in flight", flush=True)
        res = _rounds(contenders, args.rounds, size)
    peers = {
        "S3 obstore": "S3 s3fs",
        "GCS obstore": "GCS gcsfs",
        "HTTP obstore": "HTTP fsspec-http",
    }
    _table(
        f"Raw ranged GETs of one {args.size_mib} MiB object, {args.block_mib} MiB x {args.concurrency} in flight",
        res,
        size,
        peers,
    )


def _load(args: argparse.Namespace, size: int, s3: Any, tmp: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from _common import nbytes, transformer_state_dict

    sd = transformer_state_dict(size, hidden=1024, seed=1)
    total = nbytes(sd)
    path = tmp / "ckpt"
    dcp.save(
        sd,
        storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False),
        no_dist=True,
    )
    del sd
    url = s3.upload_dir(path, "bench", "ckpt")
    so = s3.storage_options()
    contenders = {
        f"load transport={t}": (
            _LOAD_CHILD,
            {"url": url, "so": so, "size": size, "bench": str(HERE), "transport": t},
        )
        for t in ("fsspec", "obstore")
    }
    print(
        f"\nasyncload.load of a {total / (1 << 20):.0f} MiB DCP checkpoint (one file per item) on S3",
        flush=True,
    )
    res = _rounds(contenders, args.rounds, total)
    _table("asyncload.load, S3", res, total, {"load transport=obstore": "load transport=fsspec"})


if __name__ == "__main__":
    main()
