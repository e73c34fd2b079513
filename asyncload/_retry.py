"""One chunk read: per-attempt timeout, retries with backoff and jitter, hedging of
stragglers, and the one place where storage errors become asyncload errors."""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from ._errors import (
    AsyncLoadError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChunkTimeoutError,
    StorageReadError,
)
from ._options import LoadOptions
from ._stats import StatsRecorder
from ._storage import ShortReadError

__all__ = ["Failure", "classify", "fetch_with_retry", "translate"]

log = logging.getLogger("asyncload.retry")
T = TypeVar("T")

_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeTooSkewed"}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED_CODES = {"AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401"}


@dataclass(frozen=True)
class Failure:
    retryable: bool
    cause: str
    status: int | None = None
    retry_after: float | None = None
    not_found: bool = False
    #: The file is damaged (a truncated object): a format error, not a storage one.
    format_error: bool = False


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


def classify(exc: BaseException) -> Failure:
    """Whether a failed read can succeed if tried again, and why it failed."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return Failure(True, "timeout")
    if isinstance(exc, ShortReadError):
        return Failure(True, "short_read")
    # walk the cause chain: s3fs and gcsfs wrap the HTTP error
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        code = _error_code(e)
        status = _status_of(e)
        if code in _NOT_FOUND_CODES or status == 404:
            return Failure(False, "not_found", 404, not_found=True)
        if code in _DENIED_CODES or status in (401, 403):
            return Failure(False, "denied", status or 403)
        if status == 416:
            return Failure(False, "range_not_satisfiable", 416, format_error=True)
        if code in _THROTTLE_CODES or status in (408, 429, 500, 502, 503, 504):
            return Failure(True, f"status_{status}" if status else f"code_{code}", status, _retry_after(e))
        if status is not None and 400 <= status < 500:
            return Failure(False, f"status_{status}", status)
        if status is not None and status >= 500:
            return Failure(True, f"status_{status}", status, _retry_after(e))
    if isinstance(exc, FileNotFoundError):
        return Failure(False, "not_found", 404, not_found=True)
    if isinstance(exc, PermissionError):
        return Failure(False, "denied", 403)
    if isinstance(exc, IsADirectoryError):
        return Failure(False, "is_a_directory")
    mod = type(exc).__module__
    if mod.startswith(("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "gcsfs", "google")):
        return Failure(True, "connection")
    if isinstance(exc, (ConnectionError, EOFError)):
        return Failure(True, "connection")
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOENT,):
            return Failure(False, "not_found", 404, not_found=True)
        if exc.errno in (errno.EACCES, errno.EPERM):
            return Failure(False, "denied", 403)
        return Failure(True, "io_error")
    return Failure(False, type(exc).__name__)


def translate(exc: BaseException, *, url: str, byte_range: tuple[int, int] | None, attempts: int,
              failure: Failure | None = None) -> AsyncLoadError:
    """The asyncload error for a read of ``url`` that failed for good."""
    if isinstance(exc, AsyncLoadError):
        return exc
    f = failure or classify(exc)
    where = f"{url} bytes [{byte_range[0]}, {byte_range[1]})" if byte_range else url
    tries = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
    if f.not_found:
        return CheckpointNotFoundError(f"{url} does not exist ({type(exc).__name__}: {exc})",
                                       path=url, byte_range=byte_range, attempts=attempts, status=404)
    if f.format_error or (isinstance(exc, ShortReadError) and not f.retryable):
        return CheckpointFormatError(f"{where} lies past the end of the file: the file is truncated ({exc})")
    if isinstance(exc, ShortReadError):
        return StorageReadError(f"reading {where} returned {exc.got} of {exc.end - exc.start} bytes {tries}: "
                                "the body was cut short every time (raise LoadOptions.retries if the network is flaky; "
                                "a file shorter than its metadata says is truncated)",
                                path=url, byte_range=byte_range, attempts=attempts)
    hint = "" if not f.retryable else " (raise LoadOptions.retries or LoadOptions.timeout for a flaky store)"
    status = f" HTTP {f.status}" if f.status else ""
    return StorageReadError(f"reading {where} failed{status} {tries}: {type(exc).__name__}: {exc}"[:800] + hint,
                            path=url, byte_range=byte_range, attempts=attempts, status=f.status)


class HedgePolicy:
    """When a chunk counts as a straggler: ``max(floor, factor x p90 of recent latencies)``."""

    def __init__(self, options: LoadOptions, stats: StatsRecorder) -> None:
        self.enabled = options.hedge
        self.factor = options.hedge_factor
        self.floor = options.hedge_min_delay
        self.stats = stats

    def delay(self) -> float | None:
        if not self.enabled:
            return None
        p90 = self.stats.recent_latency_quantile(0.9)
        return self.floor if p90 is None else max(self.floor, self.factor * p90)


async def _cancel_and_wait(tasks: set[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except BaseException:  # noqa: BLE001 - losers' outcomes are discarded on purpose
            pass


async def _attempt(op: Callable[[], Awaitable[T]], timeout: float | None, hedge: HedgePolicy | None,
                   stats: StatsRecorder) -> T:
    """One attempt, with at most one hedged duplicate; the first success wins."""
    deadline = None if timeout is None else time.monotonic() + timeout
    first = asyncio.ensure_future(op())
    pending: set[asyncio.Task[Any]] = {first}
    try:
        hedge_after = hedge.delay() if hedge is not None else None
        if hedge_after is not None and (timeout is None or hedge_after < timeout):
            done, _ = await asyncio.wait(pending, timeout=hedge_after)
            if not done:
                stats.add(hedges=1)
                log.debug("hedging a read still running after %.3f s", hedge_after)
                pending.add(asyncio.ensure_future(op()))
        last_exc: BaseException | None = None
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise asyncio.TimeoutError()
            for t in done:
                if t.exception() is None:
                    return t.result()
                last_exc = t.exception()
        assert last_exc is not None
        raise last_exc
    finally:
        if pending:
            await _cancel_and_wait(pending)


async def fetch_with_retry(op: Callable[[], Awaitable[T]], *, options: LoadOptions, stats: StatsRecorder,
                           url: str, byte_range: tuple[int, int], hedge: HedgePolicy | None = None,
                           on_throttle: Callable[[], None] | None = None) -> T:
    """Run ``op`` with the load's timeout, retry and hedge policy; translate the final error."""
    attempts = options.retries + 1
    for attempt in range(1, attempts + 1):
        t0 = time.monotonic()
        try:
            result = await _attempt(op, options.timeout, hedge, stats)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            failure = classify(exc)
            if failure.status in (429, 503) and on_throttle is not None:
                on_throttle()
            if not failure.retryable or attempt == attempts:
                if failure.cause == "timeout":
                    stats.add(timeouts=1)
                    raise ChunkTimeoutError(
                        f"reading {url} bytes [{byte_range[0]}, {byte_range[1]}) did not finish within "
                        f"{options.timeout} s on any of {attempt} attempt{'s' if attempt != 1 else ''} "
                        "(raise LoadOptions.timeout or LoadOptions.retries, or lower chunk_size)",
                        path=url, byte_range=byte_range, attempts=attempt) from exc
                raise translate(exc, url=url, byte_range=byte_range, attempts=attempt, failure=failure) from exc
            stats.retry(failure.cause)
            delay = min(options.max_backoff, options.backoff * (2 ** (attempt - 1)))
            delay = random.uniform(0, delay)  # full jitter
            if failure.retry_after is not None:
                delay = max(delay, min(failure.retry_after, options.max_backoff))
            log.debug("retrying %s [%d, %d) after %s (attempt %d of %d) in %.3f s",
                      url, byte_range[0], byte_range[1], failure.cause, attempt, attempts, delay)
            await asyncio.sleep(delay)
        else:
            stats.latency(time.monotonic() - t0)
            return result
    raise AssertionError("unreachable")  # pragma: no cover
