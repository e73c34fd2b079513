"""Where bytes come from: the one small interface every store implements (:class:`Storage`),
the pins of a remote object's version (:class:`VersionPins`) and the raw errors a store raises.

The stores sit beside this module and import only it: local files
(:mod:`asyncload.storage.local`), fsspec filesystems (:mod:`asyncload.storage.fsspec`) and
the wire transport (:mod:`asyncload.storage.wire`); :mod:`asyncload.storage.factory` above them picks
one for a checkpoint URL. A store reads half-open byte ranges ``[start, end)`` of files named
relative to the checkpoint root. A read returns exactly ``end - start`` bytes or raises; a short
answer is :class:`ShortReadError` (retryable for remote stores, a truncated file locally).
Errors here are raw (OSError, aiohttp, botocore...): :mod:`asyncload.storage.retrying`
translates them once (:mod:`asyncload.storage.classify`), with the path, range and attempt.
"""

from __future__ import annotations

import asyncio
import contextvars
import stat
from collections.abc import Callable, Collection, Sequence
from typing import Any
from urllib.parse import urlparse

from asyncload.common.errors import CheckpointFormatError, redact_url

__all__ = [
    "REQUEST",
    "CompressedAnswerError",
    "CrossOriginRedirectError",
    "ListedStore",
    "ListingTooLargeError",
    "NotRegularFileError",
    "ObjectChangedError",
    "ProtocolMismatchError",
    "RangeIgnoredError",
    "RangeMismatchError",
    "ShortReadError",
    "Storage",
    "VersionPins",
    "check_identity",
    "first_byte",
    "origin_of",
    "parse_content_range",
]


#: The request the running task makes (set per request by :mod:`asyncload.storage.retrying`, which
#: copies it into the request's task): ``first_byte()`` tells it the answer has begun.
REQUEST: contextvars.ContextVar[Any] = contextvars.ContextVar("asyncload_request", default=None)


def first_byte() -> None:
    """Called by a store once the answer to the current request has begun (its status and
    headers are in, the body not yet read): the hedge's first-byte clock
    (:class:`asyncload.common.latency.LoadClock`). A store that cannot tell never calls it."""
    req = REQUEST.get()
    if req is not None:
        req.answered()


class ShortReadError(OSError):
    """A read returned fewer bytes than asked for. ``local``: from a local file, whose
    end of file is final (the file is truncated: not worth a retry)."""

    def __init__(self, path: str, start: int, end: int, got: int, *, local: bool = False) -> None:
        super().__init__(
            f"short read of {path} [{start}, {end}): got {got} of {end - start} bytes"
        )
        self.path, self.start, self.end, self.got = path, start, end, got
        self.local = local


class RangeIgnoredError(OSError):
    """A ranged read was answered with more bytes than asked for, or with a 200 (the
    whole file) for a range that does not start at 0: the server ignores ``Range``.
    Not worth a retry: the next answer is the same."""

    def __init__(self, url: str, start: int, end: int, status: int | None, got: str) -> None:
        super().__init__(
            f"asked for bytes [{start}, {end}) of {url}, got HTTP {status} with {got}: "
            "the server ignores Range requests"
        )
        self.url, self.start, self.end, self.status = url, start, end, status


class RangeMismatchError(OSError):
    """A ranged read was answered with something else than the range asked for: a
    ``Content-Range`` with another start, end or total, none on a 206 (a cache or proxy that
    keys ranges by URL), or a body longer than the range. Its bytes are never used. Not worth
    a retry: the next answer is the same."""

    def __init__(self, url: str, start: int, end: int, status: int | None, got: str) -> None:
        super().__init__(
            f"asked for bytes [{start}, {end}) of {url}, got HTTP {status} with {got}: "
            "the answer does not match the request"
        )
        self.url, self.start, self.end, self.status = url, start, end, status


class CrossOriginRedirectError(OSError):
    """The store answered with a redirect to another origin (scheme, host and port) than the
    checkpoint's: refused before any request was sent there, so no credential or header of
    the caller went along and no byte from elsewhere is used. Not worth a retry."""

    def __init__(
        self, url: str, location: str, status: int | None, *, origin: str | None = None
    ) -> None:
        self.origin, self.target = origin or origin_of(url), origin_of(location)
        answered = f"answered HTTP {status}" if status is not None else "answered"
        super().__init__(
            f"{redact_url(url)}: the server {answered} with a redirect to another origin, "
            f"{self.target} (the checkpoint's origin is {self.origin}); asyncload follows "
            "redirects within "
            "the checkpoint's origin only, so nothing was sent there"
        )
        self.url, self.location, self.status = redact_url(url), redact_url(location), status


def origin_of(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the default port written out; userinfo left out)."""
    parts = urlparse(url)
    scheme = (parts.scheme or "").lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = {"http": 80, "https": 443}.get(scheme)
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}" if port is not None else f"{scheme}://{host}"


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``(first, last + 1, total)`` of a ``Content-Range: bytes first-last/total`` header
    (``total`` None for ``*``), or None when it is missing or not of that form."""
    if not value:
        return None
    unit, _, spec = value.strip().partition(" ")
    rng, _, total = spec.strip().partition("/")
    first, _, last = rng.partition("-")
    if unit.lower() != "bytes" or not first.isdigit() or not last.isdigit():
        return None
    if total.strip() != "*" and not total.strip().isdigit():
        return None
    return int(first), int(last) + 1, None if total.strip() == "*" else int(total)


class ListingTooLargeError(OSError):
    """A directory listing (an HTTP index page) is larger than ``LoadOptions.max_metadata_size``:
    refused after that many bytes, never read or parsed whole."""

    def __init__(self, url: str, limit: int) -> None:
        super().__init__(
            f"the listing of {url} is more than {limit} bytes (its page and the names it lists), "
            "LoadOptions.max_metadata_size: not read further (raise max_metadata_size if the "
            "directory "
            "is really that large)"
        )
        self.url, self.limit = url, limit


class ObjectChangedError(OSError):
    """A remote object is no longer the version this load first saw: the store refused a
    read conditional on it (HTTP 412) or answered with another ETag / generation. Not
    worth a retry: every later answer comes from the new version."""

    def __init__(
        self, url: str, byte_range: tuple[int, int] | None, seen: str, now: str | None
    ) -> None:
        where = f"{url} bytes [{byte_range[0]}, {byte_range[1]})" if byte_range else url
        became = (
            f"is now {now}"
            if now is not None
            else "no longer matches it (the store refused the precondition)"
        )
        super().__init__(
            f"{where}: the object was {seen} when this load first saw it and {became}"
        )
        self.url, self.byte_range, self.seen, self.now = url, byte_range, seen, now


class CompressedAnswerError(OSError):
    """An answer with a ``Content-Encoding`` (gzip, br...) though ``identity`` was asked for:
    its bytes are not the file's (a compressed body, a weak ETag of that encoding), and no
    retry changes that. Refused before a byte of it is used."""

    def __init__(self, url: str, encoding: str) -> None:
        super().__init__(
            f"{url}: the server answered with Content-Encoding: {encoding[:40]} though "
            "'Accept-Encoding: identity' was asked for"
        )
        self.url, self.encoding = url, encoding


class ProtocolMismatchError(OSError):
    """The server did not answer in HTTP/1.x (an HTTP/2-only "h2c" port, or no HTTP at
    all): ``protocol`` names what it spoke. No retry changes that."""

    def __init__(self, where: str, protocol: str) -> None:
        super().__init__(f"{where} answered in {protocol}, not HTTP/1.1")
        self.where, self.protocol = where, protocol


def check_identity(url: str, headers: Any) -> None:
    """Raise :class:`CompressedAnswerError` for an answer whose ``Content-Encoding`` is not
    ``identity`` (``headers``: a mapping, names as the client keeps them)."""
    encoding = headers.get("content-encoding") or headers.get("Content-Encoding")
    if encoding and encoding.strip().lower() not in ("identity", ""):
        raise CompressedAnswerError(url, encoding.strip())


class NotRegularFileError(OSError):
    """A checkpoint file that is a FIFO, socket or device: reading it could block an I/O
    thread for ever (a FIFO without a writer) or never end (a device)."""

    def __init__(self, path: str, mode: int) -> None:
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a character device"
            if stat.S_ISCHR(mode)
            else "a block device"
            if stat.S_ISBLK(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "not a regular file"
        )
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path = path


class Storage:
    """A checkpoint location. Subclasses implement ``read`` (and ``readinto`` where cheaper)."""

    #: ``readinto`` writes straight into caller memory without an intermediate copy.
    supports_readinto = False
    #: ``readinto`` (async, on the loop) receives a remote answer's body straight into caller
    #: memory (the wire transport): a chunk that tiles its destination is read into it.
    receives_into = False
    #: Whether a second, hedged request for a slow chunk can help.
    hedgeable = False
    #: ``size`` and ``fingerprint`` finish without awaiting anything (a local file's
    #: ``stat``, on the calling thread): no timeout could end them, so the error boundary
    #: runs them once as they are and brings in its retries and translation only after an
    #: error (``RetryingStorage._stat``).
    calls_inline = False
    #: The client that reads (``LoadStats.transport``): ``"local"``, ``"wire"``,
    #: ``"fsspec"``; the factory adds why where ``transport="auto"`` fell back to fsspec.
    transport = ""

    def __init__(self, root: str) -> None:
        self.root = root

    def url(self, name: str) -> str:
        """The full location of file ``name`` of the checkpoint, for messages and logs: a
        password in the URL and a signed URL's signature shown as ``***``
        (:func:`asyncload.common.errors.redact_url`)."""
        return redact_url(f"{self.root.rstrip('/')}/{name}" if name else self.root)

    async def read(self, name: str, start: int, end: int) -> bytes | bytearray | memoryview:
        raise NotImplementedError

    def readinto_sync(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Blocking positional read into caller memory (stores with ``supports_readinto``)."""
        raise NotImplementedError

    def readinto_cached(self, name: str, start: int, buffers: Sequence[memoryview]) -> bool:
        """Read into caller memory on the calling thread only what needs no wait (a local
        file's cached pages); ``True`` when every byte landed. ``False`` leaves the buffers
        in any state: read them again elsewhere. The base class reads nothing."""
        return False

    async def readinto(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        data = await self.read(name, start, start + sum(len(b) for b in buffers))
        pos = 0
        for b in buffers:
            b[:] = memoryview(data)[pos : pos + len(b)]
            pos += len(b)

    async def size(self, name: str) -> int:
        raise NotImplementedError

    #: :meth:`read_object` fetches a whole file and its size in one request.
    supports_read_object = False

    async def read_object(self, name: str, max_size: int) -> tuple[memoryview | None, int]:
        """The whole of file ``name`` and its size, in one request (stores with
        ``supports_read_object``): ``(None, size)`` when ``size`` exceeds ``max_size`` (the
        body is never read), else ``(bytes, size)`` with exactly ``size`` bytes."""
        raise NotImplementedError

    async def read_prefix(self, name: str, n: int) -> tuple[memoryview, int]:
        """The first ``n`` bytes of file ``name`` (all of it when it is shorter) and its size.
        Here its size, then a read; a store whose answer to a ranged read also gives the
        file's size (wire: S3, GCS, HTTP) does both in one request."""
        size = int(await self.size(name))
        if size <= 0 or n <= 0:
            return memoryview(b""), size
        data = await self.read(name, 0, min(n, size))
        return (data if isinstance(data, memoryview) else memoryview(data)), size

    async def fingerprint(self, name: str) -> object | None:
        """A value that changes when file ``name`` is rewritten or replaced, or ``None`` when
        the store cannot tell cheaply. A load compares it before and after reading."""
        return None

    async def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """Sizes of several files at once where the store can list them in one request;
        the names it could not list are left out (ask :meth:`size` for those)."""
        return {}

    async def listdir(self) -> list[str]:
        """Names of the plain files directly under the root, sorted."""
        return []

    def requests_sent(self) -> int | None:
        """How many requests this store has written to the network so far, or ``None`` where
        it cannot tell (a client that sends on threads of its own, a local file)."""
        return None

    def warm(self) -> None:
        """Work that the answers of the requests on the wire will need, done while they are
        on it (the wire transport: an S3 listing's XML parser). Here nothing."""

    async def aclose(self) -> None:
        """Close files and sessions. Safe to call twice."""


class VersionPins(Storage):
    """A remote store whose objects are pinned to the version first seen ("etag ...",
    "generation ...", "last-modified ..."): every later answer about the file must carry
    the same, else :class:`ObjectChangedError`."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        #: file name -> the version this load first saw
        self._versions: dict[str, str] = {}
        #: file name -> the size a ranged answer's ``Content-Range`` first gave
        self._totals: dict[str, int] = {}

    def _check_range(
        self, name: str, start: int, end: int, status: int | None, content_range: str | None
    ) -> None:
        """Check a 206 answer to a read of bytes ``[start, end)`` against the request before
        its bytes are used: its ``Content-Range`` must name exactly that range (the end
        clamped to the file), with the total every other answer about the file gave.

        Raised: :class:`RangeMismatchError`."""
        parsed = parse_content_range(content_range)
        if parsed is None:
            got = f"Content-Range {content_range!r}" if content_range else "no Content-Range"
            raise RangeMismatchError(self.url(name), start, end, status, got)
        first, stop, total = parsed
        seen = (
            self._totals.setdefault(name, total) if total is not None else self._totals.get(name)
        )
        short = (
            stop < end and total is not None and stop == total
        )  # the file ends there: a short read
        if (
            first != start
            or (stop != end and not short)
            or stop <= first
            or (total is not None and (total != seen or stop > total))
        ):
            raise RangeMismatchError(
                self.url(name), start, end, status, f"Content-Range {content_range!r}"
            )

    def _see(
        self, name: str, version: str | None, byte_range: tuple[int, int] | None = None
    ) -> None:
        """Pin file ``name`` to ``version`` at first sight; raise if a later answer differs."""
        if version is None:
            return
        seen = self._versions.setdefault(name, version)
        if seen != version:
            raise ObjectChangedError(self.url(name), byte_range, seen, version)

    def pinned(self, name: str) -> str | None:
        """The version of file ``name`` this storage first saw, if the store reports one."""
        return self._versions.get(name)


#: One file of a directory listing: its name relative to the root, its size and its version
#: (as :meth:`VersionPins._see` takes it; None when the store gives none).
Listed = tuple[str, int, str | None]


class ListedStore(VersionPins):
    """A remote store that answers sizes from a listing of the checkpoint's directory (S3,
    GCS) and lists an HTTP directory through another store (an HTML index page: the
    factory's fsspec store, made on first use by ``lister``). The wire transport's store
    is one; each gives :meth:`_head` (one file's size, by a request) and
    :meth:`_list` (every file directly under the root), and has ``spec.kind``
    (``"s3"``, ``"gcs"`` or ``"http"``).

    :meth:`prefetch_sizes` starts the listing beside the ``.metadata`` read; :meth:`size`
    answers from it once it is back (or from a HEAD, whichever comes first), and a file
    directly under the root that it lacks is answered missing once, without a HEAD (the
    format probe's "is there an index?" of a Hugging Face directory)."""

    spec: Any

    def __init__(self, root: str, *, lister: Callable[[], Storage] | None = None) -> None:
        super().__init__(root)
        #: file name -> its size, as a HEAD, a whole GET or a listing gave it (the version
        #: those answers carried is pinned: a later answer of another version fails the load)
        self._sizes: dict[str, int] = {}
        #: makes the store that lists an HTTP directory (an HTML index page), on first use
        self._make_lister = lister
        self._lister: Storage | None = None
        #: the listing :meth:`prefetch_sizes` started, and the sizes it gave that :meth:`size`
        #: has not yet answered from (once each: a later ``size`` asks the store again)
        self._listing: asyncio.Future[list[Listed]] | None = None
        self._listed: dict[str, int] = {}
        #: the names of that listing, once it is back
        self._listed_names: frozenset[str] | None = None
        #: that listing's entries, once taken (for :meth:`listing_for_peers`)
        self._entries: list[Listed] | None = None

    async def _head(self, name: str) -> int:
        """The size of file ``name``, by a request (its version pinned)."""
        raise NotImplementedError

    async def _list(self) -> list[Listed]:
        """Every file directly under the root (S3, GCS)."""
        raise NotImplementedError

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

    def prefetch_sizes(self) -> bool:
        """Start listing the checkpoint's directory now (S3, GCS), while ``.metadata`` is
        read: :meth:`sizes` takes the files' sizes from it (waiting for it only where it
        would list anyway: 4 files or more). Whether a listing was started."""
        if self.spec.kind != "http" and self._listing is None:
            self._listing = asyncio.ensure_future(self._list())
            return True
        return False

    async def sizes(self, names: Sequence[str]) -> dict[str, int]:
        """The sizes this load has already seen (a HEAD, a whole GET, a listing started by
        :meth:`prefetch_sizes` that has finished: no request), and one listing of the
        checkpoint's directory instead of a HEAD per file for the others (S3, GCS; 4 files
        or more)."""
        listing = self._listing
        if not self._take_listing_if_back() and listing is not None:
            if self._listable([n for n in names if n not in self._sizes]):
                # a listing is needed anyway: the one on its way is the sooner
                await asyncio.wait({listing})
                self._take_listing_if_back()  # (a failed one is dropped, and listed again)
            else:  # a HEAD each is sooner than a large directory's listing: never wait for it
                self._listing = None
                listing.cancel()
                await asyncio.gather(listing, return_exceptions=True)
        out = {n: self._sizes[n] for n in names if n in self._sizes}
        wanted = set(names) - set(out)
        if not self._listable(wanted):
            return out
        self._take_listing(await self._list(), wanted)
        out.update((n, self._sizes[n]) for n in wanted if n in self._sizes)
        return out

    def _listable(self, wanted: Collection[str]) -> bool:
        """Whether the sizes of ``wanted`` are asked of a listing (S3, GCS; 4 files or more)
        rather than of a HEAD each."""
        return len(wanted) >= 4 and self.spec.kind != "http"

    def _take_listing_if_back(self) -> bool:
        """Take the sizes and versions of every file of the listing :meth:`prefetch_sizes`
        started, if it is back (a failed one, e.g. without permission to list, is dropped;
        a hostile one, e.g. declaring XML entities, fails the load: its
        ``CheckpointFormatError`` is raised)."""
        listing = self._listing
        if listing is None or not listing.done():
            return False
        self._listing = None
        if listing.cancelled():
            return False
        failed = listing.exception()
        if isinstance(failed, CheckpointFormatError):
            raise failed
        if failed is not None:
            return False
        self._entries = listing.result()
        for path, size, _ in listing.result():
            self._listed[path] = size
        self._listed_names = frozenset(self._listed)
        self._take_listing(listing.result(), None)
        return True

    async def listing_for_peers(self, wait: float | None) -> list[Listed] | None:
        """The entries of the listing :meth:`prefetch_sizes` started, waiting up to
        ``wait`` seconds for it (it is not cancelled); None without one, or when it failed
        or is still on its way (another rank of the load lists for itself then)."""
        listing = self._listing
        if self._entries is not None or listing is None:
            return self._entries
        await asyncio.wait({listing}, timeout=wait)
        if not listing.done() or listing.cancelled() or listing.exception() is not None:
            return None
        return list(listing.result())

    def use_listing(self, entries: list[Listed]) -> bool:
        """Take ``entries`` (another rank's listing of this directory, as :meth:`_list`
        gives it) as the listing :meth:`prefetch_sizes` would start: sizes and versions come
        from it, and this store lists nothing itself. Whether it took them (not where a
        listing was started already, nor over plain HTTP)."""
        if self._listing is not None or self._entries is not None or self.spec.kind == "http":
            return False
        done: asyncio.Future[list[Listed]] = asyncio.get_running_loop().create_future()
        done.set_result(list(entries))
        self._listing = done
        return True

    def _take_listing(self, entries: list[Listed], wanted: set[str] | None) -> None:
        for path, size, version in entries:
            if wanted is None or path in wanted:
                self._sizes[path] = size
                self._see(path, version)

    async def listdir(self) -> list[str]:
        if self.spec.kind == "http":  # an HTML index page: the lister parses its links
            if self._lister is None:
                if self._make_lister is None:
                    return []
                self._lister = self._make_lister()
            return await self._lister.listdir()
        try:
            entries = await self._list()
        except FileNotFoundError:
            return []
        return sorted(p for p, _, _ in entries if "/" not in p)

    async def _close_listing(self) -> None:
        """Cancel a listing still on its way and close the HTTP lister (part of ``aclose``)."""
        listing, self._listing = self._listing, None
        if listing is not None:
            listing.cancel()
            await asyncio.gather(listing, return_exceptions=True)
        lister, self._lister = self._lister, None
        if lister is not None:
            await lister.aclose()
