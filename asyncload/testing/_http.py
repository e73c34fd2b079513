"""HTTP/1.1 as the fault proxy speaks it: a request read whole (:func:`_read_request`), one
exchange with the upstream (:func:`_exchange`) and its body relayed (:func:`_relay`),
``Content-Length``, chunked and read-until-close bodies, responses built, bytes paced to a
rate and a shared bandwidth (:func:`_send`, :class:`_TokenBucket`), a TCP reset.

Raised: :class:`_ProtocolError` for framing the proxy cannot follow (the connection ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import re
import socket
import struct
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger("asyncload.testing")

_PIECE = 64 * 1024  # bytes read from upstream at a time
_SLICE = 16 * 1024  # bytes written at a time when pacing (bandwidth)
_HEAD_LIMIT = 1 << 20  # longest request/response head accepted

Flavor = Literal["s3", "gcs", "http"]


class _ProtocolError(Exception):
    """A peer sent something that is not HTTP/1.x (connection is dropped)."""


# ---------------------------------------------------------------------------
# requests, rules, log
# ---------------------------------------------------------------------------
@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes  # as on the wire (chunk framing kept)

    @property
    def path(self) -> str:
        return urllib.parse.urlsplit(self.target).path

    @property
    def query(self) -> str:
        return urllib.parse.urlsplit(self.target).query

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def tokens(self, name: str) -> set[str]:
        name = name.lower()
        return {
            t.strip().lower() for k, v in self.headers if k.lower() == name for t in v.split(",")
        }

    @property
    def keep_alive(self) -> bool:
        conn = self.tokens("connection")
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


# ---------------------------------------------------------------------------
# pacing
# ---------------------------------------------------------------------------
class _TokenBucket:
    """A shared byte budget refilled at ``rate`` bytes/s (debt-based: fair enough, exact on
    average)."""

    def __init__(self) -> None:
        self._tokens = 0.0
        self._last = time.monotonic()

    async def take(self, nbytes: int, rate: float) -> None:
        now = time.monotonic()
        burst = max(float(_SLICE), rate * 0.02)
        self._tokens = min(burst, self._tokens + (now - self._last) * rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / rate)


# ---------------------------------------------------------------------------
# the proxy
# ---------------------------------------------------------------------------
@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    up_reader: asyncio.StreamReader | None = None
    up_writer: asyncio.StreamWriter | None = None

    def close_upstream(self) -> None:
        if self.up_writer is not None:
            self.up_writer.transport.abort()
        self.up_reader = self.up_writer = None

    def client_gone(self) -> bool:
        return self.reader.at_eof() or self.writer.transport.is_closing()


def _parse_headers(lines: list[str]) -> list[tuple[str, str]]:
    headers: list[tuple[str, str]] = []
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _ProtocolError(f"bad header line {line!r}")
        headers.append((name, value.strip()))
    return headers


def _content_length(headers: list[tuple[str, str]]) -> int | None:
    values = {v.strip() for k, v in headers if k.lower() == "content-length"}
    if not values:
        return None
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise _ProtocolError(f"bad Content-Length {values!r}")
    return int(values.pop())


async def _read_exact(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
    left = length
    while left > 0:
        data = await reader.read(min(_PIECE, left))
        if not data:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(data)
        yield data


async def _read_until_eof(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(_PIECE):
        yield data


async def _read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """Yield a chunked body as on the wire (framing and trailers included)."""
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError as exc:
            raise _ProtocolError(f"bad chunk size {line!r}") from exc
        yield line
        if size == 0:
            while True:  # trailer fields, then the empty line
                trailer = await reader.readuntil(b"\r\n")
                yield trailer
                if trailer == b"\r\n":
                    return
        left = size + 2  # data and its CRLF
        while left > 0:
            data = await reader.read(min(_PIECE, left))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            yield data


def _shift_range(value: str, offset: int) -> str:
    """``bytes=a-b`` moved by ``offset`` (other forms unchanged)."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d+)\s*-\s*(\d*)\s*", value)
    if m is None:
        return value
    first = max(0, int(m.group(1)) + offset)
    last = f"{max(first, int(m.group(2)) + offset)}" if m.group(2) else ""
    return f"bytes={first}-{last}"


def _without_connection_close(head: bytes) -> bytes:
    """A response head with its ``Connection`` header(s) removed (HTTP/1.1: keep-alive)."""
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]] + [ln for ln in lines[1:] if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join(kept) + b"\r\n\r\n"


def _build_response(
    code: int, phrase: str, headers: list[tuple[str, str]], body: bytes, *, close: bool
) -> bytes:
    lines = [
        f"HTTP/1.1 {code} {phrase}",
        "Server: asyncload-fault-proxy",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in headers]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _simple_response(code: int, body: bytes, *, close: bool) -> bytes:
    return _build_response(
        code, http.HTTPStatus(code).phrase, [("Content-Type", "text/plain")], body, close=close
    )


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Close the connection so the peer gets a TCP RST (SO_LINGER on, 0 s)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _read_request(conn: _Conn) -> _Request | None:
    """The next request on ``conn`` (its body read whole), or ``None`` when the client closed."""
    try:
        head = await conn.reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise _ProtocolError("client closed in the middle of a request head") from exc
        return None
    lines = head[:-4].decode("latin-1").split("\r\n")
    while lines and not lines[0]:  # tolerate stray CRLF between requests
        lines.pop(0)
    try:
        method, target, version = lines[0].split(" ", 2)
    except (ValueError, IndexError) as exc:
        raise _ProtocolError(f"bad request line {lines[:1]!r}") from exc
    if not version.startswith("HTTP/1."):
        raise _ProtocolError(f"unsupported version {version!r}")
    headers = _parse_headers(lines[1:])
    req = _Request(method.upper(), target, version, headers, b"")
    if "100-continue" in req.tokens("expect"):
        # Answer it ourselves and drop it, so upstream never sends a 100.
        req.headers = [(k, v) for k, v in headers if k.lower() != "expect"]
        conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await conn.writer.drain()
    if "chunked" in req.tokens("transfer-encoding"):
        req.body = b"".join([piece async for piece in _read_chunked(conn.reader)])
    else:
        length = _content_length(req.headers)
        if length:
            req.body = await conn.reader.readexactly(length)
    return req


async def _send(
    writer: asyncio.StreamWriter,
    data: bytes,
    rate: float | None,
    bandwidth: float | None,
    bucket: _TokenBucket,
    start: float = 0.0,
    before: int = 0,
) -> None:
    """Write ``data`` honouring the bandwidth cap and an optional per-request ``rate``."""
    if not data:
        return
    if rate is None and not bandwidth:
        writer.write(data)
        await writer.drain()
        return
    step = _SLICE
    if rate is not None:
        step = max(1, min(_SLICE, int(rate / 20)))
    view = memoryview(data)
    done = before
    for off in range(0, len(data), step):
        piece = view[off : off + step]
        done += len(piece)
        if rate is not None:  # the slice's last byte leaves on schedule
            wait = start + done / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        if bandwidth:
            await bucket.take(len(piece), bandwidth)
        writer.write(piece)
        await writer.drain()


async def _exchange(
    conn: _Conn, req: _Request, up_port: int, bandwidth: float | None, bucket: _TokenBucket
) -> tuple[bytes, int, list[tuple[str, str]]]:
    """Send ``req`` upstream and read the final response head (1xx skipped)."""
    for attempt in (0, 1):
        reused = conn.up_writer is not None
        if conn.up_writer is None:
            conn.up_reader, conn.up_writer = await asyncio.open_connection(
                "127.0.0.1", up_port, limit=_HEAD_LIMIT
            )
            with contextlib.suppress(OSError):
                conn.up_writer.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                )
        assert conn.up_reader is not None and conn.up_writer is not None
        try:
            lines = [f"{req.method} {req.target} {req.version}"] + [
                f"{k}: {v}" for k, v in req.headers
            ]
            conn.up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            if req.body:
                await _send(conn.up_writer, req.body, None, bandwidth, bucket)
            await conn.up_writer.drain()
            while True:
                head = await conn.up_reader.readuntil(b"\r\n\r\n")
                status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
                parts = status_line.split(" ", 2)
                if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                    raise _ProtocolError(f"bad status line {status_line!r}")
                code = int(parts[1])
                if 100 <= code < 200 and code != 101:
                    continue
                return head, code, _parse_headers(header_lines)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            # A kept-alive upstream connection may have been closed by the
            # server meanwhile: retry once on a fresh one.
            conn.close_upstream()
            partial = getattr(exc, "partial", b"")
            if attempt == 0 and reused and not partial:
                continue
            raise
    raise AssertionError("unreachable")


async def _relay(
    conn: _Conn,
    body: AsyncIterator[bytes],
    limit: int | None,
    rate: float | None,
    bandwidth: float | None,
    bucket: _TokenBucket,
) -> bool:
    """Copy the response body to the client; False if cut short (limit) or upstream failed."""
    sent = 0
    start = time.monotonic()
    try:
        async with contextlib.aclosing(body):  # type: ignore[type-var]
            async for piece in body:
                if limit is not None and sent + len(piece) >= limit:
                    await _send(
                        conn.writer,
                        piece[: limit - sent],
                        rate,
                        bandwidth,
                        bucket,
                        start,
                        sent,
                    )
                    return False
                await _send(conn.writer, piece, rate, bandwidth, bucket, start, sent)
                sent += len(piece)
    except (asyncio.IncompleteReadError, _ProtocolError, ConnectionError) as exc:
        # The upstream broke mid-body (the client must see a broken body
        # too) or the client left: either way this connection is done.
        logger.debug("fault proxy: body relay ended after %d bytes: %r", sent, exc)
        conn.writer.transport.abort()
        return False
    return limit is None
