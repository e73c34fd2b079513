"""The metadata and plan types of a load that needs no ``torch.distributed.checkpoint``.

A safetensors or torch.save file loaded into a flat dict of plain tensors
(``asyncload.load`` with no planner, one rank) needs nothing of DCP, whose package import
costs half a second of a fresh process (issue 45, item 4). Its metadata is synthesised with
the small dataclasses here, field for field DCP's (``Metadata``, ``TensorStorageMetadata``,
``TensorProperties``, ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``MetadataIndex``,
``ReadItem``, ``LoadPlan``, ``LoadItemType``), and planned by
:class:`asyncload.faces.plain_planner.PlainLoadPlanner`.

Which kind a format module builds (:func:`kinds`): these while DCP is not imported, DCP's own
once it is (a process that imported it, every DCP face, a test run), so that whatever meets
the metadata afterwards gets DCP's types as before. A face that hands metadata to DCP (or to
a planner of DCP's) converts these first (:func:`to_dcp`, done by the session unless the load
asked for them: ``LoadSession.plain_metadata``).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "LoadItemType",
    "LoadPlan",
    "Metadata",
    "MetadataIndex",
    "PlainFormatMetadata",
    "ReadItem",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "dcp_imported",
    "is_bytes_md",
    "is_metadata",
    "is_plain",
    "is_tensor_md",
    "kinds",
    "to_dcp",
]

_DCP = "torch.distributed.checkpoint"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


class LoadItemType(enum.Enum):
    """DCP's ``LoadItemType``."""

    TENSOR = 1
    BYTE_IO = 2


@dataclass(frozen=True)
class MetadataIndex:
    """DCP's ``MetadataIndex``: ``index`` is a hint, neither compared nor hashed."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.offset is not None:
            object.__setattr__(self, "offset", torch.Size(self.offset))


@dataclass
class ChunkStorageMetadata:
    """DCP's ``ChunkStorageMetadata``."""

    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    """DCP's ``TensorProperties`` (the fields a load reads; the others as DCP's defaults)."""

    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False


@dataclass
class TensorStorageMetadata:
    """DCP's ``TensorStorageMetadata``."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """DCP's ``BytesStorageMetadata``."""


@dataclass
class StorageMeta:
    """DCP's ``StorageMeta``."""

    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """DCP's ``Metadata``."""

    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


@dataclass
class PlainFormatMetadata(Metadata):
    """:class:`asyncload.formats.entries.FormatMetadata` of these types (same fields)."""

    format: str = "dcp"
    source: str = ""
    prefix: str = ""
    templates: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class ReadItem:
    """DCP's ``ReadItem``."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: torch.Size
    storage_index: MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


@dataclass
class LoadPlan:
    """DCP's ``LoadPlan``."""

    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


def dcp_imported() -> bool:
    """Whether this process imported ``torch.distributed.checkpoint`` already."""
    return _DCP_METADATA in sys.modules


class _Kinds:
    """The classes a format module builds its metadata with (:func:`kinds`)."""

    def __init__(self, mod: Any, format_metadata: Any) -> None:
        self.TensorStorageMetadata = mod.TensorStorageMetadata
        self.TensorProperties = mod.TensorProperties
        self.ChunkStorageMetadata = mod.ChunkStorageMetadata
        self.BytesStorageMetadata = mod.BytesStorageMetadata
        self.MetadataIndex = mod.MetadataIndex
        self.StorageMeta = mod.StorageMeta
        self.FormatMetadata = format_metadata


def kinds() -> _Kinds:
    """DCP's metadata classes once DCP is imported, else this module's (see the module
    docstring)."""
    if dcp_imported():
        from torch.distributed.checkpoint import metadata

        from asyncload.formats.dcp_format import FormatMetadata

        return _Kinds(metadata, FormatMetadata)
    return plain_kinds()


def plain_kinds() -> _Kinds:
    """This module's metadata classes."""
    return _Kinds(sys.modules[__name__], PlainFormatMetadata)


def is_plain(md: object) -> bool:
    """Whether ``md`` is metadata of this module's types."""
    return isinstance(md, Metadata)


def _dcp_class(name: str) -> Any:
    mod = sys.modules.get(_DCP_METADATA)
    return getattr(mod, name) if mod is not None else None


def is_metadata(md: object) -> bool:
    """``isinstance(md, Metadata)`` for DCP's ``Metadata`` or this module's."""
    if isinstance(md, Metadata):
        return True
    cls = _dcp_class("Metadata")
    return cls is not None and isinstance(md, cls)


def is_tensor_md(smd: object) -> bool:
    """``isinstance(smd, TensorStorageMetadata)``, DCP's or this module's."""
    if isinstance(smd, TensorStorageMetadata):
        return True
    cls = _dcp_class("TensorStorageMetadata")
    return cls is not None and isinstance(smd, cls)


def is_bytes_md(smd: object) -> bool:
    """``isinstance(smd, BytesStorageMetadata)``, DCP's or this module's."""
    if isinstance(smd, BytesStorageMetadata):
        return True
    cls = _dcp_class("BytesStorageMetadata")
    return cls is not None and isinstance(smd, cls)


def is_byte_io(item: Any) -> bool:
    """Whether a read item (DCP's or this module's) reads an object."""
    return item.type.name == "BYTE_IO"


def to_dcp(md: Any) -> Any:
    """``md`` with DCP's types (imports DCP): metadata of this module's types converted field
    for field (``storage_data`` re-keyed by DCP's ``MetadataIndex``, its entries shared);
    anything else as it is."""
    if not isinstance(md, Metadata):
        return md
    from torch.distributed.checkpoint import metadata as dcp_md

    from asyncload.formats.dcp_format import FormatMetadata

    def prop(p: TensorProperties) -> Any:
        return dcp_md.TensorProperties(
            dtype=p.dtype,
            layout=p.layout,
            requires_grad=p.requires_grad,
            memory_format=p.memory_format,
            pin_memory=p.pin_memory,
        )

    sdm: dict[str, Any] = {}
    for key, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            sdm[key] = dcp_md.TensorStorageMetadata(
                properties=prop(smd.properties),
                size=smd.size,
                chunks=[
                    dcp_md.ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes)
                    for c in smd.chunks
                ],
            )
        elif isinstance(smd, BytesStorageMetadata):
            sdm[key] = dcp_md.BytesStorageMetadata()
        else:  # pragma: no cover - the formats build no other kind
            sdm[key] = smd
    storage = md.storage_data
    if isinstance(storage, dict):
        storage = {
            dcp_md.MetadataIndex(i.fqn, i.offset, i.index)
            if isinstance(i, MetadataIndex)
            else i: e
            for i, e in storage.items()
        }
    meta = md.storage_meta
    if isinstance(meta, StorageMeta):
        meta = dcp_md.StorageMeta(
            checkpoint_id=meta.checkpoint_id,
            save_id=meta.save_id,
            load_id=meta.load_id,
            modules=meta.modules,
        )
    fields: dict[str, Any] = {
        "state_dict_metadata": sdm,
        "planner_data": md.planner_data,
        "storage_data": storage,
        "storage_meta": meta,
        "version": md.version,
    }
    if isinstance(md, PlainFormatMetadata):
        return FormatMetadata(
            **fields,
            format=md.format,
            source=md.source,
            prefix=md.prefix,
            templates=md.templates,
        )
    return dcp_md.Metadata(**fields)  # pragma: no cover - the formats build FormatMetadata
