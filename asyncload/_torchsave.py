"""torch.save archives (a zip of ``data.pkl`` + one entry per storage), parsed without
``torch.load``: the directory with bounds checks, the pickle with the allow-list, each
storage located by its local header. Used for every record of a DCP ``.distcp`` file
(each is one torch.save archive) and for plain ``torch.save`` files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch

from ._errors import CheckpointFormatError
from ._plan import TensorLocation, tensor_over
from ._safe_pickle import StorageRef, TensorRef, record_globals, safe_loads, storage_persistent_load
from ._zip import EOCD_SEARCH, LOCAL_HEADER_SIZE, local_data_start, locate_central_directory, parse_central_directory

__all__ = ["NeedBytes", "ByteWindow", "ArchiveLayout", "StorageLoc", "parse_archive", "aparse_archive",
           "tensor_location", "materialize", "HEAD_PROBE", "TAIL_PROBE"]

#: Bytes read at a large record's start and end to find its layout (one request each,
#: and the tail of one record is read together with the head of the next).
HEAD_PROBE = 4096
TAIL_PROBE = EOCD_SEARCH


class NeedBytes(Exception):
    """The parser needs file bytes ``[start, end)`` it does not have yet."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.start, self.end = start, end


class ByteWindow:
    """Known byte ranges of one file; ``get`` returns a range or raises NeedBytes."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, bytes | memoryview]] = []

    def add(self, start: int, data: bytes | memoryview) -> None:
        self._parts.append((start, data))

    def get(self, start: int, end: int) -> memoryview:
        for s, d in self._parts:
            if s <= start and end <= s + len(d):
                return memoryview(d)[start - s : end - s]
        raise NeedBytes(start, end)


@dataclass(frozen=True)
class StorageLoc:
    key: str
    data_start: int
    nbytes: int
    crc32: int


@dataclass
class ArchiveLayout:
    #: The decoded ``data.pkl``: tensors appear as :class:`TensorRef`.
    obj: Any
    storages: dict[str, StorageLoc]
    where: str


def _walk_refs(obj: Any, out: list[TensorRef], depth: int = 0) -> None:
    if depth > 200:
        raise CheckpointFormatError("object is nested more than 200 levels deep")
    if isinstance(obj, TensorRef):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk_refs(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _walk_refs(v, out, depth + 1)


def parse_archive(win: ByteWindow, start: int, size: int, where: str, *, max_pickle: int = 1 << 30) -> ArchiveLayout:
    """Parse the archive at file bytes ``[start, start + size)``; raises NeedBytes for missing bytes."""
    if size < 22:
        raise CheckpointFormatError(f"{where}: {size} bytes is too small to be a torch.save archive")
    tail_len = min(size, TAIL_PROBE)
    tail = win.get(start + size - tail_len, start + size)
    cd_off, cd_size, n = locate_central_directory(tail, size, where)
    cd = win.get(start + cd_off, start + cd_off + cd_size)
    entries = parse_central_directory(cd, n, size, where).entries
    pkl_names = [k for k in entries if k.endswith("/data.pkl") or k == "data.pkl"]
    if len(pkl_names) != 1:
        raise CheckpointFormatError(f"{where}: not a torch.save archive (found {len(pkl_names)} data.pkl entries)")
    pkl = entries[pkl_names[0]]
    prefix = pkl.name[: -len("data.pkl")]
    if pkl.size > max_pickle:
        raise CheckpointFormatError(f"{where}: data.pkl of {pkl.size} bytes exceeds the {max_pickle} allowed")
    bo = entries.get(prefix + "byteorder")
    if bo is not None and bo.size <= 16:
        ds = _data_start(win, start, bo.header_offset, bo.name, where)
        order = bytes(win.get(start + ds, start + ds + bo.size))
        if order not in (b"little",):
            raise CheckpointFormatError(f"{where}: byte order {order!r} is not supported (only little-endian)")
    ds = _data_start(win, start, pkl.header_offset, pkl.name, where)
    if pkl.method != 0:
        raise CheckpointFormatError(f"{where}: data.pkl is compressed; torch.save never compresses")
    pickle_bytes = win.get(start + ds, start + ds + pkl.size)
    obj = safe_loads(pickle_bytes, what=f"{where} (data.pkl)", allowed=record_globals(),
                     persistent_load=storage_persistent_load)
    refs: list[TensorRef] = []
    _walk_refs(obj, refs)
    storages: dict[str, StorageLoc] = {}
    for ref in refs:
        key = ref.storage.key
        if key in storages:
            continue
        entry = entries.get(f"{prefix}data/{key}")
        if entry is None:
            raise CheckpointFormatError(f"{where}: storage {key!r} named by data.pkl has no data/{key} entry")
        if entry.method != 0:
            raise CheckpointFormatError(f"{where}: storage data/{key} is compressed")
        if entry.size != ref.storage.nbytes:
            raise CheckpointFormatError(f"{where}: storage data/{key} holds {entry.size} bytes, "
                                        f"data.pkl says {ref.storage.nbytes}")
        dstart = _data_start(win, start, entry.header_offset, entry.name, where)
        if dstart + entry.size > size:
            raise CheckpointFormatError(f"{where}: storage data/{key} runs past the end of the archive")
        storages[key] = StorageLoc(key, start + dstart, entry.size, entry.crc32)
    return ArchiveLayout(obj, storages, where)


def _data_start(win: ByteWindow, start: int, header_offset: int, name: str, where: str) -> int:
    nl = len(name.encode("utf-8"))
    head = win.get(start + header_offset, start + header_offset + LOCAL_HEADER_SIZE + nl)
    ds = local_data_start(head, header_offset, name, where)
    if ds is None:  # pragma: no cover - get() returned the bytes asked for
        raise NeedBytes(start + header_offset, start + header_offset + LOCAL_HEADER_SIZE + nl)
    return ds


async def aparse_archive(win: ByteWindow, start: int, size: int, where: str,
                         fetch: Callable[[int, int], Awaitable[bytes | memoryview]], *,
                         max_pickle: int = 1 << 30) -> ArchiveLayout:
    """:func:`parse_archive`, fetching missing bytes with ``fetch(start, end)`` (at most 16 rounds)."""
    for _ in range(16):
        try:
            return parse_archive(win, start, size, where, max_pickle=max_pickle)
        except NeedBytes as need:
            lo = max(start, need.start)
            hi = min(start + size, max(need.end, need.start + HEAD_PROBE))
            if hi <= lo:
                raise CheckpointFormatError(f"{where}: needs bytes [{need.start}, {need.end}) outside the record") from None
            win.add(lo, await fetch(lo, hi))
    raise CheckpointFormatError(f"{where}: layout did not resolve after 16 reads")


def tensor_location(layout: ArchiveLayout, name: str, ref: TensorRef | None = None) -> TensorLocation:
    """The location of the archive's tensor (``ref``, or the archive's whole object)."""
    ref = layout.obj if ref is None else ref
    if not isinstance(ref, TensorRef):
        raise CheckpointFormatError(f"{layout.where}: expected a tensor record, found {type(ref).__name__}")
    st = layout.storages[ref.storage.key]
    loc = TensorLocation(name=name, data_start=st.data_start, storage_nbytes=st.nbytes, dtype=ref.dtype,
                         size=ref.size, stride=ref.stride, storage_offset=ref.storage_offset, crc32=st.crc32,
                         where=layout.where)
    loc.check()
    return loc


def materialize(layout: ArchiveLayout, win: ByteWindow) -> Any:
    """The archive's object with every tensor built from the bytes in ``win`` (copied)."""
    def build(ref: TensorRef) -> torch.Tensor:
        st = layout.storages[ref.storage.key]
        data = win.get(st.data_start, st.data_start + st.nbytes)
        loc = tensor_location(layout, "", ref)
        if st.nbytes % loc.itemsize:
            raise CheckpointFormatError(f"{layout.where}: storage of {st.nbytes} bytes is not whole {ref.dtype} elements")
        flat = tensor_over(data, ref.dtype)
        t = flat.as_strided(ref.size, ref.stride, ref.storage_offset).clone()
        if ref.is_parameter:
            return torch.nn.Parameter(t, requires_grad=ref.requires_grad)
        return t.requires_grad_(ref.requires_grad) if ref.requires_grad and t.is_floating_point() else t

    def walk(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return build(obj)
        if isinstance(obj, dict):
            out = type(obj)() if type(obj) in (dict,) or hasattr(type(obj), "fromkeys") else {}
            for k, v in obj.items():
                out[k] = walk(v)
            return out
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields") and type(obj) is tuple:
            return tuple(walk(v) for v in obj)
        return obj

    return walk(layout.obj)


def storage_ref_dtype(ref: StorageRef) -> torch.dtype:  # pragma: no cover - tiny helper for formats
    return ref.dtype
