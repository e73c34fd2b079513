"""What the multi-node test bed delivers without asyncload (issue 29 item 3): the same bytes
as ``bench_multinode.py``'s replicated layout, moved by plain processes over the same
network namespaces and ``tc tbf`` links, so the library's figures can be set beside the
machine's.

N nodes x R processes (no torch, no gloo, no store): the checkpoint (one file of
``--size-mib`` random bytes, served by the same HTTP range server and forwarder as the bench)
is cut into blocks of ``--block-kib``; block ``i`` is read from storage by node ``i % N``
(process ``(i // N) % R`` of it) with a plain HTTP/1.1 ranged GET on a kept-alive
connection, and sent over a raw TCP connection (opened before the clock) to the process of
the same local index on every other node: the static split, every byte entering each node
once. ``--inflight``: reads in flight per process (0: all at once, as the static plan does).
All processes start at one wall-clock instant (one machine, one clock); wall = the last
process's end minus the start. Prints bound / wall, as the bench does, and CPU seconds.

Run (root, iproute2):
  python benchmarks/bench_multinode.py --part raw --nodes 4 --per-node 2 --size-mib 32 --rate-mbit 100
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
HTTP_PORT, FWD_PORT, PEER_PORT = 18000, 18080, 19000


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
               path: str, a: int, b: int) -> bytes:  # fmt: skip
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={a}-{b - 1}\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    return await reader.readexactly(n)


async def worker(a: argparse.Namespace) -> None:
    n, r, k, j = a.nodes, a.per_node, a.node, a.local
    blocks = [(i * a.block, min(a.size, (i + 1) * a.block)) for i in range(-(-a.size // a.block))]
    mine = [i for i in range(len(blocks)) if i % n == k and (i // n) % r == j]
    from_peers = [i for i in range(len(blocks)) if i % n != k and (i // n) % r == j]
    got: dict[int, bytes] = {}
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while len(got) < len(mine) + len(from_peers):
            try:
                hdr = await reader.readexactly(12)
            except (asyncio.IncompleteReadError, asyncio.CancelledError):
                break
            i, ln = int.from_bytes(hdr[:4], "little"), int.from_bytes(hdr[4:], "little")
            got[i] = await reader.readexactly(ln)
            if len(got) == len(mine) + len(from_peers):
                done.set()

    server = await asyncio.start_server(serve, a.addr[k], PEER_PORT + j)
    await asyncio.sleep(max(0.0, a.start - 1.5 - time.time()))
    peers = []
    for m in range(n):
        if m != k:
            for _ in range(20):
                try:
                    peers.append(await asyncio.open_connection(a.addr[m], PEER_PORT + j))
                    break
                except OSError:
                    await asyncio.sleep(0.05)
    slots = len(mine) if a.inflight <= 0 else a.inflight
    conns = [await asyncio.open_connection(a.storage, FWD_PORT) for _ in range(max(1, slots))]
    free: asyncio.Queue = asyncio.Queue()
    for c in conns:
        free.put_nowait(c)
    locks = [asyncio.Lock() for _ in peers]
    await asyncio.sleep(max(0.0, a.start - time.time()))
    c0 = time.process_time()

    async def one(i: int) -> None:
        rd, wr = await free.get()
        s, e = blocks[i]
        data = await _get(rd, wr, a.storage, "/blob", s, e)
        free.put_nowait((rd, wr))
        got[i] = data
        hdr = i.to_bytes(4, "little") + len(data).to_bytes(8, "little")

        async def send(lock: asyncio.Lock, pw: asyncio.StreamWriter) -> None:
            async with lock:
                pw.write(hdr + data)
                await pw.drain()

        await asyncio.gather(*(send(lock, pw) for lock, (_, pw) in zip(locks, peers)))
        if len(got) == len(mine) + len(from_peers):
            done.set()

    await asyncio.gather(*(one(i) for i in mine))
    if len(got) < len(mine) + len(from_peers):
        await done.wait()
    end = time.time()
    cpu = time.process_time() - c0
    ok = all(got[i] == a.expect[blocks[i][0] : blocks[i][1]] for i in got)
    print(json.dumps({"node": k, "local": j, "end": end, "cpu": cpu, "ok": ok,
                      "read": sum(blocks[i][1] - blocks[i][0] for i in mine)}), flush=True)  # fmt: skip
    for _, pw in peers:
        pw.close()
    server.close()
    await asyncio.sleep(0.2)  # the peers' last reads finish before the loop closes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--node", type=int, default=0)
    ap.add_argument("--local", type=int, default=0)
    ap.add_argument("--addrs", default="")
    ap.add_argument("--storage-addr", default="")
    ap.add_argument("--blob", default="")
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--queue-ms", type=float, default=50.0)
    ap.add_argument("--inflight", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    a.size, a.block = a.size_mib * MiB, a.block_kib * 1024
    if a.worker:
        a.addr, a.storage = a.addrs.split(","), a.storage_addr
        with open(a.blob, "rb") as f:
            a.expect = f.read()
        asyncio.run(worker(a))
        return
    from asyncload.testing.netns import hosts

    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().strip()}", flush=True)
    root = tempfile.mkdtemp(prefix="asyncload-raw-")
    blob = os.path.join(root, "blob")
    with open(blob, "wb") as f:
        f.write(os.urandom(a.size))
    storage_mbit = a.nodes * a.rate_mbit
    rate = a.rate_mbit * 1e6 / 8
    bound = max(a.size / rate, a.size / (storage_mbit * 1e6 / 8))
    with hosts(a.nodes, rate_mbit=a.rate_mbit, storage_rate_mbit=storage_mbit,
               queue_ms=a.queue_ms) as net:  # fmt: skip
        st = net.addr("storage")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        servers = [
            net.popen("storage", [sys.executable, "-P", str(ROOT / "asyncload/testing/_serve.py"),
                                  "--http-range-server", "--root", root, "--port",
                                  str(HTTP_PORT)], env=env),
            net.popen("storage", [sys.executable, "-m", "asyncload.testing.netns", "--forward",
                                  f"{st}:{FWD_PORT}", f"127.0.0.1:{HTTP_PORT}"], env=env),
        ]  # fmt: skip
        try:
            time.sleep(2.0)
            addrs = ",".join(net.addr(f"n{k}") for k in range(a.nodes))
            for rnd in range(a.rounds):
                start = time.time() + 3.0
                procs = [
                    net.popen(f"n{k}", [sys.executable, __file__, "--worker", "--node", str(k),
                                        "--local", str(j), "--addrs", addrs, "--storage-addr", st,
                                        "--blob", blob, "--start", str(start),
                                        "--nodes", str(a.nodes), "--per-node", str(a.per_node),
                                        "--size-mib", str(a.size_mib), "--block-kib",
                                        str(a.block_kib), "--inflight", str(a.inflight)],
                              env=env, stdout=subprocess.PIPE, text=True)
                    for k in range(a.nodes) for j in range(a.per_node)
                ]  # fmt: skip
                rows = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
                wall = max(r["end"] for r in rows) - start
                print(
                    f"{a.nodes} nodes x {a.per_node} processes, {a.size_mib} MiB, links "
                    f"{a.rate_mbit:g} Mbit/s, blocks {a.block_kib} KiB, inflight "
                    f"{a.inflight or 'all'}: round {rnd} wall {wall:.2f} s bound {bound:.2f} s "
                    f"bound/wall {bound / wall:.2f} cpu {sum(r['cpu'] for r in rows):.2f} s "
                    f"ok {all(r['ok'] for r in rows)}",
                    flush=True,
                )
        finally:
            for p in servers:
                p.terminate()
                p.wait()
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().strip()}")


if __name__ == "__main__":
    main()
