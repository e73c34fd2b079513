"""Plain ``torch.save`` files as a checkpoint format: a synthesised DCP ``Metadata`` of
their tensors (:class:`~asyncload.formats.entries.KnownTensor`) and objects
(:class:`KnownObject`), the flattened keys and the saved nesting given back
(:func:`nest_saved`: int and tuple keys, ``OrderedDict``, tied storages). Each file is one
torch.save archive, parsed by :mod:`asyncload.formats.archive` (whose names are also
importable from here).

Raised: :class:`CheckpointFormatError` for a damaged file or one that does not hold a dict.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import asyncload.formats.plain as plain
from asyncload.common.errors import CheckpointFormatError
from asyncload.decoding import TensorRef
from asyncload.formats.archive import (
    HEAD_PROBE,
    TAIL_PROBE,
    ArchiveLayout,
    ByteWindow,
    NeedBytes,
    StorageLoc,
    _walk_refs,
    aparse_archive,
    materialize,
    parse_archive,
    tensor_location,
)
from asyncload.formats.entries import (
    Fetcher,
    FormatEntry,
    KnownTensor,
    check_weight_map,
)
from asyncload.formats.zip import (
    LOCAL_HEADER_SIZE,
    locate_central_directory,
    parse_central_directory,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from asyncload.formats.dcp_format import FormatMetadata

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
    fetcher: Fetcher,
    files: Sequence[tuple[str, int]],
    weight_map: dict[str, str] | None,
    source: str,
) -> FormatMetadata:
    layouts = await asyncio.gather(*(_alayout(fetcher, name, size) for name, size in files))
    k = plain.kinds()  # DCP's types, or asyncload.formats.plain's while DCP is not imported
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    origin: dict[str, str] = {}
    paths: dict[
        str, tuple[Any, ...]
    ] = {}  # flattened key -> its path in the saved dict, as DCP's planner_data
    for (name, _), layout in zip(files, layouts):
        if not isinstance(layout.obj, dict):
            raise CheckpointFormatError(
                f"{layout.where} holds a {type(layout.obj).__name__}, not a dict; asyncload loads "
                f"state dicts "
                "(a dict of tensors, possibly nested) from torch.save files"
            )
        for key, (path, value) in _flatten(layout.obj, layout.where).items():
            if weight_map is not None and weight_map.get(key) != name:
                continue
            paths[key] = path
            if key in origin:
                raise CheckpointFormatError(
                    f"{source}: key {key!r} is in both {origin[key]} and {name}"
                )
            origin[key] = name
            sdm[key], index, entry = saved_entry(key, value, layout, name, kinds=k)
            storage[index] = entry
    check_weight_map(weight_map, sdm, source)
    return k.FormatMetadata(
        state_dict_metadata=sdm,
        planner_data=paths,
        storage_data=storage,
        storage_meta=k.StorageMeta(),
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
    key: str,
    value: Any,
    layout: ArchiveLayout,
    name: str,
    refs: list[TensorRef] | None = None,
    *,
    kinds: Any = None,
) -> tuple[Any, MetadataIndex, Any]:
    """The stand-in DCP metadata of one flattened value of the torch.save file ``name``:
    ``(its storage metadata, its index, its storage entry)``. A tensor is one whole chunk read
    in place; anything else is an object, with the storages its tensors need (``refs``: those
    tensors, found by the caller's own walk; by default every :class:`TensorRef` in it).
    ``kinds``: the metadata classes (default :func:`asyncload.formats.plain.kinds`)."""
    k = kinds if kinds is not None else plain.kinds()
    if isinstance(value, TensorRef):
        loc = dataclasses.replace(
            tensor_location(layout, name, value),
            where=f"tensor {key!r} (storage data/{value.storage.key}) of {layout.where}",
        )
        zeros = (0,) * len(loc.size)
        md = k.TensorStorageMetadata(
            properties=k.TensorProperties(dtype=loc.dtype, requires_grad=value.requires_grad),
            size=torch.Size(loc.size),
            chunks=[k.ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(loc.size))],
        )
        return md, k.MetadataIndex(key, zeros, 0), KnownTensor(loc)
    if refs is None:
        refs = []
        _walk_refs(value, refs)
    sts = {r.storage.key: layout.storages[r.storage.key] for r in refs}
    entry = KnownObject(value, name, sts, f"object {key!r} of {layout.where}")
    return k.BytesStorageMetadata(), k.MetadataIndex(key), entry


def _flatten(obj: Mapping[Any, Any], where: str = "") -> dict[str, tuple[tuple[Any, ...], Any]]:
    """Flatten like DCP flattens a destination state dict (TensorRefs count as tensors):
    each key's path in ``obj`` and its value. ``where``: the file, for messages."""
    flat: dict[str, tuple[tuple[Any, ...], Any]] = {}

    def visit(path: tuple[Any, ...], value: Any) -> None:
        key = _flat_key(path)
        if key in flat:
            first = _saved_path(obj, flat[key][0])
            second = _saved_path(obj, path, last=True)
            raise CheckpointFormatError(
                f"{where or 'a torch.save file'}: two entries of its dict, {first} and {second}, "
                f"flatten to the same key {key!r} (keys are joined with '.', as DCP flattens a "
                "state dict): asyncload cannot tell them apart; read the file with "
                "torch.load(weights_only=True), or save it with keys that do not collide"
            )
        flat[key] = (path, value)

    _traverse(obj, visit)
    return flat


def _saved_path(obj: Any, path: tuple[Any, ...], last: bool = False) -> str:
    """``path`` (str keys for dicts, ints for lists) as Python indexing of the saved object,
    with the keys as saved (``['state'][0]['exp_avg']``, ``['a.b']``); where two keys of a
    dict print alike (``0`` and ``'0'``), the first of them, or the last with ``last``."""
    node, out = obj, []
    for comp in path:
        if isinstance(node, Mapping):
            hits = [(k, v) for k, v in node.items() if str(k) == str(comp)]
            if not hits:
                out.append(f"[{comp!r}]")
                node = None
                continue
            hit = hits[-1] if last else hits[0]
            out.append(f"[{hit[0]!r}]")
            node = hit[1]
        elif isinstance(node, list) and isinstance(comp, int) and comp < len(node):
            out.append(f"[{comp}]")
            node = node[comp]
        else:
            out.append(f"[{comp!r}]")
            node = None
    return "".join(out)


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
        saved = _flatten(layout.obj, layout.where)
        leaves = {k: v for k, (_, v) in saved.items() if isinstance(v, TensorRef)}
        everything = all(k in flat for k in saved)
        tensors = _shared_tensors(
            [
                (k, ref, flat[k])
                for k, ref in leaves.items()
                if isinstance(flat.get(k), torch.Tensor)
            ],
            layout,
        )
        built, _ = _rebuild(layout.obj, (), flat, tensors, everything)
        if out is None:
            out = built if built is not None else {}
        elif built is not None:
            _merge(out, built)
    return {} if out is None else out


_DROP: Any = object()


def _rebuild(
    node: Any,
    path: tuple[Any, ...],
    flat: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    everything: bool,
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
        return [
            None if v is _DROP else v for v in values
        ], True  # a dropped entry: None, as DCP pads
    key = _flat_key(path)
    if key in tensors:
        return tensors[key], True
    if key in flat:
        return flat[key], True
    return None, False


def _mapping_like(node: Mapping[Any, Any], items: list[tuple[Any, Any]]) -> Any:
    """A mapping of ``node``'s type (and attributes: a state dict's ``_metadata``) holding
    ``items``."""
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
            t.dtype == ref.dtype and t.device.type != "meta" and tuple(t.shape) == ref.size
            for _, ref, t in items
        )
        restrided = any(tuple(t.stride()) != ref.stride for _, ref, t in items)
        built: dict[tuple[Any, ...], torch.Tensor] = {}
        st = layout.storages.get(skey)
        held = sum(t.numel() * t.element_size() for t in {id(t): t for _, _, t in items}.values())
        cheap = st is not None and st.nbytes <= 2 * held + (
            1 << 20
        )  # not a large storage for a small slice
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


def _one_storage(
    items: list[tuple[str, TensorRef, torch.Tensor]], nbytes: int
) -> dict[tuple[Any, ...], torch.Tensor]:
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
    fetcher: Fetcher,
    name: str,
    size: int,
    *,
    decode: Callable[[memoryview, str], Any] | None = None,
) -> ArchiveLayout:
    """Parse a torch.save zip file without reading its tensor data: the directory at its
    tail, the pickle and each entry's local header (fetched concurrently, neighbours joined)."""
    url = fetcher.url(name)
    checks, chunking = fetcher.checks, fetcher.chunking
    if size < 22:
        raise CheckpointFormatError(f"{url}: {size} bytes is too small to be a torch.save archive")
    win = ByteWindow()
    tail_start = max(0, size - TAIL_PROBE)
    tail = await fetcher.read(name, tail_start, size)
    win.add(tail_start, tail)
    cd_off, cd_size, n = locate_central_directory(tail, size, url)
    if cd_size > checks.max_metadata_size:
        raise CheckpointFormatError(
            f"{url}: zip directory of {cd_size} bytes exceeds LoadOptions.max_metadata_size"
        )
    if cd_off < tail_start:
        win.add(cd_off, await fetcher.read_view(name, cd_off, min(cd_off + cd_size, size)))
    entries = parse_central_directory(win.get(cd_off, cd_off + cd_size), n, size, url).entries
    pkl = [e for k, e in entries.items() if k.endswith("/data.pkl") or k == "data.pkl"]
    if len(pkl) == 1 and pkl[0].size > checks.max_metadata_size:
        raise CheckpointFormatError(
            f"{url}: data.pkl of {pkl[0].size} bytes exceeds "
            f"LoadOptions.max_metadata_size={checks.max_metadata_size}"
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
    await _afill(fetcher, name, win, ranges, max_gap=min(chunking.min_chunk_size, _LAYOUT_MAX_GAP))
    for _ in range(16):
        try:
            return parse_archive(
                win,
                0,
                size,
                url,
                max_pickle=checks.max_metadata_size,
                safe_globals=checks.safe_globals,
                decode=decode,
            )
        except NeedBytes as need:
            lo, hi = max(0, need.start), min(size, max(need.end, need.start + HEAD_PROBE))
            if hi <= lo:
                raise CheckpointFormatError(
                    f"{url}: needs bytes [{need.start}, {need.end}) outside the file"
                ) from None
            win.add(lo, await fetcher.read(name, lo, hi))
    raise CheckpointFormatError(
        f"{url}: the archive's layout did not resolve after 16 extra reads"
    )


async def _afill(
    fetcher: Fetcher, name: str, win: ByteWindow, ranges: list[tuple[int, int]], *, max_gap: int
) -> None:
    """Fetch ``ranges`` into ``win``: sorted, neighbours within ``max_gap`` joined (up to
    ``chunk_size`` per request), all requests concurrently."""
    chunking = fetcher.chunking
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if (
            merged
            and lo - merged[-1][1] <= max_gap
            and max(hi, merged[-1][1]) - merged[-1][0] <= max(chunking.chunk_size, hi - lo)
        ):
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    datas = await asyncio.gather(*(fetcher.read(name, lo, hi) for lo, hi in merged))
    for (lo, _), data in zip(merged, datas):
        win.add(lo, data)


async def amaterialize(
    entry: KnownObject, fetch: Callable[[str, int, int], Awaitable[bytes]]
) -> Any:
    """The object of a :class:`KnownObject`, with the tensors inside it read and built."""
    win = ByteWindow()
    stores = list(entry.storages.values())
    datas = await asyncio.gather(
        *(fetch(entry.relative_path, s.data_start, s.data_start + s.nbytes) for s in stores)
    )
    for s, d in zip(stores, datas):
        win.add(s.data_start, d)
    return materialize(ArchiveLayout(entry.obj, dict(entry.storages), entry.where), win)


def object_bytes(obj: Any) -> io.BytesIO:
    """``obj`` as torch.save bytes, for planners that decode objects themselves (``load_bytes``)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
