"""The ``storage_options`` users already write for s3fs, gcsfs and fsspec's HTTP filesystem,
mapped onto one remote store for the wire transport (:mod:`asyncload.storage.wire`):
:func:`plan_store` gives a :class:`StoreSpec` for ``s3://``, ``gs://`` / ``gcs://`` and
``http(s)://``.

It maps what it can map faithfully and raises :class:`Unmappable` (naming the option) for
anything else, so that :func:`asyncload.storage.factory.open_storage` reads through fsspec
(``transport="auto"``, which says so) or refuses (``transport="wire"``) instead of dropping an
option. Clients' own retries and timeouts are not mapped: asyncload's policy in
:mod:`asyncload.storage.retrying` is the only one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from asyncload.common.errors import redact_url

__all__ = [
    "ACCEPTED_KEYS",
    "REMOTE_PROTOCOLS",
    "StoreSpec",
    "Unmappable",
    "plan_store",
    "unknown_key",
]

#: URL schemes the wire transport serves (every other one is fsspec's).
REMOTE_PROTOCOLS = frozenset({"s3", "gs", "gcs", "http", "https"})

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


#: Every ``storage_options`` key a remote store takes, by scheme: what the wire transport maps
#: and what the fsspec filesystem of that scheme (s3fs, gcsfs, fsspec's HTTP filesystem with
#: aiohttp's request arguments) accepts. A key outside these is a typo that the fsspec
#: filesystems would silently ignore (``endpoint`` for ``endpoint_url``: a load from AWS).
_FSSPEC_COMMON = frozenset(
    {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
     "asynchronous", "loop"}
)  # fmt: skip
ACCEPTED_KEYS: dict[str, frozenset[str]] = {
    "s3": _FSSPEC_COMMON
    | {"anon", "endpoint_url", "key", "secret", "token", "use_ssl", "client_kwargs",
       "requester_pays", "default_block_size", "default_fill_cache", "default_cache_type",
       "version_aware", "config_kwargs", "s3_additional_kwargs", "session", "username",
       "password", "cache_regions", "max_concurrency", "fixed_upload_size",
       "local_expiry_check", "profile", "ca_bundle", "verify"},
    "gcs": _FSSPEC_COMMON
    | {"project", "access", "token", "block_size", "consistency", "cache_timeout",
       "secure_serialize", "check_connection", "requests_timeout", "requester_pays",
       "session_kwargs", "timeout", "endpoint_url", "default_location", "version_aware",
       "finalize_on_close", "mrd_pool_cache_size", "max_mrd_pool_cache_queue_size",
       "ca_bundle", "verify"},
    "http": _FSSPEC_COMMON
    | {"simple_links", "block_size", "same_scheme", "size_policy", "cache_type",
       "cache_options", "client_kwargs", "get_client", "encoded", "params", "cookies",
       "headers", "skip_auto_headers", "auth", "allow_redirects", "max_redirects", "compress",
       "chunked", "expect100", "raise_for_status", "read_until_eof", "proxy", "proxy_auth",
       "timeout", "verify_ssl", "fingerprint", "ssl_context", "ssl", "server_hostname",
       "proxy_headers", "trace_request_ctx", "read_bufsize", "auto_decompress",
       "max_line_size", "max_field_size", "max_headers", "middlewares", "ca_bundle", "verify"},
}  # fmt: skip
_KINDS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


def unknown_key(protocol: str, storage_options: Mapping[str, Any]) -> str | None:
    """Why ``storage_options`` cannot be right for a ``protocol://`` checkpoint: a key that
    neither the wire transport nor the fsspec filesystem of that scheme takes, with the
    closest one that is taken (``None``: every key is known, or the scheme is not one of
    :data:`REMOTE_PROTOCOLS`)."""
    kind = _KINDS.get(protocol.lower())
    if kind is None:
        return None
    accepted = ACCEPTED_KEYS[kind]
    unknown = [k for k in storage_options if k not in accepted]
    if not unknown:
        return None
    import difflib

    parts = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), sorted(accepted), n=1, cutoff=0.6)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"storage_options {', '.join(parts)} {'is' if len(parts) == 1 else 'are'} not "
        f"taken for {protocol}:// (by the wire transport or the fsspec filesystem); the keys "
        f"taken are {', '.join(sorted(accepted))}"
    )


class Unmappable(Exception):
    """Raised by :func:`plan_store` when ``storage_options`` (or the environment) ask for
    something the wire transport cannot do the way the fsspec filesystem would; the message
    says what."""


@dataclass(frozen=True)
class StoreSpec:
    """One remote store for a checkpoint root: ``kind`` (``"s3"``, ``"gcs"``, ``"http"``),
    the bucket and prefix (or the base URL), the store's configuration (``region``,
    ``endpoint``, ``virtual_hosted_style_request``, keys, ``skip_signature``, ``base_url``,
    ``request_payer``) and HTTP client options (``default_headers``, ``root_certificate``,
    ``allow_invalid_certificates``)."""

    kind: str
    bucket: str | None
    prefix: str | None
    url: str | None = None
    #: (never in ``repr``: keys, secrets and headers)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    client_options: dict[str, Any] = field(default_factory=dict, repr=False)
    #: where credentials that no key names come from (never in ``repr``): ``{"profile":
    #: name}`` for S3 (botocore's chain), ``{"token": token}`` for GCS (google-auth)
    source: dict[str, Any] = field(default_factory=dict, repr=False)


def plan_store(url: str, storage_options: Mapping[str, Any], **_: Any) -> StoreSpec:
    """The remote store for checkpoint ``url`` with fsspec-style ``storage_options`` (a
    ``for_obstore`` keyword of earlier releases is accepted and ignored).

    Raised: :class:`Unmappable` naming the option (or environment variable) that the wire
    transport cannot honour as the fsspec filesystem would."""
    parts = urlsplit(url)
    protocol = parts.scheme.lower()
    if protocol not in REMOTE_PROTOCOLS:
        raise Unmappable(f"the wire transport is not used for {protocol}:// URLs")
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
        return _s3_spec(bucket, prefix, opts)
    return _gcs_spec(bucket, prefix, opts)


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


def _leftover(where: str, left: Mapping[str, Any]) -> None:
    if left:
        raise Unmappable(
            f"{where} {sorted(left)} {'is' if len(left) == 1 else 'are'} not honoured by the wire "
            "transport"
        )


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise Unmappable(f"{name}={value!r} is not a positive number of seconds")
    return float(value)


def _proxy_for(url: str, given: Any = None) -> tuple[str, str] | None:
    """``(where it was set, proxy URL)`` for a request to ``url``, as botocore, requests and
    curl choose it: ``given`` (s3fs' ``config_kwargs={"proxies": {"https": ...}}`` form, keyed
    by scheme or ``scheme://host``, or one URL: aiohttp's ``proxy=``), else ``https_proxy`` /
    ``HTTPS_PROXY`` for an https URL, ``http_proxy`` / ``HTTP_PROXY`` for an http one, then
    ``all_proxy`` / ``ALL_PROXY`` (lower case first); ``None`` where none applies or
    ``NO_PROXY`` names the host. Raised: :class:`Unmappable` for a proxy the wire transport
    cannot use (one reached over TLS, SOCKS), named without its ``user:pass@``."""
    parts = urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    found: tuple[str, str] | None = None
    if isinstance(given, Mapping):
        for k in (f"{scheme}://{host}", scheme, "all"):
            if given.get(k):
                found = (f"proxies[{k!r}]", str(given[k]))
                break
    elif given:
        found = ("proxy", str(given))
    if found is None:
        if host and _no_proxy(host):
            return None
        for name in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
            if os.environ.get(name):
                found = (name, os.environ[name])
                break
    if found is None:
        return None
    source, proxy = found
    if "://" not in proxy:
        proxy = f"http://{proxy}"
    if urlsplit(proxy).scheme.lower() != "http" or not urlsplit(proxy).hostname:
        raise Unmappable(
            f"the proxy {redact_url(proxy)} ({source}) is not an http:// proxy, the only kind "
            "the wire transport goes through"
        )
    return source, proxy


def _no_proxy(host: str) -> bool:
    """Whether ``NO_PROXY`` / ``no_proxy`` names ``host`` as curl and requests read it: ``*``,
    the host itself, or a domain it is under (``example.com`` and ``.example.com`` both
    cover ``a.example.com``); a port in an entry is ignored."""
    value = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    host = host.lower().strip("[]")
    for entry in value.split(","):
        entry = entry.strip().lower()
        if entry.startswith("[") and "]" in entry:
            entry = entry[1 : entry.index("]")]
        elif entry.count(":") == 1:
            entry = entry.split(":", 1)[0]
        entry = entry.lstrip(".")
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return True
    return False


def _s3_spec(bucket: str, prefix: str | None, opts: dict[str, Any]) -> StoreSpec:
    """s3fs's options: ``endpoint_url``, ``key``, ``secret``, ``token``, ``anon``,
    ``requester_pays``, ``profile``, ``client_kwargs`` (``endpoint_url``, ``region_name``,
    ``aws_access_key_id``...), ``config_kwargs`` (pool size, retries, timeouts, addressing
    style, unsigned); the ``AWS_*`` environment as botocore reads it. Credentials that no key
    names (a profile, ``AWS_PROFILE``, ``~/.aws``, an instance role...) are botocore's chain
    (``source["profile"]``, resolved by :mod:`asyncload.storage.credentials`)."""
    ck = dict(opts.pop("client_kwargs", None) or {})
    cfg = dict(opts.pop("config_kwargs", None) or {})
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    source: dict[str, Any] = {}
    if opts.get("profile") is not None:
        source["profile"] = str(opts.pop("profile"))
    opts.pop("profile", None)
    if opts.get("session") is not None:
        raise Unmappable(
            "storage_options 'session' (a botocore or aiobotocore session object) is not "
            "honoured by the wire transport (pass profile=, or key/secret)"
        )
    opts.pop("session", None)
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
    _tls(client, opts, ck.pop("verify", None), "AWS_CA_BUNDLE")
    # botocore's config: a pool size, retries and timeouts are asyncload's own options
    # (LoadOptions.concurrency, retries, timeout) and change nothing read
    cfg.pop("max_pool_connections", None)
    retries = cfg.pop("retries", None)
    if retries is not None and (
        not isinstance(retries, Mapping)
        or set(retries) - {"total_max_attempts", "max_attempts", "mode"}
    ):
        raise Unmappable(f"config_kwargs retries={retries!r} is not botocore's retries form")
    for name in ("connect_timeout", "read_timeout"):
        if name in cfg:
            _seconds(f"config_kwargs {name}", cfg.pop(name))
    if "signature_version" in cfg:
        sig = cfg.pop("signature_version")
        if str(sig) != "UNSIGNED" and sig not in ("s3v4", "v4"):
            raise Unmappable(
                f"config_kwargs signature_version={sig!r} is not honoured by the wire transport "
                "(it signs with SigV4, or not at all: UNSIGNED)"
            )
        anon = anon or str(sig) == "UNSIGNED"
    proxies = cfg.pop("proxies", None)
    if proxies is not None and not isinstance(proxies, Mapping):
        raise Unmappable("config_kwargs proxies is not a mapping of scheme to proxy URL")
    s3cfg = dict(cfg.pop("s3", None) or {})
    style = s3cfg.pop("addressing_style", None)
    if style not in (None, "auto", "path", "virtual"):
        raise Unmappable(
            f"config_kwargs s3 addressing_style={style!r} is not 'auto', 'path' or 'virtual'"
        )
    if style is not None:
        config["addressing_style"] = style
    if style == "virtual":
        config["virtual_hosted_style_request"] = True
    _leftover("config_kwargs s3", s3cfg)
    _leftover("config_kwargs", cfg)
    _leftover("client_kwargs", ck)
    _leftover("storage_options", opts)
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
    proxy = _proxy_for(endpoint or "https://s3.amazonaws.com", proxies)
    if proxy is not None:
        client["proxy_source"], client["proxy"] = proxy
    if endpoint is not None:
        config["endpoint"] = endpoint
    if region is None:
        if endpoint is None:
            raise Unmappable(
                "no region given (s3fs finds the bucket's region itself; set AWS_DEFAULT_REGION "
                "or client_kwargs region_name for the wire transport)"
            )
        region = "us-east-1"  # what botocore signs with for a custom endpoint without a region
    config["region"] = region
    return StoreSpec(
        "s3",
        bucket,
        prefix,
        config=config,
        client_options=client,
        source=source,
    )


def _tls(client: dict[str, Any], opts: dict[str, Any], given: Any, *env_names: str) -> None:
    """The TLS knobs of one store into ``client``: ``verify`` (``client_kwargs`` for S3, as
    botocore takes it, or a plain ``verify``: a CA bundle's path, ``True`` or ``False``), a
    plain ``ca_bundle`` path, else the first of ``env_names`` that is set (``AWS_CA_BUNDLE``
    for S3, ``REQUESTS_CA_BUNDLE`` for HTTP(S) and GCS; ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``
    are the default context's own). The bundle's certificates are added to the system roots;
    ``verify=False`` turns verification off (the store warns once)."""
    plain = opts.pop("verify", None)
    bundle = opts.pop("ca_bundle", None)
    verify = given if given is not None else plain
    if verify is False:
        client["allow_invalid_certificates"] = True
        return
    if isinstance(verify, str):
        bundle = bundle or verify
    elif verify not in (None, True):
        raise Unmappable(f"verify={verify!r} is not a CA bundle's path, True or False")
    if bundle is not None and not isinstance(bundle, (str, os.PathLike)):
        raise Unmappable(f"ca_bundle={bundle!r} is not a path")
    path = os.fspath(bundle) if bundle is not None else _env(*env_names)
    if path:
        client["root_certificate"] = _read_pem(str(path))


def _read_pem(path: str) -> str:
    """A CA bundle's certificates (added to the system's roots)."""
    try:
        with open(os.path.expanduser(path), encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError) as exc:
        raise Unmappable(f"the CA bundle {path!r} cannot be read: {exc}") from None


def _gcs_spec(bucket: str, prefix: str | None, opts: dict[str, Any]) -> StoreSpec:
    """gcsfs's options: ``endpoint_url`` (or ``STORAGE_EMULATOR_HOST``), ``token``
    (``"anon"``, ``None``/``"google_default"``/``"cloud"``, a key file's path, a service
    account or user key's dict, a google-auth credentials object), ``project`` and ``access``
    (not used by object reads). The token is kept in ``source`` as given (google-auth makes
    the OAuth tokens, :mod:`asyncload.storage.credentials`)."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    _tls(client, opts, None, "REQUESTS_CA_BUNDLE")
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
        raise Unmappable(
            "storage_options requester_pays is not honoured by the wire transport for GCS"
        )
    if opts.pop("version_aware", False):
        raise Unmappable("storage_options version_aware is not honoured by the wire transport")
    _leftover("storage_options", opts)
    source: dict[str, Any] = {"token": token}
    if token == "anon" or (
        token is None and endpoint is not None and endpoint == _norm_host(emulator)
    ):
        config["skip_signature"] = True
    elif token in (None, "google_default", "cloud"):
        pass  # application default credentials, through google-auth
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
    elif (isinstance(token, Mapping) and token.get("type") == "authorized_user") or (
        not isinstance(token, (str, Mapping)) and hasattr(token, "refresh")
    ):
        pass  # google-auth makes its tokens: a user key's dict, a credentials object
    else:
        raise Unmappable(
            f"token of type {type(token).__name__} is not honoured by the wire transport"
        )
    proxy = _proxy_for(endpoint or "https://storage.googleapis.com")
    if proxy is not None:
        client["proxy_source"], client["proxy"] = proxy
    if endpoint is not None:
        config["base_url"] = endpoint.rstrip("/")
    return StoreSpec("gcs", bucket, prefix, config=config, client_options=client, source=source)


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
    client: dict[str, Any] = {}
    _tls(client, opts, None, "REQUESTS_CA_BUNDLE")
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
                f"client_kwargs auth of type {type(auth).__name__} is not honoured by the wire "
                "transport (aiohttp.BasicAuth is)"
            )
        headers["Authorization"] = str(encode())
    if ck.pop("trust_env", False):
        raise Unmappable("client_kwargs trust_env is not honoured by the wire transport")
    proxy = _proxy_for(url, opts.pop("proxy", None))
    if proxy is not None:
        client["proxy_source"], client["proxy"] = proxy
    if opts.pop("encoded", False):
        raise Unmappable("storage_options encoded=True is not honoured by the wire transport")
    for name in ("simple_links", "same_scheme", "size_policy"):
        opts.pop(name, None)
    _leftover("client_kwargs", ck)
    _leftover("storage_options", opts)
    if headers:
        client["default_headers"] = headers
    return StoreSpec("http", None, None, url=url.rstrip("/"), client_options=client)
