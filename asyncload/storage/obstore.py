"""obstore (the Rust ``object_store`` crate's Python bindings) behind the Storage interface,
for ``s3://``, ``gs://`` / ``gcs://`` and ``http(s)://``: one store per checkpoint, built from
the plan :func:`asyncload.storage.obstore_plan.plan_store` made of the caller's
``storage_options``.

Reads are conditional on the version of the object first seen and every answer is compared,
like :class:`asyncload.storage.fsspec.FsspecStorage`. A read's body is streamed and refused
past the length asked for (never buffered whole). Requests to hosts other than the origin's (a
redirect object_store would follow) are refused by
:class:`asyncload.storage.redirect_guard.RedirectGuard`. obstore itself is imported when a
store is first used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from asyncload.storage.base import (
    CrossOriginRedirectError,
    Listed,
    ListedStore,
    ObjectChangedError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
    Storage,
    first_byte,
    origin_of,
)
from asyncload.storage.obstore_plan import StoreSpec
from asyncload.storage.redirect_guard import RedirectGuard

__all__ = ["OBJECT_PREFIX", "ObstoreStorage"]

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


def _etag(value: Any) -> str | None:
    """An entity tag without its quotes and weak marker, for comparison."""
    if not value:
        return None
    return str(value).strip().removeprefix("W/").strip('"')


class ObstoreStorage(ListedStore):
    """S3, GCS or HTTP(S) through one obstore store (one connection pool per storage,
    dropped by :meth:`aclose`).

    Versions are pinned at first sight as :class:`FsspecStorage` pins them (S3: ETag;
    GCS: generation; HTTP: ETag, else Last-Modified); a read is conditional on the ETag
    (``If-Match``) where the store sent a strong one, and every answer's version is
    compared. HTTP directory listings (HTML index pages) go through the store ``lister()``
    makes (the factory's: fsspec's, which parses their links; none: nothing is listed).
    """

    hedgeable = True

    def __init__(
        self,
        root: str,
        spec: StoreSpec,
        *,
        lister: Callable[[], Storage] | None = None,
    ) -> None:
        super().__init__(root, lister=lister)
        self.spec = spec
        self._store: Any = None
        #: file name -> the strong ETag to send as ``If-Match``
        self._conditions: dict[str, str] = {}
        #: refuses the store's requests to other hosts (built with the store)
        self._guard: RedirectGuard | None = None

    def _refusal(self, name: str) -> CrossOriginRedirectError | None:
        """The redirect to another host that :class:`RedirectGuard` refused, if any (a
        request of this store that failed failed because of it)."""
        if self._guard is None:
            return None
        where = (
            self.spec.config.get("endpoint") or self.spec.config.get("base_url") or self.spec.url
        )
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
        return (
            f"last-modified {modified.isoformat()}"
            if self.spec.kind == "http" and modified
            else None
        )

    def _see_meta(
        self, name: str, meta: Mapping[str, Any], byte_range: tuple[int, int] | None = None
    ) -> None:
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
            result = await obstore.get_async(
                self._get_store(),
                name,
                options=options,  # type: ignore[arg-type]
            )
        except PreconditionError as exc:
            raise ObjectChangedError(
                self.url(name), (start, end), self.pinned(name) or f"etag {cond}", None
            ) from exc
        except NotSupportedError as exc:
            if "Range request not supported" in str(
                exc
            ):  # a 200 for a ranged GET: the body is never read
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
            problem = RangeMismatchError(
                self.url(name), start, end, 206, f"a total of {total} bytes, not {known}"
            )
        if problem is not None:
            await _finish(result)
            del result
            raise problem
        data = await _body(result, end - start)
        del result
        if data is None:
            raise RangeMismatchError(
                self.url(name), start, end, 206, "a body longer than that range"
            )
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
            if "Range request not supported" in str(
                exc
            ):  # a 200 for a ranged GET: the body is never read
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

    async def _list(self) -> list[Listed]:
        import obstore

        listing = await obstore.list_with_delimiter_async(self._get_store())
        return [(str(m["path"]), int(m["size"]), self._version_of(m)) for m in listing["objects"]]

    async def aclose(self) -> None:
        """Drop the store (its connection pool closes with it) and the HTTP lister. Safe to call
        twice."""
        await self._close_listing()
        self._store = None
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.aclose()
        await asyncio.sleep(0)
