"""A scripted HTTP/1.1 fault proxy for tests: errors, resets, stalls, slow links.

:class:`FaultProxy` listens on a free port of 127.0.0.1 and forwards to one
upstream ``http://127.0.0.1:PORT`` (a loopback server of
:mod:`asyncload.testing.servers`). It runs its own asyncio loop in a daemon
thread, so sync and async tests use it alike::

    with S3Server() as s3, FaultProxy(s3) as proxy:
        rule = proxy.add_rule(status(503), data_only=True, times=2)
        fs = s3fs.S3FileSystem(**s3.storage_options(proxy.endpoint_url))
        fs.cat_file("bucket/key", start=0, end=100)    # two 503s, then data
        assert rule.fired == 2

It parses HTTP/1.1 framing in both directions (``Content-Length`` and
chunked bodies, bodies read until close, ``HEAD``/204/304 without body,
``Expect: 100-continue``), so faults target *one request* even on a keep-alive
connection that carries many. Each client connection gets its own upstream
connection, kept alive while the upstream allows it and reopened when it does
not: a client asking for keep-alive keeps its connection even in front of a
server that closes after every response (werkzeug/moto), as long as the body
is framed; only that ``Connection: close`` header is dropped. ``Host`` and
every other header pass through untouched (S3 signatures stay valid).

Rules are tried in the order added; the first whose matcher matches *and*
that fires (``skip``/``times``/``probability``) applies its action to that
request; other requests pass through byte for byte. Actions:

* :func:`delay` - wait, then forward;
* :func:`status` - answer an error without forwarding (S3 XML / GCS JSON /
  plain body by ``flavor``, optional ``Retry-After``); the connection stays usable;
* :func:`reset` - abort the client connection with a TCP RST (optionally after
  forwarding the headers and some body bytes);
* :func:`truncate` - forward headers and the first ``nbytes`` of the body, then close;
* :func:`stall` - send nothing (or stop after ``after_bytes`` of body) until the
  time passes, the client goes away or the proxy stops; then close;
* :func:`trickle` - forward with the body paced at ``bytes_per_second``;
* :func:`shift_range` - forward with the request's ``Range`` moved by some bytes: the
  answer (a true ``Content-Range`` for the moved range) is for another range than the
  client asked for, as from a cache that keys ranges by URL;
* :func:`overlong` - forward, then send ``extra`` bytes more than the body (its
  ``Content-Length`` raised to match, its ``Content-Range`` unchanged).

A redirect is :func:`status` with a ``Location`` header (``status(302, headers={"Location":
other.endpoint_url + path})``).

Global knobs, settable at any time: ``latency`` (one-way seconds added to each
request and each response, so +2x per round trip) and ``bandwidth`` (bytes/s
for all body bytes through the proxy, both directions, token bucket).

Stopping closes every connection and ends every stall at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import itertools
import json
import logging
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol
from xml.sax.saxutils import escape as xml_escape

if TYPE_CHECKING:
    from typing import Self

logger = logging.getLogger("asyncload.testing")

__all__ = [
    "Action",
    "Delay",
    "FaultProxy",
    "FaultProxyError",
    "Flavor",
    "LogEntry",
    "Overlong",
    "Reset",
    "Rule",
    "ShiftRange",
    "Stall",
    "Status",
    "Trickle",
    "Truncate",
    "delay",
    "overlong",
    "reset",
    "shift_range",
    "stall",
    "status",
    "trickle",
    "truncate",
]

Flavor = Literal["s3", "gcs", "http"]

_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})
_PIECE = 64 * 1024  # bytes read from upstream at a time
_SLICE = 16 * 1024  # bytes written at a time when pacing (bandwidth)
_HEAD_LIMIT = 1 << 20  # longest request/response head accepted
_proxy_ids = itertools.count(1)


class FaultProxyError(RuntimeError):
    """Raised by :meth:`FaultProxy.start` when the proxy cannot listen, and by
    ``endpoint_url``/``port`` when it is not started."""


class _ProtocolError(Exception):
    """A peer sent something that is not HTTP/1.x (connection is dropped)."""


# ---------------------------------------------------------------------------
# actions
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """Base class of the things a rule does to a request."""

    def describe(self) -> str:
        """Short text used in :class:`LogEntry`.action, e.g. ``status(503)``."""
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Delay(Action):
    """Wait ``seconds`` (on top of ``latency``), then forward normally."""

    seconds: float

    def describe(self) -> str:
        return f"delay({self.seconds:g})"


@dataclass(frozen=True)
class Status(Action):
    """Answer ``code`` without forwarding.

    ``body`` None picks a document the client classifies by the proxy's
    flavor: S3 ``<Error><Code>...`` XML (``error_code`` or a default per
    status: 403 AccessDenied, 404 NoSuchKey, 429/503 SlowDown, 500
    InternalError...), GCS JSON ``{"error": {...}}``, or plain text.
    ``retry_after`` (seconds, or an HTTP date string) adds ``Retry-After``.
    """

    code: int
    retry_after: float | str | None = None
    body: bytes | str | None = None
    error_code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return f"status({self.code})"


@dataclass(frozen=True)
class Reset(Action):
    """Abort the client connection with a TCP RST (SO_LINGER 0).

    ``after_bytes`` None: before forwarding (the upstream never sees the
    request). Otherwise forward, send the headers and ``after_bytes`` body
    bytes, then reset.
    """

    after_bytes: int | None = None

    def describe(self) -> str:
        return "reset" if self.after_bytes is None else f"reset(after_bytes={self.after_bytes})"


@dataclass(frozen=True)
class Truncate(Action):
    """Forward, send the headers (length unchanged) and ``nbytes`` of body, then close (FIN).

    Bytes count what is on the wire after the headers (chunk framing included
    for a chunked response).
    """

    nbytes: int

    def describe(self) -> str:
        return f"truncate({self.nbytes})"


@dataclass(frozen=True)
class Stall(Action):
    """Hang: send nothing for ``seconds`` (None: until the client leaves or the proxy stops), then close.

    ``after_bytes`` None: hang before forwarding (no headers). Otherwise
    forward, send the headers and ``after_bytes`` body bytes, then hang.
    """

    seconds: float | None = None
    after_bytes: int | None = None

    def describe(self) -> str:
        extra = "" if self.after_bytes is None else f", after_bytes={self.after_bytes}"
        return f"stall({'None' if self.seconds is None else format(self.seconds, 'g')}{extra})"


@dataclass(frozen=True)
class Trickle(Action):
    """Forward, pacing the response body at ``bytes_per_second``."""

    bytes_per_second: float

    def describe(self) -> str:
        return f"trickle({self.bytes_per_second:g})"


@dataclass(frozen=True)
class ShiftRange(Action):
    """Forward with the request's ``Range: bytes=a-b`` moved to ``a+offset-b+offset``."""

    offset: int

    def describe(self) -> str:
        return f"shift_range({self.offset})"


@dataclass(frozen=True)
class Overlong(Action):
    """Forward, then send ``extra`` filler bytes after the body, its ``Content-Length`` raised
    by as many (``Content-Range`` unchanged). :attr:`FaultProxy.extra_bytes_sent` counts what
    the client took of them."""

    extra: int

    def describe(self) -> str:
        return f"overlong({self.extra})"


def shift_range(offset: int) -> ShiftRange:
    """Action: forward with the ``Range`` header moved by ``offset`` bytes (another range is answered)."""
    return ShiftRange(int(offset))


def overlong(extra: int) -> Overlong:
    """Action: forward, then send ``extra`` bytes more than the body (``Content-Length`` raised to match)."""
    if extra <= 0:
        raise ValueError("extra must be > 0")
    return Overlong(int(extra))


def delay(seconds: float) -> Delay:
    """Action: add ``seconds`` of latency before forwarding this request."""
    if seconds < 0:
        raise ValueError("delay must be >= 0")
    return Delay(float(seconds))


def status(
    code: int,
    retry_after: float | str | None = None,
    body: bytes | str | None = None,
    *,
    error_code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Status:
    """Action: answer ``code`` (e.g. 500, 503, 429, 403, 404) without forwarding."""
    if not 200 <= code <= 599:
        raise ValueError(f"status code {code} out of range 200..599")
    return Status(code, retry_after, body, error_code, tuple((headers or {}).items()))


def reset(after_bytes: int | None = None) -> Reset:
    """Action: abort the connection with an RST (before forwarding, or after ``after_bytes`` of body)."""
    if after_bytes is not None and after_bytes < 0:
        raise ValueError("after_bytes must be >= 0")
    return Reset(after_bytes)


def truncate(nbytes: int) -> Truncate:
    """Action: forward but cut the response body after ``nbytes`` and close."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    return Truncate(nbytes)


def stall(seconds: float | None = None, *, after_bytes: int | None = None) -> Stall:
    """Action: send nothing for ``seconds`` (None: until the proxy stops), then close."""
    if seconds is not None and seconds < 0:
        raise ValueError("stall seconds must be >= 0")
    if after_bytes is not None and after_bytes < 0:
        raise ValueError("after_bytes must be >= 0")
    return Stall(seconds, after_bytes)


def trickle(bytes_per_second: float) -> Trickle:
    """Action: forward with the response body slowed to ``bytes_per_second``."""
    if bytes_per_second <= 0:
        raise ValueError("bytes_per_second must be > 0")
    return Trickle(float(bytes_per_second))


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
        return {t.strip().lower() for k, v in self.headers if k.lower() == name for t in v.split(",")}

    @property
    def keep_alive(self) -> bool:
        conn = self.tokens("connection")
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


# S3 sub-resources whose GET is not an object read.
_S3_SUBRESOURCES = frozenset(
    {
        "accelerate", "acl", "analytics", "attributes", "cors", "delete", "encryption", "intelligent-tiering",
        "inventory", "legal-hold", "lifecycle", "list-type", "location", "logging", "metrics", "notification",
        "object-lock", "ownershipControls", "policy", "policyStatus", "publicAccessBlock", "replication",
        "requestPayment", "restore", "retention", "select", "tagging", "torrent", "uploadId", "uploads",
        "versioning", "versions", "website",
    }
)  # fmt: skip


def _is_data_request(req: _Request, flavor: Flavor) -> bool:
    """Whether ``req`` reads object bytes (what a checkpoint loader's chunk reads are)."""
    if req.method != "GET":
        return False
    if flavor == "http":
        return True
    if flavor == "gcs":  # JSON API media GETs, or XML API GETs /bucket/object (obstore's)
        xml = bool(req.path.lstrip("/").partition("/")[2]) and not req.path.startswith(
            ("/storage/", "/upload/", "/download/", "/batch/", "/_internal/")
        )
        return "alt=media" in req.query or req.path.startswith("/download/") or xml
    bucket, _, key = req.path.lstrip("/").partition("/")
    if not bucket or not key:
        return False
    params = {k for k, _ in urllib.parse.parse_qsl(req.query, keep_blank_values=True)}
    return not (params & _S3_SUBRESOURCES)


@dataclass(eq=False)
class Rule:
    """A matcher plus an action; returned by :meth:`FaultProxy.add_rule`.

    Matcher (all given conditions must hold): ``method`` (one or several,
    case-insensitive); ``path`` (a substring of the request target - path and
    query, as sent or percent-decoded - or a compiled regex searched in it);
    ``range_only`` (the request has a ``Range`` header); ``data_only`` (an
    object-data GET for the proxy's flavor: S3 ``GET /bucket/key`` without a
    sub-resource query, GCS ``alt=media``, any HTTP GET).

    Firing: the first ``skip`` matching requests pass; then it fires on the
    next ``times`` matches (None: every one), each with ``probability``
    (None: always) drawn from the proxy's seeded RNG.

    Counters (read them from any thread): ``matched`` requests that matched,
    ``fired`` requests the action was applied to.
    """

    action: Action
    method: frozenset[str] | None = None
    path: str | re.Pattern[str] | None = None
    range_only: bool = False
    data_only: bool = False
    times: int | None = 1
    probability: float | None = None
    skip: int = 0
    matched: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def matches(self, req: _Request, flavor: Flavor) -> bool:
        """Whether the matcher (not the firing schedule) accepts ``req``."""
        if self.method is not None and req.method.upper() not in self.method:
            return False
        if self.path is not None:
            decoded = urllib.parse.unquote(req.target)
            if isinstance(self.path, re.Pattern):
                if not (self.path.search(req.target) or self.path.search(decoded)):
                    return False
            elif self.path not in req.target and self.path not in decoded:
                return False
        if self.range_only and req.header("range") is None:
            return False
        return not self.data_only or _is_data_request(req, flavor)

    @property
    def exhausted(self) -> bool:
        """True once the rule has fired ``times`` times."""
        return self.times is not None and self.fired >= self.times

    def __repr__(self) -> str:
        return (
            f"<Rule {self.action.describe()} method={sorted(self.method) if self.method else None} "
            f"path={self.path!r} range_only={self.range_only} data_only={self.data_only} "
            f"times={self.times} probability={self.probability} skip={self.skip} "
            f"matched={self.matched} fired={self.fired}>"
        )


@dataclass(frozen=True)
class LogEntry:
    """One request seen by the proxy: what it was and what was done to it.

    ``action`` is ``"forward"`` or the rule's ``Action.describe()``, e.g.
    ``"status(503)"``; ``rule`` is the :class:`Rule` that fired, or None.
    """

    method: str
    path: str
    query: str
    range: str | None
    action: str
    rule: Rule | None = field(default=None, compare=False)


class _HasEndpoint(Protocol):
    @property
    def endpoint_url(self) -> str: ...


# ---------------------------------------------------------------------------
# pacing
# ---------------------------------------------------------------------------
class _TokenBucket:
    """A shared byte budget refilled at ``rate`` bytes/s (debt-based: fair enough, exact on average)."""

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


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of one loopback upstream, with scripted faults.

    ``upstream``: ``"http://127.0.0.1:PORT"`` or an object with ``endpoint_url``
    (a server of :mod:`asyncload.testing.servers`). ``flavor`` chooses error
    bodies and what ``data_only`` means; None infers it from the server's
    ``protocol`` (``s3``/``gs``/``http``), else ``"http"``. ``seed`` seeds the
    RNG of probabilistic rules. ``port`` None picks a free one.

    Raised by the constructor: ValueError when the upstream is not
    ``http://127.0.0.1`` or ``localhost``.
    """

    def __init__(
        self,
        upstream: str | _HasEndpoint,
        *,
        flavor: Flavor | None = None,
        latency: float = 0.0,
        bandwidth: float | None = None,
        seed: int = 0,
        port: int | None = None,
    ) -> None:
        url = upstream if isinstance(upstream, str) else upstream.endpoint_url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or parts.hostname not in _LOOPBACK_HOSTS or not parts.port:
            raise ValueError(f"upstream must be http://127.0.0.1:PORT, not {url!r}")
        self.upstream_url = f"http://127.0.0.1:{parts.port}"
        self._up_port = parts.port
        if flavor is None:
            proto = getattr(upstream, "protocol", "http")
            flavor = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(str(proto), "http")  # type: ignore[assignment]
        if flavor not in ("s3", "gcs", "http"):
            raise ValueError(f"flavor must be 's3', 'gcs' or 'http', not {flavor!r}")
        self.flavor: Flavor = flavor
        self.latency = latency
        self.bandwidth = bandwidth
        self._rng = random.Random(seed)
        self._requested_port = port
        self._id = next(_proxy_ids)
        self.thread_name = f"asyncload-fault-proxy-{self._id}"

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._rules: list[Rule] = []
        self._log: list[LogEntry] = []
        self._requests_seen = 0
        self._connections_accepted = 0
        self._faults_applied = 0
        #: filler bytes of :func:`overlong` answers the client took (written to its socket)
        self.extra_bytes_sent = 0

        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._port: int | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._bucket = _TokenBucket()
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> Self:
        """Listen on 127.0.0.1 and serve from a daemon thread; returns self.

        Raised: FaultProxyError when the port cannot be bound. No-op if running.
        """
        if self._thread is not None:
            return self
        ready = threading.Event()
        error: list[BaseException] = []
        self._stopping = False
        thread = threading.Thread(target=self._run, args=(ready, error), name=self.thread_name, daemon=True)
        thread.start()
        ready.wait()
        if error:
            thread.join()
            raise FaultProxyError(f"fault proxy could not listen: {error[0]}") from error[0]
        self._thread = thread
        logger.info("fault proxy %s -> %s started (%s)", self.endpoint_url, self.upstream_url, self.flavor)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection, end stalls, join the thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        self._stopping = True
        try:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            fut.result(timeout)
        except Exception:  # keep going: the loop must stop
            logger.exception("fault proxy shutdown did not finish cleanly")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if thread.is_alive():
            logger.error("fault proxy thread %s did not stop within %.1f s", self.thread_name, timeout)
        self._thread = None
        self._port = None
        with self._cond:
            self._cond.notify_all()
        logger.info("fault proxy %s stopped", self.thread_name)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._thread is not None

    @property
    def port(self) -> int:
        """Listening port. Raised: FaultProxyError when not started."""
        if self._port is None:
            raise FaultProxyError("fault proxy is not started")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy. Raised: FaultProxyError when not started."""
        return f"http://127.0.0.1:{self.port}"

    def __repr__(self) -> str:
        where = f"{self.endpoint_url} -> " if self._port else ""
        return f"<FaultProxy {where}{self.upstream_url} {self.flavor} rules={len(self._rules)}>"

    # -- scripting ----------------------------------------------------------
    def add_rule(
        self,
        action: Action,
        *,
        method: str | Iterable[str] | None = None,
        path: str | re.Pattern[str] | None = None,
        range_only: bool = False,
        data_only: bool = False,
        times: int | None = 1,
        probability: float | None = None,
        skip: int = 0,
    ) -> Rule:
        """Append a rule (see :class:`Rule`) and return it; its counters are live.

        Raised: ValueError for ``times`` < 1, ``skip`` < 0 or a probability outside [0, 1].
        """
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None (every time)")
        if skip < 0:
            raise ValueError("skip must be >= 0")
        if probability is not None and not 0.0 <= probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")
        if not isinstance(action, Action):
            raise TypeError(f"action must be an Action (delay(), status(), ...), not {action!r}")
        methods: frozenset[str] | None = None
        if method is not None:
            methods = frozenset([method.upper()] if isinstance(method, str) else (m.upper() for m in method))
        rule = Rule(action, methods, path, range_only, data_only, times, probability, skip)
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        """Remove one rule (no error if already gone)."""
        with self._lock, contextlib.suppress(ValueError):
            self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule (counters and log are kept; see :meth:`reset_counters`)."""
        with self._lock:
            self._rules.clear()

    def reset_counters(self) -> None:
        """Zero ``requests_seen``/``connections_accepted``/``faults_applied`` and empty the log."""
        with self._lock:
            self._log.clear()
            self._requests_seen = 0
            self._connections_accepted = 0
            self._faults_applied = 0

    @property
    def rules(self) -> list[Rule]:
        """A copy of the rule list, in matching order."""
        with self._lock:
            return list(self._rules)

    @property
    def log(self) -> list[LogEntry]:
        """A copy of the request log, oldest first."""
        with self._lock:
            return list(self._log)

    @property
    def requests_seen(self) -> int:
        """Requests read from clients so far."""
        return self._requests_seen

    @property
    def connections_accepted(self) -> int:
        """Client connections accepted so far (keep-alive reuse keeps this low)."""
        return self._connections_accepted

    @property
    def faults_applied(self) -> int:
        """Requests a rule fired on, all rules together."""
        return self._faults_applied

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``requests_seen >= count``; False on timeout or stop."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._requests_seen < count:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
            return True

    # -- event loop thread --------------------------------------------------
    def _run(self, ready: threading.Event, error: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                server = loop.run_until_complete(
                    asyncio.start_server(self._on_client, "127.0.0.1", self._requested_port or 0, limit=_HEAD_LIMIT)
                )
            except BaseException as exc:
                error.append(exc)
                ready.set()
                return
            self._server = server
            self._port = int(server.sockets[0].getsockname()[1])
            ready.set()
            loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._loop = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close_upstream()
            conn.writer.transport.abort()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Conn(reader, writer)
        self._tasks.add(task)
        self._conns.add(conn)
        with self._lock:
            self._connections_accepted += 1
        with contextlib.suppress(OSError):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._stopping:
                req = await self._read_request(conn)
                if req is None:
                    break
                if not await self._serve(conn, req):
                    break
        except asyncio.CancelledError:
            pass
        except (ConnectionError, asyncio.IncompleteReadError, _ProtocolError, asyncio.LimitOverrunError) as exc:
            logger.debug("fault proxy connection ended: %r", exc)
        except Exception:  # a proxy bug must not kill the loop
            logger.exception("fault proxy: unexpected error on a connection")
        finally:
            conn.close_upstream()
            if not writer.transport.is_closing():
                if self._stopping:
                    writer.transport.abort()
                else:
                    writer.close()
            self._conns.discard(conn)
            self._tasks.discard(task)

    # -- HTTP parsing -------------------------------------------------------
    async def _read_request(self, conn: _Conn) -> _Request | None:
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

    # -- serving ------------------------------------------------------------
    def _decide(self, req: _Request) -> tuple[Rule | None, Action | None]:
        with self._cond:
            self._requests_seen += 1
            chosen: Rule | None = None
            for rule in self._rules:
                if not rule.matches(req, self.flavor):
                    continue
                rule.matched += 1
                if rule.matched <= rule.skip or rule.exhausted:
                    continue
                if rule.probability is not None and self._rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                self._faults_applied += 1
                chosen = rule
                break
            action = chosen.action if chosen else None
            description = action.describe() if action else "forward"
            self._log.append(LogEntry(req.method, req.path, req.query, req.header("range"), description, chosen))
            self._cond.notify_all()
        if chosen is not None:
            logger.debug("fault proxy %s: %s %s -> %s", self.thread_name, req.method, req.target, action)
        return chosen, action

    async def _serve(self, conn: _Conn, req: _Request) -> bool:
        """Handle one request; True when the client connection stays usable."""
        _rule, action = self._decide(req)
        if self.latency > 0:
            await asyncio.sleep(self.latency)
        if isinstance(action, Delay):
            await asyncio.sleep(action.seconds)
        if isinstance(action, Reset) and action.after_bytes is None:
            _abort_with_rst(conn.writer)
            return False
        if isinstance(action, Stall) and action.after_bytes is None:
            await self._stall(conn, action.seconds)
            return False
        if isinstance(action, Status):
            if self.latency > 0:
                await asyncio.sleep(self.latency)
            conn.writer.write(self._error_response(req, action))
            await conn.writer.drain()
            return req.keep_alive

        if isinstance(action, ShiftRange):
            req.headers = [(k, _shift_range(v, action.offset) if k.lower() == "range" else v) for k, v in req.headers]
        # forward
        try:
            head, code, resp_headers = await self._exchange(conn, req)
        except (OSError, asyncio.IncompleteReadError, _ProtocolError) as exc:
            logger.warning(
                "fault proxy: upstream %s failed for %s %s: %r", self.upstream_url, req.method, req.target, exc
            )
            conn.close_upstream()
            conn.writer.write(_simple_response(502, b"fault proxy: upstream failed\n", close=True))
            await conn.writer.drain()
            return False
        assert conn.up_reader is not None
        up_reader = conn.up_reader
        te = {t.strip().lower() for k, v in resp_headers if k.lower() == "transfer-encoding" for t in v.split(",")}
        resp_conn = {t.strip().lower() for k, v in resp_headers if k.lower() == "connection" for t in v.split(",")}
        body: AsyncIterator[bytes] | None
        until_close = False
        if req.method == "HEAD" or code in (204, 304) or 100 <= code < 200:
            body = None
        elif "chunked" in te:
            body = _read_chunked(up_reader)
        else:
            length = _content_length(resp_headers)
            if length is None:
                until_close = True
                body = _read_until_eof(up_reader)
            else:
                body = _read_exact(up_reader, length)
        upstream_keeps = not until_close and "close" not in resp_conn and head.startswith(b"HTTP/1.1")
        client_keeps = req.keep_alive and not until_close
        if client_keeps and "close" in resp_conn:
            # The upstream closes after each response (werkzeug, so moto, always
            # does); the body is framed, so keep the client's connection alive
            # and reconnect upstream for the next request, as real S3 would.
            head = _without_connection_close(head)

        if isinstance(action, Overlong):
            length = _content_length(resp_headers)
            if length is None or body is None:
                action = None  # nothing to lengthen
            else:
                head = re.sub(
                    rb"(?im)^content-length:[ \t]*\d+",
                    f"Content-Length: {length + action.extra}".encode(),
                    head,
                )
        if self.latency > 0:
            await asyncio.sleep(self.latency)
        conn.writer.write(head)
        await conn.writer.drain()

        limit: int | None = None
        if isinstance(action, Truncate):
            limit = action.nbytes
        elif isinstance(action, (Reset, Stall)):
            limit = action.after_bytes
        rate = action.bytes_per_second if isinstance(action, Trickle) else None

        completed = await self._relay(conn, body, limit, rate) if body is not None else True
        if completed and isinstance(action, Overlong):
            await self._filler(conn, action.extra)
            conn.close_upstream()
            return False
        if limit is not None or not completed:
            conn.close_upstream()
            if isinstance(action, Reset):
                _abort_with_rst(conn.writer)
            elif isinstance(action, Stall):
                await self._stall(conn, action.seconds)
            return False
        if not upstream_keeps:
            conn.close_upstream()
        return client_keeps

    async def _exchange(self, conn: _Conn, req: _Request) -> tuple[bytes, int, list[tuple[str, str]]]:
        """Send ``req`` upstream and read the final response head (1xx skipped)."""
        for attempt in (0, 1):
            reused = conn.up_writer is not None
            if conn.up_writer is None:
                conn.up_reader, conn.up_writer = await asyncio.open_connection(
                    "127.0.0.1", self._up_port, limit=_HEAD_LIMIT
                )
                with contextlib.suppress(OSError):
                    conn.up_writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert conn.up_reader is not None and conn.up_writer is not None
            try:
                lines = [f"{req.method} {req.target} {req.version}"] + [f"{k}: {v}" for k, v in req.headers]
                conn.up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                if req.body:
                    await self._send(conn.up_writer, req.body, None)
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

    async def _relay(self, conn: _Conn, body: AsyncIterator[bytes], limit: int | None, rate: float | None) -> bool:
        """Copy the response body to the client; False if cut short (limit) or upstream failed."""
        sent = 0
        start = time.monotonic()
        try:
            async with contextlib.aclosing(body):  # type: ignore[type-var]
                async for piece in body:
                    if limit is not None and sent + len(piece) >= limit:
                        await self._send(conn.writer, piece[: limit - sent], rate, start, sent)
                        return False
                    await self._send(conn.writer, piece, rate, start, sent)
                    sent += len(piece)
        except (asyncio.IncompleteReadError, _ProtocolError, ConnectionError) as exc:
            # The upstream broke mid-body (the client must see a broken body
            # too) or the client left: either way this connection is done.
            logger.debug("fault proxy: body relay ended after %d bytes: %r", sent, exc)
            conn.writer.transport.abort()
            return False
        return limit is None

    async def _filler(self, conn: _Conn, extra: int) -> bool:
        """Send ``extra`` filler bytes (an over-long body); False when the client left first."""
        piece = b"\xa5" * _PIECE
        left = extra
        try:
            while left > 0 and not self._stopping:
                n = min(_PIECE, left)
                conn.writer.write(piece[:n])
                await conn.writer.drain()
                left -= n
                with self._lock:
                    self.extra_bytes_sent += n
        except ConnectionError:
            return False
        return left == 0

    async def _send(
        self, writer: asyncio.StreamWriter, data: bytes, rate: float | None, start: float = 0.0, before: int = 0
    ) -> None:
        """Write ``data`` honouring the bandwidth cap and an optional per-request ``rate``."""
        if not data:
            return
        bandwidth = self.bandwidth
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
                await self._bucket.take(len(piece), bandwidth)
            writer.write(piece)
            await writer.drain()

    async def _stall(self, conn: _Conn, seconds: float | None) -> None:
        """Hold the connection silent until ``seconds`` pass, the client leaves, or stop."""
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        while not self._stopping and not conn.client_gone():
            step = 0.05 if deadline is None else min(0.05, deadline - loop.time())
            if step <= 0:
                break
            await asyncio.sleep(step)

    def _error_response(self, req: _Request, action: Status) -> bytes:
        code = action.code
        try:
            phrase = http.HTTPStatus(code).phrase
        except ValueError:
            phrase = "Error"
        headers: list[tuple[str, str]] = []
        if action.body is not None:
            body = action.body.encode() if isinstance(action.body, str) else action.body
            ctype = "application/xml" if body.lstrip().startswith(b"<") else "text/plain"
        elif self.flavor == "s3":
            s3_code = action.error_code or _S3_CODES.get(code, "InternalError" if code >= 500 else "InvalidRequest")
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{xml_escape(s3_code)}</Code><Message>{xml_escape(phrase)} (fault proxy)</Message>"
                f"<Resource>{xml_escape(req.path)}</Resource><RequestId>faultproxy{self._requests_seen}</RequestId>"
                "</Error>"
            ).encode()
            ctype = "application/xml"
            headers.append(("x-amz-request-id", f"faultproxy{self._requests_seen}"))
        elif self.flavor == "gcs":
            reason = action.error_code or _GCS_REASONS.get(code, "backendError" if code >= 500 else "invalid")
            message = f"{phrase} (fault proxy)"
            doc = {
                "error": {
                    "code": code,
                    "message": message,
                    "errors": [{"domain": "global", "reason": reason, "message": message}],
                }
            }
            body = json.dumps(doc).encode()
            ctype = "application/json; charset=UTF-8"
        else:
            body = f"{code} {phrase} (fault proxy)\n".encode()
            ctype = "text/plain"
        if req.method == "HEAD" or code in (204, 304):
            body = b""
        headers.append(("Content-Type", ctype))
        if action.retry_after is not None:
            ra = action.retry_after
            headers.append(("Retry-After", ra if isinstance(ra, str) else f"{ra:g}"))
        headers.extend(action.headers)
        return _build_response(code, phrase, headers, body, close=not req.keep_alive)


_S3_CODES = {
    400: "InvalidRequest",
    401: "AccessDenied",
    403: "AccessDenied",
    404: "NoSuchKey",
    405: "MethodNotAllowed",
    409: "OperationAborted",
    412: "PreconditionFailed",
    416: "InvalidRange",
    429: "SlowDown",
    500: "InternalError",
    501: "NotImplemented",
    503: "SlowDown",
}
_GCS_REASONS = {
    400: "invalid",
    401: "required",
    403: "forbidden",
    404: "notFound",
    412: "conditionNotMet",
    416: "requestedRangeNotSatisfiable",
    429: "rateLimitExceeded",
    500: "backendError",
    503: "backendError",
}


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


def _build_response(code: int, phrase: str, headers: list[tuple[str, str]], body: bytes, *, close: bool) -> bytes:
    lines = [f"HTTP/1.1 {code} {phrase}", "Server: asyncload-fault-proxy", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _simple_response(code: int, body: bytes, *, close: bool) -> bytes:
    return _build_response(code, http.HTTPStatus(code).phrase, [("Content-Type", "text/plain")], body, close=close)


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Close the connection so the peer gets a TCP RST (SO_LINGER on, 0 s)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
