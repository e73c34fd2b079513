"""Loads without a prebuilt state dict: :func:`iter_tensors` and :func:`aiter_tensors`.

:class:`CheckpointStream` is the core that :mod:`asyncload.faces.allocating` (``read_state_dict``) and
the CLI share. It reads the checkpoint's metadata once, selects keys, checks what the
metadata claims against the files' real sizes (:meth:`LoadSession.acheck_claims`) before
anything is allocated, then allocates destinations batch by batch and loads each batch
through the one :class:`~asyncload.engine.session.LoadSession` it keeps open (one storage, one
set of I/O threads, one clock and one :class:`LoadStats` for the whole stream).

Streaming: the selected tensors, in file and offset order, are split into batches of at
most ``memory_budget / 2`` bytes, the first ones smaller (two chunks, doubling:
:func:`batch_limits`, so that the first tensor is handed over early); a tensor larger than
its batch's limit is a batch of its own. While
batch ``k`` is being yielded, batch ``k + 1`` is read, as long as the tensors held (read and not
yet yielded, and the one yielded last until the consumer asks for the next) stay within
``memory_budget``; a batch larger than the budget is read only once nothing is held, and yielded
alone. A consumer that does not ask for the next tensor stops the reads there.

Read-ahead overlaps the batches: into CPU destinations with a fixed ``concurrency`` and no
progress callback, up to two batches are read at once, batch ``k + 1`` starting as soon as the
tensors held leave room for it (batch ``k`` may still be reading), so the link does not idle
between two batches (no round trip, no ramp-up). The batches read at once share one read
budget (``memory_budget``) and one ``concurrency`` limit, and their tensors are still yielded
in order: a batch's error is raised where its first tensor would have been yielded.
Elsewhere (CUDA destinations, whose pinned staging ring a session keeps one of; ``"auto"``
concurrency, whose tuner works on one pipeline; a progress callback, which counts one batch at
a time) one batch is read at a time, the next one starting when the previous one has landed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fnmatch
import logging
import os
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from asyncload.common.errors import StateDictMismatchError, redact_url
from asyncload.common.loop import loop_thread, run_sync
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats
from asyncload.engine import LoadSession, Meter, _in_thread, resolve_config
from asyncload.faces.arguments import check_source_arguments
from asyncload.faces.terms import planner_terms
from asyncload.formats import plain

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = [
    "CheckpointStream",
    "KeySelection",
    "aiter_tensors",
    "iter_tensors",
    "select_keys",
    "sync_iter",
]

log = logging.getLogger("asyncload.stream")

#: ``keys=``: names, glob patterns, or a predicate over the checkpoint's flattened names.
KeySelection = Collection[str] | str | Callable[[str], bool] | None
ProgressCallback = Callable[[int, int], None]


def batch_limits(budget: int, chunk: int) -> Iterator[int]:
    """The byte limits of a stream's batches, in order: ``budget / 2`` each, except the first
    ones, which start at two chunks (or ``budget / 16``, the larger) and double up to it. A
    batch is handed over once all of it has landed, so a first batch of half the budget kept
    the consumer idle until that half was read (64 MiB from S3 behind 10 ms: 0.5 s inside
    vLLM); a small first batch lands within a round trip or two, and the next one is read
    while it is consumed."""
    full = max(1, budget // 2)
    limit = min(full, max(2 * chunk, budget // 16, 1))
    while True:
        yield limit
        limit = min(full, 2 * limit)


def select_keys(metadata: Metadata, keys: KeySelection, checkpoint: Any) -> list[str]:
    """The checkpoint's flattened names that ``keys`` selects, in the metadata's order.

    A name selects that key and everything saved under it (``"layers"`` selects
    ``"layers.0.q"``, like torch's ``_load_state_dict_from_keys``); a pattern is matched
    with :func:`fnmatch.fnmatchcase`. A name or pattern that selects nothing raises
    :class:`StateDictMismatchError` (a typo is not an empty load).
    """
    names = list(metadata.state_dict_metadata)
    if keys is None:
        return names
    if callable(keys):
        return [n for n in names if keys(n)]
    wanted = [keys] if isinstance(keys, str) else list(keys)
    chosen: set[str] = set()
    for want in wanted:
        if not isinstance(want, str):
            raise TypeError(
                f"keys must be names, glob patterns or a callable, not a {type(want).__name__}"
            )
        hits = [
            n
            for n in names
            if n == want or n.startswith(want + ".") or fnmatch.fnmatchcase(n, want)
        ]
        if not hits:
            raise StateDictMismatchError(
                f"keys={want!r} selects nothing in {checkpoint} (it has {len(names)} keys, "
                f"e.g. {names[:5]}; names are flattened with dots: 'layers.0.weight')"
            )
        chosen.update(hits)
    return [n for n in names if n in chosen]


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "meta"):
        raise ValueError(
            f"device={device!r}: asyncload loads into 'cpu', 'cuda', 'cuda:N' or 'meta'"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch sees no CUDA device here")
        if dev.index is None:  # the caller's current device: allocation runs on a worker thread
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class CheckpointStream:
    """One checkpoint's selected tensors (and objects), allocated and loaded batch by batch
    through one session. Use :meth:`aopen`, then :meth:`abatches` or :meth:`aload_all`,
    and always :meth:`aclose`."""

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        keys: KeySelection = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        options: LoadOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        progress: ProgressCallback | None = None,
        metadata_cache: dict[Any, Metadata] | None = None,
    ) -> None:
        if options is not None and not isinstance(options, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, not {type(options).__name__}")
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise ValueError(
                f"dtype={dtype!r}: floating tensors are converted to it, so it must be a floating dtype"
            )
        self.checkpoint = checkpoint
        self.keys = keys
        self.device = _device(device)
        self.dtype = dtype
        base = options or LoadOptions()
        # the rest of the checkpoint is simply not selected; a dtype given converts on load
        self.options = dataclasses.replace(
            base,
            strict_unexpected_keys=False,
            allow_dtype_cast=base.allow_dtype_cast or dtype is not None,
        )
        config = resolve_config(self.options)
        self.session = LoadSession(
            checkpoint,
            config=config,
            options=self.options,
            storage_options=storage_options,
            progress=self._batch_progress,
            metadata_cache=metadata_cache,
        )
        #: ``progress(bytes_done, bytes_total)`` over every batch (from library threads).
        self.progress = progress
        #: Bytes of the batches loaded before the one in flight, and of every selected tensor.
        self._progress_done = 0
        self._progress_base = 0
        self._progress_total = 0
        self.metadata: Metadata | None = None
        #: Selected flattened names: tensors in file and offset order, then objects.
        self.tensors: list[str] = []
        self.objects: list[str] = []
        #: Allocate zeros (touched memory, as the CLI's timed loads do) instead of empty tensors.
        self.touch = False
        #: Tensor bytes allocated and not yet handed over (the ``streaming`` share of the
        #: memory plan): a batch larger than the budget only alone.
        self.held = Meter(
            config.memory.streaming, name="streamed tensors", oversize="alone", unit="bytes"
        )
        self._stats: LoadStats | None = None
        #: Files read by the batches, and those counted when the metadata was read.
        self._files: set[str] = set()
        self._files_at_open = 0
        #: The batches being read (ahead of the consumer), oldest first.
        self._pending: collections.deque[asyncio.Task[dict[str, Any]]] = collections.deque()
        #: The read budget and reads-in-flight meters that the batches read at once share
        #: (set by :meth:`abatches` while it reads more than one batch at once).
        self._read_meters: tuple[Meter, Meter] | None = None
        #: Held while a batch's planner is set up and its reads prepared: the session keeps
        #: the terms of one planner at a time (:meth:`LoadSession.planner_arrived`), so two
        #: batches read at once prepare one after the other.
        self._preparing = asyncio.Lock()
        #: For each batch started by :meth:`abatches`, in order: how many earlier batches
        #: were still being read when it started (0: none, the link was idle).
        self.overlaps: list[int] = []

    @property
    def held_bytes(self) -> int:
        """Tensor bytes allocated and not yet handed over."""
        return self.held.used

    @property
    def peak_held_bytes(self) -> int:
        return self.held.peak

    def _batch_progress(self, done: int, _batch_total: int) -> None:
        """The session counts one batch: report over the whole stream."""
        user = self.progress
        if user is not None:
            user(self._progress_base + done, self._progress_total)

    # --- planning ------------------------------------------------------------------------

    async def aopen(self, *, check: bool = True) -> Metadata:
        """Read the metadata and select the keys; with ``check``, :meth:`acheck` too."""
        session = self.session
        session.begin()
        md = await session.aread_metadata()
        if plain.is_plain(md):  # (session.plain_metadata: read_state_dict)
            from asyncload.faces.plain_planner import whole_tensors

            if not whole_tensors(md):  # chunked tensors: planned by DCP's planner
                md = plain.to_dcp(md)
        self.metadata = md
        chosen = select_keys(md, self.keys, self.checkpoint)
        sdm = md.state_dict_metadata
        self.tensors = sorted((k for k in chosen if plain.is_tensor_md(sdm[k])), key=self._where)
        self.objects = [k for k in chosen if not plain.is_tensor_md(sdm[k])]
        self._files_at_open = session.live_stats().files
        if check:
            await self.acheck()
        return md

    async def acheck(self) -> None:
        """What the metadata claims for the selected keys fits the files' real sizes
        (before anything is allocated; nothing to check for ``"meta"``)."""
        assert self.metadata is not None
        if self.device.type != "meta":
            await self.session.acheck_claims(self.metadata, self.tensors + self.objects)

    def tensor_metadata(self, fqn: str) -> Any:
        """The saved tensor ``fqn``'s metadata (shape, dtype, chunks)."""
        assert self.metadata is not None
        smd = self.metadata.state_dict_metadata[fqn]
        assert plain.is_tensor_md(smd)
        return smd

    def _where(self, fqn: str) -> tuple[str, int]:
        """Where a tensor's first saved chunk is (file, offset): the order to read in."""
        smd = self.tensor_metadata(fqn)
        assert self.metadata is not None
        if smd.chunks and self.metadata.storage_data:
            kinds = plain.plain_kinds() if plain.is_plain(self.metadata) else plain.kinds()
            index = kinds.MetadataIndex(fqn, smd.chunks[0].offsets)
            info = self.metadata.storage_data.get(index)
            if info is not None:
                return str(getattr(info, "relative_path", "")), int(
                    getattr(info, "offset", 0) or 0
                )
        return "", 0

    def dtype_of(self, smd: TensorStorageMetadata) -> torch.dtype:
        saved = smd.properties.dtype
        return self.dtype if self.dtype is not None and saved.is_floating_point else saved

    def nbytes(self, fqn: str) -> int:
        """The bytes of tensor ``fqn``'s destination."""
        smd = self.tensor_metadata(fqn)
        return torch.Size(smd.size).numel() * self.dtype_of(smd).itemsize

    def batches(self) -> list[list[str]]:
        """The selected tensors in batches of at most ``memory_budget / 2`` bytes, the first
        ones smaller (:func:`batch_limits`) so that the first tensor is handed over early."""
        limits = batch_limits(self.options.memory_budget, self.options.effective_chunk_size)
        limit = next(limits)
        out: list[list[str]] = []
        size = 0
        for fqn in self.tensors:
            n = self.nbytes(fqn)
            if out and size + n <= limit:
                out[-1].append(fqn)
                size += n
            else:
                if out:
                    limit = next(limits)
                out.append([fqn])
                size = n
        return out

    def allocate(self, fqns: list[str]) -> dict[str, Any]:
        """Fresh destinations: empty tensors (zeros with :attr:`touch`) of the saved shapes
        (in ``dtype`` for floating ones) on the device; ``None`` for objects."""
        assert self.metadata is not None
        out: dict[str, Any] = {}
        for fqn in fqns:
            smd: Any = self.metadata.state_dict_metadata[fqn]
            if plain.is_tensor_md(smd):
                make = torch.zeros if self.touch else torch.empty
                out[fqn] = make(tuple(smd.size), dtype=self.dtype_of(smd), device=self.device)
            else:
                out[fqn] = None
        return out

    # --- loading -------------------------------------------------------------------------

    async def aload(self, fqns: list[str]) -> dict[str, Any]:
        """Allocate ``fqns`` (:meth:`allocate`) and load them through the open session: the
        flattened names and their values. Allocation and the planner's work run on a worker
        thread, the reads on this loop."""
        if self.device.type == "meta":  # no data read: objects left out
            return {k: v for k, v in self.allocate(fqns).items() if v is not None}
        session = self.session
        md = self.metadata
        assert md is not None
        planner: Any
        if plain.is_plain(md):  # a safetensors or torch.save file: no DCP (whole tensors)
            from asyncload.faces.plain_planner import PlainLoadPlanner

            planner = PlainLoadPlanner(options=self.options, allow_partial_load=True)
        else:
            from asyncload.faces.dcp_reader import PipelinedLoadPlanner

            planner = PipelinedLoadPlanner(options=self.options, allow_partial_load=True)
        dest: dict[str, Any] = {}

        def prepare() -> Any:
            dest.update(self.allocate(fqns))
            planner.set_up_planner(dest, md, True)
            local = planner.create_local_plan()
            planner.unexpected_keys = []  # the other keys are other batches', or not selected
            final = planner.finish_plan(planner.create_global_plan([local])[0])
            # this batch's planner (it carries the stream's options: the config stands)
            session.planner_arrived(planner_terms(planner))
            return session.prepare_reads(final, planner, md)

        async with self._preparing:
            records = await _in_thread(prepare)
        self._files.update(r.name for r in records)
        if self.progress is not None:  # the session counts one batch: report over the whole stream
            self._progress_base = self._progress_done
            self._progress_total = sum(self.nbytes(k) for k in self.tensors)
        meters = self._read_meters
        try:
            if meters is None:
                await session.aread(records)
            else:
                await session.aread(records, shared=meters)
        finally:
            await session.afinish_device_copies()
        self._progress_done += sum(
            t.numel() * t.element_size() for t in dest.values() if t is not None
        )
        await _in_thread(self._commit, records, planner)
        return dest

    def _commit(self, records: Any, planner: Any) -> None:
        session = self.session
        session.commit(records, planner)
        del records, planner  # a stream hands its tensors over: it keeps no view of them

    async def aload_all(self) -> dict[str, Any]:
        """Every selected key in one load (``read_state_dict``), flattened names."""
        return await self.aload(self.tensors + self.objects)

    async def abatches(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The selected tensors, each as soon as its batch has landed, double-buffered
        within ``memory_budget`` (see the module docstring)."""
        held = self.held
        todo = self.batches()
        sizes = [sum(self.nbytes(f) for f in b) for b in todo]
        following = 0  # the index of the next batch to start
        ahead = self.read_ahead()
        pending = self._pending
        if ahead > 1:
            options = self.options
            self._read_meters = (
                Meter(options.memory_budget, name="read budget", unit="bytes"),
                Meter(options.initial_concurrency, name="reads in flight", unit="reads"),
            )

        def start_if_room() -> None:
            nonlocal following
            while len(pending) < ahead and following < len(todo):
                # nothing held, or the batch fits with what is held (a larger one: alone)
                if not held.try_acquire(sizes[following]):
                    return
                self.overlaps.append(sum(1 for t in pending if not t.done()))
                pending.append(asyncio.ensure_future(self.aload(todo[following])))
                following += 1

        try:
            start_if_room()
            while pending:
                loaded = await pending[0]
                pending.popleft()
                names = list(loaded)
                start_if_room()
                for fqn in names:
                    tensor = loaded.pop(fqn)
                    n = tensor.numel() * tensor.element_size()
                    start_if_room()
                    yield fqn, tensor
                    del tensor
                    # held until the consumer asks for the next one (it holds it meanwhile)
                    held.release(n)
                    start_if_room()
        finally:
            await self._astop()

    def read_ahead(self) -> int:
        """How many batches :meth:`abatches` reads at once: 2 into CPU destinations with a
        fixed ``concurrency`` and no progress callback, else 1 (the module docstring)."""
        if self.device.type != "cpu" or self.progress is not None:
            return 1
        return 1 if self.options.concurrency == "auto" else 2

    async def _astop(self) -> None:
        """Cancel the batches being read ahead, if any, and wait until they have stopped."""
        pending = self._pending
        tasks = list(pending)
        pending.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except BaseException:  # cancelled, or failed: the stream is ending anyway
                log.debug(
                    "the batch in flight of %s ended",
                    redact_url(str(self.checkpoint)),
                    exc_info=True,
                )

    # --- results and cleanup -------------------------------------------------------------

    def finish(self) -> LoadStats:
        """The stream has ended: its :class:`LoadStats` (``peak_buffered_bytes`` counts the
        tensors held but not yet handed over too; ``files`` each file once), logged as one INFO line."""
        stats = self.session.finish()
        stats.peak_buffered_bytes = max(stats.peak_buffered_bytes, self.peak_held_bytes)
        stats.files = self._files_at_open + len(self._files)  # each batch counts its files again
        self._stats = stats
        log.info("read %s: %s", redact_url(str(self.checkpoint)), stats)
        return stats

    @property
    def stats(self) -> LoadStats:
        """The final statistics once :meth:`finish` ran, else a live snapshot."""
        return self._stats if self._stats is not None else self.session.live_stats()

    async def aclose(self) -> None:
        """Stop a batch in flight, close files and sessions and stop the I/O threads."""
        try:
            await self._astop()
            await self.session.afinish_device_copies()
        finally:
            await self.session.aclose()


async def _astream(stream: CheckpointStream) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    try:
        await stream.aopen()
        async with contextlib.aclosing(
            stream.abatches()
        ) as tensors:  # closed now, not when collected
            async for item in tensors:
                yield item
                del item  # not held while the next one is read
        stream.finish()
    finally:
        await stream.aclose()


def aiter_tensors(
    checkpoint: str | os.PathLike[str],
    *,
    keys: KeySelection = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """:func:`iter_tensors` as an async iterator, on the caller's event loop. Cancelling the
    task that iterates, or ``aclose()`` (``contextlib.aclosing``), stops the reads and
    returns once files, sessions and threads are closed."""
    check_source_arguments(checkpoint, options, storage_options, face="asyncload.aiter_tensors")
    stream = CheckpointStream(
        checkpoint,
        keys=keys,
        device=device,
        dtype=dtype,
        options=options,
        storage_options=storage_options,
    )
    # a safetensors or torch.save file's metadata of asyncload.formats.plain's types: no DCP
    stream.session.plain_metadata = True
    return _astream(stream)


def iter_tensors(
    checkpoint: str | os.PathLike[str],
    *,
    keys: KeySelection = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each selected tensor of ``checkpoint``, each as soon as
    its bytes have landed, without a prebuilt state dict.

    Names are the checkpoint's flattened keys (``"layers.0.weight"``). ``keys``: names (a
    name selects what is saved under it), glob patterns, or a callable ``name -> bool``;
    only the selected tensors' bytes are read. ``device``: ``"cpu"``, ``"cuda"``/
    ``"cuda:N"`` (through the pinned staging path) or ``"meta"`` (shapes and dtypes, no
    data read). ``dtype``: floating tensors are converted to it on load. Objects are not
    yielded (:func:`asyncload.read_state_dict` returns them).

    Memory: tensors read but not yet yielded, with the one yielded last, stay within
    ``options.memory_budget``; a tensor larger than it is read only after the loop asked for
    the next tensor, with nothing else held, so the peak is that one tensor plus whatever the
    loop still holds of the previous ones (``for name, t in ...`` keeps ``t`` bound while
    the next is read: ``del t`` at the end of the body for a peak of one tensor). Leaving the loop
    early (``break``, ``close()``, an exception) stops the reads and closes files, sessions and
    threads.
    """
    check_source_arguments(checkpoint, options, storage_options, face="asyncload.iter_tensors")
    agen = aiter_tensors(
        checkpoint,
        keys=keys,
        device=device,
        dtype=dtype,
        options=options,
        storage_options=storage_options,
    )
    return sync_iter(agen, options or LoadOptions())


async def _anext(agen: Any) -> Any:
    return await agen.__anext__()


def sync_iter(agen: Any, options: LoadOptions) -> Iterator[Any]:
    """Drive the async generator ``agen`` from this thread on the library's loop thread."""
    loop = loop_thread(options.use_uvloop)
    try:
        while True:
            try:
                item = run_sync(_anext(agen), loop)
            except StopAsyncIteration:
                return
            yield item
            del item
    finally:
        # a generator left open until the interpreter exits is finalised after the loop
        # thread has stopped: nothing could run the cleanup (the process is ending anyway)
        if not sys.is_finalizing():
            run_sync(agen.aclose(), loop)
