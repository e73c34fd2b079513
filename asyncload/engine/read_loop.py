"""The read loop of the faces that read byte ranges into memory they own: :func:`read_chunks`.

A list of :class:`~asyncload.engine.chunks.Chunk` s is read into their pieces' memory
(``Piece.into``) over a :class:`~asyncload.storage.RetryingStorage` (its per-read timeouts,
retries, hedging and typed errors), at most ``max_in_flight`` reads at once and at most
``memory_budget`` bytes in flight (a :class:`~asyncload.engine.meter.Meter` of bytes; one
larger chunk alone). On a store that reads into caller memory (a local file), runs of small
chunks are read together in one thread hop (:func:`group_chunks`,
:meth:`RetryingStorage.read_batch`). ``peak_concurrency`` and ``peak_buffered_bytes`` are
counted in the storage's statistics.

Used by :func:`asyncload.safe_open` (each ``get_tensor`` / ``get_slice(...)[...]``) and the
torch-checkpointing integration's ranged stream. A load's reads go through
:class:`~asyncload.engine.pipeline.Pipeline` instead (assembly off the loop, device staging,
``concurrency="auto"``).

The first failure is raised as it came (one read's typed error); every read still running
is cancelled and awaited before it propagates.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from asyncload.engine.chunks import Chunk
from asyncload.engine.meter import Meter
from asyncload.storage import BATCH_INLINE, RetryingStorage

if TYPE_CHECKING:
    from asyncload.engine.config import LoadConfig

__all__ = ["SMALL_READ", "group_chunks", "probe_slots", "read_chunks"]

#: Chunks of a store that reads into caller memory (a local file) at most this large are
#: read in batches (one thread hop for many: a column slice's rows).
SMALL_READ = 64 * 1024


def group_chunks(storage: RetryingStorage, chunks: list[Chunk], budget: int) -> list[list[Chunk]]:
    """Chunks to read one by one, and (a store that reads into caller memory) runs of small
    ones read together in one thread hop (:meth:`RetryingStorage.read_batch`), at most
    ``min(BATCH_INLINE, budget)`` bytes a run."""
    if not storage.supports_readinto:
        return [[c] for c in chunks]
    groups: list[list[Chunk]] = []
    batch: list[Chunk] = []
    held = 0
    for c in chunks:
        if c.nbytes > SMALL_READ:
            groups.append([c])
            continue
        if batch and held + c.nbytes > min(BATCH_INLINE, budget):
            groups.append(batch)
            batch, held = [], 0
        batch.append(c)
        held += c.nbytes
    if batch:
        groups.append(batch)
    return groups


def _deliver(chunk: Chunk, data: memoryview) -> None:
    for seg in chunk.segments:
        assert seg.into is not None
        seg.into[:] = data[seg.start - chunk.start : seg.end - chunk.start]


async def _read_group(storage: RetryingStorage, group: list[Chunk]) -> None:
    if len(group) > 1:
        await storage.read_batch(
            [(c.name, c.start, c.end, functools.partial(_deliver, c)) for c in group]
        )
        return
    (chunk,) = group
    if chunk.tiles_into():
        into = [s.into for s in chunk.segments if s.into is not None]
        await storage.readinto(chunk.name, chunk.start, into)
    else:
        _deliver(chunk, await storage.read(chunk.name, chunk.start, chunk.end))


async def read_chunks(
    storage: RetryingStorage, chunks: list[Chunk], *, memory_budget: int, max_in_flight: int
) -> None:
    """Read ``chunks`` into their pieces' memory (every piece has ``into``): at most
    ``max_in_flight`` requests at once and ``memory_budget`` bytes in flight (one larger
    chunk alone).

    Raised: the first read's error (an :class:`~asyncload.AsyncLoadError` naming the file,
    byte range and attempts), after the other reads are cancelled."""
    groups = group_chunks(storage, chunks, memory_budget)
    if not groups:
        return
    held = Meter(memory_budget, name="reads", oversize="alone", unit="bytes")
    todo = iter(groups)
    stats = storage.stats
    flying = [0]

    async def worker() -> None:
        for group in todo:
            n = sum(c.nbytes for c in group)
            async with held.hold(n):
                flying[0] += 1
                stats.maximum("peak_concurrency", flying[0])
                stats.maximum("peak_buffered_bytes", held.used)
                try:
                    await _read_group(storage, group)
                finally:
                    flying[0] -= 1

    tasks = [
        asyncio.ensure_future(worker()) for _ in range(min(max(1, max_in_flight), len(groups)))
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def probe_slots(config: LoadConfig) -> Meter:
    """The read slots of a format probe's fetchers (:class:`asyncload.formats.Fetcher`):
    ``max_in_flight`` reads at once."""
    return Meter(max(1, config.concurrency.max_in_flight), name="format reads", unit="reads")
