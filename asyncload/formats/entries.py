"""The interface every checkpoint format implements, and what the formats share.

A format module answers one question for the reader: for each saved key, where are its
bytes? For DCP checkpoints the answer is a record located when it is read
(:mod:`asyncload.engine.session`); every other format synthesises a DCP ``Metadata``
(:class:`FormatMetadata`) whose ``storage_data`` maps each ``MetadataIndex`` to a
:class:`FormatEntry`: a tensor already located (:class:`KnownTensor`), a tensor of a
safetensors blob inside a DCP file (:class:`~asyncload.formats.safetensors.BlobTensor`), or a
decoded object (:class:`~asyncload.formats.torchsave.KnownObject`). The reader asks each kind to
:meth:`FormatEntry.resolve` all its entries at once, with the load's reads (:class:`Fetcher`);
it never asks which kind an entry is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import asyncload.formats.plain as plain
from asyncload.common.errors import (
    AsyncLoadError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    StateDictMismatchError,
)
from asyncload.common.options import CheckPolicy, ChunkPolicy
from asyncload.formats.location import TensorLocation, split_file_url
from asyncload.storage import RetryingStorage

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload.formats.dcp_format import FormatMetadata

__all__ = [
    "HF_INDEX",
    "HF_SINGLE",
    "Fetcher",
    "FormatEntry",
    "FormatMetadata",
    "KnownTensor",
    "OpenRoot",
    "ReadSlots",
    "TensorLocation",
    "check_weight_map",
    "rebase",
    "source_of",
    "split_file_url",
]

log = logging.getLogger("asyncload.formats")


class FormatEntry:
    """A ``storage_data`` entry whose bytes a format module locates (not a DCP record).

    ``relative_path``, ``offset`` and ``length`` say which file and bytes it stands for
    (the reader checks the files against them before any destination is touched);
    ``holds_object`` whether it resolves to a decoded object instead of a tensor's
    :class:`TensorLocation`.
    """

    holds_object: ClassVar[bool] = False
    relative_path: str
    offset: int
    length: int

    @classmethod
    async def resolve(cls, entries: Sequence[Any], fetcher: Fetcher) -> list[Any]:
        """Locate (or decode) ``entries`` of this kind, all at once: for each, in order, its
        :class:`TensorLocation` (or its object)."""
        raise NotImplementedError


#: The names Hugging Face (and torch's HuggingFaceStorageWriter) give a checkpoint's files.
HF_INDEX = "model.safetensors.index.json"


HF_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class KnownTensor(FormatEntry):
    """A ``storage_data`` entry whose tensor (or saved chunk) is already located."""

    location: TensorLocation
    relative_path: str = field(init=False)
    offset: int = field(init=False)
    length: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "relative_path", self.location.name)
        object.__setattr__(self, "offset", self.location.data_start)
        object.__setattr__(self, "length", self.location.storage_nbytes)

    @classmethod
    async def resolve(cls, entries: Sequence[Any], fetcher: Fetcher) -> list[Any]:
        return [e.location for e in entries]


def __getattr__(name: str) -> Any:
    # FormatMetadata subclasses DCP's Metadata: its module (which imports DCP) is imported on
    # first use, not with this one (asyncload.formats.plain)
    if name == "FormatMetadata":
        from asyncload.formats.dcp_format import FormatMetadata

        return FormatMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ReadSlots(Protocol):
    """Where a :class:`Fetcher` takes its read slots: the engine's ``Meter`` of reads
    (``Meter(n, name=..., unit="reads")``), made by the fetcher's caller."""

    def hold(self, n: int = 1) -> AbstractAsyncContextManager[None]: ...


class Fetcher:
    """Reads for format probing over the load's :class:`RetryingStorage` (its retry policy,
    counted in the load's stats), each under one of ``slots`` (the caller's meter of reads:
    ``max_in_flight`` of them); a missing file is ``None`` rather than an error. ``checks``
    bound what a header or pickle may claim; ``chunking`` how a layout's reads are joined."""

    def __init__(
        self,
        storage: RetryingStorage,
        checks: CheckPolicy,
        chunking: ChunkPolicy,
        *,
        slots: ReadSlots,
    ) -> None:
        self.storage = storage
        self.checks = checks
        self.chunking = chunking
        self._slots = slots

    def url(self, name: str) -> str:
        return self.storage.url(name)

    async def read(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        async with self._slots.hold():
            return bytes(await self.storage.read(name, start, end))

    async def read_view(self, name: str, start: int, end: int) -> bytes | memoryview:
        """:meth:`read` without its copy, for reads as large as ``LoadOptions.max_metadata_size``
        (a zip directory): the store's own buffer, as bytes or a view of it."""
        if end <= start:
            return b""
        async with self._slots.hold():
            data = await self.storage.read(name, start, end)
        return data if isinstance(data, bytes) else memoryview(data)

    def reader(self, name: str) -> Callable[[int, int], Awaitable[bytes]]:
        """``read(start, end)`` of file ``name``."""

        async def read(start: int, end: int) -> bytes:
            return await self.read(name, start, end)

        return read

    async def size(self, name: str) -> int | None:
        """The file's size, or ``None`` when it does not exist (or is a directory)."""
        try:
            async with self._slots.hold():
                size = await self.storage.size(name)
        except AsyncLoadError as exc:
            if _absent(exc):
                return None
            raise
        return int(size) if size else None

    async def read_prefix(self, name: str, n: int) -> tuple[bytes, int] | None:
        """The file's first ``n`` bytes (all of it when shorter) and its size, in one request
        where the store can; ``None`` when it does not exist or is empty (as :meth:`size`)."""
        try:
            async with self._slots.hold():
                data, size = await self.storage.read_prefix(name, n)
        except AsyncLoadError as exc:
            if _absent(exc):
                return None
            raise
        return (bytes(data), size) if size else None

    async def listdir(self) -> list[str]:
        """Names of the files directly under the storage root ([] when it cannot be listed)."""
        return await self.storage.listdir()


def _absent(exc: AsyncLoadError) -> bool:
    """Whether ``exc`` says the file is not there: missing, or a local path below a regular
    file ("model.pt/.metadata": NotADirectoryError)."""
    return isinstance(exc, CheckpointNotFoundError) or isinstance(
        exc.__cause__, NotADirectoryError
    )


OpenRoot = Callable[[str], Awaitable[RetryingStorage]]


def source_of(md: Metadata | None) -> str:
    """What a load's metadata was read from, for messages: the file (or files) of a
    synthesised ``md``, a DCP checkpoint's directory; ``"the checkpoint"`` when unknown."""
    source = getattr(md, "source", "") or getattr(md, "_asyncload_source", "")
    return str(source) if source else "the checkpoint"


def rebase(md: Metadata | None, dest_keys: Collection[str]) -> FormatMetadata | None:
    """A view of ``md`` (any format: DCP, safetensors, torch.save) with its keys taken from
    under one prefix, when that is what the destination's keys match; ``None`` when no prefix
    is needed or none fits.

    None of ``dest_keys`` is a key of ``md``, and one prefix ``P`` (``"model"``, ``"module"``,
    ``"state_dict.model"`` ...) makes strictly more of them ``P.<key>`` keys than any other
    (counting first the keys that are tensors there, so a prefix holding the same names as
    objects, as DeepSpeed's ``param_shapes``, loses to the one holding the tensors):
    a training checkpoint ``{"model": ..., "optim": ..., "step": ...}`` loads into
    ``model.state_dict()``. The view holds only the keys under ``P`` (without it);
    ``md.storage_data`` gains the stripped indexes (the reader shares that dict).

    Raised: :class:`StateDictMismatchError` when two prefixes hold as many of the
    destination's keys (``{"model": ..., "ema": ...}``): which one is meant is the caller's
    choice (nest the destination under it).
    """
    if not plain.is_metadata(md) or not dest_keys:
        return None
    assert md is not None
    if getattr(md, "prefix", None):  # a view already
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
    # ranked by the keys that are tensors there, then by all: DeepSpeed's model-states file
    # holds the module's keys under "module" (tensors) and "param_shapes.0" (torch.Size objects)
    best, best_hits = "", (0, 0)
    ties: list[str] = []
    for p in sorted(candidates):
        found = [saved[f"{p}.{d}"] for d in keys if f"{p}.{d}" in saved]
        hits = (sum(plain.is_tensor_md(v) for v in found), len(found))
        if hits > best_hits:
            best, best_hits = p, hits
            ties = []
        elif hits == best_hits:
            ties.append(p)
    if not best:
        return None
    source = source_of(md)
    if ties:
        both = ", ".join(repr(p) for p in [best, *ties])
        raise StateDictMismatchError(
            f"{source}: none of the destination's {len(keys)} keys is a checkpoint key, and they are "
            f"found under {len(ties) + 1} prefixes alike ({both}: {best_hits[1]} keys each): nest the "
            f"destination under the one you mean ({{{best!r}: state_dict}}), or load the "
            "checkpoint with asyncload.read_state_dict and pick the entry"
        )
    pre = best + "."
    # the view is of md's own kind: DCP's types, or asyncload.formats.plain's
    kinds = plain.kinds() if not plain.is_plain(md) else plain.plain_kinds()
    sdm = {k[len(pre) :]: v for k, v in saved.items() if k.startswith(pre)}
    for index, entry in list(md.storage_data.items()):
        if index.fqn.startswith(pre):
            md.storage_data[
                kinds.MetadataIndex(index.fqn[len(pre) :], index.offset, index.index)
            ] = entry
    log.info(
        "%s: loading the destination's keys from under %r (%d of %d destination keys found there)",
        source,
        best,
        best_hits[1],
        len(keys),
    )
    return kinds.FormatMetadata(
        state_dict_metadata=sdm,
        planner_data=md.planner_data,
        storage_data=md.storage_data,
        storage_meta=md.storage_meta,
        version=md.version,
        format=getattr(md, "format", "dcp"),
        source=source if source != "the checkpoint" else "",
        prefix=best,
        templates=list(getattr(md, "templates", ()) or ()),
    )


def check_weight_map(
    weight_map: dict[str, str] | None, found: Collection[str], source: str
) -> None:
    """Every key an index places in a shard was found in that shard's header or archive."""
    if weight_map is None:
        return
    missing = [k for k in weight_map if k not in found]
    if missing:
        raise CheckpointFormatError(
            f"{source}: the index places {missing[0]!r} in {weight_map[missing[0]]}, "
            f"which does not hold it ({len(missing)} keys missing)"
        )
