"""The one storage error boundary (:class:`RetryingStorage`): timeout, retries with backoff
and jitter, hedging of stragglers, and the one place where storage errors become asyncload
errors.

The policy (the same for every store: the fsspec filesystems' own retry loops are
turned off in :mod:`asyncload.storage.base`):

* **Timeout with a shared, progress-extended deadline.** An attempt fails with a
  timeout once ``LoadOptions.timeout`` seconds have passed both since it started and
  since *any* read of the same load last finished. A dead store (nothing finishes)
  fails an attempt after exactly ``timeout`` seconds; a slow store that keeps
  delivering (a bandwidth-capped link with many reads queued behind each other) does
  not fail however long one chunk takes. One slow request among fast ones is the
  hedging's job, not the timeout's.
* **Retries**: ``LoadOptions.retries`` more attempts per chunk for retryable failures
  (timeouts, 5xx, 429/SlowDown, connection resets, bodies cut short), after a full-jitter
  exponential backoff (``backoff`` doubling up to ``max_backoff``), at least the
  server's ``Retry-After``. Counted in ``LoadStats.retries`` and ``retries_by_cause``.
  403/404/missing objects and other 4xx fail at once; nothing answering at the endpoint
  (refused, host not found) gets :data:`UNREACHABLE_ATTEMPTS` attempts at most.
* **Hedging**: an attempt still running after its hedge delay gets one duplicate request;
  the first to succeed wins, the other is cancelled (its connection closed). Counted in
  ``LoadStats.hedges``; at most ``HedgePolicy.max_in_flight`` duplicates at once. Two
  rules, the earlier wins (:func:`hedge_delay`):

  - *body*: ``max(floor, hedge_factor x p90)`` of recent comparable reads (same size or
    larger, scaled to this chunk's size), the cold delay before 4 of them have finished;
  - *first byte* (stores that tell when an answer begins: obstore): a request whose
    answer has not begun after ``max(floor, hedge_factor x p90)`` of recent first-byte
    latencies, while requests asked for after it have had theirs (a stalled GET is
    caught after a few round trips, not after the whole chunk's time).

  The floor is ``hedge_min_delay`` (cold: ``4 x`` it) or, with ``hedge_min_delay=None``
  (the default), derived from this load: ``hedge_factor x`` the expected time of the
  chunk at the measured first-byte latency and per-stream rate, at least 0.05 s; derived,
  the body rule waits for 4 comparable reads to finish (no cold delay). Each rule
  compares a read with its peers on the same link now, so a uniformly slow or congested
  link hedges nothing. The delay is re-evaluated while the attempt waits, so reads that
  started before any history existed are hedged as soon as their peers show they are
  stragglers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from asyncload._errors import (
    AsyncLoadError,
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChunkTimeoutError,
    StorageReadError,
    docs_ref,
    redact_text,
)
from asyncload._latency import HEDGE_POLL, LoadClock, hedge_delay
from asyncload._options import HedgePolicy, LoadOptions, RetryPolicy
from asyncload._stats import StatsRecorder
from asyncload.storage.base import (
    REQUEST,
    CrossOriginRedirectError,
    ListingTooLargeError,
    NotRegularFileError,
    ObjectChangedError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
    Storage,
)

__all__ = [
    "Failure",
    "RetryingStorage",
    "call_with_retry",
    "classify",
    "translate",
]

log = logging.getLogger("asyncload.retry")
T = TypeVar("T")

#: Bytes of a :meth:`RetryingStorage.read_batch` read on the loop thread where the store
#: can without waiting (a local file's cached pages: ``Storage.readinto_cached``).
BATCH_INLINE = 1 << 20

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
_SLOW_DOWN_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
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
#: obstore (Rust ``object_store``) raises typed classes for some failures and a
#: ``GenericError`` with the HTTP status, the S3 error code or the OS error in its message
#: for the others; these read them from the message.
_OBSTORE_STATUS = re.compile(r"status code: (\d{3})\b")
_OBSTORE_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
#: object_store's words for a 206 whose ``Content-Range`` is not the range asked for.
_OBSTORE_RANGE_MISMATCH = re.compile(
    r"Requested \d+\.\.\d+, got \d+\.\.\d+|Content-Range header not present|value for CONTENT_RANGE header"
)
_OBSTORE_RETRY_AFTER = re.compile(r"retry-after\W{0,3}(\d+(?:\.\d+)?)", re.IGNORECASE)
_OBSTORE_FINAL = {
    "PreconditionError": ("object_changed", 412),
    "NotFoundError": ("not_found", 404),
    "PermissionDeniedError": ("denied", 403),
    "UnauthenticatedError": ("credentials", 401),
    "UnknownConfigurationKeyError": ("config", None),
    "InvalidPathError": ("config", None),
    "NotModifiedError": ("status_304", 304),
}
#: Words of an obstore message without a status: a body cut short (reqwest's body errors:
#: the answer had begun), credentials it could not get or decode, a rejected certificate,
#: a timeout, a failed or broken connection.
_OBSTORE_SHORT_BODY = ("IncompleteBody", "UnexpectedEof", "request or response body error")
_OBSTORE_CREDENTIALS = ("credential error", "Credential {", "Unable to decode service account")
_OBSTORE_TLS = ("InvalidCertificate", "UnknownIssuer", "certificate verify failed", "CertificateExpired")
_OBSTORE_TIMEOUT = ("TimedOut", "operation timed out", "deadline has elapsed")
_OBSTORE_CONNECTION = (
    "ConnectionReset",
    "ConnectionRefused",
    "ConnectionAborted",
    "BrokenPipe",
    "NotConnected",
    "error sending request",
    "request or response body error",
    "connection closed",
    "dns error",
)
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
    #: The most attempts this cause deserves, whatever ``LoadOptions.retries`` says (``None``: no cap).
    max_attempts: int | None = None


def _is_obstore(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("obstore")


def _status_of(exc: BaseException) -> int | None:
    if _is_obstore(exc):
        m = _OBSTORE_STATUS.search(str(exc))
        return int(m.group(1)) if m else None
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
    if _is_obstore(exc):  # obstore keeps no headers; a message may quote the value
        m = _OBSTORE_RETRY_AFTER.search(str(exc))
        return float(m.group(1)) if m else None
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
    if _is_obstore(exc):  # the S3 error document is quoted in the message
        m = _OBSTORE_CODE.search(str(exc))
        return m.group(1) if m else None
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = resp.get("Error", {}).get("Code")
        if code:
            return str(code)
    return None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from (``__cause__``, else ``__context__``), at most 8."""
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
    if "SSLCertVerificationError" in _mro_names(exc) or "ClientConnectorCertificateError" in _mro_names(exc):
        return True
    return "SSLError" in _mro_names(exc) and "certificate verify failed" in str(exc).lower()


def _classify_obstore(exc: BaseException) -> Failure | None:
    """What an obstore exception means, where its class or words say it (``None``: an
    HTTP status in the message, classified like any other client's, or nothing known)."""
    name = type(exc).__name__
    if name in _OBSTORE_FINAL:
        cause, status = _OBSTORE_FINAL[name]
        return Failure(False, cause, status, not_found=cause == "not_found")
    text = str(exc)
    if name == "NotSupportedError":
        if "Range request not supported" in text:  # a 200 answer to a ranged GET
            return Failure(False, "range_ignored", 200)
        return Failure(False, "not_supported")
    if _OBSTORE_RANGE_MISMATCH.search(text):  # object_store checked the answer's Content-Range
        return Failure(False, "range_mismatch", 206)
    if _OBSTORE_STATUS.search(text):
        return None
    for words, failure in (
        (_OBSTORE_SHORT_BODY, Failure(True, "short_read")),
        (_OBSTORE_CREDENTIALS, Failure(False, "credentials")),
        (_OBSTORE_TLS, Failure(False, "tls")),
        (_OBSTORE_TIMEOUT, Failure(True, "timeout")),
        (_OBSTORE_CONNECTION, Failure(True, "connection")),
    ):
        if any(w in text for w in words):
            return failure
    return None


#: Nothing answers at the endpoint (connection refused, host name not found): the address is
#: wrong or the server is down, which retrying with backoff does not fix. One retry, for a
#: server that restarts or a load balancer that swaps a backend at that moment; then the load
#: fails with "could not connect to <endpoint>" (docs/errors.md, StorageReadError).
UNREACHABLE_ATTEMPTS = 2
UNREACHABLE = Failure(True, "unreachable", max_attempts=UNREACHABLE_ATTEMPTS)
_OBSTORE_CONNECT = re.compile(r"kind: Connect\b")
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
        if _is_obstore(e):
            if _OBSTORE_CONNECT.search(text) and "ConnectionRefused" in text:
                why = "connection refused"
            elif _OBSTORE_CONNECT.search(text) and "dns error" in text:
                why = "host name not found"
        elif "EndpointConnectionError" in names:
            # botocore wraps every aiohttp connection error in it, a reset of a pooled
            # connection too: only the error it was raised from (further down the chain) says
            # whether the connection was refused or the host not found (its URL names the endpoint)
            m = _URL_HOST.search(text)
            outer = f"{m.group(1)}://{m.group(2)}" if m else outer
            continue
        elif "ClientConnectorError" in names and not names & {"ClientConnectorCertificateError", "ClientSSLError"}:
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
        if why:
            m = _URL_HOST.search(text)
            return (f"{m.group(1)}://{m.group(2)}" if m else outer or "the endpoint"), why
    return None


def brief(exc: BaseException) -> str:
    """``exc``'s message without the Rust client's ``Debug source:`` dump that obstore appends
    (the first line says what failed; the dump repeats it as nested structs)."""
    return str(exc).split("\n\nDebug source:", 1)[0].strip()


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
        if _mro_names(e) & _CREDENTIAL_ERRORS:
            return Failure(False, "credentials")
        if _mro_names(e) & _CONFIG_ERRORS:
            return Failure(False, "config")
        if _is_certificate_error(e):
            return Failure(False, "tls")
        if _is_obstore(e):
            known = _classify_obstore(e)
            if known is not None:
                return known
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
                True, f"status_{status}" if status else f"code_{code}", status, _retry_after(e), throttle=throttle
            )
        if status is not None and 400 <= status < 500:
            return Failure(False, f"status_{status}", status)
        if status is not None and status >= 500:
            return Failure(True, f"status_{status}", status, _retry_after(e))
    if isinstance(exc, FileNotFoundError):
        return Failure(False, "not_found", 404, not_found=True)
    if isinstance(exc, PermissionError) or (type(exc) is OSError and str(exc).startswith("Forbidden:")):
        return Failure(False, "denied", 403)  # gcsfs raises a bare OSError("Forbidden: ...") for 403
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
_HINTS = {
    "credentials": (
        " (the store rejected or did not get credentials: check the access key, secret, session token"
        " and its expiry, e.g. AWS_* variables, the profile, or storage_options key/secret/token)"
    ),
    "denied": " (the credentials lack permission to read this object: check the bucket policy or IAM role)",
    "config": (
        " (the client configuration is wrong: check the endpoint URL and region,"
        " e.g. storage_options client_kwargs={'endpoint_url': ..., 'region_name': ...})"
    ),
    "tls": (
        " (the server's TLS certificate was rejected: check the endpoint URL and the CA bundle,"
        " e.g. AWS_CA_BUNDLE or SSL_CERT_FILE)"
    ),
    "not_a_regular_file": " (a checkpoint file must be a regular file, not a FIFO, socket or device)",
    "object_changed": " (the object was replaced while this load read it: load again once the save has finished)",
    "not_supported": " (the store does not support this request: try LoadOptions.transport='fsspec')",
    "range_mismatch": (
        " (the answer was not the byte range asked for, so none of its bytes were used: read the checkpoint "
        "from the store itself, not through a cache or proxy that keys ranges by URL or rewrites answers)"
    ),
    "redirect_refused": (
        " (asyncload follows redirects within the checkpoint's origin only: if you trust the other origin, "
        "load the checkpoint from the URL the redirect names)"
    ),
    "not_a_directory": " (a path component is a file where a directory is expected: check the checkpoint path)",
    "name_too_long": " (the path is longer than the file system allows: check the checkpoint path)",
    "symlink_loop": " (the path has a symbolic link loop: check the checkpoint path)",
}


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
            f"{changed} (a save or upload is replacing this checkpoint; nothing of two versions was mixed: "
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
            f"reading {where} made no progress {limit}on any of {attempts} attempt{'s' if attempts != 1 else ''} "
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
            f"could not connect to {endpoint} ({why}) to read {where} {tries}: {fix}, and that the server "
            f"is running ({docs_ref('Errors', 'StorageReadError')})",
            path=url,
            byte_range=byte_range,
            attempts=attempts,
        )
    if f.format_error or (isinstance(exc, ShortReadError) and not f.retryable):
        return CheckpointFormatError(f"{where} lies past the end of the file: the file is truncated ({exc})")
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
    hint = _HINTS.get(f.cause, "")
    if f.retryable:
        hint = " (raise LoadOptions.retries or LoadOptions.timeout for a flaky store)"
    status = f" HTTP {f.status}" if f.status else ""
    # a client library may wrap asyncload's own refusal (botocore: HTTPClientError): show the refusal
    exc = next((e for e in _causes(exc) if isinstance(e, (CrossOriginRedirectError, RangeMismatchError))), exc)
    return StorageReadError(
        f"reading {where} failed{status} {tries}: {type(exc).__name__}: {brief(exc)}"[:800] + hint,
        path=url,
        byte_range=byte_range,
        attempts=attempts,
        status=f.status,
    )


class _Request:
    """One request to the store (an attempt's original or its hedged duplicate): when it
    started and when its answer began. Stores tell through :func:`asyncload.storage.base.first_byte`."""

    __slots__ = ("clock", "first_byte", "started")

    def __init__(self, clock: LoadClock) -> None:
        self.clock = clock
        self.started = clock.now()
        self.first_byte: float | None = None

    def answered(self) -> None:
        if self.first_byte is None:
            self.first_byte = self.clock.now()
            self.clock.answered(self.first_byte - self.started, self.started)


async def _cancel_and_wait(tasks: set[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except BaseException:
            pass


async def _attempt(
    op: Callable[[], Awaitable[T]],
    limit: float | None,
    hedge: HedgePolicy | None,
    stats: StatsRecorder,
    clock: LoadClock,
    nbytes: int,
) -> tuple[T, _Request]:
    """One attempt, with at most one hedged duplicate; the first success wins (returned
    with its request: when it started, when its answer began).

    Raises ``asyncio.TimeoutError`` when ``limit`` seconds pass without progress (see the
    module docstring), or the error of the last request to fail."""
    started = clock.now()
    first = _Request(clock)
    requests: dict[asyncio.Future[Any], _Request] = {}

    def start(req: _Request) -> asyncio.Future[Any]:
        token = REQUEST.set(req)  # the request's task copies it: the store's first_byte() reaches req
        try:
            fut = asyncio.ensure_future(op())
        finally:
            REQUEST.reset(token)
        requests[fut] = req
        return fut

    pending: set[asyncio.Future[Any]] = {start(first)}
    hedged = False
    last_exc: BaseException | None = None
    try:
        while pending:
            now = clock.now()
            wait: float | None = None
            if limit is not None:
                deadline = clock.deadline(started, limit)
                if now >= deadline:
                    raise TimeoutError()
                wait = deadline - now
            if hedge is not None and not hedged:
                waiting = first.started if first.first_byte is None and clock.first_bytes else None
                after = hedge_delay(hedge, clock, nbytes, waiting_since=waiting)
                if after is None:  # no yardstick yet: look again as peers answer and finish
                    step = HEDGE_POLL if waiting is not None else HEDGE_POLL * 4
                    wait = step if wait is None else min(wait, step)
                else:
                    if now - started >= after and clock.hedges_in_flight < hedge.max_in_flight:
                        hedged = True
                        stats.add(hedges=1)
                        clock.hedges_in_flight += 1
                        log.debug(
                            "hedging a read of %d bytes still running after %.3f s (delay %.3f s, %s)",
                            nbytes,
                            now - started,
                            after,
                            "no answer yet" if first.first_byte is None else "answer begun",
                        )
                        dup = start(_Request(clock))
                        dup.add_done_callback(lambda _f: _hedge_done(clock))
                        pending.add(dup)
                        continue
                    # re-check soon: the delay shrinks as peers finish and build history
                    step = max(HEDGE_POLL, after - (now - started)) if now - started < after else HEDGE_POLL
                    step = min(step, HEDGE_POLL * 4)
                    wait = step if wait is None else min(wait, step)
            done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is None:
                    return t.result(), requests[t]
                last_exc = t.exception()
        assert last_exc is not None
        raise last_exc
    finally:
        if pending:
            await _cancel_and_wait(pending)  # type: ignore[arg-type]


def _hedge_done(clock: LoadClock) -> None:
    clock.hedges_in_flight -= 1


async def call_with_retry(
    op: Callable[[], Awaitable[T]],
    *,
    retry: RetryPolicy,
    stats: StatsRecorder,
    clock: LoadClock,
    url: str,
    byte_range: tuple[int, int] | None,
    hedge: HedgePolicy | None = None,
    on_throttle: Callable[[], None] | None = None,
    timed: bool = True,
    culprit: Callable[[], tuple[str, tuple[int, int]] | None] | None = None,
) -> T:
    """Run ``op`` (one storage call about ``byte_range`` of ``url``; ``None``: the whole
    file) with the load's timeout, retry and hedge policy (module docstring), measured on
    the load's ``clock``; translate the final error. Only :class:`RetryingStorage` calls it.

    Raised: :class:`ChunkTimeoutError` when every attempt timed out (it names the URL,
    byte range and attempts), :class:`CheckpointNotFoundError` / :class:`StorageReadError`
    / :class:`CheckpointFormatError` for other failures, at once when retrying cannot help.
    A call of many reads: ``timed=False``, ``op`` records their latencies itself (the call
    only counts as progress); ``culprit()``, the URL and byte range its error names instead
    of ``url`` and ``byte_range`` (the read that failed, or those in flight when the attempt
    timed out).
    """
    attempts = retry.attempts
    nbytes = max(0, byte_range[1] - byte_range[0]) if byte_range else 0
    for attempt in range(1, attempts + 1):
        t0 = time.monotonic()
        try:
            result, request = await _attempt(op, retry.timeout, hedge, stats, clock, nbytes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = classify(exc)
            if failure.throttle and on_throttle is not None:
                on_throttle()
            if not failure.retryable or attempt >= min(attempts, failure.max_attempts or attempts):
                if failure.cause == "timeout":
                    stats.add(timeouts=1)
                where = culprit() if culprit is not None else None
                url, byte_range = where if where is not None else (url, byte_range)
                raise translate(
                    exc, url=url, byte_range=byte_range, attempts=attempt, failure=failure, timeout=retry.timeout
                ) from exc
            stats.retry(failure.cause)
            delay = min(retry.max_backoff, retry.backoff * (2 ** (attempt - 1)))
            delay = random.uniform(0, delay)  # full jitter
            if failure.retry_after is not None:
                delay = max(delay, min(failure.retry_after, retry.max_backoff))
            log.debug(
                "retrying %s %s after %s (attempt %d of %d) in %.3f s",
                url,
                byte_range,
                failure.cause,
                attempt,
                attempts,
                delay,
            )
            await asyncio.sleep(delay)
        else:
            now = time.monotonic()
            elapsed = now - t0
            if byte_range is not None and timed:
                stats.latency(elapsed)
                body = None if request.first_byte is None else now - request.first_byte
                clock.finished(elapsed, nbytes, body)
            else:
                clock.last_progress = time.monotonic()
            return result
    raise AssertionError("unreachable")  # pragma: no cover


def _group_span(ranges: Sequence[tuple[str, int, int]]) -> tuple[int, int]:
    """The byte range that a group of reads (``(name, start, end)`` each, read in one thread
    hop) names in its errors: all of them when they are of one file, else the first."""
    name, start, end = ranges[0]
    if all(r[0] == name for r in ranges):
        return min(r[1] for r in ranges), max(r[2] for r in ranges)
    return start, end


class RetryingStorage:
    """The one storage error boundary: every call a load makes to its storage (sizes,
    listings, fingerprints, metadata, probes, data, batched local reads) goes through
    here, and only here are timeout, retry, hedge, classification and translation
    applied. Above it, code sees asyncload errors only; below it, raw ones.

    Reads (:meth:`read`, :meth:`readinto`, :meth:`read_batch`) count ``LoadStats.bytes_read``
    (all but the ``.metadata`` read); hedging applies to remote stores only.

    The policy is fixed when the boundary is made: a load that changes its policy (a
    planner's knobs under a plain ``dcp.load``) makes a new boundary around the same store;
    nothing changes this one's. Every call measures on the load's ``clock``.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        retry: RetryPolicy,
        hedge: HedgePolicy,
        stats: StatsRecorder,
        executor: concurrent.futures.Executor,
        clock: LoadClock | None = None,
        on_throttle: Callable[[], None] | None = None,
    ) -> None:
        self.raw = storage
        self.retry = retry
        self._hedge_policy = hedge
        self.hedge = hedge if storage.hedgeable and hedge.enabled else None
        self.stats = stats
        self.executor = executor
        #: The load's clock: the timeout's progress, latencies that drive hedging.
        self.clock = clock if clock is not None else LoadClock()
        #: Called when the store asks to slow down (``concurrency="auto"`` backs off).
        self.on_throttle = on_throttle

    @classmethod
    def for_options(
        cls,
        storage: Storage,
        options: LoadOptions,
        stats: StatsRecorder,
        executor: concurrent.futures.Executor,
        clock: LoadClock | None = None,
    ) -> RetryingStorage:
        """A boundary with ``options``' retry and hedge policies (a fresh clock unless given)."""
        return cls(
            storage,
            retry=options.retry_policy,
            hedge=options.hedge_policy,
            stats=stats,
            executor=executor,
            clock=clock,
        )

    def with_throttle(self, on_throttle: Callable[[], None]) -> RetryingStorage:
        """The same store, policy, statistics and clock, telling ``on_throttle`` when the
        store asks to slow down (each pipeline its own)."""
        return RetryingStorage(
            self.raw,
            retry=self.retry,
            hedge=self._hedge_policy,
            stats=self.stats,
            executor=self.executor,
            clock=self.clock,
            on_throttle=on_throttle,
        )

    @property
    def root(self) -> str:
        return self.raw.root

    @property
    def supports_readinto(self) -> bool:
        return self.raw.supports_readinto

    @property
    def hedgeable(self) -> bool:
        return self.raw.hedgeable

    def url(self, name: str) -> str:
        return self.raw.url(name)

    async def _call(
        self,
        op: Callable[[], Awaitable[T]],
        name: str,
        byte_range: tuple[int, int] | None,
        *,
        hedge: bool = False,
        timed: bool = True,
        culprit: Callable[[], tuple[str, tuple[int, int]] | None] | None = None,
    ) -> T:
        return await call_with_retry(
            op,
            retry=self.retry,
            stats=self.stats,
            clock=self.clock,
            url=self.raw.url(name),
            byte_range=byte_range,
            hedge=self.hedge if hedge else None,
            on_throttle=self.on_throttle,
            timed=timed,
            culprit=culprit,
        )

    async def read(self, name: str, start: int, end: int, *, hedge: bool = True, counted: bool = True) -> memoryview:
        """Exactly bytes ``[start, end)`` of file ``name`` (``counted``: in ``bytes_read``,
        which leaves out the checkpoint's ``.metadata``)."""
        if end <= start:
            return memoryview(b"")
        raw = self.raw
        data = await self._call(lambda: raw.read(name, start, end), name, (start, end), hedge=hedge)
        if counted:
            self.stats.add(bytes_read=end - start)
        return memoryview(data).cast("B") if not isinstance(data, memoryview) else data

    @property
    def supports_read_object(self) -> bool:
        return self.raw.supports_read_object

    async def read_object(self, name: str, max_size: int) -> tuple[memoryview | None, int]:
        """The whole of file ``name`` and its size in one request (``supports_read_object``;
        not counted in ``bytes_read``: the checkpoint's ``.metadata``). ``(None, size)`` when
        it is larger than ``max_size``."""
        raw = self.raw
        return await self._call(lambda: raw.read_object(name, max_size), name, None, hedge=True)

    async def read_prefix(self, name: str, n: int) -> tuple[memoryview, int]:
        """The first ``n`` bytes of file ``name`` (all of it when shorter) and its size: one
        request where the store can (obstore), a size and a read otherwise. Counted in
        ``bytes_read``."""
        raw = self.raw
        data, size = await self._call(lambda: raw.read_prefix(name, n), name, (0, n), hedge=True)
        self.stats.add(bytes_read=len(data))
        return data, int(size)

    async def readinto(
        self, name: str, start: int, buffers: Sequence[memoryview], *, then: Callable[[], None] | None = None
    ) -> None:
        """Fill ``buffers`` with the bytes from ``start`` on. A store that reads into caller
        memory does it on an I/O thread and runs ``then`` (a checksum) in the same hop."""
        raw = self.raw
        n = sum(len(b) for b in buffers)
        if raw.supports_readinto:
            loop = asyncio.get_running_loop()

            def job() -> None:
                raw.readinto_sync(name, start, buffers)
                if then is not None:
                    then()

            await self._call(lambda: loop.run_in_executor(self.executor, job), name, (start, start + n))
        else:
            await self._call(lambda: raw.readinto(name, start, buffers), name, (start, start + n), hedge=True)
            if then is not None:
                then()
        self.stats.add(bytes_read=n)

    async def read_batch(self, reads: Sequence[tuple[str, int, int, Callable[[memoryview], None]]]) -> None:
        """Several tiny reads of a store that reads into caller memory, without a thread hop
        as far as the store can read them on the loop (``Storage.readinto_cached``: a local
        file's cached pages, at most :data:`BATCH_INLINE` bytes), the rest in one hop to an
        I/O thread; each ``(name, start, end, deliver)`` hands its bytes to ``deliver`` on the
        thread that read them, in order. A failure retries the whole batch (its deliveries
        are idempotent copies)."""
        raw = self.raw
        loop = asyncio.get_running_loop()

        def job(todo: Sequence[tuple[str, int, int, Callable[[memoryview], None]]]) -> None:
            for name, start, end, deliver in todo:
                buf = bytearray(end - start)
                raw.readinto_sync(name, start, [memoryview(buf)])
                deliver(memoryview(buf))

        async def attempt() -> None:
            # what the page cache holds is read here, on the loop, without a thread hop (at
            # most BATCH_INLINE bytes); the rest from the first read that is not, on an I/O thread
            i, left = 0, BATCH_INLINE
            while i < len(reads) and reads[i][2] - reads[i][1] <= left:
                name, start, end, deliver = reads[i]
                buf = bytearray(end - start)
                if not raw.readinto_cached(name, start, [memoryview(buf)]):
                    break
                deliver(memoryview(buf))
                left -= end - start
                i += 1
            if i < len(reads):
                await loop.run_in_executor(self.executor, job, reads[i:])

        span = _group_span([(name, start, end) for name, start, end, _ in reads])
        await self._call(attempt, reads[0][0], span)
        self.stats.add(bytes_read=sum(r[2] - r[1] for r in reads))

    async def readinto_shared(
        self,
        reads: Sequence[tuple[str, int, Sequence[memoryview]]],
        *,
        jobs: int,
        landed: Callable[[int, float], None] | None = None,
    ) -> None:
        """Reads straight into caller memory (a store that reads into it), each ``(name,
        start, buffers)``, by ``jobs`` I/O threads that pull them from one queue: one thread
        hop per thread, not per read. ``landed(i, seconds)`` runs on the I/O thread once read
        ``i`` has landed: once per read, whatever the attempts; an error it raises ends the
        reads and is raised as it is. Each landing is progress for the timeout. A failed read
        stops the other threads after their current read; the next attempt reads what has not
        landed (refilling a buffer is idempotent). The error names the file and byte range of
        the read that failed (a timeout: of the reads in flight)."""
        if not reads:
            return
        raw = self.raw
        loop = asyncio.get_running_loop()
        clock = self.clock
        todo: deque[int] = deque(range(len(reads)))
        sizes = [sum(len(b) for b in buffers) for _, _, buffers in reads]
        lock = threading.Lock()
        times: list[tuple[float, int]] = []
        refused: list[BaseException] = []  # what ``landed`` raised
        culprit: list[tuple[str, tuple[int, int]] | None] = [None]  # what the last failed attempt's error is about
        readinto, monotonic = raw.readinto_sync, time.monotonic
        ends = [(name, start, start + n) for (name, start, _), n in zip(reads, sizes)]

        def about(ids: list[int]) -> tuple[str, tuple[int, int]] | None:
            """The file of the first of ``ids`` and the span of those of that file."""
            if not ids:
                return None
            name = reads[ids[0]][0]
            return raw.url(name), _group_span([ends[i] for i in ids if ends[i][0] == name])

        async def attempt() -> None:
            stop = False
            taken: set[int] = set()  # popped by this attempt's threads, not landed yet
            failed: list[int] = []  # the read whose error ended this attempt

            def job() -> None:
                while True:
                    with lock:
                        if stop or refused or not todo:
                            return
                        i = todo.popleft()
                        taken.add(i)
                    name, start, buffers = reads[i]
                    t0 = monotonic()
                    try:
                        readinto(name, start, buffers)
                    except BaseException:
                        with lock:
                            failed.append(i)
                        raise
                    seconds = monotonic() - t0
                    with lock:
                        if stop:  # the attempt has ended: the read went back to the queue
                            return
                        taken.discard(i)
                        times.append((seconds, sizes[i]))
                    clock.last_progress = clock.now()
                    if landed is not None:
                        try:
                            landed(i, seconds)
                        except BaseException as exc:
                            with lock:
                                refused.append(exc)
                            return

            futures = [loop.run_in_executor(self.executor, job) for _ in range(min(jobs, len(todo)))]
            try:
                await asyncio.gather(*futures)
            except BaseException:
                with lock:  # the read that failed; else (a timeout) those still in flight
                    culprit[0] = about(failed[:1] or sorted(taken))
                raise
            finally:
                with lock:
                    stop = True
                    todo.extendleft(sorted(taken, reverse=True))
                    taken.clear()

        await self._call(attempt, reads[0][0], _group_span(ends), timed=False, culprit=lambda: culprit[0])
        if refused:
            raise refused[0]
        for seconds, nbytes in times:
            self.stats.latency(seconds)
            clock.finished(seconds, nbytes)
        self.stats.add(bytes_read=sum(sizes))

    async def _stat(self, op: Callable[[], Awaitable[T]], name: str) -> T:
        """``size`` or ``fingerprint``: of a store whose calls finish inline (a local file's
        ``stat``), once as it is (a tenth of the retrying call's cost); after an error, and
        for every other store, through :meth:`_call`."""
        if self.raw.calls_inline:
            try:
                value = await op()
            except Exception:
                pass  # again below, with retries and translation
            else:
                self.clock.last_progress = time.monotonic()
                return value
        return await self._call(op, name, None)

    async def size(self, name: str) -> int:
        raw = self.raw
        return int(await self._stat(lambda: raw.size(name), name))

    def prefetch_sizes(self) -> None:
        """Let the store start listing the checkpoint's files now, where it can (a hint:
        :meth:`sizes` uses the listing if it is back in time, nothing waits for it)."""
        prefetch = getattr(self.raw, "prefetch_sizes", None)
        if prefetch is not None:
            prefetch()

    async def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """Sizes of several files in one listing where the store can (an optimisation: the
        names it could not list are left out, ask :meth:`size` for those)."""
        try:
            return await asyncio.wait_for(self.raw.sizes(names), self.retry.timeout)
        except Exception as exc:
            log.debug(
                "listing %s failed (%s); asking for each file's size instead",
                self.raw.url(""),
                redact_text(f"{type(exc).__name__}: {exc}"),
            )
            return {}

    async def fingerprint(self, name: str) -> object | None:
        raw = self.raw
        return await self._stat(lambda: raw.fingerprint(name), name)

    async def listdir(self) -> list[str]:
        """Names of the plain files directly under the root (``[]`` when it cannot be listed)."""
        raw = self.raw
        try:
            return await self._call(raw.listdir, "", None)
        except CheckpointFormatError:  # a listing larger than max_metadata_size: say so
            raise
        except AsyncLoadError as exc:  # a listing is a last resort: say why, find nothing
            log.debug("listing %s failed: %r", raw.url(""), exc)
            return []

    async def aclose(self) -> None:
        await self.raw.aclose()
