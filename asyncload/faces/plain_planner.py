"""The default planner of a load that needs no ``torch.distributed.checkpoint`` (issue 45, item 4).

``asyncload.load`` / ``aload`` / ``start_load`` with no ``planner``, on one rank, make their
planner once the checkpoint's metadata is read (``faces.api._default_planner``): a safetensors or
torch.save file (metadata of :mod:`asyncload.formats.plain`'s types, every tensor saved
whole) loaded into a flat dict of plain tensors gets :class:`PlainLoadPlanner`, which plans
exactly what :class:`asyncload.PipelinedLoadPlanner` plans for it (the same checks and
errors, the same read items, of the plain types) without importing DCP; everything else
(a DCP checkpoint, a nested or stateful destination, a DTensor, a chunked tensor) gets a
``PipelinedLoadPlanner`` and DCP's types, as before.
"""

from __future__ import annotations

from typing import Any

import torch

import asyncload.formats as formats
from asyncload.common.errors import StateDictMismatchError
from asyncload.common.options import LoadOptions
from asyncload.engine import (
    PLAIN_TENSOR_TYPES,
    alias_groups,
    check_cast,
    check_missing_keys,
    same_bits,
)
from asyncload.faces.terms import TermsPlanner
from asyncload.formats import plain

__all__ = ["PlainLoadPlanner", "fits", "same_saved_bytes", "ties", "whole_tensors"]


def ties(state_dict: dict[str, Any], md: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Tied destination keys -> the key each is loaded through (the first of its group, in
    the destination's order, that the checkpoint holds), and those of them the checkpoint
    holds too, under other bytes (read to be compared, not written twice). Groups the
    checkpoint lacks entirely stay out."""
    saved = md.state_dict_metadata
    tied: dict[str, str] = {}
    checked: dict[str, str] = {}
    for keys in alias_groups(state_dict):
        present = [k for k in keys if k in saved]
        if not present:
            continue
        for k in keys:
            if k != present[0]:
                tied[k] = present[0]
                if k in saved and not same_saved_bytes(md, k, present[0]):
                    checked[k] = present[0]
    return tied, checked


def same_saved_bytes(md: Any, a: str, b: str) -> bool:
    """Whether the checkpoint holds keys ``a`` and ``b`` as one and the same located tensor
    (a ``torch.save`` of tied weights: one storage, the same offset, shape and stride), so
    that reading one reads the other."""
    ma, mb = md.state_dict_metadata.get(a), md.state_dict_metadata.get(b)
    if not plain.is_tensor_md(ma) or not plain.is_tensor_md(mb):
        return False
    if (
        ma.size != mb.size
        or ma.properties.dtype != mb.properties.dtype
        or len(ma.chunks) != len(mb.chunks)
    ):
        return False
    data = md.storage_data or {}
    index = plain.plain_kinds() if plain.is_plain(md) else plain.kinds()
    for i, (ca, cb) in enumerate(zip(ma.chunks, mb.chunks)):
        if ca.offsets != cb.offsets or ca.sizes != cb.sizes:
            return False
        ea, eb = (
            data.get(index.MetadataIndex(a, ca.offsets, i)),
            data.get(index.MetadataIndex(b, cb.offsets, i)),
        )
        if not isinstance(ea, formats.KnownTensor) or not isinstance(eb, formats.KnownTensor):
            return False
        la, lb = ea.location, eb.location
        if (la.name, la.data_start, la.dtype, la.size, la.stride, la.storage_offset) != (
            lb.name,
            lb.data_start,
            lb.dtype,
            lb.size,
            lb.stride,
            lb.storage_offset,
        ):
            return False
    return True


def whole_tensors(md: Any) -> bool:
    """Whether ``md`` is plain metadata whose tensors are each saved whole (one chunk at
    the origin)."""
    if not isinstance(md, plain.PlainFormatMetadata):
        return False
    for smd in md.state_dict_metadata.values():
        if isinstance(smd, plain.TensorStorageMetadata):
            if len(smd.chunks) != 1:
                return False
            chunk = smd.chunks[0]
            if any(chunk.offsets) or chunk.sizes != smd.size:
                return False
    return True


def fits(state_dict: Any, md: Any) -> bool:
    """Whether :class:`PlainLoadPlanner` plans this load: :func:`whole_tensors`, into a flat
    dict of plain tensors (and ``None`` where the checkpoint holds an object)."""
    if not whole_tensors(md) or not isinstance(state_dict, dict):
        return False
    saved = md.state_dict_metadata
    for k, v in state_dict.items():
        if type(k) is not str:
            return False
        if type(v) in PLAIN_TENSOR_TYPES:
            continue
        if v is None and isinstance(saved.get(k), plain.BytesStorageMetadata):
            continue
        return False
    return True


class PlainLoadPlanner(TermsPlanner):
    """What :class:`asyncload.PipelinedLoadPlanner` does for a load that :func:`fits`, with
    :mod:`asyncload.formats.plain`'s types: the destination checked against the checkpoint
    (missing keys, shapes, dtypes, tied keys, a key prefix), one read item per tensor, tied
    keys the checkpoint holds twice read into scratch memory and compared; an object into
    a ``None`` of the destination (``read_state_dict``)."""

    #: Objects are never planned here (a destination holds tensors only).
    raw_objects = False
    #: It carries the load's resolved options (as the ``PipelinedLoadPlanner`` it stands for).
    has_options = True

    def __init__(self, *, options: LoadOptions, allow_partial_load: bool = False) -> None:
        self.options = options
        self.allow_partial_load = allow_partial_load
        self.state_dict: dict[str, Any] = {}
        self.original_state_dict: dict[str, Any] = {}
        self.metadata: Any = None
        self.is_coordinator = True
        self.unexpected_keys: list[str] = []
        self.missing_keys: list[str] = []
        self.tied_keys: dict[str, str] = {}
        self._tie_checks: dict[str, list[Any]] = {}
        self._destinations_checked: Any = None

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = state_dict
        self.state_dict = dict(state_dict)  # as DCP's flattening of a flat dict: a new dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> plain.LoadPlan:
        rebased = formats.rebase(self.metadata, list(self.state_dict.keys()))
        if rebased is not None:
            self.metadata = rebased
        md = self.metadata
        saved = md.state_dict_metadata
        tied, checked = ties(self.state_dict, md)
        source = formats.source_of(md)
        missing = check_missing_keys(
            self.state_dict,
            saved,
            tied,
            allow_partial_load=self.allow_partial_load,
            source=source,
        )
        cast_ok = self.options.allow_dtype_cast
        for fqn, obj in self.state_dict.items():
            smd = saved.get(fqn)
            if smd is None:
                continue
            if obj is None:  # an object's place (checked by fits)
                continue
            if not isinstance(smd, plain.TensorStorageMetadata):
                raise StateDictMismatchError(
                    f"{source}, key {fqn!r}: the destination is a tensor, the checkpoint holds an object"
                )
            shape = list(obj.size())
            if list(smd.size) != shape:
                raise StateDictMismatchError(
                    f"{source}, key {fqn!r}: the destination has shape {shape}, the checkpoint "
                    f"{list(smd.size)}"
                )
            check_cast(
                smd.properties.dtype, obj.dtype, allow_cast=cast_ok, what=f"{source}, key {fqn!r}"
            )
        self.unexpected_keys = sorted(k for k in saved if k not in self.state_dict)
        self.missing_keys = sorted(missing)
        self.tied_keys = dict(sorted(tied.items()))
        skip = {k for k in tied if k not in checked}
        items: list[plain.ReadItem] = []
        for fqn in self.state_dict:
            if fqn in skip or fqn not in saved:
                continue
            if isinstance(saved[fqn], plain.BytesStorageMetadata):
                index = plain.MetadataIndex(fqn)
                items.append(
                    plain.ReadItem(
                        type=plain.LoadItemType.BYTE_IO,
                        dest_index=index,
                        dest_offsets=torch.Size((0,)),
                        storage_index=index,
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
                continue
            size = saved[fqn].size
            if not all(size) and len(size):  # no element to read (torch plans none)
                continue
            zeros = torch.Size([0] * len(size))
            index = plain.MetadataIndex(fqn, zeros, 0)
            items.append(
                plain.ReadItem(
                    type=plain.LoadItemType.TENSOR,
                    dest_index=index,
                    dest_offsets=zeros,
                    storage_index=index,
                    storage_offsets=zeros,
                    lengths=torch.Size(size),
                )
            )
        # a tied key the checkpoint holds too is read into scratch memory and compared with
        # what its twin loaded: the destination is written once, never twice with two values
        self._tie_checks = {
            k: [checked[k], torch.empty_like(self.state_dict[k].detach()), 1]
            for k in checked
            if any(item.dest_index.fqn == k for item in items)
        }
        return plain.LoadPlan(items)

    def create_global_plan(self, plans: list[plain.LoadPlan]) -> list[plain.LoadPlan]:
        return plans

    def finish_plan(self, plan: plain.LoadPlan) -> plain.LoadPlan:
        return plan

    def lookup_tensor(self, index: plain.MetadataIndex) -> torch.Tensor:
        check = self._tie_checks.get(index.fqn)
        if check is not None:
            return check[1]
        return self.state_dict[index.fqn]

    def transform_tensor(self, read_item: plain.ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        # torch's narrow_tensor_by_index: every item here is a whole tensor
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            if length < tensor.size(dim):
                tensor = tensor.narrow(dim, offset, length)
        return tensor

    def resolve_tensor(self, read_item: plain.ReadItem) -> torch.Tensor:
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    def commit_tensor(self, read_item: plain.ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        check = self._tie_checks.get(fqn)
        if check is None:
            return
        twin = check[0]
        loaded = self.transform_tensor(read_item, self.state_dict[fqn])
        if not same_bits(loaded, tensor):
            self._tie_checks.clear()
            raise StateDictMismatchError(
                f"{formats.source_of(self.metadata)}: keys {fqn!r} and {twin!r} are one tensor in the destination (tied weights: the same memory), "
                f"but the checkpoint holds different values for them (in the box at offsets "
                f"{list(read_item.dest_offsets)}, lengths {list(read_item.lengths)}): the destination holds "
                f"{twin!r}'s values; untie the two in the model (give one its own memory) to load both"
            )
        del self._tie_checks[fqn]  # compared: the scratch memory goes

    def load_object(self, read_item: plain.ReadItem, obj: Any) -> None:
        """Place an object the reader decoded (as DCP's flattening places a flat key)."""
        self.original_state_dict[read_item.dest_index.fqn] = obj

    def load_bytes(self, read_item: plain.ReadItem, value: Any) -> None:  # pragma: no cover
        # (the reader hands asyncload's planners decoded objects: load_object)
        raise NotImplementedError("PlainLoadPlanner takes decoded objects (load_object)")
