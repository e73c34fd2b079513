"""The checks of a load: what it reads is what the checkpoint says, and what it wrote is whole.

Before any destination is touched: every file exists and is long enough for its records
(:func:`check_files`, one listing), what the metadata claims fits the files
(:func:`check_claims`, before a stream allocates), objects fit ``max_metadata_size``
(:func:`check_object_claims`), the pieces planned fill every destination byte
(:func:`check_planned`). While reading: a record's tensor is what the metadata says
(:func:`check_against_metadata`, :func:`check_decoded_storage`). At the end: checksums
under ``verify`` (:func:`check_crc`), every destination byte written
(:func:`check_written`), no file changed under the load (:func:`check_unchanged`).

Raised: :class:`CheckpointFormatError`, :class:`CheckpointNotFoundError`,
:class:`CheckpointChangedError`, each naming the file, the key and the byte range.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from asyncload.common.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
)
from asyncload.common.options import CheckPolicy
from asyncload.common.paths import check_relative_path
from asyncload.common.stats import StatsRecorder
from asyncload.engine import transforms as _transforms
from asyncload.engine.changes import check_unchanged
from asyncload.engine.chunks import Piece
from asyncload.engine.crc import CrcTracker
from asyncload.engine.records import Record, expected_storage
from asyncload.formats import plain
from asyncload.storage import RetryingStorage

if TYPE_CHECKING:
    from torch.distributed.checkpoint import ReadItem
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload.engine.config import LoadConfig

__all__ = [
    "check_against_metadata",
    "check_claims",
    "check_crc",
    "check_decoded_storage",
    "check_files",
    "check_object_claims",
    "check_planned",
    "check_unchanged",
    "check_written",
    "raise_on_bad_crc",
]


def check_planned(item: ReadItem, dest: torch.Tensor, pieces: list[Piece], rec: Record) -> None:
    """The pieces planned for ``item`` fill every byte of its destination view, before any
    is read."""
    want = dest.numel() * dest.element_size()
    got = sum(p.nbytes if p.useful is None else p.useful for p in pieces)
    if got != want:
        raise CheckpointFormatError(
            f"key {item.dest_index.fqn!r}, {rec.where}: the reads planned fill {got} of the "
            "destination's "
            f"{want} bytes: the checkpoint does not describe this part of the tensor consistently"
        )


def raise_on_bad_crc(tracker: CrcTracker, rec: Record, url: str) -> None:
    got = tracker.value()
    if got != tracker.expected:
        raise CheckpointFormatError(
            f"checksum mismatch in {url}: key {rec.fqn!r}, {rec.where}, tensor bytes "
            f"[{tracker.start}, "
            f"{tracker.end}) of the file: CRC-32 {got:#010x}, the record says "
            f"{tracker.expected:#010x}: "
            "the file is damaged"
        )


def check_object_claims(records: list[Record], checks: CheckPolicy, checkpoint: object) -> None:
    """Objects are read whole and kept until the planner decodes them: what the metadata
    claims for them, together, must fit ``LoadOptions.max_metadata_size`` (checked before
    any is read, so a forged length cannot make the load allocate it)."""
    objects = [r for r in records if r.entry is None and r.byte_items and not r.tensor_items]
    claimed = sum(r.length for r in objects)
    if claimed > checks.max_metadata_size:
        big = max(objects, key=lambda r: r.length)
        raise CheckpointFormatError(
            f"{checkpoint}: the checkpoint's objects claim {claimed} bytes in all (the largest, "
            f"{big.fqn!r}, "
            f"{big.length} bytes at [{big.offset}, {big.end}) of {big.name}), more than "
            f"LoadOptions.max_metadata_size={checks.max_metadata_size}: objects are read whole "
            "before they are "
            "decoded; raise max_metadata_size if the checkpoint is trusted to hold objects that "
            "large"
        )


def check_decoded_storage(rec: Record, loc: Any) -> None:
    """A decoded record's tensor storage is exactly what the metadata claims (DCP saves
    tensors with minimal storage)."""
    expected = expected_storage(rec)
    if expected is not None and loc.storage_nbytes != expected:
        raise CheckpointFormatError(
            f"{rec.where}, decoded through {list(rec.transforms)}: holds a tensor storage of "
            f"{loc.storage_nbytes} "
            f"bytes, the metadata claims {expected} ({list(rec.chunk_md.sizes)} of {rec.dtype}): "
            "the record is "
            "damaged or the metadata lies"
        )


def check_against_metadata(rec: Record, loc: Any) -> None:
    if rec.dtype is not None and loc.dtype != rec.dtype:
        raise CheckpointFormatError(
            f"{rec.where}: the record holds {loc.dtype}, the metadata says {rec.dtype}"
        )
    if rec.chunk_md is not None and tuple(rec.chunk_md.sizes) != tuple(loc.size):
        raise CheckpointFormatError(
            f"{rec.where}: the record holds shape {list(loc.size)}, the metadata says "
            f"{list(rec.chunk_md.sizes)}"
        )


def check_crc(
    tracker: CrcTracker, rec: Record, storage: RetryingStorage, recorder: StatsRecorder
) -> None:
    if not tracker.complete:  # pragma: no cover - every byte of a verified storage is read
        raise CheckpointFormatError(
            f"{storage.url(rec.name)}, {rec.where}: verify=True read only "
            f"{tracker.covered} of {tracker.end - tracker.start} bytes of the tensor"
        )
    raise_on_bad_crc(tracker, rec, storage.url(rec.name))
    recorder.add(verified_records=1)


def check_written(
    records: list[Record],
    assembled_before: int,
    total: int,
    recorder: StatsRecorder,
    checkpoint: object,
    *,
    written: int | None = None,
) -> None:
    """Every destination byte the plan asked for was written: counted per assembled chunk
    (data) and per whole record (small records), against the destinations' sizes.
    ``written``: the bytes this read assembled, counted apart (where other reads of the same
    session ran at once), instead of the recorder's count since ``assembled_before``."""
    if written is None:
        written = recorder.stats.bytes_assembled - assembled_before
    if written != total:
        keys = sorted({item.dest_index.fqn for r in records for item, _ in r.tensor_items})
        raise CheckpointFormatError(
            f"{checkpoint}: the load wrote {written} of the {total} destination bytes it planned "
            f"(keys {keys[:8]}{' ...' if len(keys) > 8 else ''}): the destination is incomplete"
        )


async def check_files(
    storage: RetryingStorage,
    records: list[Record],
    fingerprints: dict[str, object],
    recorder: StatsRecorder,
) -> None:
    """Every file exists and is long enough for its records, before any destination is touched."""
    ends: dict[str, int] = {}
    last: dict[str, Record] = {}
    for r in records:
        if r.end > ends.get(r.name, -1):
            ends[r.name], last[r.name] = r.end, r

    listed = await storage.sizes(list(ends))  # one LIST instead of a HEAD per file

    async def size_of(name: str) -> int:
        if name in listed:
            return listed[name]
        try:
            return await storage.size(name)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{storage.url(name)} is named by the checkpoint's metadata but does not exist: "
                "the checkpoint is incomplete",
                path=storage.url(name),
                status=404,
            ) from exc

    unlisted = [n for n in ends if n not in listed]
    listed.update(zip(unlisted, await asyncio.gather(*(size_of(n) for n in unlisted))))
    sizes = [listed[n] for n in ends]
    fps = (
        await asyncio.gather(*(storage.fingerprint(n) for n in ends))
        if storage.fingerprints
        else []
    )
    for n, fp in zip(ends, fps):
        if fp is not None:
            fingerprints.setdefault(n, fp)
    for (name, end), size in zip(ends.items(), sizes):
        if size < end:
            raise CheckpointFormatError(
                f"{storage.url(name)} is {size} bytes but the metadata places a record up to byte "
                f"{end} "
                f"(key {last[name].fqn!r}): the file is truncated, or a save is rewriting it"
            )
    recorder.add(files=len(ends))


async def check_claims(
    storage: RetryingStorage,
    metadata: Metadata,
    fqns: list[str],
    config: LoadConfig,
    fingerprints: dict[str, object],
    recorder: StatsRecorder,
    checkpoint: object,
) -> None:
    """Before destinations are allocated for ``fqns`` from ``metadata``: every saved
    chunk of their tensors fits in its record, and every record in its file (one listing
    of the files' sizes), so a ``.metadata`` claiming gigabytes next to a small file is a
    typed error, not a gigabyte allocation."""
    # the metadata's own kind of index (DCP's, or asyncload.formats.plain's)
    kinds = plain.plain_kinds() if plain.is_plain(metadata) else plain.kinds()
    records: list[Record] = []
    for fqn in fqns:
        smd: Any = metadata.state_dict_metadata[fqn]
        tensor = plain.is_tensor_md(smd)
        chunks = smd.chunks if tensor else [None]
        for chunk in chunks:
            index = kinds.MetadataIndex(fqn, None if chunk is None else chunk.offsets)
            info = metadata.storage_data.get(index) if metadata.storage_data else None
            if info is None:
                raise CheckpointFormatError(
                    f"{checkpoint}: metadata has no storage entry for {index}"
                )
            where = f"{checkpoint}: storage entry of {fqn!r:.200}"
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if (
                not isinstance(offset, int)
                or not isinstance(length, int)
                or offset < 0
                or length < 0
            ):
                raise CheckpointFormatError(f"{where} is malformed: {info!r:.200}")
            rec = Record(
                check_relative_path(getattr(info, "relative_path", None), where),
                offset,
                length,
                fqn,
            )
            # a record saved through stream transforms (compressed) may be shorter than its
            # tensor: its claim is bounded by what its bytes can decode to and by the budget
            # (it is decoded whole); the decoded size is bounded again when it is read
            transformed = getattr(info, "transform_descriptors", None)
            if chunk is not None and tensor and transformed:
                claimed = torch.Size(chunk.sizes).numel() * smd.properties.dtype.itemsize
                budget = config.memory.budget
                where = f"{checkpoint}, {rec.where}"
                _transforms.check_claim(transformed, length, claimed, budget, what=where)
            elif chunk is not None and tensor and getattr(info, "location", None) is None:
                # (a tensor a format module located, a torch.save view: checked when located
                # that its elements lie in its storage, which may be smaller than the tensor:
                # expand()'s stride 0, overlapping strides)
                claimed = torch.Size(chunk.sizes).numel() * smd.properties.dtype.itemsize
                if claimed > length:
                    raise CheckpointFormatError(
                        f"{checkpoint}, {rec.where}: the metadata claims a chunk of shape "
                        f"{list(chunk.sizes)} "
                        f"({claimed} bytes of {smd.properties.dtype}) in a record of {length} "
                        "bytes: "
                        "the metadata does not match the data files"
                    )
            records.append(rec)
    files = recorder.stats.files
    await check_files(storage, records, fingerprints, recorder)
    recorder.stats.files = files  # counted once, by the reads that follow
