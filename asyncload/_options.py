"""LoadOptions: every knob of a load, validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ChunkPolicy", "GiB", "HedgePolicy", "KiB", "LoadOptions", "MiB", "RetryPolicy"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: The smallest memory budget accepted: header probes and small records must fit.
MIN_MEMORY_BUDGET = 64 * KiB
#: ``min_chunk_size`` when it is not given: this, or ``chunk_size`` when that is smaller.
DEFAULT_MIN_CHUNK_SIZE = 1 * MiB
#: ``HedgePolicy.min_delay`` where ``hedge_min_delay`` is derived (None): the fixed floor
#: that peer transfers of multi-rank loads keep, seconds.
DEFAULT_HEDGE_MIN_DELAY = 0.5


_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+\Z")


def _check_safe_globals(value: Any) -> tuple[Any, ...]:
    """``LoadOptions.safe_globals`` as a tuple of classes, functions and ``"module.qualname"``
    strings; ValueError naming the field and the bad entry otherwise."""

    def bad(want: str) -> ValueError:
        return ValueError(f"LoadOptions.safe_globals={value!r:.300} is invalid: {want}")

    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise bad("expected a list or tuple of classes, functions or 'module.qualname' strings")
    entries = tuple(value)
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            if not _QUALNAME.match(entry):
                raise bad(
                    f"entry {i} ({entry!r:.200}) is not a 'module.qualname' string such as 'argparse.Namespace'"
                )
            continue
        module, qualname = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
        if (
            not (isinstance(entry, type) or callable(entry))
            or type(module) is not str
            or type(qualname) is not str
        ):
            raise bad(
                f"entry {i} ({entry!r:.200}) is not a class, a function or a 'module.qualname' string"
            )
        if "<" in qualname:
            raise bad(
                f"entry {i} ({module}.{qualname}) is a local or lambda object, which a pickle cannot name; "
                "define it at module level"
            )
    return entries


class _Derived(int):
    """An int that a field took by default from other fields (``min_chunk_size`` from
    ``chunk_size``). ``dataclasses.replace`` hands it back to ``__init__``, which derives it
    again from the new values instead of keeping a stale one."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How one storage call is tried: per-attempt ``timeout`` (progress-extended, see
    :mod:`asyncload.storage.retrying`), ``retries`` more attempts, full-jitter exponential backoff."""

    timeout: float | None
    retries: int
    backoff: float
    max_backoff: float

    @property
    def attempts(self) -> int:
        return self.retries + 1


@dataclass(frozen=True, kw_only=True)
class HedgePolicy:
    """When a remote read counts as a straggler and gets one duplicate request."""

    enabled: bool
    factor: float
    #: The floor, seconds: ``LoadOptions.hedge_min_delay``, or ``DEFAULT_HEDGE_MIN_DELAY``
    #: where it is derived (the floor of peer transfers in multi-rank loads).
    min_delay: float
    #: Duplicate requests in flight at once, at most (hedging must not double the load).
    max_in_flight: int
    #: ``hedge_min_delay=None``: the floor of a storage read is derived from the load's
    #: measured latency and per-stream rate (:func:`asyncload.storage.retrying.hedge_delay`).
    derived: bool = False


@dataclass(frozen=True, kw_only=True)
class ChunkPolicy:
    """How byte ranges become read requests: split at ``chunk_size`` (already clamped to
    the memory budget), neighbours coalesced under ``min_chunk_size``."""

    chunk_size: int
    min_chunk_size: int


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load reads. Sizes are bytes, durations seconds, ``None`` means no limit.

    Vary with ``dataclasses.replace(options, field=value)``.
    """

    #: Largest single read request. Larger byte ranges are split into reads of this size
    #: that run concurrently. Clamped to ``memory_budget`` so one chunk always fits.
    chunk_size: int = 16 * MiB
    #: Neighbouring reads smaller than this are coalesced into one request (gaps
    #: between them up to this size are read and thrown away). Not given: 1 MiB, or
    #: ``chunk_size`` when that is smaller (derived again when ``chunk_size`` is replaced).
    min_chunk_size: int | None = None
    #: Seconds allowed for one attempt at one chunk; ``None`` = no limit.
    timeout: float | None = 30.0
    #: Multi-rank loads: seconds a rank may go without progress (no chunk read or shared,
    #: no step done, no heartbeat while it waits on others) before the other ranks give up
    #: on it and raise DistributedLoadError naming it; ``None`` = wait forever.
    collective_timeout: float | None = 300.0
    #: Extra attempts after the first failed one (0 = no retry).
    retries: int = 4
    #: First backoff delay in seconds; doubles per attempt, with full jitter.
    backoff: float = 0.2
    #: Longest backoff delay in seconds.
    max_backoff: float = 10.0
    #: Reads in flight at once, or ``"auto"`` to let the pipeline find its level.
    concurrency: int | Literal["auto"] = 16
    #: Hard bound on bytes read but not yet assembled.
    memory_budget: int = 512 * MiB
    #: Check the CRC-32 torch stores for each tensor record against the bytes read.
    verify: bool = False
    #: Re-issue a chunk that is much slower than its peers (remote stores only).
    hedge: bool = True
    #: A chunk becomes a straggler after ``max(floor, hedge_factor x p90 latency)`` of recent
    #: comparable reads, or once its answer has not begun ``hedge_factor x p90`` first-byte
    #: latency after it was asked for while later requests had theirs (docs/remote.md).
    hedge_factor: float = 3.0
    #: Floor for the hedge delay, seconds (``4 x`` it before any comparable read finished).
    #: ``None`` (the default): derived from this load's measured first-byte latency and
    #: per-stream rate (``hedge_factor x`` the expected time of the chunk, at least 0.05 s;
    #: 1 s before any history). A number keeps the fixed floor (0.5 was the default before).
    hedge_min_delay: float | None = None
    #: Allow lossy dtype conversions on load (fp32 into bf16, float into int: cast on copy).
    #: Lossless widening (bf16 into fp32, int8 into int32) loads without it (docs/errors.md).
    allow_dtype_cast: bool = False
    #: Raise when the checkpoint holds keys the destination lacks (they are always
    #: listed in ``LoadStats.unexpected_keys``).
    strict_unexpected_keys: bool = False
    #: Run the event loop on uvloop when it is installed: remote loads import it on first
    #: use; the sync faces' local loads run on it only when the program has imported it (its
    #: import costs more than it saves in a local load), on the standard loop otherwise.
    use_uvloop: bool = True
    #: Threads for local positional reads and for assembly copies (``None``: from concurrency).
    io_threads: int | None = None
    #: Copy a large local read that the kernel's copy would slow down 1.6-3.9x (a destination
    #: 1-31 bytes past its file offset modulo 4096: 4 KiB aliasing) out of a short-lived
    #: mapping of the file's cached pages, under a read lease that keeps writers out while it
    #: lasts, instead of ``preadv`` (Linux 6.5+; falls back to ``preadv`` by itself: no lease,
    #: a page not cached, a writer waiting). docs/performance.md has the figures.
    local_mapped_copies: bool = True
    #: Largest ``.metadata`` / header accepted, bytes (hostile-input guard).
    max_metadata_size: int = 1 * GiB
    #: The client for ``s3://``, ``gs://``/``gcs://`` and ``http(s)://``: ``"wire"``
    #: (asyncload's own HTTP/1.1 range reader: bodies land straight in the destination),
    #: ``"obstore"`` (Rust ``object_store``), ``"fsspec"`` (s3fs, gcsfs, aiohttp), or
    #: ``"auto"``: wire when every ``storage_options`` entry maps onto it and its credentials
    #: are static (or none), else obstore when it is installed and they map onto it, else
    #: fsspec (docs/remote.md#transport). Other protocols always use fsspec.
    transport: Literal["auto", "obstore", "fsspec", "wire"] = "auto"
    #: The most bytes a load reads per byte its destinations need, with ``verify=False``
    #: (header probes and gaps read through included): a rank that needs a slice of each
    #: saved tensor reads gaps only while they fit this bound, cheapest first, and only those
    #: a cost model (the store's per-request latency x bandwidth) prices below one more
    #: request. ``None``: no bound, gaps up to ``min_chunk_size`` read through (docs/tuning.md).
    max_over_read_ratio: float | None = 1.15
    #: Globals the user trusts in the checkpoint's objects beyond asyncload's allow-list
    #: (tensors, containers, numpy data...), as torch's ``torch.serialization.add_safe_globals``:
    #: classes or functions, or ``"module.qualname"`` strings (imported only when a pickle names
    #: them). A listed class may be created and filled (``__setstate__``, else its ``__dict__``
    #: and slots), a listed function called, with the pickle's arguments: their code runs.
    #: Applies to every object decode (DCP objects, torch.save files), never to ``.metadata``.
    #: Stored as a tuple; any iterable is accepted.
    safe_globals: tuple[type | Callable[..., Any] | str, ...] = ()
    #: Multi-rank loads: a rank that has waited this many seconds on other ranks (at a
    #: barrier, for a peer's bytes) without progress of its own logs a WARNING
    #: (``asyncload.monitor``) naming the slowest of them, with the files and byte ranges
    #: they have in flight and for how long; again at most this often while the wait lasts.
    #: ``None`` = never (docs/distributed.md#watching-a-multi-rank-load).
    late_rank_log_after: float | None = 60.0
    #: Multi-rank loads (``asyncload.load``/``aload``/``start_load``) on a group with a CPU
    #: backend (gloo): ``.metadata`` is read by the group's rank 0 alone and its bytes are
    #: broadcast, with its listing of the data files (one request of each for the job instead
    #: of one per rank; every rank decodes the bytes with the allow-list). Each rank chooses
    #: whether it uses them: ``"auto"`` for a remote checkpoint (S3, GCS, HTTP...) that names
    #: a directory; ``True`` also for a local one (a shared file system); ``False`` never (it
    #: reads its own). A rank whose checkpoint URL differs from rank 0's reads its own
    #: (docs/distributed.md#metadata-read-once).
    share_metadata: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        def bad(field: str, value: object, want: str) -> None:
            raise ValueError(f"LoadOptions.{field}={value!r} is invalid: {want}")

        cs = self.chunk_size
        if (
            (self.min_chunk_size is None or isinstance(self.min_chunk_size, _Derived))
            and isinstance(cs, int)
            and not isinstance(cs, bool)
            and cs > 0
        ):
            object.__setattr__(self, "min_chunk_size", _Derived(min(DEFAULT_MIN_CHUNK_SIZE, cs)))

        for name in ("chunk_size", "min_chunk_size", "memory_budget", "max_metadata_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(name, v, "expected a positive int (bytes)")
        if self.min_chunk_size is not None and self.min_chunk_size > self.chunk_size:
            bad(
                "min_chunk_size",
                self.min_chunk_size,
                f"must not exceed chunk_size={self.chunk_size}",
            )
        if self.memory_budget < MIN_MEMORY_BUDGET:
            bad("memory_budget", self.memory_budget, f"must be at least {MIN_MEMORY_BUDGET} bytes")
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
            or math.isinf(self.timeout)
        ):
            bad("timeout", self.timeout, "expected a positive number of seconds or None")
        if not isinstance(self.share_metadata, bool) and self.share_metadata != "auto":
            bad("share_metadata", self.share_metadata, "expected True, False or 'auto'")
        ct = self.collective_timeout
        if ct is not None and (
            isinstance(ct, bool)
            or not isinstance(ct, (int, float))
            or not ct > 0
            or math.isinf(ct)
        ):
            bad("collective_timeout", ct, "expected a positive number of seconds or None")
        la = self.late_rank_log_after
        if la is not None and (
            isinstance(la, bool)
            or not isinstance(la, (int, float))
            or not la > 0
            or math.isinf(la)
        ):
            bad("late_rank_log_after", la, "expected a positive number of seconds or None")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            bad("retries", self.retries, "expected an int >= 0")
        for name in ("backoff", "max_backoff", "hedge_min_delay"):
            v = getattr(self, name)
            if v is None and name == "hedge_min_delay":
                continue  # derived from the load's measurements
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                bad(
                    name,
                    v,
                    "expected a number of seconds >= 0"
                    + (" or None" if name == "hedge_min_delay" else ""),
                )
        if (
            isinstance(self.hedge_factor, bool)
            or not isinstance(self.hedge_factor, (int, float))
            or not self.hedge_factor >= 1
        ):
            bad("hedge_factor", self.hedge_factor, "expected a number >= 1")
        c = self.concurrency
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            bad("concurrency", c, 'expected an int >= 1 or "auto"')
        if not isinstance(self.local_mapped_copies, bool):
            bad("local_mapped_copies", self.local_mapped_copies, "expected True or False")
        if self.io_threads is not None and (
            isinstance(self.io_threads, bool)
            or not isinstance(self.io_threads, int)
            or self.io_threads < 1
        ):
            bad("io_threads", self.io_threads, "expected an int >= 1 or None")
        r = self.max_over_read_ratio
        if r is not None and (
            isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 1 or math.isinf(r)
        ):
            bad("max_over_read_ratio", r, "expected a finite number >= 1 or None (no bound)")
        if self.transport not in ("auto", "obstore", "fsspec", "wire"):
            bad("transport", self.transport, 'expected "auto", "obstore", "fsspec" or "wire"')
        object.__setattr__(self, "safe_globals", _check_safe_globals(self.safe_globals))
        for name in (
            "verify",
            "hedge",
            "allow_dtype_cast",
            "strict_unexpected_keys",
            "use_uvloop",
        ):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "expected a bool")

    @functools.cached_property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
            max_backoff=self.max_backoff,
        )

    @functools.cached_property
    def hedge_policy(self) -> HedgePolicy:
        return HedgePolicy(
            enabled=self.hedge,
            factor=self.hedge_factor,
            min_delay=DEFAULT_HEDGE_MIN_DELAY
            if self.hedge_min_delay is None
            else self.hedge_min_delay,
            max_in_flight=max(2, self.max_in_flight // 4),
            derived=self.hedge_min_delay is None,
        )

    @functools.cached_property
    def chunk_policy(self) -> ChunkPolicy:
        assert self.min_chunk_size is not None  # derived in __post_init__
        return ChunkPolicy(
            chunk_size=self.effective_chunk_size, min_chunk_size=self.min_chunk_size
        )

    @property
    def effective_chunk_size(self) -> int:
        """``chunk_size`` clamped so that one chunk always fits in the budget."""
        return min(self.chunk_size, self.memory_budget)

    @property
    def max_in_flight(self) -> int:
        """The most reads in flight: the fixed ``concurrency``, or the ceiling for ``"auto"``."""
        return 64 if self.concurrency == "auto" else int(self.concurrency)

    @property
    def initial_concurrency(self) -> int:
        return 8 if self.concurrency == "auto" else int(self.concurrency)

    def replace(self, **changes: object) -> LoadOptions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
