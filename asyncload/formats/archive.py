"""One torch.save archive (a zip of ``data.pkl`` + one entry per storage), parsed without
``torch.load``: the directory with bounds checks, the pickle with the allow-list, each
storage located by its local header (:func:`parse_archive`, :func:`aparse_archive`), a
tensor's bytes located (:func:`tensor_location`) and an object's tensors rebuilt
(:func:`materialize`). Every record of a DCP ``.distcp`` file is such an archive, and so is
a plain ``torch.save`` file (:mod:`asyncload.formats.torchsave`).

Raised: :class:`CheckpointFormatError` for a damaged or truncated archive or pickle;
:class:`UnsafeCheckpointError` for a pickle outside the allow-list.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncload.common.errors import CheckpointFormatError
from asyncload.decoding import (
    TensorRef,
    WorkBudget,
    record_globals,
    safe_loads,
    storage_persistent_load,
)
from asyncload.formats.buffers import tensor_over
from asyncload.formats.entries import (
    TensorLocation,
)
from asyncload.formats.window import HEAD_PROBE, TAIL_PROBE, ByteWindow, NeedBytes
from asyncload.formats.zip import (
    LOCAL_HEADER_SIZE,
    local_data_start,
    locate_central_directory,
    parse_central_directory,
)

__all__ = [
    "HEAD_PROBE",
    "TAIL_PROBE",
    "ArchiveLayout",
    "ByteWindow",
    "NeedBytes",
    "StorageLoc",
    "aparse_archive",
    "materialize",
    "own_head_len",
    "parse_archive",
    "tensor_location",
]


@dataclass(frozen=True)
class StorageLoc:
    key: str
    data_start: int
    nbytes: int
    #: ``None`` where the archive stores no checksums (every entry's CRC-32 field 0).
    crc32: int | None


@dataclass
class ArchiveLayout:
    #: The decoded ``data.pkl``: tensors appear as :class:`TensorRef`.
    obj: Any
    storages: dict[str, StorageLoc]
    where: str


def _has_fields(o: Any) -> bool:
    """An object whose attributes may hold tensors: a dataclass, or an object of a class the
    user trusts (``LoadOptions.safe_globals``: an ``argparse.Namespace`` holding a tensor)."""
    return hasattr(o, "__dict__") and not isinstance(o, (type, enum.Enum, TensorRef, torch.Tensor))


def _walk_refs(obj: Any, out: list[TensorRef]) -> None:
    """Every TensorRef in ``obj`` (iterative; shared and self-referencing objects once)."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, TensorRef):
            out.append(o)
            continue
        if id(o) in seen:
            continue
        if isinstance(o, dict):
            seen.add(id(o))
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            seen.add(id(o))
            stack.extend(o)
        elif _has_fields(o):
            seen.add(id(o))
            stack.extend(vars(o).values())


def parse_archive(
    win: ByteWindow,
    start: int,
    size: int,
    where: str,
    *,
    max_pickle: int = 1 << 30,
    safe_globals: tuple[Any, ...] = (),
    decode: Callable[[memoryview, str], Any] | None = None,
    work: WorkBudget | None = None,
) -> ArchiveLayout:
    """Parse the archive at file bytes ``[start, start + size)``; raises NeedBytes for missing
    bytes inside the archive, CheckpointFormatError for anything that points outside it or
    does not hold together (never an exception from ``struct`` or ``zipfile``).
    ``safe_globals``: the globals the user trusts in its pickle (``LoadOptions.safe_globals``).
    ``decode(data.pkl, where)``: another allow-list decoder (torch-checkpointing's DTensors).
    ``work``: charged a unit per directory entry and tensor reference, and the decode's own
    units (a custom ``decode``: a unit per byte of its pickle).
    """
    if work is None:
        work = WorkBudget()
    if decode is None:
        decode = functools.partial(_record_object, safe_globals=safe_globals, work=work)
    else:
        decode = functools.partial(_counted, decode, work)
    try:
        return _parse_archive(win, start, size, where, max_pickle, decode, work)
    except NeedBytes as need:
        if need.start < start or need.end > start + size or need.end < need.start:
            raise CheckpointFormatError(
                f"{where}: the archive points at bytes [{need.start - start}, {need.end - start}) "
                f"of a "
                f"{size}-byte record: the record is damaged or its length in the metadata is wrong"
            ) from None
        raise


def _counted(
    decode: Callable[[memoryview, str], Any], work: WorkBudget, data: memoryview, where: str
) -> Any:
    work.charge(len(data), where)  # another decoder: a unit per byte of its pickle
    return decode(data, where)


def _parse_archive(
    win: ByteWindow,
    start: int,
    size: int,
    where: str,
    max_pickle: int,
    decode: Callable[[memoryview, str], Any],
    work: WorkBudget,
) -> ArchiveLayout:
    if size < 22:
        raise CheckpointFormatError(
            f"{where}: {size} bytes is too small to be a torch.save archive"
        )
    tail_len = min(size, TAIL_PROBE)
    tail = win.get(start + size - tail_len, start + size)
    cd_off, cd_size, n = locate_central_directory(tail, size, where)
    cd = win.get(start + cd_off, start + cd_off + cd_size)
    entries = parse_central_directory(cd, n, size, where).entries
    work.charge(1 + len(entries), where)  # the entries parsed (a count claimed is not trusted)
    pkl_names = [k for k in entries if k.endswith("/data.pkl") or k == "data.pkl"]
    if len(pkl_names) != 1:
        raise CheckpointFormatError(
            f"{where}: not a torch.save archive (found {len(pkl_names)} data.pkl entries)"
        )
    pkl = entries[pkl_names[0]]
    prefix = pkl.name[: -len("data.pkl")]
    if pkl.size > max_pickle:
        raise CheckpointFormatError(
            f"{where}: data.pkl of {pkl.size} bytes exceeds the {max_pickle} allowed"
        )
    bo = entries.get(prefix + "byteorder")
    if bo is not None:
        if bo.size > 16:
            raise CheckpointFormatError(f"{where}: byteorder entry of {bo.size} bytes")
        ds = _data_start(win, start, bo.header_offset, bo.name, where)
        order = bytes(win.get(start + ds, start + ds + bo.size))
        if order not in (b"little",):
            raise CheckpointFormatError(
                f"{where}: byte order {order!r} is not supported (only little-endian)"
            )
    ds = _data_start(win, start, pkl.header_offset, pkl.name, where)
    if pkl.method != 0:
        raise CheckpointFormatError(
            f"{where}: data.pkl is compressed; torch.save never compresses"
        )
    obj = decode(win.get(start + ds, start + ds + pkl.size), where)
    refs: list[TensorRef] = []
    _walk_refs(obj, refs)
    work.charge(len(refs), where)
    storages: dict[str, StorageLoc] = {}
    # torch.save under torch.serialization.set_crc32_options(False) writes 0 for every
    # entry's CRC-32 (data.pkl, never empty, included): such an archive stores no checksum
    # to check (a real archive's CRCs are all 0 with a chance of 2^-32 per entry)
    has_crcs = any(e.crc32 for e in entries.values())
    for ref in refs:
        key = ref.storage.key
        if key in storages:
            continue
        entry = entries.get(f"{prefix}data/{key}")
        if entry is None:
            raise CheckpointFormatError(
                f"{where}: storage {key!r} named by data.pkl has no data/{key} entry"
            )
        if entry.method != 0:
            raise CheckpointFormatError(f"{where}: storage data/{key} is compressed")
        if entry.size != ref.storage.nbytes:
            raise CheckpointFormatError(
                f"{where}: storage data/{key} holds {entry.size} bytes, data.pkl says "
                f"{ref.storage.nbytes}"
            )
        dstart = _data_start(win, start, entry.header_offset, entry.name, where)
        if dstart + entry.size > size:
            raise CheckpointFormatError(
                f"{where}: storage data/{key} runs past the end of the archive"
            )
        storages[key] = StorageLoc(
            key, start + dstart, entry.size, entry.crc32 if has_crcs else None
        )
    return ArchiveLayout(obj, storages, where)


#: Decoded ``data.pkl`` of single-tensor records, by their bytes. The records of one DCP
#: file differ mostly in their data: a model's layers repeat a few shapes, so most of
#: its records' pickles are byte for byte one of a few (a 67-record checkpoint has 6).
#: Only a :class:`TensorRef` (frozen, all of it immutable) is kept, and only the decode
#: is skipped: every record's directory, entries and sizes are still checked.
_TENSOR_PICKLES: dict[tuple[bytes, tuple[Any, ...]], TensorRef] = {}
_TENSOR_PICKLES_MAX = 4096
_TENSOR_PICKLE_MAX_BYTES = 4096


def _record_object(
    pickle_bytes: memoryview,
    where: str,
    safe_globals: tuple[Any, ...] = (),
    work: WorkBudget | None = None,
) -> Any:
    """A record's ``data.pkl``, decoded with the allow-list (or its earlier decode under the
    same ``safe_globals``: a unit of ``work`` per byte, the bytes compared)."""
    key = (
        (bytes(pickle_bytes), safe_globals)
        if len(pickle_bytes) <= _TENSOR_PICKLE_MAX_BYTES
        else None
    )
    if key is not None:
        hit = _TENSOR_PICKLES.get(key)
        if hit is not None:
            if work is not None:
                work.charge(len(pickle_bytes), where)
            return hit
    obj = safe_loads(
        pickle_bytes,
        what=f"{where} (data.pkl)",
        allowed=record_globals(),
        persistent_load=storage_persistent_load,
        safe_globals=safe_globals,
        work=work,
    )
    if key is not None and type(obj) is TensorRef:
        if len(_TENSOR_PICKLES) >= _TENSOR_PICKLES_MAX:
            _TENSOR_PICKLES.clear()
        _TENSOR_PICKLES[key] = obj
    return obj


def _data_start(win: ByteWindow, start: int, header_offset: int, name: str, where: str) -> int:
    nl = len(name.encode("utf-8"))
    head = win.get(start + header_offset, start + header_offset + LOCAL_HEADER_SIZE + nl)
    ds = local_data_start(head, header_offset, name, where)
    if ds is None:  # the local header's name is longer than the directory's
        raise CheckpointFormatError(
            f"{where}: the local header of {name[:200]!r} at {header_offset} does not match the "
            f"central directory"
        )
    return ds


async def aparse_archive(
    win: ByteWindow,
    start: int,
    size: int,
    where: str,
    fetch: Callable[[int, int], Awaitable[bytes | memoryview]],
    *,
    max_pickle: int = 1 << 30,
    safe_globals: tuple[Any, ...] = (),
    work: WorkBudget | None = None,
) -> ArchiveLayout:
    """:func:`parse_archive`, fetching missing bytes with ``fetch(start, end)``: at most 16
    rounds and ``max_pickle`` + 1 MiB in all (a damaged directory cannot make it read a
    whole multi-gigabyte record into memory)."""
    fetched = 0
    limit = max_pickle + (1 << 20)
    for _ in range(16):
        try:
            return parse_archive(
                win,
                start,
                size,
                where,
                max_pickle=max_pickle,
                safe_globals=safe_globals,
                work=work,
            )
        except NeedBytes as need:
            lo = max(start, need.start)
            hi = min(start + size, max(need.end, need.start + HEAD_PROBE))
            fetched += hi - lo
            if fetched > limit:
                raise CheckpointFormatError(
                    f"{where}: finding the record's tensor needs more than {limit} bytes "
                    "of headers: the record is damaged"
                ) from None
            win.add(lo, await fetch(lo, hi))
    raise CheckpointFormatError(f"{where}: layout did not resolve after 16 reads")


_own_head: list[int | None] = []


def own_head_len() -> int | None:
    """Bytes before the tensor in the archive this process's ``torch.save`` writes for one
    tensor (704 in torch 2.13, whatever the shape and dtype, as ``dcp.save`` writes every
    record), found by parsing one such archive as a record is parsed; ``None`` where it
    cannot be. Computed once per process (about a millisecond). What a remote DCP load
    guesses before any of its records' headers are known (``engine.streamed``)."""
    if not _own_head:
        import io

        buf = io.BytesIO()
        torch.save(torch.zeros(1), buf)
        raw = buf.getvalue()
        win = ByteWindow()
        win.add(0, raw)
        try:
            loc = tensor_location(parse_archive(win, 0, len(raw), "torch.save"), "")
            _own_head.append(loc.data_start)
        except Exception:  # pragma: no cover - torch's own archive
            _own_head.append(None)
    return _own_head[0]


def tensor_location(
    layout: ArchiveLayout, name: str, ref: TensorRef | None = None
) -> TensorLocation:
    """The location of the archive's tensor (``ref``, or the archive's whole object)."""
    ref = layout.obj if ref is None else ref
    if not isinstance(ref, TensorRef):
        raise CheckpointFormatError(
            f"{layout.where}: expected a tensor record, found {type(ref).__name__}"
        )
    st = layout.storages[ref.storage.key]
    loc = TensorLocation(
        name=name,
        data_start=st.data_start,
        storage_nbytes=st.nbytes,
        dtype=ref.dtype,
        size=ref.size,
        stride=ref.stride,
        storage_offset=ref.storage_offset,
        crc32=st.crc32,
        where=layout.where,
    )
    loc.check()
    return loc


def materialize(layout: ArchiveLayout, win: ByteWindow) -> Any:
    """The archive's object with every tensor built from the bytes in ``win``.

    Like ``torch.load``: each storage is copied once, tensors are views of it (so two
    tensors that shared a storage still do, and a stride-0 tensor costs its storage, not
    its apparent size). Lists, dicts and dataclasses are updated in place, tuples and
    sets rebuilt; shared and self-referencing objects are handled once (iteratively, no
    recursion)."""
    refs: list[TensorRef] = []
    _walk_refs(layout.obj, refs)
    if not refs:
        return layout.obj
    storages: dict[str, torch.Tensor] = {}

    def build(ref: TensorRef) -> torch.Tensor:
        st = layout.storages[ref.storage.key]
        loc = tensor_location(layout, "", ref)  # checks that every element lies in the storage
        if st.nbytes % loc.itemsize:
            raise CheckpointFormatError(
                f"{layout.where}: storage of {st.nbytes} bytes is not whole {ref.dtype} elements"
            )
        raw = storages.get(st.key)
        if raw is None:
            raw = torch.empty(st.nbytes, dtype=torch.uint8)
            if st.nbytes:
                raw.copy_(
                    tensor_over(win.get(st.data_start, st.data_start + st.nbytes), torch.uint8)
                )
            storages[st.key] = raw
        try:
            t = raw.view(ref.dtype).as_strided(ref.size, ref.stride, ref.storage_offset)
        except RuntimeError as exc:
            raise CheckpointFormatError(
                f"{layout.where}: tensor of size {list(ref.size)} cannot be built ({exc})"[:400]
            ) from None
        try:
            if ref.is_parameter:
                return torch.nn.Parameter(t, requires_grad=ref.requires_grad)
            return (
                t.requires_grad_(ref.requires_grad)
                if ref.requires_grad and t.is_floating_point()
                else t
            )
        except RuntimeError as exc:  # the rebuild functions check requires_grad; belt and braces
            raise CheckpointFormatError(
                f"{layout.where}: tensor cannot be built ({exc})"[:400]
            ) from None

    done: dict[int, Any] = {}  # id(original) -> replacement
    keep: list[Any] = []  # keeps originals alive while their ids are keys
    stack: list[tuple[Any, bool]] = [(layout.obj, False)]
    while stack:
        o, children_done = stack.pop()
        oid = id(o)
        if not children_done:
            if oid in done:
                continue
            if isinstance(o, TensorRef):
                done[oid] = build(o)
                keep.append(o)
                continue
            if isinstance(o, dict):
                kids: Any = o.values()
            elif isinstance(o, (list, tuple, set, frozenset)):
                kids = o
            elif _has_fields(o):
                kids = vars(o).values()
            else:
                continue
            done[oid] = o  # placeholder: a cycle back to ``o`` sees ``o`` itself
            keep.append(o)
            stack.append((o, True))
            stack.extend((k, False) for k in kids if id(k) not in done)
            continue
        new = _rebuilt(o, done)
        done[oid] = new
    return done.get(id(layout.obj), layout.obj)


def _rebuilt(o: Any, done: dict[int, Any]) -> Any:
    def sub(v: Any) -> Any:
        return done.get(id(v), v)

    if isinstance(o, list):
        for i, v in enumerate(o):
            o[i] = sub(v)
        return o
    if isinstance(o, dict):
        for k, v in o.items():
            o[k] = sub(v)
        return o
    if _has_fields(o):  # only what changed: the object may be one the user's class shares
        d = vars(o)
        for k, v in list(d.items()):
            new = sub(v)
            if new is not v:
                d[k] = new
        return o
    if type(o) is tuple:
        return tuple(sub(v) for v in o)
    if isinstance(o, (set, frozenset)):
        return type(o)(sub(v) for v in o)
    return o  # a tuple subclass (torch.Size...) holds no tensors
