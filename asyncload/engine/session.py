"""LoadSession: the async core of one load.

A session owns everything one load needs beyond the planner: the storage (behind the
retrying error boundary, :class:`asyncload.storage.retrying.RetryingStorage`), the I/O threads,
the statistics and the load's clock, file fingerprints, cancellation, the metadata read
and format probing, the read phases (probes and small records, then tensor data) and the
checks (file sizes before any destination is touched, checksums, files changed under
the load). Every face calls it: ``load``/``aload``/``start_load`` through the driver
(:mod:`asyncload.engine.driver`), ``dcp.load`` through :class:`asyncload.PipelinedReader`, the CLI.

Threads: coroutines run on one event loop (the library's loop thread for the sync faces,
the caller's loop for ``aload``); :meth:`LoadSession.prepare_reads` and
:meth:`LoadSession.commit` call planner hooks and run on the caller's thread (or a worker
thread for ``aload``); copies run on the I/O threads.

Options: :attr:`LoadSession.options` governs every call the session makes. Under a plain
``dcp.load``, torch reads ``.metadata`` before it hands the reader the planner, so the
reader's options govern the metadata read and a :class:`PipelinedLoadPlanner` with options
of its own governs everything after it (:meth:`LoadSession.use_options`); ``asyncload.load``
resolves one ``LoadOptions`` before anything is read and gives it to both.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import functools
import io
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from asyncload import formats
from asyncload._errors import (
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    StateDictMismatchError,
    docs_ref,
    redact_url,
)
from asyncload._loop import loop_thread, refuse_on_library_loop, run_sync
from asyncload._options import ChunkPolicy, LoadOptions
from asyncload._paths import check_relative_path
from asyncload._stats import LoadStats, StatsRecorder
from asyncload.engine import cuda as _cuda
from asyncload.engine import transforms as _transforms
from asyncload.engine.assembly import copy_bytes
from asyncload.engine.chunks import Chunk, Piece, TensorLocation
from asyncload.engine.crc import CrcTracker, gaps
from asyncload.engine.pipeline import Pipeline
from asyncload.engine.plan import break_even_gap, make_chunks, plan_tensor
from asyncload.formats.torchsave import (
    HEAD_PROBE,
    TAIL_PROBE,
    ByteWindow,
    aparse_archive,
    materialize,
    parse_archive,
    tensor_location,
)
from asyncload.storage import RetryingStorage, is_local, local_root, open_storage

__all__ = ["LoadSession", "decode_object"]

log = logging.getLogger("asyncload.session")
T = TypeVar("T")


def decode_object(
    raw: bytes | memoryview, *, what: str, max_pickle: int = 1 << 30, safe_globals: tuple[Any, ...] = ()
) -> Any:
    """A non-tensor object saved by DCP (a torch.save archive), decoded with the allow-list
    (and the globals the user trusts: ``LoadOptions.safe_globals``)."""
    win = ByteWindow()
    win.add(0, raw)
    layout = parse_archive(win, 0, len(raw), what, max_pickle=max_pickle, safe_globals=safe_globals)
    return materialize(layout, win)


@dataclass
class _Record:
    """One saved item (a torch.save archive inside a .distcp file) and the reads that need it."""

    name: str
    offset: int
    length: int
    fqn: str
    tensor_items: list[tuple[ReadItem, torch.Tensor]] = field(default_factory=list)
    byte_items: list[ReadItem] = field(default_factory=list)
    chunk_md: Any = None
    dtype: torch.dtype | None = None
    window: ByteWindow = field(default_factory=ByteWindow)
    raw: bytes | None = None
    #: A ``formats.FormatEntry`` (KnownTensor, BlobTensor, KnownObject): bytes located by a format module.
    entry: Any = None
    #: The located tensor of ``entry`` (a TensorLocation), and the decoded object of a KnownObject.
    known: Any = None
    value: Any = None
    #: Stream transforms the record was saved with (descriptors) and the extensions decoding them.
    transforms: tuple[str, ...] = ()
    extensions: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def where(self) -> str:
        return f"record {self.fqn!r} at [{self.offset}, {self.end}) of {self.name}"


def _refuse_a_dcp_file(checkpoint: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointFormatError` when ``checkpoint`` names a file inside a DCP
    checkpoint (a ``.distcp`` data file or the ``.metadata``) instead of its directory."""
    path = str(checkpoint).split("?", 1)[0].split("#", 1)[0].rstrip("/")
    name = path.rsplit("/", 1)[-1]
    if name.endswith(".distcp") or name == ".metadata" or (name.startswith("__") and name.endswith(".metadata")):
        parent = path[: -len(name)].rstrip("/") or "/"
        raise CheckpointFormatError(
            f"{checkpoint} is a file of a DCP checkpoint, not the checkpoint: pass the checkpoint directory "
            f"({parent}) that holds it and the .metadata"
        )


class LoadSession:
    """The async core of one load of ``checkpoint`` (a local path, ``PathLike``, ``file://``
    or fsspec URL; ``storage_options`` go to the fsspec filesystem).

    A session may run several loads one after the other (a reader reused by ``dcp.load``):
    :meth:`begin` starts each one's statistics and clock.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        options: LoadOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.options = options or LoadOptions()
        self.storage_options = dict(storage_options or {})
        #: ``progress(bytes_done, bytes_total)``, called from the loop and assembly threads.
        self.progress: Callable[[int, int], None] | None = None
        #: The loop the coroutines run on for the sync faces (``None``: the library's loop thread).
        self.loop: asyncio.AbstractEventLoop | None = None
        #: (pid, loop) of the library loop thread the sync faces chose (:meth:`_library_loop`).
        self._pinned_loop: tuple[int, asyncio.AbstractEventLoop] | None = None
        #: The final statistics of the last load, once it has finished.
        self.stats: LoadStats | None = None
        #: The metadata the reads are planned from (set by :meth:`prepare_reads`).
        self.metadata: Metadata | None = None
        #: The first error of the metadata read in this load (``dcp.load`` hides it behind an AssertionError).
        self.metadata_error: BaseException | None = None
        #: A local checkpoint directory that does not exist (no rank-local fallback to try).
        self.checkpoint_missing = False
        #: Multi-rank loads: the process group and its monitor (:mod:`asyncload.engine.driver`).
        self.group: Any = None
        self.monitor: Any = None
        self._recorder = StatsRecorder()
        self._t0: float | None = None
        self._report: Callable[[int], None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        #: file name -> Storage.fingerprint when the load first looked at it (a save
        #: rewriting the checkpoint during the load is an error, not a torn tensor)
        self._fingerprints: dict[str, object] = {}
        self._storage: RetryingStorage | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: Where storage is opened when not at ``checkpoint`` (the directory of a file checkpoint).
        self._storage_root: str | None = None
        #: The device path of the load in progress (``_cuda.DeviceStager``), if any.
        self._stager: Any = None
        #: Decodes records saved with stream transforms (``PipelinedReader(_extension_registry=...)``).
        self.extension_registry = _transforms.default_registry()
        #: ``.metadata`` decoded before, by URL and bytes (shared by loads of one checkpoint key by
        #: key, as the CLI's ``verify`` does after damage): the same bytes are decoded once.
        self.metadata_cache: dict[tuple[str, bytes], Metadata] | None = None
        #: The plan comes from a planner that is not asyncload's (torch's DefaultLoadPlanner):
        #: convert dtypes as torch does, without asyncload's lossless-widening rule.
        self._torch_casts = False

    def __repr__(self) -> str:
        return f"LoadSession({redact_url(str(self.checkpoint))!r}, started={self._t0 is not None}, done={self.stats is not None})"

    # --- one load's clock and statistics -------------------------------------------------

    def begin(self, checkpoint: str | os.PathLike[str] | None = None) -> None:
        """Start a load (of ``checkpoint`` instead, when given): fresh statistics and clock."""
        if checkpoint:
            self.checkpoint = checkpoint
            self._storage_root = None
        self._recorder = StatsRecorder()
        self._t0 = time.monotonic()
        self.stats = None
        self.metadata_error = None
        self._fingerprints = {}

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def use_options(self, options: LoadOptions) -> None:
        """Govern the rest of the load by ``options`` (see the module docstring)."""
        if options is not self.options:
            self.options = options
            if self._storage is not None:  # the open store takes the new policy too
                self._storage.retry = options.retry_policy
                self._storage.hedge = options.hedge_policy if self._storage.hedgeable and options.hedge else None

    def live_stats(self) -> LoadStats:
        """The statistics so far (``seconds`` is the time since the load started); final once done."""
        if self.stats is not None:
            return self.stats
        snap = self._recorder.snapshot()
        if self._t0 is not None:
            snap.seconds = time.monotonic() - self._t0
        return snap

    def finish(self) -> LoadStats:
        """The load has succeeded: freeze and return its statistics."""
        if self._t0 is not None:
            self._recorder.stats.seconds = time.monotonic() - self._t0
        self.stats = self._recorder.snapshot()
        return self.stats

    # --- the sync face and cancellation ------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], *, cleanup: bool = False) -> T:
        """Run ``coro`` on the session's loop from another thread and wait (the sync faces).
        A cancelled session runs nothing more but ``cleanup`` coroutines (closing)."""
        if self._cancelled.is_set() and not cleanup:
            coro.close()
            raise asyncio.CancelledError()
        if self.loop is None:
            refuse_on_library_loop(coro)
        loop = self.loop or self._library_loop()
        return run_sync(coro, loop, on_task=None if cleanup else self._track_task)

    def _library_loop(self) -> asyncio.AbstractEventLoop:
        """The library loop thread this session runs on: chosen once (its storage's clients
        belong to that loop), again in a forked child or once that loop has stopped."""
        pinned = self._pinned_loop
        if pinned is None or pinned[0] != os.getpid() or not pinned[1].is_running():
            loop = loop_thread(self.options.use_uvloop, local=is_local(self.checkpoint))
            pinned = self._pinned_loop = (os.getpid(), loop)
        return pinned[1]

    def _track_task(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._tasks.add(task)
        task.add_done_callback(self._untrack)
        if self._cancelled.is_set():
            task.cancel()

    def _untrack(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._tasks.discard(task)

    async def guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the running loop as a task :meth:`cancel` can reach (``aload``)."""
        if self._cancelled.is_set():
            coro.close()
            raise asyncio.CancelledError()
        task = asyncio.ensure_future(coro)
        self._track_task(task)
        return await task

    @property
    def cancelled(self) -> threading.Event:
        """Set once :meth:`cancel` was called."""
        return self._cancelled

    def cancel(self) -> None:
        """Cancel the load in progress (from any thread); it raises CancelledError."""
        self._cancelled.set()
        with self._lock:
            tasks = list(self._tasks)
        for t in tasks:
            t.get_loop().call_soon_threadsafe(t.cancel)

    # --- storage -----------------------------------------------------------------------

    def _io_threads(self) -> int:
        options = self.options
        if options.io_threads is not None:
            return options.io_threads
        # page-cache copies scale with cores, not with threads; more threads than cores
        # measured slower here (docs/performance.md)
        return max(2, min(16, options.max_in_flight, os.cpu_count() or 2))

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The load's I/O and assembly threads (started on first use)."""
        if self._executor is None:
            self._executor = _IOThreads(self._io_threads(), thread_name_prefix="asyncload-io")
        return self._executor

    @property
    def open(self) -> bool:
        """Whether files, sessions or I/O threads are open (:meth:`aclose` has work to do)."""
        return self._storage is not None or self._executor is not None

    async def storage(self) -> RetryingStorage:
        """The checkpoint's storage behind the retrying error boundary (opened on first use)."""
        if self._storage is None:
            root = self._storage_root if self._storage_root is not None else self.checkpoint
            raw = open_storage(
                root,
                self.storage_options,
                self.executor,
                transport=self.options.transport,
                mapped_copies=self.options.local_mapped_copies,
                max_listing_size=self.options.max_metadata_size,
            )
            self._storage = RetryingStorage.for_options(raw, self.options, self._recorder, self.executor)
        elif self._storage.stats is not self._recorder:  # a reused reader's next load
            self._storage.stats = self._recorder
        return self._storage

    async def _open_root(self, root: str | None) -> RetryingStorage:
        """Storage at ``root`` instead (a file checkpoint is read relative to its directory)."""
        if self._storage is not None and self._storage_root == root:
            return self._storage
        storage, self._storage = self._storage, None
        if storage is not None:
            await storage.aclose()
        self._storage_root = root
        return await self.storage()

    async def aclose(self) -> None:
        """Close files and sessions and stop the I/O threads (waits for running reads)."""
        storage, self._storage = self._storage, None
        executor, self._executor = self._executor, None
        if storage is not None:
            await storage.aclose()
        if executor is not None:
            if isinstance(executor, _IOThreads) and executor.idle:
                # nothing is running or queued (a load that ended well): the idle threads
                # exit as soon as they are told, so they are joined here, without a hop to
                # another thread (a stuck read, which could block the loop, is never idle)
                executor.shutdown(wait=True)
                return
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: executor.shutdown(wait=True, cancel_futures=True)
            )

    def close(self) -> None:
        """Sync :meth:`aclose`."""
        if self._storage is None and self._executor is None:
            return
        self.run(self.aclose(), cleanup=True)

    def close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            log.debug("closing the storage of %s failed", redact_url(str(self.checkpoint)), exc_info=True)

    # --- metadata ------------------------------------------------------------------------

    async def aread_metadata(self, rank: int | None = None) -> Metadata:
        """Read and decode ``.metadata`` (``__{rank}.metadata`` when ``rank`` is given) with
        the allow-list; check its version and structure.

        A checkpoint that is not a DCP directory (safetensors, a torch.save file: see
        :mod:`asyncload.formats`) gets a synthesised ``Metadata`` instead.
        """
        try:
            return await self._aread_metadata(rank)
        except Exception as exc:
            if self.metadata_error is None:
                self.metadata_error = exc
            raise

    async def _aread_metadata(self, rank: int | None) -> Metadata:
        options = self.options
        _refuse_a_dcp_file(self.checkpoint)
        if rank is None:
            if self._storage_root is not None:
                await self._open_root(None)  # back to the checkpoint itself
            found = await formats.aprobe_first(self.checkpoint, self._open_root, options)
            if found is not None:
                return found
            await self._open_root(None)  # probing may have opened the directory of a would-be file
        storage = await self.storage()
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        url = storage.url(name)
        raw: memoryview | None = None
        try:  # retried like any read: a 503 on this first request must not fail the load
            if storage.supports_read_object:  # one GET: its answer gives the size and version
                first = asyncio.ensure_future(storage.read_object(name, options.max_metadata_size))
                if rank is None:
                    storage.prefetch_sizes()  # the data files' sizes, listed while .metadata is read
                raw, size = await first
            else:
                size = await storage.size(name)
        except CheckpointNotFoundError as exc:
            if is_local(self.checkpoint) and not os.path.lexists(local_root(self.checkpoint)):  # noqa: ASYNC240 - one stat, on the error path
                self.checkpoint_missing = True
                raise CheckpointNotFoundError(
                    f"the checkpoint {self.checkpoint} does not exist: no such file or directory (check the path)",
                    path=str(self.checkpoint),
                    status=404,
                ) from None  # the .metadata it looked for adds nothing
            if rank is None:
                found = await formats.aprobe_fallback(self.checkpoint, storage, self._open_root, options)
                if found is not None:
                    return found
            raise CheckpointNotFoundError(
                f"{url} does not exist: {self.checkpoint} is not a DCP checkpoint, or its save did not finish "
                "(DCP writes .metadata last); nor is it a safetensors or torch.save checkpoint "
                f"({docs_ref('Formats')})",
                path=url,
                status=404,
            ) from exc.__cause__ or exc  # the client's own error: the translated one says the same
        if size > options.max_metadata_size:
            raise CheckpointFormatError(
                f"{url} is {size} bytes, more than LoadOptions.max_metadata_size={options.max_metadata_size}"
            )
        if size == 0:
            raise CheckpointFormatError(f"{url} is empty: the checkpoint is incomplete or damaged")
        fp = await storage.fingerprint(name)
        if fp is not None:
            self._fingerprints[name] = fp
        if raw is None:
            raw = await storage.read(name, 0, size, counted=False)
        cache, md = self.metadata_cache, None
        if cache is not None:
            md = cache.get((url, bytes(raw)))
        if md is None:
            md = formats.decode_metadata(raw, url, max_size=options.max_metadata_size)
            if cache is not None:
                cache.clear()  # the last one only
                cache[(url, bytes(raw))] = md
        self._recorder.add(files=1)
        return md

    # --- reading -------------------------------------------------------------------------

    def prepare_reads(self, plan: LoadPlan, planner: LoadPlanner, metadata: Metadata) -> list[_Record]:
        """The plan's reads grouped by saved record, destinations resolved through the
        planner (its hooks: call on the caller's thread), the device path set up, the
        unexpected-keys rule applied."""
        self.metadata = metadata
        records = self.collect(plan, planner)
        # CUDA destinations: pinned staging ring + side stream (caller's thread: stream order)
        self._stager = _cuda.stager_for((d for r in records for _, d in r.tensor_items), self.options)
        missing = getattr(planner, "missing_keys", None)
        if isinstance(missing, list):
            self._recorder.stats.missing_keys = list(missing)
        tied = getattr(planner, "tied_keys", None)
        if isinstance(tied, dict):
            self._recorder.stats.tied_keys = dict(tied)
        unexpected = getattr(planner, "unexpected_keys", None)
        if isinstance(unexpected, list):
            self._recorder.stats.unexpected_keys = list(unexpected)
            if unexpected and self.options.strict_unexpected_keys:
                raise StateDictMismatchError(
                    f"the checkpoint holds {len(unexpected)} keys the destination lacks: "
                    f"{unexpected[:10]} (LoadOptions.strict_unexpected_keys=True)"
                )
        return records

    def end_reads(self) -> None:
        """The reads are over (done, failed or cancelled): every device copy has finished
        and files, sessions and I/O threads are closed (sync faces; caller's thread)."""
        stager, self._stager = self._stager, None
        try:
            if stager is not None:
                stager.finish_sync()
        finally:
            self.close_quietly()

    async def aend_reads(self) -> None:
        """:meth:`end_reads` on the running loop (``aload``)."""
        stager, self._stager = self._stager, None
        try:
            if stager is not None:
                await asyncio.to_thread(stager.finish_sync)
        finally:
            try:
                await self.aclose()
            except Exception:
                log.debug("closing the storage of %s failed", redact_url(str(self.checkpoint)), exc_info=True)

    def commit(self, records: list[_Record], planner: LoadPlanner) -> None:
        """Hand every tensor and decoded object to the planner (its hooks: caller's thread).

        Objects: a :class:`PipelinedLoadPlanner` gets them decoded by the allow-list
        (``load_object``), unless its class overrides ``load_bytes``: that one gets each DCP
        object's raw record (an ``io.BytesIO``, as torch's ``FileSystemReader`` gives it) and
        decodes it itself. Any other planner (torch's ``DefaultLoadPlanner`` decodes with
        ``torch.load(weights_only=False)``) gets the raw record only after the allow-list has
        decoded it. Objects of a torch.save file are part of its one pickle, decoded when its
        layout was read: ``load_bytes`` gets them saved again with ``torch.save``."""
        from asyncload._dcp import PipelinedLoadPlanner

        ours = isinstance(planner, PipelinedLoadPlanner)
        raw_bytes = ours and type(planner).load_bytes is not PipelinedLoadPlanner.load_bytes
        safe_globals = self.options.safe_globals
        for rec in records:
            for item, dest in rec.tensor_items:
                planner.commit_tensor(item, dest)
        for rec in records:
            for item in rec.byte_items:
                if rec.entry is not None:  # decoded by a format module (a torch.save pickle)
                    if ours and not raw_bytes:
                        planner.load_object(item, rec.value)  # type: ignore[attr-defined]
                    else:
                        planner.load_bytes(item, formats.object_bytes(rec.value))
                    continue
                if rec.raw is None:  # pragma: no cover - every object record is read whole
                    raise CheckpointFormatError(f"{rec.where}: the object was not read")
                if raw_bytes:  # the planner's own decode (docs/distributed.md): its safety is the user's
                    planner.load_bytes(item, io.BytesIO(rec.raw))
                    continue
                obj = decode_object(
                    rec.raw,
                    what=f"object {rec.fqn!r} in {rec.where}",
                    max_pickle=self.options.max_metadata_size,
                    safe_globals=safe_globals,
                )
                if ours:
                    planner.load_object(item, obj)  # type: ignore[attr-defined]
                else:  # bytes were checked by the allow-list above; the planner decodes them its own way
                    planner.load_bytes(item, io.BytesIO(rec.raw))

    def collect(self, plan: LoadPlan, planner: LoadPlanner) -> list[_Record]:
        """Group the plan's read items by saved record; resolve destinations (caller's thread)."""
        md = self.metadata
        if md is None:  # pragma: no cover - prepare_reads sets it
            raise CheckpointFormatError(f"{self.checkpoint}: no metadata to plan reads from")
        from asyncload._dcp import PipelinedLoadPlanner

        storage_data = md.storage_data
        records: dict[tuple[str, int, int], _Record] = {}
        checked: set[str] = set()  # file names already found to be plain relative paths
        located: list[_Record] = []
        self._torch_casts = not isinstance(planner, PipelinedLoadPlanner)
        for item in plan.items:
            sinfo = storage_data.get(item.storage_index)
            if sinfo is None:
                raise CheckpointFormatError(
                    f"{self.checkpoint}: metadata has no storage entry for {item.storage_index}"
                )
            if isinstance(sinfo, formats.FormatEntry):
                # safetensors / torch.save files, DCP saved as safetensors: one record per item
                rec = _Record(sinfo.relative_path, sinfo.offset, sinfo.length, item.storage_index.fqn, entry=sinfo)
                if item.type == LoadItemType.BYTE_IO:
                    rec.byte_items.append(item)
                else:
                    rec.tensor_items.append((item, planner.resolve_tensor(item).detach()))
                located.append(rec)
                continue
            name, offset, length = (
                getattr(sinfo, "relative_path", None),
                getattr(sinfo, "offset", None),
                getattr(sinfo, "length", None),
            )
            if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length <= 0:
                raise CheckpointFormatError(
                    f"{self.checkpoint}: malformed storage entry {sinfo!r:.200} for {item.storage_index.fqn!r}"
                )
            if type(name) is not str or name not in checked:
                name = check_relative_path(name, f"{self.checkpoint}: storage entry of {item.storage_index.fqn!r:.200}")
                checked.add(name)
            key = (name, offset, length)
            found = records.get(key)
            if found is None:
                found = records[key] = _Record(name, offset, length, item.storage_index.fqn)
                descriptors = getattr(sinfo, "transform_descriptors", None)
                if descriptors:  # checked now: an unknown transform fails before any read
                    found.transforms = tuple(descriptors)
                    found.extensions = _transforms.extensions_for(
                        self.extension_registry,
                        found.transforms,
                        what=f"key {found.fqn!r} in {self.checkpoint}, {found.where}",
                    )
            rec = found
            if item.type == LoadItemType.BYTE_IO:
                rec.byte_items.append(item)
            else:
                smd = md.state_dict_metadata.get(item.storage_index.fqn)
                if isinstance(smd, TensorStorageMetadata):
                    rec.dtype = smd.properties.dtype
                    idx = item.storage_index.index
                    if (
                        idx is not None
                        and 0 <= idx < len(smd.chunks)
                        and smd.chunks[idx].offsets == item.storage_index.offset
                    ):
                        rec.chunk_md = smd.chunks[idx]
                    else:
                        rec.chunk_md = next((c for c in smd.chunks if c.offsets == item.storage_index.offset), None)
                dest = planner.resolve_tensor(item).detach()
                rec.tensor_items.append((item, dest))
        return sorted(records.values(), key=lambda r: (r.name, r.offset)) + located

    async def aread(
        self, records: list[_Record], run_chunks: Callable[[Pipeline, list[Chunk]], Awaitable[None]] | None = None
    ) -> None:
        """Read and assemble every record's bytes: probes and small records, then each
        large record's data; checksums and changed files checked at the end."""
        options = self.options
        chunking = options.chunk_policy
        run = run_chunks or Pipeline.run  # (pipeline, chunks): ShardedLoadPlanner's session shares reads
        storage = await self.storage()
        assert self._executor is not None
        stager = self._stager
        if stager is not None:  # CUDA destinations: chunks fit the pinned ring's slots
            options = stager.plan_options(options)
            chunking = options.chunk_policy
        pipeline = Pipeline(storage, options, self._recorder, self._executor)
        pipeline.staging = stager
        total = sum(dest.numel() * dest.element_size() for r in records for _, dest in r.tensor_items)
        self._report = None
        if self.progress is not None:
            done = [0]
            cb = self.progress
            progress_lock = threading.Lock()

            def on_progress(n: int) -> None:
                # called from the loop and from assembly threads: one at a time, so the
                # callback sees bytes_done increase; clamped because a staged read may
                # carry a few bytes of gap between a destination's rows
                with progress_lock:
                    done[0] = min(total, done[0] + n)
                    cb(done[0], total)

            pipeline.on_progress = on_progress
            self._report = on_progress
        t_start = time.monotonic()
        assembled_before = self._recorder.stats.bytes_assembled
        await self._check_files(storage, records)
        # A remote load of plain DCP records, each needed whole (one process loading its
        # checkpoint): each record's data is read as soon as its own probes land (_aread_streamed).
        streamed = run_chunks is None and stager is None and storage.hedgeable and _dense(records)
        located = [] if streamed else await self._locate(storage, records, options)
        t_checked = time.monotonic()
        await self._aread_transformed(pipeline, [r for r in records if r.transforms], options)
        # Records up to min_chunk_size (plus the probes' size) are read whole: cheaper than
        # two round trips, and it guarantees that a large record's head and tail probes are
        # more than min_chunk_size apart, so coalescing never reads through its data. Under
        # max_over_read_ratio a record of which this rank needs a slice is read whole only
        # where the bound (and the cost model) allow it, else probed like a large one.
        small = chunking.min_chunk_size + HEAD_PROBE + TAIL_PROBE
        _check_object_claims(records, options, self.checkpoint)
        trackers: list[tuple[CrcTracker, _Record]] = []
        ecs = chunking.chunk_size
        reads = _ReadBudget.for_load(options, storage.hedgeable, records, self._recorder.stats.bytes_read)
        whole = reads.whole_records(records, min(small, ecs))
        # Phase A: whole small records and objects; head and tail probes of large records
        pieces: list[Piece] = []
        deferred: list[Piece] = []  # whole small tensor records read in phase B (sharing)

        def shared_tensor_record(rec: _Record) -> bool:
            return run_chunks is not None and bool(rec.tensor_items) and not rec.byte_items

        large: list[_Record] = []
        probe_of: dict[int, _Record] = {}  # id of a probe piece -> its record
        for rec in records:
            if rec.entry is not None or rec.transforms:
                continue  # located already (safetensors, torch.save files), or read and decoded whole
            if rec.byte_items and not rec.tensor_items and rec.length > ecs:
                # an object larger than one read: fetched in chunk_size pieces into one buffer
                buf = bytearray(rec.length)
                rec.raw = buf  # type: ignore[assignment]  # complete once phase A has run
                for lo in range(0, rec.length, ecs):
                    hi = min(rec.length, lo + ecs)
                    pieces.append(Piece(rec.name, rec.offset + lo, rec.offset + hi, into=memoryview(buf)[lo:hi]))
            elif id(rec) in whole:
                whole_piece = Piece(rec.name, rec.offset, rec.end, deliver=self._whole_record(rec, options))
                # sharing: a small tensor record is read with the data (phase B), so that a rank
                # whose assembly is slow does not hold up every rank's start of phase B
                (deferred if shared_tensor_record(rec) else pieces).append(whole_piece)
            else:
                large.append(rec)
                head, tail = _probes(rec)
                for lo, hi in (head, tail):
                    probe = Piece(rec.name, lo, hi, deliver=_store(rec.window, lo))
                    probe_of[id(probe)] = rec
                    pieces.append(probe)
        chunks = _unit_chunks(pieces, chunking, reads)
        if streamed:
            await self._aread_streamed(pipeline, storage, options, chunks, probe_of, len(large), reads, trackers)
            self._check_written(records, assembled_before, total)
            log.debug(
                "read %d records streamed (each record's data once its probes landed): %.4f s",
                len(records),
                time.monotonic() - t_start,
            )
            for tracker, rec in trackers:
                self._check_crc(tracker, rec, storage)
            await self._check_unchanged(storage)
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
        headers: list[tuple[_Record, Any]] = []  # each record's tensor location: the rest is its headers
        for rec in large + located:
            data_pieces.extend(
                await self._record_pieces(
                    rec, storage, options, stager, reads, trackers, from_probes, headers, shared=run_chunks is not None
                )
            )
        self._copy_from_probes(from_probes)
        charge = _ForeignBytes(self.metadata, headers) if reads.bounded else None
        chunks = self._data_chunks(data_pieces, chunking, reads, charge)
        if deferred:
            chunks = [*chunks, *_unit_chunks(deferred, chunking, reads)]
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
            self._check_crc(tracker, rec, storage)
        await self._check_unchanged(storage)

    def _check_written(self, records: list[_Record], assembled_before: int, total: int) -> None:
        """Every destination byte the plan asked for was written: counted per assembled chunk
        (data) and per whole record (small records), against the destinations' sizes."""
        written = self._recorder.stats.bytes_assembled - assembled_before
        if written != total:
            keys = sorted({item.dest_index.fqn for r in records for item, _ in r.tensor_items})
            raise CheckpointFormatError(
                f"{self.checkpoint}: the load wrote {written} of the {total} destination bytes it planned "
                f"(keys {keys[:8]}{' ...' if len(keys) > 8 else ''}): the destination is incomplete"
            )

    async def _aread_streamed(
        self,
        pipeline: Pipeline,
        storage: RetryingStorage,
        options: LoadOptions,
        first: list[Chunk],
        probe_of: dict[int, _Record],
        n_large: int,
        reads: _ReadBudget,
        trackers: list[tuple[CrcTracker, _Record]],
    ) -> None:
        """One pipeline run for probes, small records and data: the chunks of ``first``
        (probes and small records) go out first, then each large record's data as soon as
        its own probes have landed (planned on the loop as they do), not after every
        record's probes."""
        loop = asyncio.get_running_loop()
        chunking = options.chunk_policy
        ready: asyncio.Queue[list[Chunk] | BaseException] = asyncio.Queue()
        planning: set[asyncio.Task[None]] = set()
        waiting: dict[int, int] = {}
        measured = [False]

        async def plan(rec: _Record) -> None:
            try:
                if not measured[0]:
                    measured[0] = True
                    reads.measure(self._recorder)
                from_probes: list[tuple[memoryview, memoryview]] = []
                pieces = await self._record_pieces(
                    rec, storage, options, None, reads, trackers, from_probes, [], shared=False
                )
                self._copy_from_probes(from_probes)
                ready.put_nowait(self._data_chunks(pieces, chunking, reads, None))
            except Exception as exc:
                ready.put_nowait(exc)

        def landed(rec: _Record) -> None:
            waiting[id(rec)] -= 1
            if waiting[id(rec)] == 0:
                task = asyncio.ensure_future(plan(rec))
                planning.add(task)
                task.add_done_callback(planning.discard)

        for c in first:
            for seg in c.segments:
                owner = probe_of.get(id(seg))
                if owner is not None:
                    waiting[id(owner)] = waiting.get(id(owner), 0) + 1
                    seg.deliver = _then(seg.deliver, loop, functools.partial(landed, owner))

        planned = [0]

        def take(got: list[Chunk] | BaseException) -> list[Chunk]:
            if isinstance(got, BaseException):
                raise got
            planned[0] += 1
            return got

        async def source() -> AsyncIterator[Chunk]:
            for c in first:
                # the data of records whose probes have landed goes before the remaining
                # probes: the link fills with data as soon as there is some to read
                while not ready.empty():
                    for d in take(ready.get_nowait()):
                        yield d
                yield c
            while planned[0] < n_large:
                for d in take(await ready.get()):
                    yield d

        try:
            await pipeline.run_stream(source())
        finally:
            for task in list(planning):
                task.cancel()
            await asyncio.gather(*planning, return_exceptions=True)

    async def _record_pieces(
        self,
        rec: _Record,
        storage: RetryingStorage,
        options: LoadOptions,
        stager: Any,
        reads: _ReadBudget,
        trackers: list[tuple[CrcTracker, _Record]],
        from_probes: list[tuple[memoryview, memoryview]],
        headers: list[tuple[_Record, Any]],
        *,
        shared: bool,
    ) -> list[Piece]:
        """The data reads of one large (probed) or located record: its tensor located
        from the probes (more of its headers fetched where they fall short), each item
        planned and checked, bytes the probes hold taken from them (``from_probes``), a
        checksum tracker under ``verify`` (``trackers``); ``headers``: the record's tensor
        location, the rest of it being headers. ``shared``: reads planned by
        ShardedLoadPlanner, whose plan of who reads what counts every range."""
        chunking = options.chunk_policy
        if rec.known is not None:
            loc = rec.known
        else:

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
            self._check_against_metadata(rec, loc)
        tracker = None
        if options.verify and loc.crc32 is not None:
            tracker = CrcTracker(loc.data_start, loc.data_start + loc.storage_nbytes, loc.crc32)
            trackers.append((tracker, rec))
        rec_pieces = [
            p
            for _, item_pieces in self._plan_items(
                rec, loc, options, chunking.chunk_size, chunking.min_chunk_size, stager, max_gap=reads.max_gap
            )
            for p in item_pieces
        ]
        if reads.bounded and not shared and tracker is None and stager is None and rec.known is None:
            rec_pieces = _from_probes(rec, rec_pieces, from_probes)
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
        reads: _ReadBudget,
        charge: Callable[[str, int, int], int] | None,
    ) -> list[Chunk]:
        """Data pieces as read requests, gaps read through within what the over-read bound leaves."""
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
        rec: _Record,
        loc: TensorLocation,
        options: LoadOptions,
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
                allow_cast=options.allow_dtype_cast or self._torch_casts,
                key=item.dest_index.fqn,
                stager=stager,
                max_gap=max_gap,
            )
            _check_planned(item, dest, pieces, rec)
            planned.append((dest, pieces))
        return planned

    async def _check_unchanged(self, storage: RetryingStorage) -> None:
        """Raise if a file of the checkpoint was rewritten or replaced while this load read
        it (a save in progress into the same directory): the bytes may be torn."""
        names = list(self._fingerprints)
        now = await asyncio.gather(*(storage.fingerprint(n) for n in names), return_exceptions=True)
        for name, fp in zip(names, now):
            if fp != self._fingerprints[name]:
                raise CheckpointChangedError(
                    f"{storage.url(name)} changed while it was being read: a save is writing into this checkpoint "
                    "(or replaced it); the destination holds a mix, load again once the save has finished",
                    path=storage.url(name),
                    seen=repr(self._fingerprints[name]),
                    now=None if isinstance(fp, BaseException) else repr(fp),
                )

    async def _locate(self, storage: RetryingStorage, records: list[_Record], options: LoadOptions) -> list[_Record]:
        """Records of already located formats: tensors' locations (safetensors blobs in DCP
        files: their headers are read now), objects decoded (tensors inside them read)."""
        located = [r for r in records if r.entry is not None]

        kinds: dict[type[formats.FormatEntry], list[_Record]] = {}
        for r in located:
            kinds.setdefault(type(r.entry), []).append(r)
        fetcher = formats.Fetcher(storage, options)
        for kind, recs in kinds.items():
            found = await kind.resolve([r.entry for r in recs], fetcher)
            for r, value in zip(recs, found):
                if kind.holds_object:
                    r.value = value
                else:
                    r.known = value
        return [r for r in located if r.known is not None]

    async def _check_files(self, storage: RetryingStorage, records: list[_Record]) -> None:
        """Every file exists and is long enough for its records, before any destination is touched."""
        ends: dict[str, int] = {}
        last: dict[str, _Record] = {}
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

        sizes = await asyncio.gather(*(size_of(n) for n in ends))
        fps = await asyncio.gather(*(storage.fingerprint(n) for n in ends))
        for n, fp in zip(ends, fps):
            if fp is not None:
                self._fingerprints.setdefault(n, fp)
        for (name, end), size in zip(ends.items(), sizes):
            if size < end:
                raise CheckpointFormatError(
                    f"{storage.url(name)} is {size} bytes but the metadata places a record up to byte {end} "
                    f"(key {last[name].fqn!r}): the file is truncated, or a save is rewriting it"
                )
        self._recorder.add(files=len(ends))

    def _whole_record(self, rec: _Record, options: LoadOptions) -> Callable[[memoryview], None]:
        """Assembly of a record read whole: its bytes as stored, or (a record saved with
        stream transforms) the archive its transforms decoded."""
        recorder = self._recorder
        base = 0 if rec.transforms else rec.offset

        def deliver(data: memoryview) -> None:
            if rec.byte_items:
                rec.raw = bytes(data)
            if not rec.tensor_items:
                return
            win = ByteWindow()
            win.add(base, data)
            where = f"{rec.where}, decoded through {list(rec.transforms)}" if rec.transforms else rec.where
            layout = parse_archive(
                win, base, len(data), where, max_pickle=options.max_metadata_size, safe_globals=options.safe_globals
            )
            loc = tensor_location(layout, rec.name)
            self._check_against_metadata(rec, loc)
            if rec.transforms:
                _check_decoded_storage(rec, loc)
            # a decoded record is always checked: a damaged compressed stream may decode to
            # other bytes without an error of its own (zstd frames carry no checksum by default)
            if (options.verify or rec.transforms) and loc.crc32 is not None:
                tracker = CrcTracker(loc.data_start, loc.data_start + loc.storage_nbytes, loc.crc32)
                tracker.add(base, data)
                _raise_on_bad_crc(tracker, rec, rec.name)
                recorder.add(verified_records=1)
            n = 0
            planned = self._plan_items(rec, loc, options, 1 << 62, 1 << 62, self._stager)
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

    async def _aread_transformed(self, pipeline: Pipeline, records: list[_Record], options: LoadOptions) -> None:
        """Records saved with stream transforms: fetched whole, decoded, assembled (:mod:`asyncload.engine.transforms`)."""
        if not records:
            return
        storage = pipeline.storage
        reads = []
        for rec in records:
            room = max(1, pipeline.budget.capacity - rec.length)
            expected = _expected_storage(rec)
            retry: int | None = None
            if expected is not None:
                limit = expected + _transforms.ARCHIVE_SLACK  # the tensor's bytes and its archive's headers
            else:  # an object: the metadata does not say how large; most are small
                retry = min(room, options.max_metadata_size)
                limit = min(retry, max(4 * rec.length, 1 << 20))
            what = f"key {rec.fqn!r}, {storage.url(rec.name)} {rec.where} (transforms {list(rec.transforms)})"
            deliver = self._whole_record(rec, options)
            reads.append(
                _transforms.TransformedRead(rec.name, rec.offset, rec.end, rec.extensions, limit, what, deliver, retry)
            )
        await _transforms.aread_transformed(pipeline, reads)

    def _check_against_metadata(self, rec: _Record, loc: Any) -> None:
        if rec.dtype is not None and loc.dtype != rec.dtype:
            raise CheckpointFormatError(f"{rec.where}: the record holds {loc.dtype}, the metadata says {rec.dtype}")
        if rec.chunk_md is not None and tuple(rec.chunk_md.sizes) != tuple(loc.size):
            raise CheckpointFormatError(
                f"{rec.where}: the record holds shape {list(loc.size)}, the metadata says {list(rec.chunk_md.sizes)}"
            )

    def _check_crc(self, tracker: CrcTracker, rec: _Record, storage: RetryingStorage) -> None:
        if not tracker.complete:  # pragma: no cover - every byte of a verified storage is read
            raise CheckpointFormatError(
                f"{storage.url(rec.name)}, {rec.where}: verify=True read only "
                f"{tracker.covered} of {tracker.end - tracker.start} bytes of the tensor"
            )
        _raise_on_bad_crc(tracker, rec, storage.url(rec.name))
        self._recorder.add(verified_records=1)

    # --- loads that allocate their destinations (asyncload._stream) ----------------------

    async def acheck_claims(self, metadata: Metadata, fqns: list[str]) -> None:
        """Before destinations are allocated for ``fqns`` from ``metadata``: every saved
        chunk of their tensors fits in its record, and every record in its file (one listing
        of the files' sizes), so a ``.metadata`` claiming gigabytes next to a small file is a
        typed error, not a gigabyte allocation."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        records: list[_Record] = []
        for fqn in fqns:
            smd = metadata.state_dict_metadata[fqn]
            chunks = smd.chunks if isinstance(smd, TensorStorageMetadata) else [None]
            for chunk in chunks:
                index = MetadataIndex(fqn, None if chunk is None else chunk.offsets)
                info = metadata.storage_data.get(index) if metadata.storage_data else None
                if info is None:
                    raise CheckpointFormatError(f"{self.checkpoint}: metadata has no storage entry for {index}")
                where = f"{self.checkpoint}: storage entry of {fqn!r:.200}"
                offset, length = getattr(info, "offset", None), getattr(info, "length", None)
                if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
                    raise CheckpointFormatError(f"{where} is malformed: {info!r:.200}")
                rec = _Record(check_relative_path(getattr(info, "relative_path", None), where), offset, length, fqn)
                # a record saved through stream transforms (compressed) may be shorter than its
                # tensor: its claim is bounded by what its bytes can decode to and by the budget
                # (it is decoded whole); the decoded size is bounded again when it is read
                transformed = getattr(info, "transform_descriptors", None)
                if chunk is not None and isinstance(smd, TensorStorageMetadata) and transformed:
                    claimed = torch.Size(chunk.sizes).numel() * smd.properties.dtype.itemsize
                    budget = self.options.memory_budget
                    where = f"{self.checkpoint}, {rec.where}"
                    _transforms.check_claim(transformed, length, claimed, budget, what=where)
                elif chunk is not None and isinstance(smd, TensorStorageMetadata):
                    claimed = torch.Size(chunk.sizes).numel() * smd.properties.dtype.itemsize
                    if claimed > length:
                        raise CheckpointFormatError(
                            f"{self.checkpoint}, {rec.where}: the metadata claims a chunk of shape {list(chunk.sizes)} "
                            f"({claimed} bytes of {smd.properties.dtype}) in a record of {length} bytes: "
                            "the metadata does not match the data files"
                        )
                records.append(rec)
        files = self._recorder.stats.files
        await self._check_files(await self.storage(), records)
        self._recorder.stats.files = files  # counted once, by the reads that follow

    async def afinish_device_copies(self) -> None:
        """Wait until the device copies of the reads so far have finished (between two
        batches of a load read batch by batch); the storage stays open."""
        stager, self._stager = self._stager, None
        if stager is not None:
            await asyncio.to_thread(stager.finish_sync)


class _IOThreads(concurrent.futures.ThreadPoolExecutor):
    """The load's I/O thread pool, counting the jobs submitted and not yet finished."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._unfinished = 0
        self._count_lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        with self._count_lock:
            self._unfinished += 1
        try:
            fut = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._finished(None)
            raise
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _fut: object) -> None:
        with self._count_lock:
            self._unfinished -= 1

    @property
    def idle(self) -> bool:
        """No job is queued or running (a job counts until its result is set)."""
        return self._unfinished == 0


def _check_planned(item: ReadItem, dest: torch.Tensor, pieces: list[Piece], rec: _Record) -> None:
    """The pieces planned for ``item`` fill every byte of its destination view, before any is read."""
    want = dest.numel() * dest.element_size()
    got = sum(p.nbytes if p.useful is None else p.useful for p in pieces)
    if got != want:
        raise CheckpointFormatError(
            f"key {item.dest_index.fqn!r}, {rec.where}: the reads planned fill {got} of the destination's "
            f"{want} bytes: the checkpoint does not describe this part of the tensor consistently"
        )


def _raise_on_bad_crc(tracker: CrcTracker, rec: _Record, url: str) -> None:
    got = tracker.value()
    if got != tracker.expected:
        raise CheckpointFormatError(
            f"checksum mismatch in {url}: key {rec.fqn!r}, {rec.where}, tensor bytes [{tracker.start}, "
            f"{tracker.end}) of the file: CRC-32 {got:#010x}, the record says {tracker.expected:#010x}: "
            "the file is damaged"
        )


def _check_object_claims(records: list[_Record], options: LoadOptions, checkpoint: object) -> None:
    """Objects are read whole and kept until the planner decodes them: what the metadata
    claims for them, together, must fit ``LoadOptions.max_metadata_size`` (checked before
    any is read, so a forged length cannot make the load allocate it)."""
    objects = [r for r in records if r.entry is None and r.byte_items and not r.tensor_items]
    claimed = sum(r.length for r in objects)
    if claimed > options.max_metadata_size:
        big = max(objects, key=lambda r: r.length)
        raise CheckpointFormatError(
            f"{checkpoint}: the checkpoint's objects claim {claimed} bytes in all (the largest, {big.fqn!r}, "
            f"{big.length} bytes at [{big.offset}, {big.end}) of {big.name}), more than "
            f"LoadOptions.max_metadata_size={options.max_metadata_size}: objects are read whole before they are "
            "decoded; raise max_metadata_size if the checkpoint is trusted to hold objects that large"
        )


def _expected_storage(rec: _Record) -> int | None:
    """Bytes of the tensor a record holds, as the metadata claims them (``None``: an object,
    or a chunk the metadata does not describe)."""
    if not rec.tensor_items or rec.chunk_md is None or rec.dtype is None:
        return None
    return int(torch.Size(rec.chunk_md.sizes).numel()) * rec.dtype.itemsize


def _check_decoded_storage(rec: _Record, loc: Any) -> None:
    """A decoded record's tensor storage is exactly what the metadata claims (DCP saves
    tensors with minimal storage)."""
    expected = _expected_storage(rec)
    if expected is not None and loc.storage_nbytes != expected:
        raise CheckpointFormatError(
            f"{rec.where}, decoded through {list(rec.transforms)}: holds a tensor storage of {loc.storage_nbytes} "
            f"bytes, the metadata claims {expected} ({list(rec.chunk_md.sizes)} of {rec.dtype}): the record is "
            "damaged or the metadata lies"
        )


#: The cost model's assumptions until the load has measured its store (docs/tuning.md):
#: seconds one more request costs beyond its bytes, and bytes per second of one stream.
LOCAL_REQUEST_SECONDS = 20e-6
LOCAL_BANDWIDTH = 4 << 30
REMOTE_REQUEST_SECONDS = 20e-3
REMOTE_BANDWIDTH = 64 << 20


class _ReadBudget:
    """What a load may read beyond what its destinations need (``max_over_read_ratio``),
    and what reading a gap is worth (:func:`asyncload.engine.plan.break_even_gap`): records read
    whole or probed, gaps read through or skipped. Unbounded (``None``, or ``verify=True``,
    which reads every byte of a storage anyway): the rules of ``min_chunk_size`` alone."""

    def __init__(self, ratio: float | None, remote: bool, needed: int, read_before: int) -> None:
        self.bounded = ratio is not None
        self.limit = int((ratio or 1.0) * needed)
        self.read_before = read_before
        self.latency = REMOTE_REQUEST_SECONDS if remote else LOCAL_REQUEST_SECONDS
        self.bandwidth = REMOTE_BANDWIDTH if remote else LOCAL_BANDWIDTH
        #: plan_tensor's gap limit: 0 under the bound (make_chunks joins within the budget)
        self.max_gap: int | None = 0 if self.bounded else None
        self._spare = 0

    @classmethod
    def for_load(cls, options: LoadOptions, remote: bool, records: list[_Record], read_before: int) -> _ReadBudget:
        ratio = None if options.verify else options.max_over_read_ratio
        return cls(ratio, remote, sum(_needed(r) for r in records if not r.transforms), read_before)

    def whole_records(self, records: list[_Record], small: int) -> set[int]:
        """ids of the records phase A reads whole (the others with tensors are probed)."""
        whole: set[int] = set()
        candidates: list[tuple[int, _Record]] = []
        spare = self.limit - sum(_needed(r) for r in records if not r.transforms)
        for rec in records:
            if rec.entry is not None or rec.transforms:
                continue
            if rec.byte_items:
                whole.add(id(rec))
                continue
            probed = min(rec.length, HEAD_PROBE + TAIL_PROBE)
            if rec.length > small:
                spare -= probed
                continue
            extra = rec.length - _needed(rec)
            if not self.bounded or extra <= probed:  # whole costs no more bytes than probing
                whole.add(id(rec))
                spare -= extra
                continue
            spare -= probed
            candidates.append((extra - probed, rec))
        # whole instead of probed: saves the probes' and the data's requests for ``cost`` bytes
        worth = 3 * break_even_gap(self.latency, self.bandwidth)
        for cost, rec in sorted(candidates, key=lambda c: c[0]):
            if cost > spare or cost > worth:
                break
            spare -= cost
            whole.add(id(rec))
        self._spare = max(0, spare)
        return whole

    def measure(self, recorder: StatsRecorder) -> None:
        """Use the latency measured so far (the requests' median), where there is one."""
        p50 = recorder.snapshot().latency_p50
        if p50 > 0:
            self.latency = p50

    def join_gap(self, min_chunk_size: int) -> int:
        """The largest gap make_chunks may read through."""
        if not self.bounded:
            return min_chunk_size
        return max(1, min(min_chunk_size, break_even_gap(self.latency, self.bandwidth)))

    def gap_allowance(self, read_now: int | None = None, pieces: list[Piece] | None = None) -> int | None:
        """Bytes make_chunks may read through gaps: what phase A left (no arguments), or
        what is left once ``read_now`` bytes were read and ``pieces`` are still to read."""
        if not self.bounded:
            return None
        if read_now is None or pieces is None:
            return self._spare
        return max(0, self.limit - (read_now - self.read_before) - sum(p.nbytes for p in pieces))


class _ForeignBytes:
    """``charge`` for make_chunks: the bytes of a gap that count against the over-read bound,
    those of saved items (tensors, objects) the load does not need. The headers of the
    records it reads (a zip's directory between two tensors it needs), and bytes the
    metadata describes no item in (torch.save's local headers between storages), are priced
    by the cost model alone: reading them never means reading another rank's data."""

    def __init__(self, metadata: Metadata | None, located: list[tuple[_Record, Any]]) -> None:
        self._metadata = metadata
        self._located = located
        self._items: dict[str, _Coverage] | None = None
        self._headers: dict[str, _Coverage] = {}

    def __call__(self, name: str, start: int, end: int) -> int:
        found = self._items if self._items is not None else self._build()
        items, headers = found.get(name), self._headers.get(name)
        n = items.overlap(start, end) if items is not None else 0
        return max(0, n - (headers.overlap(start, end) if headers is not None else 0))

    def _build(self) -> dict[str, _Coverage]:
        extents: dict[str, list[tuple[int, int]]] = {}
        storage_data = getattr(self._metadata, "storage_data", None) or {}
        for sinfo in storage_data.values():
            name, offset, length = (getattr(sinfo, a, None) for a in ("relative_path", "offset", "length"))
            if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int) and length > 0:
                extents.setdefault(name, []).append((offset, offset + length))
        heads: dict[str, list[tuple[int, int]]] = {}
        for rec, loc in self._located:
            data_end = loc.data_start + loc.storage_nbytes
            for lo, hi in ((rec.offset, min(rec.end, loc.data_start)), (max(rec.offset, data_end), rec.end)):
                if lo < hi:
                    heads.setdefault(rec.name, []).append((lo, hi))
        self._headers = {n: _Coverage(v) for n, v in heads.items()}
        self._items = {n: _Coverage(v) for n, v in extents.items()}
        return self._items


class _Coverage:
    """Byte ranges of one file, merged; ``overlap(start, end)``: how many bytes of
    ``[start, end)`` they cover (a bisection)."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [lo for lo, _ in merged]
        self.ends = [hi for _, hi in merged]
        self.before = list(itertools.accumulate((hi - lo for lo, hi in merged), initial=0))

    def _covered(self, x: int) -> int:
        i = bisect.bisect_right(self.starts, x) - 1
        if i < 0:
            return 0
        return self.before[i] + min(x, self.ends[i]) - self.starts[i]

    def overlap(self, start: int, end: int) -> int:
        return self._covered(end) - self._covered(start)


def _needed(rec: _Record) -> int:
    """Bytes of ``rec`` the load's destinations need: an object's whole record, a tensor's boxes."""
    if rec.byte_items and not rec.tensor_items:
        return rec.length
    saved = rec.dtype if rec.dtype is not None else getattr(rec.known, "dtype", None)
    n = 0
    for item, dest in rec.tensor_items:
        size = saved.itemsize if isinstance(saved, torch.dtype) else dest.element_size()
        n += int(torch.Size(item.lengths).numel()) * size
    return n


def _unit_chunks(pieces: list[Piece], chunking: ChunkPolicy, reads: _ReadBudget) -> list[Chunk]:
    """Chunks of probes and whole records: not payload (each whole record's delivery, and
    each record's data read later, count their own bytes)."""
    chunks = make_chunks(
        pieces,
        chunk_size=chunking.chunk_size,
        min_chunk_size=reads.join_gap(chunking.min_chunk_size),
        max_over_read=reads.gap_allowance(),
    )
    for c in chunks:
        for seg in c.segments:
            seg.payload = False
    return chunks


def _probes(rec: _Record) -> tuple[tuple[int, int], tuple[int, int]]:
    """The head and tail probes of a record: the byte ranges whose layout they hold."""
    return (rec.offset, rec.offset + min(HEAD_PROBE, rec.length)), (rec.end - min(TAIL_PROBE, rec.length), rec.end)


def _from_probes(rec: _Record, pieces: list[Piece], out: list[tuple[memoryview, memoryview]]) -> list[Piece]:
    """Direct pieces trimmed of the bytes the record's probes already read (a rank that needs
    the first or last rows of a tensor); those bytes are copied from the probes (``out``)."""
    kept: list[Piece] = []
    for p in pieces:
        if p.into is not None and p.deliver is None and not p.pinned:
            for lo, hi in _probes(rec):
                if p.start >= lo and p.start < hi:  # a prefix of the piece was probed
                    k = min(p.end, hi) - p.start
                    out.append((p.into[:k], rec.window.get(p.start, p.start + k)))
                    p.into, p.start = p.into[k:], p.start + k
                elif p.start < lo < p.end <= hi:  # a suffix was probed
                    k = p.end - lo
                    out.append((p.into[len(p.into) - k :], rec.window.get(lo, p.end)))
                    p.into, p.end = p.into[: len(p.into) - k], lo
                if p.start >= p.end:
                    break
            if p.start >= p.end:
                continue
        kept.append(p)
    return kept


def _dense(records: list[_Record]) -> bool:
    """Plain DCP records (no format entries, no stream transforms), each tensor record
    needed whole by one destination: no narrow read, nothing for the over-read bound to
    weigh across records."""
    for rec in records:
        if rec.entry is not None or rec.transforms:
            return False
        if rec.tensor_items:
            if rec.byte_items or len(rec.tensor_items) != 1:
                return False
            expected = _expected_storage(rec)
            if expected is None or _needed(rec) != expected:
                return False
    return True


def _then(
    deliver: Callable[[memoryview], None] | None, loop: asyncio.AbstractEventLoop, after: Callable[[], None]
) -> Callable[[memoryview], None]:
    """``deliver``, then ``after`` scheduled on ``loop`` (deliveries run on assembly threads)."""

    def both(data: memoryview) -> None:
        if deliver is not None:
            deliver(data)
        loop.call_soon_threadsafe(after)

    return both


def _store(win: ByteWindow, start: int) -> Callable[[memoryview], None]:
    def deliver(data: memoryview) -> None:
        win.add(start, bytes(data))

    return deliver
