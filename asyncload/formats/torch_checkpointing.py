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
``Metadata`` (:class:`~asyncload.formats.base.FormatMetadata`): one chunk per saved shard,
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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asyncload._errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from asyncload._paths import check_relative_path
from asyncload.decoding.allowlist import (
    MAX_DEPTH,
    TensorRef,
    _check_coverage,
    _check_structure,
    _CheckpointPolicy,
    _is_int,
    record_globals,
    safe_loads,
    storage_persistent_load,
)
from asyncload.decoding.vm import PickleVM, short_repr
from asyncload.formats.base import Fetcher, FormatMetadata, KnownTensor
from asyncload.formats.torchsave import ArchiveLayout, _alayout, saved_entry, tensor_location

__all__ = [
    "METADATA_FILE",
    "DTensorRef",
    "adirectory_metadata",
    "decode_record",
    "is_torch_checkpointing",
    "item_file_hint",
]

#: The file torch-checkpointing writes when an item declares a resharder.
METADATA_FILE = "metadata.pkl"

#: ``<item>_<rank>.pt``: torch-checkpointing's default layout (``default_torch_layout_info``).
_ITEM_FILE = re.compile(r"^(?P<item>[A-Za-z0-9_.\-]+?)_(?P<rank>0|[1-9][0-9]{0,6})\.pt$")

#: The metadata versions read (``DistributedMetadata.to_dict`` of torch-checkpointing 0.1).
_VERSIONS = ("2.0",)

#: Largest device mesh accepted (ranks), and most dimensions of one.
_MAX_MESH = 1 << 24
_MAX_MESH_DIMS = 16


def is_torch_checkpointing(names: Sequence[str]) -> bool:
    """Whether a directory listing is a torch-checkpointing checkpoint: a ``metadata.pkl``
    or rank-0 item files (``<item>_0.pt``), and no ``.pt`` file of another name (a
    ``metadata.pkl`` alone is one whose item files are missing: it says which)."""
    pts = [n for n in names if n.endswith(".pt")]
    if not all(_ITEM_FILE.match(n) for n in pts):
        return False
    return METADATA_FILE in names or any(n.endswith("_0.pt") for n in pts)


def item_file_hint(name: str) -> str | None:
    """What to say when a file named like one torch-checkpointing item file cannot be read
    alone (an int item, a DTensor shard): load its directory."""
    base = name.rsplit("/", 1)[-1]
    if not _ITEM_FILE.match(base):
        return None
    return (
        f"{base} is named like one item file of a torch-checkpointing checkpoint (<item>_<rank>.pt): "
        "load the checkpoint's directory instead, which asyncload reads whole"
    )


# --- the records a DTensor pickle decodes to ------------------------------------------


@dataclass(frozen=True)
class DTensorRef:
    """A pickled ``DTensor`` as data: its local shard (a :class:`TensorRef`), its global
    size and dtype, its placements (``("shard", dim, 0)``, ``("strided", dim, split_factor)``
    or ``("replicate", -1, 0)``), the shape of its mesh and the saving rank's coordinate in
    it (``None`` when that rank is not in the mesh)."""

    local: TensorRef
    size: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[tuple[str, int, int], ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None
    requires_grad: bool = False

    def shard(self, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(local shape, global offsets)`` this rank's shard has by its placements, checked
        against the local tensor that was saved."""
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

        assert self.coordinate is not None
        objs: list[Any] = []
        for kind, dim, split in self.placements:
            if kind == "replicate":
                objs.append(Replicate())
            elif kind == "shard":
                objs.append(Shard(dim))
            else:
                objs.append(_StridedShard(dim, split_factor=split))
        try:
            shape, offsets = _compute_local_shape_and_global_offset(
                self.size, self.mesh_shape, list(self.coordinate), objs
            )
        except Exception as exc:  # torch's own checks of the geometry
            raise CheckpointFormatError(
                f"{where}: its placements {self.describe()} cannot be applied ({type(exc).__name__}: {exc})"[:500]
            ) from None
        shape, offsets = tuple(int(x) for x in shape), tuple(int(x) for x in offsets)
        if shape != self.local.size:
            raise CheckpointFormatError(
                f"{where}: the saved local shard has shape {list(self.local.size)}, but its placements "
                f"{self.describe()} give this rank (coordinate {list(self.coordinate)}) a shard of shape {list(shape)}"
            )
        for o, n, g in zip(offsets, shape, self.size):
            if o < 0 or o + n > g:
                raise CheckpointFormatError(
                    f"{where}: its shard at {list(offsets)} of shape {list(shape)} lies outside the tensor "
                    f"of size {list(self.size)}"
                )
        return shape, offsets

    def primary(self) -> bool:
        """Whether this rank's copy is the one read: coordinate 0 on every replicated mesh dim."""
        assert self.coordinate is not None
        return all(c == 0 for c, (kind, _, _) in zip(self.coordinate, self.placements) if kind == "replicate")

    def describe(self) -> str:
        names = {"shard": "Shard({1})", "strided": "_StridedShard({1}, split_factor={2})", "replicate": "Replicate()"}
        ps = ", ".join(names[k].format(k, d, s) for k, d, s in self.placements)
        return f"[{ps}] on a mesh of shape {list(self.mesh_shape)}"


class _Record:
    """An object of a class a DTensor pickle names, kept as data: the ``NEWOBJ`` arguments
    and the ``BUILD`` state. Never anything's real class; checked where it is used."""

    kind: ClassVar[str] = ""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args
        self.fields: dict[str, Any] = {}


class _SpecRecord(_Record):
    kind = "DTensorSpec"


class _MeshRecord(_Record):
    kind = "DeviceMesh"


class _LayoutRecord(_Record):
    kind = "_MeshLayout"


class _TensorMetaRecord(_Record):
    kind = "TensorMeta"


class _ShardOrderRecord(_Record):
    kind = "ShardOrderEntry"


class _ShardRecord(_Record):
    kind = "Shard"


class _StridedShardRecord(_Record):
    kind = "_StridedShard"


class _ReplicateRecord(_Record):
    kind = "Replicate"


class _PartialRecord(_Record):
    kind = "Partial"


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name


_WRAPPER = _Marker("torch._utils._rebuild_wrapper_subclass")
_DTENSOR = _Marker("torch.distributed.tensor.DTensor")


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRef:
    """``torch._tensor._rebuild_from_type_v2`` of a pickled DTensor, as a :class:`DTensorRef`."""
    if func is not _WRAPPER or new_type is not _DTENSOR:
        raise UnsafeCheckpointError("_rebuild_from_type_v2 is allowed only to rebuild a DTensor")
    if type(args) is not tuple or len(args) != 8 or args[0] is not _DTENSOR:
        raise CheckpointFormatError(f"DTensor record has malformed arguments {short_repr(args)}")
    _, dtype, size, _stride, _offset, layout, _device, requires_grad = args
    if not isinstance(dtype, torch.dtype) or layout is not torch.strided or type(requires_grad) is not bool:
        raise CheckpointFormatError(f"DTensor record has malformed arguments {short_repr(args)}")
    size = _int_tuple(size, "global size")
    if type(state) is tuple and len(state) == 2 and state[0] is None:  # (__dict__, slots) of __reduce_ex__
        state = state[1]
    if not isinstance(state, dict) or not set(state) <= {"_local_tensor", "_spec"}:
        extra = sorted(str(k) for k in state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointFormatError(f"DTensor record has unexpected state {short_repr(extra)}")
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, TensorRef):
        raise CheckpointFormatError("DTensor record holds no local tensor")
    if local.dtype != dtype:
        raise CheckpointFormatError(f"DTensor record of dtype {dtype} holds a local tensor of dtype {local.dtype}")
    if not isinstance(spec, _SpecRecord):
        raise CheckpointFormatError("DTensor record holds no DTensorSpec")
    placements = _placements(spec.fields.get("placements"))
    mesh_shape, coordinate = _mesh(spec.fields.get("mesh"))
    meta = spec.fields.get("tensor_meta")
    if isinstance(meta, _TensorMetaRecord) and meta.args and _int_tuple(meta.args[0], "tensor_meta shape") != size:
        raise CheckpointFormatError(
            f"DTensor record's tensor_meta shape {short_repr(meta.args[0])} is not its size {list(size)}"
        )
    if len(placements) != len(mesh_shape):
        raise CheckpointFormatError(
            f"DTensor record has {len(placements)} placements for a mesh of {len(mesh_shape)} dimensions"
        )
    for kind, dim, _ in placements:
        if kind != "replicate" and not 0 <= dim < len(size):
            raise CheckpointFormatError(f"DTensor record shards dimension {dim} of a {len(size)}-dimensional tensor")
    if coordinate is not None and (
        len(coordinate) != len(mesh_shape) or not all(0 <= c < n for c, n in zip(coordinate, mesh_shape))
    ):
        raise CheckpointFormatError(
            f"DTensor record's coordinate {list(coordinate)} lies outside its mesh of shape {list(mesh_shape)}"
        )
    return DTensorRef(local, size, dtype, placements, mesh_shape, coordinate, requires_grad)


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) > 1024 or not all(_is_int(x) and x >= 0 for x in v):
        raise CheckpointFormatError(f"DTensor record has a malformed {what}: {short_repr(v)}")
    return tuple(v)


def _placements(v: Any) -> tuple[tuple[str, int, int], ...]:
    if type(v) not in (tuple, list) or not 0 < len(v) <= _MAX_MESH_DIMS:
        raise CheckpointFormatError(f"DTensor record has malformed placements {short_repr(v)}")
    out: list[tuple[str, int, int]] = []
    for p in v:
        if isinstance(p, _PartialRecord):
            raise CheckpointFormatError(
                "DTensor record has a Partial placement: it holds a pending reduction (partial sums), "
                "not a slice of the tensor, and asyncload does not reduce across ranks"
            )
        if not isinstance(p, _Record):
            raise CheckpointFormatError(f"DTensor record has a malformed placement {short_repr(p)}")
        dim: Any = p.fields.get("dim", p.args[0] if p.args else None)
        if isinstance(p, _ReplicateRecord):
            out.append(("replicate", -1, 0))
        elif isinstance(p, _ShardRecord) and _is_int(dim):
            out.append(("shard", dim, 0))
        elif isinstance(p, _StridedShardRecord) and _is_int(dim):
            split: Any = p.fields.get("split_factor", p.args[1] if len(p.args) > 1 else None)
            if not _is_int(split) or not 0 < split <= _MAX_MESH:
                raise CheckpointFormatError(f"DTensor record has a malformed _StridedShard {short_repr(p.fields)}")
            out.append(("strided", dim, split))
        else:
            raise CheckpointFormatError(f"DTensor record has a malformed placement {p.kind} {short_repr(dim)}")
    return tuple(out)


def _flat_ints(v: Any, depth: int = 0) -> list[int]:
    if _is_int(v):
        return [v]
    if type(v) is tuple and depth < 8 and len(v) <= _MAX_MESH_DIMS:
        return [x for e in v for x in _flat_ints(e, depth + 1)]
    raise CheckpointFormatError(f"DeviceMesh record has a malformed layout {short_repr(v)}")


def _mesh(v: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The mesh's shape and the saving rank's coordinate, from a pickled ``DeviceMesh``:
    torch 2.10+ (``_layout``: one CuTe layout per mesh dim, whose size is the product of its
    shape) or older (``mesh``: the rank tensor, whose size is the mesh shape)."""
    if not isinstance(v, _MeshRecord):
        raise CheckpointFormatError("DTensor record holds no DeviceMesh")
    f = v.fields
    layout, mesh = f.get("_layout"), f.get("mesh")
    if isinstance(layout, _LayoutRecord):
        axes = layout.fields.get("axes", layout.args[0] if layout.args else None)
        if type(axes) is not tuple or not 0 < len(axes) <= _MAX_MESH_DIMS:
            raise CheckpointFormatError(f"DeviceMesh record has malformed layout axes {short_repr(axes)}")
        shape_l = []
        for ax in axes:
            if not isinstance(ax, _LayoutRecord):
                raise CheckpointFormatError("DeviceMesh record has a malformed layout axis")
            shape_l.append(math.prod(_flat_ints(ax.fields.get("shape", ()))))
        shape = tuple(shape_l)
    elif isinstance(mesh, TensorRef):
        shape = mesh.size
    else:
        raise CheckpointFormatError(
            "DeviceMesh record has neither a _layout nor a mesh tensor: its shape cannot be determined "
            "(written by a torch version asyncload does not know)"
        )
    if not 0 < len(shape) <= _MAX_MESH_DIMS or not all(0 < n <= _MAX_MESH for n in shape):
        raise CheckpointFormatError(f"DeviceMesh record has a malformed shape {short_repr(shape)}")
    if math.prod(shape) > _MAX_MESH:
        raise CheckpointFormatError(f"DeviceMesh record of shape {list(shape)} has more than {_MAX_MESH} ranks")
    coord = f.get("_coordinate_on_dim")
    if coord is not None:
        coord = _int_tuple(coord, "mesh coordinate")
    return shape, coord


_RECORDS: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _WRAPPER,
    ("torch.distributed.tensor", "DTensor"): _DTENSOR,
    ("torch.distributed.tensor._api", "DTensor"): _DTENSOR,
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): _SpecRecord,
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): _TensorMetaRecord,
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): _ShardOrderRecord,
    ("torch.distributed.device_mesh", "DeviceMesh"): _MeshRecord,
    ("torch.distributed._mesh_layout", "_MeshLayout"): _LayoutRecord,
    ("torch.distributed._mesh_layout", "_FlatLayout"): _LayoutRecord,
    ("torch.distributed.tensor.placement_types", "Shard"): _ShardRecord,
    ("torch.distributed.tensor.placement_types", "_StridedShard"): _StridedShardRecord,
    ("torch.distributed.tensor.placement_types", "Replicate"): _ReplicateRecord,
    ("torch.distributed.tensor.placement_types", "Partial"): _PartialRecord,
}
_RECORD_CLASSES = frozenset(v for v in _RECORDS.values() if isinstance(v, type))


class _DTensorPolicy(_CheckpointPolicy):
    """The torch.save record policy, plus the names of a pickled DTensor as records."""

    def __init__(self) -> None:
        super().__init__(record_globals(), storage_persistent_load)

    def find_class(self, vm: PickleVM, module: Any, name: Any) -> Any:
        if type(module) is str and type(name) is str:
            rec = _RECORDS.get((module, name))
            if rec is not None:
                return rec
        return super().find_class(vm, module, name)

    def call(self, vm: PickleVM, func: Any, args: Any) -> Any:
        if func is _rebuild_from_type:
            if type(args) is not tuple or len(args) != 4:
                raise vm.bad(f"_rebuild_from_type_v2 called with malformed arguments {short_repr(args)}")
            vm.charge(16)
            try:
                return _rebuild_from_type(*args)
            except (CheckpointFormatError, UnsafeCheckpointError) as exc:
                raise type(exc)(f"{vm.what}: {exc}") from None
        if (isinstance(func, type) and func in _RECORD_CLASSES) or isinstance(func, _Marker):
            raise vm.unsafe(f"asks to call {getattr(func, 'kind', '') or getattr(func, 'name', '')}")
        return super().call(vm, func, args)

    def newobj(self, vm: PickleVM, cls: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(cls, type) and cls in _RECORD_CLASSES:
            if type(args) is not tuple or len(args) > 8 or kwargs:
                raise vm.bad(f"{cls.__name__} created with malformed arguments {short_repr(args)}")
            vm.charge(4 + len(args))
            obj = cls(args)
            vm.mark_fresh(obj)
            return obj
        return super().newobj(vm, cls, args, kwargs)

    def build(self, vm: PickleVM, inst: Any, state: Any) -> None:
        if isinstance(inst, _Record):
            if not vm.is_fresh(inst):
                raise vm.unsafe(f"asks to modify a {inst.kind} record it did not create")
            if type(state) is tuple and len(state) == 2:  # (__dict__, slots)
                merged: dict[Any, Any] = {}
                for part in state:
                    if part is not None:
                        if type(part) is not dict:
                            raise vm.bad(f"{inst.kind} state is malformed")
                        merged.update(part)
                state = merged
            if type(state) is not dict or len(state) > 64 or not all(type(k) is str for k in state):
                raise vm.bad(f"{inst.kind} state is malformed: {short_repr(state)}")
            vm.charge(len(state))
            inst.fields.update(state)
            return
        super().build(vm, inst, state)


def decode_record(pickle_bytes: bytes | memoryview, where: str) -> Any:
    """An archive's ``data.pkl`` with the DTensor records allowed (see the module docstring)."""
    vm = PickleVM(bytes(pickle_bytes), _DTensorPolicy(), f"{where} (data.pkl)")
    obj = vm.run()
    _check_structure(obj, f"{where} (data.pkl)", MAX_DEPTH, vm.work_limit)
    return _no_loose_records(obj, where)


def _no_loose_records(obj: Any, where: str) -> Any:
    """A spec, mesh or placement outside a DTensor is not something a state dict holds."""
    stack, seen = [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, (_Record, _Marker)):
            shown = o.kind if isinstance(o, _Record) else o.name
            raise CheckpointFormatError(f"{where}: holds a {shown} outside a DTensor, which asyncload does not read")
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
    return obj


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
    """``metadata.pkl`` decoded with no global allowed (it is plain data) and checked field by field."""
    d: Any = safe_loads(raw, what=url, allowed={}, max_size=max_size)
    if type(d) is not dict or not {"metadata", "world_size"} <= set(d):
        raise _bad(url, "is not torch-checkpointing metadata (a dict with 'metadata' and 'world_size')")
    version = d.get("version")
    if version not in _VERSIONS:
        raise _bad(url, f"has metadata version {short_repr(version)}; asyncload reads versions {list(_VERSIONS)}")
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
    if type(sm) is not dict or type(ranks) not in (tuple, list) or not all(_is_int(r) for r in ranks):
        raise _bad(url, f"key {key!r} has a malformed sharding group")
    if any(not 0 <= r < world for r in ranks):
        raise _bad(url, f"key {key!r} names ranks {short_repr(ranks)} outside the world of {world}")
    kind = sm.get("type")
    if kind != "DTensorShardingMetadata":
        raise _bad(
            url,
            f"key {key!r} has sharding metadata of type {short_repr(kind)}; asyncload reads only "
            "DTensorShardingMetadata (default_tensor_v1 of custom CheckpointableTensors is not read)",
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
    if math.prod(mesh_shape) != len(mesh_ranks) or len(mesh_shape) != len(placements) or not mesh_shape:
        raise _bad(url, f"key {key!r} has a mesh of shape {list(mesh_shape)} with {len(mesh_ranks)} ranks")
    return _Sharding(tuple(ranks), size, placements, mesh_shape, mesh_ranks)


def _spec_placement(p: Any, key: str, url: str) -> _Record:
    kind = p.get("type") if type(p) is dict else None
    cls = {"Shard": _ShardRecord, "StridedShard": _StridedShardRecord, "Replicate": _ReplicateRecord}.get(kind)  # type: ignore[arg-type]
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
                f"{url(name)} does not exist although rank {world - 1} wrote {item}_{world - 1}.pt: the "
                "torch-checkpointing save did not finish or its files were removed",
                path=url(name),
                status=404,
            )
        out[item] = [by_rank[r] for r in range(world)]
    return out


async def adirectory_metadata(fetcher: Fetcher, names: Sequence[str], source: str) -> FormatMetadata:
    """The synthesised metadata of the torch-checkpointing directory ``fetcher`` is opened at
    (``names``: its listing)."""
    opts = fetcher.options
    meta: _TcMetadata | None = None
    if METADATA_FILE in names:
        size = await fetcher.size(METADATA_FILE)
        url = fetcher.url(METADATA_FILE)
        if size is None:
            raise CheckpointFormatError(f"{url} is empty: the torch-checkpointing save did not finish")
        if size > opts.max_metadata_size:
            raise CheckpointFormatError(
                f"{url} is {size} bytes, more than LoadOptions.max_metadata_size={opts.max_metadata_size}"
            )
        meta = decode_metadata_pkl(await fetcher.read(METADATA_FILE, 0, size), url, max_size=opts.max_metadata_size)
    files = _item_files(names, fetcher.url)
    if meta is not None:  # metadata.pkl is authoritative for the items it describes
        for (item, rank), rel in meta.files.items():
            files.setdefault(item, [""] * meta.world_size)
            lst = files[item]
            if len(lst) != meta.world_size:
                lst[:] = (lst + [""] * meta.world_size)[: meta.world_size]
            lst[rank] = rel
    if not files:
        raise CheckpointFormatError(f"{source}: a torch-checkpointing directory without item files")
    wanted = sorted({rel for lst in files.values() for rel in lst})
    sizes = await asyncio.gather(*(fetcher.size(rel) for rel in wanted))
    size_of = dict(zip(wanted, sizes))
    for rel, size in size_of.items():
        if size is None:
            named = f"named by {fetcher.url(METADATA_FILE)}" if meta is not None else "expected"
            raise CheckpointNotFoundError(
                f"{fetcher.url(rel)} ({named}) does not exist or is empty: the torch-checkpointing save did "
                "not finish or its files were removed",
                path=fetcher.url(rel),
                status=404,
            )
    layouts = dict(
        zip(
            wanted,
            await asyncio.gather(*(_afile_layout(fetcher, rel, size_of[rel] or 0) for rel in wanted)),
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
        traverse_state_dict({item: value}, visit, keep_traversing=lambda v: isinstance(v, (TensorRef, DTensorRef)))
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
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
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
                other = next(r for r in rs if (type(per_rank[r][key][1]) is DTensorRef) != (type(value) is DTensorRef))
                raise CheckpointFormatError(
                    f"{layouts[ranks[other]].where} and {layout.where}: key {key!r} is a DTensor in one and not "
                    "in the other: the ranks saved different state"
                )
            if isinstance(value, DTensorRef):
                sdm[key], chunks = _dtensor_entry(key, [(r, ranks[r], per_rank[r][key][1]) for r in rs], layouts, meta)
                for index, (offsets, loc) in enumerate(chunks):
                    storage[MetadataIndex(key, offsets, index)] = KnownTensor(loc)
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
                    f"{fetcher.url(METADATA_FILE)} describes key {key!r}, which no file of the checkpoint holds"
                )
    return FormatMetadata(
        state_dict_metadata=sdm,
        planner_data=paths,
        storage_data=storage,
        storage_meta=StorageMeta(),
        format="torch-checkpointing",
        source=source,
    )


def _refs_in(obj: Any, out: list[TensorRef], where: str, depth: int = 0) -> None:
    if depth > 200:
        raise CheckpointFormatError(f"{where}: nested more than 200 levels deep")
    if isinstance(obj, DTensorRef):
        raise CheckpointFormatError(
            f"{where}: holds a DTensor inside a tuple, set or other object; asyncload reads DTensors only "
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
    chunks: list[tuple[tuple[int, ...], Any]] = []
    metas: list[ChunkStorageMetadata] = []
    groups = meta.shardings.get(key) if meta is not None else None
    if meta is not None and groups is None:
        raise CheckpointFormatError(f"{where0}: holds DTensor {key!r}, which metadata.pkl does not describe")
    for rank, rel, d in held:
        layout = layouts[rel]
        where = f"DTensor {key!r} of {layout.where}"
        if (d.size, d.dtype) != (base.size, base.dtype):
            raise CheckpointFormatError(
                f"{where}: has size {list(d.size)} and dtype {d.dtype}, {where0} has {list(base.size)} and {base.dtype}"
            )
        if groups is not None:
            _check_against_metadata(d, rank, groups, where)
        if d.coordinate is None or not d.primary():
            continue
        shape, offsets = d.shard(where)
        loc = replace(
            tensor_location(layout, rel, d.local),
            where=f"shard {list(offsets)} of DTensor {key!r} (storage data/{d.local.storage.key}) of {layout.where}",
        )
        chunks.append((offsets, loc))
        metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
    _check_coverage(metas, base.size, f"{where0.rsplit('/', 1)[0]}: DTensor {key!r}")
    return (
        TensorStorageMetadata(
            properties=TensorProperties(dtype=base.dtype, requires_grad=base.requires_grad),
            size=torch.Size(base.size),
            chunks=metas,
        ),
        chunks,
    )


def _check_against_metadata(d: DTensorRef, rank: int, groups: list[_Sharding], where: str) -> None:
    g = next((g for g in groups if rank in g.rank_set), None)
    if g is None:
        raise CheckpointFormatError(f"{where}: metadata.pkl lists no sharding of it for rank {rank}")
    theirs = (g.size, g.placements, g.mesh_shape, g.coordinate(rank))
    ours = (d.size, d.placements, d.mesh_shape, d.coordinate)
    if theirs != ours:
        raise CheckpointFormatError(
            f"{where}: metadata.pkl says size {list(g.size)}, placements {g.placements}, mesh {list(g.mesh_shape)} "
            f"and coordinate {g.coordinate(rank)} for rank {rank}; the file holds size {list(d.size)}, placements "
            f"{d.placements}, mesh {list(d.mesh_shape)} and coordinate {d.coordinate}"
        )


def _check_plain(key: str, value: TensorRef, meta: _TcMetadata, fetcher: Fetcher) -> None:
    """A plain tensor of a resharded item is described as replicated, of its own size."""
    for g in meta.shardings.get(key, ()):
        if g.size != value.size or any(k != "replicate" for k, _, _ in g.placements):
            raise CheckpointFormatError(
                f"{fetcher.url(METADATA_FILE)}: says key {key!r} has size {list(g.size)} and placements "
                f"{g.placements}; the files hold a plain tensor of size {list(value.size)}"
            )
