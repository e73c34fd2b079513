"""Local files: positional reads from a thread pool, straight into caller memory.

Errors here are raw (OSError, :class:`~asyncload.storage.base.ShortReadError`,
:class:`~asyncload.storage.base.NotRegularFileError`); :mod:`asyncload.storage.retrying`
translates them once, with the path, range and attempt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import stat
import threading
from collections.abc import Sequence

from asyncload.storage.base import NotRegularFileError, ShortReadError, Storage
from asyncload.storage.mapped import MIN_MAPPED_READ, MappedCopies, mapped_copies_available

log = logging.getLogger("asyncload.local")

#: Reads of at most this many bytes (``.metadata``, record probes, small records) are tried on
#: the loop thread first, from the page cache only: a hop to an I/O thread and back costs
#: more than copying them (docs/performance.md).
INLINE_READ = 256 << 10
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """Positional reads (``os.preadv``) from a thread pool, straight into caller memory.

    Not aiofiles, which is slower for this job (its ``read`` allocates a new bytes object
    per call and it cannot read into a caller's buffer at an offset): figures in
    ``docs/performance.md``.
    """

    transport = "local"

    supports_readinto = True
    calls_inline = True

    def __init__(
        self, root: str, executor: concurrent.futures.Executor, *, mapped_copies: bool = True
    ) -> None:
        super().__init__(root)
        self._executor = executor
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._mapped: MappedCopies | None = None
        #: Small reads are tried on the loop thread first (:meth:`_read_cached`).
        self._nowait = _RWF_NOWAIT != 0
        if mapped_copies:
            why = mapped_copies_available()
            if why is None:
                self._mapped = MappedCopies()
            else:
                log.debug("local reads without mappings: %s", why)

    @property
    def mapped_bytes(self) -> int:
        """Bytes copied out of the page cache through leased mappings
        (:mod:`asyncload.storage.mapped`)."""
        return 0 if self._mapped is None else self._mapped.bytes_copied

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _fd(self, name: str) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("storage is closed")
            fd = self._fds.get(name)
            if fd is None:
                path = self._path(name)
                _check_regular(path, os.stat(path).st_mode)
                # O_NONBLOCK: a FIFO swapped in after the stat must not block this thread in open
                fd = os.open(
                    path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
                )
                try:
                    _check_regular(path, os.fstat(fd).st_mode)
                    os.set_blocking(fd, True)
                except BaseException:
                    os.close(fd)
                    raise
                self._fds[name] = fd
            return fd

    def _preadv(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        fd = self._fd(name)
        want = sum(len(b) for b in buffers)
        mapped = self._mapped
        if mapped is not None and want >= MIN_MAPPED_READ and mapped.any_aliasing(start, buffers):
            self._read_aliasing(fd, name, start, buffers, want, mapped)
            return
        got = _pread_all(fd, list(buffers), start)
        if got != want:
            raise ShortReadError(self._path(name), start, start + want, got, local=True)

    def _read_aliasing(
        self,
        fd: int,
        name: str,
        start: int,
        buffers: Sequence[memoryview],
        want: int,
        mapped: MappedCopies,
    ) -> None:
        """Buffer by buffer: those the kernel's copy would alias copied through a leased
        mapping (:mod:`asyncload.storage.mapped`), as far as it goes, the rest with ``preadv``."""
        path = self._path(name)
        done = 0
        for b in buffers:
            pos = start + done
            n = mapped.copy(fd, path, pos, b) if mapped.aliasing(pos, b) else 0
            if n < len(b):
                got = _pread_all(fd, [b[n:]], pos + n)
                if got != len(b) - n:
                    raise ShortReadError(path, start, start + want, done + n + got, local=True)
            done += len(b)

    def readinto_sync(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Blocking form, for callers already on an I/O thread."""
        self._preadv(name, start, buffers)

    def readinto_cached(self, name: str, start: int, buffers: Sequence[memoryview]) -> bool:
        """At most :data:`INLINE_READ` bytes from the page cache on the calling thread
        (:meth:`_read_cached`); ``False`` when any of it must come from the disk."""
        if not self._nowait or sum(len(b) for b in buffers) > INLINE_READ:
            return False
        return self._read_cached(name, start, buffers) is None

    async def readinto(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        loop = asyncio.get_running_loop()
        want = sum(len(b) for b in buffers)
        if not self._nowait or want > INLINE_READ:
            await loop.run_in_executor(self._executor, self._preadv, name, start, buffers)
            return
        rest = self._read_cached(name, start, buffers)
        if rest is None:
            return
        pos, left = rest
        try:
            await loop.run_in_executor(self._executor, self._preadv, name, pos, left)
        except ShortReadError as exc:  # named by the whole read, not by its uncached rest
            raise ShortReadError(
                self._path(name), start, start + want, pos - start + exc.got, local=True
            ) from None

    def _read_cached(
        self, name: str, start: int, buffers: Sequence[memoryview]
    ) -> tuple[int, list[memoryview]] | None:
        """A small read on the calling (loop) thread, as far as the page cache holds it:
        ``preadv2(RWF_NOWAIT)`` never waits for the disk (it stops at the first page that is
        not cached). ``None`` when all of it landed; else where the rest starts and its
        buffers, for an I/O thread (which also tells a short file from an uncached page)."""
        fd = self._fd(name)
        bufs = [b for b in buffers if len(b)]
        pos = start
        while bufs:
            try:
                n = os.preadv(fd, bufs, pos, _RWF_NOWAIT)
            except BlockingIOError:  # the next page is not cached
                break
            except OSError as exc:
                if exc.errno in (
                    errno.EOPNOTSUPP,
                    errno.EINVAL,
                    errno.ENOSYS,
                ):  # not on this file system
                    self._nowait = False
                    break
                raise
            if n <= 0:
                break
            pos += n
            _consume(bufs, n)
        return (pos, bufs) if bufs else None

    async def read(self, name: str, start: int, end: int) -> bytearray:
        buf = bytearray(end - start)
        await self.readinto(name, start, [memoryview(buf)])
        return buf

    async def size(self, name: str) -> int:
        st = os.stat(self._path(name))
        if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            raise NotRegularFileError(self._path(name), st.st_mode)
        return st.st_size

    async def fingerprint(self, name: str) -> object | None:
        st = os.stat(self._path(name))
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)

    async def listdir(self) -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._listdir)

    def _listdir(self) -> list[str]:
        root = self.root
        try:
            names = os.listdir(root)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []
        return sorted(n for n in names if os.path.isfile(os.path.join(root, n)))

    async def aclose(self) -> None:
        self._close_fds()

    def _close_fds(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            if self._mapped is not None:
                self._mapped.forget(fd)
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass

    def __del__(self) -> None:
        # as a file object closes itself when it is dropped: a storage that a Ctrl-C kept from
        # being closed (it landed between a face's opening and its ``with``, say) keeps no
        # file open once nothing refers to it; no read can be running then (a read holds it)
        if getattr(self, "_fds", None):
            log.debug("closing %d file(s) of a storage dropped unclosed", len(self._fds))
            self._close_fds()


def _check_regular(path: str, mode: int) -> None:
    """Raised: :class:`IsADirectoryError` for a directory, :class:`NotRegularFileError` for a
    FIFO, socket or device at ``path`` (``mode``: its ``st_mode``)."""
    if not stat.S_ISREG(mode):
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", path)
        raise NotRegularFileError(path, mode)


def _pread_all(fd: int, bufs: list[memoryview], pos: int) -> int:
    """``preadv`` until ``bufs`` are full or the file ends; the bytes read."""
    done = 0
    while bufs:
        n = os.preadv(fd, bufs, pos)
        if n <= 0:
            break
        done += n
        pos += n
        _consume(bufs, n)
    return done


def _consume(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``bufs`` (filled by a read): whole buffers, then the
    front of the next."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs.pop(0)
    if n:
        bufs[0] = bufs[0][n:]
