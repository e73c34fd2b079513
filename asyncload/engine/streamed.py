"""A remote load of plain DCP records, streamed: :func:`aread_streamed`.

One pipeline run reads the small records and, in file order among them, each large record,
read by a guess of where its tensor starts. ``torch.save`` writes the same headers before
every tensor, so a record whose tensor goes straight into its destination is read by
requests of at most ``chunk_size`` covering the whole record, without probes: its header
bytes, guessed to be as long as the known record's, are received into scratch, the tensor
into its destination, the tail into scratch. Before any record's headers are known, the
guess is what this process's own ``torch.save`` writes (``own_head_len``): the first large
record is read by it, its first and last requests cut at its head and tail probes' ranges
(its headers, parsed from them a round trip in, are what later records are guessed by), and
every record that goes out before they are parsed is read by it too, without waiting; where no guess can be made a record is probed and its data read once the
probes have landed and said where the tensor starts. Once every request of it
has landed, its headers are parsed and checked like a probed record's. Where they put the
tensor elsewhere than guessed, nothing is handed over until it is right: where only its
start differs (another pickle length; another torch's headers), its bytes are all in memory
already (the requests covered the whole record: headers and tail in scratch, the rest in the
destination) and are moved into place (:func:`_shift`), no byte read again; where its strides
or dtype differ it is read again where they say (the load never returns before that). So a
wrong guess costs a move in memory or one more read, never a wrong byte, and damaged
headers are the same typed error a probed record gives. A small
record right after a guessed one (read whole) joins its last request. A guessed record
saves the round of header probes a probed record waits for before its data goes out.
Where there are more large records than read slots, neighbouring guessed records share
requests (:class:`_Joiner`: their bytes shared out over the slots, at most ``chunk_size``),
so that a file of many records goes out in about as many requests as slots, as a
safetensors file does, instead of waves of one request per record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncload.common.options import CheckPolicy
from asyncload.engine.assembly import assemble
from asyncload.engine.checks import check_against_metadata
from asyncload.engine.chunks import Chunk, Piece, TensorLocation
from asyncload.engine.cost import ReadBudget, unit_chunks
from asyncload.engine.crc import CrcTracker
from asyncload.engine.pipeline import Pipeline
from asyncload.engine.records import Record, expected_storage, probes, store, then
from asyncload.formats import (
    HEAD_PROBE,
    TAIL_PROBE,
    ByteWindow,
    aparse_archive,
    own_head_len,
    tensor_location,
)
from asyncload.storage import RetryingStorage

if TYPE_CHECKING:
    from asyncload.engine.config import LoadConfig

__all__ = ["aread_streamed", "locate", "probe_pieces"]

log = logging.getLogger("asyncload.session")

#: Records after the first read by a guess (the tests compare with probing every record).
GUESS = True
#: Large records read by the prior guess (the header length this process's ``torch.save``
#: writes) before any record's headers are known: the first one (its headers, parsed from
#: its first and last requests, are what the later guesses go by) and up to this many in
#: all. A checkpoint whose headers differ only in length (another torch) moves those
#: records' bytes in memory (:func:`_shift`), reading nothing again, so every record that
#: goes out before the first headers are parsed is read by the prior: the link is filled in
#: the first round trip, as for a safetensors file, instead of waiting for one record's
#: headers (a round trip and the first record's bytes) before the rest go out.
SPECULATE = 1 << 30


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


async def locate(rec: Record, storage: RetryingStorage, checks: CheckPolicy) -> TensorLocation:
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
        max_pickle=checks.max_metadata_size,
        safe_globals=checks.safe_globals,
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


def _shifted(a: TensorLocation, b: TensorLocation, rec: Record) -> bool:
    """``a`` puts the tensor where ``b`` does but for its start, inside record ``rec``: its
    bytes are all among the pieces a guessed read of ``rec`` by ``b`` landed in."""
    return (
        a.data_start != b.data_start
        and rec.offset <= a.data_start
        and a.data_start + b.storage_nbytes <= rec.end
        and _same_place(dataclasses.replace(a, data_start=b.data_start), b)
    )


#: Bytes moved at a time by :func:`_shift` (the memory it takes beside the destination).
SHIFT_WINDOW = 4 << 20


def _copy(segments: list[Piece], lo: int, buf: memoryview, *, out: bool) -> int:
    """Bytes ``[lo, lo + len(buf))`` of a file copied from the pieces that hold them into
    ``buf``, or (``out``) from ``buf`` into those pieces; how many the pieces held."""
    hi, done = lo + len(buf), 0
    for p in segments:
        a, b = max(lo, p.start), min(hi, p.end)
        if a < b and p.into is not None:
            if out:
                p.into[a - p.start : b - p.start] = buf[a - lo : b - lo]
            else:
                buf[a - lo : b - lo] = p.into[a - p.start : b - p.start]
            done += b - a
    return done


def _shift(segments: list[Piece], guessed: int, true: int, n: int) -> None:
    """A guessed read's tensor put where its headers say: the ``n`` bytes at file offset
    ``true`` moved to the pieces that received the file's bytes at ``guessed`` (the
    destination), from the pieces they landed in (the destination itself, the head's or
    the tail's scratch), a window at a time through one buffer, in the order that reads
    every byte before it is overwritten (up when the tensor starts later than guessed,
    down when earlier)."""
    window = memoryview(bytearray(min(SHIFT_WINDOW, n)))
    starts = range(0, n, SHIFT_WINDOW)
    for k in starts if true > guessed else reversed(starts):
        buf = window[: min(SHIFT_WINDOW, n - k)]
        _copy(segments, true + k, buf, out=False)
        _copy(segments, guessed + k, buf, out=True)


def _gather(segments: list[Piece], lo: int, hi: int) -> bytes:
    """Bytes ``[lo, hi)`` of a file from the pieces they landed in (sorted, contiguous)."""
    out = bytearray(hi - lo)
    if _copy(segments, lo, memoryview(out), out=False) != hi - lo:  # pragma: no cover
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


def _split(segments: list[Piece], *at: int) -> list[list[Piece]]:
    """Contiguous pieces split at the file offsets ``at`` (ascending): the pieces before the
    first, between each two, after the last (each part keeps its slice of the destination)."""
    parts: list[list[Piece]] = [[]]
    cuts = list(at)
    for p in segments:
        while True:
            while cuts and p.start >= cuts[0]:
                cuts.pop(0)
                parts.append([])
            if not (cuts and cuts[0] < p.end):
                break
            assert p.into is not None  # every piece of a guessed record has a place
            k = cuts[0] - p.start
            parts[-1].append(dataclasses.replace(p, end=cuts[0], into=p.into[:k]))
            p = dataclasses.replace(p, start=cuts[0], into=p.into[k:])
        parts[-1].append(p)
    while cuts:
        cuts.pop(0)
        parts.append([])
    return parts


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


class _Owner:
    """A guessed record's request whose bytes went out in joined requests: its ``landed``
    called once every joined request holding some of its bytes has landed."""

    __slots__ = ("chunk", "done", "parts", "whole")

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.parts = self.done = 0
        self.whole = False  # its last byte went out

    def one_landed(self) -> None:
        self.done += 1
        if self.whole and self.done == self.parts:
            assert self.chunk.landed is not None
            self.chunk.landed()


class _Joiner:
    """Neighbouring guessed records' requests smaller than ``limit`` joined and cut again
    into requests of ``limit`` bytes (:func:`join_limit`), anywhere: each piece keeps its
    slice of its destination, each record's request counts in (its ``landed``) once all of
    its bytes have landed. ``add`` takes a request and hands back the joined ones that are
    full; ``flush`` the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: pieces not yet sent, contiguous, each with the request it belongs to
        self.pieces: list[tuple[Piece, _Owner]] = []
        self.held = 0

    def fits(self, c: Chunk) -> bool:
        if (
            not self.limit
            or c.nbytes >= self.limit  # full already: sent as it is
            or c.landed is None
            or c.trackers
            or not c.tiles_into()
        ):
            return False
        if not self.pieces:
            return True
        last = self.pieces[-1][0]
        return last.name == c.name and last.end == c.start

    def add(self, c: Chunk) -> list[Chunk]:
        owner = _Owner(c)
        self.pieces.extend((p, owner) for p in c.segments)
        self.held += c.nbytes
        out = []
        while self.held >= self.limit:
            out.append(self._cut(self.limit))
        return out

    def flush(self) -> list[Chunk]:
        return [self._cut(self.held)] if self.held else []

    def _cut(self, n: int) -> Chunk:
        take: list[Piece] = []
        owners: list[_Owner] = []
        room = n
        while room:
            p, owner = self.pieces[0]
            if p.nbytes > room:
                assert p.into is not None  # a guessed record's pieces all have a place
                take.append(dataclasses.replace(p, end=p.start + room, into=p.into[:room]))
                self.pieces[0] = (
                    dataclasses.replace(p, start=p.start + room, into=p.into[room:]),
                    owner,
                )
                room = 0
            else:
                take.append(p)
                self.pieces.pop(0)
                room -= p.nbytes
            if not owners or owners[-1] is not owner:
                owners.append(owner)
                owner.parts += 1
        self.held -= n
        for owner in owners:
            owner.whole = not any(o is owner for _, o in self.pieces[:1])

        def landed() -> None:
            for owner in owners:
                owner.one_landed()

        return Chunk(take[0].name, take[0].start, take[-1].end, take, landed=landed)


def join_limit(large: list[Record], chunk_size: int, slots: int) -> int:
    """The size of a request that neighbouring guessed records are joined into: none (0)
    where their requests all fit the read slots at once (one request per record goes out
    together), else the records' bytes shared out over the slots, at most ``chunk_size``:
    fewer, larger requests where they would otherwise queue for a slot (a queue refills
    the link a round trip late, once per wave of requests)."""
    total = sum(rec.length for rec in large)
    if len(large) <= slots or total <= 0:
        return 0
    return min(chunk_size, -(-total // max(1, slots)))


async def aread_streamed(
    reads_of: Any,
    pipeline: Pipeline,
    storage: RetryingStorage,
    config: LoadConfig,
    first: list[Chunk],
    large: list[Record],
    reads: ReadBudget,
    trackers: list[tuple[CrcTracker, Record]],
) -> None:
    """Read ``first`` (the chunks of small records and objects) and the ``large`` records
    (both in file order) in one pipeline run, as the module says. ``reads_of``: the load's
    :class:`~asyncload.engine.reads.RecordReads` (its planning of a record's data, its
    counters)."""
    stream = _Stream(reads_of, storage, config, reads, trackers, len(large))
    try:
        await pipeline.run_stream(stream.source(first, large))
    finally:
        for task in list(stream.planning):
            task.cancel()
        await asyncio.gather(*stream.planning, return_exceptions=True)
        if stream.guessed:
            log.debug(
                "%d records read by guessing where their tensor starts, %d guessed wrong, "
                "read again, %d at another start, moved into place",
                stream.guessed,
                stream.wrong,
                stream.shifted,
            )


class _Stream:
    """One run of :func:`aread_streamed`: what goes out next (:meth:`source`), and each
    large record's data planned once its probes have landed (:meth:`plan`) or its guess
    checked once it has landed (:meth:`confirm`); both hand their chunks (or their error)
    to ``ready``. Runs on the load's loop.

    Mutable state: ``ready``, ``planning`` (tasks planning or confirming), ``waiting``
    (probes not landed, per record), ``head_len`` (bytes before a record's tensor, from the
    first record whose headers were parsed), ``known`` (set once a probed record was planned
    or failed to be), ``probed`` / ``waited`` (a record was probed; the wait for the first
    headers is over), ``planned`` (large records whose outcome was taken from ``ready``),
    ``guessed`` / ``wrong`` / ``shifted`` (records read by a guess; those guessed wrong and
    read again; those whose tensor started elsewhere, moved into place), ``measured``
    (the budget's latency and rate taken, at the first record planned)."""

    def __init__(
        self,
        reads_of: Any,
        storage: RetryingStorage,
        config: LoadConfig,
        reads: ReadBudget,
        trackers: list[tuple[CrcTracker, Record]],
        n_large: int,
    ) -> None:
        self.reads_of = reads_of
        self.storage = storage
        self.checks = config.checks
        self.chunking = config.chunking
        self.max_in_flight = config.concurrency.max_in_flight
        self.reads = reads
        self.trackers = trackers
        self.n_large = n_large
        self.loop = asyncio.get_running_loop()
        # verify=True: every record probed, each tensor's bytes checked as they land
        self.guessing = GUESS and not config.checks.verify
        self.ready: asyncio.Queue[list[Chunk] | BaseException] = asyncio.Queue()
        self.planning: set[asyncio.Task[None]] = set()
        self.waiting: dict[int, int] = {}
        self.head_len: int | None = None
        self.known = asyncio.Event()
        self.probed = self.waited = self.measured = False
        self.planned = 0
        self.guessed = self.wrong = self.shifted = 0
        #: bytes before a record's tensor as this process's torch.save writes them: the
        #: guess before any record's headers are known (up to SPECULATE records)
        self.prior = own_head_len() if self.guessing else None
        self.speculated = 0
        #: guessed records' requests joined (:meth:`_joined`); ids of requests never
        #: joined (a learned record's)
        self.joiner = _Joiner(0)
        self.learning: set[int] = set()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.planning.add(task)
        task.add_done_callback(self.planning.discard)

    async def plan(self, rec: Record) -> None:
        """``rec``'s data chunks, planned from its probes' bytes, into ``ready``."""
        r = self.reads_of
        try:
            if not self.measured:  # the latency and rate seen so far, once
                self.measured = True
                self.reads.measure(r._recorder)
            from_probes: list[tuple[memoryview, memoryview]] = []
            located: list[tuple[Record, Any]] = []
            pieces = await r._record_pieces(
                rec,
                self.storage,
                self.chunking,
                None,
                self.reads,
                self.trackers,
                from_probes,
                located,
                shared=False,
            )
            if self.head_len is None and located:
                self.head_len = located[0][1].data_start - rec.offset
            r._copy_from_probes(from_probes)
            self.ready.put_nowait(r._data_chunks(pieces, self.chunking, self.reads, None))
        except Exception as exc:
            self.ready.put_nowait(exc)
        finally:
            self.known.set()

    def _landed(self, rec: Record) -> None:
        self.waiting[id(rec)] -= 1
        if self.waiting[id(rec)] == 0:
            self._spawn(self.plan(rec))

    def probe(self, rec: Record) -> list[Chunk]:
        """``rec``'s head and tail probes; its data planned once both have landed."""
        pieces = probe_pieces(rec, functools.partial(self._landed, rec), self.loop)
        self.waiting[id(rec)] = len(pieces)
        self.probed = True
        return unit_chunks(pieces, self.chunking, self.reads)

    async def _learned(self, twin: Record) -> None:
        try:
            loc = await locate(twin, self.storage, self.checks)
            if self.head_len is None:
                self.head_len = loc.data_start - twin.offset
        except Exception:  # the guessed read of the same bytes raises it, when checked
            log.debug("%s: headers not parsed from its first bytes", twin.where, exc_info=True)
        finally:
            self.known.set()

    def guess(self, rec: Record, g: int | None = None, learn: bool = False) -> list[Chunk] | None:
        """``rec`` read by the guess of where its tensor starts (``g`` bytes in; by default
        as far in as the known record's), or ``None`` where no guess can be made or its
        tensor does not go straight into its destination. ``learn``: its first and last
        requests are its head and tail probes' ranges, and once both have landed its
        headers are parsed from their bytes (:meth:`_learned`: what later records are
        guessed by), a round trip in, while the rest of it is on the wire: no byte read
        twice."""
        if g is None:
            g = self.head_len
        n = expected_storage(rec)
        if not self.guessing or g is None or n is None or n <= 0 or rec.dtype is None:
            return None
        tail = rec.length - g - n
        if not (0 < g <= HEAD_PROBE) or not (0 < tail <= TAIL_PROBE):
            return None
        size = tuple(int(d) for d in rec.chunk_md.sizes)
        spot = TensorLocation(
            rec.name, rec.offset + g, n, rec.dtype, size, _contiguous(size), 0, None, rec.where
        )
        ecs = self.chunking.chunk_size
        try:
            planned = self.reads_of._plan_items(
                rec,
                spot,
                ecs,
                self.chunking.min_chunk_size,
                None,
                max_gap=self.reads.max_gap,
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
        segments = [
            Piece(rec.name, rec.offset, spot.data_start, into=memoryview(bytearray(g))),
            *pieces,
            Piece(rec.name, pos, rec.end, into=memoryview(bytearray(tail))),
        ]
        for p in segments:
            p.payload = False  # counted once the headers confirm the guess
        ranges = probes(rec)
        if learn and ranges[0][1] <= ranges[1][0]:
            parts = [_cut(part, ecs) for part in _split(segments, ranges[0][1], ranges[1][0])]
            groups = [g for part in parts for g in part]
            probing = set(range(len(parts[0]))) | set(
                range(len(groups) - len(parts[2]), len(groups))
            )
            twin = dataclasses.replace(rec, window=ByteWindow())
            self.probed = True
        else:
            groups, probing, twin = _cut(segments, ecs), set(), None
        left, unlearned = [len(groups)], [len(probing)]
        report = self.reads_of._report
        lo, hi = spot.data_start, spot.data_start + n

        def one_landed(index: int, tensor_bytes: int) -> None:
            # progress as the bytes land (a large record is not one jump at its end); a
            # wrong guess's bytes are reported again by its second read (the total clamps)
            if report is not None and tensor_bytes:
                report(tensor_bytes)
            if twin is not None and index in probing:
                unlearned[0] -= 1
                if unlearned[0] == 0:
                    for a, b in ranges:
                        twin.window.add(a, _gather(segments, a, b))
                    self._spawn(self._learned(twin))
            left[0] -= 1
            if left[0] == 0:
                self._spawn(self.confirm(rec, spot, segments, n))

        self.guessed += 1
        chunks = [
            Chunk(
                rec.name,
                g[0].start,
                g[-1].end,
                g,
                landed=functools.partial(
                    one_landed, i, sum(max(0, min(p.end, hi) - max(p.start, lo)) for p in g)
                ),
            )
            for i, g in enumerate(groups)
        ]
        if twin is not None:
            self.learning.update(id(c) for c in chunks)
        return chunks

    async def confirm(
        self, rec: Record, spot: TensorLocation, segments: list[Piece], n: int
    ) -> None:
        """A guessed record's headers parsed and checked; its tensor moved into place where
        they put it at another start (:func:`_shift`), read again where they put it with
        other strides or another dtype. ``segments``: the record's bytes as they landed, in order: they are
        the file's bytes whatever the guess, so the probes' ranges are taken from them."""
        r = self.reads_of
        try:
            rec.window = ByteWindow()
            for lo, hi in probes(rec):
                rec.window.add(lo, _gather(segments, lo, hi))
            loc = await locate(rec, self.storage, self.checks)
            moved = _shifted(loc, spot, rec)
            if moved:
                # its bytes all landed, at another offset: moved into place, none read again
                log.debug(
                    "%s: the tensor is at %d, not at the guessed %d: moved into place",
                    rec.where,
                    loc.data_start,
                    spot.data_start,
                )
                _shift(segments, spot.data_start, loc.data_start, n)
                self.shifted += 1
            if moved or _same_place(loc, spot):
                rec.window = ByteWindow()
                r._recorder.add(bytes_assembled=n)  # progress was reported as they landed
                self.ready.put_nowait([])
                return
            self.wrong += 1
            log.debug(
                "%s: the tensor is at %d (strides %s), not at the guessed %d (%s): read again",
                rec.where,
                loc.data_start,
                list(loc.stride),
                spot.data_start,
                list(spot.stride),
            )
        except Exception as exc:
            self.ready.put_nowait(exc)
            return
        await self.plan(rec)  # planned from the probes' bytes, as a probed record is

    def _take(self, got: list[Chunk] | BaseException) -> list[Chunk]:
        if isinstance(got, BaseException):
            raise got
        self.planned += 1
        return got

    def _drain(self) -> list[Chunk]:
        """The data planned since last asked (records whose probes have landed go before
        the remaining ones: the link fills with data as soon as there is some to read)."""
        out: list[Chunk] = []
        while not self.ready.empty():
            out.extend(self._take(self.ready.get_nowait()))
        return out

    async def one(self, rec: Record) -> list[Chunk]:
        """What goes out for ``rec``: the data planned since, then ``rec`` guessed or
        probed. Before any record's headers are known: the first record read by the prior
        guess and probed (:meth:`learn`), up to SPECULATE records by the prior, then a
        bounded wait for the first headers."""
        if self.guessing and self.head_len is None and self.prior is not None:
            first = not self.probed
            if first or (self.speculated and self._speculating()):
                chunks = self.guess(rec, self.prior, learn=first)
                if chunks is not None:
                    self.speculated += 1
                    return self._drain() + chunks
        if self.guessing and self.probed and not self.waited and self.head_len is None:
            # one round trip: the first probed record's headers. Bounded: where its probes
            # stall, the next records are probed, and their answers are the history that
            # hedges the stalled ones
            self.waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.known.wait(), guess_wait(self.storage))
        out = self._drain()
        chunks = self.guess(rec)
        return out + (chunks if chunks is not None else self.probe(rec))

    def _joined(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks``, guessed records' requests joined by ``joiner`` where there are
        more requests than read slots. Requests of the record whose headers are learned
        (its probes' ranges) are never joined: later guesses wait for them."""
        out: list[Chunk] = []
        for d in chunks:
            if id(d) not in self.learning and self.joiner.fits(d):
                out.extend(self.joiner.add(d))
            else:
                out.extend(self.joiner.flush())
                out.append(d)
        return out

    def _release(self) -> list[Chunk]:
        return self.joiner.flush()

    def _speculating(self) -> bool:
        """The next record goes out by the prior guess (no record's headers known yet)."""
        return self.prior is not None and self.speculated < SPECULATE and not self.known.is_set()

    def _may_wait(self) -> bool:
        """:meth:`one` may wait for the first record's headers (nothing held across it):
        not while records go out by the prior, which are joined as they go."""
        return self.guessing and self.head_len is None and not self._speculating()

    async def source(self, first: list[Chunk], large: list[Record]) -> AsyncIterator[Chunk]:
        """The chunks of ``first`` and of the ``large`` records, in file order, then the
        data planned after the last record went out."""
        ecs = self.chunking.chunk_size
        self.joiner = _Joiner(join_limit(large, ecs, self.max_in_flight))
        i = 0
        for c in first:
            pending: Chunk | None = c
            while i < len(large) and (large[i].name, large[i].offset) < (c.name, c.start):
                if self._may_wait():
                    for d in self._release():
                        yield d
                got = await self.one(large[i])
                i += 1
                if pending is not None and got and _joinable(got[-1], pending, ecs):
                    joined = _join(got[-1], pending)
                    if id(got[-1]) in self.learning:
                        self.learning.add(id(joined))
                    got[-1], pending = joined, None
                for d in self._joined(got):
                    yield d
            if pending is not None:
                for d in self._release():
                    yield d
            for d in self._drain():
                yield d
            if pending is not None:
                yield pending
        for rec in large[i:]:
            if self._may_wait():
                for d in self._release():
                    yield d
            for d in self._joined(await self.one(rec)):
                yield d
        for d in self._release():
            yield d
        while self.planned < self.n_large:
            for d in self._take(await self.ready.get()):
                yield d
