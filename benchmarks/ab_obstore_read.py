"""A/B of two asyncload trees on obstore's ranged reads alone: 3 x 256 MiB read as 8 MiB
``ObstoreStorage.read`` calls (8 in flight) from the aiohttp Range server on loopback, each tree in a
fresh child process, alternated round by round; wall and CPU seconds of the reads.

    python benchmarks/ab_obstore_read.py --a /path/to/old/tree --b /path/to/new/tree --rounds 3

Run it from outside both trees (a child's working directory must not hold another ``asyncload``).
Issue 25 measured with it the cost of reading a body as a stream that stops past its length.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import asyncio, concurrent.futures, json, resource, sys, time
import asyncload
from asyncload.storage import open_storage
url = sys.argv[1]
CH, N = 8 << 20, 32
async def main():
    ex = concurrent.futures.ThreadPoolExecutor(2)
    st = open_storage(url, {}, ex, transport="obstore")
    sem = asyncio.Semaphore(8)
    async def one(i):
        async with sem:
            assert len(await st.read("f.bin", i * CH, (i + 1) * CH)) == CH
    await one(0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(3):
        await asyncio.gather(*(one(i) for i in range(N)))
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    await st.aclose()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(json.dumps({"tree": asyncload.__file__, "seconds": round(t, 3), "cpu_s": round(cpu, 3)}))
asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from asyncload.testing.servers import HTTPRangeServer

    with tempfile.TemporaryDirectory() as cwd, HTTPRangeServer() as server:
        server.put_object("b", "f.bin", os.urandom(256 << 20))
        url = server.url("b", "")
        for rnd in range(args.rounds):
            for tree in (args.a, args.b) if rnd % 2 == 0 else (args.b, args.a):
                env = {**os.environ, "PYTHONPATH": tree}
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, url],
                    env=env,
                    cwd=cwd,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                print(rnd, json.dumps(json.loads(out.stdout)), flush=True)


if __name__ == "__main__":
    main()
