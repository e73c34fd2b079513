"""The wire transport (``LoadOptions.transport="wire"``): asyncload's own HTTP/1.1 range reader
for ``s3://`` (SigV4, :mod:`asyncload.storage.sigv4`), ``gs://`` / ``gcs://`` (anonymous, or
an OAuth bearer) and ``http(s)://``, over keep-alive connections per origin
(:mod:`asyncload.storage.wire_http`).

A range's body is received straight into the destination's memory (:meth:`WireStorage.readinto`:
``BufferedProtocol.get_buffer`` hands out a view of it), so a remote byte lands once, as a local
one does. Everything the other transports promise holds: reads conditional on the version first
seen (``If-Match`` on a strong ETag) and every answer's version compared
(:class:`asyncload.storage.base.VersionPins`); every ranged answer checked against the request
(status, ``Content-Range`` start, end and total, ``Content-Length``) before a byte of its body is
taken, and never more than the requested length read; redirects followed within the checkpoint's
origin only (:class:`asyncload.storage.base.CrossOriginRedirectError` otherwise: no credential or
header of the caller ever leaves the origin, whatever the store); URL userinfo redacted in every
message. Timeouts, retries and hedging are the error boundary's
(:mod:`asyncload.storage.retrying`); raw errors are classified there
(:mod:`asyncload.storage.classify`).

:func:`plan_wire` maps the fsspec-style ``storage_options`` (through
:func:`asyncload.storage.store_options.plan_store`, which refuses what it cannot honour).
Credentials that come from another host (botocore's chain: a profile, SSO, web identity, a
container endpoint, an instance role; GCS OAuth through google-auth) are fetched and refreshed
by :mod:`asyncload.storage.credentials`; without botocore (or google-auth) installed
:class:`asyncload.storage.store_options.Unmappable` is raised, and ``transport="auto"`` then
reads through fsspec (and says so). With ``addressing_style="virtual"`` the bucket goes in
the host as botocore puts it (:func:`_virtual`), never in a way that reaches another bucket.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import logging
import os
import re
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode, urljoin, urlsplit, urlunsplit

from asyncload.common.errors import CheckpointFormatError, redact_url
from asyncload.storage.base import (
    CrossOriginRedirectError,
    Listed,
    ListedStore,
    ListingTooLargeError,
    ObjectChangedError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
    Storage,
    check_identity,
    first_byte,
    origin_of,
    parse_content_range,
)
from asyncload.storage.credentials import RequestAuth
from asyncload.storage.sigv4 import SigV4
from asyncload.storage.wire_http import BodyTooLongError, Pool, Response

log = logging.getLogger("asyncload.storage")

__all__ = ["WireSpec", "WireStorage", "plan_wire", "requote_path", "requote_url"]

#: The first GET of a ``.metadata`` asks for at most this many bytes .
OBJECT_PREFIX = 4 << 20
#: Redirects within the origin followed at most.
MAX_REDIRECTS = 5
#: The default most bytes of a listing (all its pages), when the load gives none.
LISTING_LIMIT = 64 << 20


@dataclass(frozen=True)
class WireSpec:
    """Where a checkpoint's files are and how requests for them are made: ``kind`` (``"s3"``,
    ``"gcs"``, ``"http"``), the origin's base URL (an endpoint, or the checkpoint's URL for
    HTTP), bucket and prefix, and (never in ``repr``) the caller's headers, the signer (static
    keys) or the credentials fetched from elsewhere (``auth``), and the CA certificates."""

    kind: str
    base: str
    bucket: str | None = None
    prefix: str = ""
    virtual: bool = False
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    signer: SigV4 | None = field(default=None, repr=False)
    auth: RequestAuth | None = field(default=None, repr=False)
    cadata: str | None = field(default=None, repr=False)
    verify: bool = True
    #: the forwarding proxy requests go through (``http://[user:pass@]host:port``; never in
    #: ``repr``) and where it was set (``HTTPS_PROXY``, ``proxies['https']``...)
    proxy: str | None = field(default=None, repr=False)
    proxy_source: str = ""

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix and name else (self.prefix or name)

    def object_url(self, name: str) -> str:
        """The URL of file ``name`` (path URI-encoded as sent). For HTTP, ``name`` is a path
        segment as a URL gives it: encoded as UTF-8 where it is raw (a space, ``✓``), its
        ``%XX`` escapes kept (:func:`requote_path`); an S3 or GCS key is literal."""
        base = self.base.rstrip("/")
        if self.kind == "http":
            return f"{base}/{requote_path(name)}" if name else base
        key = quote(self.key(name), safe="/~")
        if self.kind == "s3" and self.virtual:
            p = urlsplit(base)
            return f"{p.scheme}://{self.bucket}.{p.netloc}/{key}"
        return f"{base}/{self.bucket}/{key}"

    def list_url(self, token: str | None) -> str:
        base = self.base.rstrip("/")
        prefix = f"{self.prefix}/" if self.prefix else ""
        if self.kind == "gcs":
            q = {"prefix": prefix, "delimiter": "/"}
            if token:
                q["pageToken"] = token
            return f"{base}/storage/v1/b/{quote(str(self.bucket), safe='')}/o?{urlencode(q)}"
        q = {"delimiter": "/", "list-type": "2", "prefix": prefix}
        if token:
            q["continuation-token"] = token
        query = urlencode(sorted(q.items()), quote_via=quote)
        if self.virtual:
            p = urlsplit(base)
            return f"{p.scheme}://{self.bucket}.{p.netloc}/?{query}"
        return f"{base}/{self.bucket}?{query}"

    def ssl_context(self) -> ssl.SSLContext:
        """The system's roots (``SSL_CERT_FILE`` honoured), plus the CA bundle given."""
        ctx = ssl.create_default_context()
        if self.cadata:
            ctx.load_verify_locations(cadata=self.cadata)
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


def plan_wire(
    url: str,
    storage_options: Mapping[str, Any],
    executor: concurrent.futures.Executor | None = None,
) -> WireSpec:
    """The wire transport's plan for checkpoint ``url`` with fsspec-style ``storage_options``
    (``executor``: where credentials from another host are fetched and refreshed).

    Raised: :class:`asyncload.storage.store_options.Unmappable` naming what it cannot honour."""
    from asyncload.storage.credentials import (
        AwsChain,
        GoogleToken,
        botocore_available,
        google_auth_available,
    )
    from asyncload.storage.store_options import Unmappable, plan_store

    spec = plan_store(url, storage_options)
    client = spec.client_options
    cadata = client.get("root_certificate")
    verify = not client.get("allow_invalid_certificates", False)
    proxy = {"proxy": client.get("proxy"), "proxy_source": client.get("proxy_source", "")}
    if spec.kind == "http":
        return WireSpec(
            "http",
            requote_url(str(spec.url)),
            headers=dict(client.get("default_headers") or {}),
            cadata=cadata,
            verify=verify,
            **proxy,
        )
    cfg = spec.config
    auth: RequestAuth | None = None
    if spec.kind == "gcs":
        if not cfg.get("skip_signature"):
            if not google_auth_available():
                raise Unmappable(
                    "GCS credentials (OAuth tokens) need google-auth, which is not installed "
                    "(pip install asyncload[gcs]; token='anon' for a public bucket)"
                )
            auth = GoogleToken(url, spec.source.get("token"), executor=executor)
        base = cfg.get("base_url") or "https://storage.googleapis.com"
        return WireSpec(
            "gcs",
            base,
            spec.bucket,
            spec.prefix or "",
            auth=auth,
            cadata=cadata,
            verify=verify,
            **proxy,
        )
    payer = bool(cfg.get("request_payer"))
    region = str(cfg.get("region") or "us-east-1")
    endpoint = cfg.get("endpoint")
    virtual = _virtual(str(spec.bucket), endpoint, cfg.get("addressing_style"))
    if endpoint is None:
        endpoint = f"https://s3.{region}.amazonaws.com"
    signer = None
    if not cfg.get("skip_signature"):
        key = cfg.get("access_key_id") or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = cfg.get("secret_access_key") or os.environ.get("AWS_SECRET_ACCESS_KEY")
        token = cfg.get("session_token") or (
            None if cfg.get("access_key_id") else os.environ.get("AWS_SESSION_TOKEN")
        )
        profile = spec.source.get("profile")
        if key and secret and not profile:
            signer = SigV4(str(key), str(secret), region, token, request_payer=payer)
        elif not botocore_available():
            raise Unmappable(
                "credentials that come from another host (a profile, an instance role, web "
                "identity, a container endpoint) need botocore, which is not installed (pip "
                "install asyncload[s3]), or pass key/secret"
            )
        else:
            auth = AwsChain(url, region, profile=profile, request_payer=payer, executor=executor)
    return WireSpec(
        "s3",
        str(endpoint),
        spec.bucket,
        spec.prefix or "",
        virtual=virtual,
        signer=signer,
        auth=auth,
        cadata=cadata,
        verify=verify,
        **proxy,
    )


#: What RFC 3986 allows unencoded in a path (``pchar`` and ``/``), and ``%`` of an escape.
_PATH_SAFE = "/!$&'()*+,;=:@-._~"
_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def requote_path(path: str) -> str:
    """``path`` as a URL sends it, as curl and requests send a URL given raw: each character
    RFC 3986 does not allow in a path percent-encoded as UTF-8 (``" "`` -> ``%20``, ``✓`` ->
    ``%E2%9C%93``, ``ü`` -> ``%C3%BC``), a ``%XX`` escape kept as given (an encoded path stays
    as it is), a ``%`` that starts no escape encoded (``%25``)."""
    out = []
    pos = 0
    for m in _ESCAPE.finditer(path):
        out.append(quote(path[pos : m.start()], safe=_PATH_SAFE))
        out.append(m.group(0).upper())
        pos = m.end()
    out.append(quote(path[pos:], safe=_PATH_SAFE))
    return "".join(out)


def requote_url(url: str) -> str:
    """``url`` with its path requoted (:func:`requote_path`) and its query's raw characters
    encoded the same way; scheme, host and port as given."""
    p = urlsplit(url)
    query = quote(p.query, safe=_PATH_SAFE + "?%") if p.query else ""
    return urlunsplit((p.scheme, p.netloc, requote_path(p.path), query, p.fragment))


_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def _virtual(bucket: str, endpoint: str | None, style: str | None) -> bool:
    """Whether the bucket goes in the host (``bucket.endpoint-host``), as botocore's S3
    endpoint rules put it: AWS's own endpoint unless ``addressing_style="path"``; an
    ``endpoint_url`` only with ``addressing_style="virtual"``, and not for a host that is an
    IP address (botocore then keeps the path style). Either way a bucket whose name is not a
    DNS label (dots under https, capitals, underscores) stays in the path: no request ever
    goes to a host that names another bucket."""
    if style == "path" or (endpoint is not None and style != "virtual"):
        return False
    if endpoint is not None:
        host = urlsplit(endpoint).hostname or ""
        try:
            ipaddress.ip_address(host)
            return False
        except ValueError:
            pass
        secure = not endpoint.lower().startswith("http://")
    else:
        secure = True
    labels = bucket.split(".")
    if secure and len(labels) > 1:
        return False
    return 3 <= len(bucket) <= 63 and all(_DNS_LABEL.fullmatch(x) for x in labels)


def _etag(value: str | None) -> str | None:
    if not value:
        return None
    return value.strip().removeprefix("W/").strip('"') or None


class WireStorage(ListedStore):
    """S3, GCS or HTTP(S) through asyncload's own HTTP/1.1 client (one connection pool per
    origin, dropped by :meth:`aclose`). Versions are pinned (S3: ETag; GCS: generation; HTTP:
    ETag, else Last-Modified). HTTP directory listings go through the store ``lister()``
    makes (the factory's: fsspec's)."""

    transport = "wire"

    hedgeable = True
    receives_into = True
    supports_read_object = True

    def __init__(
        self,
        root: str,
        spec: WireSpec,
        *,
        lister: Callable[[], Storage] | None = None,
        max_listing_size: int | None = None,
    ) -> None:
        super().__init__(root, lister=lister)
        self.spec = spec
        if spec.proxy:
            log.debug(
                "reading %s through the proxy %s (%s)",
                redact_url(root),
                redact_url(spec.proxy),
                spec.proxy_source,
            )
        if not spec.verify and spec.object_url("x").startswith("https://"):
            log.warning(
                "TLS certificate verification is off for %s (storage_options verify=False): "
                "any server on the way can read and change what this load reads",
                redact_url(root),
            )
        self._origin = origin_of(spec.object_url("x"))
        #: origin -> its pool (the checkpoint's only: nothing else is ever asked)
        self._pools: dict[str, Pool] = {}
        self._ssl: ssl.SSLContext | None = None
        #: file name -> the condition header to send (``If-Match`` with a strong ETag)
        self._conditions: dict[str, str] = {}
        self._max_listing = max_listing_size or LISTING_LIMIT
        #: requests written to a connection so far (:meth:`requests_sent`)
        self._sent = 0

    def __repr__(self) -> str:
        return f"<WireStorage {self.url('')} pools={list(self._pools.values())}>"

    # requests
    def _pool(self, url: str) -> Pool:
        origin = origin_of(url)
        pool = self._pools.get(origin)
        if pool is None:
            p = urlsplit(url)
            scheme = p.scheme.lower()
            if scheme == "https" and self._ssl is None:
                self._ssl = self.spec.ssl_context()
            port = p.port or (443 if scheme == "https" else 80)
            pool = self._pools[origin] = Pool(
                scheme, p.hostname or "", port, self._ssl, proxy=self.spec.proxy
            )
        return pool

    async def _headers(self, method: str, url: str, extra: Mapping[str, str]) -> dict[str, str]:
        headers = {"Accept-Encoding": "identity", **self.spec.headers}
        headers.update(extra)
        signer, auth = self.spec.signer, self.spec.auth
        p = urlsplit(url)
        if signer is not None:
            pool = self._pool(url)
            headers.update(signer.sign(method, pool.host_header, p.path or "/", p.query))
        elif auth is not None:  # credentials from another host, refreshed off the loop
            host = self._pool(url).host_header
            headers.update(await auth.headers(method, host, p.path or "/", p.query))
        return headers

    async def _send(self, method: str, name: str, url: str, extra: Mapping[str, str]) -> Response:
        """Send a request and follow redirects within the checkpoint's origin (re-signed for
        their path); a redirect elsewhere is refused before anything is sent there."""
        for _ in range(MAX_REDIRECTS + 1):
            if origin_of(url) != self._origin:  # never happens but through a redirect
                raise AssertionError("a request outside the origin")  # pragma: no cover
            p = urlsplit(url)
            target = (p.path or "/") + (f"?{p.query}" if p.query else "")
            headers = await self._headers(method, url, extra)
            resp = await self._pool(url).request(
                method, target, headers, self.url(name), self._count_sent
            )
            location = resp.headers.get("location")
            if resp.status not in (301, 302, 303, 307, 308) or not location:
                return resp
            resp.close()
            nxt = urljoin(url, location)
            if origin_of(nxt) != self._origin:
                raise CrossOriginRedirectError(
                    self.url(name), nxt, resp.status, origin=self._origin
                )
            url = nxt
        raise ConnectionError(f"{self.url(name)}: more than {MAX_REDIRECTS} redirects")

    def _count_sent(self) -> None:
        self._sent += 1

    def requests_sent(self) -> int:
        return self._sent

    def _version(self, headers: Mapping[str, str]) -> str | None:
        if self.spec.kind == "gcs":
            gen = headers.get("x-goog-generation")
            if gen:
                return f"generation {gen}"
        etag = _etag(headers.get("etag"))
        if etag:
            return f"etag {etag}"
        modified = headers.get("last-modified")
        return f"last-modified {modified}" if self.spec.kind == "http" and modified else None

    def _identity(self, name: str, headers: Mapping[str, str]) -> None:
        """Refuse a compressed answer of an HTTP server (nginx with ``gzip on``): its bytes
        are not the file's. An S3 or GCS object's ``Content-Encoding`` is metadata stored
        with it, its bytes served as stored: not refused here."""
        if self.spec.kind == "http":
            check_identity(self.url(name), headers)

    def _see_headers(
        self, name: str, headers: Mapping[str, str], byte_range: tuple[int, int] | None
    ) -> None:
        self._see(name, self._version(headers), byte_range)
        raw = headers.get("etag")
        if raw and name not in self._conditions and raw.strip().startswith('"'):
            self._conditions[name] = raw.strip()

    async def _ranged(self, name: str, start: int, end: int, *, conditional: bool) -> Response:
        """A GET of bytes ``[start, end)`` whose head is checked (status, version,
        ``Content-Range`` and length) before any byte of its body is read."""
        extra = {"Range": f"bytes={start}-{end - 1}"}
        cond = self._conditions.get(name) if conditional else None
        if cond is not None:
            extra["If-Match"] = cond
        resp = await self._send("GET", name, self.spec.object_url(name), extra)
        try:
            if resp.status == 412 and cond is not None:
                raise ObjectChangedError(
                    self.url(name), (start, end), self.pinned(name) or f"etag {cond}", None
                )
            if resp.status >= 300:
                raise await resp.error()
            first_byte()  # the answer has begun: the hedge's first-byte clock
            self._identity(name, resp.headers)
            self._see_headers(name, resp.headers, (start, end))
            if resp.status != 206:
                # a 200: the whole file, acceptable only where it is exactly the range
                if start != 0 or resp.length is None or resp.length > end:
                    got = f"{resp.length} bytes" if resp.length is not None else "a body"
                    raise RangeIgnoredError(self.url(name), start, end, resp.status, got)
                self._totals.setdefault(name, resp.length)
                if resp.length < end:  # the whole file is shorter than the range
                    raise ShortReadError(self.url(name), start, end, resp.length)
                return resp
            self._check_range(name, start, end, resp.status, resp.headers.get("content-range"))
            first, stop, total = parse_content_range(resp.headers.get("content-range")) or (
                start,
                end,
                None,
            )
            known = self._sizes.get(name)
            if total is not None and known is not None and total != known:
                raise RangeMismatchError(
                    self.url(name), start, end, 206, f"a total of {total} bytes, not {known}"
                )
            if resp.length is not None and resp.length != stop - first:
                got = (
                    "a body longer than that range"
                    if resp.length > stop - first
                    else f"Content-Length {resp.length}"
                )
                raise RangeMismatchError(self.url(name), start, end, 206, got)
            if stop < end:  # the file ends there
                raise ShortReadError(self.url(name), start, end, stop - start)
            return resp
        except BaseException:
            resp.close()
            raise

    async def readinto(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Receive bytes ``[start, start + len(buffers))`` straight into ``buffers``."""
        views = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers]
        n = sum(len(v) for v in views)
        if n == 0:
            return
        resp = await self._ranged(name, start, start + n, conditional=True)
        got = await resp.read_into(views, n)
        if got != n:
            raise ShortReadError(self.url(name), start, start + n, got)

    async def read(self, name: str, start: int, end: int) -> memoryview:
        out = bytearray(max(0, end - start))
        await self.readinto(name, start, [memoryview(out)])
        return memoryview(out)

    async def read_object(self, name: str, max_size: int) -> tuple[memoryview | None, int]:
        """One ranged GET of the first ``min(max_size, OBJECT_PREFIX)`` bytes gives the size;
        a larger file within ``max_size`` takes one more GET of the rest, conditional on that
        version."""
        first, size = await self.read_prefix(name, min(max_size, OBJECT_PREFIX))
        if size > max_size:
            return None, size
        if len(first) >= size:
            return first, size
        whole = bytearray(size)
        whole[: len(first)] = first
        await self.readinto(name, len(first), [memoryview(whole)[len(first) :]])
        return memoryview(whole), size

    async def read_prefix(self, name: str, n: int) -> tuple[memoryview, int]:
        """The first ``n`` bytes and the file's size in one ranged GET (its ``Content-Range``
        total); an empty file, which no range fits (416), is asked its size."""
        if n <= 0:
            return memoryview(b""), await self.size(name)
        resp = await self._send(
            "GET", name, self.spec.object_url(name), {"Range": f"bytes=0-{n - 1}"}
        )
        try:
            if resp.status == 416:
                resp.close()
                if await self._head(name) == 0:
                    return memoryview(b""), 0
                raise RangeMismatchError(self.url(name), 0, n, 416, "416 for a file not empty")
            if resp.status >= 300:
                raise await resp.error()
            first_byte()
            self._identity(name, resp.headers)
            self._see_headers(name, resp.headers, (0, n))
            if resp.status == 200:
                if resp.length is None or resp.length > n:
                    raise RangeIgnoredError(self.url(name), 0, n, 200, "the whole file")
                size = resp.length
            else:
                parsed = parse_content_range(resp.headers.get("content-range"))
                if parsed is None or parsed[2] is None:
                    raise RangeMismatchError(
                        self.url(name),
                        0,
                        n,
                        206,
                        f"Content-Range {resp.headers.get('content-range')!r}",
                    )
                size = parsed[2]
                self._check_range(name, 0, min(n, size), 206, resp.headers.get("content-range"))
            want = min(n, size)
            if resp.length is not None and resp.length != want:
                raise RangeMismatchError(
                    self.url(name), 0, want, resp.status, f"Content-Length {resp.length}"
                )
        except BaseException:
            resp.close()
            raise
        self._sizes[name] = size
        out = bytearray(want)
        got = await resp.read_into([memoryview(out)], want)
        if got != want:
            raise ShortReadError(self.url(name), 0, want, got)
        return memoryview(out), size

    async def _head(self, name: str) -> int:
        resp = await self._send("HEAD", name, self.spec.object_url(name), {})
        try:
            if resp.status >= 300:
                raise await resp.error()
            self._identity(name, resp.headers)
            self._see_headers(name, resp.headers, None)
            length = resp.headers.get("content-length", "")
        finally:
            resp.close()
        if not length.isdigit():  # a HEAD without a length: one byte's answer gives the total
            _, size = await self.read_prefix(name, 1)
            return size
        size = self._sizes[name] = int(length)
        return size

    # listings
    def warm(self) -> None:
        """An S3 listing's XML parser imported while the listing is on the wire (3-4 ms of a
        fresh process's first load, after its answer otherwise)."""
        if (
            self.spec.kind == "s3"
            and self._listing is not None
            and "defusedxml.ElementTree" not in sys.modules
        ):
            import defusedxml.ElementTree  # noqa: F401

    async def _list(self) -> list[Listed]:
        """``(name, size, version)`` of every file directly under the root (S3, GCS), all
        pages together at most the listing limit."""
        out: list[Listed] = []
        token: str | None = None
        left = self._max_listing
        prefix = f"{self.spec.prefix}/" if self.spec.prefix else ""
        while True:
            url = self.spec.list_url(token)
            resp = await self._send("GET", "", url, {})
            if resp.status >= 300:
                raise await resp.error()
            try:
                body = await resp.read(left)
            except BodyTooLongError:
                raise ListingTooLargeError(self.url(""), self._max_listing) from None
            left -= len(body)
            if self.spec.kind == "gcs":
                page, token = _gcs_page(bytes(body), prefix)
            else:
                page, token = _s3_page(bytes(body), prefix, self.url(""))
            out.extend(page)
            if not token:
                return out

    async def aclose(self) -> None:
        """Close every connection and the HTTP lister. Safe to call twice."""
        await self._close_listing()
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


def _s3_page(body: bytes, prefix: str, url: str = "") -> tuple[list[Listed], str | None]:
    """One ListObjectsV2 page: its files (names relative to the root) and the next token.

    Parsed without a DTD, entity or external reference (defusedxml): S3 never sends one, and
    an entity expanded in memory would turn a listing within ``max_metadata_size`` into
    hundreds of times as much (a "billion laughs"). Raised: ``CheckpointFormatError`` for a
    listing that declares any, ``ConnectionError`` for one that is not XML."""
    import xml.etree.ElementTree as ET

    import defusedxml.ElementTree as safe_et
    from defusedxml import DefusedXmlException

    try:
        root = safe_et.fromstring(body, forbid_dtd=True, forbid_entities=True)
    except DefusedXmlException as exc:
        raise CheckpointFormatError(
            f"the listing of {redact_url(url) or 'the checkpoint'} declares a DTD or an entity "
            f"({type(exc).__name__}), which no S3 listing does: refused unparsed (is the "
            "endpoint_url an S3 store?)"
        ) from None
    except ET.ParseError as exc:
        raise ConnectionError(f"a listing that is not XML: {exc}") from None
    ns = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""
    out = []
    for item in root.iter(f"{ns}Contents"):
        key = item.findtext(f"{ns}Key") or ""
        size = item.findtext(f"{ns}Size") or ""
        etag = _etag(item.findtext(f"{ns}ETag"))
        if key.startswith(prefix) and size.isdigit():
            out.append((key[len(prefix) :], int(size), f"etag {etag}" if etag else None))
    truncated = (root.findtext(f"{ns}IsTruncated") or "").lower() == "true"
    token = root.findtext(f"{ns}NextContinuationToken") if truncated else None
    return out, token


def _gcs_page(body: bytes, prefix: str) -> tuple[list[Listed], str | None]:
    """One page of the GCS JSON API's object list."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ConnectionError(f"a listing that is not JSON: {exc}") from None
    out = []
    for item in doc.get("items") or []:
        name, size, gen = item.get("name", ""), str(item.get("size", "")), item.get("generation")
        if isinstance(name, str) and name.startswith(prefix) and size.isdigit():
            out.append((name[len(prefix) :], int(size), f"generation {gen}" if gen else None))
    token = doc.get("nextPageToken")
    return out, token if isinstance(token, str) and token else None
