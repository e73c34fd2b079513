"""What the fault proxy does to a request: the actions (:func:`delay`, :func:`status`,
:func:`reset`, :func:`truncate`, :func:`stall`, :func:`trickle`, :func:`shift_range`,
:func:`overlong`, :func:`trailing`), the rules that choose requests for them (:class:`Rule`), the log of
what was done (:class:`LogEntry`), and the error answers of :func:`status` as S3, GCS or a
plain server would write them.
"""

from __future__ import annotations

import http
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from xml.sax.saxutils import escape as xml_escape

from asyncload.testing._http import Flavor, _build_response, _Request


# ---------------------------------------------------------------------------
# actions
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """Base class of the things a rule does to a request."""

    def describe(self) -> str:
        """Short text used in :class:`LogEntry`.action, e.g. ``status(503)``."""
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Delay(Action):
    """Wait ``seconds`` (on top of ``latency``), then forward normally."""

    seconds: float

    def describe(self) -> str:
        return f"delay({self.seconds:g})"


@dataclass(frozen=True)
class Status(Action):
    """Answer ``code`` without forwarding.

    ``body`` None picks a document the client classifies by the proxy's
    flavor: S3 ``<Error><Code>...`` XML (``error_code`` or a default per
    status: 403 AccessDenied, 404 NoSuchKey, 429/503 SlowDown, 500
    InternalError...), GCS JSON ``{"error": {...}}``, or plain text.
    ``retry_after`` (seconds, or an HTTP date string) adds ``Retry-After``.
    """

    code: int
    retry_after: float | str | None = None
    body: bytes | str | None = None
    error_code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return f"status({self.code})"


@dataclass(frozen=True)
class Reset(Action):
    """Abort the client connection with a TCP RST (SO_LINGER 0).

    ``after_bytes`` None: before forwarding (the upstream never sees the
    request). Otherwise forward, send the headers and ``after_bytes`` body
    bytes, then reset.
    """

    after_bytes: int | None = None

    def describe(self) -> str:
        return "reset" if self.after_bytes is None else f"reset(after_bytes={self.after_bytes})"


@dataclass(frozen=True)
class Truncate(Action):
    """Forward, send the headers (length unchanged) and ``nbytes`` of body, then close (FIN).

    Bytes count what is on the wire after the headers (chunk framing included
    for a chunked response).
    """

    nbytes: int

    def describe(self) -> str:
        return f"truncate({self.nbytes})"


@dataclass(frozen=True)
class Stall(Action):
    """Hang: send nothing for ``seconds`` (None: until the client leaves or the proxy stops), then
    close.

    ``after_bytes`` None: hang before forwarding (no headers). Otherwise
    forward, send the headers and ``after_bytes`` body bytes, then hang.
    """

    seconds: float | None = None
    after_bytes: int | None = None

    def describe(self) -> str:
        extra = "" if self.after_bytes is None else f", after_bytes={self.after_bytes}"
        return f"stall({'None' if self.seconds is None else format(self.seconds, 'g')}{extra})"


@dataclass(frozen=True)
class Trickle(Action):
    """Forward, pacing the response body at ``bytes_per_second``."""

    bytes_per_second: float

    def describe(self) -> str:
        return f"trickle({self.bytes_per_second:g})"


@dataclass(frozen=True)
class ShiftRange(Action):
    """Forward with the request's ``Range: bytes=a-b`` moved to ``a+offset-b+offset``."""

    offset: int

    def describe(self) -> str:
        return f"shift_range({self.offset})"


@dataclass(frozen=True)
class Overlong(Action):
    """Forward, then send ``extra`` filler bytes after the body, its ``Content-Length`` raised
    by as many (``Content-Range`` unchanged). :attr:`FaultProxy.extra_bytes_sent` counts what
    the client took of them."""

    extra: int

    def describe(self) -> str:
        return f"overlong({self.extra})"


@dataclass(frozen=True)
class Trailing(Action):
    """Forward, then, ``after`` seconds later, send ``extra`` bytes in a write of their own on
    the kept-alive connection: bytes that answer nothing the client asked (a late duplicate
    answer, a body after a HEAD, 204 or 304). :attr:`FaultProxy.trailing_sent` counts the
    writes done."""

    extra: bytes
    after: float = 0.05

    def describe(self) -> str:
        return f"trailing({len(self.extra)})"


def trailing(extra: bytes, after: float = 0.05) -> Trailing:
    """Action: forward, then send ``extra`` (bytes nothing asked for) ``after`` seconds later,
    in a packet of its own."""
    if not extra:
        raise ValueError("extra must not be empty")
    return Trailing(bytes(extra), float(after))


def shift_range(offset: int) -> ShiftRange:
    """Action: forward with the ``Range`` header moved by ``offset`` bytes (another range is
    answered)."""
    return ShiftRange(int(offset))


def overlong(extra: int) -> Overlong:
    """Action: forward, then send ``extra`` bytes more than the body (``Content-Length`` raised to
    match)."""
    if extra <= 0:
        raise ValueError("extra must be > 0")
    return Overlong(int(extra))


def delay(seconds: float) -> Delay:
    """Action: add ``seconds`` of latency before forwarding this request."""
    if seconds < 0:
        raise ValueError("delay must be >= 0")
    return Delay(float(seconds))


def status(
    code: int,
    retry_after: float | str | None = None,
    body: bytes | str | None = None,
    *,
    error_code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Status:
    """Action: answer ``code`` (e.g. 500, 503, 429, 403, 404) without forwarding."""
    if not 200 <= code <= 599:
        raise ValueError(f"status code {code} out of range 200..599")
    return Status(code, retry_after, body, error_code, tuple((headers or {}).items()))


def reset(after_bytes: int | None = None) -> Reset:
    """Action: abort the connection with an RST (before forwarding, or after ``after_bytes`` of
    body)."""
    if after_bytes is not None and after_bytes < 0:
        raise ValueError("after_bytes must be >= 0")
    return Reset(after_bytes)


def truncate(nbytes: int) -> Truncate:
    """Action: forward but cut the response body after ``nbytes`` and close."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    return Truncate(nbytes)


def stall(seconds: float | None = None, *, after_bytes: int | None = None) -> Stall:
    """Action: send nothing for ``seconds`` (None: until the proxy stops), then close."""
    if seconds is not None and seconds < 0:
        raise ValueError("stall seconds must be >= 0")
    if after_bytes is not None and after_bytes < 0:
        raise ValueError("after_bytes must be >= 0")
    return Stall(seconds, after_bytes)


def trickle(bytes_per_second: float) -> Trickle:
    """Action: forward with the response body slowed to ``bytes_per_second``."""
    if bytes_per_second <= 0:
        raise ValueError("bytes_per_second must be > 0")
    return Trickle(float(bytes_per_second))


# S3 sub-resources whose GET is not an object read.
_S3_SUBRESOURCES = frozenset(
    {
        "accelerate", "acl", "analytics", "attributes", "cors", "delete", "encryption", "intelligent-tiering",
        "inventory", "legal-hold", "lifecycle", "list-type", "location", "logging", "metrics", "notification",
        "object-lock", "ownershipControls", "policy", "policyStatus", "publicAccessBlock", "replication",
        "requestPayment", "restore", "retention", "select", "tagging", "torrent", "uploadId", "uploads",
        "versioning", "versions", "website",
    }
)  # fmt: skip


def _is_data_request(req: _Request, flavor: Flavor) -> bool:
    """Whether ``req`` reads object bytes (what a checkpoint loader's chunk reads are)."""
    if req.method != "GET":
        return False
    if flavor == "http":
        return True
    if flavor == "gcs":  # JSON API media GETs, or XML API GETs /bucket/object (obstore's)
        xml = bool(req.path.lstrip("/").partition("/")[2]) and not req.path.startswith(
            ("/storage/", "/upload/", "/download/", "/batch/", "/_internal/")
        )
        return "alt=media" in req.query or req.path.startswith("/download/") or xml
    bucket, _, key = req.path.lstrip("/").partition("/")
    if not bucket or not key:
        return False
    params = {k for k, _ in urllib.parse.parse_qsl(req.query, keep_blank_values=True)}
    return not (params & _S3_SUBRESOURCES)


@dataclass(eq=False)
class Rule:
    """A matcher plus an action; returned by :meth:`FaultProxy.add_rule`.

    Matcher (all given conditions must hold): ``method`` (one or several,
    case-insensitive); ``path`` (a substring of the request target - path and
    query, as sent or percent-decoded - or a compiled regex searched in it);
    ``range_only`` (the request has a ``Range`` header); ``data_only`` (an
    object-data GET for the proxy's flavor: S3 ``GET /bucket/key`` without a
    sub-resource query, GCS ``alt=media``, any HTTP GET).

    Firing: the first ``skip`` matching requests pass; then it fires on the
    next ``times`` matches (None: every one), each with ``probability``
    (None: always) drawn from the proxy's seeded RNG.

    Counters (read them from any thread): ``matched`` requests that matched,
    ``fired`` requests the action was applied to.
    """

    action: Action
    method: frozenset[str] | None = None
    path: str | re.Pattern[str] | None = None
    range_only: bool = False
    data_only: bool = False
    times: int | None = 1
    probability: float | None = None
    skip: int = 0
    matched: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def matches(self, req: _Request, flavor: Flavor) -> bool:
        """Whether the matcher (not the firing schedule) accepts ``req``."""
        if self.method is not None and req.method.upper() not in self.method:
            return False
        if self.path is not None:
            decoded = urllib.parse.unquote(req.target)
            if isinstance(self.path, re.Pattern):
                if not (self.path.search(req.target) or self.path.search(decoded)):
                    return False
            elif self.path not in req.target and self.path not in decoded:
                return False
        if self.range_only and req.header("range") is None:
            return False
        return not self.data_only or _is_data_request(req, flavor)

    @property
    def exhausted(self) -> bool:
        """True once the rule has fired ``times`` times."""
        return self.times is not None and self.fired >= self.times

    def __repr__(self) -> str:
        return (
            f"<Rule {self.action.describe()} method={sorted(self.method) if self.method else None} "
            f"path={self.path!r} range_only={self.range_only} data_only={self.data_only} "
            f"times={self.times} probability={self.probability} skip={self.skip} "
            f"matched={self.matched} fired={self.fired}>"
        )


@dataclass(frozen=True)
class LogEntry:
    """One request seen by the proxy: what it was and what was done to it.

    ``action`` is ``"forward"`` or the rule's ``Action.describe()``, e.g.
    ``"status(503)"``; ``rule`` is the :class:`Rule` that fired, or None.
    """

    method: str
    path: str
    query: str
    range: str | None
    action: str
    rule: Rule | None = field(default=None, compare=False)


_S3_CODES = {
    400: "InvalidRequest",
    401: "AccessDenied",
    403: "AccessDenied",
    404: "NoSuchKey",
    405: "MethodNotAllowed",
    409: "OperationAborted",
    412: "PreconditionFailed",
    416: "InvalidRange",
    429: "SlowDown",
    500: "InternalError",
    501: "NotImplemented",
    503: "SlowDown",
}


_GCS_REASONS = {
    400: "invalid",
    401: "required",
    403: "forbidden",
    404: "notFound",
    412: "conditionNotMet",
    416: "requestedRangeNotSatisfiable",
    429: "rateLimitExceeded",
    500: "backendError",
    503: "backendError",
}


def _error_response(req: _Request, action: Status, flavor: Flavor, request_no: int) -> bytes:
    """The answer of a :func:`status` action, as the ``flavor`` of server would write it."""
    code = action.code
    try:
        phrase = http.HTTPStatus(code).phrase
    except ValueError:
        phrase = "Error"
    headers: list[tuple[str, str]] = []
    if action.body is not None:
        body = action.body.encode() if isinstance(action.body, str) else action.body
        ctype = "application/xml" if body.lstrip().startswith(b"<") else "text/plain"
    elif flavor == "s3":
        s3_code = action.error_code or _S3_CODES.get(
            code, "InternalError" if code >= 500 else "InvalidRequest"
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{xml_escape(s3_code)}</Code><Message>{xml_escape(phrase)} (fault "
            f"proxy)</Message>"
            f"<Resource>{xml_escape(req.path)}</Resource><RequestId>faultproxy{request_no}</RequestId>"
            "</Error>"
        ).encode()
        ctype = "application/xml"
        headers.append(("x-amz-request-id", f"faultproxy{request_no}"))
    elif flavor == "gcs":
        reason = action.error_code or _GCS_REASONS.get(
            code, "backendError" if code >= 500 else "invalid"
        )
        message = f"{phrase} (fault proxy)"
        doc = {
            "error": {
                "code": code,
                "message": message,
                "errors": [{"domain": "global", "reason": reason, "message": message}],
            }
        }
        body = json.dumps(doc).encode()
        ctype = "application/json; charset=UTF-8"
    else:
        body = f"{code} {phrase} (fault proxy)\n".encode()
        ctype = "text/plain"
    if req.method == "HEAD" or code in (204, 304):
        body = b""
    headers.append(("Content-Type", ctype))
    if action.retry_after is not None:
        ra = action.retry_after
        headers.append(("Retry-After", ra if isinstance(ra, str) else f"{ra:g}"))
    headers.extend(action.headers)
    return _build_response(code, phrase, headers, body, close=not req.keep_alive)
