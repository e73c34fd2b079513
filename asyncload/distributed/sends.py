"""Sends that may outlive their load: :class:`BackgroundSends` (one load's sends from
private copies under ``ShardedLoadPlanner(wait_for_peers=False)``), the process's meter of
those copies (:data:`COPIES`: at most one ``memory_budget`` among every load of the
process), :func:`wait_for_background_sends` and the wait at interpreter exit."""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from asyncload.common.errors import DistributedLoadError
from asyncload.common.stats import _fmt_bytes
from asyncload.distributed.barrier import BarrierWait, poll_interval
from asyncload.distributed.monitor import Monitor
from asyncload.engine import Meter, MeterStatistics

__all__ = ["COPIES", "BackgroundSends", "wait_for_background_sends"]

log = logging.getLogger("asyncload.sharded")

#: Loads whose sends outlive them (returned early) and still drain: waited for at exit.
_live_sends: set[BackgroundSends] = set()
_live_lock = threading.Lock()
_exit_hook: list[bool] = []
#: Seconds between the drain's checks of stalled peers (the monitor's heartbeat interval).
_BEAT = 1.0
#: Seconds interpreter exit waits at most for background sends (also when collective_timeout
#: is None).
_EXIT_WAIT = 300.0
#: What a rank whose load returned and whose sends all landed does (its wait at "done").
_DONE_DOING = "waiting, its load returned, for the other ranks to finish theirs"
#: Bytes held in send copies by every load of this process together, at most the budget of
#: the load that reserves (one memory_budget); its lock, because copies are given back by
#: the threads that see their sends land.
COPIES = Meter(1, name="send copies")
_copy_lock = threading.Lock()


class BackgroundSends:
    """The sends of one load on this rank under ``ShardedLoadPlanner(wait_for_peers=False)``:
    every unit this rank sends goes out from a private copy of its bytes (never from the
    destination, which the caller may overwrite as soon as the load returns), so the load
    can return while slower peers still have to post their receives.

    The copies are bounded: at most one ``memory_budget`` per process; once they fill it, a
    peer far behind (:meth:`behind`) is left out of new units (it reads them from storage
    itself, counted in its ``bytes_hedged``). After the load returned, a daemon
    thread keeps this rank's status alive while sends are pending (so peers do not declare
    it stalled), declares a receiver that makes no progress for ``collective_timeout``
    stalled (posting the failure that rank and the others still loading raise), logs a
    failure a peer posts after this rank returned, and ends once every rank has finished
    the load. Interpreter exit waits for it, bounded by those same rules.

    Attributes (bytes count once per peer): ``bytes_posted`` (every send of the load),
    ``bytes_at_return`` (still on their way when the load returned), ``bytes_sent_after_return``
    (of those, delivered since), ``error`` (a send that failed, or the failure that stopped
    the drain), ``returned``.
    """

    def __init__(self, monitor: Monitor, budget: int) -> None:
        self.monitor = monitor
        self.rank = monitor.rank
        self.budget = budget
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        #: Per peer: copies waiting for it (FIFO, one waiter thread per peer at most).
        self._queues: dict[int, list[tuple[Any, int, list[Any]]]] = {}
        self._waiters: set[int] = set()
        self._to: dict[int, int] = {}
        self._held = 0
        self.bytes_posted = 0
        self.bytes_at_return = 0
        self.bytes_sent_after_return = 0
        self.returned = False
        self.abandoned = False
        self.error: BaseException | None = None
        self._drained = threading.Event()

    # --- during the load (the event loop's thread) ------------------------------------------

    def behind(self, peers: Sequence[int], nbytes: int) -> list[int]:
        """The peers far behind, once the copies fill the budget (no room for ``nbytes``
        more; before that, nobody): those whose pending copies pass half of it and more than
        twice what any other peer of this rank holds (one clear straggler; peers late alike
        are never left out, and with a single peer there is nobody to fall behind)."""
        with _copy_lock:
            if COPIES.used + nbytes <= self.budget:
                return []
        with self._lock:
            if len(self._to) < 2:
                return []
            top = sorted(self._to.values(), reverse=True)
            held = [self._to.get(p, 0) for p in peers]
        half = self.budget // 2
        return [
            p
            for p, h in zip(peers, held)
            if h + nbytes > half and h == top[0] and h > 2 * top[1] + nbytes
        ]

    def reserve(self, nbytes: int) -> bool:
        """Room for a copy of ``nbytes`` within the budget (every load of the process together)."""
        with self._lock:
            if self.abandoned:  # the load failed: its copies no longer count, so none is made
                return False
            with _copy_lock:
                COPIES.set_capacity(self.budget)  # this load's budget, for every load's copies
                if not COPIES.try_acquire(nbytes):
                    return False
            self._held += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        """Give back the room of a copy of ``nbytes`` (sent, or never made)."""
        with self._lock:
            if self.abandoned:
                return
            self._held -= nbytes
        with _copy_lock:
            COPIES.release(nbytes)

    def statistics(self) -> MeterStatistics:
        """The meter of send copies (every load of this process together)."""
        with _copy_lock:
            return COPIES.statistics()

    def post(self, group: Any, peers: Sequence[int], tag: int, copy: bytearray) -> None:
        """Send ``copy`` (room reserved) to ``peers``; a waiter thread per peer sees it land."""
        n = len(copy)
        tensor = torch.frombuffer(copy, dtype=torch.uint8)
        # the copy is freed (and its room given back) when its last peer has it
        left = [len(peers), copy]
        works: list[tuple[int, Any]] = []
        for p in peers:
            try:
                works.append((p, dist.isend(tensor, group=group, group_dst=p, tag=tag)))
            except RuntimeError as exc:  # gloo: the peer's connection closed (it died)
                # not this rank's failure: that peer reads the unit itself or fails on its own,
                # and the monitor tells the others; the send is simply not made
                log.warning(
                    "rank %d: no send to rank %d, its connection is gone: %s", self.rank, p, exc
                )
        left[0] = len(works)
        if not works:
            self.unreserve(n)
            return
        with self._lock:
            for p, w in works:
                self._queues.setdefault(p, []).append((w, n, left))
                self._to[p] = self._to.get(p, 0) + n
                self.bytes_posted += n
                if p not in self._waiters:
                    self._waiters.add(p)
                    threading.Thread(
                        target=self._wait_peer, args=(p,), name="asyncload-share-send", daemon=True
                    ).start()

    def _wait_peer(self, peer: int) -> None:
        while True:
            with self._lock:
                q = self._queues.get(peer)
                if not q:
                    self._waiters.discard(peer)
                    self._cond.notify_all()
                    return
                work, n, left = q[0]
            err: BaseException | None = None
            try:
                work.wait()
            except BaseException as exc:
                err = exc
            with self._lock:
                q.pop(0)
                self._to[peer] -= n
                if self.returned and err is None:
                    self.bytes_sent_after_return += n
                left[0] -= 1
                last = left[0] == 0
                self._cond.notify_all()
            if last:
                left[1] = None  # the copy
                self.unreserve(n)
            if err is not None:
                self._failed(peer, err)

    def _failed(self, peer: int, exc: BaseException) -> None:
        try:
            gone_after_done = self.monitor.finished(peer)
        except Exception:
            gone_after_done = False
        if gone_after_done:  # it finished its load (it hedged this unit) and left: nothing is lost
            log.debug(
                "rank %d: a send to rank %d, which had finished its load, failed: %s",
                self.rank,
                peer,
                exc,
            )
            return
        err = DistributedLoadError(
            f"rank {self.rank} lost its connection to rank {peer} while sending it shared "
            f"bytes: {exc}",
            rank=peer,
            doing="receiving shared bytes",
        )
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
            returned = self.returned
        if returned:
            if first:
                log.warning("rank %d, after its load returned: %s", self.rank, err)
            return
        try:  # the load is still running here: every rank still loading raises it
            self.monitor.fail(err, err.doing)
        except Exception:  # pragma: no cover - the store is gone too
            log.debug("could not post a send failure", exc_info=True)

    def abandon(self) -> None:
        """The load failed or the drain gave up: stop counting the pending copies against the
        budget (their sends stay posted; the threads waiting for them keep the memory alive)."""
        with self._lock:
            if self.abandoned:
                return
            self.abandoned = True
            held, self._held = self._held, 0
            self._cond.notify_all()
        if held:
            with _copy_lock:
                COPIES.release(held)

    @property
    def bytes_pending(self) -> int:
        """Bytes (once per peer) posted and not yet delivered."""
        with self._lock:
            return sum(self._to.values())

    def pending_peers(self) -> list[int]:
        with self._lock:
            return sorted(p for p, n in self._to.items() if n > 0)

    # --- after the load returned ------------------------------------------------------------

    def after_return(self) -> None:
        """The load returned (``Monitor.finish``): raise a send failure known by now; else
        drain the rest in the background."""
        with self._lock:
            self.returned = True
            self.bytes_at_return = sum(self._to.values())
            error = self.error
        if error is not None:
            self.abandon()
            raise error
        peers = self.pending_peers()
        what = f"; sending {_fmt_bytes(self.bytes_at_return)} to rank(s) {peers}" if peers else ""
        self.monitor.status(f"finished its load{what}")
        with _live_lock:
            _live_sends.add(self)
            if not _exit_hook:
                _exit_hook.append(True)
                atexit.register(_wait_at_exit)
        threading.Thread(target=self._drain, name="asyncload-share-drain", daemon=True).start()

    def _drain(self) -> None:
        """After the load returned: while sends are pending, beat (receivers see this rank
        alive), watch their receivers and poll one key for a failure (``ev``); once none is
        pending, wait at "done" with the other ranks that returned (:class:`BarrierWait`,
        arrived already: one key a poll; the barrier's watcher alone reads the ranks still
        loading and gives up on one without progress), so that the group's traffic grows with
        the ranks, not ranks squared."""
        m = self.monitor
        delay = 0.005
        longest = poll_interval(m.world)
        checked = 0.0
        ev = -1
        done: BarrierWait | None = None
        wait = None  # the deadline of the wait on the receivers (Monitor.peer_wait)
        pending = -1
        try:
            while True:
                peers = self.pending_peers()
                if not peers:
                    if done is None:
                        done = BarrierWait(m, "done", _DONE_DOING)
                        done.arrived_before()
                        longest = done.max_delay
                    if m.all_finished.is_set() or done.poll():
                        m.all_finished.set()
                        return
                else:
                    left = self.bytes_pending
                    if wait is None or wait.peers != peers:
                        wait = m.peer_wait(peers, f"rank(s) {peers} to receive what it sends")
                    elif left < pending:
                        wait.moved()  # a send landed
                    pending = left
                    seen = int(m.store.add("ev", 0))  # moved by every failure posted
                    if seen != ev:
                        ev = seen
                        m.check()
                    m.beat()  # receivers waiting on this rank see it alive
                    now = time.monotonic()
                    if now - checked >= _BEAT:
                        checked = now
                        idle = m.idle_peer(peers)
                        if idle is not None:
                            rank, seconds, status = idle
                            message = (
                                f"rank {rank} made no progress for {seconds:.1f} s "
                                f"(LoadOptions.collective_timeout={m.timeout}); its last status: "
                                f"{status or 'none'}; rank {self.rank} gave up on it "
                                "after its own load had returned"
                            )
                            m.post_abort(f"{rank}|{status}|{message}")
                            log.warning("rank %d: %s", self.rank, message)
                            self._stop(DistributedLoadError(message, rank=rank, doing=status))
                            return
                        wait.check()
                time.sleep(delay)
                delay = min(longest, delay * 2)
        except (Exception, asyncio.CancelledError) as exc:
            if getattr(exc, "_asyncload_posted", False):  # a rank failed or was given up on
                log.warning("rank %d, after its load returned: %s", self.rank, exc)
            else:  # the store is gone (its host exited): nothing left to coordinate
                log.debug("rank %d: background sends stop watching: %s", self.rank, exc)
            self._stop(exc)
        finally:
            self._drained.set()
            with self._lock:
                self._cond.notify_all()
            with _live_lock:
                _live_sends.discard(self)

    def _stop(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc
        self.abandon()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every send has landed and (once the load returned) the drain ended or
        gave up; True if so, False at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if (
                    self._drained.is_set()
                    if self.returned
                    else self.abandoned or not any(self._to.values())
                ):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(left, 0.1))


def wait_for_background_sends(timeout: float | None = None) -> bool:
    """Wait until the sends of every load of this process that returned before its peers
    (``ShardedLoadPlanner(wait_for_peers=False)``) have landed or were given up on (a
    receiver stalled or failed); True if so, False at ``timeout``. Call it before
    ``dist.destroy_process_group()``: with gloo, destroying the group while a send is still on
    its way aborts the process at exit."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _live_lock:
        live = list(_live_sends)
    for rec in live:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not rec.wait(left):
            return False
    return True


def _wait_at_exit() -> None:
    """Interpreter exit: let background sends land (bounded: the drain declares a receiver
    that stops progressing stalled; at most ``_EXIT_WAIT`` s in all)."""
    with _live_lock:
        live = list(_live_sends)
    if live:
        log.debug("waiting for %d load(s)' background sends before exit", len(live))
        wait_for_background_sends(_EXIT_WAIT)
