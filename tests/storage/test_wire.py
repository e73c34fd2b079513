"""The wire transport (``LoadOptions.transport="wire"``, :mod:`asyncload.storage.wire`): ranges
received straight into caller memory, bit for bit, on moto (S3, SigV4), fake-gcs-server and the
HTTP Range server, behind the fault proxy; keep-alive connections; nothing past the range lands;
a cancel stops every write at once and closes the connection; TLS through the loop's ssl; the
signature is botocore's. The load-level guarantees (retries, hedging, version pins, range
checks, redirects, redaction) run for this transport in the suites parametrized by
``transport`` (``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from _remote import make_remote, wait_closed

from asyncload import LoadOptions, StorageReadError
from asyncload.storage.base import RangeMismatchError, ShortReadError
from asyncload.storage.factory import open_storage
from asyncload.storage.sigv4 import SigV4
from asyncload.storage.wire import WireStorage
from asyncload.testing import faults

pytestmark = pytest.mark.timeout(120)

SIZE = 3 << 20 | 12345
GUARD = 4096


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, bytes]:
    d = tmp_path / "ckpt"
    d.mkdir()
    data = torch.randint(
        0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    raw = data.numpy().tobytes()
    (d / "blob.bin").write_bytes(raw)
    (d / "other.bin").write_bytes(raw[:1000])
    return d, raw


def _wire(r: Any, executor: concurrent.futures.Executor, **kw: Any) -> WireStorage:
    st = open_storage(r.url, r.storage_options, executor, transport="wire", **kw)
    assert isinstance(st, WireStorage), type(st)
    return st


def _dest(n: int) -> tuple[torch.Tensor, list[memoryview]]:
    """A destination of ``n`` bytes between two guards, as three views (the pieces a chunk
    that spans three tensors hands over)."""
    dest = torch.zeros(n + 2 * GUARD, dtype=torch.uint8)
    dest[:GUARD] = 0xA5
    dest[-GUARD:] = 0xA5
    mv = memoryview(dest.numpy())[GUARD : GUARD + n]
    a, b = n // 3, 2 * n // 3
    return dest, [mv[:a], mv[a:b], mv[b:]]


def _guards_intact(dest: torch.Tensor) -> bool:
    return bool((dest[:GUARD] == 0xA5).all() and (dest[-GUARD:] == 0xA5).all())


@pytest.mark.parametrize("backend", ["http", "s3", "gcs"])
def test_ranges_land_in_the_destination_bit_for_bit_over_one_connection(
    request, backend, blob, bucket_name, fault_proxy
):
    path, raw = blob
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        st = _wire(r, executor)

        async def go() -> None:
            try:
                assert await st.size("blob.bin") == SIZE
                for lo, hi in [(0, 1), (1, 4097), (12345, 12345 + (2 << 20)), (SIZE - 10, SIZE)]:
                    dest, views = _dest(hi - lo)
                    await st.readinto("blob.bin", lo, views)
                    assert dest[GUARD:-GUARD].numpy().tobytes() == raw[lo:hi], (lo, hi)
                    assert _guards_intact(dest)
                head, size = await st.read_prefix("other.bin", 1 << 20)
                assert bytes(head) == raw[:1000] and size == 1000
                whole, size = await st.read_object("blob.bin", 1 << 30)
                assert whole is not None and bytes(whole) == raw and size == SIZE
                if backend != "http":
                    assert await st.listdir() == ["blob.bin", "other.bin"]
                    assert await st.sizes(["blob.bin", "other.bin", "a", "b"]) == {
                        "blob.bin": SIZE,
                        "other.bin": 1000,
                    }
                # sequential requests, one keep-alive connection
                assert "opened=1>" in repr(st), repr(st)
            finally:
                await st.aclose()

        asyncio.run(go())
    assert r.proxy.requests_seen >= 7


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_an_over_long_body_never_lands_past_the_range(
    request, backend, blob, bucket_name, fault_proxy
):
    path, _raw = blob
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    r.proxy.add_rule(faults.overlong(8 << 20), path="blob.bin", range_only=True, times=None)
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        st = _wire(r, executor)
        dest, views = _dest(1 << 20)

        async def go() -> None:
            try:
                with pytest.raises(RangeMismatchError, match="a body longer than that range"):
                    await st.readinto("blob.bin", 4096, views)
            finally:
                await st.aclose()

        asyncio.run(go())
    # refused on its head: not a byte of the body reached the destination or past it
    assert not dest[GUARD:-GUARD].any() and _guards_intact(dest)


@pytest.mark.parametrize("backend", ["http", "gcs"])
def test_a_body_cut_short_is_a_short_read(request, backend, blob, bucket_name, fault_proxy):
    path, raw = blob
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    r.proxy.add_rule(faults.truncate(100_000), path="blob.bin", range_only=True, times=1)
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        st = _wire(r, executor)
        dest, views = _dest(1 << 20)

        async def go() -> None:
            try:
                with pytest.raises(ShortReadError, match=r"got 100000 of 1048576 bytes"):
                    await st.readinto("blob.bin", 0, views)
                await st.readinto("blob.bin", 0, views)  # the next answer is whole
            finally:
                await st.aclose()

        asyncio.run(go())
    assert dest[GUARD:-GUARD].numpy().tobytes() == raw[: 1 << 20] and _guards_intact(dest)


def test_a_cancel_stops_every_write_and_closes_the_connection(
    request, blob, bucket_name, fault_proxy
):
    path, _raw = blob
    r = make_remote(request, "s3", path, bucket_name, fault_proxy)
    r.proxy.add_rule(faults.stall(None, after_bytes=200_000), path="blob.bin", range_only=True)
    port = int(r.proxy.endpoint_url.rsplit(":", 1)[1])
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        st = _wire(r, executor)
        dest, views = _dest(2 << 20)

        async def go() -> torch.Tensor:
            try:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(st.readinto("blob.bin", 0, views), 1.0)
                seen = dest.clone()
                await asyncio.sleep(0.3)  # nothing lands after the cancel
                assert torch.equal(dest, seen)
                return seen
            finally:
                await st.aclose()

        seen = asyncio.run(go())
    landed = int(seen[GUARD:-GUARD].ne(0).sum())
    assert landed > 0 and _guards_intact(seen)
    assert wait_closed(port) == []


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_records_received_before_the_body_is_asked_for_all_land(tmp_path):
    """An answer that arrives whole over TLS before the reader asks for its body: asyncio's
    TLS layer decrypts several records into one buffer from ``get_buffer`` (the records
    after the first into ``buf[offset:]``), and every byte of each must reach the body."""
    from asyncload.storage.wire_http import Connection

    cert, key = _self_signed(tmp_path)
    body = torch.randint(0, 256, (512 << 10,), dtype=torch.uint8).numpy().tobytes()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async def go() -> None:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert, key)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)  # head and body at once: many TLS records back to back
            await writer.drain()
            await reader.read()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        client_ctx = ssl.create_default_context(cafile=str(cert))
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            Connection, "127.0.0.1", port, ssl=client_ctx, server_hostname="127.0.0.1"
        )
        try:
            conn.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            while len(conn._inbox) < len(answer):  # all of it in before the head is read
                assert not conn.closed
                await asyncio.sleep(0.005)
            status, _, headers = await conn.read_head()
            assert (status, headers["content-length"]) == (200, str(len(body)))
            got = bytearray(len(body))
            assert await conn.read_exactly_into([memoryview(got)], len(body)) == len(body)
            assert bytes(got) == body
        finally:
            conn.abort()
            server.close()

    asyncio.run(go())


def test_tls_through_the_loops_ssl(request, blob, bucket_name, fault_proxy, tmp_path, monkeypatch):
    """HTTPS to a TLS front of the HTTP Range server, its self-signed certificate trusted
    through ``SSL_CERT_FILE``; an untrusted certificate is a TLS error, not retried."""
    path, raw = blob
    r = make_remote(request, "http", path, bucket_name, fault_proxy)
    cert, key = _self_signed(tmp_path)
    upstream = r.proxy.endpoint_url.rsplit(":", 1)[1]

    async def go() -> None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(1 << 16):
                    b.write(data)
                    await b.drain()
            finally:
                b.close()

        async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            ur, uw = await asyncio.open_connection("127.0.0.1", int(upstream))
            await asyncio.gather(pipe(reader, uw), pipe(ur, writer), return_exceptions=True)

        server = await asyncio.start_server(front, "127.0.0.1", 0, ssl=ctx)
        port = server.sockets[0].getsockname()[1]
        url = r.url.replace(r.proxy.endpoint_url, f"https://127.0.0.1:{port}")
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            st = open_storage(url, {}, executor, transport="wire")
            try:
                dest, views = _dest(SIZE)
                await st.readinto("blob.bin", 0, views)
                assert dest[GUARD:-GUARD].numpy().tobytes() == raw
            finally:
                await st.aclose()
            monkeypatch.delenv("SSL_CERT_FILE")
            st = open_storage(url, {}, executor, transport="wire")
            try:
                with pytest.raises(ssl.SSLCertVerificationError):
                    await st.size("blob.bin")
            finally:
                await st.aclose()
        server.close()

    asyncio.run(go())


def test_the_signature_is_botocores():
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    for token in (None, "session/token+="):
        url = "http://127.0.0.1:9000/bkt/a%20b/%C3%A9~x.bin"
        query = "delimiter=%2F&list-type=2&prefix=a%20b%2F"
        for target in (url, f"{url}?{query}"):
            req = AWSRequest(method="GET", url=target, headers={})
            S3SigV4Auth(Credentials("AKID", "SECRET/KEY", token), "s3", "eu-west-3").add_auth(req)
            when = datetime.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
            ours = SigV4("AKID", "SECRET/KEY", "eu-west-3", token).sign(
                "GET",
                "127.0.0.1:9000",
                "/bkt/a%20b/%C3%A9~x.bin",
                query if "?" in target else "",
                now=when.replace(tzinfo=datetime.UTC),
            )
            assert ours["authorization"] == req.headers["Authorization"]


def test_wire_refuses_what_it_cannot_sign(tmp_path, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        with pytest.raises(StorageReadError) as info:
            open_storage(
                "gs://user:pw@bucket/ckpt", {"endpoint_url": "http://127.0.0.1:1"}, executor,
                transport="wire",
            )  # fmt: skip
        assert "transport='wire'" in str(info.value) and "pw" not in str(info.value)
        with pytest.raises(StorageReadError, match="requester_pays"):
            open_storage(
                "gs://bucket/ckpt", {"endpoint_url": "http://127.0.0.1:1", "requester_pays": True},
                executor, transport="wire",
            )  # fmt: skip
    assert LoadOptions(transport="wire").transport == "wire"
    with pytest.raises(ValueError, match="wire"):
        LoadOptions(transport="curl")  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["wire", "fsspec"])
def test_time_to_first_byte_is_reported(request, bucket_name, fault_proxy, tmp_path, transport):
    """``LoadStats.time_to_first_byte``: from the call to the first data byte, after the
    ``.metadata`` round trips (the proxy adds 20 ms to each) and before the load ends."""
    import torch.distributed.checkpoint as dcp

    import asyncload

    sd = {
        f"w{i}": torch.randn(64, 33, generator=torch.Generator().manual_seed(i)) for i in range(3)
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    r = make_remote(request, "s3", tmp_path / "ckpt", bucket_name, fault_proxy, latency=0.01)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    stats = asyncload.load(
        dest, r.url, options=LoadOptions(transport=transport), storage_options=r.storage_options
    )
    assert all(torch.equal(dest[k], sd[k]) for k in sd)
    assert 0.02 <= stats.time_to_first_byte <= stats.seconds, stats
