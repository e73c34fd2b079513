"""How to reach a checkpoint through obstore (the Rust ``object_store`` crate's Python
bindings): :func:`plan_store` maps the fsspec-style ``storage_options`` users pass to s3fs, gcsfs
and fsspec's HTTP filesystem onto one obstore store (:class:`StoreSpec`), for ``s3://``,
``gs://`` / ``gcs://`` and ``http(s)://``.

It maps what it can map faithfully and raises :class:`Unmappable` (naming the option) for
anything else, so that :func:`asyncload.storage.factory.open_storage` falls back to fsspec
instead of dropping an option. obstore's own retries are off and its own timeouts out of the
way (asyncload's policy in :mod:`asyncload.storage.retrying` is the only one). The store reads
in :mod:`asyncload.storage.obstore`.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from asyncload._errors import redact_url

if TYPE_CHECKING:
    from asyncload.storage.redirect_guard import RedirectGuard

__all__ = [
    "OBSTORE_PROTOCOLS",
    "StoreSpec",
    "Unmappable",
    "forked_after_use",
    "obstore_available",
    "plan_store",
]

#: URL schemes obstore serves here.
OBSTORE_PROTOCOLS = frozenset({"s3", "gs", "gcs", "http", "https"})
#: obstore's own timeouts, out of the way: a read is cancelled by asyncload's ``timeout``.
_NO_TIMEOUT = datetime.timedelta(days=7)

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
    #: where the wire transport gets credentials that no key names (never in ``repr``):
    #: ``{"profile": name}`` for S3 (botocore's chain), ``{"token": token}`` for GCS
    #: (google-auth); made with ``for_obstore=False`` only
    source: dict[str, Any] = field(default_factory=dict, repr=False)

    def build(self, guard: RedirectGuard | None = None) -> Any:
        from obstore.store import GCSStore, HTTPStore, S3Store

        _settle_at_exit()
        client: Any = {
            "timeout": _NO_TIMEOUT,
            "connect_timeout": _NO_TIMEOUT,
            **self.client_options,
        }
        if guard is not None and self.origin_hosts:
            # every host but the origin's goes to the guard, which refuses it: a redirect to
            # another host is never followed (object_store follows redirects itself)
            client["proxy_url"] = guard.proxy_url
            client["proxy_excludes"] = ",".join(self.origin_hosts)
        retry: Any = {"max_retries": self.max_retries}
        config: Any = self.config
        if self.kind == "s3":
            return S3Store(
                self.bucket,
                prefix=self.prefix,
                config=config,
                client_options=client,
                retry_config=retry,
            )
        if self.kind == "gcs":
            return GCSStore(
                self.bucket,
                prefix=self.prefix,
                config=config,
                client_options=client,
                retry_config=retry,
            )
        return HTTPStore(str(self.url), client_options=client, retry_config=retry)


#: the process that built the first store (its runtime threads do not survive a fork)
_settling: list[int] = []


def _settle_at_exit() -> None:
    """Once a store is built: give obstore's runtime threads a moment at interpreter exit.

    obstore 0.12's tokio threads finish their share of a just-completed read after the
    Python future resolved; a process that exits in that window aborts (SIGABRT, about one
    exit in four right after concurrent reads, measured here; ``tests/storage/test_obstore.py``).
    50 ms in an ``atexit`` hook (registered on first use, not at import) closes the window."""
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


def plan_store(
    url: str, storage_options: Mapping[str, Any], *, for_obstore: bool = True
) -> StoreSpec:
    """The obstore store for checkpoint ``url`` with fsspec-style ``storage_options``
    (``for_obstore=False``: the mapping only, for the wire transport, which a fork does not
    hurt).

    Raised: :class:`Unmappable` naming the option (or environment variable) that obstore
    cannot honour as the fsspec filesystem would."""
    parts = urlsplit(url)
    protocol = parts.scheme.lower()
    if protocol not in OBSTORE_PROTOCOLS:
        raise Unmappable(f"obstore is not used for {protocol}:// URLs")
    if for_obstore and forked_after_use():
        raise Unmappable(
            "this process was forked from one that used obstore, whose runtime threads a fork does "
            "not copy"
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
            f"the URL {redact_url(url)!r} carries credentials (user:password@), which "
            f"{protocol}:// does not use: "
            "pass them in storage_options (key/secret/token, or token= for GCS)"
        )
    if not bucket:
        raise Unmappable(f"the URL {redact_url(url)!r} names no bucket")
    if protocol == "s3":
        return _s3_spec(bucket, prefix, opts, for_obstore)
    return _gcs_spec(bucket, prefix, opts, for_obstore)


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
        raise Unmappable(
            f"{where} {sorted(left)} {'has' if len(left) == 1 else 'have'} no obstore equivalent"
        )


def _seconds(name: str, value: Any) -> datetime.timedelta:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise Unmappable(f"{name}={value!r} is not a positive number of seconds")
    return datetime.timedelta(seconds=value)


def _s3_spec(
    bucket: str, prefix: str | None, opts: dict[str, Any], for_obstore: bool = True
) -> StoreSpec:
    """s3fs's options: ``endpoint_url``, ``key``, ``secret``, ``token``, ``anon``,
    ``requester_pays``, ``profile``, ``client_kwargs`` (``endpoint_url``, ``region_name``,
    ``aws_access_key_id``...), ``config_kwargs`` (pool size, retries, timeouts, addressing
    style, unsigned); the ``AWS_*`` environment as botocore reads it. ``for_obstore=False``
    (the wire transport, which resolves botocore's chain itself): a profile, ``AWS_PROFILE``
    and ``~/.aws`` are allowed, the profile kept in ``source``."""
    ck = dict(opts.pop("client_kwargs", None) or {})
    cfg = dict(opts.pop("config_kwargs", None) or {})
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    max_retries = 0
    source: dict[str, Any] = {}
    if not for_obstore and opts.get("profile") is not None:
        source["profile"] = str(opts.pop("profile"))
    for name in ("profile", "session"):
        if opts.get(name) is not None:
            raise Unmappable(
                f"storage_options {name!r} (a botocore profile or session) has no obstore "
                "equivalent"
            )
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
    region = (
        ck.pop("region_name", None)
        or cfg.pop("region_name", None)
        or _env("AWS_REGION", "AWS_DEFAULT_REGION")
    )
    verify = ck.pop("verify", None)
    if verify is False:
        client["allow_invalid_certificates"] = True
    elif isinstance(verify, str) or _env("AWS_CA_BUNDLE"):
        client["root_certificate"] = _read_pem(
            verify if isinstance(verify, str) else str(_env("AWS_CA_BUNDLE"))
        )
    elif verify not in (None, True):
        raise Unmappable(f"client_kwargs verify={verify!r} has no obstore equivalent")
    if for_obstore and _env("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        raise Unmappable(
            "AWS_PROFILE (credentials from a botocore profile) has no obstore equivalent"
        )
    # botocore's config
    if "max_pool_connections" in cfg:
        client["pool_max_idle_per_host"] = str(int(cfg.pop("max_pool_connections")))
    retries = cfg.pop("retries", None)
    if retries is not None:
        attempts = retries.get("total_max_attempts") or (retries.get("max_attempts", 0) + 1)
        if set(retries) - {"total_max_attempts", "max_attempts", "mode"} or not isinstance(
            attempts, int
        ):
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
            raise Unmappable(
                "storage_options give an access key without its secret (or a secret without its "
                "key)"
            )
        if token is None and _env("AWS_SESSION_TOKEN"):
            raise Unmappable(
                "explicit key/secret with AWS_SESSION_TOKEN in the environment (botocore ignores "
                "it)"
            )
        config.update(access_key_id=key, secret_access_key=secret)
        if token:
            config["session_token"] = token
    elif for_obstore and not (
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
            raise Unmappable(
                "credentials would come from ~/.aws (a botocore profile), which obstore does not "
                "read"
            )
        if str(_env("AWS_EC2_METADATA_DISABLED") or "").lower() == "true":
            # botocore then finds no credentials and stops; obstore would ask the instance
            # metadata endpoint (169.254.169.254) instead
            raise Unmappable(
                "no credentials, and AWS_EC2_METADATA_DISABLED=true rules out the instance metadata"
            )
    if endpoint is not None:
        config["endpoint"] = endpoint
        _allow_http(endpoint, client)
    if region is None:
        if endpoint is None:
            raise Unmappable(
                "no region given (s3fs finds the bucket's region itself, obstore needs it)"
            )
        region = "us-east-1"  # what botocore signs with for a custom endpoint without a region
    config["region"] = region
    static = bool(anon or key)  # no credential provider asks another host
    hosts = _hosts(endpoint) if endpoint is not None and static else None
    if hosts and config.get("virtual_hosted_style_request"):
        hosts = (*hosts, f"{bucket}.{hosts[0]}")  # requests go to bucket.endpoint-host
    return StoreSpec(
        "s3",
        bucket,
        prefix,
        config=config,
        client_options=client,
        max_retries=max_retries,
        origin_hosts=hosts,
        source=source,
    )


def _read_pem(path: str) -> str:
    """A CA bundle's certificates (obstore adds them to the system's roots)."""
    try:
        with open(os.path.expanduser(path), encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError) as exc:
        raise Unmappable(f"the CA bundle {path!r} cannot be read: {exc}") from None


def _gcs_spec(
    bucket: str, prefix: str | None, opts: dict[str, Any], for_obstore: bool = True
) -> StoreSpec:
    """gcsfs's options: ``endpoint_url`` (or ``STORAGE_EMULATOR_HOST``), ``token``
    (``"anon"``, ``None``/``"google_default"``/``"cloud"``, a key file's path, a service
    account dict), ``project`` and ``access`` (not used by object reads). ``for_obstore=False``
    (the wire transport, which makes OAuth tokens with google-auth): the token is kept in
    ``source`` as given; a user key's dict, a google-auth credentials object and application
    default credentials of any kind are allowed too."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    if any(_env(n) for n in _PROXY_ENV):
        raise Unmappable(
            "a proxy in the environment (gcsfs's aiohttp session ignores it, obstore would use it)"
        )
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
    source: dict[str, Any] = {"token": token}
    if token == "anon" or (
        token is None and endpoint is not None and endpoint == _norm_host(emulator)
    ):
        config["skip_signature"] = True
    elif token in (None, "google_default", "cloud"):
        adc = _env("GOOGLE_APPLICATION_CREDENTIALS")
        if (
            for_obstore
            and adc is not None
            and _key_type(adc) not in ("service_account", "authorized_user")
        ):
            raise Unmappable(
                "GOOGLE_APPLICATION_CREDENTIALS is not a service account or user key file"
            )
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
    elif not for_obstore and (
        (isinstance(token, Mapping) and token.get("type") == "authorized_user")
        or (not isinstance(token, (str, Mapping)) and hasattr(token, "refresh"))
    ):
        pass  # google-auth makes its tokens: a user key's dict, a credentials object
    else:
        raise Unmappable(f"token of type {type(token).__name__} has no obstore equivalent")
    if endpoint is not None:
        config["base_url"] = endpoint.rstrip("/")
        _allow_http(endpoint, client)
    hosts = _hosts(endpoint) if endpoint is not None and config.get("skip_signature") else None
    return StoreSpec(
        "gcs",
        bucket,
        prefix,
        config=config,
        client_options=client,
        origin_hosts=hosts,
        source=source,
    )


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
            raise Unmappable(
                "the URL carries credentials (user:password@) and client_kwargs gives auth too"
            )
        import base64

        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"
        url = urlunsplit(
            (
                parts.scheme,
                parts.netloc.rpartition("@")[2],
                parts.path,
                parts.query,
                parts.fragment,
            )
        )
    if auth is not None:
        encode = getattr(auth, "encode", None)
        if encode is None:
            raise Unmappable(
                f"client_kwargs auth of type {type(auth).__name__} has no obstore equivalent"
            )
        headers["Authorization"] = str(encode())
    if ck.pop("trust_env", False):
        raise Unmappable("client_kwargs trust_env has no obstore equivalent")
    if any(_env(n) for n in _PROXY_ENV):
        raise Unmappable(
            "a proxy in the environment (fsspec's aiohttp session ignores it, obstore would use it)"
        )
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
    return StoreSpec(
        "http", None, None, url=url.rstrip("/"), client_options=client, origin_hosts=_hosts(url)
    )


def _hosts(url: str) -> tuple[str, ...] | None:
    """The host of ``url`` as ``proxy_excludes`` names it (None: none to name)."""
    host = urlsplit(url if "://" in url else f"http://{url}").hostname
    return (host,) if host else None
