"""A/B of two asyncload trees on one remote load: the same s3rver behind the same 10 ms proxy,
the trees alternated round by round (order flipped each round), each load the first in a fresh
child process (imports and destination allocation outside the clock); wall and CPU seconds.

    python benchmarks/ab_remote.py --a /path/to/old/tree --b /path/to/new/tree --rounds 8
    python benchmarks/ab_remote.py --a OLD --b NEW --layout safetensors   # one .safetensors file, its URL

A tree is a directory that holds the ``asyncload`` package (a checkout or a ``git worktree``).
Needs s3rver (``npm install --prefix .s3rver s3rver@3.7.1``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from asyncload.testing import S3rverServer, configure_env

configure_env()
import bench_remote as BR
import torch.distributed.checkpoint as dcp
from _common import transformer_state_dict

CHILD = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["bench"])
from _common import transformer_state_dict, zeros_like
import asyncload
sd = zeros_like(transformer_state_dict(cfg["size"], hidden=1024, seed=1))
opts = asyncload.LoadOptions(chunk_size=8 << 20, concurrency=32)
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
st = asyncload.load(sd, cfg["url"], options=opts, storage_options=cfg["so"])
t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"t": t, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "file": asyncload.__file__}))
"""
ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
ap.add_argument("--a", required=True, help="tree A (directory holding asyncload/)")
ap.add_argument("--b", required=True, help="tree B")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--size-mib", type=int, default=256)
ap.add_argument(
    "--layout",
    choices=["dcp", "safetensors"],
    default="dcp",
    help="dcp: what dcp.save writes, one file per item; safetensors: one .safetensors file, loaded by its URL",
)
args = ap.parse_args()
trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
from _common import ensure_bytecode

for tree in trees.values():  # the fresh children import bytecode, as from an installed package
    ensure_bytecode(os.path.join(tree, "asyncload"))
size = args.size_mib << 20
exe = BR.find_s3rver()
if exe is None:
    sys.exit("s3rver is not installed (npm install --prefix .s3rver s3rver@3.7.1)")
server = S3rverServer(executable=exe)
sd = transformer_state_dict(size, hidden=1024)
res: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
with tempfile.TemporaryDirectory() as tmp, server:
    path = Path(tmp) / "ckpt"
    if args.layout == "safetensors":
        from safetensors.torch import save_file

        path.mkdir()
        save_file(sd, str(path / "model.safetensors"))
        url = server.upload_dir(path, "bench", "st") + "/model.safetensors"
    else:
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False),
            no_dist=True,
        )
        url = server.upload_dir(path, "bench", "ckpt")
    del sd
    proxy = BR.Proxy(server.endpoint_url, 0.010, None)
    so = server.storage_options(endpoint_url=proxy.url)
    try:
        for rnd in range(args.rounds):
            for tag in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                tree = trees[tag]
                env = dict(os.environ, PYTHONPATH=tree)
                cfg = {"url": url, "so": so, "size": size, "bench": str(HERE)}
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, json.dumps(cfg)],
                    env=env,
                    capture_output=True,
                    text=True,
                    cwd="/",
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                assert r["file"].startswith(tree), r
                res[tag].append((r["t"], r["cpu"]))
                print(tag, f"{r['t']:.3f} s, CPU {r['cpu']:.3f} s", flush=True)
    finally:
        proxy.close()
for tag, rows in res.items():
    ts = sorted(x[0] for x in rows)
    cs = sorted(x[1] for x in rows)
    print(
        f"{tag} {trees[tag]}: median {statistics.median(ts):.3f} s (min {ts[0]:.3f}), "
        f"CPU median {statistics.median(cs):.3f} s; load average {os.getloadavg()}"
    )
