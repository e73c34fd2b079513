"""The child side of the loopback servers: run as a script (``python -P _serve.py
--http-range-server|--moto-server ...``) by :class:`~asyncload.testing.servers.HTTPRangeServer`
and :class:`~asyncload.testing.servers.S3Server`. It imports only the standard library at
import time, so that starting a child stays cheap; aiohttp and moto are imported in the child.

:func:`parse_byte_range` is the one reading of an HTTP ``Range`` header (also used by the
tests). Raised: :class:`RangeNotSatisfiable` for a range that lies past the file's end.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import urllib.parse
from pathlib import Path

#: The only address these helpers bind to or send traffic to.
LOOPBACK = "127.0.0.1"


def _etags(header: str) -> list[str]:
    """The strong entity tags an ``If-Match`` header lists (weak ones never match)."""
    return [t.strip() for t in header.split(",") if t.strip() and not t.strip().startswith("W/")]


class RangeNotSatisfiable(ValueError):
    """Raised by :func:`parse_byte_range` when the range cannot be served (416)."""


_RANGE_SPEC = re.compile(r"\s*(\d*)\s*-\s*(\d*)\s*")


def parse_byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Half-open ``(start, stop)`` that a ``Range`` header asks of a ``size``-byte file.

    None when there is no header or its unit is not ``bytes`` (serve 200).
    Raised: :class:`RangeNotSatisfiable` for an invalid range, one starting at
    or past the end, ``bytes=-0``, any range of an empty file, or several ranges.
    """
    if header is None:
        return None
    unit, sep, spec = header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    if "," in spec:
        raise RangeNotSatisfiable("multiple ranges are not supported")
    m = _RANGE_SPEC.fullmatch(spec)
    if m is None or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(f"invalid range {header!r}")
    first, last = m.group(1), m.group(2)
    if not first:
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range {header!r} of a {size}-byte file")
        return max(0, size - n), size
    start = int(first)
    if start >= size:
        raise RangeNotSatisfiable(f"range {header!r} starts past the end of a {size}-byte file")
    if not last:
        return start, size
    end = int(last)
    if end < start:
        raise RangeNotSatisfiable(f"invalid range {header!r}")
    return start, min(end + 1, size)


def _run_http_range_server(
    root: str,
    port: int,
    *,
    ignore_range: bool = False,
    request_log: str | None = None,
    gzip: str | None = None,
) -> None:
    """Serve ``root`` on 127.0.0.1:port until SIGTERM/SIGINT (child process)."""
    import asyncio
    import email.utils
    import html
    import json

    from aiohttp import web

    root_path = Path(root).resolve()
    chunk = 1 << 20
    log_file = open(request_log, "a", buffering=1) if request_log else None  # noqa: SIM115 - lives as long as the process

    async def handle(request: web.Request) -> web.StreamResponse:
        sent = [0]
        status: int | None = None
        try:
            resp = await _handle(request, sent)
            status = resp.status
            return resp
        finally:
            if log_file is not None:
                entry = {
                    "method": request.method,
                    "path": request.raw_path,
                    "range": request.headers.get("Range"),
                    "if_match": request.headers.get("If-Match"),
                    "accept_encoding": request.headers.get("Accept-Encoding"),
                    "status": status,
                    "sent": sent[0],
                }
                log_file.write(json.dumps(entry) + "\n")

    async def _handle(request: web.Request, sent: list[int]) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return web.Response(
                status=405, text="method not allowed\n", headers={"Allow": "GET, HEAD"}
            )
        target = (root_path / request.path.lstrip("/")).resolve()
        if not target.is_relative_to(root_path) or not target.exists():
            return web.Response(status=404, text="not found\n")
        if target.is_dir():
            base = request.path if request.path.endswith("/") else request.path + "/"
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
            links = "".join(
                f'<a href="{html.escape(base + urllib.parse.quote(n))}">{html.escape(n)}</a>\n'
                for n in names
            )
            return web.Response(
                text=f"<html><body>\n{links}</body></html>\n", content_type="text/html"
            )
        st = target.stat()
        size = st.st_size
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "ETag": f'"{st.st_mtime_ns:x}-{size:x}"',
            "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
        }
        if_match = request.headers.get("If-Match")
        if (
            if_match is not None
            and if_match.strip() != "*"
            and headers["ETag"] not in _etags(if_match)
        ):
            return web.Response(status=412, text="precondition failed\n", headers=headers)
        asked = request.headers.get("Accept-Encoding", "")
        if gzip == "always" or (gzip == "if-asked" and "gzip" in asked):
            # as nginx with gzip on: the whole file compressed, a weak ETag, Range ignored
            import gzip as gz

            body = gz.compress(target.read_bytes(), compresslevel=1)
            headers["ETag"] = "W/" + headers["ETag"]
            del headers["Accept-Ranges"]
            headers["Content-Encoding"] = "gzip"
            sent[0] = len(body)
            return web.Response(status=200, body=body if request.method == "GET" else None,
                                headers=headers)  # fmt: skip
        try:
            byte_range = (
                None if ignore_range else parse_byte_range(request.headers.get("Range"), size)
            )
        except RangeNotSatisfiable as exc:
            headers["Content-Range"] = f"bytes */{size}"
            headers["Content-Type"] = "text/plain"
            return web.Response(status=416, text=f"{exc}\n", headers=headers)
        if byte_range is None:
            status, (start, stop) = 200, (0, size)
        else:
            status, (start, stop) = 206, byte_range
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        resp = web.StreamResponse(status=status, headers=headers)
        if request.query.get("chunked") == "1":
            resp.enable_chunked_encoding()
        else:
            resp.content_length = stop - start
        await resp.prepare(request)
        if request.method == "GET":
            loop = asyncio.get_running_loop()
            fd = os.open(target, os.O_RDONLY)
            try:
                pos = start
                while pos < stop:
                    data = await loop.run_in_executor(
                        None, os.pread, fd, min(chunk, stop - pos), pos
                    )
                    if not data:
                        break
                    await resp.write(data)
                    pos += len(data)
                    sent[0] += len(data)
            finally:
                os.close(fd)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host=LOOPBACK, port=port, print=None, access_log=None, shutdown_timeout=1.0)


def _run_moto_server(port: int) -> None:
    """moto's S3 (and other) server on 127.0.0.1:port until SIGTERM (child process)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    class Handler(MotoRequestHandler):
        def send_response(self, code: int, message: str | None = None) -> None:
            # BaseHTTPRequestHandler.send_response without its Server header:
            # moto sends its own, and a duplicate breaks strict HTTP parsers.
            self.log_request(code)
            self.send_response_only(code, message)
            self.send_header("Date", self.date_time_string())

    def on_signal(signum: int, frame: object) -> None:
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(LOOPBACK, port, app, threaded=True, request_handler=Handler)


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="asyncload loopback test servers (child processes)"
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--http-range-server", action="store_true", help="serve --root with Range support"
    )
    which.add_argument("--moto-server", action="store_true", help="moto's server")
    parser.add_argument("--root", help="directory served by --http-range-server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--ignore-range", action="store_true", help="answer every GET with the whole file"
    )
    parser.add_argument("--request-log", help="append one JSON line per request served")
    parser.add_argument(
        "--gzip",
        choices=("if-asked", "always"),
        help="answer with the whole file gzip-compressed (as nginx with gzip on)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.moto_server:
        _run_moto_server(args.port)
    else:
        if not args.root:
            parser.error("--http-range-server needs --root")
        _run_http_range_server(
            args.root,
            args.port,
            ignore_range=args.ignore_range,
            request_log=args.request_log,
            gzip=args.gzip,
        )


if __name__ == "__main__":
    _main()
