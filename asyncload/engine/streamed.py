"""A remote load of plain DCP records, streamed: :func:`aread_streamed`.

One pipeline run reads the small records and, in file order among them, each large record:
probed (its head and tail read; its data read once they have landed and said where the
tensor starts) until one record's headers are known, then read by a guess. ``torch.save``
writes the same headers before every tensor, so a record whose tensor goes straight into its
destination is read by requests of at most ``chunk_size`` covering the whole record, without
probes: its header bytes, guessed to be as long as the known record's, are received into
scratch, the tensor into its destination, the tail into scratch. Once every request of it
has landed, its headers are parsed and checked like a probed record's; where they put the
tensor elsewhere than guessed (another pickle length, other strides), it is read again where
they say (the load never returns before that), so a wrong guess costs one more read, never a
wrong byte, and damaged headers are the same typed error a probed record gives. A small
record right after a guessed one (read whole) joins its last request. Half the
requests of a DCP load (issue 30: a round of probes per record was what kept it behind
``curl --parallel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from asyncload._options import LoadOptions
from asyncload.engine.assembly import assemble
from asyncload.engine.checks import check_against_metadata
from asyncload.engine.chunks import Chunk, Piece, TensorLocation
from asyncload.engine.cost import ReadBudget, unit_chunks
from asyncload.engine.crc import CrcTracker
from asyncload.engine.pipeline import Pipeline
from asyncload.engine.records import Record, expected_storage, probes, store, then
from asyncload.formats.torchsave import (
    HEAD_PROBE,
    TAIL_PROBE,
    ByteWindow,
    aparse_archive,
    tensor_location,
)
from asyncload.storage import RetryingStorage

__all__ = ["aread_streamed", "locate", "probe_pieces"]

log = logging.getLogger("asyncload.session")

#: Records after the first read by a guess (the tests compare with probing every record).
GUESS = True


def probe_pieces(
    rec: Record, after: Callable[[], None] | None = None, loop: Any = None
) -> list[Piece]:
    """The head and tail probes of a large record, each stored in its window as it lands
    (then ``after`` scheduled on ``loop``)."""
    out = []
    for lo, hi in probes(rec):
        deliver = store(rec.window, lo)
        out.append(
            Piece(
                rec.name, lo, hi, deliver=deliver if after is None else then(deliver, loop, after)
            )
        )
    return out


async def locate(rec: Record, storage: RetryingStorage, options: LoadOptions) -> TensorLocation:
    """Where ``rec``'s tensor is, from its headers: the bytes its window holds (its probes),
    more of them fetched where they fall short; checked against the metadata."""

    async def fetch(lo: int, hi: int) -> bytes | memoryview:
        data = await storage.read(rec.name, lo, hi)  # not copied: may be a large zip directory
        return data if isinstance(data, bytes) else memoryview(data)

    layout = await aparse_archive(
        rec.window,
        rec.offset,
        rec.length,
        f"{storage.url(rec.name)} {rec.where}",
        fetch,
        max_pickle=options.max_metadata_size,
        safe_globals=options.safe_globals,
    )
    loc = tensor_location(layout, rec.name)
    check_against_metadata(rec, loc)
    return loc


def guess_wait(storage: RetryingStorage) -> float:
    """How long the first probed record's headers are waited for before the next records
    are probed too: four of the slowest first-byte latencies seen (the listing's,
    ``.metadata``'s), within [0.1 s, 1 s]."""
    seen = storage.clock.first_byte_time(1.0)
    return min(1.0, max(0.1, 4 * seen)) if seen is not None else 0.1


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, n = [], 1
    for d in reversed(size):
        stride.append(n)
        n *= max(d, 1)
    return tuple(reversed(stride))


def _same_place(a: TensorLocation, b: TensorLocation) -> bool:
    """Two locations put every element at the same byte (what a guessed read is checked by)."""
    return (
        a.data_start == b.data_start
        and a.storage_nbytes == b.storage_nbytes
        and a.dtype == b.dtype
        and tuple(a.size) == tuple(b.size)
        and tuple(a.stride) == tuple(b.stride)
        and a.storage_offset == b.storage_offset
    )


def _gather(segments: list[Piece], lo: int, hi: int) -> bytes:
    """Bytes ``[lo, hi)`` of a file from the pieces they landed in (sorted, contiguous)."""
    out = bytearray()
    for p in segments:
        a, b = max(lo, p.start), min(hi, p.end)
        if a < b and p.into is not None:
            out += p.into[a - p.start : b - p.start]
    if len(out) != hi - lo:  # pragma: no cover - the pieces tile the record
        raise AssertionError(f"[{lo}, {hi}) is not covered by the record's pieces")
    return bytes(out)


def _cut(segments: list[Piece], limit: int) -> list[list[Piece]]:
    """Contiguous pieces cut into requests of at most ``limit`` bytes (pieces split where a
    request ends: each part keeps its slice of the destination)."""
    groups: list[list[Piece]] = [[]]
    room = limit
    for p in segments:
        while p.nbytes > room:
            if room:
                assert p.into is not None  # every piece of a guessed record has a place
                groups[-1].append(dataclasses.replace(p, end=p.start + room, into=p.into[:room]))
                p = dataclasses.replace(p, start=p.start + room, into=p.into[room:])
            groups.append([])
            room = limit
        if p.nbytes:
            groups[-1].append(p)
            room -= p.nbytes
    return [g for g in groups if g]


def _joinable(guessed: Chunk, small: Chunk, limit: int) -> bool:
    """``small`` (small records read whole) starts where the last request of a guessed
    record ends, and both fit one request."""
    return (
        guessed.landed is not None
        and small.landed is None
        and not small.trackers
        and small.name == guessed.name
        and small.start == guessed.end
        and guessed.nbytes + small.nbytes <= limit
    )


def _join(guessed: Chunk, small: Chunk) -> Chunk:
    """One request for both: ``small``'s bytes received into scratch and handed to its
    pieces (their deliveries count their own bytes) once the request has landed."""
    buf = bytearray(small.nbytes)
    after = guessed.landed
    assert after is not None

    def landed() -> None:
        assemble(small, memoryview(buf))
        after()

    scratch = Piece(small.name, small.start, small.end, into=memoryview(buf), payload=False)
    return Chunk(
        guessed.name, guessed.start, small.end, [*guessed.segments, scratch], landed=landed
    )


async def aread_streamed(
    self: Any,
    pipeline: Pipeline,
    storage: RetryingStorage,
    options: LoadOptions,
    first: list[Chunk],
    large: list[Record],
    reads: ReadBudget,
    trackers: list[tuple[CrcTracker, Record]],
) -> None:
    """Read ``first`` (the chunks of small records and objects) and the ``large`` records
    (both in file order) in one pipeline run, as the module says: ``self``'s reads of one
    load (:class:`~asyncload.engine.reads.RecordReads`: its planning of a record's data, its
    counters)."""
    loop = asyncio.get_running_loop()
    chunking = options.chunk_policy
    ecs = chunking.chunk_size
    ready: asyncio.Queue[list[Chunk] | BaseException] = asyncio.Queue()
    planning: set[asyncio.Task[None]] = set()
    waiting: dict[int, int] = {}
    measured = [False]
    # bytes before a record's tensor data, from the first record whose headers were parsed
    head_len: list[int | None] = [None]
    known = asyncio.Event()  # set once a probed record was planned (or failed to be)
    # verify=True: every record probed, each tensor's bytes checked as they land
    guessing = GUESS and not options.verify
    guessed = [0, 0]  # records read by a guess, and those whose guess was wrong

    def spawn(coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        planning.add(task)
        task.add_done_callback(planning.discard)

    async def plan(rec: Record) -> None:
        try:
            if not measured[0]:
                measured[0] = True
                reads.measure(self._recorder)
            from_probes: list[tuple[memoryview, memoryview]] = []
            located: list[tuple[Record, Any]] = []
            pieces = await self._record_pieces(
                rec, storage, options, None, reads, trackers, from_probes, located, shared=False
            )
            if head_len[0] is None and located:
                head_len[0] = located[0][1].data_start - rec.offset
            self._copy_from_probes(from_probes)
            ready.put_nowait(self._data_chunks(pieces, chunking, reads, None))
        except Exception as exc:
            ready.put_nowait(exc)
        finally:
            known.set()

    def landed(rec: Record) -> None:
        waiting[id(rec)] -= 1
        if waiting[id(rec)] == 0:
            spawn(plan(rec))

    def probe(rec: Record) -> list[Chunk]:
        pieces = probe_pieces(rec, functools.partial(landed, rec), loop)
        waiting[id(rec)] = len(pieces)
        return unit_chunks(pieces, chunking, reads)

    def guess(rec: Record) -> list[Chunk] | None:
        """``rec`` read by the guess of where its tensor starts, or ``None`` where no guess
        can be made or its tensor does not go straight into its destination."""
        g = head_len[0]
        n = expected_storage(rec)
        if not guessing or g is None or n is None or n <= 0 or rec.dtype is None:
            return None
        tail = rec.length - g - n
        if not (0 < g <= HEAD_PROBE) or not (0 < tail <= TAIL_PROBE):
            return None
        size = tuple(int(d) for d in rec.chunk_md.sizes)
        spot = TensorLocation(
            rec.name, rec.offset + g, n, rec.dtype, size, _contiguous(size), 0, None, rec.where
        )
        try:
            planned = self._plan_items(
                rec, spot, options, ecs, chunking.min_chunk_size, None, max_gap=reads.max_gap
            )
        except Exception:  # the probed path raises it, with the record's own headers
            return None
        pieces = sorted((p for _, ps in planned for p in ps), key=lambda p: p.start)
        pos = spot.data_start
        for p in pieces:
            if (
                p.into is None
                or p.deliver is not None
                or p.pinned
                or p.useful is not None
                or p.start != pos
                or len(p.into) != p.nbytes
            ):
                return None
            pos = p.end
        if pos != spot.data_start + n:
            return None
        head_buf, tail_buf = bytearray(g), bytearray(tail)
        segments = [
            Piece(rec.name, rec.offset, spot.data_start, into=memoryview(head_buf)),
            *pieces,
            Piece(rec.name, pos, rec.end, into=memoryview(tail_buf)),
        ]
        for p in segments:
            p.payload = False  # counted once the headers confirm the guess
        groups = _cut(segments, ecs)
        left = [len(groups)]

        def one_landed() -> None:
            left[0] -= 1
            if left[0] == 0:
                spawn(confirm(rec, spot, segments, n))

        guessed[0] += 1
        return [Chunk(rec.name, g[0].start, g[-1].end, g, landed=one_landed) for g in groups]

    async def confirm(rec: Record, spot: TensorLocation, segments: list[Piece], n: int) -> None:
        """A guessed record's headers parsed and checked; its tensor read again where they
        put it elsewhere. ``segments``: the record's bytes as they landed, in order: they are
        the file's bytes whatever the guess, so the probes' ranges are taken from them."""
        try:
            rec.window = ByteWindow()
            for lo, hi in probes(rec):
                rec.window.add(lo, _gather(segments, lo, hi))
            loc = await locate(rec, storage, options)
            if _same_place(loc, spot):
                rec.window = ByteWindow()
                self._recorder.add(bytes_assembled=n)
                if self._report is not None:
                    self._report(n)
                ready.put_nowait([])
                return
            guessed[1] += 1
            log.debug(
                "%s: the tensor is at %d (strides %s), not at the guessed %d (%s): read again",
                rec.where,
                loc.data_start,
                list(loc.stride),
                spot.data_start,
                list(spot.stride),
            )
        except Exception as exc:
            ready.put_nowait(exc)
            return
        await plan(rec)  # planned from the probes' bytes, as a probed record is

    planned = [0]

    def take(got: list[Chunk] | BaseException) -> list[Chunk]:
        if isinstance(got, BaseException):
            raise got
        planned[0] += 1
        return got

    state = {"probed": False, "waited": False}

    async def one(rec: Record) -> list[Chunk]:
        """What goes out for ``rec``: the data planned since (records whose probes have
        landed go before the remaining ones: the link fills with data as soon as there is
        some to read), then ``rec`` guessed or probed."""
        if guessing and state["probed"] and not state["waited"] and head_len[0] is None:
            # one round trip: the first probed record's headers. Bounded: where its probes
            # stall, the next records are probed, and their answers are the history that
            # hedges the stalled ones
            state["waited"] = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(known.wait(), guess_wait(storage))
        out: list[Chunk] = []
        while not ready.empty():
            out.extend(take(ready.get_nowait()))
        chunks = guess(rec)
        if chunks is None:
            chunks = probe(rec)
            state["probed"] = True
        return out + chunks

    async def source() -> AsyncIterator[Chunk]:
        i = 0
        for c in first:  # small records and large ones in file order
            pending: Chunk | None = c
            while i < len(large) and (large[i].name, large[i].offset) < (c.name, c.start):
                got = await one(large[i])
                i += 1
                if pending is not None and got and _joinable(got[-1], pending, ecs):
                    got[-1], pending = _join(got[-1], pending), None
                for d in got:
                    yield d
            while not ready.empty():
                for d in take(ready.get_nowait()):
                    yield d
            if pending is not None:
                yield pending
        for rec in large[i:]:
            for d in await one(rec):
                yield d
        while planned[0] < len(large):
            for d in take(await ready.get()):
                yield d

    try:
        await pipeline.run_stream(source())
    finally:
        for task in list(planning):
            task.cancel()
        await asyncio.gather(*planning, return_exceptions=True)
        if guessed[0]:
            log.debug(
                "%d records read by guessing where their tensor starts, %d guessed wrong, "
                "read again",
                guessed[0],
                guessed[1],
            )
