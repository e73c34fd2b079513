"""Where the CPU of a remote load goes, per transport: one ``asyncload.aload`` (on this thread's loop, so that the profile sees it) of a DCP
checkpoint (one file, ``--size-mib``) from s3rver on loopback, under cProfile, in a fresh
process per transport (imports and a touched destination before the profile); prints CPU
seconds per GiB (``/proc/self/stat`` user + system of the process, all threads) and the
functions with the most own time.

    python benchmarks/profile_transport.py --size-mib 256 --transports wire,obstore,fsspec
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = r"""
import asyncio, cProfile, io, json, os, pstats, sys, time
import torch
import asyncload
cfg = json.loads(sys.argv[1])
from asyncload.testing import configure_env
configure_env()
spec = cfg["spec"]
dest = {k: torch.zeros(s, dtype=getattr(torch, d)) for k, (s, d) in spec.items()}
def cpu():
    with open("/proc/self/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
opts = asyncload.LoadOptions(transport=cfg["transport"])
prof = cProfile.Profile()
c0, t0 = cpu(), time.perf_counter()
prof.enable()
asyncio.run(asyncload.aload(dest, cfg["url"], options=opts, storage_options=cfg["so"]))
prof.disable()
wall, used = time.perf_counter() - t0, cpu() - c0
gib = sum(t.numel() * t.element_size() for t in dest.values()) / (1 << 30)
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(cfg["top"])
print(f"{cfg['transport']}: {wall:.2f} s, {used / gib:.2f} CPU s/GiB (profiled: slower than unprofiled)")
print("\n".join(out.getvalue().splitlines()[6:]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--transports", default="wire,obstore,fsspec")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    from bench_peers import make_tensors, write_layouts
    from bench_remote import find_s3rver

    from asyncload.testing import S3rverServer, configure_env

    configure_env()
    tensors = make_tensors(args.size_mib << 20, 1024)
    spec = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    with open("/proc/loadavg") as f:
        print("load average", " ".join(f.read().split()[:3]))
    with tempfile.TemporaryDirectory() as tmp, S3rverServer(executable=find_s3rver()) as server:
        paths = write_layouts(tensors, Path(tmp), ["dcp-one-file"])
        url = server.upload_dir(paths["dcp-one-file"], "prof", "dcp")
        so = server.storage_options()
        for tr in args.transports.split(","):
            cfg = {"transport": tr, "url": url, "so": so, "spec": spec, "top": args.top}
            env = dict(os.environ, AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
            subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], check=False, env=env)
    with open("/proc/loadavg") as f:
        print("load average", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
