"""Which format a checkpoint URL holds: a DCP directory (``.metadata``), a safetensors file,
directory or index, a zip-format torch.save file or an index of them.

:func:`aprobe_first` runs before ``.metadata`` is looked for (a URL that names a file),
:func:`aprobe_fallback` when it is missing (a Hugging Face directory). Both answer with a
synthesised :class:`~asyncload.formats.entries.FormatMetadata`, or ``None``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from asyncload.common.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from asyncload.common.options import CheckPolicy, ChunkPolicy
from asyncload.common.paths import check_relative_path
from asyncload.formats.dcpv2_names import METADATA_FILE, is_torch_checkpointing, item_file_hint
from asyncload.formats.entries import (
    HF_INDEX,
    HF_SINGLE,
    Fetcher,
    OpenRoot,
    ReadSlots,
    split_file_url,
)
from asyncload.formats.location import may_be_a_file
from asyncload.formats.safetensors import (
    HEADER_PROBE,
    SafetensorsHeader,
    _asafetensors_files,
    _safetensors_metadata,
    aread_header,
    looks_like_safetensors,
)
from asyncload.formats.safetensors_header import _no_duplicates
from asyncload.formats.window import HEAD_PROBE
from asyncload.storage import RetryingStorage, is_local

if TYPE_CHECKING:
    from asyncload.formats.dcp_format import FormatMetadata

__all__ = ["aprobe_fallback", "aprobe_first"]


#: Legacy torch.save files start with the pickled magic number 0x1950a86a20f9469cfc6c.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


async def aprobe_first(
    checkpoint: str | os.PathLike[str],
    open_root: OpenRoot,
    checks: CheckPolicy,
    chunking: ChunkPolicy,
    *,
    slots: ReadSlots,
) -> FormatMetadata | None:
    """Before looking for ``.metadata``: a checkpoint that is a file (a local file, or a URL
    whose name ends in ``.safetensors``, ``.json``, ``.pt``, ``.bin`` ...). ``None`` otherwise.
    Every read holds one of ``slots`` (the caller's meter of reads)."""
    if not may_be_a_file(checkpoint):  # one stat where local: cheaper than a hop
        return None
    if is_local(checkpoint):
        parent, name = split_file_url(checkpoint)
        fetcher = Fetcher(await open_root(parent), checks, chunking, slots=slots)
        size = await fetcher.size(name)
        if size is None:
            raise CheckpointFormatError(f"{checkpoint} is an empty file, not a checkpoint")
        return await _afile(fetcher, name, size, str(checkpoint))
    parent, name = split_file_url(checkpoint)
    return await _aremote_file(
        Fetcher(await open_root(parent), checks, chunking, slots=slots), name, str(checkpoint)
    )


async def aprobe_fallback(
    checkpoint: str | os.PathLike[str],
    storage: RetryingStorage,
    open_root: OpenRoot,
    checks: CheckPolicy,
    chunking: ChunkPolicy,
    *,
    slots: ReadSlots,
) -> FormatMetadata | None:
    """``.metadata`` is missing: a Hugging Face directory, or the URL itself is a file.

    ``storage`` is opened at ``checkpoint``. Returns ``None`` when nothing readable is there.
    Every read holds one of ``slots`` (the caller's meter of reads; the fetchers of the
    probe, used one after the other, share it).
    """
    fetcher = Fetcher(storage, checks, chunking, slots=slots)
    size = await fetcher.size(HF_INDEX)
    if size is not None:
        return await _aindex(fetcher, HF_INDEX, size, str(checkpoint))
    size = await fetcher.size(HF_SINGLE)
    if size is not None:
        return await _afile(fetcher, HF_SINGLE, size, str(checkpoint))
    if not is_local(checkpoint) and (
        await fetcher.size(METADATA_FILE) is not None or str(checkpoint).endswith("/")
    ):
        # a torch-checkpointing directory, before the URL is tried as a file: over HTTP the
        # directory's URL answers with its index page, which is no checkpoint file
        names = await fetcher.listdir()
        if is_torch_checkpointing(names):
            return await _adirectory(fetcher, names, str(checkpoint))
    if not is_local(checkpoint):
        parent, name = split_file_url(checkpoint)
        if name:
            md = await _aremote_file(
                Fetcher(await open_root(parent), checks, chunking, slots=slots),
                name,
                str(checkpoint),
            )
            if md is not None:
                return md
            storage = await open_root(str(checkpoint))
            fetcher = Fetcher(storage, checks, chunking, slots=slots)
    names = await fetcher.listdir()
    if is_torch_checkpointing(names):
        return await _adirectory(fetcher, names, str(checkpoint))
    shards = [n for n in names if n.endswith(".safetensors")]
    if shards:
        return await _asafetensors_files(fetcher, shards, None, str(checkpoint))
    indexes = [n for n in names if n.endswith(".index.json")]
    if len(indexes) == 1:
        size = await fetcher.size(indexes[0])
        if size is not None:
            return await _aindex(fetcher, indexes[0], size, str(checkpoint))
    return None


def _probe_size(name: str) -> int:
    """The bytes read first of a file that is not an index."""
    return HEADER_PROBE if name.endswith(".safetensors") else min(HEAD_PROBE, HEADER_PROBE)


async def _aremote_file(fetcher: Fetcher, name: str, source: str) -> FormatMetadata | None:
    """The remote file ``name``, or ``None`` when it does not exist. Its first bytes and its
    size come in one request where the store can (no HEAD first); an index is read whole."""
    if name.endswith(".json"):
        size = await fetcher.size(name)
        return None if size is None else await _aindex(fetcher, name, size, source)
    got = await fetcher.read_prefix(name, _probe_size(name))
    if got is None:
        return None
    head, size = got
    return await _afile(fetcher, name, size, source, head=head)


async def _afile(
    fetcher: Fetcher, name: str, size: int, source: str, *, head: bytes | None = None
) -> FormatMetadata:
    """One file: an index (``*.json``), safetensors, or a zip-format torch.save archive;
    ``head``: its first bytes, already read (at least what it probes first, or all of it)."""
    url = fetcher.url(name)
    if name.endswith(".json"):
        return await _aindex(fetcher, name, size, source)
    if head is None or len(head) < min(size, _probe_size(name)):
        head = await fetcher.read(name, 0, min(size, _probe_size(name)))
    if head.startswith(b"PK\x03\x04"):
        try:
            md = await _atorchsave(fetcher, [(name, size)], None, source)
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            hint = item_file_hint(name)
            if hint is None:
                raise
            raise type(exc)(f"{exc} ({hint})") from None
        return md

    def read_header() -> Awaitable[SafetensorsHeader]:
        return aread_header(
            fetcher.reader(name),
            name=name,
            base=0,
            blob_size=size,
            where=url,
            max_header_size=fetcher.checks.max_metadata_size,
            head=head,
        )

    if looks_like_safetensors(head, size):
        return _safetensors_metadata([await read_header()], None, source)
    if head.startswith(_LEGACY_MAGIC) or head[:1] == b"\x80":
        raise CheckpointFormatError(
            f"{url} is a legacy (pre-1.6, non-zip) torch.save file or a raw pickle; asyncload "
            f"reads only the zip "
            "format. Re-save it with torch.save(obj, path) (the default since torch 1.6, "
            "_use_new_zipfile_serialization=True), or load it with torch.load"
        )
    if name.endswith(".safetensors"):
        await read_header()  # let the header parser say precisely what is wrong
    raise CheckpointFormatError(
        f"{url} is not a checkpoint asyncload reads: not a DCP directory, a safetensors "
        "file or a zip-format torch.save file"
    )


async def _aindex(fetcher: Fetcher, name: str, size: int, source: str) -> FormatMetadata:
    """A Hugging Face index (``{"weight_map": {key: file}}``) of safetensors or torch.save
    shards."""
    url = fetcher.url(name)
    limit = min(fetcher.checks.max_metadata_size, 256 << 20)
    if size > limit:
        raise CheckpointFormatError(
            f"{url} is {size} bytes, more than the {limit} allowed for an index "
            f"(LoadOptions.max_metadata_size)"
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
        raise CheckpointFormatError(
            f"{url} has no weight_map object (key -> file): not a sharded checkpoint index"
        )
    prefix = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    weight_map = {k: prefix + check_relative_path(v, url) for k, v in wmap.items()}
    files = sorted(set(weight_map.values()))
    if all(f.endswith(".safetensors") for f in files):
        return await _asafetensors_files(fetcher, files, weight_map, source)
    sizes = await asyncio.gather(*(fetcher.size(f) for f in files))
    missing = [f for f, s in zip(files, sizes) if s is None]
    if missing:
        raise CheckpointNotFoundError(
            f"{fetcher.url(missing[0])} is named by {url} but does not exist: the checkpoint is "
            f"incomplete",
            path=fetcher.url(missing[0]),
            status=404,
        )
    heads = await asyncio.gather(
        *(fetcher.read(f, 0, min(s or 0, 4)) for f, s in zip(files, sizes))
    )
    if all(h.startswith(b"PK\x03\x04") for h in heads):
        return await _atorchsave(
            fetcher, list(zip(files, [s or 0 for s in sizes])), weight_map, source
        )
    raise CheckpointFormatError(
        f"{url} names shards that are neither all safetensors nor all zip-format torch.save files"
    )


async def _adirectory(fetcher: Fetcher, names: Sequence[str], source: str) -> FormatMetadata:
    """A torch-checkpointing directory's metadata (:mod:`.dcpv2`, imported by the first)."""
    from asyncload.formats.dcpv2 import adirectory_metadata

    return await adirectory_metadata(fetcher, names, source)


async def _atorchsave(
    fetcher: Fetcher,
    files: Sequence[tuple[str, int]],
    weight_map: dict[str, str] | None,
    source: str,
) -> FormatMetadata:
    """Zip-format torch.save files' metadata (:mod:`.torchsave`, imported by the first)."""
    from asyncload.formats.torchsave import _atorchsave_files

    return await _atorchsave_files(fetcher, files, weight_map, source)
