"""Checkpoint formats behind one small interface: which format a URL holds, and for each
saved key where its bytes are.

asyncload reads four layouts through the same pipeline:

``dcp``
    a directory with ``.metadata`` + ``*.distcp`` (what ``dcp.save`` writes). Records are
    torch.save archives located when read (:mod:`asyncload._dcp`), or, for files written with
    ``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)``, a safetensors
    blob after the objects (:class:`BlobTensor`, located when read).
``safetensors``
    one ``*.safetensors`` file, a directory holding ``model.safetensors``, or several
    ``*.safetensors`` files (``model.safetensors.index.json`` names them; torch's
    ``HuggingFaceStorageWriter(save_distributed=True)`` shards carry their chunk offsets).
``torch.save``
    one zip-format ``torch.save`` file (or HF ``pytorch_model.bin.index.json`` shards of them).

For the non-DCP formats :func:`aprobe_first` / :func:`aprobe_fallback` synthesise a DCP
``Metadata`` (one chunk per tensor, or the chunks the shards name) whose ``storage_data``
maps each ``MetadataIndex`` to a :class:`KnownTensor` (a :class:`TensorLocation`) or a
:class:`KnownObject`, so that ``dcp.load``'s planning - including DTensor and sharded
destinations that read only their slice - works unchanged, and the reader reads each
tensor's bytes straight into the destination.

Keys of a nested ``torch.save`` dict are flattened the way DCP flattens a state dict
(``{"model": {"w": t}}`` -> ``"model.w"``). When none of the destination's keys is found
but all of those found sit under one prefix (``model.``, ``module.``, ``state_dict.``),
the planner loads from under that prefix (:func:`rebase`).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ._chunks import TensorLocation
from ._errors import AsyncLoadError, CheckpointFormatError, CheckpointNotFoundError
from ._options import LoadOptions
from ._paths import check_relative_path
from ._retry import RetryingStorage
from ._safe_pickle import TensorRef
from ._safetensors import HEADER_PROBE, SafetensorsHeader, _no_duplicates, aread_header, looks_like_safetensors
from ._storage import is_local, local_root
from ._torchsave import (
    HEAD_PROBE,
    TAIL_PROBE,
    ArchiveLayout,
    ByteWindow,
    NeedBytes,
    StorageLoc,
    materialize,
    parse_archive,
    tensor_location,
)
from ._zip import LOCAL_HEADER_SIZE, locate_central_directory, parse_central_directory

__all__ = [
    "HF_INDEX",
    "HF_SINGLE",
    "BlobTensor",
    "FormatMetadata",
    "KnownObject",
    "KnownTensor",
    "amaterialize",
    "aprobe_fallback",
    "aprobe_first",
    "aresolve_blob_tensors",
    "mark_dcp_safetensors",
    "rebase",
    "split_file_url",
]

log = logging.getLogger("asyncload.formats")

#: The names Hugging Face (and torch's HuggingFaceStorageWriter) give a checkpoint's files.
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
#: Names whose URL is taken for a file first (before looking for ``.metadata`` under it).
_FILE_SUFFIXES = (".safetensors", ".json", ".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl", ".pickle")
#: Extra-field bytes guessed for the local headers of data.pkl and byteorder, read together
#: with their data (torch pads entries to 64-byte alignment; a wrong guess costs one more read).
_LOCAL_EXTRA_GUESS = 128
#: Layout reads of a torch.save file are joined across gaps up to this (and ``min_chunk_size``):
#: a gap is a storage's data, read again later, so only small ones are worth reading through.
_LAYOUT_MAX_GAP = 64 << 10
#: Legacy torch.save files start with the pickled magic number 0x1950a86a20f9469cfc6c.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


# --- storage_data entries -------------------------------------------------------------


@dataclass(frozen=True)
class KnownTensor:
    """A ``storage_data`` entry whose tensor (or saved chunk) is already located."""

    location: TensorLocation

    @property
    def relative_path(self) -> str:
        return self.location.name

    @property
    def offset(self) -> int:
        return self.location.data_start

    @property
    def length(self) -> int:
        return self.location.storage_nbytes


@dataclass(frozen=True)
class BlobTensor:
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


@dataclass(frozen=True)
class KnownObject:
    """A non-tensor value decoded (allow-listed) from a torch.save pickle. Tensors inside it
    (a tuple holding tensors, say) are :class:`TensorRef` and are read by :func:`amaterialize`."""

    obj: Any
    relative_path: str
    storages: dict[str, StorageLoc] = field(default_factory=dict)
    where: str = ""
    offset: int = 0
    length: int = 0


@dataclass
class FormatMetadata(Metadata):
    """DCP ``Metadata`` synthesised for a non-DCP checkpoint."""

    #: ``"safetensors"`` or ``"torch.save"``.
    format: str = "dcp"
    #: What was found, for messages (``"s3://b/model.safetensors"``).
    source: str = ""
    #: The key prefix the planner stripped (:func:`rebase`), or ``""``.
    prefix: str = ""


# --- where things are -------------------------------------------------------------------


def split_file_url(checkpoint: str | os.PathLike[str]) -> tuple[str, str]:
    """``(parent, file name)`` of a file checkpoint: a local path, ``file://`` or fsspec URL.

    The parent is what storage opens; the name is read relative to it.
    """
    if is_local(checkpoint):
        path = os.path.abspath(local_root(checkpoint))
        parent, name = os.path.split(path)
        return parent, name
    s = str(checkpoint)
    proto, rest = s.split("://", 1)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    if "/" in rest.rstrip("/"):
        head, name = rest.rstrip("/").rsplit("/", 1)
        return f"{proto}://{head}", name
    return f"{proto}://", rest.rstrip("/")


class Fetcher:
    """Reads for format probing over the load's :class:`RetryingStorage` (its retry policy,
    counted in the load's stats), at most ``options.max_in_flight`` at once; a missing file
    is ``None`` rather than an error."""

    def __init__(self, storage: RetryingStorage, options: LoadOptions) -> None:
        self.storage = storage
        self.options = options
        self._sem = asyncio.Semaphore(max(1, options.max_in_flight))

    def url(self, name: str) -> str:
        return self.storage.url(name)

    async def read(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        async with self._sem:
            return bytes(await self.storage.read(name, start, end))

    def reader(self, name: str) -> Callable[[int, int], Awaitable[bytes]]:
        """``read(start, end)`` of file ``name``."""

        async def read(start: int, end: int) -> bytes:
            return await self.read(name, start, end)

        return read

    async def size(self, name: str) -> int | None:
        """The file's size, or ``None`` when it does not exist (or is a directory)."""
        try:
            async with self._sem:
                size = await self.storage.size(name)
        except CheckpointNotFoundError:
            return None
        except AsyncLoadError as exc:
            # a local path below a regular file ("model.pt/.metadata") is NotADirectoryError
            if isinstance(exc.__cause__, NotADirectoryError):
                return None
            raise
        return int(size) if size else None

    async def listdir(self) -> list[str]:
        """Names of the files directly under the storage root ([] when it cannot be listed)."""
        return await self.storage.listdir()


OpenRoot = Callable[[str], Awaitable[RetryingStorage]]


# --- detection --------------------------------------------------------------------------


async def aprobe_first(
    checkpoint: str | os.PathLike[str], open_root: OpenRoot, options: LoadOptions
) -> FormatMetadata | None:
    """Before looking for ``.metadata``: a checkpoint that is a file (a local file, or a URL
    whose name ends in ``.safetensors``, ``.json``, ``.pt``, ``.bin`` ...). ``None`` otherwise."""
    if is_local(checkpoint):
        if not os.path.isfile(local_root(checkpoint)):  # noqa: ASYNC240 - one stat, cheaper than a hop
            return None
        parent, name = split_file_url(checkpoint)
        fetcher = Fetcher(await open_root(parent), options)
        size = await fetcher.size(name)
        if size is None:
            raise CheckpointFormatError(f"{checkpoint} is an empty file, not a checkpoint")
        return await _afile(fetcher, name, size, str(checkpoint))
    s = str(checkpoint)
    if s.endswith("/") or not s.split("?", 1)[0].lower().endswith(_FILE_SUFFIXES):
        return None
    parent, name = split_file_url(checkpoint)
    fetcher = Fetcher(await open_root(parent), options)
    size = await fetcher.size(name)
    if size is None:
        return None
    return await _afile(fetcher, name, size, s)


async def aprobe_fallback(
    checkpoint: str | os.PathLike[str], storage: RetryingStorage, open_root: OpenRoot, options: LoadOptions
) -> FormatMetadata | None:
    """``.metadata`` is missing: a Hugging Face directory, or the URL itself is a file.

    ``storage`` is opened at ``checkpoint``. Returns ``None`` when nothing readable is there.
    """
    fetcher = Fetcher(storage, options)
    size = await fetcher.size(HF_INDEX)
    if size is not None:
        return await _aindex(fetcher, HF_INDEX, size, str(checkpoint))
    size = await fetcher.size(HF_SINGLE)
    if size is not None:
        return await _afile(fetcher, HF_SINGLE, size, str(checkpoint))
    if not is_local(checkpoint):
        parent, name = split_file_url(checkpoint)
        if name:
            file_fetcher = Fetcher(await open_root(parent), options)
            size = await file_fetcher.size(name)
            if size is not None:
                return await _afile(file_fetcher, name, size, str(checkpoint))
            storage = await open_root(str(checkpoint))
            fetcher = Fetcher(storage, options)
    names = await fetcher.listdir()
    shards = [n for n in names if n.endswith(".safetensors")]
    if shards:
        return await _asafetensors_files(fetcher, shards, None, str(checkpoint))
    indexes = [n for n in names if n.endswith(".index.json")]
    if len(indexes) == 1:
        size = await fetcher.size(indexes[0])
        if size is not None:
            return await _aindex(fetcher, indexes[0], size, str(checkpoint))
    return None


async def _afile(fetcher: Fetcher, name: str, size: int, source: str) -> FormatMetadata:
    """One file: an index (``*.json``), safetensors, or a zip-format torch.save archive."""
    url = fetcher.url(name)
    if name.endswith(".json"):
        return await _aindex(fetcher, name, size, source)
    probe = HEADER_PROBE if name.endswith(".safetensors") else min(HEAD_PROBE, HEADER_PROBE)
    head = await fetcher.read(name, 0, min(size, probe))
    if head.startswith(b"PK\x03\x04"):
        md = await _atorchsave_files(fetcher, [(name, size)], None, source)
        return md
    if looks_like_safetensors(head, size):
        header = await aread_header(
            fetcher.reader(name),
            name=name,
            base=0,
            blob_size=size,
            where=url,
            max_header_size=fetcher.options.max_metadata_size,
            head=head,
        )
        return _safetensors_metadata([header], None, source)
    if head.startswith(_LEGACY_MAGIC) or head[:1] == b"\x80":
        raise CheckpointFormatError(
            f"{url} is a legacy (pre-1.6, non-zip) torch.save file or a raw pickle; asyncload reads only the zip "
            "format. Re-save it with torch.save(obj, path) (the default since torch 1.6, "
            "_use_new_zipfile_serialization=True), or load it with torch.load"
        )
    if name.endswith(".safetensors"):
        # let the header parser say precisely what is wrong
        await aread_header(
            fetcher.reader(name),
            name=name,
            base=0,
            blob_size=size,
            where=url,
            max_header_size=fetcher.options.max_metadata_size,
            head=head,
        )
    raise CheckpointFormatError(
        f"{url} is not a checkpoint asyncload reads: not a DCP directory, a safetensors "
        "file or a zip-format torch.save file"
    )


async def _aindex(fetcher: Fetcher, name: str, size: int, source: str) -> FormatMetadata:
    """A Hugging Face index (``{"weight_map": {key: file}}``) of safetensors or torch.save shards."""
    url = fetcher.url(name)
    limit = min(fetcher.options.max_metadata_size, 256 << 20)
    if size > limit:
        raise CheckpointFormatError(
            f"{url} is {size} bytes, more than the {limit} allowed for an index (LoadOptions.max_metadata_size)"
        )
    raw = await fetcher.read(name, 0, size)
    try:
        index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except RecursionError as exc:
        raise CheckpointFormatError(f"{url} is nested too deeply") from exc
    except ValueError as exc:
        raise CheckpointFormatError(f"{url} is not valid UTF-8 JSON: {exc}"[:500]) from exc
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) for k in wmap):
        raise CheckpointFormatError(f"{url} has no weight_map object (key -> file): not a sharded checkpoint index")
    prefix = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    weight_map = {k: prefix + check_relative_path(v, url) for k, v in wmap.items()}
    files = sorted(set(weight_map.values()))
    if all(f.endswith(".safetensors") for f in files):
        return await _asafetensors_files(fetcher, files, weight_map, source)
    sizes = await asyncio.gather(*(fetcher.size(f) for f in files))
    missing = [f for f, s in zip(files, sizes) if s is None]
    if missing:
        raise CheckpointNotFoundError(
            f"{fetcher.url(missing[0])} is named by {url} but does not exist: the checkpoint is incomplete",
            path=fetcher.url(missing[0]),
            status=404,
        )
    heads = await asyncio.gather(*(fetcher.read(f, 0, min(s or 0, 4)) for f, s in zip(files, sizes)))
    if all(h.startswith(b"PK\x03\x04") for h in heads):
        return await _atorchsave_files(fetcher, list(zip(files, [s or 0 for s in sizes])), weight_map, source)
    raise CheckpointFormatError(
        f"{url} names shards that are neither all safetensors nor all zip-format torch.save files"
    )


# --- safetensors ------------------------------------------------------------------------


async def _asafetensors_files(
    fetcher: Fetcher, files: Sequence[str], weight_map: dict[str, str] | None, source: str
) -> FormatMetadata:
    sizes = await asyncio.gather(*(fetcher.size(f) for f in files))
    for f, s in zip(files, sizes):
        if s is None:
            raise CheckpointNotFoundError(
                f"{fetcher.url(f)} is named by the checkpoint's index but does not exist: the checkpoint is incomplete",
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
                max_header_size=fetcher.options.max_metadata_size,
            )
            for f, s in zip(files, sizes)
        )
    )
    return _safetensors_metadata(list(headers), weight_map, source)


def _safetensors_metadata(
    headers: Sequence[SafetensorsHeader], weight_map: dict[str, str] | None, source: str
) -> FormatMetadata:
    """One chunk per (file, key); chunk offsets from ``DCP_SHARDING_INFO`` where torch wrote them."""
    sdm: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, Any] = {}
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
                md = sdm[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=loc.dtype),
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
            storage[MetadataIndex(key, offs, len(md.chunks))] = KnownTensor(loc)
            md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(loc.size)))
    if weight_map is not None:
        missing = [k for k in weight_map if k not in sdm]
        if missing:
            raise CheckpointFormatError(
                f"{source}: the index places {missing[0]!r} in {weight_map[missing[0]]}, "
                f"whose header does not hold it ({len(missing)} keys missing)"
            )
    return FormatMetadata(
        state_dict_metadata=dict(sdm),
        storage_data=storage,
        storage_meta=StorageMeta(),
        format="safetensors",
        source=source,
    )


def mark_dcp_safetensors(md: Metadata) -> int:
    """Replace the ``storage_data`` entries of tensors saved with ``SerializationFormat.SAFETENSORS``
    by :class:`BlobTensor`; return how many.

    torch's ``FileSystemWriter`` records every tensor of such a file at the same offset (where
    the safetensors blob starts) with its byte count as the length; a torch.save record of a
    tensor is always longer than the tensor's bytes (zip headers), so the two never mix up.
    """
    sd = md.storage_data
    if not isinstance(sd, dict):
        return 0
    marked = 0
    for index, info in list(sd.items()):
        smd = md.state_dict_metadata.get(index.fqn) if isinstance(index, MetadataIndex) else None
        if not isinstance(smd, TensorStorageMetadata) or getattr(info, "transform_descriptors", None):
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
        sd[index] = BlobTensor(path, offset, length, index.fqn, tuple(chunk.offsets), dtype, tuple(chunk.sizes))
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
                    f"{list(offsets.get(e.key, ()))}, the metadata says {e.dtype} of shape {list(e.sizes)} at "
                    f"{list(e.saved_offsets)}"
                )
            out[e] = loc
    return out


# --- torch.save -------------------------------------------------------------------------


async def _atorchsave_files(
    fetcher: Fetcher, files: Sequence[tuple[str, int]], weight_map: dict[str, str] | None, source: str
) -> FormatMetadata:
    layouts = await asyncio.gather(*(_alayout(fetcher, name, size) for name, size in files))
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    origin: dict[str, str] = {}
    for (name, _), layout in zip(files, layouts):
        if not isinstance(layout.obj, dict):
            raise CheckpointFormatError(
                f"{layout.where} holds a {type(layout.obj).__name__}, not a dict; asyncload loads state dicts "
                "(a dict of tensors, possibly nested) from torch.save files"
            )
        for key, value in _flatten(layout.obj).items():
            if weight_map is not None and weight_map.get(key) != name:
                continue
            if key in origin:
                raise CheckpointFormatError(f"{source}: key {key!r} is in both {origin[key]} and {name}")
            origin[key] = name
            if isinstance(value, TensorRef):
                loc = tensor_location(layout, name, value)
                loc = TensorLocation(
                    name=loc.name,
                    data_start=loc.data_start,
                    storage_nbytes=loc.storage_nbytes,
                    dtype=loc.dtype,
                    size=loc.size,
                    stride=loc.stride,
                    storage_offset=loc.storage_offset,
                    crc32=loc.crc32,
                    where=f"tensor {key!r} (storage data/{value.storage.key}) of {layout.where}",
                )
                zeros = (0,) * len(loc.size)
                sdm[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=loc.dtype, requires_grad=value.requires_grad),
                    size=torch.Size(loc.size),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(loc.size))],
                )
                storage[MetadataIndex(key, zeros, 0)] = KnownTensor(loc)
            else:
                refs: list[TensorRef] = []
                _refs_in(value, refs)
                sts = {r.storage.key: layout.storages[r.storage.key] for r in refs}
                sdm[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = KnownObject(value, name, sts, f"object {key!r} of {layout.where}")
    if weight_map is not None:
        missing = [k for k in weight_map if k not in sdm]
        if missing:
            raise CheckpointFormatError(
                f"{source}: the index places {missing[0]!r} in {weight_map[missing[0]]}, "
                f"which does not hold it ({len(missing)} keys missing)"
            )
    return FormatMetadata(
        state_dict_metadata=sdm, storage_data=storage, storage_meta=StorageMeta(), format="torch.save", source=source
    )


def _flatten(obj: dict[Any, Any]) -> dict[str, Any]:
    """Flatten like DCP flattens a destination state dict (TensorRefs count as tensors)."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    flat: dict[str, Any] = {}

    def visit(path: tuple[Any, ...], value: Any) -> None:
        key = ".".join(map(str, path))
        if key in flat:
            raise CheckpointFormatError(f"two entries of the torch.save dict flatten to the same key {key!r}")
        flat[key] = value

    try:
        traverse_state_dict(obj, visit, keep_traversing=lambda v: isinstance(v, (TensorRef, torch.Tensor)))
    except RecursionError as exc:
        raise CheckpointFormatError("the torch.save dict is nested too deeply") from exc
    return flat


def _refs_in(obj: Any, out: list[TensorRef], depth: int = 0) -> None:
    if depth > 200:
        raise CheckpointFormatError("object is nested more than 200 levels deep")
    if isinstance(obj, TensorRef):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _refs_in(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _refs_in(v, out, depth + 1)


async def _alayout(fetcher: Fetcher, name: str, size: int) -> ArchiveLayout:
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
        win.add(cd_off, await fetcher.read(name, cd_off, min(cd_off + cd_size, size)))
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
            return parse_archive(win, 0, size, url, max_pickle=opts.max_metadata_size)
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


# --- keys -----------------------------------------------------------------------------------


def rebase(md: Metadata | None, dest_keys: Collection[str]) -> FormatMetadata | None:
    """A view of a synthesised ``md`` with its keys taken from under one prefix, when that is
    what the destination's keys match; ``None`` when no prefix is needed or none fits.

    None of ``dest_keys`` is a key of ``md``, and one prefix ``P`` (``"model"``, ``"module"``,
    ``"state_dict.model"`` ...) makes strictly more of them ``P.<key>`` keys than any other.
    The view holds only the keys under ``P`` (without it); ``md.storage_data`` gains the
    stripped indexes (the reader shares that dict).
    """
    if not isinstance(md, FormatMetadata) or md.prefix or not dest_keys:
        return None
    saved = md.state_dict_metadata
    keys = list(dest_keys)
    if any(k in saved for k in keys):
        return None
    candidates: set[str] = set()
    for d in keys[:16]:
        suffix = "." + d
        for k in saved:
            if k.endswith(suffix) and len(k) > len(suffix):
                candidates.add(k[: -len(suffix)])
    best, best_hits, tie = "", 0, False
    for p in sorted(candidates):
        hits = sum(1 for d in keys if f"{p}.{d}" in saved)
        if hits > best_hits:
            best, best_hits, tie = p, hits, False
        elif hits == best_hits:
            tie = True
    if not best or tie:
        return None
    pre = best + "."
    sdm = {k[len(pre) :]: v for k, v in saved.items() if k.startswith(pre)}
    for index, entry in list(md.storage_data.items()):
        if index.fqn.startswith(pre):
            md.storage_data[MetadataIndex(index.fqn[len(pre) :], index.offset, index.index)] = entry
    log.info(
        "%s: loading the destination's keys from under %r (%d of %d destination keys found there)",
        md.source,
        best,
        best_hits,
        len(keys),
    )
    return FormatMetadata(
        state_dict_metadata=sdm,
        planner_data=md.planner_data,
        storage_data=md.storage_data,
        storage_meta=md.storage_meta,
        version=md.version,
        format=md.format,
        source=md.source,
        prefix=best,
    )
