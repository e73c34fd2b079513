"""LoadSession: the async core of one load.

A session owns everything one load needs beyond the planner: the storage (behind the
retrying error boundary, :class:`asyncload.storage.retrying.RetryingStorage`), the I/O threads,
the statistics and the load's clock, file fingerprints, cancellation and the metadata read
(format probing included). The rest is done by one module per job, which the session calls
with what it holds:

- :mod:`asyncload.engine.tally`: the load's statistics and clock (:class:`LoadTally`, one
  per load from :meth:`LoadSession.begin`);
- :mod:`asyncload.engine.cancellation`: the load's tasks, their cancellation from any thread
  and the library loop the sync faces run them on (:class:`LoadTasks`);
- :mod:`asyncload.engine.records`: the plan's items grouped by saved record, destinations
  resolved, tensors and objects handed back to the planner (:func:`~.records.commit`);
- :mod:`asyncload.engine.reads`: the read phases (probes and small records, then tensor data);
- :mod:`asyncload.engine.checks`: file sizes before any destination is touched, checksums,
  every byte written, files changed under the load;
- :mod:`asyncload.engine.cost`: the over-read bound and the cost model of gaps.

Every face calls it: ``load``/``aload``/``start_load`` through the driver
(:mod:`asyncload.engine.driver`), ``dcp.load`` through :class:`asyncload.PipelinedReader`
(the same read sequence, :func:`asyncload.engine.driver.read_steps`), the streams and the CLI.

Threads: coroutines run on one event loop (the library's loop thread for the sync faces,
the caller's loop for ``aload``); :meth:`LoadSession.prepare_reads` and
:meth:`LoadSession.commit` call planner hooks and run on the caller's thread (or a worker
thread for ``aload``); copies run on the I/O threads.

Configuration: the session is made with a :class:`~asyncload.engine.config.LoadConfig`
(:func:`~asyncload.engine.config.resolve_config`), which governs every call it makes (with
what the planner brings, its ``planner`` terms). Under a plain ``dcp.load`` the planner
arrives after ``.metadata`` was read:
:meth:`LoadSession.planner_arrived` is that one step (see :mod:`asyncload.engine.config`);
once the load has begun reading tensor data (:meth:`LoadSession.prepare_reads`,
:meth:`LoadSession.acheck_claims`) it refuses to change the config (``RuntimeError``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import asyncload.formats as formats
from asyncload.common.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    docs_ref,
    redact_url,
)
from asyncload.common.loop import close_through_interrupt
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats
from asyncload.engine.cancellation import LoadTasks
from asyncload.engine.checks import check_claims
from asyncload.engine.chunks import Chunk
from asyncload.engine.config import (
    LoadConfig,
    PlannerTerms,
    open_boundary,
    resolve_config,
    settings,
)
from asyncload.engine.meter import Meter
from asyncload.engine.pipeline import Pipeline
from asyncload.engine.read_loop import probe_slots
from asyncload.engine.reads import RecordReads
from asyncload.engine.records import (
    Record,
    collect,
    commit,
    decode_object,
    note_keys,
    refuse_a_dcp_file,
    torch_casts,
)
from asyncload.engine.tally import LoadTally
from asyncload.formats import plain
from asyncload.storage import RetryingStorage, Storage, is_local, local_root

if TYPE_CHECKING:  # DCP's types: imported where a load needs them, not for annotations
    import torch
    from torch.distributed.checkpoint import LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload.engine.config import MemoryPlan
    from asyncload.engine.cuda_ring import DeviceCopier, DeviceStager
    from asyncload.storage import InFlight

__all__ = ["LoadSession", "decode_object", "in_flight"]

log = logging.getLogger("asyncload.session")


def _stager_for(
    dests: Iterable[torch.Tensor], memory: MemoryPlan, copier: DeviceCopier | None
) -> DeviceStager | None:
    """The device path of a load (``cuda_ring.stager_for``), its module imported only where
    it can have one: a copier given or set (``use_copier`` imported it), or a CUDA
    destination. A load into CPU memory imports none of it."""
    dests = list(dests)
    if (
        copier is None
        and "asyncload.engine.cuda_ring" not in sys.modules
        and not any(t.device.type == "cuda" for t in dests)
    ):
        return None
    from asyncload.engine import cuda_ring

    return cuda_ring.stager_for(dests, memory, copier)


def _warm() -> None:
    formats.warm_decoders()


T = TypeVar("T")

ProgressCallback = Callable[[int, int], None]


class LoadSession:
    """The async core of one load of ``checkpoint`` (a local path, ``PathLike``, ``file://``
    or fsspec URL; ``storage_options`` go to the fsspec filesystem).

    Its collaborators are given when it is made and never replaced: ``config`` (the load's
    :class:`~asyncload.engine.config.LoadConfig`), ``group`` and ``monitor`` (multi-rank
    loads: the process group and the :class:`~asyncload.distributed.monitor.Monitor` that
    bounds every wait on another rank), ``progress(bytes_done, bytes_total)`` (called from
    the loop and the assembly threads), ``clock`` (the time source of each load's
    :class:`~asyncload.common.latency.LoadClock` and of its ``seconds``), ``copier`` (the
    :class:`~asyncload.engine.cuda_ring.DeviceCopier` of device destinations; ``None``: the one
    :func:`~asyncload.engine.cuda_ring.use_copier` installed, else CUDA's), ``extension_registry``
    (decodes stream transforms), ``metadata_cache`` (``.metadata`` decoded before, by URL and
    bytes: loads of one checkpoint key by key decode it once).

    A session may run several loads one after the other (a reader reused by ``dcp.load``):
    :meth:`begin` starts each one's statistics and clock.

    Mutable state, all of it (nothing outside the session sets any): the load in progress
    (``checkpoint`` and ``_storage_root``, ``_config``, ``_tally``: its statistics and clock,
    ``_reading``, ``metadata``, ``metadata_error``, ``checkpoint_missing``, ``_fingerprints``,
    ``_torch_casts``, ``_stager``); what is open (``_raw``: the store, ``_boundary``: the
    retrying boundary over it for this load's config, ``_executor``); the tasks, their
    cancellation and the library loop (``_tasks``).
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        config: LoadConfig | None = None,
        options: LoadOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        group: Any = None,
        monitor: Any = None,
        progress: ProgressCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        copier: DeviceCopier | None = None,
        extension_registry: Any = None,
        metadata_cache: dict[tuple[str, bytes], Metadata] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.storage_options = dict(storage_options or {})
        # collaborators (read-only)
        self._made_with = config if config is not None else resolve_config(options)
        #: The options the config was resolved from, when the face gave them (:attr:`options`).
        self._made_with_options = options
        self._group = group
        self._monitor = monitor
        self._progress = progress
        self._copier = copier
        #: None: torch's default, made when a record names a transform (importing DCP's).
        self.extension_registry = extension_registry
        self.metadata_cache = metadata_cache
        #: Takes metadata of :mod:`asyncload.formats.plain`'s types (else converted to DCP's).
        self.plain_metadata = False
        # the load in progress
        self._config = self._made_with
        self._options = options
        #: Where storage is opened when not at ``checkpoint`` (the directory of a file checkpoint).
        self._storage_root: str | None = None
        #: The load's statistics and clock (:class:`~asyncload.engine.tally.LoadTally`).
        self._tally = LoadTally(clock)
        #: This load has begun reading tensor data (:meth:`prepare_reads`,
        #: :meth:`acheck_claims`): its config is fixed (:meth:`planner_arrived`).
        self._reading = False
        #: The metadata the reads are planned from (set by :meth:`prepare_reads`).
        self.metadata: Metadata | None = None
        #: The first error of the metadata read in this load (``dcp.load`` hides it behind an
        #: AssertionError).
        self.metadata_error: BaseException | None = None
        #: A local checkpoint directory that does not exist (no rank-local fallback to try).
        self.checkpoint_missing = False
        #: file name -> Storage.fingerprint when the load first looked at it (a save
        #: rewriting the checkpoint during the load is an error, not a torn tensor)
        self._fingerprints: dict[str, object] = {}
        #: The plan comes from a planner that is not asyncload's (torch's DefaultLoadPlanner).
        self._torch_casts = False
        #: The device path of the load in progress (``cuda_ring.DeviceStager``), if any.
        self._stager: DeviceStager | None = None
        # what is open
        self._raw: Storage | None = None
        self._boundary: RetryingStorage | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # cancellation
        self._tasks = LoadTasks()  # and the library loop (:mod:`asyncload.engine.cancellation`)

    def __repr__(self) -> str:
        if self.stats is not None:
            state = "done"
        elif self._tally.started:
            state = "cancelled" if self._tasks.cancelled.is_set() else "started"
        else:
            state = "not started"
        opened = [
            w for w, on in (("storage", self._raw), ("threads", self._executor)) if on is not None
        ]
        ranks = "" if self._group is None else ", multi-rank"
        return (
            f"LoadSession({redact_url(str(self.checkpoint))!r}, {state}{ranks}, "
            f"open={'+'.join(opened) or 'nothing'}, {self._config!r})"
        )

    # --- collaborators and configuration -------------------------------------------------

    @property
    def config(self) -> LoadConfig:
        """The configuration governing the load in progress."""
        return self._config

    @property
    def options(self) -> LoadOptions | None:
        """The options :attr:`config` was resolved from (None: the face gave none), for the
        faces that hand them to a public hook (``ShardedLoadPlanner.share_session``); the
        engine reads :attr:`config`."""
        return self._options

    @property
    def group(self) -> Any:
        """Multi-rank loads: the process group (``None``: one process, or the default group)."""
        return self._group

    @property
    def monitor(self) -> Any:
        """Multi-rank loads: the monitor bounding every wait on another rank, else ``None``."""
        return self._monitor

    @property
    def progress(self) -> ProgressCallback | None:
        """``progress(bytes_done, bytes_total)``, or ``None``."""
        return self._progress

    def planner_arrived(self, terms: PlannerTerms) -> None:
        """The load's planner arrived late (``dcp.load``'s after ``.metadata`` was read) with
        ``terms``: the one step where a load's config can change, before any read of tensor
        data (:mod:`asyncload.engine.config`); options of the planner's own are resolved and
        the storage boundary made anew for them (the open store's policy never changes).

        Once this load has begun reading tensor data (:meth:`prepare_reads`,
        :meth:`acheck_claims`) its config is fixed: terms with options that resolve to other
        settings than the config's (:func:`~asyncload.engine.config.settings`) raise
        ``RuntimeError`` naming the options that would change (terms without options, or
        with options that resolve alike, still set :attr:`LoadConfig.planner`: a stream's
        next batch). :meth:`begin` starts the next load free again."""
        own = terms.options
        if own is None or own is self._options:
            self._config = self._config.with_planner(terms)
            return
        new = resolve_config(own, terms)
        if self._reading:
            changed = _changed_settings(self._config, new)
            if not changed:  # equal options: nothing would change
                self._config = self._config.with_planner(terms)
                return
            raise RuntimeError(
                f"LoadSession.planner_arrived: a planner's options would change "
                f"{', '.join(changed)} of the load of {redact_url(str(self.checkpoint))} "
                "after it began reading tensor data; a load's configuration is fixed from "
                "then on (give the options when the load starts, or start another load)"
            )
        self._config, self._options, self._boundary = new, own, None

    # --- one load's clock and statistics -------------------------------------------------

    def begin(self, checkpoint: str | os.PathLike[str] | None = None) -> None:
        """Start a load (of ``checkpoint`` instead, when given): fresh statistics and clock,
        the config the session was made with."""
        if checkpoint:
            self.checkpoint = checkpoint
            self._storage_root = None
        self._config, self._options = self._made_with, self._made_with_options
        self._tally.begin()
        self._boundary = None  # made again for this load's statistics and clock
        self._reading = False
        self.metadata_error = None
        self._fingerprints = {}

    def record(self, **fields: Any) -> None:
        """Set fields of this load's statistics: what a step decided (``metadata_shared``)."""
        self._tally.record(**fields)

    @property
    def started(self) -> bool:
        return self._tally.started

    @property
    def stats(self) -> LoadStats | None:
        """The final statistics of the last load, once it has finished."""
        return self._tally.stats

    def live_stats(self) -> LoadStats:
        """The statistics so far (``seconds``: since the load started); final once done."""
        return self._tally.live()

    def finish(self) -> LoadStats:
        """The load has succeeded: freeze and return its statistics."""
        return self._tally.finish()

    # --- the sync face and cancellation ------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], *, cleanup: bool = False) -> T:
        """Run ``coro`` on the session's loop from another thread and wait (the sync faces).
        A cancelled session runs nothing more but ``cleanup`` coroutines (closing: shielded)."""
        return self._tasks.run(coro, self._library_loop, cleanup=cleanup)

    def _library_loop(self) -> asyncio.AbstractEventLoop:
        """The library loop thread this session runs on (:meth:`LoadTasks.library_loop`)."""
        local = is_local(self.checkpoint)
        return self._tasks.library_loop(self._config.use_uvloop, local=local)

    async def guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the running loop as a task :meth:`cancel` can reach (``aload``)."""
        return await self._tasks.guard(coro)

    @property
    def cancelled(self) -> threading.Event:
        """Set once :meth:`cancel` was called."""
        return self._tasks.cancelled

    def cancel(self) -> None:
        """Cancel the load in progress (from any thread); it raises CancelledError."""
        self._tasks.cancel()

    # --- storage -----------------------------------------------------------------------

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The load's I/O and assembly threads (started on first use)."""
        if self._executor is None:
            self._executor = _IOThreads(self._config.io_threads, thread_name_prefix="asyncload-io")
        return self._executor

    @property
    def open(self) -> bool:
        """Whether files, sessions or I/O threads are open (:meth:`aclose` has work to do)."""
        return self._raw is not None or self._executor is not None

    async def storage(self) -> RetryingStorage:
        """The checkpoint's storage (opened on first use) behind the retrying error
        boundary, with this load's config, statistics and clock."""
        boundary = self._boundary
        if boundary is None:
            root = self._storage_root if self._storage_root is not None else self.checkpoint
            boundary = self._boundary = open_boundary(
                self._config,
                root,
                self.storage_options,
                self.executor,
                self._tally.recorder,
                self._tally.clock,
                raw=self._raw,
            )
            self._raw = boundary.raw
        return boundary

    async def open_root(self, root: str | None) -> RetryingStorage:
        """Storage at ``root`` instead (a file checkpoint is read relative to its directory)."""
        if self._raw is not None and self._storage_root == root:
            return await self.storage()
        raw, self._raw, self._boundary = self._raw, None, None
        if raw is not None:
            await raw.aclose()
        self._storage_root = root
        return await self.storage()

    async def aclose(self) -> None:
        """Close files and sessions and stop the I/O threads (waits for running reads)."""
        raw, self._raw, self._boundary = self._raw, None, None
        executor, self._executor = self._executor, None
        if raw is not None:
            await raw.aclose()
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
        """Sync :meth:`aclose`; a Ctrl-C that lands before it reached the loop: closed anyway."""
        close_through_interrupt(lambda: self.open, lambda: self.run(self.aclose(), cleanup=True))

    def close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            log.debug("closing %s failed", redact_url(str(self.checkpoint)), exc_info=True)

    # --- metadata ------------------------------------------------------------------------

    async def aread_metadata(
        self,
        rank: int | None = None,
        *,
        on_bytes: Callable[[memoryview, str], Awaitable[None]] | None = None,
    ) -> Metadata:
        """Read and decode ``.metadata`` (``__{rank}.metadata`` when ``rank`` is given) with
        the allow-list; check its version and structure. ``on_bytes(raw, url)`` is awaited
        with a global ``.metadata``'s bytes before they are decoded (a multi-rank load sends
        them to the other ranks: :mod:`asyncload.engine.metadata_read`).

        A checkpoint that is not a DCP directory (safetensors, a torch.save file: see
        :mod:`asyncload.formats`) gets a synthesised ``Metadata`` instead. The first error of
        this load's metadata reads is kept in :attr:`metadata_error` until one succeeds.
        Plain types (:mod:`asyncload.formats.plain`) become DCP's unless :attr:`plain_metadata`.
        """
        try:
            md = await self._aread_metadata(rank, on_bytes)
        except Exception as exc:
            if self.metadata_error is None:
                self.metadata_error = exc
            raise
        self.metadata_error = None  # read (a rank-local one after a missing .metadata, say)
        return md if self.plain_metadata else plain.to_dcp(md)

    async def _aread_metadata(
        self, rank: int | None, on_bytes: Callable[[memoryview, str], Awaitable[None]] | None
    ) -> Metadata:
        config = self._config
        limit = config.checks.max_metadata_size
        refuse_a_dcp_file(self.checkpoint)
        if rank is None:
            if self._storage_root is not None:
                await self.open_root(None)  # back to the checkpoint itself
            if formats.may_be_a_file(self.checkpoint):  # else: the probing formats not imported
                found = await formats.aprobe_first(
                    self.checkpoint,
                    self.open_root,
                    config.checks,
                    config.chunking,
                    slots=probe_slots(config),
                )
                if found is not None:
                    return found
                await self.open_root(None)  # probing may have opened a would-be file's directory
        storage = await self.storage()
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        url = storage.url(name)
        raw: memoryview | None = None
        try:  # retried like any read: a 503 on this first request must not fail the load
            if storage.supports_read_object:  # one GET: its answer gives the size and version
                first = asyncio.ensure_future(storage.read_object(name, limit))
                if rank is None:
                    self.start_listing(requests=1)  # the data files' sizes, while it is read
                raw, size = await first
            else:
                size = await storage.size(name)
        except CheckpointNotFoundError as exc:
            return await _not_found(self, storage, exc, url, rank)
        if size > limit:
            raise CheckpointFormatError(
                f"{url} is {size} bytes, more than LoadOptions.max_metadata_size={limit}"
            )
        if size == 0:
            raise CheckpointFormatError(f"{url} is empty: the checkpoint is incomplete or damaged")
        fp = await storage.fingerprint(name)
        if fp is not None:
            self._fingerprints[name] = fp
        if raw is None:
            raw = await storage.read(name, 0, size, counted=False)
        if on_bytes is not None and rank is None:
            await on_bytes(raw, url)
        return self.decode_metadata(raw, url)

    def start_listing(self, requests: int = 0) -> None:
        """List the data files' sizes now (S3, GCS), beside the ``.metadata`` read (its
        ``requests`` already sent); the decoders' tables built once both have left."""
        storage = self._boundary
        if storage is not None:
            listing = storage.prefetch_sizes()
            storage.when_sent(requests + listing, _warm)

    async def aopen_early(self) -> RetryingStorage:
        """Open the checkpoint's storage now: a rank that waits for ``.metadata``'s bytes
        (and the listing of the data files) from another rank
        (:mod:`asyncload.engine.metadata_read`)."""
        if self._storage_root is not None:
            await self.open_root(None)
        return await self.storage()

    def decode_metadata(self, raw: bytes | memoryview, url: str) -> Metadata:
        """``.metadata``'s bytes (read from ``url``, here or by another rank) decoded with the
        allow-list, once per URL and bytes with a cache."""
        cache, md = self.metadata_cache, None
        if cache is not None:
            md = cache.get((url, bytes(raw)))
        if md is None:
            md = formats.decode_metadata(raw, url, max_size=self._config.checks.max_metadata_size)
            if cache is not None:
                cache.clear()  # the last one only
                cache[(url, bytes(raw))] = md
        self._tally.recorder.add(files=1)
        return md

    # --- reading -------------------------------------------------------------------------

    def prepare_reads(
        self, plan: LoadPlan, planner: LoadPlanner, metadata: Metadata
    ) -> list[Record]:
        """The plan's reads grouped by saved record, destinations resolved through the
        planner (its hooks: call on the caller's thread), the device path set up, the
        unexpected-keys rule applied to what the planner reports (``config.planner``)."""
        self.metadata = metadata
        self._reading = True  # the reads are planned with this config: it is fixed from here
        rep = self._config.planner.planned()  # what the planner reports, or None
        records = collect(plan, planner, metadata, self.checkpoint, self.extension_registry, rep)
        self._torch_casts = torch_casts(planner)
        # CUDA destinations: pinned staging ring + side stream (caller's thread: stream order)
        dests = (d for r in records for _, d in r.tensor_items)
        self._stager = _stager_for(dests, self._config.memory, self._copier)
        note_keys(
            rep, self._tally.recorder.stats, strict=self._config.checks.strict_unexpected_keys
        )
        return records

    async def aread(
        self,
        records: list[Record],
        run_chunks: Callable[[Pipeline, list[Chunk]], Awaitable[None]] | None = None,
        shared: tuple[Meter, Meter] | None = None,  # (budget, limiter) of reads run at once
    ) -> None:
        """Read and assemble every record's bytes (:class:`~asyncload.engine.reads.RecordReads`):
        probes and small records, then each large record's data; checksums and changed
        files checked at the end. ``run_chunks`` replaces ``Pipeline.run`` (a planner that
        shares reads across ranks: ``ShardedLoadPlanner``); ``shared``: Pipeline meters."""
        storage = await self.storage()
        reads = RecordReads(
            storage,
            self.executor,
            self._config,
            self._tally.recorder,
            checkpoint=self.checkpoint,
            metadata=self.metadata,
            fingerprints=self._fingerprints,
            stager=self._stager,
            progress=self._progress,
            torch_casts=self._torch_casts,
            shared=shared,
        )
        await reads.run(records, run_chunks)

    def commit(self, records: list[Record], planner: LoadPlanner) -> None:
        """Hand every tensor and decoded object to the planner (its hooks: caller's thread;
        :func:`asyncload.engine.records.commit`)."""
        commit(records, planner, self._config.checks)

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
        """:meth:`end_reads` on the running loop (``aload``, and the driver's steps)."""
        stager, self._stager = self._stager, None
        try:
            if stager is not None:
                await asyncio.to_thread(stager.finish_sync)
        finally:
            try:
                await self.aclose()
            except Exception:
                log.debug(
                    "closing the storage of %s failed",
                    redact_url(str(self.checkpoint)),
                    exc_info=True,
                )

    # --- loads that allocate their destinations (asyncload.faces.streaming) ----------------------

    async def acheck_claims(self, metadata: Metadata, fqns: list[str]) -> None:
        """Before destinations are allocated for ``fqns`` from ``metadata``: every saved
        chunk of their tensors fits in its record, and every record in its file
        (:func:`asyncload.engine.checks.check_claims`)."""
        self._reading = True  # the data files are read from here: the config is fixed
        storage = await self.storage()
        await check_claims(
            storage,
            metadata,
            fqns,
            self._config,
            self._fingerprints,
            self._tally.recorder,
            self.checkpoint,
        )

    async def afinish_device_copies(self) -> None:
        """Wait until the device copies of the reads so far have finished (between two
        batches of a load read batch by batch); the storage stays open."""
        stager, self._stager = self._stager, None
        if stager is not None:
            await asyncio.to_thread(stager.finish_sync)


async def _not_found(
    session: LoadSession,
    storage: RetryingStorage,
    exc: CheckpointNotFoundError,
    url: str,
    rank: int | None,
) -> Metadata:
    """``.metadata`` (``__{rank}.metadata``) at ``url`` is missing: a local checkpoint that
    does not exist, or another format found by the fallback probe; else the typed error."""
    checkpoint = session.checkpoint
    local = is_local(checkpoint)
    # one stat, on the error path
    if local and not os.path.lexists(local_root(checkpoint)):  # noqa: ASYNC240
        session.checkpoint_missing = True
        raise CheckpointNotFoundError(
            f"the checkpoint {checkpoint} does not exist: no such file or directory "
            "(check the path)",
            path=str(checkpoint),
            status=404,
        ) from None  # the .metadata it looked for adds nothing
    if rank is None:
        found = await formats.aprobe_fallback(
            checkpoint,
            storage,
            session.open_root,
            session.config.checks,
            session.config.chunking,
            slots=probe_slots(session.config),
        )
        if found is not None:
            return found
    raise CheckpointNotFoundError(
        f"{url} does not exist: {checkpoint} is not a DCP checkpoint, or its save "
        "did not finish "
        "(DCP writes .metadata last); nor is it a safetensors or torch.save checkpoint "
        f"({docs_ref('Formats')})",
        path=url,
        status=404,
    ) from exc.__cause__ or exc  # the client's own error: the translated one says the same


def _changed_settings(current: LoadConfig, new: LoadConfig) -> list[str]:
    """The names of the options whose resolved values differ between ``current`` and
    ``new`` (:func:`asyncload.engine.config.settings`)."""
    old, now = settings(current), settings(new)
    return [name for name in old if old[name] != now[name]]


def in_flight(session: LoadSession) -> InFlight | None:
    """The storage requests of ``session``'s load in progress that have not ended (``None``
    before its storage is opened)."""
    boundary = session._boundary
    return boundary.in_flight if boundary is not None else None


class _IOThreads(concurrent.futures.ThreadPoolExecutor):
    """The load's I/O thread pool, counting the jobs submitted and not yet finished."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._unfinished = 0
        self._count_lock = threading.Lock()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
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
