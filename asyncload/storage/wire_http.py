"""HTTP/1.1 for the wire transport (:mod:`asyncload.storage.wire`): keep-alive connections
per origin (:class:`Pool`) and an asyncio ``BufferedProtocol`` (:class:`Connection`) whose
``get_buffer`` hands out a view of the caller's memory while a body is read into it, so that a
range's bytes go from the socket (or the TLS layer) straight into the destination, once.

What a connection holds at any time::

    idle --send()--> head --headers in--> body --read_into() / read() / discard()--> idle
      \\________________ any error, cancel, or a body not read to its end: aborted ____/

A connection goes back to its pool only when its answer was read whole and nothing past it
arrived; one that receives a byte while idle (a late duplicate answer, a body after a HEAD,
204 or 304 in its own packet), or whose socket holds one when it is taken, is closed and
never sent another request: an answer is read only from a connection whose previous answer
was read to its end.

Only as many bytes as the answer's framing says are asked of the socket while a body lands in
caller memory (``get_buffer`` offers exactly what is left), so a body longer than promised is
never read into it. Bytes past the head that arrived with it are copied once (at most one
receive's worth). Raw errors only (:class:`HTTPStatusError`, ``ConnectionError``,
:class:`asyncload.storage.base.ShortReadError`); the error boundary
(:mod:`asyncload.storage.retrying`) classifies and translates them.
"""

from __future__ import annotations

import asyncio
import base64
import re
import select
import socket
import ssl as _ssl
from collections.abc import Callable, Sequence
from urllib.parse import unquote, urlsplit

from asyncload.storage.base import ProtocolMismatchError, ShortReadError

__all__ = [
    "BodyTooLongError",
    "Connection",
    "HTTPStatusError",
    "NotFoundError",
    "Pool",
    "ProxyError",
    "Response",
]

#: The most bytes of a response head (status line and headers).
MAX_HEAD = 64 << 10
#: The most bytes of an error answer's body kept for its message (a longer one is dropped with
#: its connection).
MAX_ERROR_BODY = 64 << 10
_SCRATCH = 256 << 10
_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{1,300})</Message>")


class HTTPStatusError(OSError):
    """An answer with an error status (4xx, 5xx, or a redirect that was not followed): its
    status, headers and the S3 error code of its body, in the shape
    :mod:`asyncload.storage.classify` reads (``status``, ``headers``, ``response``)."""

    def __init__(self, url: str, status: int, reason: str, headers: dict[str, str], body: bytes):
        m = _CODE.search(body)
        code = m.group(1).decode("utf-8", "replace") if m else None
        said = _MESSAGE.search(body)
        detail = f" ({code}: {said.group(1).decode('utf-8', 'replace')})" if code and said else ""
        if code and not detail:
            detail = f" ({code})"
        super().__init__(f"{url}: HTTP {status} {reason}{detail}")
        self.url, self.status, self.headers = url, status, headers
        self.response = {
            "Error": {"Code": code} if code else {},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers},
        }


class NotFoundError(HTTPStatusError, FileNotFoundError):
    """A 404."""


class BodyTooLongError(OSError):
    """A body longer than the caller allows (``limit``); read no further."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the body is longer than {limit} bytes")
        self.limit = limit


class Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection. Mutable state: the transport, the bytes received and not yet
    taken (``_inbox``), the caller memory a body lands in (``_sinks``, ``_si``, ``_pos``), the
    waiter of the coroutine reading, and whether it ended (``_lost``)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH)
        #: what get_buffer hands out when no body is being received: a view, never the
        #: bytearray itself, since asyncio's TLS layer fills ``buf[offset:]`` after its first
        #: record, and a slice of a bytearray is a copy (those bytes would be lost)
        self._scratch_view = memoryview(self._scratch)
        self._inbox = bytearray()
        self._sinks: Sequence[memoryview] | None = None
        self._si = 0
        self._pos = 0
        self._waiter: asyncio.Future[None] | None = None
        self._lost: BaseException | None = None
        self._eof = False
        self._paused = False
        #: the connection can carry another request once this one's body is read
        self.reusable = True
        #: requests sent on it (a stale keep-alive connection is retried once, if it was reused)
        self.uses = 0
        #: where it is connected (``scheme://host:port``), for messages
        self.where = "the server"
        #: in its pool between answers: any byte received now is not an answer to anything
        #: asked (a late duplicate, a body after a HEAD, 204 or 304), and the connection is
        #: never used again
        self.idle = False

    def __repr__(self) -> str:
        state = "lost" if self._lost or self._eof else "open"
        return f"<Connection {state} uses={self.uses} inbox={len(self._inbox)}>"

    # protocol callbacks (the loop calls these)
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        sinks = self._sinks
        if sinks is not None and self._si < len(sinks):
            return sinks[self._si][self._pos :]
        return self._scratch_view

    def buffer_updated(self, nbytes: int) -> None:
        sinks = self._sinks
        if sinks is not None and self._si < len(sinks):
            self._pos += nbytes
            if self._pos >= len(sinks[self._si]):
                self._si, self._pos = self._si + 1, 0
                while self._si < len(sinks) and not len(sinks[self._si]):
                    self._si += 1
                if self._si >= len(sinks):
                    self._wake()
            return
        self._inbox += self._scratch_view[:nbytes]
        if self.idle:
            self.reusable = False
        if len(self._inbox) > 4 * _SCRATCH and self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self.reusable = False
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionResetError("the connection was closed")
        self.reusable = False
        self._wake()

    # helpers of the coroutines
    @property
    def closed(self) -> bool:
        return self._lost is not None or self._eof

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _ended(self) -> BaseException:
        return self._lost or ConnectionResetError("the server closed the connection")

    def abort(self) -> None:
        """Drop the connection now (its body unread, or after an error or a cancel)."""
        self.reusable = False
        self._sinks = None
        if self.transport is not None:
            self.transport.abort()

    def send(self, data: bytes) -> None:
        if self.transport is None or self.closed:
            raise self._ended()
        if self._inbox or (not self.reusable and self.uses):
            # bytes no request of this connection asked for: never read as this one's answer
            raise ConnectionError("a connection that holds bytes it was not asked for")
        self.idle = False
        self.uses += 1
        self.transport.write(data)

    async def read_head(self) -> tuple[int, str, dict[str, str]]:
        """The status, reason and headers (lower-case names) of the next answer that is not
        an interim 1xx."""
        while True:
            first = bytes(self._inbox[:9])
            if (len(first) >= 9 or (first and self.closed)) and not (
                first.startswith(b"HTTP/") or b"HTTP/".startswith(first)
            ):
                raise ProtocolMismatchError(self.where, _spoken(first))
            end = self._inbox.find(b"\r\n\r\n")
            if end < 0:
                if len(self._inbox) > MAX_HEAD:
                    raise ConnectionError(f"an answer's head is longer than {MAX_HEAD} bytes")
                if self.closed:
                    raise self._ended()
                await self._wait()
                continue
            head = bytes(self._inbox[:end]).decode("latin-1")
            del self._inbox[: end + 4]
            lines = head.split("\r\n")
            parts = lines[0].split(" ", 2)
            if parts[0].startswith("HTTP/") and not parts[0].startswith("HTTP/1."):
                raise ProtocolMismatchError(self.where, parts[0][:12])
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise ConnectionError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
            status = int(parts[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:
                continue
            if parts[0] == "HTTP/1.0" or "close" in headers.get("connection", "").lower():
                self.reusable = False
            return status, parts[2] if len(parts) > 2 else "", headers

    async def read_exactly_into(self, views: Sequence[memoryview], n: int) -> int:
        """Land the next ``n`` body bytes in ``views`` (``n`` at most their total length);
        the bytes got (fewer: the connection ended)."""
        rest: list[memoryview] = []
        left = n
        for v in views:
            if left <= 0:
                break
            rest.append(v[:left])
            left -= len(rest[-1])
        got = 0
        while self._inbox and rest:  # bytes that came with the head: copied once
            v = rest[0]
            take = min(len(v), len(self._inbox))
            v[:take] = self._inbox[:take]
            del self._inbox[:take]
            got += take
            if take == len(v):
                rest.pop(0)
            else:
                rest[0] = v[take:]
        rest = [v for v in rest if len(v)]
        if not rest:
            return got
        self._sinks, self._si, self._pos = rest, 0, 0
        try:
            while self._si < len(rest) and not self.closed:
                await self._wait()
            landed = sum(len(v) for v in rest[: self._si]) + (
                self._pos if self._si < len(rest) else 0
            )
        finally:
            self._sinks = None
        return got + landed

    async def read_some(self, limit: int) -> bytes:
        """At most ``limit`` bytes of what has arrived (waiting for some); ``b""`` at the end."""
        while not self._inbox:
            if self.closed:
                return b""
            await self._wait()
        out = bytes(self._inbox[:limit])
        del self._inbox[:limit]
        return out

    async def read_line(self, limit: int = 4096) -> bytes:
        while True:
            end = self._inbox.find(b"\r\n")
            if end >= 0:
                line = bytes(self._inbox[:end])
                del self._inbox[: end + 2]
                return line
            if len(self._inbox) > limit:
                raise ConnectionError("a chunk header is too long")
            if self.closed:
                raise self._ended()
            await self._wait()


class Response:
    """An answer whose head is in and whose body is still on the connection: read it with
    :meth:`read_into` or :meth:`read`, or drop it with :meth:`discard` / :meth:`close`; then
    the connection goes back to its pool (when the body was read to its end) or is closed."""

    def __init__(
        self,
        pool: Pool,
        conn: Connection,
        method: str,
        status: int,
        reason: str,
        headers: dict[str, str],
        url: str,
    ) -> None:
        self.pool, self.conn, self.status, self.reason = pool, conn, status, reason
        self.headers, self.url = headers, url
        length = headers.get("content-length")
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.length: int | None = int(length) if length and length.isdigit() else None
        if method == "HEAD" or status in (204, 304) or status < 200:
            self.chunked, self.length = False, 0
        if self.length is None and not self.chunked:
            conn.reusable = False  # the body ends when the connection does
        self._done = self.length == 0

    def _finish(self) -> None:
        self._done = True
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if conn is not None:
            self.pool.release(conn)

    def close(self) -> None:
        """Drop the answer: its connection is closed unless its body was read."""
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done:
            self.pool.release(conn)
        else:
            conn.abort()

    async def read_into(self, views: Sequence[memoryview], n: int) -> int:
        """Land the body, which must be ``n`` bytes, in ``views``: the bytes that landed
        (fewer than ``n``: the connection ended early; the answer is closed)."""
        conn = self.conn
        try:
            if self.chunked:  # rare for a range: decoded, then copied once
                data = await self.read(n)
                pos = 0
                for v in views:
                    take = min(len(v), len(data) - pos)
                    v[:take] = memoryview(data)[pos : pos + take]
                    pos += take
                return len(data)
            got = await conn.read_exactly_into(views, n)
        except BaseException:
            self.close()
            raise
        if got == n and self.length == n:
            self._finish()
        else:
            self.close()
        return got

    async def read(self, limit: int) -> bytearray:
        """The whole body, at most ``limit`` bytes.

        Raised: :class:`BodyTooLongError` past ``limit`` (the answer is closed)."""
        out = bytearray()
        try:
            if self.chunked:
                await self._read_chunked(out, limit)
            elif self.length is not None:
                if self.length > limit:
                    raise BodyTooLongError(limit)
                out = bytearray(self.length)
                got = await self.conn.read_exactly_into([memoryview(out)], self.length)
                if got < self.length:
                    raise ShortReadError(self.url, 0, self.length, got)
            else:
                while piece := await self.conn.read_some(1 << 20):
                    out += piece
                    if len(out) > limit:
                        raise BodyTooLongError(limit)
        except BaseException:
            self.close()
            raise
        if self.length is None and not self.chunked:
            self.close()
        else:
            self._finish()
        return out

    async def _read_chunked(self, out: bytearray, limit: int) -> None:
        conn = self.conn
        while True:
            line = await conn.read_line()
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ConnectionError(f"a bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while await conn.read_line():  # trailers, up to the empty line
                    pass
                return
            if len(out) + size > limit:
                raise BodyTooLongError(limit)
            start = len(out)
            out.extend(bytes(size))
            got = await conn.read_exactly_into([memoryview(out)[start:]], size)
            if got < size:
                raise ShortReadError(self.url, start, start + size, got)
            if await conn.read_line() != b"":
                raise ConnectionError("a chunk is not followed by CRLF")

    async def error(self) -> HTTPStatusError:
        """The error this answer is (its body read for the message, at most
        :data:`MAX_ERROR_BODY` bytes)."""
        try:
            body = bytes(await self.read(MAX_ERROR_BODY))
        except (OSError, asyncio.IncompleteReadError):
            body = b""
        cls = NotFoundError if self.status == 404 else HTTPStatusError
        return cls(self.url, self.status, self.reason, self.headers, body)


def _spoken(head: bytes) -> str:
    """What the first bytes of an answer that is not HTTP/1.x speak: an HTTP/2 frame
    (SETTINGS or GOAWAY on stream 0: an h2c-only port answering an HTTP/1.1 request), TLS (a
    record's header: an https port asked in plain http), or something else."""
    if len(head) >= 9 and head[3] in (0x04, 0x07) and head[5:9] == bytes(4):
        return "HTTP/2 (h2c: HTTP/2 without TLS)"
    if head[:1] == b"\x15" or head[:1] == b"\x16":
        return "TLS (an https:// port asked in plain http://)"
    return f"something that is not HTTP ({head[:9]!r})"


def _readable(conn: Connection) -> bool:
    """Whether ``conn``'s socket has bytes (or an end) the loop has not delivered yet."""
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            return bool(poller.poll(0))
        return bool(select.select([sock.fileno()], [], [], 0)[0])
    except (OSError, ValueError):
        return True  # a socket that cannot be asked is not trusted with an answer


class ProxyError(OSError):
    """A forwarding proxy refused to carry a request (its status, e.g. 407 without or with
    wrong credentials, 403, 502), named without the proxy's ``user:pass@``."""

    def __init__(self, proxy: str, status: int, reason: str, target: str) -> None:
        super().__init__(f"the proxy {proxy} answered {status} {reason} for {target}")
        self.proxy, self.status, self.target = proxy, status, target


class Pool:
    """Keep-alive connections to one origin (``scheme``, ``host``, ``port``); TLS through the
    loop's ``ssl`` with ``ssl_context``; through the forwarding ``proxy``
    (``http://[user:pass@]host:port``) where one is given: an ``http://`` origin's requests
    are sent to it with an absolute URI, an ``https://`` origin is reached by ``CONNECT`` and
    TLS with the origin inside the tunnel. Mutable state: the idle connections (most recent
    last) and whether it is closed."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        ssl_context: _ssl.SSLContext | None,
        *,
        max_idle: int = 256,
        proxy: str | None = None,
    ) -> None:
        self.scheme, self.host, self.port = scheme, host, port
        self.ssl = ssl_context if scheme == "https" else None
        self.max_idle = max_idle
        self._proxy: tuple[str, int, str | None, str] | None = None
        if proxy:
            p = urlsplit(proxy)
            auth = None
            if p.username is not None:
                raw = f"{unquote(p.username)}:{unquote(p.password or '')}".encode()
                auth = "Basic " + base64.b64encode(raw).decode("ascii")
            shown = f"http://{p.hostname}:{p.port or 80}"  # never its user:pass@
            self._proxy = (p.hostname or "", p.port or 80, auth, shown)
        self._idle: list[Connection] = []
        self._closed = False
        #: connections opened (for tests and stats)
        self.opened = 0

    def __repr__(self) -> str:
        return (
            f"<Pool {self.scheme}://{self.host}:{self.port} idle={len(self._idle)} "
            f"opened={self.opened}>"
        )

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def proxy(self) -> str | None:
        """The proxy's ``http://host:port`` (without credentials), or ``None``."""
        return self._proxy[3] if self._proxy else None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        host, port = (self._proxy[0], self._proxy[1]) if self._proxy else (self.host, self.port)
        direct_tls = self.ssl if self._proxy is None else None
        try:
            _, conn = await loop.create_connection(
                Connection,
                host,
                port,
                ssl=direct_tls,
                server_hostname=self.host if direct_tls is not None else None,
            )
        except (ConnectionRefusedError, socket.gaierror) as exc:  # named with the endpoint
            where = self.proxy or f"{self.scheme}://{self.host_header}"
            what = "the proxy " if self._proxy else ""
            raise type(exc)(
                exc.errno, f"could not connect to {what}{where} ({exc.strerror})"
            ) from exc
        self.opened += 1
        conn.where = f"{self.scheme}://{self.host_header}"
        if self._proxy is not None and self.ssl is not None:
            try:
                await self._tunnel(conn)
            except BaseException:
                conn.abort()
                raise
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return conn

    async def _tunnel(self, conn: Connection) -> None:
        """``CONNECT host:port`` through the proxy on ``conn``, then TLS with the origin
        inside the tunnel (its certificate checked against the origin's name)."""
        assert self._proxy is not None and self.ssl is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        authority = f"{host}:{self.port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if self._proxy[2]:
            lines.append(f"Proxy-Authorization: {self._proxy[2]}")
        conn.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        conn.where = self._proxy[3]
        status, reason, _ = await conn.read_head()
        if status != 200:
            raise ProxyError(self._proxy[3], status, reason, f"CONNECT {authority}")
        if conn._inbox:
            raise ConnectionError(f"the proxy {self._proxy[3]} sent bytes past its CONNECT answer")
        loop = asyncio.get_running_loop()
        assert conn.transport is not None
        tls = await loop.start_tls(conn.transport, conn, self.ssl, server_hostname=self.host)
        conn.transport = tls
        conn.where = f"{self.scheme}://{self.host_header}"
        conn.uses = 0  # the tunnel's CONNECT is not a request of the origin's

    def release(self, conn: Connection) -> None:
        """Keep ``conn`` for the next request (its answer was read whole), unless it holds a
        byte past that answer, was told to close, or the pool is full or closed."""
        if (
            self._closed
            or not conn.reusable
            or conn.closed
            or conn._inbox  # bytes past the answer: not to be taken for the next one
            or len(self._idle) >= self.max_idle
        ):
            conn.abort()
            return
        conn.idle = True
        self._idle.append(conn)

    def _take_idle(self) -> Connection | None:
        """The most recent idle connection that is still clean: open, nothing received
        while it was idle, nothing waiting in its socket (bytes the loop has not delivered
        yet: a late answer still on its way in); the others are closed."""
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or not conn.reusable or conn._inbox or _readable(conn):
                conn.abort()
                continue
            return conn
        return None

    async def request(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        url: str,
        sent: Callable[[], None] | None = None,
    ) -> Response:
        """Send ``method target`` with ``headers`` on an idle connection (one the server has
        closed is dropped) or a new one (``sent`` called once it is written), and wait for the
        answer's head."""
        if self._closed:
            raise ConnectionError("the connection pool is closed")
        if self._proxy is not None and self.ssl is None:  # plain http through the proxy
            target = f"http://{self.host_header}{target}"
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if self._proxy is not None and self.ssl is None and self._proxy[2]:
            lines.append(f"Proxy-Authorization: {self._proxy[2]}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = self._take_idle()
        if conn is None:
            conn = await self._connect()
        try:
            conn.send(data)
            if sent is not None:
                sent()
            status, reason, head = await conn.read_head()
        except BaseException:
            # a reset or cancel, even of a reused connection: asyncload's retry policy is the
            # only one (nothing is re-sent here)
            conn.abort()
            raise
        return Response(self, conn, method, status, reason, head, url)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
