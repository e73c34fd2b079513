"""Hugging Face safetensors checkpoints: one file, a directory of shards (with or without
``model.safetensors.index.json``), or safetensors blobs inside DCP files, as a synthesised DCP
``Metadata`` whose entries are located tensors.

The header itself (its format, and every check a hostile or damaged header gets) is
:mod:`.safetensors_header`, whose names are re-exported here. A blob usually is a whole
``*.safetensors`` file (``base == 0``); torch's
``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)`` appends one
to each ``.distcp`` file after the pickled objects (``base`` > 0).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import asyncload.formats.plain as plain
from asyncload.common.errors import CheckpointFormatError, CheckpointNotFoundError
from asyncload.common.paths import check_relative_path
from asyncload.formats.entries import (
    Fetcher,
    FormatEntry,
    KnownTensor,
    TensorLocation,
    check_weight_map,
)
from asyncload.formats.safetensors_header import (
    DCP_SHARDING_INFO_KEY,
    HEADER_PROBE,
    MAX_HEADER_SIZE,
    SAFETENSORS_DTYPES,
    SafetensorsHeader,
    aread_header,
    header_length,
    looks_like_safetensors,
    parse_header,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    from asyncload.formats.dcp_format import FormatMetadata

__all__ = [
    "DCP_SHARDING_INFO_KEY",
    "HEADER_PROBE",
    "MAX_HEADER_SIZE",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "aread_header",
    "header_length",
    "looks_like_safetensors",
    "parse_header",
]

log = logging.getLogger("asyncload.safetensors")

# --- safetensors checkpoints: synthesised DCP metadata, blobs inside DCP files --------------


@dataclass(frozen=True)
class BlobTensor(FormatEntry):
    """A ``storage_data`` entry of a DCP checkpoint saved with ``SerializationFormat.SAFETENSORS``:
    tensor ``key`` of the safetensors blob that starts at ``offset`` of ``relative_path``
    (``length`` is the tensor's byte count). Located by :func:`aresolve_blob_tensors`."""

    relative_path: str
    offset: int
    length: int
    key: str
    saved_offsets: tuple[int, ...]
    dtype: torch.dtype
    sizes: tuple[int, ...]

    @classmethod
    async def resolve(cls, entries: Sequence[Any], fetcher: Fetcher) -> list[Any]:
        async def size_of(name: str) -> int:
            size = await fetcher.size(name)
            if size is None:
                raise CheckpointNotFoundError(
                    f"{fetcher.url(name)} is named by the checkpoint's metadata but does not exist",
                    path=fetcher.url(name),
                    status=404,
                )
            return size

        found = await aresolve_blob_tensors(
            entries,
            fetcher.read,
            size_of,
            url=fetcher.url,
            max_header_size=fetcher.checks.max_metadata_size,
        )
        return [found[e] for e in entries]


async def _asafetensors_files(
    fetcher: Fetcher, files: Sequence[str], weight_map: dict[str, str] | None, source: str
) -> FormatMetadata:
    sizes = await asyncio.gather(*(fetcher.size(f) for f in files))
    for f, s in zip(files, sizes):
        if s is None:
            raise CheckpointNotFoundError(
                f"{fetcher.url(f)} is named by the checkpoint's index but does not exist: the "
                f"checkpoint is incomplete",
                path=fetcher.url(f),
                status=404,
            )
    headers = await asyncio.gather(
        *(
            aread_header(
                fetcher.reader(f),
                name=f,
                base=0,
                blob_size=s or 0,
                where=fetcher.url(f),
                max_header_size=fetcher.checks.max_metadata_size,
            )
            for f, s in zip(files, sizes)
        )
    )
    return _safetensors_metadata(list(headers), weight_map, source)


def _safetensors_metadata(
    headers: Sequence[SafetensorsHeader], weight_map: dict[str, str] | None, source: str
) -> FormatMetadata:
    """One chunk per (file, key); chunk offsets from ``DCP_SHARDING_INFO`` where torch wrote
    them. Of DCP's types, or :mod:`asyncload.formats.plain`'s while DCP is not imported."""
    k = plain.kinds()
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for h in headers:
        offsets = h.sharding_offsets()
        for key, loc in h.tensors.items():
            if weight_map is not None and weight_map.get(key) != h.name:
                continue
            offs = offsets.get(key, (0,) * len(loc.size))
            prev = seen.get((key, offs))
            if prev is not None:
                raise CheckpointFormatError(
                    f"{source}: tensor {key!r} (chunk at {list(offs)}) is in both {prev} and "
                    f"{h.name}; the checkpoint is ambiguous"
                )
            seen[(key, offs)] = h.name
            md = sdm.get(key)
            if md is None:
                md = sdm[key] = k.TensorStorageMetadata(
                    properties=k.TensorProperties(dtype=loc.dtype),
                    size=torch.Size([o + s for o, s in zip(offs, loc.size)]),
                    chunks=[],
                )
            elif md.properties.dtype != loc.dtype or len(md.size) != len(loc.size):
                raise CheckpointFormatError(
                    f"{source}: chunks of tensor {key!r} disagree on dtype or rank "
                    f"({md.properties.dtype} vs {loc.dtype} in {h.name})"
                )
            else:
                md.size = torch.Size([max(a, o + s) for a, o, s in zip(md.size, offs, loc.size)])
            storage[k.MetadataIndex(key, offs, len(md.chunks))] = KnownTensor(loc)
            md.chunks.append(
                k.ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(loc.size))
            )
    check_weight_map(weight_map, sdm, source)
    return k.FormatMetadata(
        state_dict_metadata=dict(sdm),
        storage_data=storage,
        storage_meta=k.StorageMeta(),
        format="safetensors",
        source=source,
    )


def mark_dcp_safetensors(md: Metadata) -> int:
    """Replace the ``storage_data`` entries of tensors saved with
    ``SerializationFormat.SAFETENSORS``
    by :class:`BlobTensor`; return how many.

    torch's ``FileSystemWriter`` records every tensor of such a file at the same offset (where
    the safetensors blob starts) with its byte count as the length; a torch.save record of a
    tensor is always longer than the tensor's bytes (zip headers), so the two never mix up.
    """
    # (a DCP checkpoint's metadata: DCP's types, imported with it)
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    sd = md.storage_data
    if not isinstance(sd, dict):
        return 0
    marked = 0
    for index, info in list(sd.items()):
        smd = md.state_dict_metadata.get(index.fqn) if isinstance(index, MetadataIndex) else None
        if not isinstance(smd, TensorStorageMetadata) or getattr(
            info, "transform_descriptors", None
        ):
            continue
        path, offset, length = (
            getattr(info, "relative_path", None),
            getattr(info, "offset", None),
            getattr(info, "length", None),
        )
        if not isinstance(path, str) or not isinstance(offset, int) or not isinstance(length, int):
            continue
        chunk = _chunk_for(smd, index)
        if chunk is None:
            continue
        dtype = smd.properties.dtype
        if not isinstance(dtype, torch.dtype) or length != math.prod(chunk.sizes) * dtype.itemsize:
            continue
        try:
            check_relative_path(path, "")
        except CheckpointFormatError:
            continue  # left as it is: the reader refuses it with the metadata's other entries
        sd[index] = BlobTensor(
            path, offset, length, index.fqn, tuple(chunk.offsets), dtype, tuple(chunk.sizes)
        )
        marked += 1
    return marked


def _chunk_for(smd: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata | None:
    i = index.index
    if i is not None and 0 <= i < len(smd.chunks) and smd.chunks[i].offsets == index.offset:
        return smd.chunks[i]
    return next((c for c in smd.chunks if c.offsets == index.offset), None)


async def aresolve_blob_tensors(
    entries: Iterable[BlobTensor],
    fetch: Callable[[str, int, int], Awaitable[bytes]],
    size_of: Callable[[str], Awaitable[int]],
    *,
    url: Callable[[str], str],
    max_header_size: int,
) -> dict[BlobTensor, TensorLocation]:
    """Locate :class:`BlobTensor` entries: read each blob's header once (concurrently)."""
    blobs: dict[tuple[str, int], list[BlobTensor]] = {}
    for e in entries:
        blobs.setdefault((e.relative_path, e.offset), []).append(e)

    async def one(name: str, base: int) -> SafetensorsHeader:
        size = await size_of(name)
        if size < base:
            raise CheckpointFormatError(
                f"{url(name)} is {size} bytes; the metadata places a safetensors blob at {base}"
            )
        return await aread_header(
            lambda lo, hi: fetch(name, lo, hi),
            name=name,
            base=base,
            blob_size=size - base,
            where=f"{url(name)} (safetensors at byte {base})",
            max_header_size=max_header_size,
        )

    keys = list(blobs)
    headers = await asyncio.gather(*(one(n, b) for n, b in keys))
    out: dict[BlobTensor, TensorLocation] = {}
    for (name, _), header in zip(keys, headers):
        offsets = header.sharding_offsets()
        for e in blobs[(name, header.base)]:
            loc = header.tensors.get(e.key)
            if loc is None:
                raise CheckpointFormatError(
                    f"{header.where}: the metadata places tensor {e.key!r} here but the "
                    "safetensors header does not hold it"
                )
            if (
                loc.dtype != e.dtype
                or tuple(loc.size) != e.sizes
                or (e.key in offsets and offsets[e.key] != e.saved_offsets)
            ):
                raise CheckpointFormatError(
                    f"{loc.where}: holds {loc.dtype} of shape {list(loc.size)} at offsets "
                    f"{list(offsets.get(e.key, ()))}, the metadata says {e.dtype} of shape "
                    f"{list(e.sizes)} at "
                    f"{list(e.saved_offsets)}"
                )
            out[e] = loc
    return out
