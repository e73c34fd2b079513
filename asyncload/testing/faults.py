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
* :func:`trailing` - forward, then send bytes nothing asked for in a packet of their own
  (a late duplicate answer, a body after a HEAD, 204 or 304);
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
import itertools
import logging
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from asyncload.testing._http import (
    _HEAD_LIMIT,
    _PIECE,
    Flavor,
    _abort_with_rst,
    _Conn,
    _content_length,
    _exchange,
    _ProtocolError,
    _read_chunked,
    _read_exact,
    _read_request,
    _read_until_eof,
    _relay,
    _Request,
    _shift_range,
    _simple_response,
    _TokenBucket,
    _without_connection_close,
)
from asyncload.testing._rules import (
    Action,
    Delay,
    LogEntry,
    Overlong,
    Reset,
    Rule,
    ShiftRange,
    Stall,
    Status,
    Trailing,
    Trickle,
    Truncate,
    _error_response,
    delay,
    overlong,
    reset,
    shift_range,
    stall,
    status,
    trailing,
    trickle,
    truncate,
)

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
    "Trailing",
    "Trickle",
    "Truncate",
    "delay",
    "overlong",
    "reset",
    "shift_range",
    "stall",
    "status",
    "trailing",
    "trickle",
    "truncate",
]


_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})
_proxy_ids = itertools.count(1)


class FaultProxyError(RuntimeError):
    """Raised by :meth:`FaultProxy.start` when the proxy cannot listen, and by
    ``endpoint_url``/``port`` when it is not started."""


class _HasEndpoint(Protocol):
    @property
    def endpoint_url(self) -> str: ...


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
        #: :func:`trailing` writes done (the bytes are in the client's socket once counted)
        self.trailing_sent = 0

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
        thread = threading.Thread(
            target=self._run, args=(ready, error), name=self.thread_name, daemon=True
        )
        thread.start()
        ready.wait()
        if error:
            thread.join()
            raise FaultProxyError(f"fault proxy could not listen: {error[0]}") from error[0]
        self._thread = thread
        logger.info(
            "fault proxy %s -> %s started (%s)", self.endpoint_url, self.upstream_url, self.flavor
        )
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
            logger.error(
                "fault proxy thread %s did not stop within %.1f s", self.thread_name, timeout
            )
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
            methods = frozenset(
                [method.upper()] if isinstance(method, str) else (m.upper() for m in method)
            )
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
                    asyncio.start_server(
                        self._on_client, "127.0.0.1", self._requested_port or 0, limit=_HEAD_LIMIT
                    )
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
                req = await _read_request(conn)
                if req is None:
                    break
                if not await self._serve(conn, req):
                    break
        except asyncio.CancelledError:
            pass
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            _ProtocolError,
            asyncio.LimitOverrunError,
        ) as exc:
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
            self._log.append(
                LogEntry(req.method, req.path, req.query, req.header("range"), description, chosen)
            )
            self._cond.notify_all()
        if chosen is not None:
            logger.debug(
                "fault proxy %s: %s %s -> %s", self.thread_name, req.method, req.target, action
            )
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
            await _stall(conn, action.seconds, self)
            return False
        if isinstance(action, Status):
            if self.latency > 0:
                await asyncio.sleep(self.latency)
            conn.writer.write(_error_response(req, action, self.flavor, self._requests_seen))
            await conn.writer.drain()
            return req.keep_alive

        if isinstance(action, ShiftRange):
            req.headers = [
                (k, _shift_range(v, action.offset) if k.lower() == "range" else v)
                for k, v in req.headers
            ]
        # forward
        try:
            head, code, resp_headers = await _exchange(
                conn, req, self._up_port, self.bandwidth, self._bucket
            )
        except (OSError, asyncio.IncompleteReadError, _ProtocolError) as exc:
            logger.warning(
                "fault proxy: upstream %s failed for %s %s: %r",
                self.upstream_url,
                req.method,
                req.target,
                exc,
            )
            conn.close_upstream()
            conn.writer.write(_simple_response(502, b"fault proxy: upstream failed\n", close=True))
            await conn.writer.drain()
            return False
        assert conn.up_reader is not None
        up_reader = conn.up_reader
        te = {
            t.strip().lower()
            for k, v in resp_headers
            if k.lower() == "transfer-encoding"
            for t in v.split(",")
        }
        resp_conn = {
            t.strip().lower()
            for k, v in resp_headers
            if k.lower() == "connection"
            for t in v.split(",")
        }
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
        upstream_keeps = (
            not until_close and "close" not in resp_conn and head.startswith(b"HTTP/1.1")
        )
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

        completed = (
            await _relay(conn, body, limit, rate, self.bandwidth, self._bucket)
            if body is not None
            else True
        )
        if completed and isinstance(action, Overlong):
            await self._filler(conn, action.extra)
            conn.close_upstream()
            return False
        if completed and isinstance(action, Trailing) and not self._stopping:
            await asyncio.sleep(action.after)
            conn.writer.write(action.extra)
            await conn.writer.drain()
            with self._lock:
                self.trailing_sent += 1
        if limit is not None or not completed:
            conn.close_upstream()
            if isinstance(action, Reset):
                _abort_with_rst(conn.writer)
            elif isinstance(action, Stall):
                await _stall(conn, action.seconds, self)
            return False
        if not upstream_keeps:
            conn.close_upstream()
        return client_keeps

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


async def _stall(conn: _Conn, seconds: float | None, proxy: FaultProxy) -> None:
    """Hold the connection silent until ``seconds`` pass, the client leaves, or ``proxy`` stops."""
    loop = asyncio.get_running_loop()
    deadline = None if seconds is None else loop.time() + seconds
    while not proxy._stopping and not conn.client_gone():
        step = 0.05 if deadline is None else min(0.05, deadline - loop.time())
        if step <= 0:
            break
        await asyncio.sleep(step)
