"""What a pickled ``DTensor`` of a torch-checkpointing item file decodes to: records
(:class:`DTensorRef` and small data holders), never the real classes. No ``DeviceMesh``,
process group or placement of the checkpoint is constructed; the mesh shape, the saving
rank's coordinate and the placements are checked integers (:func:`decode_record`).

Raised: :class:`CheckpointFormatError` for a malformed or unsupported record (a ``Partial``
placement, a mesh too large, a DTensor inside a tuple or object);
:class:`UnsafeCheckpointError` for a name outside the allow-list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asyncload.common.errors import CheckpointFormatError, UnsafeCheckpointError
from asyncload.common.paths import short_repr
from asyncload.decoding import (
    MAX_DEPTH,
    PickleVM,
    TensorRef,
    _check_structure,
    _CheckpointPolicy,
    _is_int,
    record_globals,
    storage_persistent_load,
)

# --- the records a DTensor pickle decodes to ------------------------------------------

#: Largest device mesh accepted (ranks), and most dimensions of one.
_MAX_MESH = 1 << 24
_MAX_MESH_DIMS = 16

__all__ = ["DTensorRef", "decode_record"]


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
                f"{where}: its placements {self.describe()} cannot be applied ({type(exc).__name__}: {exc})"[
                    :500
                ]
            ) from None
        shape, offsets = tuple(int(x) for x in shape), tuple(int(x) for x in offsets)
        if shape != self.local.size:
            raise CheckpointFormatError(
                f"{where}: the saved local shard has shape {list(self.local.size)}, but its "
                f"placements "
                f"{self.describe()} give this rank (coordinate {list(self.coordinate)}) a shard of "
                f"shape {list(shape)}"
            )
        for o, n, g in zip(offsets, shape, self.size):
            if o < 0 or o + n > g:
                raise CheckpointFormatError(
                    f"{where}: its shard at {list(offsets)} of shape {list(shape)} lies outside "
                    f"the tensor "
                    f"of size {list(self.size)}"
                )
        return shape, offsets

    def primary(self) -> bool:
        """Whether this rank's copy is the one read: coordinate 0 on every replicated mesh dim."""
        assert self.coordinate is not None
        return all(
            c == 0
            for c, (kind, _, _) in zip(self.coordinate, self.placements)
            if kind == "replicate"
        )

    def describe(self) -> str:
        names = {
            "shard": "Shard({1})",
            "strided": "_StridedShard({1}, split_factor={2})",
            "replicate": "Replicate()",
        }
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
    if (
        not isinstance(dtype, torch.dtype)
        or layout is not torch.strided
        or type(requires_grad) is not bool
    ):
        raise CheckpointFormatError(f"DTensor record has malformed arguments {short_repr(args)}")
    size = _int_tuple(size, "global size")
    if (
        type(state) is tuple and len(state) == 2 and state[0] is None
    ):  # (__dict__, slots) of __reduce_ex__
        state = state[1]
    if not isinstance(state, dict) or not set(state) <= {"_local_tensor", "_spec"}:
        extra = sorted(str(k) for k in state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointFormatError(f"DTensor record has unexpected state {short_repr(extra)}")
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, TensorRef):
        raise CheckpointFormatError("DTensor record holds no local tensor")
    if local.dtype != dtype:
        raise CheckpointFormatError(
            f"DTensor record of dtype {dtype} holds a local tensor of dtype {local.dtype}"
        )
    if not isinstance(spec, _SpecRecord):
        raise CheckpointFormatError("DTensor record holds no DTensorSpec")
    placements = _placements(spec.fields.get("placements"))
    mesh_shape, coordinate = _mesh(spec.fields.get("mesh"))
    meta = spec.fields.get("tensor_meta")
    if (
        isinstance(meta, _TensorMetaRecord)
        and meta.args
        and _int_tuple(meta.args[0], "tensor_meta shape") != size
    ):
        raise CheckpointFormatError(
            f"DTensor record's tensor_meta shape {short_repr(meta.args[0])} is not its size "
            f"{list(size)}"
        )
    if len(placements) != len(mesh_shape):
        raise CheckpointFormatError(
            f"DTensor record has {len(placements)} placements for a mesh of {len(mesh_shape)} "
            f"dimensions"
        )
    for kind, dim, _ in placements:
        if kind != "replicate" and not 0 <= dim < len(size):
            raise CheckpointFormatError(
                f"DTensor record shards dimension {dim} of a {len(size)}-dimensional tensor"
            )
    if coordinate is not None and (
        len(coordinate) != len(mesh_shape)
        or not all(0 <= c < n for c, n in zip(coordinate, mesh_shape))
    ):
        raise CheckpointFormatError(
            f"DTensor record's coordinate {list(coordinate)} lies outside its mesh of shape "
            f"{list(mesh_shape)}"
        )
    return DTensorRef(local, size, dtype, placements, mesh_shape, coordinate, requires_grad)


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if (
        not isinstance(v, (tuple, list))
        or len(v) > 1024
        or not all(_is_int(x) and x >= 0 for x in v)
    ):
        raise CheckpointFormatError(f"DTensor record has a malformed {what}: {short_repr(v)}")
    return tuple(v)


def _placements(v: Any) -> tuple[tuple[str, int, int], ...]:
    if type(v) not in (tuple, list) or not 0 < len(v) <= _MAX_MESH_DIMS:
        raise CheckpointFormatError(f"DTensor record has malformed placements {short_repr(v)}")
    out: list[tuple[str, int, int]] = []
    for p in v:
        if isinstance(p, _PartialRecord):
            raise CheckpointFormatError(
                "DTensor record has a Partial placement: it holds a pending reduction (partial "
                "sums), "
                "not a slice of the tensor, and asyncload does not reduce across ranks"
            )
        if not isinstance(p, _Record):
            raise CheckpointFormatError(
                f"DTensor record has a malformed placement {short_repr(p)}"
            )
        dim: Any = p.fields.get("dim", p.args[0] if p.args else None)
        if isinstance(p, _ReplicateRecord):
            out.append(("replicate", -1, 0))
        elif isinstance(p, _ShardRecord) and _is_int(dim):
            out.append(("shard", dim, 0))
        elif isinstance(p, _StridedShardRecord) and _is_int(dim):
            split: Any = p.fields.get("split_factor", p.args[1] if len(p.args) > 1 else None)
            if not _is_int(split) or not 0 < split <= _MAX_MESH:
                raise CheckpointFormatError(
                    f"DTensor record has a malformed _StridedShard {short_repr(p.fields)}"
                )
            out.append(("strided", dim, split))
        else:
            raise CheckpointFormatError(
                f"DTensor record has a malformed placement {p.kind} {short_repr(dim)}"
            )
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
            raise CheckpointFormatError(
                f"DeviceMesh record has malformed layout axes {short_repr(axes)}"
            )
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
            "DeviceMesh record has neither a _layout nor a mesh tensor: its shape cannot be "
            "determined "
            "(written by a torch version asyncload does not know)"
        )
    if not 0 < len(shape) <= _MAX_MESH_DIMS or not all(0 < n <= _MAX_MESH for n in shape):
        raise CheckpointFormatError(f"DeviceMesh record has a malformed shape {short_repr(shape)}")
    if math.prod(shape) > _MAX_MESH:
        raise CheckpointFormatError(
            f"DeviceMesh record of shape {list(shape)} has more than {_MAX_MESH} ranks"
        )
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
                raise vm.bad(
                    f"_rebuild_from_type_v2 called with malformed arguments {short_repr(args)}"
                )
            vm.charge(16)
            try:
                return _rebuild_from_type(*args)
            except (CheckpointFormatError, UnsafeCheckpointError) as exc:
                raise type(exc)(f"{vm.what}: {exc}") from None
        if (isinstance(func, type) and func in _RECORD_CLASSES) or isinstance(func, _Marker):
            raise vm.unsafe(
                f"asks to call {getattr(func, 'kind', '') or getattr(func, 'name', '')}"
            )
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
            if (
                type(state) is not dict
                or len(state) > 64
                or not all(type(k) is str for k in state)
            ):
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
            raise CheckpointFormatError(
                f"{where}: holds a {shown} outside a DTensor, which asyncload does not read"
            )
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
    return obj
