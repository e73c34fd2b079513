"""LoadOptions: every knob of a load, validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

__all__ = [
    "CheckPolicy",
    "ChunkPolicy",
    "GiB",
    "HedgePolicy",
    "KiB",
    "LoadOptions",
    "MiB",
    "RetryPolicy",
]

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
class CheckPolicy:
    """What a load checks of the checkpoint and refuses (``LoadOptions``' fields of the same
    names): the CRC-32 of each tensor record, lossy casts, unexpected keys, the size of a
    header or object, the bytes read per byte needed, the globals an object may name."""

    verify: bool
    allow_dtype_cast: bool
    strict_unexpected_keys: bool
    #: Largest ``.metadata`` / header / object accepted, bytes.
    max_metadata_size: int
    max_over_read_ratio: float | None
    safe_globals: tuple[type | Callable[..., Any] | str, ...]


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
    min_chunk_size: int | None = _Derived(DEFAULT_MIN_CHUNK_SIZE)
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
    #: Check the CRC-32 torch stores for each tensor record against the bytes read. Off by
    #: default (it costs more than 5% of a local load): a flipped byte inside tensor data is
    #: then not caught; sizes, offsets and headers are always checked (docs/integrity.md).
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
    #: 1 s before any history). A number is a fixed floor, in seconds.
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
    #: ``"fsspec"`` (s3fs, gcsfs, aiohttp), or ``"auto"``: wire when every
    #: ``storage_options`` entry maps onto it, else fsspec, which ``LoadStats.transport`` and
    #: a log line report (docs/remote.md#transport). Other protocols always use fsspec.
    #: ``"obstore"`` is deprecated: it warns and reads as ``"auto"``.
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
            bad("transport", self.transport, 'expected "auto", "wire" or "fsspec"')
        if self.transport == "obstore":  # retired: warned here, in the caller's own code
            warnings.warn(
                'LoadOptions.transport="obstore" is deprecated: obstore is no longer used, and '
                '"obstore" reads as "auto" does (wire for s3://, gs:// and http(s)://, fsspec '
                'otherwise); pass transport="auto" (or "wire" / "fsspec")',
                DeprecationWarning,
                stacklevel=_caller_level(),
            )
            object.__setattr__(self, "transport", "auto")
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


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside asyncload and dataclasses (the caller's
    ``LoadOptions(...)`` or ``.replace(...)``), for a warning shown where it was asked for."""
    import sys
    import types

    here = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the package
    frame: types.FrameType | None = sys._getframe(2)  # level 1 is __post_init__
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(here) or name == "<string>" or name == dataclasses.__file__):
            return level
        frame, level = frame.f_back, level + 1
    return level


def _suggest_fields(cls: type, init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (a dataclass's ``__init__``) raising, for a keyword that is not a field of
    ``cls``, a ``TypeError`` that names the closest field (``concurency`` -> ``concurrency``)
    and lists them all. The signature stays the dataclass's (``__wrapped__``)."""
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in names]
        if unknown and not args:
            import difflib

            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1, cutoff=0.6)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(
                f"{cls.__name__} has no field {', '.join(hints)}; its fields are "
                f"{', '.join(names)}"
            )
        init(self, *args, **kwargs)

    return __init__


LoadOptions.__init__ = _suggest_fields(LoadOptions, LoadOptions.__init__)  # type: ignore[method-assign]


class FieldDoc(NamedTuple):
    """One field: what it is, its unit (``"bytes"``, ``"seconds"``, ``"count"``, ...), and
    when to change it (options; ``""`` for a counter)."""

    meaning: str
    unit: str
    change: str = ""


def _show(value: Any, unit: str) -> str:
    if unit == "bytes" and isinstance(value, int) and not isinstance(value, bool) and value:
        for size, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value % size == 0:
                return f"{int(value)} ({value // size} {name})"
    if isinstance(value, int) and not isinstance(value, bool):
        return repr(int(value))
    return repr(value)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    """The field's default as the signature shows it (its factory called)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _render(cls: type, base: str | None, docs: dict[str, FieldDoc], heading: str) -> str:
    """``base`` (the class docstring) followed by a section ``heading``: every dataclass field
    of ``cls`` with its meaning, unit, default and when to change it, in the fields' order."""
    import textwrap

    # indented as the class docstring's own lines, so that inspect.cleandoc keeps the layout
    lines = [heading, "-" * len(heading)]
    for f in dataclasses.fields(cls):
        doc = docs.get(f.name)
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", f.type)
        lines.append(f"{f.name}: {type_name} = {_show(_default_of(f), doc.unit if doc else '')}")
        if doc is None:
            lines.append("    (undocumented)")
            continue
        text = [f"{doc.meaning} Unit: {doc.unit}."]
        if doc.change:
            text.append(f"When to change it: {doc.change}")
        for t in text:
            lines += textwrap.wrap(t, 88, initial_indent="    ", subsequent_indent="    ")
    body = "\n".join("    " + line for line in lines)
    return (base or "").rstrip() + "\n\n" + body + "\n"


class FieldsDoc:
    """A dataclass's ``__doc__``: its docstring followed by every field's meaning, unit,
    default and when to change it (``docs``), rendered on the first read (by ``help()``), so
    that ``import asyncload`` does not pay for it. A field without an entry in ``docs`` is
    shown as undocumented (tests/engine/test_options.py and test_stats.py fail on it)."""

    def __init__(self, base: str | None, docs: dict[str, FieldDoc], heading: str) -> None:
        self._base, self.docs, self._heading = base, docs, heading
        self._text: str | None = None

    def __get__(self, obj: object, cls: type | None = None) -> str:
        if self._text is None:
            owner = cls if cls is not None else type(obj)
            self._text = _render(owner, self._base, self.docs, self._heading)
        return self._text


OPTION_DOCS: dict[str, FieldDoc] = {
    "chunk_size": FieldDoc(
        "The largest single read request; larger byte ranges are split into reads of this size "
        "that run concurrently. Clamped to memory_budget so one chunk always fits.",
        "bytes",
        "smaller (4-8 MiB) for a store with slow streams, so more reads run at once; larger "
        "(64 MiB) for a fast local disk or a store that charges per request.",
    ),
    "min_chunk_size": FieldDoc(
        "Neighbouring reads smaller than this are coalesced into one request (the gaps between "
        "them, up to this size, are read and thrown away). Not given: 1 MiB, or chunk_size when "
        "that is smaller (derived again when chunk_size is replaced).",
        "bytes",
        "larger on a store with high per-request latency and many small tensors; smaller when "
        "the gaps between wanted tensors are large and bandwidth is dear.",
    ),
    "timeout": FieldDoc(
        "Seconds allowed for one attempt at one chunk, extended while bytes keep arriving; "
        "None = no limit.",
        "seconds",
        "longer on a slow link where a whole chunk cannot arrive in 30 s.",
    ),
    "collective_timeout": FieldDoc(
        "Multi-rank loads: how long a rank may go without progress before the other ranks give "
        "up on it and raise DistributedLoadError naming it; None = wait forever.",
        "seconds",
        "longer when ranks legitimately stall (a slow shared file system, a long first compile).",
    ),
    "retries": FieldDoc(
        "Extra attempts at a chunk after its first failed one (0 = no retry).",
        "count",
        "higher for a flaky store; 0 to see the first failure at once.",
    ),
    "backoff": FieldDoc(
        "First delay before a retry; doubles per attempt, with full jitter.",
        "seconds",
        "higher when a store throttles (HTTP 503 SlowDown) and retries come too fast.",
    ),
    "max_backoff": FieldDoc(
        "Longest delay between two attempts.", "seconds", "with backoff, for a throttling store."
    ),
    "concurrency": FieldDoc(
        'Reads in flight at once, or "auto" to let the pipeline find its level (8 to start, at '
        "most 64).",
        "count",
        '"auto" or a higher number for a remote store far away (latency x bandwidth needs many '
        "reads in flight); lower for a disk that slows down under parallel reads.",
    ),
    "memory_budget": FieldDoc(
        "Hard bound on bytes read but not yet assembled into the destination (LoadStats."
        "peak_buffered_bytes never exceeds it).",
        "bytes",
        "lower on a machine short of memory; higher when LoadStats shows waits for memory "
        "budget (full) on a fast store.",
    ),
    "verify": FieldDoc(
        "Check the CRC-32 torch stores for each tensor record (DCP's default .distcp files, "
        "torch.save files) against the bytes read, every byte of such a record read "
        "(LoadStats.verified_records counts them). Off, a flipped byte inside tensor data "
        "loads as it is; sizes, offsets and headers are checked either way. safetensors "
        "stores no checksum: nothing to check there (docs/integrity.md).",
        "bool",
        "True when the storage may hand back damaged bytes and a checksum pass is affordable "
        "(30-50% more CPU on a local load here: docs/performance.md).",
    ),
    "hedge": FieldDoc(
        "Re-issue a remote chunk that is much slower than its peers (one duplicate request; the "
        "first answer wins).",
        "bool",
        "False where duplicate requests cost money or the store is local.",
    ),
    "hedge_factor": FieldDoc(
        "A chunk becomes a straggler after max(floor, hedge_factor x p90 latency) of recent "
        "comparable reads (docs/remote.md).",
        "ratio (>= 1)",
        "higher to hedge less often on a store whose latency varies widely.",
    ),
    "hedge_min_delay": FieldDoc(
        "Floor for the hedge delay. None: derived from this load's measured first-byte latency "
        "and per-stream rate (at least 0.05 s; 1 s before any history).",
        "seconds",
        "a number for a fixed floor (e.g. 0.5).",
    ),
    "allow_dtype_cast": FieldDoc(
        "Allow lossy dtype conversions on load (fp32 into bf16, float into int: cast on copy). "
        "Lossless widening loads without it.",
        "bool",
        "True when the destination's dtype differs on purpose (a bf16 model from an fp32 "
        "checkpoint).",
    ),
    "strict_unexpected_keys": FieldDoc(
        "Raise when the checkpoint holds keys the destination lacks (they are always listed in "
        "LoadStats.unexpected_keys).",
        "bool",
        "True to catch a destination that lost layers by mistake.",
    ),
    "use_uvloop": FieldDoc(
        "Run the event loop on uvloop when it is installed (remote loads import it on first use; "
        "local loads only when the program has imported it).",
        "bool",
        "False to rule uvloop out while debugging the loop.",
    ),
    "io_threads": FieldDoc(
        "Threads for local positional reads and assembly copies. None: from concurrency.",
        "count",
        "set it when local loads share the machine with other work and should use fewer cores.",
    ),
    "local_mapped_copies": FieldDoc(
        "Copy a large local read that 4 KiB aliasing would slow down out of a short-lived "
        "mapping of the file's cached pages (Linux 6.5+; falls back to preadv by itself).",
        "bool",
        "False to force preadv for every local read (docs/performance.md).",
    ),
    "max_metadata_size": FieldDoc(
        "Largest .metadata file or format header accepted (a guard against hostile input).",
        "bytes",
        "higher only for a checkpoint with an enormous number of keys that is refused.",
    ),
    "transport": FieldDoc(
        'The client for s3://, gs://, gcs:// and http(s)://: "wire" (asyncload\'s own HTTP/1.1 '
        'range reader), "fsspec" (s3fs, gcsfs, aiohttp), "obstore" (deprecated), or "auto": wire '
        "where every storage_options entry maps onto it (docs/remote.md#transport).",
        "name",
        '"fsspec" for a store or option only fsspec understands; leave "auto" otherwise.',
    ),
    "max_over_read_ratio": FieldDoc(
        "The most bytes a load reads per byte its destinations need (gaps read through to save "
        "requests count); None: no bound (docs/tuning.md).",
        "ratio (>= 1)",
        "lower when bandwidth is dear; None when requests are dearer than bytes.",
    ),
    "safe_globals": FieldDoc(
        "Classes, functions or 'module.qualname' strings the user trusts in the checkpoint's "
        "pickled objects beyond asyncload's allow-list, as torch.serialization.add_safe_globals "
        "(their code runs).",
        "tuple of globals",
        "add the class an UnsafeCheckpointError names, once you trust the checkpoint.",
    ),
    "late_rank_log_after": FieldDoc(
        "Multi-rank loads: after this long waiting on other ranks, a WARNING names the slowest "
        "and what it has in flight; None = never.",
        "seconds",
        "lower to hear about stragglers sooner; None to silence it.",
    ),
    "share_metadata": FieldDoc(
        "Multi-rank loads on a CPU (gloo) group: .metadata read by rank 0 alone and broadcast. "
        '"auto": for a remote checkpoint; True: also a local one; False: every rank reads its own.',
        'bool or "auto"',
        "True on a shared file system that suffers from many ranks opening one file.",
    ),
}


LoadOptions.__doc__ = FieldsDoc(  # type: ignore[assignment]
    LoadOptions.__doc__, OPTION_DOCS, "Fields (meaning, unit, default, when to change it)"
)
