"""Any fsspec filesystem behind the Storage interface: async ones (s3fs, gcsfs, fsspec's HTTP)
natively on the load's loop, sync ones (``memory://``, ...) in threads.

Reads are conditional on the version of the object first seen and every answer is compared
(:class:`asyncload.storage.base.VersionPins`); a body longer than asked for is refused, never
buffered whole. The filesystems' own retry loops are turned off and aiohttp's silent re-send of
a request on a pooled connection too (:mod:`asyncload.storage.retrying` is the only retry
policy); redirects to another origin are refused before anything is sent there
(:func:`_refuse_cross_origin` on aiohttp's trace signals).
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import errno
import logging
import os
import posixpath
import sys
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import fsspec

from asyncload.storage.base import (
    CrossOriginRedirectError,
    ListingTooLargeError,
    ObjectChangedError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
    VersionPins,
    check_identity,
    first_byte,
    origin_of,
)
from asyncload.storage.credentials import CredentialSourceError, aio_credentials_or_none_found

__all__ = ["FsspecStorage", "close_async_fs"]

log = logging.getLogger("asyncload.storage")


class FsspecStorage(VersionPins):
    """Any fsspec filesystem: async ones (s3fs, gcsfs, HTTP) natively on our loop,
    sync ones (memory://, ...) in threads.

    One filesystem (and so one HTTP session and connection pool) per storage, opened on
    first use and closed by :meth:`aclose` when the load ends, fails or is cancelled.

    The filesystems' own retry loops are turned off (s3fs/botocore retry 5xx, throttling
    and resets for up to 39 s on their own; gcsfs retries 5xx six times): asyncload's
    per-chunk policy (:mod:`asyncload.storage.retrying`) is then the only one, the same for every
    store, with its timeouts, backoff, hedging and ``LoadStats.retries`` counting. Options
    the caller gives in ``storage_options`` (e.g. ``config_kwargs={"retries": ...}``) win.
    """

    transport = "fsspec"

    hedgeable = True

    def __init__(
        self,
        root: str,
        protocol: str,
        storage_options: Mapping[str, Any],
        executor: concurrent.futures.Executor,
        *,
        max_listing_size: int | None = None,
    ) -> None:
        super().__init__(root)
        #: the most bytes an HTTP directory listing (an HTML index page) may have
        #: (``LoadOptions.max_metadata_size``; None: no limit)
        self.max_listing_size = max_listing_size
        self.protocol = protocol
        self._executor = executor
        self._cls = fsspec.get_filesystem_class(protocol)
        self._options = dict(storage_options)
        self._fs: Any = None
        self._fs_lock: asyncio.Lock | None = None
        #: the credential lookup that found none (raised again, never asked again)
        self._no_credentials: CredentialSourceError | None = None
        self._root_path = self._cls._strip_protocol(root)
        self.is_async = bool(getattr(self._cls, "async_impl", False))

    def _full(self, name: str) -> str:
        if self.protocol in ("http", "https"):
            return f"{self.root.rstrip('/')}/{name}"
        return f"{self._root_path.rstrip('/')}/{name}" if name else self._root_path

    def _constructor_options(self) -> dict[str, Any]:
        """The caller's storage options plus asyncload's defaults (the caller's win)."""
        opts = dict(self._options)
        if self.is_async:
            opts.setdefault("skip_instance_cache", True)
        _tls_options(self.protocol, self._cls, opts)
        if self.protocol in ("http", "https"):
            # aiohttp asks for gzip by default, and a server that compresses answers a ranged
            # GET with a compressed 200 and a weak ETag: ask for the bytes as they are stored
            headers = dict(opts.get("headers") or {})
            if not any(k.lower() == "accept-encoding" for k in headers):
                headers["Accept-Encoding"] = "identity"
            opts["headers"] = headers
            # aiohttp ignores HTTP(S)_PROXY / NO_PROXY unless asked: honour them as requests,
            # curl and the wire transport do (a load must not go around the proxy)
            client = dict(opts.get("client_kwargs") or {})
            client.setdefault("trust_env", True)
            opts["client_kwargs"] = client
        if _is_s3(self._cls):
            config = dict(opts.get("config_kwargs") or {})
            # botocore: one attempt, no retry of its own (asyncload retries)
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            # botocore's pool of 10 connections would cap reads in flight
            config.setdefault("max_pool_connections", 128)
            opts["config_kwargs"] = config
            if self.is_async and "session" not in opts and "profile" not in opts:
                # a botocore session per filesystem re-reads and re-parses the S3 service model
                # (60-500 ms per load); one per event loop keeps it (and resolved credentials,
                # which botocore refreshes itself when they expire)
                opts["session"] = _shared_aio_session()
        return opts

    def _disable_own_retries(self, fs: Any) -> None:
        if _is_s3(self._cls) and "retries" not in self._options:
            fs.retries = 1  # s3fs's _error_wrapper: one try
        elif _is_gcs(self._cls):
            # gcsfs decorates _request with a fixed retry loop (6 tries, up to 32 s apart);
            # bind the undecorated method to this instance only
            inner = getattr(type(fs)._request, "__wrapped__", None)
            if inner is not None:
                fs._request = types.MethodType(inner, fs)

    async def _get_fs(self) -> Any:
        if self._fs is not None:
            return self._fs
        if self._fs_lock is None:
            self._fs_lock = asyncio.Lock()
        async with self._fs_lock:  # concurrent first reads must not open two sessions
            if self._fs is None:
                opts = self._constructor_options()
                if self.is_async:
                    if _resolves_own_credentials(self._cls, self._options, opts):
                        # no key, profile or anon given: look before s3fs makes its client, so
                        # that none anywhere is said so at once (the metadata service asked once)
                        if self._no_credentials is not None:  # one lookup per load
                            raise self._no_credentials
                        bucket = self._root_path.split("/", 1)[0]
                        try:
                            await aio_credentials_or_none_found(opts["session"], f"s3://{bucket}")
                        except CredentialSourceError as exc:
                            self._no_credentials = exc
                            raise
                    fs = self._cls(asynchronous=True, loop=asyncio.get_running_loop(), **opts)
                    self._disable_own_retries(fs)
                    try:
                        set_session = getattr(fs, "set_session", None) or getattr(
                            fs, "_set_session", None
                        )
                        if set_session is not None:
                            await set_session()
                        _no_client_resend(fs)
                    except BaseException:
                        await close_async_fs(fs, self.protocol)
                        raise
                else:
                    loop = asyncio.get_running_loop()
                    fs = await loop.run_in_executor(self._executor, lambda: self._cls(**opts))
                    self._disable_own_retries(fs)
                self._fs = fs
        return self._fs

    async def fingerprint(self, name: str) -> object | None:
        """The pinned version: a change shows on the first answer that carries another
        (every ranged read is checked), so no extra request is made for it."""
        return None

    async def read(self, name: str, start: int, end: int) -> bytes:
        fs = await self._get_fs()
        path = self._full(name)
        if self.is_async and self.protocol in ("http", "https") and hasattr(fs, "encode_url"):
            data = await self._read_http(fs, name, path, start, end)
        elif self.is_async and _is_s3(self._cls):
            data = await self._read_s3(fs, name, path, start, end)
        elif self.is_async and _is_gcs(self._cls) and hasattr(fs, "_call"):
            data = await self._read_gcs(fs, name, path, start, end)
        elif self.is_async:
            data = await fs._cat_file(path, start=start, end=end)
        else:
            loop = asyncio.get_running_loop()
            data = await loop.run_in_executor(
                self._executor, lambda: fs.cat_file(path, start=start, end=end)
            )
        if len(data) > end - start:
            raise RangeIgnoredError(self.url(name), start, end, None, f"{len(data)} bytes")
        if len(data) != end - start:
            raise ShortReadError(self.url(name), start, end, len(data))
        return data

    async def _read_s3(self, fs: Any, name: str, path: str, start: int, end: int) -> bytes:
        """One ranged GetObject, conditional on the ETag first seen (``If-Match``; the
        answer's ETag is compared too, for stores that ignore the condition)."""
        bucket, key, version_id = fs.split_path(path)
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if version_id:
            kw["VersionId"] = version_id
        seen = self._versions.get(name)
        if seen is not None and seen.startswith("etag "):
            kw["IfMatch"] = seen[5:]
        try:
            resp = await fs._call_s3("get_object", **kw)
        except OSError as exc:
            if seen is not None and _status_412(exc):
                raise ObjectChangedError(self.url(name), (start, end), seen, None) from exc
            raise
        first_byte()  # the answer's headers are in, its body unread: the hedge's first-byte clock
        body = resp["Body"]
        try:
            etag = resp.get("ETag")
            self._see(name, f"etag {etag}" if etag else None, (start, end))
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status == 206 or resp.get("ContentRange"):
                self._check_range(name, start, end, status, resp.get("ContentRange"))
            elif start != 0:
                raise RangeIgnoredError(self.url(name), start, end, status, "the whole file")
            # at most one byte more than asked for: a longer body is refused, never buffered whole
            data = await _read_at_most(body.read, end - start + 1)
            if len(data) > end - start:
                raise RangeMismatchError(
                    self.url(name), start, end, status, "a body longer than that range"
                )
        finally:
            body.close()
        return data

    async def _read_gcs(self, fs: Any, name: str, path: str, start: int, end: int) -> bytes:
        """One ranged media GET, conditional on the generation first seen
        (``ifGenerationMatch``; the answer's ``x-goog-generation`` is compared too)."""
        seen = self._versions.get(name)
        params: dict[str, Any] = {}
        if seen is not None and seen.startswith("generation "):
            params["ifGenerationMatch"] = seen[11:]
        from gcsfs.retry import validate_response

        url = fs.url(path)
        await fs._set_session()
        # the request gcsfs's _call makes, with its body streamed: an answer's headers are checked
        # before its bytes are used, and a body longer than asked for is never buffered whole
        async with fs.session.request(
            "GET",
            url,
            params=fs._get_params(params),
            headers=fs._get_headers({"Range": f"bytes={start}-{end - 1}"}),
            timeout=fs.requests_timeout,
        ) as r:
            first_byte()
            if r.status >= 300:
                content = await _read_at_most(r.content.read, 1 << 16)
                try:
                    validate_response(r.status, content, url)
                except (OSError, FileExistsError) as exc:
                    if seen is not None and (r.status == 412 or _status_412(exc)):
                        raise ObjectChangedError(self.url(name), (start, end), seen, None) from exc
                    raise
                raise RangeMismatchError(
                    self.url(name), start, end, r.status, "a body that is not the range asked for"
                )
            generation = r.headers.get("x-goog-generation")
            self._see(name, f"generation {generation}" if generation else None, (start, end))
            if r.status == 206 or start != 0:
                self._check_range(name, start, end, r.status, r.headers.get("Content-Range"))
            data = await _read_at_most(r.content.read, end - start + 1)
            if len(data) > end - start:
                r.close()  # drop the connection: never read the rest of the body
                raise RangeMismatchError(
                    self.url(name), start, end, r.status, "a body longer than that range"
                )
        return data

    async def _read_http(self, fs: Any, name: str, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` over fsspec's HTTP session, streamed: a server that
        ignores ``Range`` (200 with the whole file) is detected after at most
        ``end - start + 1`` bytes, not after downloading the file. Conditional on the
        strong ETag first seen (``If-Match``); the answer's validator is compared too."""
        want = end - start
        kw = dict(fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Range"] = f"bytes={start}-{end - 1}"
        seen = self._versions.get(name)
        if seen is not None and seen.startswith('etag "'):
            headers["If-Match"] = seen[5:]
        session = await fs.set_session()
        async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
            first_byte()
            if r.status == 412 and seen is not None:
                r.close()
                raise ObjectChangedError(
                    self.url(name), (start, end), seen, _http_version(r.headers)
                )
            fs._raise_not_found_for_status(r, path)
            if r.headers.get("Content-Encoding"):
                r.close()  # never read: its bytes are not the file's
                check_identity(self.url(name), r.headers)
            self._see(name, _http_version(r.headers), (start, end))
            length = r.headers.get("Content-Length")
            if r.status == 206:
                self._check_range(name, start, end, r.status, r.headers.get("Content-Range"))
            elif r.status != 200:
                r.close()
                raise RangeMismatchError(
                    self.url(name), start, end, r.status, "a body that is not the range asked for"
                )
            if r.status != 206 and (
                start != 0 or (length is not None and length.isdigit() and int(length) > want)
            ):
                r.close()  # drop the connection: never read the rest of the body
                got = f"a {length}-byte body" if length is not None else "the whole file"
                raise RangeIgnoredError(self.url(name), start, end, r.status, got)
            try:
                data = await r.content.readexactly(want)
            except asyncio.IncompleteReadError as exc:
                return exc.partial  # the body ended early: read() raises ShortReadError
            if await r.content.read(1):
                r.close()
                if r.status == 206:
                    raise RangeMismatchError(
                        self.url(name), start, end, 206, "a body longer than that range"
                    )
                raise RangeIgnoredError(self.url(name), start, end, r.status, "a longer body")
        return data

    async def size(self, name: str) -> int:
        fs = await self._get_fs()
        path = self._full(name)
        if self.is_async:
            try:
                info = await fs._info(path)
            except FileNotFoundError as exc:
                # fsspec's HTTP filesystem turns *any* failure of its HEAD-then-GET probe into
                # FileNotFoundError: a 503 or a reset is not a missing file (retry it)
                cause = exc.__cause__
                if (
                    self.protocol in ("http", "https")
                    and cause is not None
                    and getattr(cause, "status", None) not in (404, 410)
                ):
                    raise cause from None
                raise
            except OSError as exc:
                if isinstance(exc, PermissionError) or (
                    type(exc) is OSError and exc.errno == errno.EINVAL
                ):
                    # s3fs' HEAD answer has no body, so no error code: a wrong secret, an
                    # unknown key, a refused one ("Forbidden"), a bad session token ("Bad
                    # Request"). One GET of a byte says which.
                    raise await self._s3_refusal(fs, path) or exc from exc
                raise
        else:
            loop = asyncio.get_running_loop()
            info = await loop.run_in_executor(self._executor, fs.info, path)
        size = info.get("size")
        if size is None and self.is_async and self.protocol in ("http", "https"):
            await self._check_http_encoding(fs, name, path)
        if size is None:
            raise OSError(f"{self.url(name)}: the store did not report a size")
        self._see(name, self._version_of(info))
        self._totals.setdefault(name, int(size))  # what every Content-Range must give as the total
        return int(size)

    async def _s3_refusal(self, fs: Any, path: str) -> BaseException | None:
        """The error S3 gives for a GET of the first byte of ``path`` (botocore's
        ``ClientError``, with the code its HEAD could not carry: SignatureDoesNotMatch,
        InvalidAccessKeyId, InvalidToken, AccessDenied...); ``None`` where it is no S3 store
        or the GET succeeds."""
        if not _is_s3(self._cls):
            return None
        try:
            bucket, key, _ = fs.split_path(path)
            client = await fs.set_session()
            resp = await client.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")
            resp["Body"].close()
        except Exception as exc:
            return exc if getattr(exc, "response", None) is not None else None
        return None

    async def _check_http_encoding(self, fs: Any, name: str, path: str) -> None:
        """Why an HTTP server gave no size: it compresses what it serves (a compressed answer
        has no length of the file's), raised as :class:`CompressedAnswerError`."""
        kw = dict(fs.kwargs)
        headers = {**dict(kw.pop("headers", None) or {}), "Range": "bytes=0-0"}
        session = await fs.set_session()
        async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
            r.close()  # its body is never read
            check_identity(self.url(name), r.headers)

    def _version_of(self, info: Mapping[str, Any]) -> str | None:
        """The version a listing or ``info`` entry reports, in the form reads compare."""
        if _is_gcs(self._cls):
            gen = info.get("generation")
            return f"generation {gen}" if gen not in (None, "") else None
        if _is_s3(self._cls):
            etag = info.get("ETag") or info.get("etag")
            return f"etag {etag}" if etag else None
        if self.protocol in ("http", "https"):
            return _http_version(info)
        return None

    async def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """One listing of the checkpoint's directory instead of a HEAD per file (s3, gcs:
        a checkpoint saved one file per item has hundreds)."""
        if not self.is_async or len(names) < 4 or not (_is_s3(self._cls) or _is_gcs(self._cls)):
            return {}
        fs = await self._get_fs()
        root = self._root_path.rstrip("/")
        entries = await fs._ls(root, detail=True)
        wanted = set(names)
        out: dict[str, int] = {}
        for e in entries:
            name = str(e.get("name", "")).rstrip("/")
            rel = name[len(root) + 1 :] if name.startswith(root + "/") else None
            size = e.get("size")
            if rel in wanted and e.get("type", "file") == "file" and isinstance(size, int):
                out[rel] = size
                self._see(rel, self._version_of(e))
        return out

    async def listdir(self) -> list[str]:
        fs = await self._get_fs()
        path = self._full("").rstrip("/") or "/"
        if self.is_async and self.protocol in ("http", "https") and hasattr(fs, "encode_url"):
            return await self._list_http(fs, path)
        try:
            if self.is_async:
                entries = await fs._ls(path, detail=True)
            else:
                loop = asyncio.get_running_loop()
                entries = await loop.run_in_executor(
                    self._executor, lambda: fs.ls(path, detail=True)
                )
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for e in entries:
            if isinstance(e, dict) and e.get("type", "file") == "file":
                out.append(posixpath.basename(str(e.get("name", "")).rstrip("/")))
        return sorted(n for n in out if n)

    async def _list_http(self, fs: Any, url: str) -> list[str]:
        """The files an HTML index page at ``url`` links to directly under it (what fsspec's
        ``ls`` finds, with its ``simple_links`` and ``same_scheme``), read as a stream and
        parsed piece by piece: memory holds one piece and the names found, not the page. The
        page's bytes and the memory of the names found (a page of millions of links) count
        together against ``max_listing_size``.

        Raised: :class:`ListingTooLargeError` past ``max_listing_size``."""
        from fsspec.implementations.http import ex, ex2

        limit = self.max_listing_size
        base = url.rstrip("/")
        parts = urlparse(base)
        simple = bool(getattr(fs, "simple_links", False))
        names: set[str] = set()

        root = base.replace("https", "http", 1) + "/"

        def take(link: str) -> None:
            """A link of the page: kept when it names a file directly under ``base``."""
            if link.startswith("/") and len(link) > 1:
                link = f"{parts.scheme}://{parts.netloc}{link}"
            if link.startswith("http"):
                plain = link.replace("https", "http", 1)  # fsspec allows http <-> https
                if not plain.startswith(root):
                    return
                rel = plain[len(root) :]
            elif link in ("..", "../"):
                return
            else:
                rel = link.lstrip("/")
            if rel and "/" not in rel and rel not in names:
                names.add(rel)
                cost[0] += sys.getsizeof(rel) + 32  # the string and its slot in the set

        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        overlap = 1 << 13  # a link longer than this may be missed at a piece's edge
        text, got = "", 0
        cost = [0]  # the memory of the names found
        session = await fs.set_session()
        async with session.get(fs.encode_url(base), **fs.kwargs) as r:
            if r.status in (404, 410):
                return []
            r.raise_for_status()
            mimetype = r.headers.get("Content-Type", "").partition(";")[0].strip() or None
            if mimetype not in ("text/html", None):
                return []
            while True:
                piece = await r.content.read(1 << 20)
                got += len(piece)
                if limit is not None and got + cost[0] > limit:
                    r.close()  # drop the connection: never read the rest
                    raise ListingTooLargeError(self.url(""), limit)
                text += decoder.decode(piece, final=not piece)
                # links that end before the last ``overlap`` characters are whole; the rest
                # are looked at again with the next piece
                edge = len(text) if not piece else max(0, len(text) - overlap)
                for m in ex.finditer(text):
                    if m.end() <= edge or not piece:
                        take(m.group("url"))
                if simple:
                    for m in ex2.finditer(text):
                        if m.end() <= edge or not piece:
                            take(m.group("url"))
                if not piece:
                    break
                text = text[max(0, len(text) - 2 * overlap) :]
        return sorted(names)

    async def aclose(self) -> None:
        """Close the filesystem's HTTP session and its connections. Safe to call twice."""
        fs, self._fs = self._fs, None
        if fs is None or not self.is_async:
            return
        await close_async_fs(fs, self.protocol)


async def _read_at_most(read: Any, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``read(n)`` (a body's ``read``, which may return fewer than
    asked for before its end): stops at ``limit`` or at the end of the body."""
    parts: list[bytes] = []
    got = 0
    while got < limit:
        piece = await read(limit - got)
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _http_version(headers: Mapping[str, Any]) -> str | None:
    """An HTTP answer's validator: its ETag, else its Last-Modified date."""
    etag = headers.get("ETag")
    if etag:
        return f"etag {etag}"
    modified = headers.get("Last-Modified")
    return f"last-modified {modified}" if modified else None


def _status_412(exc: BaseException) -> bool:
    """Whether a client error is the store's 412 Precondition Failed (s3fs turns it into
    ``OSError(EINVAL)`` with the botocore error as cause; gcsfs into an ``HttpError``)."""
    e: BaseException | None = exc
    for _ in range(6):
        if e is None:
            return False
        if getattr(e, "code", None) == 412 or getattr(e, "status", None) == 412:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            meta = response.get("ResponseMetadata") or {}
            if (
                err.get("Code") in ("PreconditionFailed", "412")
                or meta.get("HTTPStatusCode") == 412
            ):
                return True
        e = e.__cause__ or e.__context__
    return False


def _no_client_resend(fs: Any) -> None:
    """Turn off aiohttp's silent re-send of an idempotent request whose pooled connection
    the server closed or reset (aiohttp >= 3.10 tries it once more, unseen): asyncload's
    policy retries it instead, so the fault shows in ``LoadStats.retries``. HTTP and
    gcsfs keep their aiohttp ``ClientSession`` in ``_session``; s3fs's aiobotocore client
    makes its sessions lazily, one per proxy, in its endpoint's ``AIOHTTPSession``."""
    session = getattr(fs, "_session", None)
    if session is not None and hasattr(session, "_retry_connection"):
        session._retry_connection = False
    if session is not None:
        _same_origin_redirects_only(session)
    endpoint = getattr(getattr(fs, "_s3", None), "_endpoint", None)
    http = getattr(endpoint, "http_session", None)
    make = getattr(http, "_get_session", None)
    if http is None or make is None or getattr(make, "_asyncload_no_resend", False):
        return

    async def get_session(proxy_url: Any) -> Any:
        made = await make(proxy_url)
        if hasattr(made, "_retry_connection"):
            made._retry_connection = False
        _same_origin_redirects_only(made)
        return made

    get_session._asyncload_no_resend = True  # type: ignore[attr-defined]
    http._get_session = get_session


async def _refuse_cross_origin(session: Any, ctx: Any, params: Any) -> None:
    """aiohttp's ``on_request_redirect`` signal: runs when a redirect has come back and before
    aiohttp follows it. One to another origin is refused here, so the request that would carry
    the caller's headers and the store's credentials (an S3 session token, an API key) there
    is never sent."""
    resp = params.response
    location = resp.headers.get("Location") or resp.headers.get("URI")
    if location is None:
        return
    try:
        target = str(params.url.join(type(params.url)(location)))
    except ValueError:
        target = location
    if origin_of(str(params.url)) != origin_of(target):
        resp.close()
        raise CrossOriginRedirectError(str(params.url), target, resp.status)


def _same_origin_redirects_only(session: Any) -> None:
    """Refuse redirects to another origin on an aiohttp ``ClientSession`` (s3fs's, gcsfs's and
    fsspec HTTP's follow every redirect by default): :func:`_refuse_cross_origin` on its
    trace signals. A redirect within the origin is followed as aiohttp does (at most 10)."""
    configs = getattr(session, "_trace_configs", None)
    if not isinstance(configs, list) or any(
        getattr(c, "_asyncload_origin", False) for c in configs
    ):
        return
    import aiohttp

    config = aiohttp.TraceConfig()
    config.on_request_redirect.append(_refuse_cross_origin)
    config._asyncload_origin = True  # type: ignore[attr-defined]
    config.freeze()
    configs.append(config)


_aio_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
    weakref.WeakKeyDictionary()
)


def _shared_aio_session() -> Any:
    """One aiobotocore session per event loop, for s3fs filesystems made without one."""
    loop = asyncio.get_running_loop()
    sess = _aio_sessions.get(loop)
    if sess is None:
        import aiobotocore.session

        sess = _aio_sessions[loop] = aiobotocore.session.AioSession()
    return sess


def _resolves_own_credentials(
    cls: type, given: Mapping[str, Any], opts: Mapping[str, Any]
) -> bool:
    """Whether an s3fs filesystem made with ``opts`` will find its credentials through the
    shared session's chain: no key, secret, token, profile or ``anon`` given."""
    if not _is_s3(cls) or given.get("anon") or "session" in given:
        return False
    creds = ("key", "secret", "token", "profile", "aws_access_key_id", "aws_secret_access_key")
    if any(given.get(k) for k in creds):
        return False
    client = given.get("client_kwargs") or {}
    return "session" in opts and not any(client.get(k) for k in creds[4:])


def _tls_options(protocol: str, cls: type, opts: dict[str, Any]) -> None:
    """The TLS knobs the wire transport takes (``ca_bundle``, a plain ``verify``), in the form
    of the fsspec filesystem: S3 ``client_kwargs={"verify": ...}`` (botocore's); HTTP(S)
    aiohttp's ``ssl`` (a context with the bundle added to the system roots, or ``False``;
    ``REQUESTS_CA_BUNDLE`` too, as wire reads it). gcsfs has no such knob: refused, never
    dropped."""
    bundle, verify = opts.pop("ca_bundle", None), opts.pop("verify", None)
    if bundle is None and verify is None and protocol not in ("http", "https"):
        return
    if _is_s3(cls):
        ck = dict(opts.get("client_kwargs") or {})
        if verify is False:
            ck["verify"] = False
        elif bundle is not None or isinstance(verify, str):
            ck["verify"] = os.fspath(bundle if bundle is not None else verify)
        opts["client_kwargs"] = ck
    elif protocol in ("http", "https"):
        import ssl

        path = bundle if bundle is not None else verify if isinstance(verify, str) else None
        path = path or os.environ.get("REQUESTS_CA_BUNDLE")
        if verify is False:
            opts["ssl"] = False
        elif path and "ssl" not in opts:
            ctx = ssl.create_default_context()
            ctx.load_verify_locations(cafile=os.fspath(path))
            opts["ssl"] = ctx
    else:
        raise ValueError(
            f"storage_options ca_bundle / verify are not taken by the fsspec filesystem of "
            f"{protocol}:// (use transport='wire', or SSL_CERT_FILE)"
        )


def _is_s3(cls: type) -> bool:
    return any(c.__module__.startswith("s3fs") for c in cls.__mro__)


def _is_gcs(cls: type) -> bool:
    return any(c.__module__.startswith("gcsfs") for c in cls.__mro__)


async def close_async_fs(fs: Any, protocol: str) -> None:
    """Close the session of an ``asynchronous=True`` s3fs / gcsfs / HTTP filesystem.

    Each keeps it under another name: s3fs an aiobotocore client made by ``_s3creator``
    (its ``__aexit__`` closes the client's aiohttp session), gcsfs and HTTPFileSystem an
    aiohttp ``ClientSession`` in ``_session``. Errors are logged, never raised: closing
    must not mask the load's own outcome.
    """
    try:
        creator = getattr(fs, "_s3creator", None)
        if creator is not None:
            fs._s3creator = None
            fs._s3 = None
            await creator.__aexit__(None, None, None)
        else:
            client = getattr(fs, "_s3", None)
            if client is not None:
                fs._s3 = None
                await client.close()
        session = getattr(fs, "_session", None)
        if session is not None and hasattr(session, "closed") and not session.closed:
            await session.close()
        # let the transports' close callbacks run on this loop
        await asyncio.sleep(0)
    except Exception:
        log.debug("closing the %s session failed", protocol, exc_info=True)
