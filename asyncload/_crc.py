"""CRC-32 of pieces that arrive out of order: compute each piece, combine in file order.

``crc32_combine`` is zlib's (x^(8n) mod P, by repeated squaring), in Python: a few
hundred integer operations per combine, nothing per byte.
"""

from __future__ import annotations

import threading
import zlib

__all__ = ["crc32_combine", "CrcTracker"]

_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [0] * 32
_p = 1 << 30  # x^1
_X2N[0] = _p
for _k in range(1, 32):
    _p = _multmodp(_p, _p)
    _X2N[_k] = _p


def _x2nmodp(n: int, k: int) -> int:
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


class CrcTracker:
    """Collects the CRC-32 of pieces of one byte range ``[start, end)`` and checks the whole."""

    def __init__(self, start: int, end: int, expected: int) -> None:
        self.start, self.end, self.expected = start, end, expected
        self._pieces: dict[int, tuple[int, int]] = {}
        self._covered = 0
        self._lock = threading.Lock()

    def add(self, offset: int, data: memoryview | bytes) -> None:
        """Add ``data``, the bytes at absolute ``offset`` (clipped to this range)."""
        lo, hi = max(offset, self.start), min(offset + len(data), self.end)
        if hi <= lo:
            return
        crc = zlib.crc32(data[lo - offset : hi - offset])
        with self._lock:
            if lo not in self._pieces:
                self._pieces[lo] = (hi - lo, crc)
                self._covered += hi - lo

    @property
    def complete(self) -> bool:
        return self._covered >= self.end - self.start

    def value(self) -> int:
        crc = 0
        pos = self.start
        for off in sorted(self._pieces):
            length, c = self._pieces[off]
            if off != pos:
                raise ValueError("pieces overlap or leave a gap")
            crc = crc32_combine(crc, c, length)
            pos += length
        return crc
