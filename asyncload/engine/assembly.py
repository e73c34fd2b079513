"""Assembly: putting bytes into destination memory, off the event loop.

A chunk's bytes land straight in a contiguous CPU destination (the read's own buffer),
or in a reused, already-touched staging buffer (:class:`StagingPool`) and are then copied
piece by piece (:func:`assemble`): a plain copy into ``into``, or ``deliver`` (a strided
copy into a view, a cast, a device copy through ``asyncload.engine.cuda``). Checksums of
``verify=True`` are fed here too, on the same thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from asyncload.engine.chunks import Chunk

__all__ = ["StagingPool", "assemble", "copy_bytes", "memory_of", "tensor_over", "track"]


def copy_bytes(dst: memoryview, src: memoryview | bytes | bytearray) -> None:
    """memcpy that releases the GIL for large copies (numpy does)."""
    n = len(dst)
    if n < 1 << 16:
        dst[:] = src
        return
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8, count=n))


def memory_of(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (any dtype)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def tensor_over(data: memoryview | bytes | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` over ``data`` without copying (``data`` must outlive it).

    Bytes that do not start at an address aligned for ``dtype`` (a tensor's bytes at an odd
    offset of a read buffer) are copied into aligned memory first: torch's kernels load
    elements with aligned vector instructions, and a misaligned ``complex128`` source crashed
    the process in ``copy_``."""
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    if len(mv) == 0:
        return torch.empty(0, dtype=dtype)
    raw = np.frombuffer(mv, dtype=np.uint8)
    addr = raw.ctypes.data
    if addr % min(dtype.itemsize, _MAX_ALIGN):
        aligned = torch.empty(len(mv), dtype=torch.uint8)  # torch allocations are 64-byte aligned
        np.copyto(aligned.numpy(), raw)
        return aligned.view(dtype)
    if mv.readonly:  # torch warns on read-only buffers; we never write through this view
        mv = memoryview((ctypes.c_char * len(mv)).from_address(addr)).cast("B")
    return torch.frombuffer(mv, dtype=torch.uint8).view(dtype)


#: The widest alignment a tensor kernel may assume of its elements (16: complex128).
_MAX_ALIGN = 16


def track(chunk: Chunk, views: Sequence[memoryview]) -> None:
    """Feed the chunk's bytes, read straight into ``views``, to its checksums."""
    pos = chunk.start
    for v in views:
        for tr in chunk.trackers:
            tr.add(pos, v)
        pos += len(v)


def assemble(chunk: Chunk, data: memoryview) -> None:
    """Hand each piece of ``chunk`` its bytes of ``data`` (the whole request's bytes)."""
    for tr in chunk.trackers:
        tr.add(chunk.start, data)
    base = chunk.start
    for seg in chunk.segments:
        part = data[seg.start - base : seg.end - base]
        if seg.into is not None:
            copy_bytes(seg.into, part)
        elif seg.deliver is not None:
            seg.deliver(part)


class StagingPool:
    """Reusable staging buffers: memory already touched, so reads run at full speed."""

    def __init__(self, limit_bytes: int) -> None:
        self._free: list[bytearray] = []
        self._limit = limit_bytes
        self._held = 0

    def get(self, n: int) -> bytearray:
        best = None
        for i, b in enumerate(self._free):
            if len(b) >= n and (best is None or len(b) < len(self._free[best])):
                best = i
        if best is not None:
            buf = self._free.pop(best)
            self._held -= len(buf)
            return buf
        return bytearray(n)

    def put(self, buf: bytearray) -> None:
        if self._held + len(buf) <= self._limit:
            self._free.append(buf)
            self._held += len(buf)
