"""Assembly: putting bytes into destination memory, off the event loop.

A chunk's bytes land straight in a contiguous CPU destination (the read's own buffer),
or in a reused, already-touched staging buffer (:class:`StagingPool`) and are then copied
piece by piece (:func:`assemble`): a plain copy into ``into``, or ``deliver`` (a strided
copy into a view, a cast, a device copy through ``asyncload.engine.cuda_ring``). Checksums of
``verify=True`` are fed here too, on the same thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncload.engine.chunks import Chunk
from asyncload.formats import copy_bytes, memory_of, tensor_over

__all__ = ["StagingPool", "assemble", "copy_bytes", "memory_of", "tensor_over", "track"]


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
