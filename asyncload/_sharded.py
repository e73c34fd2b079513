"""Loading across ranks: a collective driver whose every wait is bounded, and
:class:`ShardedLoadPlanner`, which reads each byte range once and shares it over the
process group.

How a multi-rank load runs (``asyncload.load`` with ``torch.distributed`` initialised)::

    every rank                      coordinator (group rank 0)
    read .metadata, local plan  --> gather plans --> create_global_plan
    <-- scatter plans -------------------------------'
    read_data(final plan)
       PipelinedLoadPlanner: each rank reads the byte ranges its own shards need
       ShardedLoadPlanner:   per phase (record headers, then tensor data):
           all_gather(needed byte ranges)  -> the same plan_transfers() on every rank:
           a range two or more ranks need is read by one of them (bytes balanced)
           and sent to the others point to point, chunk by chunk, as reads land
    barrier "done"

Every wait on another rank goes through a :class:`_Monitor`: a few keys in the
process group's store hold each rank's status ("reading data: 12 of 40 chunks"), its
failure if it had one, and barrier arrivals. A rank that raises posts its error there
at once and every other rank raises :class:`DistributedLoadError` naming it; a rank
that makes no progress for ``collective_timeout`` seconds is declared stalled by the
first rank waiting on it, and every rank raises an error naming it and its last
status. Collectives themselves (gather/scatter of plans, all_gather of needs) are only
entered once a monitored barrier has seen every rank arrive, so they cannot hang on a
rank that has already failed.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from ._dcp import PipelinedLoadPlanner, PipelinedReader
from ._errors import AsyncLoadError, DistributedLoadError
from ._options import LoadOptions
from ._pipeline import Chunk, Pipeline, _assemble, _track, copy_bytes
from ._retry import fetch_with_retry
from ._stats import _fmt_bytes

__all__ = ["ShardedLoadPlanner", "Transfer", "plan_transfers", "collective_load"]

log = logging.getLogger("asyncload.sharded")

_UNSET: Any = object()

#: Seconds between checks for another rank's failure while reading.
_WATCH_INTERVAL = 0.1
#: Longest sleep between polls of a barrier.
_MAX_POLL = 0.05
#: Seconds between stall checks and heartbeats while waiting on another rank.
_BEAT_INTERVAL = 1.0
#: Status updates during reading are written at most this often.
_PROGRESS_INTERVAL = 0.5
#: Point-to-point tags: ``(load sequence % _TAG_LOADS) * _TAG_SPAN + transfer index``.
_TAG_SPAN = 2_000_000
_TAG_LOADS = 1000


class ShardedLoadPlanner(PipelinedLoadPlanner):
    """A :class:`PipelinedLoadPlanner` for multi-rank loads that reads every byte once.

    Before each read phase the ranks all-gather the byte ranges they need; every range
    that two or more ranks need is then read from storage by exactly one of them (chosen
    to balance bytes read per rank) and sent to the others over the process group, chunk
    by chunk as reads land, within ``memory_budget``. With 4 ranks loading a replicated
    model, the ranks together read the checkpoint about once instead of 4 times.

    ``process_group``: the group the load runs on (default: the world). ``asyncload.load``
    fills it in from its own ``process_group`` argument; with ``dcp.load`` on a subgroup,
    pass the same group here. ``collective_timeout``: seconds a rank may go without
    progress before the others give up on it (overrides ``LoadOptions.collective_timeout``).
    ``ordered``: issue the transfers between two ranks in one agreed order on both sides
    (needed by backends that match sends to receives by order, not by tag: ``None`` turns it
    on for NCCL only). Other keyword arguments are those of :class:`PipelinedLoadPlanner`.
    """

    def __init__(self, *, process_group: Any = None, collective_timeout: float | None = _UNSET,
                 ordered: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ordered = ordered
        if collective_timeout is not _UNSET:
            # validated like the LoadOptions field
            dataclasses.replace(self.options, collective_timeout=collective_timeout)
        self.process_group = process_group
        self._collective_timeout = collective_timeout

    def collective_timeout_for(self, options: LoadOptions) -> float | None:
        """This planner's ``collective_timeout`` if it was given one, else the options'."""
        return options.collective_timeout if self._collective_timeout is _UNSET else self._collective_timeout

    def plan_transfers(self, needs: Sequence[Sequence[tuple[str, int, int]]]) -> tuple[list[Transfer], list[int]]:
        """Who reads which shared bytes: an extension point. Called on every rank, between
        the all-gather of ``needs`` and the reads, once per read phase; every rank must
        return the same answer for the same ``needs``.

        ``needs[r]``: the byte ranges ``(file, start, end)`` group rank ``r`` needs. Return
        the transfers (see :func:`plan_transfers`, which this default calls) and the bytes
        each rank reads. An override may choose other owners (``dataclasses.replace(t,
        owner=...)`` with ``owner in t.consumers``: ranks on a faster link, or fewer
        readers) but must keep the transfers' ranges, consumers and order; that is checked.
        """
        return plan_transfers(needs)

    def share_session(self, reader: PipelinedReader, options: LoadOptions) -> "_ShareSession | None":
        """The reader's hook: a session that takes over this rank's reads, or None when
        there is nobody to share with (no process group, or a group of one)."""
        group = self.process_group if self.process_group is not None else getattr(reader, "_asyncload_group", None)
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size(group) <= 1:
            return None
        monitor = getattr(reader, "_asyncload_monitor", None)
        if monitor is None or monitor.group is not group:
            monitor = _Monitor(group, self.collective_timeout_for(options))
        return _ShareSession(group, monitor, options, ordered=self.ordered, plan=self.plan_transfers)


# --- the monitor: status, failures and barriers through the process group's store ----------


def _group_store(group: Any) -> Any:
    pg = group if group is not None else dist.group.WORLD
    try:
        return dist.distributed_c10d._get_process_group_store(pg)
    except Exception as exc:  # noqa: BLE001 - a group without a store
        raise DistributedLoadError(
            f"asyncload needs the process group's store to coordinate a multi-rank load and this group has none "
            f"({type(exc).__name__}: {exc})") from exc


_seq_lock = threading.Lock()
_seq: dict[str, int] = {}
_previous_keys: dict[str, tuple[Any, list[str]]] = {}


def _group_name(group: Any) -> str:
    pg = group if group is not None else dist.group.WORLD
    return str(getattr(pg, "group_name", "") or dist.distributed_c10d._get_process_group_name(pg))


def _next_seq(group: Any) -> tuple[str, int]:
    name = _group_name(group)
    with _seq_lock:
        n = _seq.get(name, 0)
        _seq[name] = n + 1
    return name, n


def _remote_error(value: bytes | str) -> DistributedLoadError:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    rank_s, _, rest = text.partition("|")
    doing, _, message = rest.partition("|")
    try:
        rank: int | None = int(rank_s)
    except ValueError:
        rank, doing, message = None, "", text
    err = DistributedLoadError(message, rank=rank, doing=doing)
    err._asyncload_posted = True  # type: ignore[attr-defined]
    return err


class _GuardedStore:
    """The group's store, with its failures (the rank hosting it exited, the connection
    broke) raised as DistributedLoadError."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._store, name)(*args)
        except RuntimeError as exc:
            raise DistributedLoadError(
                f"rank {self._rank} lost the process group's store ({type(exc).__name__}: {str(exc)[:300]}); "
                "the rank that hosts it (the rendezvous master, usually rank 0) has probably exited or "
                "crashed", doing="hosting the store") from exc

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)  # type: ignore[no-any-return]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)  # type: ignore[no-any-return]

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)  # type: ignore[no-any-return]


class _Monitor:
    """One load's view of the other ranks, through a few keys in the group's store.

    ``st/<r>``: rank r's status, ``"<counter>|<text>"`` (the counter moves on progress,
    phase changes and, while r waits on others, once a second); ``at/<barrier>/<r>``:
    ``arrived`` or, when r was given up on, ``aborted`` (set with compare-and-set so a
    rank cannot arrive after the others left without it); ``abort``: the first failure,
    ``"<rank>|<doing>|<message>"``, which every rank raises.
    """

    def __init__(self, group: Any, timeout: float | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        self.group_name, self.seq = _next_seq(group)
        self.store = _GuardedStore(dist.PrefixStore(f"asyncload/{self.seq}/", _group_store(group)), self.rank)
        self._lock = threading.Lock()
        self._counter = 0
        self._text = ""
        self._last_write = 0.0
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._status_cache: dict[int, tuple[bytes, float]] = {}
        self._written: list[str] = []
        #: Set from another thread to stop waiting (LoadHandle.cancel).
        self.cancelled: threading.Event | None = None
        with _seq_lock:
            # the previous load's keys go once every rank has passed this load's first barrier
            self._to_delete = _previous_keys.get(self.group_name)
            _previous_keys[self.group_name] = (self.store, self._written)
        self.status("starting the load")

    # --- this rank's status ---------------------------------------------------------------

    def _write_status(self) -> None:
        key = f"st/{self.rank}"
        try:
            self.store.set(key, f"{self._counter}|{self._text}")
        except Exception:  # noqa: BLE001 - status is best effort; a dead store shows up elsewhere
            log.debug("could not write status", exc_info=True)
        self._last_write = time.monotonic()
        if key not in self._written:
            self._written.append(key)

    def status(self, text: str) -> None:
        """Say what this rank is doing now (also counts as progress)."""
        log.debug("rank %d: %s", self.rank, text)
        with self._lock:
            self._counter += 1
            self._text = text
            self._write_status()

    @property
    def doing(self) -> str:
        return self._text

    def progress(self, detail: str | None = None) -> None:
        """Count progress (rate-limited store write)."""
        with self._lock:
            self._counter += 1
            if detail is not None:
                self._text = detail
            if time.monotonic() - self._last_write >= _PROGRESS_INTERVAL:
                self._write_status()

    def beat(self) -> None:
        """A heartbeat while this rank waits on others: it is alive, not stalled."""
        with self._lock:
            if time.monotonic() - self._last_write >= _BEAT_INTERVAL:
                self._counter += 1
                self._write_status()

    # --- failures -------------------------------------------------------------------------

    def fail(self, exc: BaseException, doing: str) -> None:
        """Post this rank's failure (or a peer's that this rank found, such as a broken
        connection) so that every other rank raises at once."""
        if getattr(exc, "_asyncload_posted", False):
            return  # read from the store, or posted when it was raised
        if isinstance(exc, DistributedLoadError) and exc.rank is not None and exc.rank != self.rank:
            value = f"{exc.rank}|{exc.doing}|{exc}"  # a peer's failure this rank saw first
        else:
            kind = "the load was cancelled" if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)) \
                else f"{type(exc).__name__}: {exc}"
            value = f"{self.rank}|{doing}|rank {self.rank} failed while {doing}: {kind}"
        self._written.append("abort")
        try:
            self.store.compare_set("abort", "", value[:4000])
            exc._asyncload_posted = True  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the peers will see a stall instead
            log.warning("could not post this rank's failure to the other ranks", exc_info=True)
        self.status(f"failed while {doing}")

    def check(self) -> None:
        """Raise DistributedLoadError if any rank failed or was given up on."""
        if self.store.check(["abort"]):
            raise _remote_error(self.store.get("abort"))

    def _give_up(self, rank: int, barrier: str | None, idle: float, status: str, doing: str) -> None:
        """Declare ``rank`` stalled (unless it arrives at ``barrier`` right now) and raise."""
        if barrier is not None:
            got = self.store.compare_set(f"at/{barrier}/{rank}", "", "aborted")
            if got == b"arrived":
                return
        self._written.append("abort")
        what = status or "it had not started the load"
        message = (f"rank {rank} made no progress for {idle:.1f} s (LoadOptions.collective_timeout="
                   f"{self.timeout}); its last status: {what}; rank {self.rank} gave up on it while {doing}")
        self.store.compare_set("abort", "", f"{rank}|{what}|{message}")
        self.check()
        raise DistributedLoadError(message, rank=rank, doing=what)  # pragma: no cover - check() raised

    def _status_of(self, rank: int) -> bytes:
        key = f"st/{rank}"
        if not self.store.check([key]):
            return b""
        return self.store.get(key)

    def idle_peer(self, peers: Sequence[int]) -> tuple[int, float, str] | None:
        """A peer whose status has not changed for ``timeout`` seconds, with its idle time and status."""
        if self.timeout is None:
            return None
        now = time.monotonic()
        for r in peers:
            cached = self._status_cache.get(r)
            if cached is not None and now - cached[1] < 0.5 * _BEAT_INTERVAL:
                value = cached[0]
            else:
                value = self._status_of(r)
                self._status_cache[r] = (value, now)
            seen = self._seen.get(r)
            if seen is None or seen[0] != value:
                self._seen[r] = (value, now)
                continue
            idle = now - seen[1]
            if idle >= self.timeout:
                return r, idle, value.decode("utf-8", "replace").partition("|")[2]
        return None

    # --- barriers -------------------------------------------------------------------------

    def _arrive(self, name: str) -> list[str]:
        key = f"at/{name}/{self.rank}"
        got = self.store.compare_set(key, "", "arrived")
        self._written.append(key)
        if got != b"arrived":
            self.check()
            raise DistributedLoadError(f"rank {self.rank} arrived at {name!r} after the other ranks gave up on it",
                                       rank=self.rank, doing=name)
        return [f"at/{name}/{r}" for r in range(self.world)]

    def _poll(self, name: str, keys: list[str], doing: str, state: dict[str, float]) -> bool:
        if self.cancelled is not None and self.cancelled.is_set():
            raise asyncio.CancelledError()
        self.check()
        if self.store.check(keys):
            values = self.store.multi_get(keys)
            if all(v == b"arrived" for v in values):
                return True
            self.check()
            raise DistributedLoadError(f"the ranks gave up at {name!r}")  # pragma: no cover - abort is set first
        now = time.monotonic()
        if now - state.get("stall", 0.0) >= _BEAT_INTERVAL:
            state["stall"] = now
            self.beat()
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            idle = self.idle_peer(missing)
            if idle is not None:
                rank, seconds, status = idle
                self._give_up(rank, name, seconds, status, doing)
        return False

    def _passed(self) -> None:
        """After the first barrier every rank has finished the previous load: drop its keys."""
        prev, self._to_delete = self._to_delete, None
        if prev is not None:
            store, keys = prev
            for k in set(keys):
                try:
                    store.delete_key(k)
                except Exception:  # noqa: BLE001 - cleanup is best effort
                    break

    def barrier(self, name: str, doing: str) -> None:
        """Wait (caller's thread) until every rank arrives; raise on a failure or a stall."""
        self.status(doing)
        keys = self._arrive(name)
        state: dict[str, float] = {"stall": time.monotonic()}
        delay = 0.0005
        while not self._poll(name, keys, doing, state):
            time.sleep(delay)
            delay = min(_MAX_POLL, delay * 2)
        self._passed()

    async def abarrier(self, name: str, doing: str) -> None:
        """:meth:`barrier` for the event loop."""
        self.status(doing)
        keys = self._arrive(name)
        state: dict[str, float] = {"stall": time.monotonic()}
        delay = 0.0005
        while not self._poll(name, keys, doing, state):
            await asyncio.sleep(delay)
            delay = min(_MAX_POLL, delay * 2)
        self._passed()

    async def wait_on(self, fut: asyncio.Future[Any], peers: Sequence[int], doing: str) -> Any:
        """Await ``fut`` (an exchange with ``peers``); raise if one of them stalls."""
        while True:
            done, _ = await asyncio.wait({fut}, timeout=_BEAT_INTERVAL)
            if done:
                return fut.result()
            self.beat()
            idle = self.idle_peer(peers)
            if idle is not None:
                rank, seconds, status = idle
                self._give_up(rank, None, seconds, status, doing)

    async def watch(self) -> None:
        """Raise as soon as any rank posts a failure (runs beside the reads)."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            self.check()


# --- the plan: who reads which bytes -------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """Bytes ``[start, end)`` of file ``name`` that several ranks need: ``owner`` reads
    them from storage and sends them to the other ``consumers`` (group ranks)."""

    index: int
    name: str
    start: int
    end: int
    owner: int
    consumers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_transfers(needs: Sequence[Sequence[tuple[str, int, int]]]) -> tuple[list[Transfer], list[int]]:
    """Which rank reads which shared bytes. Pure and deterministic: every rank computes
    the same answer from the same all-gathered ``needs``.

    ``needs[r]`` lists the half-open byte ranges ``(file, start, end)`` rank ``r`` needs;
    one rank's ranges do not overlap (they may touch). Returns the transfers, in global
    order (by file, then offset), and the bytes each rank will read from storage.

    Every byte that two or more ranks need is in exactly one transfer; its owner is one of
    the ranks that need it, chosen greedily (largest transfers first, to the consumer with
    the fewest bytes so far) to balance bytes read per rank. A transfer never crosses a
    range boundary of any of its consumers, so it lands inside one read request of each.
    """
    world = len(needs)
    load = [0] * world
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for r, ranges in enumerate(needs):
        for name, start, end in ranges:
            if end > start:
                by_file.setdefault(name, []).append((start, end, r))
    runs: list[tuple[str, int, int, tuple[int, ...]]] = []
    for name in sorted(by_file):
        events: dict[int, list[tuple[int, int]]] = {}
        for start, end, r in by_file[name]:
            events.setdefault(start, []).append((r, 1))
            events.setdefault(end, []).append((r, -1))
        points = sorted(events)
        active: dict[int, int] = {}
        cur: list[Any] | None = None  # [start, end, consumers]
        for i, p in enumerate(points):
            edge = set()
            for r, d in events[p]:
                edge.add(r)
                c = active.get(r, 0) + d
                if c:
                    active[r] = c
                else:
                    active.pop(r, None)
            if i + 1 == len(points):
                break
            q = points[i + 1]
            if not active:
                if cur is not None:
                    runs.append((name, cur[0], cur[1], cur[2]))
                    cur = None
                continue
            consumers = tuple(sorted(active))
            if cur is not None and cur[1] == p and cur[2] == consumers and not edge.intersection(consumers):
                cur[1] = q
                continue
            if cur is not None:
                runs.append((name, cur[0], cur[1], cur[2]))
            cur = [p, q, consumers]
        if cur is not None:
            runs.append((name, cur[0], cur[1], cur[2]))
    shared: list[tuple[str, int, int, tuple[int, ...]]] = []
    for name, start, end, consumers in runs:
        if len(consumers) == 1:
            load[consumers[0]] += end - start
        else:
            shared.append((name, start, end, consumers))
    owners: dict[tuple[str, int], int] = {}
    for name, start, end, consumers in sorted(shared, key=lambda s: (-(s[2] - s[1]), s[0], s[1])):
        owner = min(consumers, key=lambda c: (load[c], c))
        load[owner] += end - start
        owners[(name, start)] = owner
    transfers = [Transfer(i, name, start, end, owners[(name, start)], consumers)
                 for i, (name, start, end, consumers) in enumerate(shared)]
    return transfers, load


def _check_transfers(transfers: Sequence[Transfer], needs: Sequence[Sequence[tuple[str, int, int]]]) -> None:
    """A (custom) plan keeps the rules the reads rely on; raise AsyncLoadError otherwise."""
    for i, t in enumerate(transfers):
        if t.index != i:
            raise AsyncLoadError(f"plan_transfers returned transfer {t} at position {i}: index must be its position")
        if t.owner not in t.consumers or len(t.consumers) < 2:
            raise AsyncLoadError(f"plan_transfers returned {t}: the owner must be one of two or more consumers")
        if i and (transfers[i - 1].name, transfers[i - 1].end) > (t.name, t.start):
            raise AsyncLoadError(f"plan_transfers returned {t} out of order or overlapping the one before")


@dataclass
class _Part:
    """A slice ``[start, end)`` of one of this rank's chunks and where its bytes come from."""

    start: int
    end: int
    #: ``read`` (this rank reads it for itself), ``own`` (reads it and sends it to the
    #: other consumers) or ``recv`` (receives it from the transfer's owner).
    kind: str
    transfer: Transfer | None = None


def _advertise(chunks: Sequence[Chunk]) -> list[tuple[int, int] | None]:
    """The part of each chunk (sorted by file and offset) not already covered by an
    earlier chunk of this rank: what this rank announces it needs. Overlaps (two reads of
    the same bytes on one rank, rare) are read locally again rather than shared."""
    out: list[tuple[int, int] | None] = []
    covered: dict[str, int] = {}
    for c in chunks:
        lo = max(c.start, covered.get(c.name, c.start))
        out.append((lo, c.end) if lo < c.end else None)
        covered[c.name] = max(covered.get(c.name, 0), c.end)
    return out


def _parts_for(chunks: Sequence[Chunk], adv: Sequence[tuple[int, int] | None], transfers: Sequence[Transfer],
               rank: int) -> list[list[_Part] | None]:
    """Split each chunk into parts by source; None for a chunk this rank reads whole."""
    mine: dict[str, list[Transfer]] = {}
    for t in transfers:
        if rank in t.consumers:
            mine.setdefault(t.name, []).append(t)
    starts = {name: [t.start for t in ts] for name, ts in mine.items()}
    out: list[list[_Part] | None] = []
    for c, a in zip(chunks, adv):
        ts = mine.get(c.name)
        if a is None or not ts:
            out.append(None)
            continue
        lo, hi = a
        i = bisect.bisect_left(starts[c.name], lo)
        parts: list[_Part] = []
        pos = c.start
        while i < len(ts) and ts[i].start < hi:
            t = ts[i]
            if t.start < lo or t.end > hi:  # pragma: no cover - plan_transfers never crosses a boundary
                raise AsyncLoadError(f"internal error: transfer {t} crosses a read of rank {rank} [{lo}, {hi})")
            if t.start > pos:
                parts.append(_Part(pos, t.start, "read"))
            parts.append(_Part(t.start, t.end, "own" if t.owner == rank else "recv", t))
            pos = t.end
            i += 1
        if not parts:
            out.append(None)
            continue
        if pos < c.end:
            parts.append(_Part(pos, c.end, "read"))
        out.append(parts)
    return out


# --- moving bytes between ranks ----------------------------------------------------------------


def _transport_kind(group: Any) -> tuple[str, torch.device]:
    """``("thread", cpu)`` for gloo and other CPU backends (waits run in a thread: gloo's
    point-to-point works only complete inside ``wait()``), ``("poll", cuda)`` for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return "thread", torch.device("cpu")
    return "poll", torch.device("cuda", torch.cuda.current_device())


#: Buffers of point-to-point operations abandoned after a failure (NCCL): kept alive until
#: the operation completes, so that a late transfer never writes into freed memory.
_orphans: list[tuple[list[Any], Any]] = []


class _Transport:
    """Point-to-point sends and receives of byte ranges over the process group.

    With NCCL the bytes travel through a CUDA buffer on the caller's current device; with
    ``ordered`` (always for NCCL) the operations between two ranks are issued in transfer
    order on both sides, so that NCCL's in-order matching pairs them correctly.
    """

    def __init__(self, group: Any, *, ordered: bool | None = None) -> None:
        self.group = group
        self.kind, self.device = _transport_kind(group)
        self.ordered = self.kind == "poll" if ordered is None else ordered
        self._turns: dict[int, list[int]] = {}
        self._next: dict[int, int] = {}
        self._cond: asyncio.Condition | None = None

    def set_order(self, transfers: Sequence[Transfer], rank: int) -> None:
        """The transfers this rank takes part in, per peer, in the order both sides issue them."""
        self._turns = {}
        self._next = {}
        for t in transfers:
            if rank not in t.consumers:
                continue
            peers = [c for c in t.consumers if c != rank] if t.owner == rank else [t.owner]
            for p in peers:
                self._turns.setdefault(p, []).append(t.index)
        for p in self._turns:
            self._next[p] = 0

    async def _my_turn(self, peer: int, index: int) -> None:
        if not self.ordered:
            return
        if self._cond is None:
            self._cond = asyncio.Condition()
        turns = self._turns[peer]
        async with self._cond:
            await self._cond.wait_for(lambda: turns[self._next[peer]] == index)

    async def _done_turn(self, peer: int) -> None:
        if not self.ordered:
            return
        assert self._cond is not None
        async with self._cond:
            self._next[peer] += 1
            self._cond.notify_all()

    def _tensor(self, view: memoryview) -> torch.Tensor:
        return torch.frombuffer(view, dtype=torch.uint8)

    async def exchange(self, op: str, peers: Sequence[int], tag: int, index: int, view: memoryview, keep: Any,
                       monitor: _Monitor, doing: str) -> None:
        """Send ``view`` to every rank in ``peers`` (``op="send"``) or receive it from the one
        peer (``op="recv"``), then wait, watching the peers for a stall."""
        loop = asyncio.get_running_loop()
        works: list[Any] = []
        buffers: list[Any] = []
        dev: torch.Tensor | None = None
        current: int | None = None
        try:
            for peer in peers:
                await self._my_turn(peer, index)
                current = peer
                try:
                    if dev is None:
                        cpu = torch.frombuffer(view, dtype=torch.uint8)
                        if self.kind == "poll":
                            dev = cpu.to(self.device) if op == "send" else torch.empty(
                                len(view), dtype=torch.uint8, device=self.device)
                        else:
                            dev = cpu
                        buffers.append(dev)
                    with torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext():
                        if op == "send":
                            works.append(dist.isend(dev, group=self.group, group_dst=peer, tag=tag))
                        else:
                            works.append(dist.irecv(dev, group=self.group, group_src=peer, tag=tag))
                finally:
                    await self._done_turn(peer)
            current = None
            fut: asyncio.Future[None] = loop.create_future()
            if self.kind == "thread":
                _wait_in_thread(works, (buffers, keep), loop, fut)
            else:
                loop.create_task(_poll_works(works, fut))
            await monitor.wait_on(fut, peers, doing)
            if self.kind == "poll" and op == "recv" and dev is not None:
                copy_bytes(view, memoryview(dev.cpu().numpy()))
            works = []
        except BaseException as exc:
            if works and self.kind == "poll":
                _orphans.append((buffers, keep))
            cause: BaseException = exc
            if isinstance(exc, _WorkFailed):
                current, cause = peers[exc.index], exc.cause
            elif current is None and len(peers) == 1:
                current = peers[0]
            if isinstance(cause, RuntimeError) and not isinstance(cause, AsyncLoadError):  # gloo/NCCL: peer gone
                who = f"rank {current}" if current is not None else f"rank(s) {list(peers)}"
                raise DistributedLoadError(f"rank {monitor.rank} lost its connection to {who} while {doing}: "
                                           f"{cause}", rank=current, doing=doing) from cause
            if cause is not exc:
                raise cause from None
            raise


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _WorkFailed(Exception):
    """Work number ``index`` of an exchange raised ``cause``."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(index, cause)
        self.index = index
        self.cause = cause


def _wait_in_thread(works: list[Any], keep: Any, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Wait for gloo works on a daemon thread (it holds ``keep``, the buffers, until they finish)."""

    def settle(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def run() -> None:
        err: BaseException | None = None
        for i, w in enumerate(works):
            try:
                w.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                err = _WorkFailed(i, exc)
                break
        try:
            loop.call_soon_threadsafe(settle, err)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass
        _ = keep

    threading.Thread(target=run, name="asyncload-share-wait", daemon=True).start()


async def _poll_works(works: list[Any], fut: asyncio.Future[None]) -> None:
    """Wait for NCCL works by polling (their ``is_completed`` is non-blocking and exact)."""
    delay = 0.0002
    for i, w in enumerate(works):
        try:
            while not w.is_completed():
                if fut.done():
                    return
                await asyncio.sleep(delay)
                delay = min(0.005, delay * 2)
            w.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            if not fut.done():
                fut.set_exception(_WorkFailed(i, exc))
            return
    if not fut.done():
        fut.set_result(None)


class _SharedPipeline(Pipeline):
    """The reader pool, where a chunk's bytes may come from storage, from another rank, or
    both; bytes this rank owns are sent on as soon as they are read."""

    def __init__(self, base: Pipeline, session: "_ShareSession", parts: dict[int, list[_Part]], tag_base: int,
                 total_chunks: int) -> None:
        super().__init__(base.storage, base.options, base.stats, base.executor, budget=base.budget)
        self.on_progress = base.on_progress
        # chunks for CUDA destinations: unshared ones go through the pinned ring as usual;
        # shared ones are assembled from host memory (the stager bounces them into pinned memory)
        self.staging = base.staging
        self.session = session
        self.parts = parts
        self.tag_base = tag_base
        self.total = total_chunks
        self.done = 0

    async def _read_and_assemble(self, chunk: Chunk) -> None:
        members: list[Chunk] | None = getattr(chunk, "members", None)  # the base pipeline's batch of tiny reads
        if members is not None and any(id(c) in self.parts for c in members):
            async with asyncio.TaskGroup() as tg:
                for c in members:
                    tg.create_task(self._read_and_assemble(c))
            return
        parts = self.parts.get(id(chunk))
        if parts is None:
            await super()._read_and_assemble(chunk)
        else:
            await self._shared(chunk, parts)
        self.done += len(members) if members is not None else 1
        self.session.monitor.progress(f"{self.session.doing}: {self.done} of {self.total} chunks done")

    async def _read_part(self, chunk: Chunk, part: _Part, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        storage = self.storage
        t0 = time.monotonic()
        url = storage.url(chunk.name)
        rng = (part.start, part.end)
        if storage.supports_readinto:
            def into() -> None:
                storage.readinto_sync(chunk.name, part.start, [view])  # type: ignore[attr-defined]

            await fetch_with_retry(lambda: loop.run_in_executor(self.executor, into), options=self.options,
                                   stats=self.stats, url=url, byte_range=rng, hedge=None)
        else:
            raw = await fetch_with_retry(lambda: storage.read(chunk.name, part.start, part.end),
                                         options=self.options, stats=self.stats, url=url, byte_range=rng,
                                         hedge=self.hedge, on_throttle=self._note_throttle)
            copy_bytes(view, memoryview(raw))
        self.stats.add(bytes_read=part.end - part.start, chunks=1, storage_wait_seconds=time.monotonic() - t0)

    async def _part(self, chunk: Chunk, part: _Part, buf: memoryview, state: dict[str, bool]) -> None:
        view = buf[part.start - chunk.start : part.end - chunk.start]
        t = part.transfer
        if part.kind == "read":
            await self._read_part(chunk, part, view)
            return
        assert t is not None
        session = self.session
        tag = self.tag_base + t.index
        where = f"bytes [{t.start}, {t.end}) of {t.name}"
        if part.kind == "own":
            await self._read_part(chunk, part, view)
            peers = [c for c in t.consumers if c != session.rank]
            state["pending"] = True
            await session.transport.exchange("send", peers, tag, t.index, view, chunk, session.monitor,
                                             f"sending {where} to rank(s) {peers}")
            self.stats.add(bytes_sent=t.nbytes * len(peers))
        else:
            state["pending"] = True
            await session.transport.exchange("recv", [t.owner], tag, t.index, view, chunk, session.monitor,
                                             f"waiting for {where} from rank {t.owner}")
            self.stats.add(bytes_received=t.nbytes)

    async def _shared(self, chunk: Chunk, parts: list[_Part]) -> None:
        loop = asyncio.get_running_loop()
        # receive into a staging buffer, never into the destination: after a failure, a
        # transfer still pending can then only ever land in a buffer that was given up on
        direct = len(chunk.segments) == 1 and chunk.tiles_into() and all(p.kind != "recv" for p in parts)
        pooled: bytearray | None = None
        if direct:
            buf = chunk.segments[0].into
            assert buf is not None
        else:
            pooled = self._pool.get(chunk.nbytes)
            buf = memoryview(pooled)[: chunk.nbytes]
        state = {"pending": False}
        ok = False
        try:
            if len(parts) == 1:
                await self._part(chunk, parts[0], buf, state)
            else:
                async with asyncio.TaskGroup() as tg:
                    for p in parts:
                        tg.create_task(self._part(chunk, p, buf, state))
            t1 = time.monotonic()
            if direct:
                if chunk.trackers:
                    await loop.run_in_executor(self.executor, _track, chunk, [buf])
            else:
                await loop.run_in_executor(self.executor, _assemble, chunk, buf)
            ok = True
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            # a buffer a failed transfer may still write into is never reused
            if pooled is not None and (ok or not state["pending"]):
                self._pool.put(pooled)
        self._count_assembled(chunk, t1)


def _flatten(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_flatten(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _first_error(group: BaseExceptionGroup) -> BaseException:
    errors = _flatten(group)
    real = [e for e in errors if not isinstance(e, asyncio.CancelledError)]
    if not real:
        return asyncio.CancelledError()
    own = [e for e in real if isinstance(e, AsyncLoadError) and not isinstance(e, DistributedLoadError)]
    remote = [e for e in real if isinstance(e, DistributedLoadError)]
    return (own or remote or real)[0]


# --- one rank's part of a sharded read ---------------------------------------------------------


class _ShareSession:
    """This rank's side of a :class:`ShardedLoadPlanner` load, created by the reader's
    ``read_data`` (through ``planner.share_session``); :meth:`run` replaces
    ``Pipeline.run`` for each read phase."""

    def __init__(self, group: Any, monitor: _Monitor, options: LoadOptions, *, ordered: bool | None = None,
                 plan: Any = None) -> None:
        self.group = group
        self.monitor = monitor
        self.options = options
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.transport = _Transport(group, ordered=ordered)
        self.phase = 0
        self.doing = "reading data"
        self.planned_bytes: list[list[int]] = []
        self.plan = plan or plan_transfers

    def fail(self, exc: BaseException) -> None:
        """read_data failed on this rank: tell the others."""
        self.monitor.fail(exc, self.doing)

    def _set_doing(self, text: str) -> None:
        self.doing = text
        self.monitor.status(text)

    async def run(self, pipeline: Pipeline, chunks: Sequence[Chunk]) -> None:
        phase = self.phase
        self.phase += 1
        what = "record headers and small records" if phase == 0 else "tensor data"
        mine = sorted(chunks, key=lambda c: (c.name, c.start))
        adv = _advertise(mine)
        needs = [(c.name, a[0], a[1]) for c, a in zip(mine, adv) if a is not None]
        t0 = time.monotonic()
        self._set_doing(f"exchanging which {what} it needs")
        await self.monitor.abarrier(f"needs-{phase}", f"waiting for the other ranks to plan reading {what}")
        loop = asyncio.get_running_loop()
        device = self.transport.device
        group = self.group
        world = self.world

        def gather() -> list[Any]:
            out: list[Any] = [None] * world
            with torch.cuda.device(device) if device.type == "cuda" else _nullcontext():
                dist.all_gather_object(out, needs, group=group)
            return out

        all_needs = await loop.run_in_executor(None, gather)
        transfers, load = self.plan(all_needs)
        _check_transfers(transfers, all_needs)
        self.planned_bytes.append(load)
        self.transport.set_order(transfers, self.rank)
        parts = _parts_for(mine, adv, transfers, self.rank)
        by_id = {id(c): p for c, p in zip(mine, parts) if p is not None}
        tag_base = ((self.monitor.seq * 2 + phase) % _TAG_LOADS) * _TAG_SPAN
        shared = _SharedPipeline(pipeline, self, by_id, tag_base, len(mine))
        t1 = time.monotonic()
        self._set_doing(f"reading and sharing {what}")
        await _run_watched(shared.run(mine), self.monitor)
        log.debug("rank %d, %s: planned in %.3f s (barrier, all_gather, plan), %d transfers, this rank reads %s; "
                  "read and shared in %.3f s", self.rank, what, t1 - t0, len(transfers), _fmt_bytes(load[self.rank]),
                  time.monotonic() - t1)


async def _run_watched(coro: Awaitable[None], monitor: _Monitor) -> None:
    """Run ``coro`` while watching for another rank's failure."""
    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(monitor.watch())
            try:
                await coro
            finally:
                watcher.cancel()
    except BaseExceptionGroup as group:
        raise _first_error(group) from None


# --- the collective driver behind asyncload.load -----------------------------------------------


def collective_load(state_dict: dict[str, Any], reader: PipelinedReader, planner: LoadPlanner,
                    process_group: Any = None) -> None:
    """``dcp.load``'s collective steps (the same planner and reader calls, in the same
    order) with every wait on another rank bounded by ``LoadOptions.collective_timeout``
    and a failure on one rank raised on all of them."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    options = reader._effective_options(planner)
    timeout = planner.collective_timeout_for(options) if isinstance(planner, ShardedLoadPlanner) else \
        options.collective_timeout
    monitor = _Monitor(process_group, timeout)
    reader._asyncload_monitor = monitor  # type: ignore[attr-defined]
    reader._asyncload_group = process_group  # type: ignore[attr-defined]
    user_progress = reader.progress

    def on_progress(done: int, total: int) -> None:
        monitor.progress(f"reading data: {_fmt_bytes(done)} of {_fmt_bytes(total)}")
        if user_progress is not None:
            user_progress(done, total)

    reader.progress = on_progress
    monitor.cancelled = reader._cancelled
    dist_w = _DistWrapper(process_group, True, 0)
    keys = sorted(state_dict.keys())
    stateful = {k: state_dict[k].state_dict() if isinstance(state_dict[k], Stateful) else state_dict[k]
                for k in keys}
    doing = "reading the checkpoint metadata"
    try:
        monitor.status(doing)
        metadata = reader.read_metadata()
        planner.set_up_planner(stateful, metadata, dist_w.is_coordinator)
        reader.set_up_storage_reader(metadata, dist_w.is_coordinator, rank=dist_w.rank, use_collectives=True)
        doing = "making its local plan"
        monitor.status(doing)
        local_plan = reader.prepare_local_plan(planner.create_local_plan())
        doing = "waiting for the other ranks' local plans"
        monitor.barrier("local-plan", doing)
        # every rank is here and well: the collectives below cannot wait on a failed rank
        plans = dist_w.gather_object(local_plan)
        scattered: list[Any] | None = None
        if dist_w.is_coordinator:
            doing = "making the global plan"
            monitor.status(doing)
            if plans is None:  # pragma: no cover - the coordinator always gathers
                raise DistributedLoadError("the coordinator gathered no local plans")
            scattered = reader.prepare_global_plan(planner.create_global_plan(plans))
        doing = "waiting for the global plan"
        monitor.barrier("global-plan", doing)
        central = dist_w.scatter_object(scattered)
        doing = "reading data"
        monitor.status(doing)
        final = planner.finish_plan(central)
        reader.read_data(final, planner).wait()
        doing = "waiting for the other ranks to finish reading"
        monitor.barrier("done", doing)
        # one collective, so that no rank (rank 0 hosts the store) leaves while another is
        # still reading the barrier's keys
        dist_w.barrier()
    except BaseException as exc:
        monitor.fail(exc, monitor.doing if doing == "reading data" else doing)
        raise
    for k in keys:
        if isinstance(state_dict[k], Stateful):
            state_dict[k].load_state_dict(stateful[k])
        else:
            state_dict[k] = stateful[k]
