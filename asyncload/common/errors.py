"""The exceptions asyncload raises.

Every error the library raises on purpose derives from :class:`AsyncLoadError`;
leaves also derive from the builtin a caller would naturally catch::

    AsyncLoadError
    ├── ChunkTimeoutError          (also TimeoutError)   one chunk read ran out of time on every attempt
    ├── StorageReadError           (also OSError)        storage refused or failed a read
    │   └── CheckpointNotFoundError (also FileNotFoundError) a file of the checkpoint does not exist
    ├── CheckpointFormatError      (also ValueError)     corrupt, truncated or not a checkpoint
    │   └── CheckpointChangedError                      a file or object was rewritten while the load read it
    ├── UnsafeCheckpointError      (also ValueError)     the checkpoint asks to run code or import a non-allowed name
    ├── StateDictMismatchError     (also ValueError)     the destination does not fit the checkpoint
    ├── DistributedLoadError       (also RuntimeError)   another rank failed or stalled during a load
    ├── LoadReentryError           (also RuntimeError)   the blocking API was called from the library's own loop thread
    └── LoadCancelledError         (also CancelledError) the load was cancelled through its handle

Storage errors are translated into these classes in one place
(:class:`asyncload.storage.retrying.RetryingStorage`), parser errors in the format modules, always
with
``raise ... from exc`` so the original cause stays attached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

__all__ = [
    "AsyncLoadError",
    "CheckpointChangedError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChunkTimeoutError",
    "DistributedLoadError",
    "LoadCancelledError",
    "LoadReentryError",
    "StateDictMismatchError",
    "StorageReadError",
    "UnsafeCheckpointError",
]


#: Query parameters whose value is a secret (a signature, a token, a key): shown as ``***``.
SECRET_QUERY_KEYS = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "x-goog-security-token",
        "sig",
        "signature",
        "token",
        "access_token",
        "id_token",
        "refresh_token",
        "key",
        "api_key",
        "apikey",
        "api-key",
        "password",
        "passwd",
        "secret",
        "client_secret",
        "auth",
        "authorization",
        "code",
    }
)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def redact_url(url: str) -> str:
    """``url`` as messages, log records and ``repr`` show it: the password of its userinfo
    (``user:pw@``) and the values of query parameters that carry a signature or token
    (:data:`SECRET_QUERY_KEYS`: ``X-Amz-Signature``, ``X-Goog-Signature``, ``sig``,
    ``token``, ``key``...) replaced by ``***``. Anything that is not a URL with a scheme and
    host comes back unchanged."""
    try:
        parts = urlsplit(url)
        if not parts.scheme or not parts.netloc:
            return url
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user = userinfo.partition(":")[0]
            netloc = f"{user}:***@{hostport}" if user else f"***@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in SECRET_QUERY_KEYS for k, _ in pairs):
                query = "&".join(
                    f"{k}=***" if k.lower() in SECRET_QUERY_KEYS else part
                    for part in query.split("&")
                    for k in [part.partition("=")[0]]
                )
        if netloc == parts.netloc and query == parts.query:
            return url
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:  # not parseable as a URL (an invalid port, brackets): hide all of it
        return "<a URL that cannot be shown>"


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`: the one rule for
    every message, log record and ``repr`` that may quote a checkpoint's URL (an error of a
    client library quotes the URL it requested, credentials and signatures included)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


class AsyncLoadError(Exception):
    """Base class of every error asyncload raises on purpose. Its message never shows a
    URL's password or a signed URL's signature (:func:`redact_text`)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))


class ChunkTimeoutError(AsyncLoadError, TimeoutError):
    """Raised when one chunk read did not finish within ``timeout`` on every attempt.

    Attributes name where: ``path``, ``byte_range`` (half-open), ``attempts``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        byte_range: tuple[int, int] = (0, 0),
        attempts: int = 0,
    ):
        super().__init__(message)
        self.path = redact_url(path)
        self.byte_range = byte_range
        self.attempts = attempts


class StorageReadError(AsyncLoadError, OSError):
    """Raised when storage failed a read and retrying did not help (or could not).

    Attributes: ``path``, ``byte_range`` (half-open, or ``None`` for whole-file
    operations), ``attempts``, ``status`` (HTTP status where known).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        byte_range: tuple[int, int] | None = None,
        attempts: int = 0,
        status: int | None = None,
    ):
        # OSError's constructor interprets positional args; keep the message whole.
        super().__init__(message)
        self.path = redact_url(path)
        self.byte_range = byte_range
        self.attempts = attempts
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(StorageReadError, FileNotFoundError):
    """Raised when the checkpoint, its ``.metadata`` or one of its data files does not exist."""


class CheckpointFormatError(AsyncLoadError, ValueError):
    """Raised when a checkpoint is corrupt, truncated, of an unknown version, or not a checkpoint."""


class CheckpointChangedError(CheckpointFormatError):
    """Raised when a file or object of the checkpoint was rewritten or replaced while the
    load read it (a save into the same place, an upload over it): its bytes would mix two
    saves. Remote objects are pinned at first sight (ETag, GCS generation, Last-Modified)
    and every ranged read is conditional on that version or checked against it.

    Attributes: ``path``, ``byte_range`` (the read that saw the change, or ``None``),
    ``seen`` (the version at first sight) and ``now`` (the version the store reported
    then, or ``None`` when it only refused the precondition).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        byte_range: tuple[int, int] | None = None,
        seen: str | None = None,
        now: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = redact_url(path)
        self.byte_range = byte_range
        self.seen = seen
        self.now = now


class UnsafeCheckpointError(AsyncLoadError, ValueError):
    """Raised when the metadata or an object in the checkpoint asks to run code or
    import something outside the allow-list. Nothing from it was executed."""


class StateDictMismatchError(AsyncLoadError, ValueError):
    """Raised when the destination state dict does not fit the checkpoint: a missing
    key, a wrong shape or a wrong dtype. The message names the key and both sides."""


class DistributedLoadError(AsyncLoadError, RuntimeError):
    """Raised on every rank when another rank failed or stalled during a collective load.

    Attributes: ``rank`` (the group rank that failed or stalled, where known) and
    ``doing`` (what that rank was doing, e.g. ``"reading and sharing tensor data"``).
    """

    def __init__(self, message: str, *, rank: int | None = None, doing: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.doing = doing


class LoadReentryError(AsyncLoadError, RuntimeError):
    """Raised when ``load`` (or another blocking call) is made from the thread of the event
    loop that would have to do its work - a library callback such as ``progress`` that
    loads again - instead of hanging forever. Nothing was read."""


class LoadCancelledError(AsyncLoadError, concurrent.futures.CancelledError):
    """Raised by ``LoadHandle.result()`` after ``LoadHandle.cancel()``."""


def docs_ref(page: str, section: str = "") -> str:
    """Where a message points for more: ``"asyncload docs: Errors > StorageReadError"``.

    Pages and sections are named by their titles (the page names of docs/index.md), which stay
    the same across versions, renderings and installs; a repository path does not exist in an
    installed package."""
    return f"asyncload docs: {page}" + (f" > {section}" if section else "")


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The one error to raise for a task group's failure (exception groups stop inside the
    library): this process's own asyncload error first, then another rank's
    (:class:`DistributedLoadError`), then any other real error; the cancellations the
    failure caused count only when nothing else failed."""
    errors: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            else:
                errors.append(e)

    walk(group)
    real = [e for e in errors if not isinstance(e, asyncio.CancelledError)]
    if not real:
        return asyncio.CancelledError()
    own = [
        e
        for e in real
        if isinstance(e, AsyncLoadError) and not isinstance(e, DistributedLoadError)
    ]
    remote = [e for e in real if isinstance(e, DistributedLoadError)]
    return (own or remote or real)[0]
