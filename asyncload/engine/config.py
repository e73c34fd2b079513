"""The load's configuration, resolved once: :func:`resolve_config`.

One function turns :class:`~asyncload.LoadOptions` (and what the planner brings,
:class:`PlannerTerms`) into a frozen :class:`LoadConfig`: the narrow policies every stage
reads (retry, hedge, chunking, the I/O threads, the collective timeout) and the
:class:`MemoryPlan`. The config travels with the work: the session is made with it, the
storage boundary is made from it (:class:`asyncload.storage.retrying.RetryingStorage`), the
pipeline reads with it; nothing resolves an option again downstream. The config holds
resolved fields only, no ``LoadOptions``: the policies above, the staged chunking of a load
into device tensors, the reads in flight (:class:`Concurrency`), the checks
(:class:`~asyncload.common.options.CheckPolicy`), how storage is opened
(:class:`StoragePolicy`) and the multi-rank options (:class:`RankPolicy`); each reader takes
the field it needs. :func:`settings` names what each option resolved to.

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
with options that resolve to other settings than the config's (:func:`settings`) raises
``RuntimeError`` naming them (terms without options, or with options that resolve alike,
still set :attr:`LoadConfig.planner`: a
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
from typing import Any, Literal, Protocol

from asyncload.common.latency import LoadClock
from asyncload.common.options import (
    CheckPolicy,
    ChunkPolicy,
    HedgePolicy,
    LoadOptions,
    RetryPolicy,
)
from asyncload.common.stats import StatsRecorder
from asyncload.storage import RetryingStorage, Storage, open_storage

__all__ = [
    "Concurrency",
    "LoadConfig",
    "MemoryPlan",
    "PlanReport",
    "PlannerTerms",
    "RankPolicy",
    "ReadShare",
    "StoragePolicy",
    "governing_options",
    "open_boundary",
    "resolve_config",
    "ring_geometry",
    "settings",
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
    #: ``collective_timeout(own)``: the planner's collective timeout for a load whose
    #: options say ``own`` (``ShardedLoadPlanner(collective_timeout=...)``); None: ``own``.
    collective_timeout: Callable[[float | None], float | None] | None = None
    #: ``share(session)``: the share session that takes over this rank's reads of the load
    #: ``session``, or None when there is nobody to share with (``ShardedLoadPlanner``).
    share: Callable[[Any], ReadShare | None] | None = None
    #: ``destinations_checked(state_dict)``: the load checked ``state_dict`` before its first
    #: request; the planner need not check it again when it is set up with it.
    destinations_checked: Callable[[Any], None] | None = None
    #: ``report()``: what the planner planned, once its plan is final (:class:`PlanReport`).
    report: Callable[[], PlanReport] | None = None

    def planned(self) -> PlanReport | None:
        """:attr:`report`'s answer (None: the planner reports nothing)."""
        return self.report() if self.report is not None else None


#: What a planner that brings nothing brings.
_NO_TERMS = PlannerTerms()


def ring_geometry(memory_budget: int, chunk_size: int) -> tuple[int, int]:
    """``(slots, slot_size)`` of the pinned ring for chunks of ``chunk_size`` (clamped to
    the budget already): slots of one chunk, 2 to 8 of them, all within ``memory_budget``."""
    slot = min(chunk_size, max(MIN_SLOT_SIZE, memory_budget // MIN_SLOTS))
    slots = max(MIN_SLOTS, min(MAX_SLOTS, memory_budget // slot))
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
    def for_budget(cls, budget: int, chunk_size: int) -> MemoryPlan:
        """The plan of ``budget`` for a load read in chunks of ``chunk_size`` (clamped)."""
        slots, slot = ring_geometry(budget, chunk_size)
        return cls(budget, budget, slots * slot, slots, slot, budget, budget)


@dataclass(frozen=True, kw_only=True)
class StoragePolicy:
    """How the storage under the error boundary is opened (:func:`open_boundary`): the
    remote client (``LoadOptions.transport``), local mapped copies
    (``local_mapped_copies``) and the bound on a listing (``max_metadata_size``)."""

    transport: Literal["auto", "obstore", "fsspec", "wire"]
    mapped_copies: bool
    max_listing_size: int


@dataclass(frozen=True, kw_only=True)
class Concurrency:
    """Reads in flight (``LoadOptions.concurrency``): a fixed number, or ``auto`` (the
    pipeline finds its level from ``initial`` up to ``max_in_flight``)."""

    auto: bool
    #: The reads in flight a pipeline starts with (the fixed number when not ``auto``).
    initial: int
    #: The most reads in flight.
    max_in_flight: int


@dataclass(frozen=True, kw_only=True)
class RankPolicy:
    """The options of a multi-rank load as given (``LoadOptions``' fields of the same
    names); :attr:`LoadConfig.collective_timeout` is the load's, its planner's when it has
    one."""

    collective_timeout: float | None
    late_rank_log_after: float | None
    share_metadata: bool | Literal["auto"]


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """One load's resolved configuration (:func:`resolve_config`); frozen. Every stage reads
    the field it needs: no :class:`~asyncload.LoadOptions` travels inside it."""

    retry: RetryPolicy
    hedge: HedgePolicy
    chunking: ChunkPolicy
    memory: MemoryPlan
    #: The chunking of the reads of a load into device tensors: chunks no larger than one
    #: pinned slot (``chunking`` itself when its chunks fit).
    staged: ChunkPolicy
    #: Reads in flight.
    concurrency: Concurrency
    #: What is checked and refused (``verify``, ``max_metadata_size``, ``safe_globals``...).
    checks: CheckPolicy
    #: How the storage is opened.
    storage: StoragePolicy
    #: Threads for local reads and assembly copies.
    io_threads: int
    #: Run the library's event loop on uvloop when it is installed.
    use_uvloop: bool
    #: The multi-rank options as given.
    ranks: RankPolicy
    #: Multi-rank loads: seconds a rank may go without progress (the planner's own when it
    #: has one: ``ShardedLoadPlanner(collective_timeout=...)``).
    collective_timeout: float | None
    #: What the load's planner brings to it (:class:`PlannerTerms`; none by default).
    planner: PlannerTerms = _NO_TERMS

    def with_planner(self, terms: PlannerTerms) -> LoadConfig:
        """This config for a planner that brings ``terms`` and no other options (none of
        its own, or these): the options and policies stand; the planner's own collective
        timeout (``ShardedLoadPlanner(collective_timeout=...)``), when it has one, is the
        load's."""
        timeout_for = terms.collective_timeout
        own = self.ranks.collective_timeout
        collective = own if timeout_for is None else timeout_for(own)
        return dataclasses.replace(self, planner=terms, collective_timeout=collective)

    def without_planner(self) -> LoadConfig:
        """This config bringing no planner's terms (``planner=PlannerTerms()``), for a holder
        that must not keep the planner alive."""
        if self.planner is _NO_TERMS:
            return self
        return dataclasses.replace(self, planner=_NO_TERMS)

    def __repr__(self) -> str:
        c = self.chunking
        return (
            f"LoadConfig(chunks={c.chunk_size}/{c.min_chunk_size}, timeout={self.retry.timeout}, "
            f"retries={self.retry.retries}, hedge={self.hedge.enabled}, "
            f"memory_budget={self.memory.budget}, "
            f"io_threads={self.io_threads})"
        )


def governing_options(options: LoadOptions | None, terms: PlannerTerms) -> LoadOptions:
    """The options that govern a load given ``options`` and a planner that brings
    ``terms``: ``options`` when given, else the planner's own (set explicitly), else the
    defaults (what :func:`resolve_config` resolves; a face that hands the options on to a
    planner of its own asks here).

    Raised: ``TypeError`` when ``options`` is not a :class:`LoadOptions` or ``terms`` not
    a :class:`PlannerTerms`."""
    if not isinstance(terms, PlannerTerms):
        raise TypeError(
            f"terms must be a PlannerTerms (asyncload.faces.terms.planner_terms makes them "
            f"from a planner), not {type(terms).__name__}"
        )
    if options is None:
        return terms.options or LoadOptions()
    if not isinstance(options, LoadOptions):
        raise TypeError(f"options must be a LoadOptions, not {type(options).__name__}")
    return options


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
    options = governing_options(options, terms)
    chunking = options.chunk_policy
    memory = MemoryPlan.for_budget(options.memory_budget, chunking.chunk_size)
    staged = chunking
    if chunking.chunk_size > memory.slot_size:
        staged = ChunkPolicy(
            chunk_size=memory.slot_size,
            min_chunk_size=min(chunking.min_chunk_size, memory.slot_size),
        )
    timeout_for = terms.collective_timeout
    own = options.collective_timeout
    collective = own if timeout_for is None else timeout_for(own)
    if options.io_threads is not None:
        threads = options.io_threads
    else:
        # page-cache copies scale with cores, not with threads; more threads than cores
        # measured slower here (docs/performance.md)
        threads = max(2, min(16, options.max_in_flight, os.cpu_count() or 2))
    return LoadConfig(
        retry=options.retry_policy,
        hedge=options.hedge_policy,
        chunking=chunking,
        memory=memory,
        staged=staged,
        concurrency=Concurrency(
            auto=options.concurrency == "auto",
            initial=options.initial_concurrency,
            max_in_flight=options.max_in_flight,
        ),
        checks=CheckPolicy(
            verify=options.verify,
            allow_dtype_cast=options.allow_dtype_cast,
            strict_unexpected_keys=options.strict_unexpected_keys,
            max_metadata_size=options.max_metadata_size,
            max_over_read_ratio=options.max_over_read_ratio,
            safe_globals=options.safe_globals,
        ),
        storage=StoragePolicy(
            transport=options.transport,
            mapped_copies=options.local_mapped_copies,
            max_listing_size=options.max_metadata_size,
        ),
        io_threads=threads,
        use_uvloop=options.use_uvloop,
        ranks=RankPolicy(
            collective_timeout=own,
            late_rank_log_after=options.late_rank_log_after,
            share_metadata=options.share_metadata,
        ),
        collective_timeout=collective,
        planner=terms,
    )


#: Each option's resolved value in a config (:func:`settings`), in ``LoadOptions``' order.
_SETTINGS: tuple[tuple[str, Callable[[LoadConfig], object]], ...] = (
    ("chunk_size", lambda c: c.chunking.chunk_size),
    ("min_chunk_size", lambda c: c.chunking.min_chunk_size),
    ("timeout", lambda c: c.retry.timeout),
    ("collective_timeout", lambda c: c.ranks.collective_timeout),
    ("retries", lambda c: c.retry.retries),
    ("backoff", lambda c: c.retry.backoff),
    ("max_backoff", lambda c: c.retry.max_backoff),
    ("concurrency", lambda c: c.concurrency),
    ("memory_budget", lambda c: c.memory.budget),
    ("verify", lambda c: c.checks.verify),
    ("hedge", lambda c: c.hedge.enabled),
    ("hedge_factor", lambda c: c.hedge.factor),
    ("hedge_min_delay", lambda c: (c.hedge.min_delay, c.hedge.derived)),
    ("allow_dtype_cast", lambda c: c.checks.allow_dtype_cast),
    ("strict_unexpected_keys", lambda c: c.checks.strict_unexpected_keys),
    ("use_uvloop", lambda c: c.use_uvloop),
    ("io_threads", lambda c: c.io_threads),
    ("local_mapped_copies", lambda c: c.storage.mapped_copies),
    ("max_metadata_size", lambda c: c.checks.max_metadata_size),
    ("transport", lambda c: c.storage.transport),
    ("max_over_read_ratio", lambda c: c.checks.max_over_read_ratio),
    ("safe_globals", lambda c: c.checks.safe_globals),
    ("late_rank_log_after", lambda c: c.ranks.late_rank_log_after),
    ("share_metadata", lambda c: c.ranks.share_metadata),
)


def settings(config: LoadConfig) -> dict[str, object]:
    """What ``config`` resolved each ``LoadOptions`` field to, by the field's name (a
    chunk size clamped to the budget, the I/O threads derived...): two configs that read
    alike have equal settings."""
    return {name: get(config) for name, get in _SETTINGS}


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
    if raw is None:
        store = config.storage
        raw = open_storage(
            root,
            storage_options,
            executor,
            transport=store.transport,
            mapped_copies=store.mapped_copies,
            max_listing_size=store.max_listing_size,
        )
    return RetryingStorage(
        raw,
        retry=config.retry,
        hedge=config.hedge,
        stats=stats,
        executor=executor,
        clock=clock,
    )
