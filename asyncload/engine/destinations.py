"""Destinations a load cannot write, refused before any I/O.

A tensor is loaded in place: its memory must exist, be dense, hold each element once and
be writable. Each destination that is not is a :class:`StateDictMismatchError` naming the
key and the reason, raised before anything is read:

- on the ``meta`` device (no memory: torch's planner would look for a process group);
- not ``torch.strided`` (sparse, mkldnn: ``copy_`` cannot write it);
- elements that overlap in memory (``expand()``'s stride 0, ``as_strided``), or may (a
  layout not provably disjoint): one place would receive several elements;
- CPU memory that is not mapped writable (``torch.from_numpy`` of a read-only
  ``np.memmap``, a ``mmap`` opened ``PROT_READ``): a copy would kill the process with
  SIGSEGV, a read into it fail with EFAULT. Decided from ``/proc/self/maps`` (one read per
  check, then a binary search per tensor: nothing touches the memory); where the kernel
  has no ``/proc`` this check is skipped.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from asyncload.common.errors import StateDictMismatchError

__all__ = ["PLAIN_TENSOR_TYPES", "check_destinations"]

log = logging.getLogger("asyncload.destinations")


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(flattened name, tensor)`` of a state dict, nested as DCP flattens it."""
    if isinstance(obj, Mapping):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, torch.Tensor):
        shards = getattr(type(obj), "local_shards", None)
        if callable(shards):  # a ShardedTensor: its local shards are written
            for shard in shards(obj):
                yield prefix, shard.tensor
            return
        local = getattr(obj, "_local_tensor", None)  # a DTensor: its local shard is written
        yield prefix, local if isinstance(local, torch.Tensor) else obj
        return
    else:
        return
    for k, v in items:
        if type(v) in _PLAIN:  # the common case, without a generator per key
            yield (f"{prefix}.{k}" if prefix else str(k)), v
        else:
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


#: The types of plain tensors (not a subclass that could be ``Stateful``, a DTensor, ...).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN = PLAIN_TENSOR_TYPES


class _Maps:
    """This process's memory mappings (``/proc/self/maps``), searched by address."""

    def __init__(self, text: str) -> None:
        # each line: ``start-end perms offset dev inode path`` (proc(5)); split, not matched
        # with a regular expression (a torch process has hundreds of mappings: 0.3 ms
        # against 8.5 ms)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.writable: list[bool] = []
        self.lines: list[str] = []
        for line in text.splitlines():
            span, _, rest = line.partition(" ")
            lo, dash, hi = span.partition("-")
            if not dash or not rest:
                continue
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
            self.starts.append(start)
            self.ends.append(end)
            self.writable.append(rest[1:2] == "w")  # perms: rwxp
            self.lines.append(rest)

    @classmethod
    def read(cls) -> _Maps | None:
        try:
            with open("/proc/self/maps") as f:
                return cls(f.read())
        except OSError:  # not Linux: the check is skipped
            return None

    def unwritable(self, start: int, end: int) -> str | None:
        """Why ``[start, end)`` is not all mapped writable (the mapping's line), or ``None``."""
        i = bisect.bisect_right(self.starts, start) - 1
        at = start
        while at < end:
            if i < 0 or i >= len(self.starts) or self.starts[i] > at or self.ends[i] <= at:
                return f"[{at:#x}, ...) is not mapped"
            if not self.writable[i]:
                return f"[{self.starts[i]:#x}, {self.ends[i]:#x}) is mapped {' '.join(self.lines[i].split())}"
            at = self.ends[i]
            i += 1
        return None


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: unless each dimension's stride (in
    increasing order) steps past everything the smaller ones reach. Exact for ``expand()``
    and the layouts torch makes; a layout it cannot prove disjoint is refused too (torch's
    ``copy_`` refuses only the overlaps it can prove, and writes the others element over element)."""
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t``'s elements occupy: ``[first, last + itemsize)``."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    start = t.data_ptr()
    return start, start + (extent + 1) * t.element_size()


def check_destinations(state_dict: Any) -> None:
    """Raise :class:`StateDictMismatchError` for the first tensor of ``state_dict`` (nested
    or flattened) that a load cannot write (see the module docstring); reads nothing.
    About 5 microseconds a tensor (docs/integrity.md)."""
    maps: _Maps | None = None
    maps_read = False
    strided = torch.strided
    for key, t in _tensors(state_dict, ""):
        if type(t) not in _PLAIN:
            try:  # a tensor subclass may refuse these (a ShardedTensor's __torch_function__ does)
                t.is_meta, t.layout  # noqa: B018
            except (RuntimeError, TypeError, NotImplementedError):
                continue
        if t.is_meta:
            raise StateDictMismatchError(
                f"key {key!r:.200}: the destination is on the meta device, which has no memory to load into: "
                "allocate it first (module.to_empty(device=...)), or let asyncload.read_state_dict allocate it"
            )
        if t.layout is not strided:
            raise StateDictMismatchError(
                f"key {key!r:.200}: the destination is a {t.layout} tensor; a load writes dense (torch.strided) "
                "tensors in place: pass a dense tensor (and convert it after the load)"
            )
        if t.is_contiguous():
            if not t.is_cpu or not t.nbytes:
                continue
            start = t.data_ptr()
            end = start + t.nbytes
        else:
            if t.numel() == 0:
                continue
            if _may_overlap(t):
                raise StateDictMismatchError(
                    f"key {key!r:.200}: the destination's elements overlap in memory (shape {list(t.shape)}, "
                    f"strides {list(t.stride())}, as expand() or as_strided() make): several elements would be "
                    "written to one place; pass a tensor with memory of its own (.clone())"
                )
            if not t.is_cpu:
                continue
            start, end = _span(t)
        if not maps_read:
            maps, maps_read = _Maps.read(), True
        if maps is None:
            continue
        why = maps.unwritable(start, end)
        if why is not None:
            raise StateDictMismatchError(
                f"key {key!r:.200}: the destination's memory is not writable ({why}), as with torch.from_numpy "
                "of a read-only np.memmap: writing into it would kill the process; pass writable memory "
                "(np.memmap(..., mode='r+') or 'c', or a copy)"
            )
