"""Byte views over memory, without copying: what formats and the engine share to put a
checkpoint's bytes into tensors (:func:`tensor_over`, :func:`memory_of`) and to copy them
with the GIL released (:func:`copy_bytes`)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = ["copy_bytes", "memory_of", "tensor_over"]


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
    mv = (
        memoryview(data).cast("B")
        if not isinstance(data, memoryview) or data.format != "B"
        else data
    )
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
