"""Tests of asyncload.testing: the loopback storage servers and the fault proxy.

Every server is real (child process on 127.0.0.1) and every client is a real
one (s3fs, gcsfs, fsspec's HTTP filesystem, aiohttp, raw sockets), so these
tests also pin down how those clients behave against the servers.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

# The fixtures s3_server, gcs_server, http_server, fault_proxy and bucket_name
# come from asyncload.testing.pytest_fixtures, imported by tests/conftest.py.
from asyncload.testing import configure_env

configure_env()  # before gcsfs is imported

import aiohttp
import fsspec
import gcsfs
import s3fs
from fsspec.implementations.http import HTTPFileSystem

from asyncload.testing import (
    FaultProxy,
    GCSServer,
    HTTPRangeServer,
    LoopbackServer,
    RangeNotSatisfiable,
    S3rverServer,
    S3Server,
    ServerNotAvailableError,
    ServerNotRunningError,
    ServerStartError,
    aclose_filesystem,
    close_filesystem,
    delay,
    parse_byte_range,
    reset,
    stall,
    status,
    trickle,
    truncate,
)

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
MakeProxy = Callable[..., FaultProxy]

A = random.Random(1).randbytes(300 * 1024 + 7)  # a.bin
B = random.Random(2).randbytes(64 * 1024)  # sub/b.bin
SMALL = b"0123456789" * 10  # small.txt
RANGES = [(0, 1), (0, 100), (1000, 5000), (len(A) - 10, len(A)), (4096, len(A)), (123, 124)]


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie counts: it would be a leak too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def payload_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("payload")
    (root / "sub").mkdir()
    (root / "a.bin").write_bytes(A)
    (root / "sub" / "b.bin").write_bytes(B)
    (root / "small.txt").write_bytes(SMALL)
    return root


@pytest.fixture(scope="module")
def http_files(http_server: HTTPRangeServer, payload_dir: Path) -> str:
    """Base url of the payload on the HTTP server."""
    return http_server.upload_dir(payload_dir, "faults", "")


@pytest.fixture
def closing() -> Iterator[Callable[[T], T]]:
    """``closing(fs)`` returns ``fs`` and closes its session when the test ends."""
    made: list[Any] = []

    def keep(fs: T) -> T:
        made.append(fs)
        return fs

    yield keep
    for fs in made:
        close_filesystem(fs)


# ---------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("server_name", ["s3_server", "gcs_server", "http_server"])
def test_server_serves_exact_ranges(
    server_name: str,
    request: pytest.FixtureRequest,
    payload_dir: Path,
    closing: Callable[[Any], Any],
) -> None:
    server: LoopbackServer = request.getfixturevalue(server_name)
    url = server.upload_dir(payload_dir, "roundtrip", "run1/")
    expected_prefix = {"s3": "s3://roundtrip/run1", "gs": "gs://roundtrip/run1"}.get(
        server.protocol, f"{server.endpoint_url}/roundtrip/run1"
    )
    assert url == expected_prefix

    fs = closing(fsspec.filesystem(server.protocol, **server.storage_options()))
    assert type(fs) in (s3fs.S3FileSystem, gcsfs.GCSFileSystem, HTTPFileSystem)
    a, b = f"{url}/a.bin", f"{url}/sub/b.bin"
    assert fs.info(a)["size"] == len(A)
    assert fs.cat_file(b) == B
    for start, end in RANGES:
        assert fs.cat_file(a, start=start, end=end) == A[start:end], (start, end)

    async def read_async() -> list[bytes]:
        afs = type(fs)(asynchronous=True, **server.storage_options())
        try:
            whole = await afs._cat_file(b)
            parts = await asyncio.gather(*(afs._cat_file(a, start=s, end=e) for s, e in RANGES))
            return [whole, *parts]
        finally:
            await aclose_filesystem(afs)

    whole, *parts = run(read_async())
    assert whole == B
    assert parts == [A[s:e] for s, e in RANGES]


def test_put_object_and_listing(
    s3_server: S3Server,
    gcs_server: GCSServer,
    http_server: HTTPRangeServer,
    closing: Callable[[Any], Any],
) -> None:
    for server in (s3_server, gcs_server, http_server):
        url = server.put_object("listing", "dir/x.bin", b"xyz")
        assert url == server.url("listing", "dir/x.bin")
        fs = closing(server.filesystem())
        assert fs.cat_file(url) == b"xyz"
        listed = fs.ls(server.url("listing", "dir"), detail=False)
        assert [p.rstrip("/").rsplit("/", 1)[-1] for p in listed] == ["x.bin"], server


def test_http_server_range_semantics(
    http_server: HTTPRangeServer, http_files: str, closing: Callable[[Any], Any]
) -> None:
    size = len(A)
    url = f"{http_files}/a.bin"
    empty = http_server.put_object("faults", "empty.bin", b"")

    async def main() -> None:
        async with aiohttp.ClientSession() as session:

            async def get(
                u: str, rng: str | None = None, method: str = "GET"
            ) -> tuple[int, Any, bytes]:
                headers = {"Range": rng} if rng else {}
                async with session.request(method, u, headers=headers) as r:
                    return r.status, r.headers, await r.read()

            st, h, body = await get(url, method="HEAD")
            assert (st, h["Content-Length"], h["Accept-Ranges"], body) == (
                200,
                str(size),
                "bytes",
                b"",
            )
            st, h, body = await get(url, "bytes=10-19", method="HEAD")
            assert (st, h["Content-Length"], h["Content-Range"], body) == (
                206,
                "10",
                f"bytes 10-19/{size}",
                b"",
            )
            st, h, body = await get(url)
            assert (st, body) == (200, A)
            st, h, body = await get(url, "bytes=10-19")
            assert (st, h["Content-Range"], body) == (206, f"bytes 10-19/{size}", A[10:20])
            st, h, body = await get(url, "bytes=-10")  # suffix
            assert (st, h["Content-Range"], body) == (
                206,
                f"bytes {size - 10}-{size - 1}/{size}",
                A[-10:],
            )
            st, h, body = await get(url, f"bytes=-{size + 50}")  # suffix longer than the file
            assert (st, body) == (206, A)
            st, h, body = await get(url, f"bytes={size - 5}-")  # open-ended
            assert (st, body) == (206, A[-5:])
            st, h, body = await get(url, f"bytes={size - 5}-{size + 100}")  # end clamped
            assert (st, h["Content-Range"], body) == (
                206,
                f"bytes {size - 5}-{size - 1}/{size}",
                A[-5:],
            )
            for bad in (
                f"bytes={size}-",
                f"bytes={size + 10}-{size + 20}",
                "bytes=20-10",
                "bytes=-0",
                "bytes=0-1,5-6",
                "bytes=abc",
            ):
                st, h, body = await get(url, bad)
                assert (st, h["Content-Range"]) == (416, f"bytes */{size}"), bad
            st, h, body = await get(url, "items=0-5")  # unknown unit: ignored
            assert (st, body) == (200, A)
            st, h, body = await get(empty)
            assert (st, body) == (200, b"")
            st, h, body = await get(empty, "bytes=0-")
            assert st == 416
            st, h, body = await get(f"{url}?chunked=1", "bytes=5-70004")
            assert (st, h["Transfer-Encoding"], body) == (206, "chunked", A[5:70005])
            assert (await get(f"{http_files}/missing.bin"))[0] == 404
            assert (await get(f"{http_files}/../../etc/passwd"))[0] == 404
            assert (await get(url, method="PUT"))[0] == 405

    run(main())

    fs = closing(HTTPFileSystem(skip_instance_cache=True))
    with pytest.raises(aiohttp.ClientResponseError) as info:
        fs.cat_file(url, start=size, end=size + 10)
    assert info.value.status == 416
    assert fs.cat_file(url, start=-10) == A[-10:]


def test_parse_byte_range() -> None:
    assert parse_byte_range(None, 10) is None
    assert parse_byte_range("bytes=0-0", 10) == (0, 1)
    assert parse_byte_range("bytes=2-", 10) == (2, 10)
    assert parse_byte_range("bytes=-3", 10) == (7, 10)
    assert parse_byte_range("bytes=-30", 10) == (0, 10)
    assert parse_byte_range("bytes=5-99", 10) == (5, 10)
    assert parse_byte_range("BYTES = 1 - 2", 10) == (1, 3)
    assert parse_byte_range("lines=1-2", 10) is None
    for bad in ("bytes=10-", "bytes=3-2", "bytes=-0", "bytes=-", "bytes=1-2,4-5", "bytes=x-1"):
        with pytest.raises(RangeNotSatisfiable):
            parse_byte_range(bad, 10)
    with pytest.raises(RangeNotSatisfiable):
        parse_byte_range("bytes=-1", 0)


@pytest.mark.parametrize("cls", [S3Server, GCSServer, HTTPRangeServer])
def test_server_stop_leaves_no_process(cls: type[LoopbackServer]) -> None:
    server = cls()
    with pytest.raises(ServerNotRunningError):
        _ = server.endpoint_url
    with server:
        pid, port, workdir = server.pid, server.port, server.workdir
        assert server.running and alive(pid) and port_open(port)
        assert server.endpoint_url == f"http://127.0.0.1:{port}"
        server.start()  # no-op while running
        assert server.pid == pid
        url = server.put_object("lifecycle", "k", b"v")
        assert url == server.url("lifecycle", "k")
        if isinstance(server, S3Server):
            server.reset()  # moto: every bucket gone
            assert server.client().list_buckets()["Buckets"] == []
    assert not server.running
    assert not alive(pid), f"{cls.__name__} pid {pid} still exists"
    assert not Path(f"/proc/{pid}").exists()
    assert not port_open(port)
    assert not workdir.exists()
    with pytest.raises(ServerNotRunningError):
        _ = server.pid
    server.stop()  # idempotent


def test_moto_sends_one_server_header(s3_server: S3Server) -> None:
    # two Server headers (werkzeug's and moto's) make aiohttp's strict parser
    # (python -X dev, PYTHONASYNCIODEBUG=1) reject every response
    sock = socket.create_connection(("127.0.0.1", s3_server.port), timeout=5)
    with sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = _recv_all(sock).partition(b"\r\n\r\n")[0].lower()
    assert head.count(b"\r\nserver:") == 1, head


def test_server_start_failure_is_reported(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # taken (not listening): the child cannot bind it
        server = HTTPRangeServer(tmp_path, port=holder.getsockname()[1])
        with pytest.raises(ServerStartError, match="(?i)address already in use"):
            server.start()
    assert not server.running
    with pytest.raises(ServerNotRunningError):
        _ = server.pid


def test_s3rver_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        S3rverServer, "find_executable", staticmethod(lambda executable=None: None)
    )
    with pytest.raises(ServerNotAvailableError, match=r"npm install .*s3rver@3\.7\.1"):
        S3rverServer().start()


@pytest.mark.skipif(S3rverServer.find_executable() is None, reason="s3rver (npm) is not installed")
def test_s3rver_serves_exact_ranges(payload_dir: Path, closing: Callable[[Any], Any]) -> None:
    with S3rverServer() as server:
        url = server.upload_dir(payload_dir, "roundtrip", "run1")
        fs = closing(server.filesystem())
        assert fs.cat_file(f"{url}/sub/b.bin") == B
        # s3rver 3.7.1 gets two ranges wrong: bytes=-N (first N+1 bytes) and
        # bytes=0-0 (the whole object), so neither is asked here.
        for start, end in RANGES:
            if (start, end) != (0, 1):
                assert fs.cat_file(f"{url}/a.bin", start=start, end=end) == A[start:end]
        assert fs.cat_file(f"{url}/a.bin", start=1, end=2) == A[1:2]
        pid = server.pid
    assert not alive(pid)


# ---------------------------------------------------------------------------
# fault proxy, with aiohttp and raw sockets in front of the HTTP server
# ---------------------------------------------------------------------------
def _session(limit: int = 1, timeout: float = 10.0) -> aiohttp.ClientSession:
    """One keep-alive connection by default, so faults hit a shared connection."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit), timeout=aiohttp.ClientTimeout(total=timeout)
    )


async def _get(
    session: aiohttp.ClientSession, url: str, rng: tuple[int, int] | None = None, **kw: Any
) -> tuple[int, bytes, float]:
    headers = {"Range": f"bytes={rng[0]}-{rng[1] - 1}"} if rng else {}
    t0 = time.monotonic()
    async with session.get(url, headers=headers, **kw) as r:
        body = await r.read()
    return r.status, body, time.monotonic() - t0


def _raw_request(port: int, path: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    return sock


def _recv_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_proxy_passthrough_keepalive_bit_exact(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    assert proxy.flavor == "http"
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)

    async def main() -> None:
        async with _session(limit=1) as s:
            for start, end in RANGES:
                assert (await _get(s, f"{base}/a.bin", (start, end)))[:2] == (206, A[start:end])
            assert (await _get(s, f"{base}/a.bin"))[:2] == (200, A)
            assert (await _get(s, f"{base}/sub/b.bin?chunked=1"))[:2] == (200, B)
            assert (await _get(s, f"{base}/sub/b.bin?chunked=1", (5, 60000)))[:2] == (
                206,
                B[5:60000],
            )
            async with s.head(f"{base}/a.bin") as r:
                assert (r.status, r.headers["Content-Length"]) == (200, str(len(A)))
            assert (await _get(s, f"{base}/nope.bin"))[0] == 404
            assert (await _get(s, f"{base}/small.txt"))[:2] == (200, SMALL)
        async with _session(limit=16) as s:  # many connections at once
            got = await asyncio.gather(
                *(_get(s, f"{base}/a.bin", (i * 4096, i * 4096 + 9000)) for i in range(40))
            )
            assert [g[1] for g in got] == [A[i * 4096 : i * 4096 + 9000] for i in range(40)]

    run(main())
    log = proxy.log
    assert len(log) == proxy.requests_seen == len(RANGES) + 6 + 40
    assert {e.action for e in log} == {"forward"}
    assert log[0].range == "bytes=0-0" and log[0].path == "/faults/a.bin"
    assert log[len(RANGES) + 1].query == "chunked=1"
    assert proxy.faults_applied == 0
    # the first eleven requests shared one keep-alive connection
    assert 2 <= proxy.connections_accepted <= 17


def test_proxy_delay_targets_one_request(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    rule = proxy.add_rule(delay(0.5), path="b.bin", times=1)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)

    async def main() -> list[tuple[int, bytes, float]]:
        async with _session() as s:
            return [
                await _get(s, f"{base}/{name}")
                for name in ("a.bin", "sub/b.bin", "sub/b.bin", "a.bin")
            ]

    (s1, b1, t1), (s2, b2, t2), (s3, b3, t3), (s4, b4, t4) = run(main())
    assert (s1, b1, s2, b2, s3, b3, s4, b4) == (200, A, 200, B, 200, B, 200, A)
    assert t2 >= 0.5
    assert max(t1, t3, t4) < t2 - 0.3  # relative: robust on a loaded machine
    assert (rule.matched, rule.fired) == (2, 1)
    assert [e.action for e in proxy.log] == ["forward", "delay(0.5)", "forward", "forward"]
    assert proxy.log[1].rule is rule
    assert proxy.connections_accepted == 1


def test_proxy_error_statuses_keep_the_connection(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    r503 = proxy.add_rule(status(503, retry_after=2), path="/a.bin", range_only=True, times=1)
    r429 = proxy.add_rule(status(429), path="b.bin", times=1)
    r500 = proxy.add_rule(status(500, body="boom"), method="HEAD", times=None)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)

    async def main() -> None:
        async with _session() as s:
            async with s.get(f"{base}/a.bin", headers={"Range": "bytes=0-9"}) as r:
                assert (r.status, r.headers["Retry-After"], await r.text()) == (
                    503,
                    "2",
                    "503 Service Unavailable (fault proxy)\n",
                )
            async with s.get(f"{base}/sub/b.bin") as r:
                assert r.status == 429 and "Retry-After" not in r.headers
            async with s.head(f"{base}/small.txt") as r:
                assert (r.status, r.headers["Content-Length"]) == (500, "0")  # no body for HEAD
            assert (await _get(s, f"{base}/a.bin", (0, 10)))[:2] == (206, A[:10])
            assert (await _get(s, f"{base}/sub/b.bin"))[:2] == (200, B)
            async with s.head(f"{base}/small.txt") as r:
                assert r.status == 500

    run(main())
    assert (r503.fired, r429.fired, r500.fired) == (1, 1, 2)
    assert [e.action for e in proxy.log] == [
        "status(503)",
        "status(429)",
        "status(500)",
        "forward",
        "forward",
        "status(500)",
    ]
    assert proxy.connections_accepted == 1
    assert proxy.faults_applied == 4


def test_proxy_reset_sends_rst_on_the_targeted_request(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)
    first = proxy.add_rule(reset(), path="b.bin", times=1)

    sock = _raw_request(proxy.port, "/faults/sub/b.bin")
    with sock, pytest.raises(ConnectionResetError):  # an RST, not a FIN
        _recv_all(sock)
    assert first.fired == 1

    async def main() -> None:
        async with _session() as s:
            assert (await _get(s, f"{base}/a.bin"))[:2] == (200, A)
            # aiohttp silently retries an idempotent request once when the
            # connection breaks before the response head: one reset is invisible.
            once = proxy.add_rule(reset(), path="b.bin", times=1)
            assert (await _get(s, f"{base}/sub/b.bin"))[:2] == (200, B)
            assert once.fired == 1
            twice = proxy.add_rule(reset(), path="b.bin", times=2)
            with pytest.raises(aiohttp.ClientOSError):
                await _get(s, f"{base}/sub/b.bin")
            assert twice.fired == 2
            assert (await _get(s, f"{base}/a.bin", (7, 77)))[:2] == (206, A[7:77])
            assert (await _get(s, f"{base}/sub/b.bin"))[:2] == (200, B)

    run(main())
    assert [e.action for e in proxy.log] == [
        "reset",
        "forward",
        "reset",
        "forward",
        "reset",
        "reset",
        "forward",
        "forward",
    ]

    # reset after part of the body: the headers arrive, the body breaks
    proxy.clear()
    proxy.add_rule(reset(after_bytes=1000), path="a.bin")

    async def mid_body() -> None:
        async with _session() as s:
            async with s.get(f"{base}/a.bin") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
            assert (await _get(s, f"{base}/a.bin"))[:2] == (200, A)

    run(mid_body())


def test_proxy_truncate_cuts_the_body(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)
    proxy.add_rule(truncate(1000), path="a.bin", times=1)

    sock = _raw_request(proxy.port, "/faults/a.bin")
    with sock:
        raw = _recv_all(sock)  # ends with a FIN: no exception
    head, _, body = raw.partition(b"\r\n\r\n")
    assert f"Content-Length: {len(A)}".encode() in head
    assert body == A[:1000]

    rule = proxy.add_rule(truncate(100), path="chunked=1", times=1)

    async def main() -> None:
        async with _session() as s:
            assert (await _get(s, f"{base}/a.bin"))[:2] == (200, A)
            async with s.get(f"{base}/sub/b.bin?chunked=1") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
            assert (await _get(s, f"{base}/sub/b.bin?chunked=1"))[:2] == (200, B)

    run(main())
    assert rule.fired == 1
    assert [e.action for e in proxy.log] == [
        "truncate(1000)",
        "forward",
        "truncate(100)",
        "forward",
    ]


def test_proxy_stall(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)
    forever = proxy.add_rule(stall(), path="b.bin", times=1)
    short = proxy.add_rule(stall(0.3), path="small.txt", times=2)
    mid = proxy.add_rule(stall(after_bytes=5000), path="a.bin", range_only=True, times=1)

    async def main() -> None:
        async with _session(limit=8) as s:
            stalled = asyncio.ensure_future(
                _get(s, f"{base}/sub/b.bin", timeout=aiohttp.ClientTimeout(total=0.6))
            )
            await asyncio.sleep(0.1)
            # other requests go through while one is stalled
            assert (await _get(s, f"{base}/a.bin"))[:2] == (200, A)
            with pytest.raises(asyncio.TimeoutError):
                await stalled
            t0 = time.monotonic()
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await _get(
                    s, f"{base}/small.txt"
                )  # stalled, closed, retried by aiohttp, stalled, closed
            assert 0.6 <= time.monotonic() - t0 < 2.5
            async with s.get(
                f"{base}/a.bin",
                headers={"Range": "bytes=0-99999"},
                timeout=aiohttp.ClientTimeout(sock_read=0.4),
            ) as r:
                assert r.status == 206
                assert await r.content.readexactly(5000) == A[:5000]
                with pytest.raises(asyncio.TimeoutError):
                    await r.read()
            assert (await _get(s, f"{base}/sub/b.bin"))[:2] == (200, B)
            assert (await _get(s, f"{base}/small.txt"))[:2] == (200, SMALL)

    run(main())
    assert (forever.fired, short.fired, mid.fired) == (1, 2, 1)

    # stop() ends a stall at once and closes its connection
    proxy.clear()
    proxy.add_rule(stall(), times=None)
    seen = proxy.requests_seen
    sock = _raw_request(proxy.port, "/faults/a.bin")
    with sock:
        assert proxy.wait_for_requests(seen + 1, timeout=5)
        t0 = time.monotonic()
        proxy.stop()
        assert time.monotonic() - t0 < 2.0
        try:
            assert _recv_all(sock) == b""
        except ConnectionResetError:
            pass


def test_proxy_trickle_latency_bandwidth(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)
    rule = proxy.add_rule(trickle(200_000), path="b.bin", times=1)

    async def timed(url: str, n: int = 1) -> list[float]:
        async with _session() as s:
            out = []
            for _ in range(n):
                st, body, dt = await _get(s, url)
                expected = {"b.bin": B, "small.txt": SMALL, "a.bin": A}[url.rsplit("/", 1)[-1]]
                assert (st, body) == (200, expected)
                out.append(dt)
            return out

    slow, fast = run(timed(f"{base}/sub/b.bin", 2))
    assert slow >= len(B) / 200_000 * 0.95 and fast < slow / 2
    assert rule.fired == 1

    proxy.latency = 0.1  # one way: +0.2 s per request
    (t,) = run(timed(f"{base}/small.txt"))
    assert 0.2 <= t < 1.5
    proxy.latency = 0.0

    proxy.bandwidth = 1_000_000  # 300 KiB at 1 MB/s: about 0.3 s
    (capped,) = run(timed(f"{base}/a.bin"))
    assert 0.25 <= capped < 2.0
    proxy.bandwidth = None
    (t,) = run(timed(f"{base}/a.bin"))
    assert t < capped / 2


def test_proxy_skip_and_probability(
    http_server: HTTPRangeServer, http_files: str, fault_proxy: MakeProxy
) -> None:
    proxy = fault_proxy(http_server)
    base = http_server.url("faults", endpoint_url=proxy.endpoint_url)
    second = proxy.add_rule(status(500), path="small.txt", skip=1, times=1)

    async def statuses(url: str, n: int) -> list[int]:
        async with _session() as s:
            return [(await _get(s, url))[0] for _ in range(n)]

    assert run(statuses(f"{base}/small.txt", 3)) == [200, 500, 200]
    assert (second.matched, second.fired) == (3, 1)

    patterns = []
    for _ in range(2):
        p = fault_proxy(http_server, seed=7)
        rule = p.add_rule(status(503), probability=0.5, times=None)
        got = run(
            statuses(http_server.url("faults", "small.txt", endpoint_url=p.endpoint_url), 24)
        )
        assert rule.fired == got.count(503) and 0 < rule.fired < 24
        patterns.append(got)
    assert patterns[0] == patterns[1]


def test_proxy_upstream_down_gives_502(fault_proxy: MakeProxy) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        proxy = fault_proxy(f"http://127.0.0.1:{holder.getsockname()[1]}")
        sock = _raw_request(proxy.port, "/x")
        with sock:
            assert _recv_all(sock).startswith(b"HTTP/1.1 502 ")


def test_proxy_rejects_non_loopback_upstream() -> None:
    with pytest.raises(ValueError):
        FaultProxy("http://example.com:80")
    with pytest.raises(ValueError):
        FaultProxy("https://127.0.0.1:443")


def test_proxy_stop_leaves_no_thread(http_server: HTTPRangeServer, http_files: str) -> None:
    proxy = FaultProxy(http_server)
    with proxy:
        name = proxy.thread_name
        assert name in {t.name for t in threading.enumerate()}
        port = proxy.port
        keep = _raw_request(port, "/faults/small.txt")  # an idle keep-alive connection
        with keep:
            assert keep.recv(65536).startswith(b"HTTP/1.1 200")
    assert name not in {t.name for t in threading.enumerate()}
    assert not port_open(port)
    proxy.stop()  # idempotent
    with proxy:  # restartable
        assert proxy.thread_name in {t.name for t in threading.enumerate()}
    assert proxy.thread_name not in {t.name for t in threading.enumerate()}


# ---------------------------------------------------------------------------
# fault proxy with the cloud clients
# ---------------------------------------------------------------------------
def test_proxy_s3_errors_reach_s3fs_as_the_right_exceptions(
    s3_server: S3Server, fault_proxy: MakeProxy, bucket_name: str, closing: Callable[[Any], Any]
) -> None:
    url = s3_server.put_object(bucket_name, "dir/obj.bin", A)
    proxy = fault_proxy(s3_server)
    assert proxy.flavor == "s3"
    fs = closing(s3fs.S3FileSystem(**s3_server.storage_options(proxy.endpoint_url)))

    # PUT through the proxy (request bodies are forwarded), then read it back
    fs.pipe_file(f"{bucket_name}/dir/put.bin", B)
    assert fs.cat_file(f"{bucket_name}/dir/put.bin", start=0, end=len(B)) == B

    # moto closes after every response; the proxy still keeps s3fs's connection alive
    assert proxy.requests_seen == 2 and proxy.connections_accepted == 1

    proxy.reset_counters()
    slow = proxy.add_rule(status(503), data_only=True, times=1)
    assert fs.cat_file(url, start=100, end=200) == A[100:200]  # s3fs retries the SlowDown
    assert slow.fired == 1
    assert [(e.method, e.action) for e in proxy.log] == [
        ("GET", "status(503)"),
        ("GET", "forward"),
    ]
    assert {e.range for e in proxy.log} == {"bytes=100-199"}

    proxy.clear()
    proxy.add_rule(status(404), data_only=True)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(url, start=0, end=10)
    proxy.add_rule(status(403), data_only=True)
    with pytest.raises(PermissionError):
        fs.cat_file(url, start=0, end=10)
    # a listing is not a data request: untouched
    proxy.add_rule(status(500), data_only=True, times=None)
    assert fs.ls(f"{bucket_name}/dir", detail=False) == [
        f"{bucket_name}/dir/obj.bin",
        f"{bucket_name}/dir/put.bin",
    ]
    assert proxy.log[-1].action == "forward" and "list-type=2" in proxy.log[-1].query


def test_proxy_gcs_error_then_success(
    gcs_server: GCSServer, fault_proxy: MakeProxy, bucket_name: str, closing: Callable[[Any], Any]
) -> None:
    url = gcs_server.put_object(bucket_name, "obj.bin", A)
    proxy = fault_proxy(gcs_server)
    assert proxy.flavor == "gcs"
    rule = proxy.add_rule(status(503), data_only=True, times=1)
    fs = closing(gcsfs.GCSFileSystem(**gcs_server.storage_options(proxy.endpoint_url)))
    assert fs.cat_file(url, start=10, end=5000) == A[10:5000]  # gcsfs retries 5xx
    assert rule.fired == 1
    data_log = [e for e in proxy.log if "alt=media" in e.query]
    assert [e.action for e in data_log] == ["status(503)", "forward"]
    proxy.add_rule(status(404), data_only=True)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(url, start=0, end=10)
