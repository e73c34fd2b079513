"""The read phases of one load: :class:`RecordReads`.

Phase A reads header probes and small records (whole), phase B each large record's tensor
data: its layout parsed from the probes, each destination's boxes planned (narrow reads
within the over-read bound, :mod:`asyncload.engine.cost`), chunks read and assembled by the
:class:`~asyncload.engine.pipeline.Pipeline`. A remote load of plain records streams the
two phases (:mod:`asyncload.engine.streamed`: a record's data goes out as soon as its own
probes land, and once one record's headers are known the later ones are read whole by a
guess of where their tensor starts, checked against their headers). Records saved with
stream transforms are fetched whole and decoded (:mod:`asyncload.engine.transforms`);
records of other formats were located already (:mod:`asyncload.formats`). The checks
(:mod:`asyncload.engine.checks`) run before any destination is touched and at the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only (a load of a non-DCP file imports no DCP)
    from torch.distributed.checkpoint.metadata import Metadata

import asyncload.formats as formats
from asyncload.common.options import ChunkPolicy
from asyncload.common.stats import SharedRecorder, StatsRecorder
from asyncload.engine import transforms as _transforms
from asyncload.engine.assembly import copy_bytes
from asyncload.engine.checks import (
    check_against_metadata,
    check_crc,
    check_decoded_storage,
    check_files,
    check_object_claims,
    check_planned,
    check_unchanged,
    check_written,
    raise_on_bad_crc,
)
from asyncload.engine.chunks import Chunk, Piece, TensorLocation
from asyncload.engine.config import LoadConfig
from asyncload.engine.cost import ForeignBytes, ReadBudget, unit_chunks
from asyncload.engine.crc import CrcTracker, gaps
from asyncload.engine.meter import Meter
from asyncload.engine.pipeline import Pipeline
from asyncload.engine.plan import make_chunks, plan_tensor
from asyncload.engine.read_loop import probe_slots
from asyncload.engine.records import (
    Record,
    dense,
    expected_storage,
    trim_probed,
)
from asyncload.formats import HEAD_PROBE, TAIL_PROBE, ByteWindow
from asyncload.storage import RetryingStorage

__all__ = ["RecordReads"]

log = logging.getLogger("asyncload.session")


class RecordReads:
    """One load's reads of its records (:meth:`run`), made by
    :meth:`asyncload.engine.session.LoadSession.aread` with what the session holds: its
    storage boundary and I/O threads, its config, statistics and file fingerprints, the
    device path (``stager``), the progress callback. ``torch_casts``: the plan came from a
    planner that is not asyncload's (torch's dtype conversions). Mutable state: ``_report``
    (the progress counter of the run in progress)."""

    def __init__(
        self,
        storage: RetryingStorage,
        executor: Any,
        config: LoadConfig,
        recorder: StatsRecorder,
        *,
        checkpoint: object,
        metadata: Metadata | None,
        fingerprints: dict[str, object],
        stager: Any = None,
        progress: Callable[[int, int], None] | None = None,
        torch_casts: bool = False,
        shared: tuple[Meter, Meter] | None = None,
    ) -> None:
        self.storage = storage
        #: The (read budget, reads in flight) meters shared with other reads running at once
        #: (``Pipeline``'s ``budget`` and ``limiter``), or ``None``: the pipeline's own.
        self._shared = shared
        #: Reads that run at once count their own assembled bytes (their completeness check).
        self._tally = SharedRecorder(recorder) if shared is not None else None
        if self._tally is not None:
            recorder = self._tally
        self._executor = executor
        self.config = config
        self._recorder = recorder
        self.checkpoint = checkpoint
        self.metadata = metadata
        self._fingerprints = fingerprints
        self._stager = stager
        self._progress = progress
        self._torch_casts = torch_casts
        self._report: Callable[[int], None] | None = None

    def _check_written(self, records: list[Record], assembled_before: int, total: int) -> None:
        tally = self._tally
        check_written(
            records,
            assembled_before,
            total,
            self._recorder,
            self.checkpoint,
            written=None if tally is None else tally.assembled,
        )

    async def run(
        self,
        records: list[Record],
        run_chunks: Callable[[Pipeline, list[Chunk]], Awaitable[None]] | None = None,
    ) -> None:
        """Read and assemble every record's bytes: probes and small records, then each
        large record's data; checksums and changed files checked at the end. ``run_chunks``
        replaces ``Pipeline.run`` (a planner that shares reads across ranks)."""
        stager = self._stager
        # CUDA destinations: chunks fit the pinned ring's slots
        chunking = self.config.staged if stager is not None else self.config.chunking
        checks = self.config.checks
        run = (
            run_chunks or Pipeline.run
        )  # (pipeline, chunks): ShardedLoadPlanner's session shares reads
        storage = self.storage
        total = sum(
            dest.numel() * dest.element_size() for r in records for _, dest in r.tensor_items
        )
        self._report = None
        if self._progress is not None:
            done = [0]
            cb = self._progress
            progress_lock = threading.Lock()

            def on_progress(n: int) -> None:
                # called from the loop and from assembly threads: one at a time, so the
                # callback sees bytes_done increase; clamped because a staged read may
                # carry a few bytes of gap between a destination's rows
                with progress_lock:
                    done[0] = min(total, done[0] + n)
                    cb(done[0], total)

            self._report = on_progress
        pipeline = Pipeline(
            storage,
            self.config,
            self._recorder,
            self._executor,
            chunking=chunking,
            staging=stager,
            on_progress=self._report,
            budget=None if self._shared is None else self._shared[0],
            limiter=None if self._shared is None else self._shared[1],
        )
        t_start = time.monotonic()
        assembled_before = self._recorder.stats.bytes_assembled
        await check_files(storage, records, self._fingerprints, self._recorder)
        # A remote load of plain DCP records, each needed whole (one process loading its
        # checkpoint): each record's data is read as soon as its own probes land (:mod:`asyncload.engine.streamed`).
        streamed = run_chunks is None and stager is None and storage.hedgeable and dense(records)
        located = [] if streamed else await self._locate(storage, records, chunking)
        t_checked = time.monotonic()
        await self._aread_transformed(pipeline, [r for r in records if r.transforms])
        # Records up to min_chunk_size (plus the probes' size) are read whole: cheaper than
        # two round trips, and it guarantees that a large record's head and tail probes are
        # more than min_chunk_size apart, so coalescing never reads through its data. Under
        # max_over_read_ratio a record of which this rank needs a slice is read whole only
        # where the bound (and the cost model) allow it, else probed like a large one.
        small = chunking.min_chunk_size + HEAD_PROBE + TAIL_PROBE
        check_object_claims(records, checks, self.checkpoint)
        trackers: list[tuple[CrcTracker, Record]] = []
        ecs = chunking.chunk_size
        reads = ReadBudget.for_load(
            checks, storage.hedgeable, records, self._recorder.stats.bytes_read
        )
        whole = reads.whole_records(records, min(small, ecs))
        # Phase A: whole small records and objects; head and tail probes of large records
        pieces: list[Piece] = []
        deferred: list[Piece] = []  # whole small tensor records read in phase B (sharing)

        def shared_tensor_record(rec: Record) -> bool:
            return run_chunks is not None and bool(rec.tensor_items) and not rec.byte_items

        large: list[Record] = []
        for rec in records:
            if rec.entry is not None or rec.transforms:
                # located already (safetensors, torch.save files), or read and decoded whole
                continue
            if rec.byte_items and not rec.tensor_items and rec.length > ecs:
                # an object larger than one read: fetched in chunk_size pieces into one buffer
                buf = bytearray(rec.length)
                rec.raw = buf  # type: ignore[assignment]  # complete once phase A has run
                for lo in range(0, rec.length, ecs):
                    hi = min(rec.length, lo + ecs)
                    pieces.append(
                        Piece(
                            rec.name, rec.offset + lo, rec.offset + hi, into=memoryview(buf)[lo:hi]
                        )
                    )
            elif id(rec) in whole:
                whole_piece = Piece(rec.name, rec.offset, rec.end, deliver=self._whole_record(rec))
                # sharing: a small tensor record is read with the data (phase B), so that a rank
                # whose assembly is slow does not hold up every rank's start of phase B
                (deferred if shared_tensor_record(rec) else pieces).append(whole_piece)
            else:
                large.append(rec)
                if streamed:  # probed (or read by a guess) as they go out: engine.streamed
                    continue
                from asyncload.engine.streamed import probe_pieces  # DCP records only

                pieces.extend(probe_pieces(rec))
        chunks = unit_chunks(pieces, chunking, reads)
        if streamed:
            from asyncload.engine.streamed import aread_streamed

            await aread_streamed(
                self, pipeline, storage, self.config, chunks, large, reads, trackers
            )
            self._check_written(records, assembled_before, total)
            log.debug(
                "read %d records streamed (each record's data once its probes landed): %.4f s",
                len(records),
                time.monotonic() - t_start,
            )
            for tracker, rec in trackers:
                check_crc(tracker, rec, storage, self._recorder)
            await check_unchanged(storage, self._fingerprints)
            return
        pipeline.headers = True
        try:
            await run(pipeline, chunks)
        finally:
            pipeline.headers = False
        reads.measure(self._recorder)
        t_phase_a = time.monotonic()
        # Phase B: locate each large record's tensor, then read the boxes each item needs
        data_pieces: list[Piece] = []
        # destination bytes the probes already read: copied once every item is planned
        from_probes: list[tuple[memoryview, memoryview]] = []
        headers: list[
            tuple[Record, Any]
        ] = []  # each record's tensor location: the rest is its headers
        for rec in large + located:
            data_pieces.extend(
                await self._record_pieces(
                    rec,
                    storage,
                    chunking,
                    stager,
                    reads,
                    trackers,
                    from_probes,
                    headers,
                    shared=run_chunks is not None,
                )
            )
        self._copy_from_probes(from_probes)
        charge = ForeignBytes(self.metadata, headers) if reads.bounded else None
        chunks = self._data_chunks(data_pieces, chunking, reads, charge)
        if deferred:
            chunks = [*chunks, *unit_chunks(deferred, chunking, reads)]
        t_planned = time.monotonic()
        await run(pipeline, chunks)
        self._check_written(records, assembled_before, total)
        log.debug(
            "read %d records: files checked in %.4f s, probes and small records %.4f s, "
            "layouts and planning %.4f s (%d chunks), data %.4f s",
            len(records),
            t_checked - t_start,
            t_phase_a - t_checked,
            t_planned - t_phase_a,
            len(chunks),
            time.monotonic() - t_planned,
        )
        for tracker, rec in trackers:
            check_crc(tracker, rec, storage, self._recorder)
        await check_unchanged(storage, self._fingerprints)

    async def _record_pieces(
        self,
        rec: Record,
        storage: RetryingStorage,
        chunking: ChunkPolicy,
        stager: Any,
        reads: ReadBudget,
        trackers: list[tuple[CrcTracker, Record]],
        from_probes: list[tuple[memoryview, memoryview]],
        headers: list[tuple[Record, Any]],
        *,
        shared: bool,
    ) -> list[Piece]:
        """The data reads of one large (probed) or located record: its tensor located
        from the probes (more of its headers fetched where they fall short), each item
        planned and checked, bytes the probes hold taken from them (``from_probes``), a
        checksum tracker under ``verify`` (``trackers``); ``headers``: the record's tensor
        location, the rest of it being headers. ``shared``: reads planned by
        ShardedLoadPlanner, whose plan of who reads what counts every range."""
        checks = self.config.checks
        if rec.known is not None:
            loc = rec.known
        else:  # a DCP record (a torch.save archive): located from its probes
            from asyncload.engine.streamed import locate

            loc = await locate(rec, storage, checks)
        tracker = None
        if checks.verify and loc.crc32 is not None:
            tracker = CrcTracker(loc.data_start, loc.data_start + loc.storage_nbytes, loc.crc32)
            trackers.append((tracker, rec))
        rec_pieces = [
            p
            for _, item_pieces in self._plan_items(
                rec,
                loc,
                chunking.chunk_size,
                chunking.min_chunk_size,
                stager,
                max_gap=reads.max_gap,
            )
            for p in item_pieces
        ]
        if (
            reads.bounded
            and not shared
            and tracker is None
            and stager is None
            and rec.known is None
        ):
            rec_pieces = trim_probed(rec, rec_pieces, from_probes)
        headers.append((rec, loc))
        if tracker is not None:
            for p in rec_pieces:
                p.tracker = tracker
            # a narrow read (a rank's slice of a saved chunk) leaves bytes of the storage
            # out: read them too, only to checksum them, so that verify=True never hands
            # over bytes it did not check (docs/integrity.md)
            ecs = chunking.chunk_size
            for lo, hi in gaps([(p.start, p.end) for p in rec_pieces], tracker.start, tracker.end):
                for a in range(lo, hi, ecs):
                    rec_pieces.append(Piece(rec.name, a, min(hi, a + ecs), tracker=tracker))
        rec.window = ByteWindow()  # probes are no longer needed
        return rec_pieces

    def _data_chunks(
        self,
        pieces: list[Piece],
        chunking: ChunkPolicy,
        reads: ReadBudget,
        charge: Callable[[str, int, int], int] | None,
    ) -> list[Chunk]:
        """Data pieces as read requests, gaps read through within what the over-read bound
        leaves."""
        chunks = make_chunks(
            pieces,
            chunk_size=chunking.chunk_size,
            min_chunk_size=reads.join_gap(chunking.min_chunk_size),
            max_over_read=reads.gap_allowance(self._recorder.stats.bytes_read, pieces),
            charge=charge,
        )
        for c in chunks:
            for seg in c.segments:
                if seg.into is None and seg.deliver is None:
                    seg.payload = False  # read only to be checksummed
        return chunks

    def _copy_from_probes(self, from_probes: list[tuple[memoryview, memoryview]]) -> None:
        """Destination bytes the probes already read, copied (once every item is planned)."""
        copied = 0
        for into, data in from_probes:
            into[:] = data
            copied += len(data)
        from_probes.clear()
        if copied:
            self._recorder.add(bytes_assembled=copied)
            if self._report is not None:
                self._report(copied)

    def _plan_items(
        self,
        rec: Record,
        loc: TensorLocation,
        chunk_size: int,
        min_chunk_size: int,
        stager: Any,
        *,
        max_gap: int | None = None,
    ) -> list[tuple[torch.Tensor, list[Piece]]]:
        """Each of ``rec``'s tensor items as pieces of its destination view, each item checked
        to fill its view before any is read (the dtype rule: this load's options, or torch's
        casts under torch's own planner)."""
        planned = []
        for item, dest in rec.tensor_items:
            pieces = plan_tensor(
                loc,
                item.storage_offsets,
                item.lengths,
                dest,
                chunk_size=chunk_size,
                min_chunk_size=min_chunk_size,
                allow_cast=self.config.checks.allow_dtype_cast or self._torch_casts,
                key=item.dest_index.fqn,
                stager=stager,
                max_gap=max_gap,
            )
            check_planned(item, dest, pieces, rec)
            planned.append((dest, pieces))
        return planned

    async def _locate(
        self, storage: RetryingStorage, records: list[Record], chunking: ChunkPolicy
    ) -> list[Record]:
        """Records of already located formats: tensors' locations (safetensors blobs in DCP
        files: their headers are read now), objects decoded (tensors inside them read)."""
        located = [r for r in records if r.entry is not None]

        kinds: dict[type[formats.FormatEntry], list[Record]] = {}
        for r in located:
            kinds.setdefault(type(r.entry), []).append(r)
        fetcher = formats.Fetcher(
            storage, self.config.checks, chunking, slots=probe_slots(self.config)
        )
        for kind, recs in kinds.items():
            found = await kind.resolve([r.entry for r in recs], fetcher)
            for r, value in zip(recs, found):
                if kind.holds_object:
                    r.value = value
                else:
                    r.known = value
        return [r for r in located if r.known is not None]

    def _whole_record(self, rec: Record) -> Callable[[memoryview], None]:
        """Assembly of a record read whole: its bytes as stored, or (a record saved with
        stream transforms) the archive its transforms decoded."""
        recorder = self._recorder
        checks = self.config.checks
        base = 0 if rec.transforms else rec.offset

        def deliver(data: memoryview) -> None:
            if rec.byte_items:
                rec.raw = bytes(data)
            if not rec.tensor_items:
                return
            win = ByteWindow()
            win.add(base, data)
            where = (
                f"{rec.where}, decoded through {list(rec.transforms)}"
                if rec.transforms
                else rec.where
            )
            layout = formats.parse_archive(
                win,
                base,
                len(data),
                where,
                max_pickle=checks.max_metadata_size,
                safe_globals=checks.safe_globals,
            )
            loc = formats.tensor_location(layout, rec.name)
            check_against_metadata(rec, loc)
            if rec.transforms:
                check_decoded_storage(rec, loc)
            # a decoded record is always checked: a damaged compressed stream may decode to
            # other bytes without an error of its own (zstd frames carry no checksum by default)
            if (checks.verify or rec.transforms) and loc.crc32 is not None:
                tracker = CrcTracker(
                    loc.data_start, loc.data_start + loc.storage_nbytes, loc.crc32
                )
                tracker.add(base, data)
                raise_on_bad_crc(tracker, rec, rec.name)
                recorder.add(verified_records=1)
            n = 0
            planned = self._plan_items(rec, loc, 1 << 62, 1 << 62, self._stager)
            for dest, item_pieces in planned:  # every item planned before any is written
                for p in item_pieces:
                    part = data[p.start - base : p.end - base]
                    if p.into is not None:
                        copy_bytes(p.into, part)
                    elif p.deliver is not None:
                        p.deliver(part)
                n += dest.numel() * dest.element_size()
            recorder.add(bytes_assembled=n)
            report = self._report
            if report is not None and n:
                report(n)

        return deliver

    async def _aread_transformed(self, pipeline: Pipeline, records: list[Record]) -> None:
        """Records saved with stream transforms: fetched whole, decoded, assembled
        (:mod:`asyncload.engine.transforms`)."""
        if not records:
            return
        storage = pipeline.storage
        reads = []
        for rec in records:
            room = max(1, pipeline.budget.capacity - rec.length)
            expected = expected_storage(rec)
            retry: int | None = None
            if expected is not None:
                limit = (
                    expected + _transforms.ARCHIVE_SLACK
                )  # the tensor's bytes and its archive's headers
            else:  # an object: the metadata does not say how large; most are small
                retry = min(room, self.config.checks.max_metadata_size)
                limit = min(retry, max(4 * rec.length, 1 << 20))
            url = storage.url(rec.name)
            what = f"key {rec.fqn!r}, {url} {rec.where} (transforms {list(rec.transforms)})"
            deliver = self._whole_record(rec)
            reads.append(
                _transforms.TransformedRead(
                    rec.name, rec.offset, rec.end, rec.extensions, limit, what, deliver, retry
                )
            )
        await _transforms.aread_transformed(pipeline, reads)
