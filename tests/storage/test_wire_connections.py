"""Connection hygiene of the wire transport (:mod:`asyncload.storage.wire_http`): a pooled
keep-alive connection that received anything while idle (a late duplicate answer, a body after
a HEAD, 204 or 304 in a packet of its own) is closed and never reused, so an answer is read
only from a connection whose previous answer was read whole. Against the HTTP Range server
behind the fault proxy's :func:`~asyncload.testing.faults.trailing` (bytes nothing asked for,
after the answer) and a scripted server on loopback: ``safe_open(...).get_tensor()``,
``load`` and the store's own reads return the saved bytes, never the forged zeros.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import select
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import asyncload
from asyncload import LoadOptions
from asyncload.storage.factory import open_storage
from asyncload.storage.wire import WireStorage
from asyncload.storage.wire_http import Pool
from asyncload.testing import faults

pytestmark = pytest.mark.timeout(120)

OPTS = LoadOptions(transport="wire", retries=0)


def _saved(path: Path) -> tuple[dict[str, torch.Tensor], int, int]:
    """A safetensors file of ``x = arange(64)`` (after a 1 KiB pad); the byte range of ``x``."""
    tensors = {"pad": torch.ones(256, dtype=torch.float32), "x": torch.arange(64.0)}
    save_file(tensors, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    lo, hi = json.loads(raw[8 : 8 + n])["x"]["data_offsets"]
    return tensors, 8 + n + lo, 8 + n + hi


def _forged(path: Path, start: int, end: int) -> bytes:
    """A 206 answer of zeros for ``[start, end)`` of ``path`` with the version the Range
    server gives it: what a connection must never take for the answer to its next request."""
    st = path.stat()
    etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
    head = (
        "HTTP/1.1 206 Partial Content\r\n"
        f"Content-Range: bytes {start}-{end - 1}/{st.st_size}\r\n"
        f"Content-Length: {end - start}\r\nETag: {etag}\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode() + bytes(end - start)


def _wait_sent(proxy: faults.FaultProxy, n: int = 1) -> None:
    """Until the proxy wrote its ``n``-th trailing bytes (a bound, not a timing assertion)."""
    deadline = time.monotonic() + 10
    while proxy.trailing_sent < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.trailing_sent >= n
    time.sleep(0.05)  # the bytes are in the client's socket (loopback delivers on send)


@pytest.fixture
def served(http_server, fault_proxy, bucket_name, tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    tensors, start, end = _saved(d / "model.safetensors")
    http_server.upload_dir(d, bucket_name, "ckpt")
    on_disk = http_server.root / bucket_name / "ckpt" / "model.safetensors"
    proxy = fault_proxy(http_server)
    url = http_server.url(bucket_name, "ckpt/model.safetensors", endpoint_url=proxy.endpoint_url)
    return tensors, url, proxy, _forged(on_disk, start, end), (start, end)


def test_a_late_duplicate_answer_is_never_read_as_the_next_one(served):
    """The header's GET is answered, then a forged 206 of zeros follows in a packet of its own
    on the kept-alive connection; ``get_tensor`` asks again and must get ``arange(64)``."""
    tensors, url, proxy, forged, _ = served
    rule = proxy.add_rule(faults.trailing(forged), method="GET")
    with asyncload.safe_open(url, options=OPTS) as f:
        assert rule.fired == 1
        _wait_sent(proxy)
        got = f.get_tensor("x")
        assert torch.equal(got, tensors["x"])
        assert torch.equal(f.get_tensor("pad"), tensors["pad"])
    # the poisoned connection was closed, the tensor read on a new one
    assert proxy.connections_accepted >= 2


def test_a_load_after_a_late_answer_gets_the_saved_bytes(served, http_server, bucket_name):
    """``load`` reads the header (one GET), then every tensor's bytes in one ranged GET: a
    forged answer of zeros for that range follows the header's answer at once."""
    tensors, url, proxy, _, _ = served
    on_disk = http_server.root / bucket_name / "ckpt" / "model.safetensors"
    raw = on_disk.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    proxy.add_rule(faults.trailing(_forged(on_disk, 8 + n, len(raw)), after=0.0), method="GET")
    dst = {k: torch.zeros_like(v) for k, v in tensors.items()}
    asyncload.load(dst, url, options=OPTS)
    assert all(torch.equal(dst[k], tensors[k]) for k in tensors)


def test_a_body_after_a_head_is_never_read_as_the_next_answer(served):
    tensors, url, proxy, forged, (start, end) = served
    proxy.add_rule(faults.trailing(forged), method="HEAD")
    base, name = url.rsplit("/", 1)
    want = tensors["x"].numpy().tobytes()
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        st = open_storage(base, {}, executor, transport="wire")
        assert isinstance(st, WireStorage)

        async def go() -> bytes:
            try:
                assert await st.size(name) > len(want)  # a HEAD
                await asyncio.to_thread(_wait_sent, proxy)
                return bytes(await st.read(name, start, end))
            finally:
                await st.aclose()

        assert asyncio.run(go()) == want


@pytest.mark.parametrize("status", [204, 304, "HEAD"])
def test_a_pooled_connection_that_received_bytes_while_idle_is_closed(status):
    """A scripted server answers the first request (a 204, a 304, or a HEAD), then sends a
    whole forged answer in a packet of its own; it answers later requests, on any connection,
    with ``good``. The pool must read ``good`` for the second request, on a new connection."""
    good, bad = b"arange", b"zeros!"

    async def go() -> tuple[bytes, int]:
        first_done = asyncio.Event()
        late_sent = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    if not first_done.is_set():
                        first_done.set()
                        code = 200 if status == "HEAD" else status
                        length = "Content-Length: 6\r\n" if status == "HEAD" else ""
                        writer.write(f"HTTP/1.1 {code} X\r\n{length}\r\n".encode())
                        await writer.drain()
                        await asyncio.sleep(0.05)
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n" + bad)
                        await writer.drain()
                        late_sent.set()
                        continue
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n" + good)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool("http", "127.0.0.1", port, None)
        try:
            method = "HEAD" if status == "HEAD" else "GET"
            resp = await pool.request(method, "/a", {}, "http://x/a")
            assert await resp.read(100) == b""
            await late_sent.wait()
            await asyncio.sleep(0.05)
            resp = await pool.request("GET", "/b", {}, "http://x/b")
            body = bytes(await resp.read(100))
            return body, pool.opened
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()

    body, opened = asyncio.run(go())
    assert body == good
    assert opened == 2


def test_bytes_still_in_the_socket_when_a_connection_is_taken_close_it():
    """The forged answer is in the socket but the loop has not run since: the pool asks the
    socket itself before it sends on an idle connection."""

    async def go() -> tuple[bytes, int]:
        writers: list[asyncio.StreamWriter] = []
        answers = [0]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    answers[0] += 1
                    if answers[0] == 1:
                        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                    else:
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool("http", "127.0.0.1", port, None)
        try:
            resp = await pool.request("GET", "/a", {}, "http://x/a")
            assert resp.status == 204 and await resp.read(100) == b""
            (conn,) = pool._idle
            assert conn.transport is not None
            sock: Any = conn.transport.get_extra_info("socket")
            # a forged answer reaches the socket; the loop does not run before the next send
            writers[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nbad!")
            assert select.select([sock.fileno()], [], [], 5)[0]
            resp = await pool.request("GET", "/b", {}, "http://x/b")
            return bytes(await resp.read(100)), pool.opened
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()

    body, opened = asyncio.run(go())
    assert body == b"good"
    assert opened == 2
