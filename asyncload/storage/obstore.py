"""obstore (the Rust ``object_store`` crate's Python bindings) behind the Storage interface,
for ``s3://``, ``gs://`` / ``gcs://`` and ``http(s)://``.

Built from the same fsspec-style ``storage_options`` users pass to s3fs, gcsfs and
fsspec's HTTP filesystem: :func:`plan_store` maps what it can map faithfully and raises
:class:`Unmappable` (naming the option) for anything else, so that
:func:`asyncload.storage.base.open_storage` falls back to fsspec instead of dropping an
option. obstore's own retries are off and its own timeouts out of the way
(asyncload's policy in :mod:`asyncload.storage.retrying` is the only one); reads are
conditional on the version of the object first seen and every answer is compared,
like :class:`asyncload.storage.base.FsspecStorage`. A read's body is streamed and refused
past the length asked for (never buffered whole). Requests to hosts other than the
origin's (a redirect object_store would follow) are refused by :class:`RedirectGuard`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import datetime
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from asyncload._errors import redact_url
from asyncload.storage.base import (
    CrossOriginRedirectError,
    FsspecStorage,
    ObjectChangedError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
    VersionPins,
    first_byte,
    origin_of,
)

__all__ = ["OBSTORE_PROTOCOLS", "ObstoreStorage", "StoreSpec", "Unmappable", "plan_store"]

log = logging.getLogger("asyncload.storage")

#: URL schemes obstore serves here.
OBSTORE_PROTOCOLS = frozenset({"s3", "gs", "gcs", "http", "https"})
#: obstore's own timeouts, out of the way: a read is cancelled by asyncload's ``timeout``.
_NO_TIMEOUT = datetime.timedelta(days=7)
#: The first GET of a ``.metadata`` (:meth:`ObstoreStorage.read_object`) asks for at most this
#: many bytes: most fit; a larger one takes a second GET.
OBJECT_PREFIX = 4 << 20


async def _finish(result: Any) -> None:
    """Read a refused answer's body to its end where it is small (at most
    :data:`OBJECT_PREFIX`): obstore 0.12 can keep the connection of a body dropped unread
    open for good. A larger body (a server that ignores the range asked for) is dropped."""
    lo, hi = result.range
    if hi - lo <= OBJECT_PREFIX:
        with contextlib.suppress(Exception):
            await result.bytes_async()


async def _body(result: Any, want: int) -> Any:
    """The body of a ranged answer whose headers promised ``want`` bytes, read as a stream
    that stops past them: ``None`` when it is longer (a body with the right ``Content-Range``
    and hundreds of MiB too many bytes is refused after at most about twice ``want`` bytes, not
    buffered whole, as ``bytes_async`` would). One buffer of obstore's when the body is as
    long as promised (no copy)."""
    if want <= 0:
        want = 1  # an empty range: any byte is one too many
    stream = result.stream(min_chunk_size=want)
    first: Any = b""
    async for piece in stream:  # the first piece holds at least ``want`` bytes, or all there are
        first = piece
        break
    if len(first) > want:
        return None
    if len(first) == want:
        async for _more in stream:  # one more byte is over-long; the end of the body is not
            return None
    return first


#: fsspec options that change nothing about a ranged read (instance caching, file-object
#: buffering, listing caches, the event loop fsspec runs on): safe to leave out.
_NO_EFFECT = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "asynchronous",
        "loop",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "block_size",
        "cache_type",
        "cache_options",
    }
)
_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


class Unmappable(Exception):
    """Raised by :func:`plan_store` when ``storage_options`` (or the environment) ask for
    something obstore cannot do the way the fsspec filesystem would; the message says what."""


@dataclass(frozen=True)
class StoreSpec:
    """How to build one obstore store for a checkpoint root: ``kind`` (``"s3"``, ``"gcs"``,
    ``"http"``), the bucket and prefix (or the base URL), the store's configuration and
    HTTP client options."""

    kind: str
    bucket: str | None
    prefix: str | None
    url: str | None = None
    #: (never in ``repr``: keys, secrets and headers)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    client_options: dict[str, Any] = field(default_factory=dict, repr=False)
    max_retries: int = 0
    #: the hosts the store's requests go to (its origin's), when every other host can be
    #: refused (:class:`RedirectGuard`): a store whose credentials come from another host (an
    #: instance role, web identity, a token endpoint) has ``None``
    origin_hosts: tuple[str, ...] | None = None

    def build(self, guard: RedirectGuard | None = None) -> Any:
        from obstore.store import GCSStore, HTTPStore, S3Store

        _settle_at_exit()
        client: Any = {"timeout": _NO_TIMEOUT, "connect_timeout": _NO_TIMEOUT, **self.client_options}
        if guard is not None and self.origin_hosts:
            # every host but the origin's goes to the guard, which refuses it: a redirect to
            # another host is never followed (object_store follows redirects itself)
            client["proxy_url"] = guard.proxy_url
            client["proxy_excludes"] = ",".join(self.origin_hosts)
        retry: Any = {"max_retries": self.max_retries}
        config: Any = self.config
        if self.kind == "s3":
            return S3Store(self.bucket, prefix=self.prefix, config=config, client_options=client, retry_config=retry)
        if self.kind == "gcs":
            return GCSStore(self.bucket, prefix=self.prefix, config=config, client_options=client, retry_config=retry)
        return HTTPStore(str(self.url), client_options=client, retry_config=retry)


#: the process that built the first store (its runtime threads do not survive a fork)
_settling: list[int] = []


def _settle_at_exit() -> None:
    """Once a store is built: give obstore's runtime threads a moment at interpreter exit.

    obstore 0.12's tokio threads finish their share of a just-completed read after the
    Python future resolved; a process that exits in that window aborts (SIGABRT, about one
    exit in four right after concurrent reads, measured here; ``tests/test_obstore.py``). 50 ms
    in an ``atexit`` hook (registered on first use, not at import) closes the window."""
    if not _settling:
        _settling.append(os.getpid())
        atexit.register(time.sleep, 0.05)


def forked_after_use() -> bool:
    """Whether this process is a fork of one that used obstore: the child inherits its
    runtime without the runtime's threads, and every read would hang until it times out."""
    return bool(_settling) and _settling[0] != os.getpid()


def obstore_available() -> bool:
    """Whether obstore can be imported."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def plan_store(url: str, storage_options: Mapping[str, Any]) -> StoreSpec:
    """The obstore store for checkpoint ``url`` with fsspec-style ``storage_options``.

    Raised: :class:`Unmappable` naming the option (or environment variable) that obstore
    cannot honour as the fsspec filesystem would."""
    parts = urlsplit(url)
    protocol = parts.scheme.lower()
    if protocol not in OBSTORE_PROTOCOLS:
        raise Unmappable(f"obstore is not used for {protocol}:// URLs")
    if forked_after_use():
        raise Unmappable(
            "this process was forked from one that used obstore, whose runtime threads a fork does not copy"
        )
    if parts.query or parts.fragment:
        raise Unmappable(f"the URL {redact_url(url)!r} has a query or fragment")
    opts = {k: v for k, v in storage_options.items() if k not in _NO_EFFECT}
    if protocol in ("http", "https"):
        return _http_spec(url, opts)
    bucket = parts.netloc
    prefix = parts.path.strip("/") or None
    if "@" in bucket:
        raise Unmappable(
            f"the URL {redact_url(url)!r} carries credentials (user:password@), which {protocol}:// does not use: "
            "pass them in storage_options (key/secret/token, or token= for GCS)"
        )
    if not bucket:
        raise Unmappable(f"the URL {redact_url(url)!r} names no bucket")
    return _s3_spec(bucket, prefix, opts) if protocol == "s3" else _gcs_spec(bucket, prefix, opts)


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


def _allow_http(endpoint: str | None, client: dict[str, Any]) -> None:
    if endpoint is not None and endpoint.lower().startswith("http://"):
        client["allow_http"] = True


def _leftover(where: str, left: Mapping[str, Any]) -> None:
    if left:
        raise Unmappable(f"{where} {sorted(left)} {'has' if len(left) == 1 else 'have'} no obstore equivalent")


def _seconds(name: str, value: Any) -> datetime.timedelta:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise Unmappable(f"{name}={value!r} is not a positive number of seconds")
    return datetime.timedelta(seconds=value)


def _s3_spec(bucket: str, prefix: str | None, opts: dict[str, Any]) -> StoreSpec:
    """s3fs's options: ``endpoint_url``, ``key``, ``secret``, ``token``, ``anon``,
    ``requester_pays``, ``client_kwargs`` (``endpoint_url``, ``region_name``,
    ``aws_access_key_id``...), ``config_kwargs`` (pool size, retries, timeouts, addressing
    style, unsigned); the ``AWS_*`` environment as botocore reads it."""
    ck = dict(opts.pop("client_kwargs", None) or {})
    cfg = dict(opts.pop("config_kwargs", None) or {})
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    max_retries = 0
    for name in ("profile", "session"):
        if opts.get(name) is not None:
            raise Unmappable(f"storage_options {name!r} (a botocore profile or session) has no obstore equivalent")
        opts.pop(name, None)
    endpoint = (
        opts.pop("endpoint_url", None)
        or ck.pop("endpoint_url", None)
        or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    )
    ck.pop("endpoint_url", None)
    key = opts.pop("key", None) or ck.pop("aws_access_key_id", None)
    secret = opts.pop("secret", None) or ck.pop("aws_secret_access_key", None)
    token = opts.pop("token", None) or ck.pop("aws_session_token", None)
    anon = bool(opts.pop("anon", False))
    if opts.pop("requester_pays", False):
        config["request_payer"] = True
    if opts.pop("use_ssl", True) is False and not (endpoint or "").lower().startswith("http://"):
        raise Unmappable("storage_options use_ssl=False without an http:// endpoint_url")
    region = ck.pop("region_name", None) or cfg.pop("region_name", None) or _env("AWS_REGION", "AWS_DEFAULT_REGION")
    verify = ck.pop("verify", None)
    if verify is False:
        client["allow_invalid_certificates"] = True
    elif isinstance(verify, str) or _env("AWS_CA_BUNDLE"):
        client["root_certificate"] = _read_pem(verify if isinstance(verify, str) else str(_env("AWS_CA_BUNDLE")))
    elif verify not in (None, True):
        raise Unmappable(f"client_kwargs verify={verify!r} has no obstore equivalent")
    if _env("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        raise Unmappable("AWS_PROFILE (credentials from a botocore profile) has no obstore equivalent")
    # botocore's config
    if "max_pool_connections" in cfg:
        client["pool_max_idle_per_host"] = str(int(cfg.pop("max_pool_connections")))
    retries = cfg.pop("retries", None)
    if retries is not None:
        attempts = retries.get("total_max_attempts") or (retries.get("max_attempts", 0) + 1)
        if set(retries) - {"total_max_attempts", "max_attempts", "mode"} or not isinstance(attempts, int):
            raise Unmappable(f"config_kwargs retries={retries!r} has no obstore equivalent")
        max_retries = max(0, attempts - 1)
    for name, opt in (("connect_timeout", "connect_timeout"), ("read_timeout", "read_timeout")):
        if name in cfg:
            client[opt] = _seconds(f"config_kwargs {name}", cfg.pop(name))
    if "signature_version" in cfg:
        sig = cfg.pop("signature_version")
        if str(sig) != "UNSIGNED" and sig not in ("s3v4", "v4"):
            raise Unmappable(f"config_kwargs signature_version={sig!r} has no obstore equivalent")
        anon = anon or str(sig) == "UNSIGNED"
    s3cfg = dict(cfg.pop("s3", None) or {})
    style = s3cfg.pop("addressing_style", None)
    if style == "virtual":
        config["virtual_hosted_style_request"] = True
    elif style not in (None, "auto", "path"):
        raise Unmappable(f"config_kwargs s3 addressing_style={style!r} has no obstore equivalent")
    _leftover("config_kwargs s3", s3cfg)
    _leftover("config_kwargs", cfg)
    _leftover("client_kwargs", ck)
    _leftover("storage_options", opts)
    # credentials: only sources obstore reads the way botocore does
    if anon:
        config["skip_signature"] = True
    elif key or secret:
        if not (key and secret):
            raise Unmappable("storage_options give an access key without its secret (or a secret without its key)")
        if token is None and _env("AWS_SESSION_TOKEN"):
            raise Unmappable("explicit key/secret with AWS_SESSION_TOKEN in the environment (botocore ignores it)")
        config.update(access_key_id=key, secret_access_key=secret)
        if token:
            config["session_token"] = token
    elif not (
        (_env("AWS_ACCESS_KEY_ID") and _env("AWS_SECRET_ACCESS_KEY"))
        or _env("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or _env("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    ):
        shared = [
            os.path.expanduser(p)
            for p in (
                _env("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
                _env("AWS_CONFIG_FILE") or "~/.aws/config",
            )
        ]
        if any(os.path.exists(p) for p in shared):
            raise Unmappable("credentials would come from ~/.aws (a botocore profile), which obstore does not read")
        if str(_env("AWS_EC2_METADATA_DISABLED") or "").lower() == "true":
            # botocore then finds no credentials and stops; obstore would ask the instance
            # metadata endpoint (169.254.169.254) instead
            raise Unmappable("no credentials, and AWS_EC2_METADATA_DISABLED=true rules out the instance metadata")
    if endpoint is not None:
        config["endpoint"] = endpoint
        _allow_http(endpoint, client)
    if region is None:
        if endpoint is None:
            raise Unmappable("no region given (s3fs finds the bucket's region itself, obstore needs it)")
        region = "us-east-1"  # what botocore signs with for a custom endpoint without a region
    config["region"] = region
    static = bool(anon or key)  # no credential provider asks another host
    hosts = _hosts(endpoint) if endpoint is not None and static else None
    if hosts and config.get("virtual_hosted_style_request"):
        hosts = (*hosts, f"{bucket}.{hosts[0]}")  # requests go to bucket.endpoint-host
    return StoreSpec(
        "s3", bucket, prefix, config=config, client_options=client, max_retries=max_retries, origin_hosts=hosts
    )


def _read_pem(path: str) -> str:
    """A CA bundle's certificates (obstore adds them to the system's roots)."""
    try:
        with open(os.path.expanduser(path), encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError) as exc:
        raise Unmappable(f"the CA bundle {path!r} cannot be read: {exc}") from None


def _gcs_spec(bucket: str, prefix: str | None, opts: dict[str, Any]) -> StoreSpec:
    """gcsfs's options: ``endpoint_url`` (or ``STORAGE_EMULATOR_HOST``), ``token``
    (``"anon"``, ``None``/``"google_default"``/``"cloud"``, a key file's path, a service
    account dict), ``project`` and ``access`` (not used by object reads)."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    if any(_env(n) for n in _PROXY_ENV):
        raise Unmappable("a proxy in the environment (gcsfs's aiohttp session ignores it, obstore would use it)")
    emulator = _env("STORAGE_EMULATOR_HOST")
    endpoint = opts.pop("endpoint_url", None) or emulator
    if endpoint is not None and "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    token = opts.pop("token", None)
    opts.pop("project", None)  # names the project for bucket listing/creation only
    opts.pop("access", None)  # an OAuth scope; every scope can read
    opts.pop("consistency", None)  # checks of writes
    opts.pop("secure_serialize", None)
    opts.pop("check_connection", None)
    if opts.pop("requester_pays", False):
        raise Unmappable("storage_options requester_pays has no obstore equivalent for GCS")
    if opts.pop("version_aware", False):
        raise Unmappable("storage_options version_aware has no obstore equivalent")
    _leftover("storage_options", opts)
    if token == "anon" or (token is None and endpoint is not None and endpoint == _norm_host(emulator)):
        config["skip_signature"] = True
    elif token in (None, "google_default", "cloud"):
        adc = _env("GOOGLE_APPLICATION_CREDENTIALS")
        if adc is not None and _key_type(adc) not in ("service_account", "authorized_user"):
            raise Unmappable("GOOGLE_APPLICATION_CREDENTIALS is not a service account or user key file")
    elif isinstance(token, str):
        kind = _key_type(token)
        if kind == "service_account":
            config["service_account"] = token
        elif kind == "authorized_user":
            config["application_credentials"] = token
        else:
            raise Unmappable(f"token={token!r} is neither a service account nor a user key file")
    elif isinstance(token, Mapping) and token.get("type") == "service_account":
        config["service_account_key"] = json.dumps(dict(token))
    else:
        raise Unmappable(f"token of type {type(token).__name__} has no obstore equivalent")
    if endpoint is not None:
        config["base_url"] = endpoint.rstrip("/")
        _allow_http(endpoint, client)
    hosts = _hosts(endpoint) if endpoint is not None and config.get("skip_signature") else None
    return StoreSpec("gcs", bucket, prefix, config=config, client_options=client, origin_hosts=hosts)


def _norm_host(emulator: str | None) -> str | None:
    if emulator is None:
        return None
    return emulator if "://" in emulator else f"http://{emulator}"


def _key_type(path: str) -> str | None:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            kind = json.load(f).get("type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _http_spec(url: str, opts: dict[str, Any]) -> StoreSpec:
    """fsspec HTTP options: ``headers``; ``client_kwargs`` ``headers`` and ``auth``
    (``aiohttp.BasicAuth``); link-parsing options (``simple_links``, ``same_scheme``,
    ``size_policy``) are used by listings, which go through fsspec here."""
    ck = dict(opts.pop("client_kwargs", None) or {})
    headers: dict[str, str] = {}
    for source in (ck.pop("headers", None), opts.pop("headers", None)):
        for k, v in dict(source or {}).items():
            headers[str(k)] = str(v)
    auth = ck.pop("auth", None)
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        # the URL's userinfo, as aiohttp sends it: Basic auth (reqwest drops Authorization on a
        # redirect to another origin, and asyncload refuses those anyway); the store's URL
        # carries no userinfo, so it never reaches a message or a request line
        if auth is not None:
            raise Unmappable("the URL carries credentials (user:password@) and client_kwargs gives auth too")
        import base64

        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"
        url = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, parts.query, parts.fragment))
    if auth is not None:
        encode = getattr(auth, "encode", None)
        if encode is None:
            raise Unmappable(f"client_kwargs auth of type {type(auth).__name__} has no obstore equivalent")
        headers["Authorization"] = str(encode())
    if ck.pop("trust_env", False):
        raise Unmappable("client_kwargs trust_env has no obstore equivalent")
    if any(_env(n) for n in _PROXY_ENV):
        raise Unmappable("a proxy in the environment (fsspec's aiohttp session ignores it, obstore would use it)")
    if opts.pop("encoded", False):
        raise Unmappable("storage_options encoded=True has no obstore equivalent")
    for name in ("simple_links", "same_scheme", "size_policy"):
        opts.pop(name, None)
    _leftover("client_kwargs", ck)
    _leftover("storage_options", opts)
    client: dict[str, Any] = {}
    if headers:
        client["default_headers"] = headers
    _allow_http(url, client)
    return StoreSpec("http", None, None, url=url.rstrip("/"), client_options=client, origin_hosts=_hosts(url))


def _hosts(url: str) -> tuple[str, ...] | None:
    """The host of ``url`` as ``proxy_excludes`` names it (None: none to name)."""
    host = urlsplit(url if "://" in url else f"http://{url}").hostname
    return (host,) if host else None


class RedirectGuard:
    """Refuses every request of an obstore store to a host other than its origin's.

    object_store (through reqwest) follows redirects itself, up to 10, and obstore 0.12 offers
    no redirect policy: a redirect to another host would carry the caller's headers (an API
    key), an S3 session token and the ``Referer`` there, and its answer would be used. So the
    store's HTTP client is given this listener on 127.0.0.1 as its proxy for every host but the
    origin's (``proxy_url`` with ``proxy_excludes``): a request to another host reaches only
    this process, which notes where it was going, answers 403 and closes. Nothing is
    forwarded. :meth:`refusal` then turns the store's error into
    :class:`asyncload.storage.base.CrossOriginRedirectError`. A redirect to another port of the
    same host is not caught this way (``proxy_excludes`` names hosts): see docs/remote.md.
    """

    def __init__(self) -> None:
        import socket

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.setblocking(False)
        self.proxy_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        #: the origins of the requests refused, oldest first
        self.refused: list[str] = []
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve on the running loop (connections wait in the backlog until then)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, sock=self._sock, limit=1 << 16)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            words = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            target = words[1] if len(words) >= 2 else "?"
            if words and words[0].upper() == "CONNECT":
                target = f"https://{target}"
            where = origin_of(target)
            self.refused.append(where)
            log.debug("refused a request of an obstore store to %s: not the checkpoint's origin", where)
            body = f"asyncload refused a request to {where}: not the checkpoint's origin\n".encode()
            writer.write(
                b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()

    def refusal(self, url: str, origin: str) -> CrossOriginRedirectError | None:
        """The error to raise for a failed request about ``url`` (a store of ``origin``) when
        a request was refused."""
        if not self.refused:
            return None
        return CrossOriginRedirectError(url, self.refused[-1], None, origin=origin)

    async def aclose(self) -> None:
        starting, self._starting = self._starting, None
        if starting is not None:
            await asyncio.gather(starting, return_exceptions=True)
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        self._sock.close()


def _etag(value: Any) -> str | None:
    """An entity tag without its quotes and weak marker, for comparison."""
    if not value:
        return None
    return str(value).strip().removeprefix("W/").strip('"')


class ObstoreStorage(VersionPins):
    """S3, GCS or HTTP(S) through one obstore store (one connection pool per storage,
    dropped by :meth:`aclose`).

    Versions are pinned at first sight as :class:`FsspecStorage` pins them (S3: ETag;
    GCS: generation; HTTP: ETag, else Last-Modified); a read is conditional on the ETag
    (``If-Match``) where the store sent a strong one, and every answer's version is
    compared. HTTP directory listings (HTML index pages) go through fsspec.
    """

    hedgeable = True

    def __init__(
        self,
        root: str,
        spec: StoreSpec,
        *,
        storage_options: Mapping[str, Any] | None = None,
        executor: concurrent.futures.Executor | None = None,
        max_listing_size: int | None = None,
    ) -> None:
        super().__init__(root)
        self.spec = spec
        self._store: Any = None
        #: file name -> the strong ETag to send as ``If-Match``
        self._conditions: dict[str, str] = {}
        self._storage_options = dict(storage_options or {})
        self._executor = executor
        self._lister: FsspecStorage | None = None
        #: file name -> its size, as a HEAD, a whole GET or a listing gave it (the version
        #: those answers carried is pinned: a later answer of another version fails the load)
        self._sizes: dict[str, int] = {}
        #: the listing :meth:`prefetch_sizes` started, and the sizes it gave that :meth:`size`
        #: has not yet answered from (once each: a later ``size`` asks the store again)
        self._listing: asyncio.Future[list[Any]] | None = None
        self._listed: dict[str, int] = {}
        #: the names of that listing, once it is back; a file directly under the root that it
        #: lacks is answered missing once, without a HEAD (the format probe's "is there an
        #: index?" of a Hugging Face directory)
        self._listed_names: frozenset[str] | None = None
        #: refuses the store's requests to other hosts (built with the store)
        self._guard: RedirectGuard | None = None
        #: the most bytes an HTTP directory listing may have (``LoadOptions.max_metadata_size``)
        self.max_listing_size = max_listing_size

    def _refusal(self, name: str) -> CrossOriginRedirectError | None:
        """The redirect to another host that :class:`RedirectGuard` refused, if any (a
        request of this store that failed failed because of it)."""
        if self._guard is None:
            return None
        where = self.spec.config.get("endpoint") or self.spec.config.get("base_url") or self.spec.url
        return self._guard.refusal(self.url(name), origin_of(str(where)))

    def _get_store(self) -> Any:
        if self._store is None:
            if self.spec.origin_hosts and self._guard is None:
                self._guard = RedirectGuard()
                self._guard.start()
            self._store = self.spec.build(self._guard)
        return self._store

    def _version_of(self, meta: Mapping[str, Any]) -> str | None:
        if self.spec.kind == "gcs":
            gen = meta.get("version")
            return f"generation {gen}" if gen else None
        etag = _etag(meta.get("e_tag"))
        if etag:
            return f"etag {etag}"
        modified = meta.get("last_modified")
        return f"last-modified {modified.isoformat()}" if self.spec.kind == "http" and modified else None

    def _see_meta(self, name: str, meta: Mapping[str, Any], byte_range: tuple[int, int] | None = None) -> None:
        self._see(name, self._version_of(meta), byte_range)
        raw = meta.get("e_tag")
        if raw and name not in self._conditions:
            raw = str(raw).strip()
            if self.spec.kind == "s3" and not raw.startswith('"'):
                raw = f'"{raw}"'  # S3 ETags are strong; a listing may give them unquoted
            if raw.startswith('"'):  # a strong tag: If-Match compares it
                self._conditions[name] = raw

    async def read(self, name: str, start: int, end: int) -> memoryview:
        import obstore
        from obstore.exceptions import NotSupportedError, PreconditionError

        options: dict[str, Any] = {"range": (start, end)}
        cond = self._conditions.get(name)
        if cond is not None:
            options["if_match"] = cond
        try:
            # no local names the store: a traceback kept by the caller must not keep its pool open
            result = await obstore.get_async(self._get_store(), name, options=options)  # type: ignore[arg-type]
        except PreconditionError as exc:
            raise ObjectChangedError(self.url(name), (start, end), self.pinned(name) or f"etag {cond}", None) from exc
        except NotSupportedError as exc:
            if "Range request not supported" in str(exc):  # a 200 for a ranged GET: the body is never read
                raise RangeIgnoredError(self.url(name), start, end, 200, "the whole file") from exc
            raise
        except Exception as exc:
            refusal = self._refusal(name)
            if refusal is None:
                raise
            raise refusal from exc
        first_byte()  # the answer has begun: the hedge's first-byte clock
        problem: OSError | None = None
        try:
            self._see_meta(name, result.meta, (start, end))
        except ObjectChangedError as exc:
            problem = exc
        lo, hi = result.range
        if problem is None and (lo != start or hi > end):
            problem = RangeMismatchError(self.url(name), start, end, 206, f"bytes [{lo}, {hi})")
        total, known = int(result.meta["size"]), self._sizes.get(name)
        if problem is None and known is not None and total != known:  # the Content-Range total
            problem = RangeMismatchError(self.url(name), start, end, 206, f"a total of {total} bytes, not {known}")
        if problem is not None:
            await _finish(result)
            del result
            raise problem
        data = await _body(result, end - start)
        del result
        if data is None:
            raise RangeMismatchError(self.url(name), start, end, 206, "a body longer than that range")
        got = len(data)
        if got != end - start:
            raise ShortReadError(self.url(name), start, end, got)
        return memoryview(data)

    supports_read_object = True

    async def read_object(self, name: str, max_size: int) -> tuple[memoryview | None, int]:
        """The whole file and its size, without a HEAD first: one ranged GET of its first
        ``min(max_size, OBJECT_PREFIX)`` bytes (:meth:`read_prefix`: the answer's headers give
        the size and version, pinned here as a HEAD would), and for a larger file within
        ``max_size`` one more GET of the rest, conditional on that version. A file larger than
        ``max_size`` is refused after the first answer, whose bounded body is read to its end:
        obstore 0.12 can keep the connection of a body dropped unread open for good."""
        first, size = await self.read_prefix(name, min(max_size, OBJECT_PREFIX))
        if size > max_size:
            return None, size
        if len(first) >= size:
            return first, size
        whole = bytearray(size)
        whole[: len(first)] = first
        whole[len(first) :] = await self.read(name, len(first), size)
        return memoryview(whole), size

    async def read_prefix(self, name: str, n: int) -> tuple[memoryview, int]:
        """The first ``n`` bytes and the size in one ranged GET (no HEAD first): the answer's
        headers give the file's size and version (pinned here, as a HEAD would); the store
        answers a range past the end with the bytes there are. An empty file, which no range
        fits, is asked its size."""
        import obstore
        from obstore.exceptions import GenericError, NotSupportedError

        if n <= 0:
            return memoryview(b""), await self.size(name)
        try:
            result = await obstore.get_async(self._get_store(), name, options={"range": (0, n)})
        except NotSupportedError as exc:
            if "Range request not supported" in str(exc):  # a 200 for a ranged GET: the body is never read
                raise RangeIgnoredError(self.url(name), 0, n, 200, "the whole file") from exc
            raise
        except GenericError as exc:
            # 416 Range Not Satisfiable: no range fits an empty file (S3, GCS, HTTP alike)
            if "416" in str(exc) and await self._head(name) == 0:
                return memoryview(b""), 0
            refusal = self._refusal(name)
            if refusal is None:
                raise
            raise refusal from exc
        except Exception as exc:
            refusal = self._refusal(name)
            if refusal is None:
                raise
            raise refusal from exc
        first_byte()
        meta = result.meta
        problem: OSError | None = None
        try:
            self._see_meta(name, meta, (0, n))
        except ObjectChangedError as exc:
            problem = exc
        size = self._sizes[name] = int(meta["size"])
        want = min(n, size)
        lo, hi = result.range
        if problem is None and (lo != 0 or hi != want):
            problem = RangeIgnoredError(self.url(name), 0, want, 206, f"bytes [{lo}, {hi})")
        if problem is not None:
            await _finish(result)
            del result
            raise problem
        data = await _body(result, want)
        del result
        if data is None:
            raise RangeMismatchError(self.url(name), 0, want, 206, "a body longer than that range")
        if len(data) != want:
            raise ShortReadError(self.url(name), 0, want, len(data))
        return memoryview(data), size

    async def size(self, name: str) -> int:
        self._take_listing_if_back()
        listing = self._listing
        if listing is not None and "/" not in name:
            # the listing beside the .metadata GET is still on its way (it and the GET go out
            # together and come back about together): the answer is whichever comes first,
            # it or a HEAD, so a name it lacks (is there an index?) costs no extra round trip
            head = asyncio.ensure_future(self._head(name))
            try:
                pending: set[asyncio.Future[Any]] = {head, listing}
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                self._take_listing_if_back()
                if head.done() or self._listed_names is None:  # the HEAD first, or no listing
                    return await head
            finally:  # the listing answers (or this call is cancelled): the HEAD is not needed
                if not head.done():
                    head.cancel()
                    await asyncio.gather(head, return_exceptions=True)
        if name in self._listed:  # the listing beside the .metadata GET gave it: answers once
            return self._listed.pop(name)
        names = self._listed_names
        if names is not None and "/" not in name and name not in names:
            # the listing lacks it: missing, without a round trip; once (the name joins the
            # set): a later size asks the store
            self._listed_names = names | {name}
            raise FileNotFoundError(f"{self.url(name)} is not in the listing of {self.url('')}")
        return await self._head(name)

    async def _head(self, name: str) -> int:
        import obstore

        try:
            meta = await obstore.head_async(self._get_store(), name)
        except Exception as exc:
            refusal = self._refusal(name)
            if refusal is None:
                raise
            raise refusal from exc
        self._see_meta(name, meta)
        size = self._sizes[name] = int(meta["size"])
        return size

    async def _list(self) -> list[Any]:
        import obstore

        listing = await obstore.list_with_delimiter_async(self._get_store())
        return list(listing["objects"])

    def prefetch_sizes(self) -> None:
        """Start listing the checkpoint's directory now (S3, GCS), while ``.metadata`` is
        read: :meth:`sizes` takes the files' sizes from it if it has finished by then."""
        if self.spec.kind != "http" and self._listing is None:
            self._listing = asyncio.ensure_future(self._list())

    async def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """The sizes this load has already seen (a HEAD, a whole GET, a listing started by
        :meth:`prefetch_sizes` that has finished: no request), and one listing of the
        checkpoint's directory instead of a HEAD per file for the others (S3, GCS; 4 files
        or more)."""
        if not self._take_listing_if_back() and self._listing is not None:
            listing, self._listing = self._listing, None  # not back yet (a large directory): never wait for it
            listing.cancel()
            await asyncio.gather(listing, return_exceptions=True)
        out = {n: self._sizes[n] for n in names if n in self._sizes}
        wanted = set(names) - set(out)
        if len(wanted) < 4 or self.spec.kind == "http":
            return out
        self._take_listing(await self._list(), wanted)
        out.update((n, self._sizes[n]) for n in wanted if n in self._sizes)
        return out

    def _take_listing_if_back(self) -> bool:
        """Take the sizes and versions of every file of the listing :meth:`prefetch_sizes`
        started, if it is back (a failed one, e.g. without permission to list, is dropped)."""
        listing = self._listing
        if listing is None or not listing.done():
            return False
        self._listing = None
        if listing.cancelled() or listing.exception() is not None:
            return False
        for meta in listing.result():
            self._listed[str(meta["path"])] = int(meta["size"])
        self._listed_names = frozenset(self._listed)
        self._take_listing(listing.result(), None)
        return True

    def _take_listing(self, metas: list[Any], wanted: set[str] | None) -> None:
        for meta in metas:
            path = str(meta["path"])
            if wanted is None or path in wanted:
                self._sizes[path] = int(meta["size"])
                self._see(path, self._version_of(meta))

    async def listdir(self) -> list[str]:
        if self.spec.kind == "http":  # an HTML index page: fsspec parses its links
            if self._lister is None:
                if self._executor is None:
                    return []
                self._lister = FsspecStorage(
                    self.root,
                    urlsplit(self.root).scheme,
                    self._storage_options,
                    self._executor,
                    max_listing_size=self.max_listing_size,
                )
            return await self._lister.listdir()
        try:
            metas = await self._list()
        except FileNotFoundError:
            return []
        return sorted(str(m["path"]) for m in metas if "/" not in str(m["path"]))

    async def aclose(self) -> None:
        """Drop the store (its connection pool closes with it) and the HTTP lister. Safe to call twice."""
        listing, self._listing = self._listing, None
        if listing is not None:
            listing.cancel()
            await asyncio.gather(listing, return_exceptions=True)
        self._store = None
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.aclose()
        lister, self._lister = self._lister, None
        if lister is not None:
            await lister.aclose()
        await asyncio.sleep(0)
