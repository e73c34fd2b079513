"""torch-checkpointing checkpoints ("DCPv2", ``torch_checkpointing.CheckpointManager``, the
checkpointer torchtitan 0.3.0 depends on), read without ``pickle`` or ``torch.load``.

What such a checkpoint directory holds:

- ``<item>_<rank>.pt``: one ``torch.save`` archive per top-level item (``"model"``,
  ``"optimizer"``, ``"step"`` ...) per rank, holding that rank's value of the item: a (nested)
  state dict, or a scalar. Ranks of a multi-rank save pickle their ``DTensor`` values whole:
  the local shard, the device mesh and the placements.
- ``metadata.pkl``, when an item declared a resharder: a plain pickle of dicts, lists,
  tuples, strings and ints (``DistributedMetadata.to_dict()``), giving the world size, the
  file of each (item, rank) and the sharding (global shape, mesh, placements) of each tensor.

Everything is decoded by asyncload's allow-list VM: ``metadata.pkl`` with no global name
allowed at all, the archives' ``data.pkl`` with the torch.save allow-list plus the names a
pickled ``DTensor`` uses, each mapped to a *record* (:class:`DTensorRef` and the small data
holders below) instead of the real class: no ``DeviceMesh``, process group or placement of
the checkpoint is constructed and none of their code runs. The mesh shape, the saving rank's
coordinate in it and the placements are used only to compute which global slice each saved
local shard holds (torch's own pure ``_compute_local_shape_and_global_offset``, given
placement objects built here from checked integers). The result is a synthesised DCP
``Metadata`` (:class:`~asyncload.formats.entries.FormatMetadata`): one chunk per saved shard,
checked to tile each tensor exactly (no overlap, no gap), so that every destination layout
(plain tensors, DTensors split differently) is planned by DCP and reads only its bytes.

Keys are the items' paths flattened as DCP flattens a state dict (``model.layers.0.w``,
``optimizer.state.0.exp_avg``, ``step``), taken from every rank's file (a pipeline stage's rank
holds its own layers). DTensor values are assembled from the shards of every rank that holds
them; any other value (a plain tensor, an int, an object) is read from the first rank whose
file holds it (rank 0 for a key every rank saved), which is what torch-checkpointing's resharder
assumes too (it treats plain tensors as replicated).

Refused, each with a :class:`~asyncload.CheckpointFormatError` naming the file and the part:
a ``Partial`` placement (a pending reduction, not a slice), sharding metadata other than
``DTensorShardingMetadata`` (``default_tensor_v1`` of custom ``CheckpointableTensor`` s),
items saved as JSON, raw bytes or safetensors, ``metadata.pkl`` of a version other than 2.0,
and a DTensor inside a tuple, set or other object (it has no key of its own).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

import asyncload.formats.plain as plain
from asyncload.common.errors import CheckpointFormatError, CheckpointNotFoundError
from asyncload.common.paths import check_relative_path, short_repr
from asyncload.decoding import TensorRef, _check_coverage, _is_int, safe_loads
from asyncload.formats.dcpv2_names import ITEM_FILE as _ITEM_FILE
from asyncload.formats.dcpv2_names import (
    METADATA_FILE,
    is_torch_checkpointing,
    item_file_hint,
)
from asyncload.formats.dtensor_records import (
    _MAX_MESH,
    DTensorRef,
    _int_tuple,
    _placements,
    _Record,
    _ReplicateRecord,
    _ShardRecord,
    _StridedShardRecord,
    decode_record,
)
from asyncload.formats.entries import Fetcher, KnownTensor
from asyncload.formats.torchsave import ArchiveLayout, _alayout, saved_entry, tensor_location

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from asyncload.formats.dcp_format import FormatMetadata

__all__ = [
    "METADATA_FILE",
    "DTensorRef",
    "adirectory_metadata",
    "decode_record",
    "is_torch_checkpointing",
    "item_file_hint",
]

#: The metadata versions read (``DistributedMetadata.to_dict`` of torch-checkpointing 0.1).
_VERSIONS = ("2.0",)


# --- metadata.pkl ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sharding:
    """One group of ``metadata.pkl``'s sharding for a path: the ranks that share it."""

    ranks: tuple[int, ...]
    size: tuple[int, ...]
    placements: tuple[tuple[str, int, int], ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        i = self._positions.get(rank)
        if i is None:
            return None
        out = []
        for n in reversed(self.mesh_shape):
            out.append(i % n)
            i //= n
        return tuple(reversed(out))

    @cached_property
    def _positions(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.mesh_ranks)}

    @cached_property
    def rank_set(self) -> frozenset[int]:
        return frozenset(self.ranks)


@dataclass
class _TcMetadata:
    world_size: int
    #: (item, rank) -> the file's path relative to the checkpoint.
    files: dict[tuple[str, int], str]
    #: flattened key -> its sharding groups.
    shardings: dict[str, list[_Sharding]]


def _bad(url: str, msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{url}: {msg}")


def decode_metadata_pkl(raw: bytes | memoryview, url: str, *, max_size: int) -> _TcMetadata:
    """``metadata.pkl`` decoded with no global allowed (it is plain data) and checked field by
    field."""
    d: Any = safe_loads(raw, what=url, allowed={}, max_size=max_size)
    if type(d) is not dict or not {"metadata", "world_size"} <= set(d):
        raise _bad(
            url, "is not torch-checkpointing metadata (a dict with 'metadata' and 'world_size')"
        )
    version = d.get("version")
    if version not in _VERSIONS:
        raise _bad(
            url,
            f"has metadata version {short_repr(version)}; asyncload reads versions "
            f"{list(_VERSIONS)}",
        )
    world = d["world_size"]
    if not _is_int(world) or not 0 < world <= _MAX_MESH:
        raise _bad(url, f"has a malformed world_size {short_repr(world)}")
    items = d["metadata"]
    if type(items) is not dict:
        raise _bad(url, "has a malformed 'metadata' table")
    files: dict[tuple[str, int], str] = {}
    shardings: dict[str, list[_Sharding]] = {}
    for item, md in items.items():
        if type(item) is not str or type(md) is not dict:
            raise _bad(url, f"has a malformed entry for item {short_repr(item)}")
        layouts = md.get("rank_to_layout_info")
        if (
            type(layouts) is not dict
            or len(layouts) != world  # before any table of ``world`` entries is built
            or not all(_is_int(r) and 0 <= r < world for r in layouts)
        ):
            raise _bad(url, f"item {item!r} does not give the file of every rank 0..{world - 1}")
        for rank, layout in layouts.items():
            files[(item, rank)] = _layout_file(layout, item, rank, url)
        paths = md.get("nested_path_to_metadata")
        if type(paths) is not dict:
            raise _bad(url, f"item {item!r} has a malformed nested_path_to_metadata")
        for jpath, groups in paths.items():
            key = _json_key(item, jpath, url)
            if type(groups) is not list or not groups:
                raise _bad(url, f"key {key!r} has malformed sharding groups")
            shardings[key] = [_sharding(g, key, world, url) for g in groups]
    return _TcMetadata(world, files, shardings)


def _layout_file(layout: Any, item: str, rank: int, url: str) -> str:
    if layout is None:
        return f"{item}_{rank}.pt"
    if type(layout) is not dict or type(layout.get("file_path")) is not str:
        raise _bad(url, f"item {item!r} rank {rank} has a malformed layout {short_repr(layout)}")
    fmt = layout.get("serialization_format")
    kind = fmt.get("type") if type(fmt) is dict else None
    if kind != "TorchSerialization":
        raise _bad(
            url,
            f"item {item!r} of rank {rank} is saved with {short_repr(kind)}; asyncload reads only "
            "TorchSerialization items (JSON, raw and safetensors items are not read)",
        )
    return check_relative_path(layout["file_path"], url)


def _json_key(item: str, jpath: Any, url: str) -> str:
    try:
        path = json.loads(jpath) if type(jpath) is str and len(jpath) <= 4096 else None
    except ValueError:
        path = None
    if type(path) is not list or not all(type(p) in (str, int) for p in path):
        raise _bad(url, f"item {item!r} has a malformed nested path {short_repr(jpath)}")
    return ".".join([item, *map(str, path)])


def _sharding(g: Any, key: str, world: int, url: str) -> _Sharding:
    sm: Any = g.get("sharding_metadata") if type(g) is dict else None
    ranks: Any = g.get("ranks") if type(g) is dict else None
    if (
        type(sm) is not dict
        or type(ranks) not in (tuple, list)
        or not all(_is_int(r) for r in ranks)
    ):
        raise _bad(url, f"key {key!r} has a malformed sharding group")
    if any(not 0 <= r < world for r in ranks):
        raise _bad(
            url, f"key {key!r} names ranks {short_repr(ranks)} outside the world of {world}"
        )
    kind = sm.get("type")
    if kind != "DTensorShardingMetadata":
        raise _bad(
            url,
            f"key {key!r} has sharding metadata of type {short_repr(kind)}; asyncload reads only "
            "DTensorShardingMetadata (default_tensor_v1 of custom CheckpointableTensors is not "
            "read)",
        )
    data: Any = sm.get("data")
    mesh: Any = data.get("mesh_spec") if type(data) is dict else None
    if type(data) is not dict or type(mesh) is not dict:
        raise _bad(url, f"key {key!r} has malformed DTensor sharding metadata")
    try:
        size = _int_tuple(data.get("global_shape"), "global_shape")
        mesh_shape = _int_tuple(mesh.get("mesh_shape"), "mesh_shape")
        mesh_ranks = _int_tuple(mesh.get("mesh_data"), "mesh_data")
        placements = _placements(
            [_spec_placement(p, key, url) for p in data.get("placements") or ()]  # as records
        )
    except CheckpointFormatError as exc:
        raise _bad(url, f"key {key!r}: {exc}") from None
    if (
        math.prod(mesh_shape) != len(mesh_ranks)
        or len(mesh_shape) != len(placements)
        or not mesh_shape
    ):
        raise _bad(
            url, f"key {key!r} has a mesh of shape {list(mesh_shape)} with {len(mesh_ranks)} ranks"
        )
    return _Sharding(tuple(ranks), size, placements, mesh_shape, mesh_ranks)


def _spec_placement(p: Any, key: str, url: str) -> _Record:
    kind = p.get("type") if type(p) is dict else None
    cls = {
        "Shard": _ShardRecord,
        "StridedShard": _StridedShardRecord,
        "Replicate": _ReplicateRecord,
    }.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise _bad(url, f"key {key!r} has a placement of unknown type {short_repr(kind)}")
    rec = cls(())
    rec.fields.update({k: v for k, v in p.items() if k in ("dim", "split_factor")})
    return rec


# --- the directory -------------------------------------------------------------------------


def _item_files(names: Sequence[str], url: Callable[[str], str]) -> dict[str, list[str]]:
    """Each item's files by rank, from the directory listing; a gap in the ranks is an
    unfinished (or damaged) save."""
    ranks: dict[str, dict[int, str]] = {}
    for n in names:
        m = _ITEM_FILE.match(n)
        if m:
            ranks.setdefault(m["item"], {})[int(m["rank"])] = n
    out: dict[str, list[str]] = {}
    for item, by_rank in ranks.items():
        world = max(by_rank) + 1
        missing = [r for r in range(world) if r not in by_rank]
        if missing:
            name = f"{item}_{missing[0]}.pt"
            raise CheckpointNotFoundError(
                f"{url(name)} does not exist although rank {world - 1} wrote "
                f"{item}_{world - 1}.pt: the "
                "torch-checkpointing save did not finish or its files were removed",
                path=url(name),
                status=404,
            )
        out[item] = [by_rank[r] for r in range(world)]
    return out


async def adirectory_metadata(
    fetcher: Fetcher, names: Sequence[str], source: str
) -> FormatMetadata:
    """The synthesised metadata of the torch-checkpointing directory ``fetcher`` is opened at
    (``names``: its listing)."""
    checks = fetcher.checks
    meta: _TcMetadata | None = None
    if METADATA_FILE in names:
        size = await fetcher.size(METADATA_FILE)
        url = fetcher.url(METADATA_FILE)
        if size is None:
            raise CheckpointFormatError(
                f"{url} is empty: the torch-checkpointing save did not finish"
            )
        if size > checks.max_metadata_size:
            raise CheckpointFormatError(
                f"{url} is {size} bytes, more than "
                f"LoadOptions.max_metadata_size={checks.max_metadata_size}"
            )
        meta = decode_metadata_pkl(
            await fetcher.read(METADATA_FILE, 0, size), url, max_size=checks.max_metadata_size
        )
    files = _item_files(names, fetcher.url)
    if meta is not None:  # metadata.pkl is authoritative for the items it describes
        for (item, rank), rel in meta.files.items():
            files.setdefault(item, [""] * meta.world_size)
            lst = files[item]
            if len(lst) != meta.world_size:
                lst[:] = (lst + [""] * meta.world_size)[: meta.world_size]
            lst[rank] = rel
    if not files:
        raise CheckpointFormatError(
            f"{source}: a torch-checkpointing directory without item files"
        )
    wanted = sorted({rel for lst in files.values() for rel in lst})
    sizes = await asyncio.gather(*(fetcher.size(rel) for rel in wanted))
    size_of = dict(zip(wanted, sizes))
    for rel, size in size_of.items():
        if size is None:
            named = f"named by {fetcher.url(METADATA_FILE)}" if meta is not None else "expected"
            raise CheckpointNotFoundError(
                f"{fetcher.url(rel)} ({named}) does not exist or is empty: the torch-checkpointing "
                f"save did "
                "not finish or its files were removed",
                path=fetcher.url(rel),
                status=404,
            )
    layouts = dict(
        zip(
            wanted,
            await asyncio.gather(
                *(_afile_layout(fetcher, rel, size_of[rel] or 0) for rel in wanted)
            ),
        )
    )
    return _synthesise(files, layouts, meta, fetcher, source)


async def _afile_layout(fetcher: Fetcher, rel: str, size: int) -> ArchiveLayout:
    return await _alayout(fetcher, rel, size, decode=decode_record)


def _flatten(item: str, value: Any, where: str) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """The item's leaves, keyed as DCP flattens ``{item: value}`` (DTensors are leaves)."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    flat: dict[str, tuple[tuple[Any, ...], Any]] = {}

    def visit(path: tuple[Any, ...], v: Any) -> None:
        key = ".".join(map(str, path))
        if key in flat:
            raise CheckpointFormatError(f"{where}: two entries flatten to the same key {key!r}")
        flat[key] = (tuple(path), v)

    try:
        traverse_state_dict(
            {item: value}, visit, keep_traversing=lambda v: isinstance(v, (TensorRef, DTensorRef))
        )
    except RecursionError as exc:
        raise CheckpointFormatError(f"{where}: nested too deeply") from exc
    return flat


def _synthesise(
    files: dict[str, list[str]],
    layouts: dict[str, ArchiveLayout],
    meta: _TcMetadata | None,
    fetcher: Fetcher,
    source: str,
) -> FormatMetadata:
    k = plain.kinds()  # DCP's types, or asyncload.formats.plain's while DCP is not imported
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for item in sorted(files):
        ranks = files[item]
        per_rank = [_flatten(item, layouts[rel].obj, layouts[rel].where) for rel in ranks]
        # every key of every rank (a pipeline stage's rank holds its own layers), in rank order;
        # a key's DTensor shards come from every rank that holds it, anything else from the first
        holders: dict[str, list[int]] = {}
        for r, flat in enumerate(per_rank):
            for key in flat:
                holders.setdefault(key, []).append(r)
        for key, rs in holders.items():
            first = rs[0]
            path, value = per_rank[first][key]
            rel, layout = ranks[first], layouts[ranks[first]]
            paths[key] = path
            kinds = {type(per_rank[r][key][1]) is DTensorRef for r in rs}
            if len(kinds) > 1:
                other = next(
                    r
                    for r in rs
                    if (type(per_rank[r][key][1]) is DTensorRef) != (type(value) is DTensorRef)
                )
                raise CheckpointFormatError(
                    f"{layouts[ranks[other]].where} and {layout.where}: key {key!r} is a DTensor "
                    f"in one and not "
                    "in the other: the ranks saved different state"
                )
            if isinstance(value, DTensorRef):
                sdm[key], chunks = _dtensor_entry(
                    key, [(r, ranks[r], per_rank[r][key][1]) for r in rs], layouts, meta
                )
                for index, (offsets, loc) in enumerate(chunks):
                    storage[k.MetadataIndex(key, offsets, index)] = KnownTensor(loc)
            elif isinstance(value, TensorRef):
                if meta is not None:
                    _check_plain(key, value, meta, fetcher)
                sdm[key], at, entry = saved_entry(key, value, layout, rel)
                storage[at] = entry
            else:
                refs: list[TensorRef] = []
                _refs_in(value, refs, f"object {key!r} of {layout.where}")
                sdm[key], at, entry = saved_entry(key, value, layout, rel, refs)
                storage[at] = entry
    if meta is not None:
        for key in meta.shardings:
            if key not in sdm:
                raise CheckpointFormatError(
                    f"{fetcher.url(METADATA_FILE)} describes key {key!r}, which no file of the "
                    f"checkpoint holds"
                )
    return k.FormatMetadata(
        state_dict_metadata=sdm,
        planner_data=paths,
        storage_data=storage,
        storage_meta=k.StorageMeta(),
        format="torch-checkpointing",
        source=source,
    )


def _refs_in(obj: Any, out: list[TensorRef], where: str, depth: int = 0) -> None:
    if depth > 200:
        raise CheckpointFormatError(f"{where}: nested more than 200 levels deep")
    if isinstance(obj, DTensorRef):
        raise CheckpointFormatError(
            f"{where}: holds a DTensor inside a tuple, set or other object; asyncload reads "
            f"DTensors only "
            "as values of dicts and lists (each needs a key of its own)"
        )
    if isinstance(obj, TensorRef):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _refs_in(v, out, where, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _refs_in(v, out, where, depth + 1)


def _dtensor_entry(
    key: str,
    held: list[tuple[int, str, DTensorRef]],
    layouts: dict[str, ArchiveLayout],
    meta: _TcMetadata | None,
) -> tuple[TensorStorageMetadata, list[tuple[tuple[int, ...], Any]]]:
    """The global tensor ``key`` and its chunks: one per rank that holds the primary copy of
    its shard (``held``: each rank holding it, its file, its record), located in that file."""
    base = held[0][2]
    where0 = layouts[held[0][1]].where
    k = plain.kinds()
    chunks: list[tuple[tuple[int, ...], Any]] = []
    metas: list[Any] = []
    groups = meta.shardings.get(key) if meta is not None else None
    if meta is not None and groups is None:
        raise CheckpointFormatError(
            f"{where0}: holds DTensor {key!r}, which metadata.pkl does not describe"
        )
    for rank, rel, d in held:
        layout = layouts[rel]
        where = f"DTensor {key!r} of {layout.where}"
        if (d.size, d.dtype) != (base.size, base.dtype):
            raise CheckpointFormatError(
                f"{where}: has size {list(d.size)} and dtype {d.dtype}, {where0} has "
                f"{list(base.size)} and {base.dtype}"
            )
        if groups is not None:
            _check_against_metadata(d, rank, groups, where)
        if d.coordinate is None or not d.primary():
            continue
        shape, offsets = d.shard(where)
        loc = replace(
            tensor_location(layout, rel, d.local),
            where=f"shard {list(offsets)} of DTensor {key!r} (storage data/{d.local.storage.key}) "
            f"of {layout.where}",
        )
        chunks.append((offsets, loc))
        metas.append(k.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
    _check_coverage(metas, base.size, f"{where0.rsplit('/', 1)[0]}: DTensor {key!r}")
    return (
        k.TensorStorageMetadata(
            properties=k.TensorProperties(dtype=base.dtype, requires_grad=base.requires_grad),
            size=torch.Size(base.size),
            chunks=metas,
        ),
        chunks,
    )


def _check_against_metadata(d: DTensorRef, rank: int, groups: list[_Sharding], where: str) -> None:
    g = next((g for g in groups if rank in g.rank_set), None)
    if g is None:
        raise CheckpointFormatError(
            f"{where}: metadata.pkl lists no sharding of it for rank {rank}"
        )
    theirs = (g.size, g.placements, g.mesh_shape, g.coordinate(rank))
    ours = (d.size, d.placements, d.mesh_shape, d.coordinate)
    if theirs != ours:
        raise CheckpointFormatError(
            f"{where}: metadata.pkl says size {list(g.size)}, placements {g.placements}, mesh "
            f"{list(g.mesh_shape)} "
            f"and coordinate {g.coordinate(rank)} for rank {rank}; the file holds size "
            f"{list(d.size)}, placements "
            f"{d.placements}, mesh {list(d.mesh_shape)} and coordinate {d.coordinate}"
        )


def _check_plain(key: str, value: TensorRef, meta: _TcMetadata, fetcher: Fetcher) -> None:
    """A plain tensor of a resharded item is described as replicated, of its own size."""
    for g in meta.shardings.get(key, ()):
        if g.size != value.size or any(k != "replicate" for k, _, _ in g.placements):
            raise CheckpointFormatError(
                f"{fetcher.url(METADATA_FILE)}: says key {key!r} has size {list(g.size)} and "
                f"placements "
                f"{g.placements}; the files hold a plain tensor of size {list(value.size)}"
            )
