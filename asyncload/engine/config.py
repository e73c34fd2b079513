"""The load's configuration, resolved once: :func:`resolve_config`.

One function turns :class:`~asyncload.LoadOptions` (and what the planner brings,
:class:`PlannerTerms`) into a frozen :class:`LoadConfig`: the narrow policies every stage
reads (retry, hedge, chunking, the I/O threads, the collective timeout) and the
:class:`MemoryPlan`. The config travels with the work: the session is made with it, the
storage boundary is made from it (:class:`asyncload.storage.retrying.RetryingStorage`), the
pipeline reads with it; nothing resolves an option again downstream.

What the planner brings reaches the engine through one explicit object,
:class:`PlannerTerms`, made at the face by :func:`asyncload.faces.terms.planner_terms`
(the faces know their planners) and resolved into the config (:attr:`LoadConfig.planner`):
its options when they were set explicitly, its collective timeout, the share session that
takes over the reads (``ShardedLoadPlanner``), the note that the destinations were
checked, and the report of what it planned (its view of the metadata; the missing, tied
and unexpected keys). The engine never inspects a planner for asyncload's own behaviour.

Which options govern a load:

- ``asyncload.load`` / ``aload`` / ``start_load``: the ``options`` argument, else the
  planner's own (a :class:`PipelinedLoadPlanner` made with options or knobs), else the
  defaults; resolved before anything is read.
- a plain ``dcp.load(storage_reader=PipelinedReader(...), planner=...)``: torch reads
  ``.metadata`` (``read_metadata``, then ``set_up_storage_reader``) before it hands the
  reader the planner, so the reader's options govern the metadata read; once the planner
  arrives, a planner with options of its own governs the rest.

When the config can change: only in
:meth:`asyncload.engine.session.LoadSession.planner_arrived`, which a face calls with the
terms of a planner that arrives after the session was made: ``PipelinedReader.read_data``
(``dcp.load`` hands the reader its planner there), the driver of a ``load`` made with no
planner (its planner is chosen once the metadata is read) and a stream (one planner per
batch). It always sets :attr:`LoadConfig.planner`; the options, and every policy resolved
from them, change only where the planner's were set explicitly and are not the config's
already, which only the ``dcp.load`` path can meet (the other two make their planners with
the config's own options). That call comes after ``.metadata`` (or a rank's
``__{rank}.metadata``) was read and before any read of tensor data: before the plan's
records are collected, the data files' sizes checked, a record's header probed or a data
byte requested; the storage boundary is then made anew for the new options (the store that
read the metadata was closed after that read: a store's policy never changes). From there to the end of
the load the config is fixed, and the session holds it so: once the load has begun reading
tensor data (``prepare_reads``, or ``acheck_claims`` for a stream), ``planner_arrived``
with options that differ from the config's raises ``RuntimeError`` naming them (terms
without options, or with the config's own, still set :attr:`LoadConfig.planner`: a
stream's next batch). A session's next load
(:meth:`~asyncload.engine.session.LoadSession.begin`) starts again from the config it was
made with.

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
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from asyncload.common.latency import LoadClock
from asyncload.common.options import ChunkPolicy, HedgePolicy, LoadOptions, RetryPolicy
from asyncload.common.stats import StatsRecorder
from asyncload.storage import RetryingStorage, Storage, open_storage

__all__ = [
    "LoadConfig",
    "MemoryPlan",
    "PlanReport",
    "PlannerTerms",
    "ReadShare",
    "open_boundary",
    "resolve_config",
    "ring_geometry",
]

#: The most slots a pinned ring gets, and the fewest.
MAX_SLOTS = 8
MIN_SLOTS = 2
#: The smallest slot (a budget of 64 KiB gives two 32 KiB slots).
MIN_SLOT_SIZE = 32 * 1024


class ReadShare(Protocol):
    """A share session that takes over one rank's reads of a load (``ShardedLoadPlanner``:
    :class:`asyncload.distributed.share_session._ShareSession`): :meth:`run` replaces
    ``Pipeline.run`` for each read phase, :meth:`fail` tells the other ranks."""

    async def run(self, pipeline: Any, chunks: Any, /) -> None: ...

    def fail(self, exc: BaseException, /) -> None: ...


@dataclass(frozen=True)
class PlanReport:
    """What a planner of asyncload's planned, read once its plan is final: its view of the
    metadata (under a key prefix it loads from: :func:`asyncload.formats.rebase`) and the
    keys it found missing, tied and unexpected (:class:`~asyncload.LoadStats`)."""

    metadata: Any
    missing_keys: list[str]
    tied_keys: dict[str, str]
    unexpected_keys: list[str]


@dataclass(frozen=True, kw_only=True)
class PlannerTerms:
    """What a load's planner brings to it, said by the face that knows the planner
    (:func:`asyncload.faces.terms.planner_terms`); the engine learns nothing else from a
    planner. A planner that is not asyncload's (torch's ``DefaultLoadPlanner``), or none,
    brings nothing: ``PlannerTerms()``."""

    #: The planner's options when they were set explicitly (they then govern a load given
    #: no ``options``), else None.
    options: LoadOptions | None = None
    #: ``collective_timeout(options)``: the planner's collective timeout for the load's
    #: options (``ShardedLoadPlanner(collective_timeout=...)``); None: the options' own.
    collective_timeout: Callable[[LoadOptions], float | None] | None = None
    #: ``share(session, options)``: the share session that takes over this rank's reads of
    #: the load ``session``, or None when there is nobody to share with (``ShardedLoadPlanner``).
    share: Callable[[Any, LoadOptions], ReadShare | None] | None = None
    #: ``destinations_checked(state_dict)``: the load checked ``state_dict`` before its first
    #: request; the planner need not check it again when it is set up with it.
    destinations_checked: Callable[[Any], None] | None = None
    #: ``report()``: what the planner planned, once its plan is final (:class:`PlanReport`).
    report: Callable[[], PlanReport] | None = None

    def planned(self) -> PlanReport | None:
        """:attr:`report`'s answer (None: the planner reports nothing)."""
        return self.report() if self.report is not None else None


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
    #: What the load's planner brings to it (:class:`PlannerTerms`; none by default).
    planner: PlannerTerms = PlannerTerms()

    def with_planner(self, terms: PlannerTerms) -> LoadConfig:
        """This config for a planner that brings ``terms`` and no other options (none of
        its own, or these): the options and policies stand; the planner's own collective
        timeout (``ShardedLoadPlanner(collective_timeout=...)``), when it has one, is the
        load's."""
        timeout_for = terms.collective_timeout
        collective = self.collective_timeout if timeout_for is None else timeout_for(self.options)
        return dataclasses.replace(self, planner=terms, collective_timeout=collective)

    def __repr__(self) -> str:
        c = self.chunking
        return (
            f"LoadConfig(chunks={c.chunk_size}/{c.min_chunk_size}, timeout={self.retry.timeout}, "
            f"retries={self.retry.retries}, hedge={self.hedge.enabled}, "
            f"memory_budget={self.memory.budget}, "
            f"io_threads={self.io_threads})"
        )


def resolve_config(
    options: LoadOptions | None = None, terms: PlannerTerms | None = None
) -> LoadConfig:
    """The load's :class:`LoadConfig`: from ``options`` when given, else from the options
    the planner brings (``terms.options``: set explicitly), else from the defaults. The
    planner's ``terms.collective_timeout`` (``ShardedLoadPlanner``) sets the collective
    timeout.

    Raised: ``TypeError`` when ``options`` is not a :class:`LoadOptions` or ``terms`` not
    a :class:`PlannerTerms`."""
    if terms is None:
        terms = PlannerTerms()
    elif not isinstance(terms, PlannerTerms):
        raise TypeError(
            f"terms must be a PlannerTerms (asyncload.faces.terms.planner_terms makes them "
            f"from a planner), not {type(terms).__name__}"
        )
    if options is None:
        options = terms.options or LoadOptions()
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
    timeout_for = terms.collective_timeout
    collective = options.collective_timeout if timeout_for is None else timeout_for(options)
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
        planner=terms,
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
