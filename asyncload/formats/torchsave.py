"""torch.save archives (a zip of ``data.pkl`` + one entry per storage), parsed without
``torch.load``: the directory with bounds checks, the pickle with the allow-list, each
storage located by its local header. Used for every record of a DCP ``.distcp`` file
(each is one torch.save archive) and for plain ``torch.save`` files.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import enum
import functools
import io
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asyncload._errors import CheckpointFormatError
from asyncload.decoding.allowlist import TensorRef, record_globals, safe_loads, storage_persistent_load
from asyncload.engine.assembly import tensor_over
from asyncload.engine.chunks import TensorLocation
from asyncload.formats.base import Fetcher, FormatEntry, FormatMetadata, KnownTensor, check_weight_map
from asyncload.formats.zip import (
    EOCD_SEARCH,
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
    "nest_saved",
    "parse_archive",
    "tensor_location",
]

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
) -> ArchiveLayout:
    """Parse the archive at file bytes ``[start, start + size)``; raises NeedBytes for missing
    bytes inside the archive, CheckpointFormatError for anything that points outside it or
    does not hold together (never an exception from ``struct`` or ``zipfile``).
    ``safe_globals``: the globals the user trusts in its pickle (``LoadOptions.safe_globals``).
    ``decode(data.pkl, where)``: another allow-list decoder (torch-checkpointing's DTensors).
    """
    if decode is None:
        decode = functools.partial(_record_object, safe_globals=safe_globals)
    try:
        return _parse_archive(win, start, size, where, max_pickle, decode)
    except NeedBytes as need:
        if need.start < start or need.end > start + size or need.end < need.start:
            raise CheckpointFormatError(
                f"{where}: the archive points at bytes [{need.start - start}, {need.end - start}) of a "
                f"{size}-byte record: the record is damaged or its length in the metadata is wrong"
            ) from None
        raise


def _parse_archive(
    win: ByteWindow, start: int, size: int, where: str, max_pickle: int, decode: Callable[[memoryview, str], Any]
) -> ArchiveLayout:
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
    if bo is not None:
        if bo.size > 16:
            raise CheckpointFormatError(f"{where}: byteorder entry of {bo.size} bytes")
        ds = _data_start(win, start, bo.header_offset, bo.name, where)
        order = bytes(win.get(start + ds, start + ds + bo.size))
        if order not in (b"little",):
            raise CheckpointFormatError(f"{where}: byte order {order!r} is not supported (only little-endian)")
    ds = _data_start(win, start, pkl.header_offset, pkl.name, where)
    if pkl.method != 0:
        raise CheckpointFormatError(f"{where}: data.pkl is compressed; torch.save never compresses")
    obj = decode(win.get(start + ds, start + ds + pkl.size), where)
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
            raise CheckpointFormatError(
                f"{where}: storage data/{key} holds {entry.size} bytes, data.pkl says {ref.storage.nbytes}"
            )
        dstart = _data_start(win, start, entry.header_offset, entry.name, where)
        if dstart + entry.size > size:
            raise CheckpointFormatError(f"{where}: storage data/{key} runs past the end of the archive")
        storages[key] = StorageLoc(key, start + dstart, entry.size, entry.crc32)
    return ArchiveLayout(obj, storages, where)


#: Decoded ``data.pkl`` of single-tensor records, by their bytes. The records of one DCP
#: file differ mostly in their data: a model's layers repeat a few shapes, so most of
#: its records' pickles are byte for byte one of a few (a 67-record checkpoint has 6).
#: Only a :class:`TensorRef` (frozen, all of it immutable) is kept, and only the decode
#: is skipped: every record's directory, entries and sizes are still checked.
_TENSOR_PICKLES: dict[tuple[bytes, tuple[Any, ...]], TensorRef] = {}
_TENSOR_PICKLES_MAX = 4096
_TENSOR_PICKLE_MAX_BYTES = 4096


def _record_object(pickle_bytes: memoryview, where: str, safe_globals: tuple[Any, ...] = ()) -> Any:
    """A record's ``data.pkl``, decoded with the allow-list (or its earlier decode under the
    same ``safe_globals``)."""
    key = (bytes(pickle_bytes), safe_globals) if len(pickle_bytes) <= _TENSOR_PICKLE_MAX_BYTES else None
    if key is not None:
        hit = _TENSOR_PICKLES.get(key)
        if hit is not None:
            return hit
    obj = safe_loads(
        pickle_bytes,
        what=f"{where} (data.pkl)",
        allowed=record_globals(),
        persistent_load=storage_persistent_load,
        safe_globals=safe_globals,
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
            f"{where}: the local header of {name[:200]!r} at {header_offset} does not match the central directory"
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
) -> ArchiveLayout:
    """:func:`parse_archive`, fetching missing bytes with ``fetch(start, end)``: at most 16
    rounds and ``max_pickle`` + 1 MiB in all (a damaged directory cannot make it read a
    whole multi-gigabyte record into memory)."""
    fetched = 0
    limit = max_pickle + (1 << 20)
    for _ in range(16):
        try:
            return parse_archive(win, start, size, where, max_pickle=max_pickle, safe_globals=safe_globals)
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


def tensor_location(layout: ArchiveLayout, name: str, ref: TensorRef | None = None) -> TensorLocation:
    """The location of the archive's tensor (``ref``, or the archive's whole object)."""
    ref = layout.obj if ref is None else ref
    if not isinstance(ref, TensorRef):
        raise CheckpointFormatError(f"{layout.where}: expected a tensor record, found {type(ref).__name__}")
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
                raw.copy_(tensor_over(win.get(st.data_start, st.data_start + st.nbytes), torch.uint8))
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
            return t.requires_grad_(ref.requires_grad) if ref.requires_grad and t.is_floating_point() else t
        except RuntimeError as exc:  # the rebuild functions check requires_grad; belt and braces
            raise CheckpointFormatError(f"{layout.where}: tensor cannot be built ({exc})"[:400]) from None

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


# --- torch.save checkpoints: synthesised DCP metadata, decoded objects ----------------------


#: Extra-field bytes guessed for the local headers of data.pkl and byteorder, read together
#: with their data (torch pads entries to 64-byte alignment; a wrong guess costs one more read).
_LOCAL_EXTRA_GUESS = 128


#: Layout reads of a torch.save file are joined across gaps up to this (and ``min_chunk_size``):
#: a gap is a storage's data, read again later, so only small ones are worth reading through.
_LAYOUT_MAX_GAP = 64 << 10


@dataclass(frozen=True)
class KnownObject(FormatEntry):
    """A non-tensor value decoded (allow-listed) from a torch.save pickle. Tensors inside it
    (a tuple holding tensors, say) are :class:`TensorRef` and are read by :func:`amaterialize`."""

    obj: Any
    relative_path: str
    storages: dict[str, StorageLoc] = field(default_factory=dict)
    where: str = ""
    offset: int = 0
    length: int = 0

    holds_object: ClassVar[bool] = True

    @classmethod
    async def resolve(cls, entries: Sequence[Any], fetcher: Fetcher) -> list[Any]:
        return list(await asyncio.gather(*(amaterialize(e, fetcher.read) for e in entries)))


async def _atorchsave_files(
    fetcher: Fetcher, files: Sequence[tuple[str, int]], weight_map: dict[str, str] | None, source: str
) -> FormatMetadata:
    layouts = await asyncio.gather(*(_alayout(fetcher, name, size) for name, size in files))
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    origin: dict[str, str] = {}
    paths: dict[str, tuple[Any, ...]] = {}  # flattened key -> its path in the saved dict, as DCP's planner_data
    for (name, _), layout in zip(files, layouts):
        if not isinstance(layout.obj, dict):
            raise CheckpointFormatError(
                f"{layout.where} holds a {type(layout.obj).__name__}, not a dict; asyncload loads state dicts "
                "(a dict of tensors, possibly nested) from torch.save files"
            )
        for key, (path, value) in _flatten(layout.obj).items():
            if weight_map is not None and weight_map.get(key) != name:
                continue
            paths[key] = path
            if key in origin:
                raise CheckpointFormatError(f"{source}: key {key!r} is in both {origin[key]} and {name}")
            origin[key] = name
            sdm[key], index, entry = saved_entry(key, value, layout, name)
            storage[index] = entry
    check_weight_map(weight_map, sdm, source)
    return FormatMetadata(
        state_dict_metadata=sdm,
        planner_data=paths,
        storage_data=storage,
        storage_meta=StorageMeta(),
        format="torch.save",
        source=source,
        templates=list(layouts),
    )


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (TensorRef, torch.Tensor))


def _is_terminal(value: Any) -> bool:
    """A leaf of DCP's flattening (``torch.distributed.checkpoint._traverse``): anything but a
    mapping, and a list that holds no tensor, mapping or non-terminal list."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if _is_tensor(entry):
            return False
    return True


def _traverse(obj: Mapping[Any, Any], visit: Callable[[tuple[Any, ...], Any], None]) -> None:
    """``visit(path, leaf)`` for each leaf of ``obj`` as DCP's ``traverse_state_dict`` visits a
    state dict (TensorRefs count as tensors): mappings by ``str(key)``, lists holding tensors or
    mappings by index, everything else (tuples included) a leaf."""

    def walk(path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk((*path, str(k)), v)
        elif _is_terminal(value):
            visit(path, value)
        else:
            for i, v in enumerate(value):
                walk((*path, i), v)

    try:
        for key, value in obj.items():
            walk((str(key),), value)
    except RecursionError as exc:
        raise CheckpointFormatError("the torch.save dict is nested too deeply") from exc


def _flat_key(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def saved_entry(
    key: str, value: Any, layout: ArchiveLayout, name: str, refs: list[TensorRef] | None = None
) -> tuple[Any, MetadataIndex, Any]:
    """The stand-in DCP metadata of one flattened value of the torch.save file ``name``:
    ``(its storage metadata, its index, its storage entry)``. A tensor is one whole chunk read
    in place; anything else is an object, with the storages its tensors need (``refs``: those
    tensors, found by the caller's own walk; by default every :class:`TensorRef` in it)."""
    if isinstance(value, TensorRef):
        loc = dataclasses.replace(
            tensor_location(layout, name, value),
            where=f"tensor {key!r} (storage data/{value.storage.key}) of {layout.where}",
        )
        zeros = (0,) * len(loc.size)
        md = TensorStorageMetadata(
            properties=TensorProperties(dtype=loc.dtype, requires_grad=value.requires_grad),
            size=torch.Size(loc.size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(loc.size))],
        )
        return md, MetadataIndex(key, zeros, 0), KnownTensor(loc)
    if refs is None:
        refs = []
        _walk_refs(value, refs)
    sts = {r.storage.key: layout.storages[r.storage.key] for r in refs}
    entry = KnownObject(value, name, sts, f"object {key!r} of {layout.where}")
    return BytesStorageMetadata(), MetadataIndex(key), entry


def _flatten(obj: Mapping[Any, Any]) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """Flatten like DCP flattens a destination state dict (TensorRefs count as tensors):
    each key's path in ``obj`` and its value."""
    flat: dict[str, tuple[tuple[Any, ...], Any]] = {}

    def visit(path: tuple[Any, ...], value: Any) -> None:
        key = _flat_key(path)
        if key in flat:
            raise CheckpointFormatError(f"two entries of the torch.save dict flatten to the same key {key!r}")
        flat[key] = (path, value)

    _traverse(obj, visit)
    return flat


# --- the loaded state dict, rebuilt as torch.load gives it -------------------------------


def nest_saved(flat: Mapping[str, Any], templates: Sequence[ArchiveLayout]) -> dict[Any, Any]:
    """The loaded values (``flat``: flattened name -> tensor or object) put back into the
    structure each file's pickle holds: the keys as saved (ints stay ints, tuples tuples), in
    the saved order, the containers' types (``OrderedDict`` with its ``_metadata``, tuples,
    lists), tensors that shared a storage in the file sharing one again (as ``torch.load``
    builds them, with their saved strides, where the loaded tensors have the saved dtype).

    Entries not in ``flat`` (not selected) are left out, and containers left with nothing;
    when ``flat`` holds every entry of the files, empty containers are kept as saved: the
    result then equals ``torch.load`` of the file. Several files (an indexed checkpoint)
    are merged in file order."""
    out: dict[Any, Any] | None = None
    for layout in templates:
        if not isinstance(layout.obj, Mapping):
            continue
        saved = _flatten(layout.obj)
        leaves = {k: v for k, (_, v) in saved.items() if isinstance(v, TensorRef)}
        everything = all(k in flat for k in saved)
        tensors = _shared_tensors(
            [(k, ref, flat[k]) for k, ref in leaves.items() if isinstance(flat.get(k), torch.Tensor)], layout
        )
        built, _ = _rebuild(layout.obj, (), flat, tensors, everything)
        if out is None:
            out = built if built is not None else {}
        elif built is not None:
            _merge(out, built)
    return {} if out is None else out


_DROP: Any = object()


def _rebuild(
    node: Any, path: tuple[Any, ...], flat: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], everything: bool
) -> tuple[Any, bool]:
    """``(value, kept)`` of ``node`` at ``path``, mirroring :func:`_traverse`."""
    if isinstance(node, Mapping):
        items = []
        for k, v in node.items():
            value, kept = _rebuild(v, (*path, str(k)), flat, tensors, everything)
            if kept:
                items.append((k, value))
        if not items and not (everything and not node):
            return None, False
        return _mapping_like(node, items), True
    if path and not _is_terminal(node):
        values = []
        for i, v in enumerate(node):
            value, kept = _rebuild(v, (*path, i), flat, tensors, everything)
            values.append(value if kept else _DROP)
        while values and values[-1] is _DROP:
            values.pop()
        if not values:
            return None, False
        return [None if v is _DROP else v for v in values], True  # a dropped entry: None, as DCP pads
    key = _flat_key(path)
    if key in tensors:
        return tensors[key], True
    if key in flat:
        return flat[key], True
    return None, False


def _mapping_like(node: Mapping[Any, Any], items: list[tuple[Any, Any]]) -> Any:
    """A mapping of ``node``'s type (and attributes: a state dict's ``_metadata``) holding ``items``."""
    if type(node) is dict:
        return dict(items)
    if isinstance(node, dict):  # OrderedDict, or a dict subclass the user trusts
        try:
            new = copy.copy(node)
            new.clear()
        except Exception:  # a subclass that cannot be copied: the items in a plain dict
            return dict(items)
        new.update(items)
        return new
    return dict(items)


def _merge(into: dict[Any, Any], more: Mapping[Any, Any]) -> None:
    for k, v in more.items():
        if k in into and isinstance(into[k], dict) and isinstance(v, Mapping):
            _merge(into[k], v)
        else:
            into[k] = v


def _view_key(ref: TensorRef) -> tuple[Any, ...]:
    return (ref.storage_offset, ref.size, ref.stride, ref.dtype)


def _shared_tensors(
    loaded: list[tuple[str, TensorRef, torch.Tensor]], layout: ArchiveLayout
) -> dict[str, torch.Tensor]:
    """The tensors to return for the loaded ``(key, ref, tensor)`` of one file, as
    ``torch.load`` builds them: entries that are one view of one storage become one tensor
    object; entries that are different views of one storage, or saved with strides other than
    the loaded tensor's, become views of one storage again (copied into it: only these cost
    memory beyond the load, and only where the storage is at most about twice what they hold;
    a small slice of a large storage keeps the loaded, contiguous tensor). ``nn.Parameter`` and
    ``requires_grad`` as saved."""
    groups: dict[str, list[tuple[str, TensorRef, torch.Tensor]]] = {}
    for item in loaded:
        groups.setdefault(item[1].storage.key, []).append(item)
    out: dict[str, torch.Tensor] = {}
    for skey, items in groups.items():
        views = {_view_key(ref) for _, ref, _ in items}
        exact = all(
            t.dtype == ref.dtype and t.device.type != "meta" and tuple(t.shape) == ref.size for _, ref, t in items
        )
        restrided = any(tuple(t.stride()) != ref.stride for _, ref, t in items)
        built: dict[tuple[Any, ...], torch.Tensor] = {}
        st = layout.storages.get(skey)
        held = sum(t.numel() * t.element_size() for t in {id(t): t for _, _, t in items}.values())
        cheap = st is not None and st.nbytes <= 2 * held + (1 << 20)  # not a large storage for a small slice
        if exact and cheap and st is not None and (len(views) > 1 or restrided):
            built = _one_storage(items, st.nbytes)
        for key, ref, t in items:
            vk = _view_key(ref)
            if vk not in built:
                built[vk] = t
            out[key] = built[vk]
        wrapped: dict[int, torch.Tensor] = {}
        for key, ref, _ in items:
            t = out[key]
            if id(t) not in wrapped:
                wrapped[id(t)] = _as_saved(t, ref)
            out[key] = wrapped[id(t)]
    return out


def _one_storage(items: list[tuple[str, TensorRef, torch.Tensor]], nbytes: int) -> dict[tuple[Any, ...], torch.Tensor]:
    """Views of one new storage of ``nbytes`` holding the loaded tensors (``{}`` where a view
    cannot be filled: the loaded tensors are returned as they are)."""
    device = items[0][2].device
    if any(t.device != device for _, _, t in items):
        return {}
    try:
        raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        views: dict[tuple[Any, ...], torch.Tensor] = {}
        for _, ref, t in items:
            vk = _view_key(ref)
            if vk in views:
                continue
            view = raw.view(ref.dtype).as_strided(ref.size, ref.stride, ref.storage_offset)
            dst, src = view, t
            for d, (n, s) in enumerate(zip(ref.size, ref.stride)):
                if s == 0 and n > 1:  # an expanded dimension: one element of it holds the values
                    dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
            with torch.no_grad():
                dst.copy_(src)
            views[vk] = view
        return views
    except RuntimeError:  # overlapping strides, a storage too small: keep the loaded tensors
        return {}


def _as_saved(t: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    if ref.is_parameter:
        return torch.nn.Parameter(t, requires_grad=ref.requires_grad)
    if ref.requires_grad and not t.requires_grad and (t.is_floating_point() or t.is_complex()):
        return t.requires_grad_(True)
    return t


async def _alayout(
    fetcher: Fetcher, name: str, size: int, *, decode: Callable[[memoryview, str], Any] | None = None
) -> ArchiveLayout:
    """Parse a torch.save zip file without reading its tensor data: the directory at its
    tail, the pickle and each entry's local header (fetched concurrently, neighbours joined)."""
    url = fetcher.url(name)
    opts = fetcher.options
    if size < 22:
        raise CheckpointFormatError(f"{url}: {size} bytes is too small to be a torch.save archive")
    win = ByteWindow()
    tail_start = max(0, size - TAIL_PROBE)
    tail = await fetcher.read(name, tail_start, size)
    win.add(tail_start, tail)
    cd_off, cd_size, n = locate_central_directory(tail, size, url)
    if cd_size > opts.max_metadata_size:
        raise CheckpointFormatError(f"{url}: zip directory of {cd_size} bytes exceeds LoadOptions.max_metadata_size")
    if cd_off < tail_start:
        win.add(cd_off, await fetcher.read_view(name, cd_off, min(cd_off + cd_size, size)))
    entries = parse_central_directory(win.get(cd_off, cd_off + cd_size), n, size, url).entries
    pkl = [e for k, e in entries.items() if k.endswith("/data.pkl") or k == "data.pkl"]
    if len(pkl) == 1 and pkl[0].size > opts.max_metadata_size:
        raise CheckpointFormatError(
            f"{url}: data.pkl of {pkl[0].size} bytes exceeds LoadOptions.max_metadata_size={opts.max_metadata_size}"
        )
    # data.pkl and byteorder whole; of each storage only its local header's fixed part and name
    # (the data start follows from the extra field's length, which that part holds)
    ranges: list[tuple[int, int]] = []
    for key, e in entries.items():
        base = key.rsplit("/", 1)[-1]
        whole = key.endswith("data.pkl") or base == "byteorder"
        if not (whole or "/data/" in key or key.startswith("data/")):
            continue
        hi = e.header_offset + LOCAL_HEADER_SIZE + len(key.encode("utf-8"))
        if whole:
            hi += _LOCAL_EXTRA_GUESS + e.size
        ranges.append((e.header_offset, min(size, hi)))
    await _afill(fetcher, name, win, ranges, max_gap=min(opts.chunk_policy.min_chunk_size, _LAYOUT_MAX_GAP))
    for _ in range(16):
        try:
            return parse_archive(
                win, 0, size, url, max_pickle=opts.max_metadata_size, safe_globals=opts.safe_globals, decode=decode
            )
        except NeedBytes as need:
            lo, hi = max(0, need.start), min(size, max(need.end, need.start + HEAD_PROBE))
            if hi <= lo:
                raise CheckpointFormatError(f"{url}: needs bytes [{need.start}, {need.end}) outside the file") from None
            win.add(lo, await fetcher.read(name, lo, hi))
    raise CheckpointFormatError(f"{url}: the archive's layout did not resolve after 16 extra reads")


async def _afill(fetcher: Fetcher, name: str, win: ByteWindow, ranges: list[tuple[int, int]], *, max_gap: int) -> None:
    """Fetch ``ranges`` into ``win``: sorted, neighbours within ``max_gap`` joined (up to
    ``chunk_size`` per request), all requests concurrently."""
    opts = fetcher.options
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if (
            merged
            and lo - merged[-1][1] <= max_gap
            and max(hi, merged[-1][1]) - merged[-1][0] <= max(opts.effective_chunk_size, hi - lo)
        ):
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    datas = await asyncio.gather(*(fetcher.read(name, lo, hi) for lo, hi in merged))
    for (lo, _), data in zip(merged, datas):
        win.add(lo, data)


async def amaterialize(entry: KnownObject, fetch: Callable[[str, int, int], Awaitable[bytes]]) -> Any:
    """The object of a :class:`KnownObject`, with the tensors inside it read and built."""
    win = ByteWindow()
    stores = list(entry.storages.values())
    datas = await asyncio.gather(*(fetch(entry.relative_path, s.data_start, s.data_start + s.nbytes) for s in stores))
    for s, d in zip(stores, datas):
        win.add(s.data_start, d)
    return materialize(ArchiveLayout(entry.obj, dict(entry.storages), entry.where), win)


def object_bytes(obj: Any) -> io.BytesIO:
    """``obj`` as torch.save bytes, for planners that decode objects themselves (``load_bytes``)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
