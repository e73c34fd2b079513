"""Local files: positional reads from a thread pool, straight into caller memory.

Errors here are raw (OSError, :class:`~asyncload._storage.ShortReadError`,
:class:`~asyncload._storage.NotRegularFileError`); :mod:`asyncload._retry` translates them
once, with the path, range and attempt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import stat
import threading
from collections.abc import Sequence

from ._mapped import MIN_MAPPED_READ, MappedCopies, mapped_copies_available
from ._storage import NotRegularFileError, ShortReadError, Storage, _check_regular

log = logging.getLogger("asyncload.local")

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """Positional reads (``os.preadv``) from a thread pool, straight into caller memory.

    aiofiles was measured slower for this job (its ``read`` allocates a new bytes
    object per call and it cannot read into a caller's buffer at an offset);
    see ``docs/performance.md``.
    """

    supports_readinto = True

    def __init__(self, root: str, executor: concurrent.futures.Executor, *, mapped_copies: bool = True) -> None:
        super().__init__(root)
        self._executor = executor
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._mapped: MappedCopies | None = None
        if mapped_copies:
            why = mapped_copies_available()
            if why is None:
                self._mapped = MappedCopies()
            else:
                log.debug("local reads without mappings: %s", why)

    @property
    def mapped_bytes(self) -> int:
        """Bytes copied out of the page cache through leased mappings (:mod:`._mapped`)."""
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
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
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
        bufs = list(buffers)
        pos = start
        done = 0
        if self._mapped is not None and want >= MIN_MAPPED_READ:
            done = self._mapped.copy(fd, self._path(name), start, bufs)
            if done == want:
                return
            pos += done
            skip = done
            while skip >= len(bufs[0]):
                skip -= len(bufs.pop(0))
            if skip:
                bufs[0] = bufs[0][skip:]
        while bufs:
            n = os.preadv(fd, bufs, pos)
            if n <= 0:
                raise ShortReadError(self._path(name), start, start + want, done, local=True)
            done += n
            pos += n
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            if n:
                bufs[0] = bufs[0][n:]

    def readinto_sync(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Blocking form, for callers already on an I/O thread."""
        self._preadv(name, start, buffers)

    async def readinto(self, name: str, start: int, buffers: Sequence[memoryview]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._preadv, name, start, buffers)

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
