"""Errors mapped once: what a store's raw error means (:func:`classify`: retryable or not, and
why) and the asyncload error it becomes once retrying is over (:func:`translate`, with the URL,
byte range and attempts).

The raw errors come from every store: OSError and :mod:`asyncload.storage.base`'s, aiohttp,
botocore, gcsfs, the wire transport's; the tables below read their classes, error codes, HTTP statuses and
words. Only the error boundary (:mod:`asyncload.storage.retrying`) calls these.
"""

from __future__ import annotations

import asyncio
import errno
import re
from dataclasses import dataclass

from asyncload.common.errors import (
    AsyncLoadError,
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChunkTimeoutError,
    StorageReadError,
    docs_ref,
)
from asyncload.storage.base import (
    CompressedAnswerError,
    CrossOriginRedirectError,
    ListingTooLargeError,
    NotRegularFileError,
    ObjectChangedError,
    ProtocolMismatchError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
)

__all__ = [
    "HINTS",
    "UNREACHABLE",
    "UNREACHABLE_ATTEMPTS",
    "Failure",
    "brief",
    "classify",
    "translate",
    "unreachable",
]

_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
}
_SLOW_DOWN_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
}
#: Exceptions that mean "the body was cut short" (aiohttp, botocore, http.client).
_SHORT_BODY_ERRORS = {
    "ClientPayloadError",
    "ContentLengthError",
    "TransferEncodingError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "IncompleteRead",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED_CODES = {"AccessDenied", "Forbidden", "403"}
#: Error codes of credentials that are missing, wrong or expired: a retry sends the same ones.
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidToken",
    "InvalidClientTokenId",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "401",
}
#: Client-side exceptions (botocore, aiohttp) of missing or unusable credentials.
_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "UnauthorizedSSOTokenError",
    "TokenRetrievalError",
    "RefreshWithMFAUnsupportedError",
    "CredentialSourceError",  # asyncload.storage.credentials (a source that gave none)
}
#: Client-side exceptions of a configuration no retry can fix (region, endpoint, URL, parameters).
_CONFIG_ERRORS = {
    "NoRegionError",
    "ParamValidationError",
    "InvalidRegionError",
    "InvalidEndpointConfigurationError",
    "InvalidS3AddressingStyleError",
    "InvalidConfigError",
    "ProfileNotFound",
    "UnknownEndpointError",
    "EndpointResolutionError",
    "InvalidURL",
    "InvalidUrlClientError",
    "NonHttpUrlClientError",
    "InvalidSchema",
    "MissingSchema",
}
#: Client exceptions (any class in the MRO) that mean the connection failed or broke: retryable.
#: An allowlist: other exceptions of these libraries (credentials, configuration) fail at once.
_CONNECTION_ERRORS = {
    "ClientConnectionError",  # aiohttp: ServerDisconnected, ClientOSError, ClientConnectorError...
    "HTTPClientError",  # botocore: ConnectionClosedError, ReadTimeoutError...
    "ConnectionError",  # botocore's EndpointConnectionError, requests' ProxyError; the builtin
    "ProtocolError",  # urllib3
    "NewConnectionError",
    "ConnectTimeoutError",
}
#: Local paths a load cannot read, whatever it retries.
_LOCAL_ERRNOS = {
    errno.ENOTDIR: "not_a_directory",
    errno.ENAMETOOLONG: "name_too_long",
    errno.ELOOP: "symlink_loop",
}


@dataclass(frozen=True)
class Failure:
    retryable: bool
    cause: str
    status: int | None = None
    retry_after: float | None = None
    not_found: bool = False
    #: The file is damaged (a truncated object): a format error, not a storage one.
    format_error: bool = False
    #: The store asks to slow down (429, 503, SlowDown...): concurrency="auto" backs off.
    throttle: bool = False
    #: The most attempts this cause deserves, whatever ``LoadOptions.retries`` says
    #: (``None``: no cap).
    max_attempts: int | None = None


def _status_of(exc: BaseException) -> int | None:
    for attr in ("status", "code", "status_code"):
        v = getattr(exc, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        v = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


def _retry_after(exc: BaseException) -> float | None:
    headers = getattr(exc, "headers", None)
    if headers is None:
        resp = getattr(exc, "response", None)
        if isinstance(resp, dict):
            headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders")
    if not headers:
        return None
    try:
        value = headers.get("Retry-After") or headers.get("retry-after")
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _error_code(exc: BaseException) -> str | None:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = resp.get("Error", {}).get("Code")
        if code:
            return str(code)
    return None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from (``__cause__``, else ``__context__``), at
    most 8."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _mro_names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _is_certificate_error(exc: BaseException) -> bool:
    """A TLS certificate the client rejects (wrong CA bundle, self-signed, wrong host)."""
    if "SSLCertVerificationError" in _mro_names(
        exc
    ) or "ClientConnectorCertificateError" in _mro_names(exc):
        return True
    return "SSLError" in _mro_names(exc) and "certificate verify failed" in str(exc).lower()


#: Nothing answers at the endpoint (connection refused, host name not found): the address is
#: wrong or the server is down, which retrying with backoff does not fix. One retry, for a
#: server that restarts or a load balancer that swaps a backend at that moment; then the load
#: fails with "could not connect to <endpoint>" (docs/errors.md, StorageReadError).
UNREACHABLE_ATTEMPTS = 2
UNREACHABLE = Failure(True, "unreachable", max_attempts=UNREACHABLE_ATTEMPTS)
_URL_HOST = re.compile(r"\b(https?)://(?:[^@/\s\"]*@)?([^/\s\"?#,]+)")


def unreachable(exc: BaseException) -> tuple[str, str] | None:
    """``(endpoint, why)`` when ``exc`` (or an error it was raised from) says no connection
    could be made - refused, or the host name not found - before any answer: ``endpoint``
    is ``scheme://host:port`` (credentials left out) or ``host:port``; else ``None``."""
    outer = ""  # the endpoint an outer error named (botocore's EndpointConnectionError)
    for e in _causes(exc):
        names = _mro_names(e)
        text = str(e)
        why = ""
        if "EndpointConnectionError" in names:
            # botocore wraps every aiohttp connection error in it, a reset of a pooled
            # connection too: only the error it was raised from (further down the chain) says
            # whether the connection was refused or the host not found (its URL names the endpoint)
            m = _URL_HOST.search(text)
            outer = f"{m.group(1)}://{m.group(2)}" if m else outer
            continue
        elif "ClientConnectorError" in names and not names & {
            "ClientConnectorCertificateError",
            "ClientSSLError",
        }:
            os_error = getattr(e, "os_error", None)
            if isinstance(os_error, ConnectionRefusedError):
                why = "connection refused"
            elif type(os_error).__name__ == "gaierror":
                why = "host name not found"
            if why:
                host, port = getattr(e, "host", ""), getattr(e, "port", "")
                return outer or f"{host}:{port}", why
        elif isinstance(e, ConnectionRefusedError):
            why = "connection refused"
        elif type(e).__name__ == "gaierror":  # socket's (the wire transport's connect)
            why = "host name not found"
        if why:
            m = _URL_HOST.search(text)
            return (f"{m.group(1)}://{m.group(2)}" if m else outer or "the endpoint"), why
    return None


def brief(exc: BaseException) -> str:
    """``exc``'s message, stripped."""
    return str(exc).strip()


def classify(exc: BaseException) -> Failure:
    """Whether a failed read can succeed if tried again, and why it failed."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return Failure(True, "timeout")
    if isinstance(exc, ShortReadError):  # a local file's end is final: truncated, not flaky
        return Failure(not exc.local, "short_read", format_error=exc.local)
    chain = _causes(exc)  # s3fs and gcsfs wrap the HTTP error
    if unreachable(exc) is not None:
        return UNREACHABLE
    if any(type(e).__name__ in _SHORT_BODY_ERRORS for e in chain):
        # the connection ended before Content-Length bytes arrived: never data (aiohttp's
        # ContentLengthError carries a client-side "400", not the server's status)
        return Failure(True, "short_read")
    for e in chain:
        if isinstance(e, RangeIgnoredError):
            return Failure(False, "range_ignored", e.status)
        if isinstance(e, RangeMismatchError):
            return Failure(False, "range_mismatch", e.status)
        if isinstance(e, CrossOriginRedirectError):
            return Failure(False, "redirect_refused", e.status)
        if isinstance(e, ListingTooLargeError):
            return Failure(False, "listing_too_large", format_error=True)
        if isinstance(e, ObjectChangedError):
            return Failure(False, "object_changed", 412 if e.now is None else None)
        if isinstance(e, NotRegularFileError):
            return Failure(False, "not_a_regular_file")
        if isinstance(e, CompressedAnswerError):
            return Failure(False, "compressed")
        if isinstance(e, ProtocolMismatchError):
            return Failure(False, "protocol")
        if _mro_names(e) & _CREDENTIAL_ERRORS:
            return Failure(False, "credentials")
        if _mro_names(e) & _CONFIG_ERRORS:
            return Failure(False, "config")
        if _is_certificate_error(e):
            return Failure(False, "tls")
    for e in chain:
        code = _error_code(e)
        status = _status_of(e)
        if code in _NOT_FOUND_CODES or status == 404:
            return Failure(False, "not_found", 404, not_found=True)
        if code in _CREDENTIAL_CODES or status == 401:
            return Failure(False, "credentials", status or 403)
        if code in _DENIED_CODES or status == 403:
            return Failure(False, "denied", status or 403)
        if status == 416:
            return Failure(False, "range_not_satisfiable", 416, format_error=True)
        if code in _THROTTLE_CODES or status in (408, 429, 500, 502, 503, 504):
            throttle = status in (429, 503) or code in _SLOW_DOWN_CODES
            return Failure(
                True,
                f"status_{status}" if status else f"code_{code}",
                status,
                _retry_after(e),
                throttle=throttle,
            )
        if status is not None and 400 <= status < 500:
            return Failure(False, f"status_{status}", status)
        if status is not None and status >= 500:
            return Failure(True, f"status_{status}", status, _retry_after(e))
    if isinstance(exc, FileNotFoundError):
        return Failure(False, "not_found", 404, not_found=True)
    if isinstance(exc, PermissionError) or (
        type(exc) is OSError and str(exc).startswith("Forbidden:")
    ):
        return Failure(
            False, "denied", 403
        )  # gcsfs raises a bare OSError("Forbidden: ...") for 403
    if isinstance(exc, IsADirectoryError):
        return Failure(False, "is_a_directory")
    if isinstance(exc, NotADirectoryError):
        return Failure(False, "not_a_directory")
    if isinstance(exc, EOFError) or _mro_names(exc) & _CONNECTION_ERRORS:
        return Failure(True, "connection")
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOENT,):
            return Failure(False, "not_found", 404, not_found=True)
        if exc.errno in (errno.EACCES, errno.EPERM):
            return Failure(False, "denied", 403)
        if exc.errno in _LOCAL_ERRNOS:
            return Failure(False, _LOCAL_ERRNOS[exc.errno])
        return Failure(True, "io_error")
    return Failure(False, type(exc).__name__)


#: What to do about a failure no retry can fix, by cause.
HINTS = {
    "credentials": (
        " (the store rejected or did not get credentials: check the access key, secret, session "
        "token and its expiry, e.g. AWS_* variables, the profile, or storage_options "
        "key/secret/token)"
    ),
    "denied": (
        " (the credentials lack permission to read this object: check the bucket policy or IAM "
        "role)"
    ),
    "config": (
        " (the client configuration is wrong: check the endpoint URL and region, e.g. "
        "storage_options client_kwargs={'endpoint_url': ..., 'region_name': ...})"
    ),
    "tls": (  # translate() names the knobs of the URL's own scheme (_tls_hint)
        " (the server's TLS certificate was rejected: check the URL's host, and give the CA "
        "that signed it: storage_options ca_bundle='ca.pem')"
    ),
    "compressed": (
        " (the server compresses what it serves, e.g. nginx with gzip on: a byte range of a "
        "compressed body is not the file's bytes; serve checkpoint files uncompressed, e.g. "
        "leave their type out of gzip_types)"
    ),
    "protocol": (
        " (asyncload's clients speak HTTP/1.1, over TLS for https://: point the URL at the "
        "server's HTTP/1.1 port, not an HTTP/2-only (h2c) one)"
    ),
    "not_a_regular_file": (
        " (a checkpoint file must be a regular file, not a FIFO, socket or device)"
    ),
    "object_changed": (
        " (the object was replaced while this load read it: load again once the save has finished)"
    ),
    "not_supported": (
        " (the store does not support this request: try LoadOptions.transport='fsspec')"
    ),
    "range_mismatch": (
        " (the answer was not the byte range asked for, so none of its bytes were used: read the "
        "checkpoint from the store itself, not through a cache or proxy that keys ranges by URL or "
        "rewrites answers)"
    ),
    "redirect_refused": (
        " (asyncload follows redirects within the checkpoint's origin only: if you trust the other "
        "origin, load the checkpoint from the URL the redirect names)"
    ),
    "not_a_directory": (
        " (a path component is a file where a directory is expected: check the checkpoint path)"
    ),
    "name_too_long": " (the path is longer than the file system allows: check the checkpoint path)",
    "symlink_loop": " (the path has a symbolic link loop: check the checkpoint path)",
}


def _tls_hint(url: str) -> str:
    """What to change for a rejected certificate, in the knobs of ``url``'s own scheme."""
    scheme = url.split("://", 1)[0].lower()
    if scheme == "s3":
        knobs = (
            "storage_options ca_bundle='ca.pem' or client_kwargs={'verify': 'ca.pem'}, or "
            "AWS_CA_BUNDLE"
        )
    elif scheme in ("gs", "gcs"):
        knobs = "storage_options ca_bundle='ca.pem', or REQUESTS_CA_BUNDLE or SSL_CERT_FILE"
    else:
        knobs = (
            "storage_options ca_bundle='ca.pem' (or verify='ca.pem'), or REQUESTS_CA_BUNDLE, "
            "SSL_CERT_FILE or SSL_CERT_DIR"
        )
    return (
        f" (the server's TLS certificate was rejected: check the URL's host, and give the CA "
        f"that signed it: {knobs}; verify=False turns checking off)"
    )


def translate(
    exc: BaseException,
    *,
    url: str,
    byte_range: tuple[int, int] | None,
    attempts: int,
    failure: Failure | None = None,
    timeout: float | None = None,
) -> AsyncLoadError:
    """The asyncload error for a call about ``url`` that failed for good (``timeout``: the
    per-attempt limit that ran out, for the message)."""
    if isinstance(exc, AsyncLoadError):
        return exc
    too_large = next((e for e in _causes(exc) if isinstance(e, ListingTooLargeError)), None)
    if too_large is not None:
        return CheckpointFormatError(str(too_large))
    changed = next((e for e in _causes(exc) if isinstance(e, ObjectChangedError)), None)
    if changed is not None:
        return CheckpointChangedError(
            f"{changed} (a save or upload is replacing this checkpoint; nothing of two versions "
            "was mixed: "
            "load again once it has finished)",
            path=changed.url,
            byte_range=changed.byte_range,
            seen=changed.seen,
            now=changed.now,
        )
    f = failure or classify(exc)
    where = f"{url} bytes [{byte_range[0]}, {byte_range[1]})" if byte_range else url
    tries = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
    if f.cause == "timeout":
        limit = f"within {timeout} s " if timeout is not None else ""
        return ChunkTimeoutError(
            f"reading {where} made no progress {limit}on any of {attempts} "
            f"attempt{'s' if attempts != 1 else ''} "
            "(raise LoadOptions.timeout or LoadOptions.retries, or lower chunk_size)",
            path=url,
            byte_range=byte_range or (0, 0),
            attempts=attempts,
        )
    if f.not_found:
        what = (
            f"reading {where} failed: the object does not exist"
            if byte_range and byte_range[1]
            else f"{url} does not exist"
        )
        return CheckpointNotFoundError(
            f"{what} {tries} ({type(exc).__name__}: {brief(exc)})"[:800],
            path=url,
            byte_range=byte_range,
            attempts=attempts,
            status=404,
        )
    if f.cause == "unreachable":
        endpoint, why = unreachable(exc) or ("the endpoint", "no connection")
        fix = (
            "check the host and port in the URL"
            if url.startswith(("http://", "https://"))
            else "check storage_options endpoint_url (the CLI's -o endpoint_url=...)"
        )
        return StorageReadError(
            f"could not connect to {endpoint} ({why}) to read {where} {tries}: {fix}, and that the "
            "server "
            f"is running ({docs_ref('Errors', 'StorageReadError')})",
            path=url,
            byte_range=byte_range,
            attempts=attempts,
        )
    if f.format_error or (isinstance(exc, ShortReadError) and not f.retryable):
        return CheckpointFormatError(
            f"{where} lies past the end of the file: the file is truncated ({exc})"
        )
    if isinstance(exc, ShortReadError):
        return StorageReadError(
            f"reading {where} returned {exc.got} of {exc.end - exc.start} bytes {tries}: "
            "the body was cut short every time (raise LoadOptions.retries if the network is flaky; "
            "a file shorter than its metadata says is truncated)",
            path=url,
            byte_range=byte_range,
            attempts=attempts,
        )
    if f.cause == "range_ignored":
        return StorageReadError(
            f"reading {where} failed {tries}: the server ignores Range requests ({exc}); "
            "serve the checkpoint from a server that supports HTTP range requests",
            path=url,
            byte_range=byte_range,
            attempts=attempts,
            status=f.status,
        )
    hint = HINTS.get(f.cause, "")
    if f.cause == "tls":
        hint = _tls_hint(url)
    if f.retryable:
        hint = " (raise LoadOptions.retries or LoadOptions.timeout for a flaky store)"
    status = f" HTTP {f.status}" if f.status else ""
    # a client library may wrap asyncload's own refusal (botocore: HTTPClientError): show the
    # refusal
    exc = next(
        (e for e in _causes(exc) if isinstance(e, (CrossOriginRedirectError, RangeMismatchError))),
        exc,
    )
    return StorageReadError(
        f"reading {where} failed{status} {tries}: {type(exc).__name__}: {brief(exc)}"[:800] + hint,
        path=url,
        byte_range=byte_range,
        attempts=attempts,
        status=f.status,
    )
