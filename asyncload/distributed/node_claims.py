"""Adaptive claims of node-aware sharing, as work stealing: who reads a block several nodes
need is decided by its planned owner node unless another node, done with its own blocks,
takes it over from the back.

The first version claimed every shared block with one ``compare_set`` by the first fetcher to
get to it, all of a phase's blocks in the first milliseconds (16 read slots a rank held the
whole phase): the race was decided at the start, by store latency, not by speed. The store
lives on rank 0's node, whose ranks claim in microseconds, while the other nodes' claims cross
that node's link, the busiest of all (it carries the node's reads), and waited behind them
in its queue or for a retransmission (0.4-1.2 s). In one round of two, node 0 won every
block, read the whole checkpoint and forwarded it (0.55x the link bound instead of 0.87x;
``docs/distributed.md``, "Several nodes on one machine").

Here, per rank and read phase (:class:`NodeClaims`):

- **own blocks** (its node is the planned owner) are claimed in order, :data:`CLAIM_AHEAD`
  blocks before their reads can start (a claim's round trip, slow on a busy link, overlaps
  the reads in flight), and read with at most a *horizon* of bytes in flight
  (:data:`HORIZON` seconds at this rank's measured rate, at least :data:`MIN_AHEAD` blocks):
  a slow node holds few blocks at a time, so what it has not reached is left for the
  others to take;
- **the others' blocks**: while its node still has own blocks to claim, the rank only
  looks at the claim of the first undecided block of each owner (``compare_set(key, "?",
  "?")``, which never writes: the claimant, or ``"?"``), and posts the receive once it is
  decided; once every rank of its node has claimed its own blocks of the windows driven so
  far (counters at the head of the node's ring), it claims the others' undecided blocks
  from the back (work stealing: reading and sending the ones it wins, receiving the
  others). Nodes of equal speed then meet near the end of each other's queues and claim
  little more than their own.

Every byte is still read once: a block is read only by the rank whose ``compare_set`` set its
key, and every other node's fetcher receives it from that rank once the key is set. No wait
is unbounded: a block's owner reaches it once the blocks numbered before it are done (the
windows' order), and a rank's look at an undecided block backs off to :data:`_PROBE_MAX`
seconds, beating while it waits and giving up on an owner that makes no progress for
``collective_timeout``, as the other waits of a load do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from asyncload.distributed.nodes import NodeBlock
from asyncload.distributed.values import parse_rank

if TYPE_CHECKING:
    from asyncload.engine import Meter

__all__ = ["BEHIND", "CLAIM_AHEAD", "HORIZON", "MIN_AHEAD", "STEAL_AHEAD", "NodeClaims"]

log = logging.getLogger("asyncload.sharded")

#: Seconds of reading (at the rank's measured rate) it may have claimed and not landed.
HORIZON = 1.0
#: ... but at least this many blocks (one landing while the next one's claim travels).
MIN_AHEAD = 2
#: Own blocks claimed before a read can start (their claims overlap the reads in flight).
CLAIM_AHEAD = 2
#: A rank starts taking over other nodes' blocks once fewer than this many blocks of its
#: own reads are pending (its link about to idle) ...
STEAL_AHEAD = 2
#: ... or while an owner has this many blocks more undecided (of those the rank fetches)
#: than twice the rank's own work left: that owner is behind.
BEHIND = 4
#: A look at an undecided block backs off from the first to the second, seconds.
_PROBE_MIN, _PROBE_MAX = 0.05, 0.5
#: Seconds between beats (and stall checks of the owner looked at) while looking.
_CHECK = 1.0
#: The value of a look (``compare_set`` with an expected value no claim has).
_UNSET = "?"

_Task = Callable[..., Coroutine[Any, Any, None]]


class NodeClaims:
    """One rank's claims in one read phase of node-aware sharing (see the module's
    docstring). :meth:`add` hands it each shared block this rank fetches, in order, as its
    window's slot frees; :meth:`run` decides them, starting ``read_send(b, view, w)`` (under
    a slot of ``slots``, which it releases) for the ones this rank reads and ``receive(b,
    view, src, w)`` for the others; ``lost(w)``: a block of window ``w`` this rank will not
    send."""

    def __init__(
        self,
        *,
        rank: int,
        node: int,
        store: Any,
        prefix: str,
        ring: Any,
        slots: Meter,
        read_send: _Task,
        receive: _Task,
        lost: Callable[[int], None],
        written: list[str],
        beat: Callable[[], None],
        check_idle: Callable[[list[int]], None],
        times: dict[str, float],
        key_name: Callable[[str], str] = str,
    ) -> None:
        self.key_name = key_name  # a claim key as the group's store names it (in errors)
        self.rank, self.node, self.store, self.prefix = rank, node, store, prefix
        self.ring, self.slots, self.written, self.beat = ring, slots, written, beat
        self.check_idle = check_idle
        self._read_send, self._receive, self._lost = read_send, receive, lost
        self.times = times
        self.own: deque[tuple[NodeBlock, memoryview, int]] = deque()
        #: Own blocks claimed by this rank, their reads not started yet.
        self.ready: deque[tuple[NodeBlock, memoryview, int]] = deque()
        self._claiming = 0  # bytes of own blocks whose claim is on its way
        self.others: list[tuple[NodeBlock, memoryview, int]] = []
        self.own_left = 0  # own blocks added and not claimed yet
        self.driven = 0
        self.closed = False
        self.ahead = 0  # bytes claimed by this rank (read by it) and not landed yet
        self.landed_bytes = 0
        self.started: float | None = None
        self.largest = 1
        self.stolen = 0  # blocks of other nodes this rank won
        self.stealing = False  # its own reads were about done once: it may take over
        self.ops = 0
        self._wake = asyncio.Event()  # own blocks: one added, landed, or the end
        self._others_wake = asyncio.Event()  # others' blocks: one added, or the end
        self._tracing = log.isEnabledFor(logging.DEBUG)

    # --- what the drive hands over ----------------------------------------------------------

    def add(self, b: NodeBlock, view: memoryview, w: int) -> None:
        self.largest = max(self.largest, b.nbytes)
        if b.owner == self.node:
            self.own.append((b, view, w))
            self.own_left += 1
        else:
            self.others.append((b, view, w))
            self._others_wake.set()
        self._wake.set()

    def drove(self, windows: int) -> None:
        """The windows before ``windows`` were handed over (publishes what the node's other
        ranks test before taking over blocks)."""
        self.driven = windows
        self.ring.publish_claims(self.own_left, self.driven)
        self._wake.set()
        self._others_wake.set()

    def close(self) -> None:
        """Every block was handed over."""
        self.closed = True
        self._wake.set()
        self._others_wake.set()

    # --- admission ---------------------------------------------------------------------------

    def _room(self, nbytes: int) -> bool:
        if not self.ahead:
            return True
        rate = self._rate()
        limit = max(MIN_AHEAD * self.largest, rate * HORIZON if rate else 0.0)
        return self.ahead + nbytes <= limit

    def _rate(self) -> float | None:
        if self.started is None or not self.landed_bytes:
            return None
        busy = time.monotonic() - self.started
        return self.landed_bytes / busy if busy > 0 else None

    def landed(self, nbytes: int) -> None:
        """A block this rank read has landed (its bytes count for the rate)."""
        self.ahead -= nbytes
        self.landed_bytes += nbytes
        self._wake.set()
        self._others_wake.set()

    # --- the store ---------------------------------------------------------------------------

    async def _op(self, b: NodeBlock, desired: str, expected: str) -> str:
        loop = asyncio.get_running_loop()
        key = f"{self.prefix}{b.seq}"
        t0 = time.monotonic()
        got = await loop.run_in_executor(None, self.store.compare_set, key, expected, desired)
        dt = time.monotonic() - t0
        self.times["claims"] += dt
        self.ops += 1
        value = got.decode("utf-8", "replace")
        if value == desired and expected == "":
            self.written.append(key)
        if self._tracing:
            log.debug(
                "trace %s rank=%d seq=%d owner=%d winner=%s t0=%.4f dt=%.4f",
                "claim" if expected == "" else "look", self.rank, b.seq, b.owner, value,
                time.time() - dt, dt,
            )  # fmt: skip
        return value

    def _winner(self, b: NodeBlock, value: str) -> int:
        """A claim's value: the fetcher of one of the nodes that need block ``b``
        (:mod:`~asyncload.distributed.values`: anything else is a DistributedLoadError)."""
        return parse_rank(
            self.key_name(f"{self.prefix}{b.seq}"),
            value,
            sorted(b.fetchers),
            what=f"the claim of block {b.seq}, bytes [{b.start}, {b.end}) of {b.name}",
        )

    # --- deciding ----------------------------------------------------------------------------

    def _may_take_over(self) -> bool:
        """Every rank of this node has claimed its own blocks of the windows handed over so
        far, and has handed over at least as many windows as this rank, and this rank's own
        reads were about done once (fewer than :data:`STEAL_AHEAD` blocks pending; from then
        on as much as its horizon allows); or, whatever its own state, an owner is behind:
        :data:`BEHIND` blocks more undecided (of those this rank fetches) than twice its own
        work left. Not while an owner as fast would reach its blocks first: a block taken
        over costs the thief's link the bytes it sends to every other node that needs it."""
        pending = self.ahead + self._claiming + sum(x[0].nbytes for x in self.ready)
        if (
            not self.own_left
            and self.ring.node_done_claiming(self.driven)
            and (self.stealing or pending <= (STEAL_AHEAD - 1) * self.largest)
        ):
            self.stealing = True  # its own reads were about done once
            return True
        mine = pending + self.own_left * self.largest  # its own work left, about
        return max(self._left().values(), default=0) >= 2 * mine + BEHIND * self.largest

    def _left(self) -> dict[int, int]:
        """Per owner node, the bytes of its blocks this rank fetches still undecided (as far
        as this rank knows)."""
        left: dict[int, int] = {}
        for b, _, _ in self.others:
            left[b.owner] = left.get(b.owner, 0) + b.nbytes
        return left

    def _victim(self) -> int:
        """The index in :attr:`others` of the block to take over: the last one of the owner
        with the most undecided blocks left (the one furthest behind)."""
        left = self._left()
        last = {b.owner: i for i, (b, _, _) in enumerate(self.others)}
        owner = max(left, key=lambda o: (left[o], -o))
        return last[owner]

    async def run(self, tg: asyncio.TaskGroup) -> None:
        """Decide every block handed over (until :meth:`close` and none is left): own blocks
        and the others' side by side."""
        async with asyncio.TaskGroup() as inner:
            inner.create_task(self._own_blocks(tg))
            inner.create_task(self._others_blocks(tg))

    async def _own_blocks(self, tg: asyncio.TaskGroup) -> None:
        """Own blocks: claimed up to :data:`CLAIM_AHEAD` blocks before their reads can start
        (a claim's round trip, on a busy link, overlaps the reads in flight), read as the
        horizon allows."""
        while True:
            while self.ready and self._room(self.ready[0][0].nbytes):
                b, view, w = self.ready.popleft()
                await self.slots.acquire()
                self.ahead += b.nbytes
                self._start()
                tg.create_task(self._read_send(b, view, w))
            while (
                self.own
                and self._claiming + sum(x[0].nbytes for x in self.ready)
                < CLAIM_AHEAD * self.largest
            ):
                b, view, w = self.own.popleft()
                self.own_left -= 1
                self._claiming += b.nbytes
                self.ring.publish_claims(self.own_left, self.driven)
                tg.create_task(self._claim_own(b, view, w))
            if self.closed and not self.own and not self.ready and not self._claiming:
                return
            self._wake.clear()
            await self._wake.wait()

    async def _others_blocks(self, tg: asyncio.TaskGroup) -> None:
        probe = _PROBE_MIN
        checked = time.monotonic()
        while True:
            moved = False
            if self.others and self._may_take_over():
                i = self._victim()
                if self._room(self.others[i][0].nbytes):
                    b, view, w = self.others.pop(i)  # from the back
                    await self.slots.acquire()
                    try:
                        got = self._winner(b, await self._op(b, str(self.rank), ""))
                    except BaseException:
                        self.slots.release()
                        raise
                    if got == self.rank:
                        self.stolen += 1
                        self.ahead += b.nbytes
                        self._start()
                        tg.create_task(self._read_send(b, view, w))
                    else:
                        self.slots.release()
                        self._lost(w)
                        tg.create_task(self._receive(b, view, got, w))
                    moved = True
            elif self.others:
                # a look at the first undecided block of each owner (an owner claims its
                # blocks in order)
                seen: set[int] = set()
                for item in list(self.others):
                    b, view, w = item
                    owner = b.fetcher(b.owner)
                    if owner in seen:
                        continue
                    seen.add(owner)
                    got_s = await self._op(b, _UNSET, _UNSET)
                    if got_s != _UNSET:
                        self.others.remove(item)
                        self._lost(w)
                        tg.create_task(self._receive(b, view, self._winner(b, got_s), w))
                        moved = True
            if self.closed and not self.others:
                return
            if moved:
                probe = _PROBE_MIN
                continue
            if self.others:  # another node's claim, or this node's ranks: look again soon
                now = time.monotonic()
                if now - checked >= _CHECK:  # beat; give up on a block's owner that stalls
                    checked = now
                    self.beat()
                    self.check_idle([self.others[0][0].fetcher(self.others[0][0].owner)])
                # until the next look, or until a read of its own lands (it may take over)
                self._others_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._others_wake.wait(), probe)
                probe = min(_PROBE_MAX, probe * 2)
            else:
                self._others_wake.clear()
                await self._others_wake.wait()

    def _start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    async def _claim_own(self, b: NodeBlock, view: memoryview, w: int) -> None:
        """Claim an own block: ready to read, or, taken over by another node, received."""
        try:
            got = self._winner(b, await self._op(b, str(self.rank), ""))
        finally:
            self._claiming -= b.nbytes
            self._wake.set()
        if got == self.rank:
            self.ready.append((b, view, w))
            return
        self._lost(w)
        await self._receive(b, view, got, w)
