"""Several hosts on one machine, for multi-node tests and benchmarks: network namespaces
joined by veth pairs to a bridge, each host's link capped by ``tc tbf`` (both ways).

:func:`hosts` is a context manager (root and ``ip netns`` needed; :func:`available` says
whether they work here, and why not)::

    with hosts(2, rate_mbit=400) as net:       # hosts n0, n1 and a storage host
        net.run("n0", ["ip", "addr"])           # argv inside n0
        net.addr("storage")                    # its private test address

Addresses come from a private test range (``10.77.0.0/24``) and exist only inside the
namespaces made here; the bridge lives in a namespace of its own, so nothing is added to the
machine's own network namespace. Every namespace is deleted on every exit path (the
context's exit, and interpreter exit for one left by a crash of the with-block's caller).

``python -m asyncload.testing.netns --forward LISTEN_ADDR:PORT TARGET_ADDR:PORT``: a small
TCP forwarder (for a loopback-only server inside the storage host, reachable from the
others through it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Net", "available", "hosts"]

#: The private test range; host i gets .(i + 1), the storage host .100.
SUBNET = "10.77.0"
_live: set[str] = set()
_lock = threading.Lock()
_hooked: list[bool] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip reason)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"alprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", name, check=False)


def _delete_all() -> None:
    with _lock:
        names = list(_live)
        _live.clear()
    for n in names:
        _ip("netns", "del", n, check=False)


@dataclass
class Net:
    """The hosts of one :func:`hosts` context: ``names`` (``n0``... and ``storage``) ->
    namespace and address."""

    prefix: str
    rate_mbit: float | None
    names: list[str] = field(default_factory=list)
    _addr: dict[str, str] = field(default_factory=dict)

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return self._addr[host]

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def run(self, host: str, argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), **kw)  # type: ignore[call-overload]

    def popen(self, host: str, argv: Sequence[str], **kw: object) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), **kw)  # type: ignore[call-overload]


def _tbf(ns: str, dev: str, rate_mbit: float, queue_ms: float = 50.0) -> None:
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # about 4 ms at the rate
    _ip(
        "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
        "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{queue_ms:g}ms",
    )  # fmt: skip


@contextmanager
def hosts(
    n: int,
    *,
    rate_mbit: float | None = None,
    storage: bool = True,
    storage_rate_mbit: float | None = None,
    queue_ms: float = 50.0,
) -> Iterator[Net]:
    """``n`` hosts (``n0``...) and, with ``storage``, a ``storage`` host, each with a link of
    ``rate_mbit`` (None: uncapped; the storage host's ``storage_rate_mbit``, by default
    ``rate_mbit``) to one bridge; ``queue_ms``: the most a packet waits in a link's queue
    (``tc tbf latency``: a link busy both ways delays the ACKs of what it receives behind
    what it sends by up to this). Deleted on exit, whatever happens."""
    prefix = f"al{os.getpid() % 100000}x{id(object()) % 1000}"
    net = Net(prefix, rate_mbit)
    names = [f"n{i}" for i in range(n)] + (["storage"] if storage else [])
    with _lock:
        if not _hooked:
            _hooked.append(True)
            atexit.register(_delete_all)
    made: list[str] = []
    try:
        sw = f"{prefix}-sw"
        for ns in [sw] + [net.ns(h) for h in names]:
            with _lock:
                _live.add(ns)
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, h in enumerate(names):
            addr = f"{SUBNET}.{100 if h == 'storage' else i + 1}"
            ns = net.ns(h)
            port = f"p{i}"
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                "netns", sw)  # fmt: skip
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            rate = storage_rate_mbit if h == "storage" and storage_rate_mbit else rate_mbit
            if rate is not None:
                _tbf(ns, "eth0", rate, queue_ms)  # the host's sends
                _tbf(sw, port, rate, queue_ms)  # what it receives
            net.names.append(h)
            net._addr[h] = addr
        yield net
    finally:
        for ns in reversed(made):
            _ip("netns", "del", ns, check=False)
            with _lock:
                _live.discard(ns)


# --- a TCP forwarder (python -m asyncload.testing.netns --forward ...) ---------------------------


def _forward(listen: str, target: str) -> None:
    import asyncio

    lhost, lport = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1 << 18):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            w.close()
            return
        await asyncio.gather(pipe(r, tw), pipe(tr, w))

    async def main() -> None:
        server = await asyncio.start_server(handle, lhost, int(lport))
        print("forwarding", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--forward", nargs=2, metavar=("LISTEN", "TARGET"), required=True)
    a = ap.parse_args()
    _forward(*a.forward)
