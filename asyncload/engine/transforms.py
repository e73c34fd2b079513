"""Stream transforms: records that ``dcp.save(..., _extensions=[...])`` wrote through
``StreamTransformExtension``s (torch's ``ZStandard``, a user's own), read back.

A transformed record's stored bytes are not its torch.save archive, so nothing inside it
can be located before it is decoded: it is fetched whole (one read through the retrying
storage, under the load's byte budget), decoded on an I/O thread through the extensions
the metadata's descriptors name (``ExtensionRegistry.from_descriptor_list`` +
``transform_from``, in the order torch's ``FileSystemReader`` applies them), and the
decoded archive is handed to the session's whole-record assembly (tensors: checked against
the metadata, CRC-32 with ``verify``, copied into the destinations; objects: decoded with
the allow-list later). The decoded size is bounded before decoding starts (what the
metadata claims, or what the budget leaves), so a decompression bomb ends in a typed error,
never in memory beyond ``memory_budget``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncload.common.errors import AsyncLoadError, CheckpointFormatError, first_error

if TYPE_CHECKING:  # imported when a record names a transform (only DCP records do)
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

__all__ = [
    "ARCHIVE_SLACK",
    "DecodedTooLargeError",
    "TransformedRead",
    "aread_transformed",
    "check_claim",
    "decode",
    "default_registry",
    "extensions_for",
]

#: Bytes a torch.save archive of one tensor adds around the tensor's own bytes (zip headers,
#: the pickle, alignment: about 1.5 KiB; generous for long record names).
ARCHIVE_SLACK = 64 << 10
#: Decoded bytes asked of a transform stream per read.
_STEP = 1 << 20
#: The most a stored byte can decode to, per transform known to asyncload. zstd: a block
#: decodes to at most 128 KiB and takes at least 4 bytes (an RLE block), 32768:1 (64 MiB
#: of zeros at level 22 measure 32498:1); doubled for margin.
MAX_RATIO = {"stream.zstd": 1 << 16}


def check_claim(
    descriptors: Sequence[str], stored: int, claimed: int, memory_budget: int, *, what: str
) -> None:
    """Before a destination is allocated for a transformed record: the tensor bytes the
    metadata ``claimed`` for it must be ones that its ``stored`` bytes can decode to (known
    transforms: :data:`MAX_RATIO`), and the record, decoded whole, must fit ``memory_budget``
    (as :func:`aread_transformed` needs later). A :class:`CheckpointFormatError` otherwise."""
    ratio = 1
    for d in descriptors:
        known = MAX_RATIO.get(d.split("/", 1)[0])
        if known is None:  # a transform asyncload does not know may expand without bound
            ratio = 0
            break
        ratio *= known
    if ratio and claimed > stored * ratio + ARCHIVE_SLACK:
        raise CheckpointFormatError(
            f"{what}: the metadata claims {claimed} tensor bytes for a record of {stored} bytes stored through "
            f"{list(descriptors)}, which decode to at most {stored * ratio + ARCHIVE_SLACK}: "
            "the metadata does not match the data files"
        )
    if stored + claimed + ARCHIVE_SLACK > memory_budget:
        raise CheckpointFormatError(
            f"{what} is stored with stream transforms and is decoded whole: its {stored} stored bytes and the "
            f"{claimed} tensor bytes the metadata claims do not fit LoadOptions.memory_budget={memory_budget}; "
            f"raise memory_budget to at least {stored + claimed + ARCHIVE_SLACK}"
        )


def default_registry() -> ExtensionRegistry:
    """torch's default registry (``FileSystemReader``'s default: it knows ``ZStandard``)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    return ExtensionRegistry()


def extensions_for(
    registry: ExtensionRegistry | None, descriptors: Sequence[str], *, what: str
) -> list[StreamTransformExtension]:
    """The stream transforms ``descriptors`` name, in the order they decode; a descriptor the
    registry does not know (or cannot serve: ZStandard without its module) is a typed error;
    ``registry`` None: torch's default (:func:`default_registry`)."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    if registry is None:
        registry = default_registry()
    try:
        found = registry.from_descriptor_list(list(descriptors))
    except Exception as exc:
        raise CheckpointFormatError(
            f"{what} was saved with stream transforms {list(descriptors)}, which the extension registry cannot "
            f"decode ({type(exc).__name__}: {exc}): pass a registry that knows them, "
            "PipelinedReader(..., _extension_registry=...) or asyncload.load(..., extension_registry=...)"
        ) from exc
    return [
        ex for ex in found if isinstance(ex, StreamTransformExtension)
    ]  # as torch: others do not transform


class _View(io.RawIOBase):
    """A readable, seekable stream over bytes already in memory (no copy, unlike BytesIO of a memoryview)."""

    def __init__(self, data: bytes | memoryview) -> None:
        super().__init__()
        self._data = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), len(self._data) - self._pos)
        view[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class DecodedTooLargeError(CheckpointFormatError):
    """A transformed record decoded to more than its bound."""


def decode(
    extensions: Sequence[StreamTransformExtension],
    stored: bytes | memoryview,
    *,
    limit: int,
    what: str,
) -> bytearray:
    """``stored`` decoded through ``extensions``: at most ``limit`` bytes, else a typed error
    (read in steps: a bomb stops one step past the limit). Errors of the transforms are typed."""
    stream: Any = _View(stored)
    out = bytearray()
    try:
        for ex in extensions:
            stream = ex.transform_from(stream)
        while True:
            part = stream.read(min(_STEP, limit + 1 - len(out)))
            if not part:
                break
            out += part
            if len(out) > limit:
                raise DecodedTooLargeError(
                    f"{what} decodes to more than {limit} bytes, more than the metadata allows for it: "
                    "the record is damaged, or the checkpoint is hostile"
                )
    except AsyncLoadError:
        raise
    except Exception as exc:
        raise CheckpointFormatError(
            f"{what}: its stream transforms failed to decode the stored bytes ({type(exc).__name__}: {exc}): "
            "the record is damaged"
        ) from exc
    return out


@dataclass
class TransformedRead:
    """One transformed record: bytes ``[start, end)`` of file ``name``, decoded through
    ``extensions`` into at most ``limit`` bytes, then given to ``deliver`` (an I/O thread)."""

    name: str
    start: int
    end: int
    extensions: Sequence[StreamTransformExtension]
    limit: int
    what: str
    deliver: Callable[[memoryview], None]
    #: Decoded bytes allowed in a second pass, alone, when ``limit`` was too small (objects:
    #: the metadata says nothing of their size, so most reserve little and a few a lot).
    retry_limit: int | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


async def aread_transformed(pipeline: Any, reads: Sequence[TransformedRead]) -> None:
    """Fetch, decode and deliver every read: ``pipeline``'s storage (retries, timeouts, hedges),
    budget (stored plus decoded bytes reserved before the read starts, released once
    delivered) and concurrency limit; the first error is raised, the other reads cancelled.
    Reads that decoded past ``limit`` but have a ``retry_limit`` run again afterwards with it."""
    again = await _aread_pass(pipeline, reads)
    if again:
        await _aread_pass(
            pipeline,
            [
                dataclasses.replace(r, limit=r.retry_limit or r.limit, retry_limit=None)
                for r in again
            ],
        )


async def _aread_pass(pipeline: Any, reads: Sequence[TransformedRead]) -> list[TransformedRead]:
    budget = pipeline.budget
    again: list[TransformedRead] = []
    for r in reads:
        if r.nbytes + r.limit > budget.capacity:
            raise CheckpointFormatError(
                f"{r.what} is stored with stream transforms and is decoded whole: its {r.nbytes} stored bytes and up "
                f"to {r.limit} decoded bytes do not fit LoadOptions.memory_budget={budget.capacity}; "
                f"raise memory_budget to at least {r.nbytes + r.limit}"
            )
    loop = asyncio.get_running_loop()

    async def one(r: TransformedRead) -> None:
        t0 = time.monotonic()
        pipeline.stats.maximum("peak_concurrency", pipeline.limiter.used)
        stored = await pipeline.storage.read(r.name, r.start, r.end)
        pipeline.stats.add(chunks=1, storage_wait_seconds=time.monotonic() - t0)

        def work() -> None:
            try:
                decoded = decode(r.extensions, stored, limit=r.limit, what=r.what)
            except DecodedTooLargeError:
                if r.retry_limit is None or r.retry_limit <= r.limit:
                    raise
                again.append(r)
                return
            r.deliver(memoryview(decoded))

        await loop.run_in_executor(pipeline.executor, work)

    def release(n: int) -> None:
        budget.release(n)
        pipeline.limiter.release()

    error: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            for r in reads:
                need = r.nbytes + r.limit
                await budget.acquire(need)
                try:
                    await pipeline.limiter.acquire()
                except BaseException:
                    budget.release(need)
                    raise
                coro = one(r)
                try:
                    task = tg.create_task(coro)
                except BaseException:
                    coro.close()
                    release(need)
                    raise
                task.add_done_callback(lambda _t, n=need: release(n))  # type: ignore[misc]
    except BaseExceptionGroup as group:
        error = first_error(group)
    finally:
        pipeline.stats.maximum("peak_buffered_bytes", budget.peak)
    if error is not None:
        raise error.with_traceback(error.__traceback__)
    return again
