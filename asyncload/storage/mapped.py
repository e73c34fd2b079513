"""Local reads the kernel's copy would alias, copied out of the page cache through a
short-lived mapping, under a lease.

Why: ``preadv`` copies with the kernel's ``rep movsb``, one 4 KiB page at a time, forward.
When a destination's address is 1 to 31 bytes past its bytes' file offset modulo 4096, each
load of that copy aliases a store it has just made (4 KiB aliasing) and the copy is 1.6-3.9x
slower (on the 2-core AMD EPYC development machine, 256 MiB on two threads: 57-71 ms at 1-8
bytes, 29-30 ms at 16-24, 17-22 ms from 32 bytes on). Where that happens is chance: DCP
records and safetensors data start at arbitrary file offsets, tensors wherever the caller's
allocator put them (about one large tensor in 130). A user-space ``memmove`` (glibc's vector
loop, which steps around the aliasing) out of a mapping of the same page-cache pages takes
19-23 ms at every offset. Elsewhere the kernel's copy is as fast or faster (and whole loads
through mappings were measured slower on a 16-file checkpoint), so only the aliasing reads
are mapped: :meth:`MappedCopies.aliasing`. ``docs/performance.md`` has the figures.

What could go wrong, and what stops it. A mapping turns two read errors into ``SIGBUS``,
which no Python code can catch:

- **The file shrinks under the copy** (``truncate``, ``open(..., "w")``). A window is mapped
  only while this process holds a read lease on the file (``F_SETLEASE``, ``F_RDLCK``): the
  kernel grants none while anyone has the file open for writing, and makes anyone who opens
  it for writing or truncates it wait until the lease is let go (for at most
  ``/proc/sys/fs/lease-break-time``, 45 s by default). The file's size is read while the
  lease is held, and nothing past it is mapped. Before each window the lease is checked
  (``F_GETLEASE``): once a writer waits, the lease is let go as soon as the windows being
  copied are done (milliseconds), and the rest of the load reads that file with ``preadv``,
  whose short read is the typed error it always was. The lease is held only while windows
  are being copied, never between reads.
- **A page must come from the disk and the disk fails.** A window is copied only when every
  one of its pages is in the page cache (``cachestat``, Linux 6.5); a window that is not is
  read with ``preadv``, as a cold file always was.

The lease break is signalled to the holder; the signal is set to ``SIGURG`` (``F_SETSIG``),
which is ignored unless a program handles it (when Python code handles it, nothing is
mapped). Where any of this is missing (not Linux, a kernel without ``cachestat``, a file system
without leases, a file this process may not lease: not its owner and no ``CAP_LEASE``, a
file open for writing), reads use ``preadv``. ``LoadOptions(local_mapped_copies=False)`` turns it
off.

Left: a page dropped from the cache between the check and the copy that then fails to read
from the disk; a process stopped for longer than the lease-break time in the middle of a copy.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import signal
import sys
import threading
from collections.abc import Sequence

log = logging.getLogger("asyncload.local")

__all__ = ["MappedCopies", "mapped_copies_available"]

#: Reads shorter than this are not worth a mapping (each window costs a few system calls and
#: a TLB flush on every core that runs this process).
MIN_MAPPED_READ = 1 << 20
#: The largest window mapped at once (a read larger than this is copied window by window).
WINDOW = 16 << 20
#: A destination whose address is 1 to ``ALIAS_WINDOW - 1`` bytes past its bytes' file
#: offset, modulo 4096, makes the kernel's forward copy alias its loads with its own recent
#: stores (4 KiB aliasing): 1.6-3.9x slower. Elsewhere the kernel's copy is as fast as the
#: mapped one or faster, so only those reads are mapped (docs/performance.md).
ALIAS_WINDOW = 32
_ALIAS_PERIOD = 4096

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", None)
_F_SETSIG = getattr(fcntl, "F_SETSIG", None)
_SIGNAL = getattr(signal, "SIGURG", None)
_PAGE = mmap.PAGESIZE


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint64)
        for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


#: cachestat(2) (Linux 6.5): how many of a range's pages are in the page cache, one call per
#: window (mincore(2) walks the range page by page: about 0.17 ms for 16 MiB, 11 ms a GiB).
#: The same number on the architectures whose numbers were unified from 424 on (not on alpha,
#: mips or ia64: nothing is mapped there).
_NR_CACHESTAT = 451
_UNIFIED_SYSCALLS = frozenset(
    {"x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "ppc64", "s390x", "loongarch64"}
)


class _Libc:
    """The libc calls a window needs; ctypes drops the GIL for each of them."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        self.failed = ctypes.c_void_p(-1).value

    def cached_pages(self, fd: int, start: int, n: int) -> int:
        """Pages of ``[start, start + n)`` in the page cache; -1 when cachestat fails."""
        rng, st = _CachestatRange(start, n), _Cachestat()
        if self.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return -1
        return int(st.nr_cache)


_libc: _Libc | None = None
_libc_lock = threading.Lock()


def _get_libc() -> _Libc:
    global _libc
    with _libc_lock:
        if _libc is None:
            _libc = _Libc()
        return _libc


def mapped_copies_available() -> str | None:
    """``None`` when this platform can copy through leased mappings, else why not."""
    if not sys.platform.startswith("linux"):
        return f"leases are Linux-only (this is {sys.platform})"
    if _F_SETLEASE is None or _F_GETLEASE is None or _F_SETSIG is None or _SIGNAL is None:
        return "this Python's fcntl lacks F_SETLEASE, F_GETLEASE or F_SETSIG"
    if os.uname().machine not in _UNIFIED_SYSCALLS:
        return f"cachestat(2)'s number is not known on {os.uname().machine}"
    handler = signal.getsignal(_SIGNAL)
    if handler not in (signal.SIG_DFL, signal.SIG_IGN, None):
        return "the program handles SIGURG, the signal a lease break would send"
    return _cachestat_missing()


_cachestat_probe: list[str | None] = []


def _cachestat_missing() -> str | None:
    """Why cachestat(2) cannot be called here (asked once: a bad file descriptor must say
    EBADF, not ENOSYS or a seccomp filter's EPERM), or ``None``."""
    with _libc_lock:
        if _cachestat_probe:
            return _cachestat_probe[0]
    libc = _get_libc()
    ctypes.set_errno(0)
    rc = libc.syscall(_NR_CACHESTAT, -1, None, None, 0)
    err = ctypes.get_errno()
    why = (
        None
        if rc != 0 and err not in (errno.ENOSYS, errno.EPERM)
        else f"no cachestat(2): {os.strerror(err)}"
    )
    with _libc_lock:
        _cachestat_probe[:] = [why]
    return why


class _Lease:
    """One file's lease: held while ``active`` windows are being copied."""

    __slots__ = ("active", "dead", "size")

    def __init__(self) -> None:
        self.active = 0
        self.size = -1
        self.dead = False


class MappedCopies:
    """Copies of large local reads through leased mappings, for one :class:`LocalStorage`.

    :meth:`copy` copies what it can of a buffer's read, window by window from its start, and
    returns how many bytes it copied; the caller reads the rest with ``preadv``. Thread-safe: the
    I/O threads share one lease per file.
    """

    def __init__(self) -> None:
        self._leases: dict[int, _Lease] = {}
        self._lock = threading.Lock()
        #: bytes copied through mappings (for tests and the DEBUG log)
        self.bytes_copied = 0

    @staticmethod
    def aliasing(pos: int, buf: memoryview) -> bool:
        """Would the kernel's copy of file offset ``pos`` into ``buf`` alias (see the module)?
        ``buf`` at least :data:`MIN_MAPPED_READ` bytes, its address 1 to 31 bytes past
        ``pos`` modulo 4096."""
        if len(buf) < MIN_MAPPED_READ:
            return False
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        except (TypeError, ValueError):  # read-only or not contiguous: preadv says so
            return False
        return 0 < (addr - pos) % _ALIAS_PERIOD < ALIAS_WINDOW

    def any_aliasing(self, start: int, buffers: Sequence[memoryview]) -> bool:
        pos = start
        for b in buffers:
            if self.aliasing(pos, b):
                return True
            pos += len(b)
        return False

    def copy(self, fd: int, path: str, start: int, buf: memoryview) -> int:
        """Copy file bytes from ``start`` into ``buf``, window by window, as far as the lease
        and the page cache allow; the bytes copied (the caller reads the rest)."""
        with self._lock:
            lease = self._leases.get(fd)
            if lease is None:
                lease = self._leases[fd] = _Lease()
            if lease.dead:
                return 0
        n = len(buf)
        try:
            dst = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if n else 0
        except (TypeError, ValueError):  # read-only or not contiguous: preadv says so
            return 0
        libc = _get_libc()
        at = 0
        while at < n:
            m = min(WINDOW, n - at)
            if not self._enter(fd, path, lease, start + at + m):
                break
            try:
                copied = _copy_window(libc, fd, start + at, dst + at, m)
            finally:
                self._leave(fd, lease)
            if not copied:
                break
            at += m
            with self._lock:
                self.bytes_copied += m
        return at

    def _enter(self, fd: int, path: str, lease: _Lease, end: int) -> bool:
        """Hold the lease for one more window ending at file offset ``end``, or say no."""
        assert (
            _F_SETLEASE is not None
            and _F_GETLEASE is not None
            and _F_SETSIG is not None
            and _SIGNAL is not None
        )
        with self._lock:
            if lease.dead:
                return False
            if lease.active == 0:
                try:
                    # before every lease: letting a lease go (F_UNLCK) resets the signal to 0,
                    # which means SIGIO, whose default action ends the process
                    fcntl.fcntl(fd, _F_SETSIG, _SIGNAL)
                    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
                    lease.size = os.fstat(fd).st_size
                except OSError as exc:
                    lease.dead = True
                    why = (
                        "it is open for writing"
                        if exc.errno == errno.EAGAIN
                        else os.strerror(exc.errno or 0)
                    )
                    log.debug("%s: no read lease (%s): positional reads, no mappings", path, why)
                    return False
            if fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK or end > lease.size:
                # a writer waits for the lease, or the read runs past the end of the file
                # (preadv's short read names it): no more mappings of this file
                if end <= lease.size:
                    log.debug(
                        "%s: a writer waits for the read lease: positional reads from here", path
                    )
                    lease.dead = True
                if lease.active == 0:
                    _let_go(fd)
                return False
            lease.active += 1
            return True

    def _leave(self, fd: int, lease: _Lease) -> None:
        with self._lock:
            lease.active -= 1
            if lease.active == 0:
                _let_go(fd)

    def forget(self, fd: int) -> None:
        """The file is being closed (which ends its lease)."""
        with self._lock:
            self._leases.pop(fd, None)


def _let_go(fd: int) -> None:
    assert _F_SETLEASE is not None
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    except OSError:  # pragma: no cover - the lease is gone already
        pass


def _copy_window(libc: _Libc, fd: int, pos: int, dst: int, n: int) -> bool:
    """Copy ``n`` bytes at file offset ``pos`` to address ``dst`` through a mapping; ``False``
    (nothing copied) when a page is not in the page cache or the mapping fails."""
    base = pos - pos % _PAGE
    length = pos - base + n
    if libc.cached_pages(fd, base, length) != (length + _PAGE - 1) // _PAGE:
        return False
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, base)
    if addr is None or addr == libc.failed:
        return False
    try:
        ctypes.memmove(dst, addr + pos - base, n)
    finally:
        libc.munmap(addr, length)
    return True
