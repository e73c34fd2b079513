"""The load's configuration, resolved once: :func:`resolve_config`.

One function turns :class:`~asyncload.LoadOptions` (and the knobs a planner carries) into a
frozen :class:`LoadConfig`: the narrow policies every stage reads (retry, hedge, chunking,
the I/O threads, the collective timeout) and the :class:`MemoryPlan`. The config travels
with the work: the session is made with it, the storage boundary is made from it
(:class:`asyncload.storage.retrying.RetryingStorage`), the pipeline reads with it; nothing
resolves an option again downstream.

Which options govern a load:

- ``asyncload.load`` / ``aload`` / ``start_load``: the ``options`` argument, else the
  planner's own (a :class:`PipelinedLoadPlanner` made with options or knobs), else the
  defaults; resolved before anything is read.
- a plain ``dcp.load(storage_reader=PipelinedReader(...), planner=...)``: torch reads
  ``.metadata`` (``read_metadata``, then ``set_up_storage_reader``) before it hands the
  reader the planner, so the reader's options govern the metadata read; once the planner
  arrives (:meth:`asyncload.engine.session.LoadSession.planner_arrived`, the one step
  where a load's config changes), a planner with options of its own governs the rest.

The memory plan (``memory_budget`` = B; :class:`MemoryPlan`)::

    share       bounds                                              where
    ---------   -------------------------------------------------   ----------------------------
    reads       bytes read and not yet assembled: B                 engine.pipeline (Meter)
    pinned      page-locked staging ring of a device load:          engine.cuda_ring (PinnedRing)
                2..8 slots of one chunk, at most B
    streaming   tensors allocated and not yet handed over by        faces.streaming (CheckpointStream)
                iter_tensors: B (batches of B / 2)
    sends       bytes queued for ranks that read after this one     distributed (sends)
                returned (adaptive sharing): B

    peak (host) = reads + pinned (device loads) + streaming (iter_tensors) + sends (sharing)

A load uses the shares its kind needs: ``load`` of host tensors only ``reads``, into CUDA
tensors ``reads`` and ``pinned``, ``iter_tensors`` ``reads`` and ``streaming``, a sharded
multi-rank load that returns before its peers ``reads`` and ``sends``.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from asyncload.common.latency import LoadClock
from asyncload.common.options import ChunkPolicy, HedgePolicy, LoadOptions, RetryPolicy
from asyncload.common.stats import StatsRecorder
from asyncload.storage import RetryingStorage, Storage, open_storage

__all__ = [
    "CarriesOptions",
    "LoadConfig",
    "MemoryPlan",
    "open_boundary",
    "planner_options",
    "resolve_config",
    "ring_geometry",
]

#: The most slots a pinned ring gets, and the fewest.
MAX_SLOTS = 8
MIN_SLOTS = 2
#: The smallest slot (a budget of 64 KiB gives two 32 KiB slots).
MIN_SLOT_SIZE = 32 * 1024


@runtime_checkable
class CarriesOptions(Protocol):
    """A planner that carries load options (:class:`asyncload.PipelinedLoadPlanner`):
    ``has_options`` says whether they were set explicitly (only then do they govern)."""

    options: LoadOptions
    has_options: bool


def planner_options(planner: object) -> LoadOptions | None:
    """The options ``planner`` carries when they were set explicitly, else None."""
    if isinstance(planner, CarriesOptions) and planner.has_options:
        return planner.options
    return None


def ring_geometry(options: LoadOptions) -> tuple[int, int]:
    """``(slots, slot_size)`` of the pinned ring for ``options``: slots of one chunk,
    2 to 8 of them, all within ``memory_budget``."""
    slot = min(
        options.effective_chunk_size, max(MIN_SLOT_SIZE, options.memory_budget // MIN_SLOTS)
    )
    slots = max(MIN_SLOTS, min(MAX_SLOTS, options.memory_budget // slot))
    return slots, slot


@dataclass(frozen=True)
class MemoryPlan:
    """How ``memory_budget`` bounds each holder of memory (the module docstring's table):
    every share is in bytes; :attr:`peak` is the most the process holds for one load that
    uses every share."""

    budget: int
    #: Bytes read and not yet assembled (the pipeline's byte meter).
    reads: int
    #: The pinned staging ring of a load into device tensors: ``pinned_slots`` slots of
    #: ``slot_size`` bytes (a chunk of such a load is at most one slot).
    pinned: int
    pinned_slots: int
    slot_size: int
    #: Tensors allocated and not yet handed over by a stream (``iter_tensors``).
    streaming: int
    #: Bytes queued for sends to ranks that read after this one returned (adaptive sharing).
    sends: int

    @property
    def peak(self) -> int:
        return self.reads + self.pinned + self.streaming + self.sends

    @classmethod
    def for_options(cls, options: LoadOptions) -> MemoryPlan:
        budget = options.memory_budget
        slots, slot = ring_geometry(options)
        return cls(budget, budget, slots * slot, slots, slot, budget, budget)


@dataclass(frozen=True)
class LoadConfig:
    """One load's resolved configuration (:func:`resolve_config`); frozen."""

    options: LoadOptions
    retry: RetryPolicy
    hedge: HedgePolicy
    chunking: ChunkPolicy
    memory: MemoryPlan
    #: The options the reads of a load into device tensors use: chunks no larger than one
    #: pinned slot (``options`` itself when its chunks fit).
    staged: LoadOptions
    #: Threads for local reads and assembly copies.
    io_threads: int
    #: Multi-rank loads: seconds a rank may go without progress (the planner's own when it
    #: has one: ``ShardedLoadPlanner(collective_timeout=...)``).
    collective_timeout: float | None

    def __repr__(self) -> str:
        c = self.chunking
        return (
            f"LoadConfig(chunks={c.chunk_size}/{c.min_chunk_size}, timeout={self.retry.timeout}, "
            f"retries={self.retry.retries}, hedge={self.hedge.enabled}, "
            f"memory_budget={self.memory.budget}, "
            f"io_threads={self.io_threads})"
        )


def resolve_config(options: LoadOptions | None = None, planner: Any = None) -> LoadConfig:
    """The load's :class:`LoadConfig`: from ``options`` when given, else from the options
    ``planner`` carries when they were set explicitly, else from the defaults. A planner
    with ``collective_timeout_for(options)`` (``ShardedLoadPlanner``) sets the collective
    timeout.

    Raised: ``TypeError`` when ``options`` is not a :class:`LoadOptions`."""
    if options is None:
        options = planner_options(planner) or LoadOptions()
    elif not isinstance(options, LoadOptions):
        raise TypeError(f"options must be a LoadOptions, not {type(options).__name__}")
    memory = MemoryPlan.for_options(options)
    staged = options
    if options.effective_chunk_size > memory.slot_size:
        min_chunk = options.min_chunk_size
        assert min_chunk is not None  # derived from chunk_size when not given
        staged = options.replace(
            chunk_size=memory.slot_size, min_chunk_size=min(min_chunk, memory.slot_size)
        )
    timeout_for = getattr(planner, "collective_timeout_for", None)
    collective = timeout_for(options) if callable(timeout_for) else options.collective_timeout
    if options.io_threads is not None:
        threads = options.io_threads
    else:
        # page-cache copies scale with cores, not with threads; more threads than cores
        # measured slower here (docs/performance.md)
        threads = max(2, min(16, options.max_in_flight, os.cpu_count() or 2))
    return LoadConfig(
        options=options,
        retry=options.retry_policy,
        hedge=options.hedge_policy,
        chunking=options.chunk_policy,
        memory=memory,
        staged=staged,
        io_threads=threads,
        collective_timeout=collective,
    )


def open_boundary(
    config: LoadConfig,
    root: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None,
    executor: concurrent.futures.Executor,
    stats: StatsRecorder,
    clock: LoadClock,
    raw: Storage | None = None,
) -> RetryingStorage:
    """The storage at ``root`` (``raw`` when it is open already) behind the retrying error
    boundary, both made from ``config``: its transport, local mapped copies and listing
    bound, its retry and hedge policies. A load's session and ``safe_open``'s store open
    their storage here."""
    options = config.options
    if raw is None:
        raw = open_storage(
            root,
            storage_options,
            executor,
            transport=options.transport,
            mapped_copies=options.local_mapped_copies,
            max_listing_size=options.max_metadata_size,
        )
    return RetryingStorage(
        raw,
        retry=config.retry,
        hedge=config.hedge,
        stats=stats,
        executor=executor,
        clock=clock,
    )
