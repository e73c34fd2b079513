"""One read phase of node-aware sharing on one rank, pipelined through a shared-memory ring.

The node's blocks of the phase (:func:`asyncload.distributed.nodes.plan_blocks`, in their
order: file, then offset) are cut into *windows* of at most ``slot`` bytes. The node holds
``RING_SLOTS`` windows at once in one shared-memory file, the *ring* (window ``w`` in slot
``w % RING_SLOTS``), so what the node stages in ``/dev/shm`` is at most ``RING_SLOTS x slot
<= memory_budget`` whatever the checkpoint's size. Every rank of the node runs, side by side:

- the **fetch** (:func:`_drive`): window by window, once the window's slot is free, the blocks
  it fetches for its node in that window (a block several nodes need: read and sent to the
  other nodes' fetchers, or received from the one that read it; adaptive between nodes by
  work stealing, :mod:`asyncload.distributed.node_claims`);
- the **hand-over** (:class:`_FromRing`): its chunks dispatched in file order, each chunk's
  bytes copied from the ring window by window, as soon as every rank of the node has landed
  its blocks of that window. While its ranks copy window ``w``, the node fetches ``w + 1``.

A rank *releases* window ``w`` when its fetches into it landed, its sends out of it are done
and it copied everything it needs from it; the slot is free for window ``w + RING_SLOTS`` once
every rank of the node released ``w``. The ranks of a node tell each other through two
counters per rank at the head of the ring (windows landed, windows released: monotone, one
writer each), which each rank polls (:class:`_Ring`); nothing of it goes through the store or
the process group. Waits are bounded as every wait of a load is: a node peer that makes no
progress for ``collective_timeout`` is given up on (the monitor's stall check), a failure
posted anywhere ends the wait (the session watches the monitor).

No cycle of waits: a rank dispatches its chunks in window order and copies a chunk's bytes
window by window, so what holds a slot only ever waits on windows before the next one; a
block several nodes need sits, on each of them, in a window whose slot frees once the
blocks numbered before it are done (induction on the block's number).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncload.common.errors import DistributedLoadError
from asyncload.distributed.node_claims import NodeClaims
from asyncload.distributed.nodes import (
    BLOCK_UNITS,
    NodeBlock,
    NodeFiles,
    _rank_arrays,
    _token,
    plan_blocks,
)
from asyncload.distributed.share_plan import _Part
from asyncload.distributed.shared import Share, _SharedPipeline, check_digest, post_digest
from asyncload.engine import Chunk, Meter, Pipeline, _aiter, copy_bytes

__all__ = ["RING_SLOTS", "plan_windows", "run_node_phase"]

log = logging.getLogger("asyncload.sharded")

#: Windows the ring holds at once: some being handed over while the next are fetched.
RING_SLOTS = 4
#: A phase is cut into at least this many windows (else the node would fetch all of a
#: small phase before its ranks copy anything); as many as the ring holds, so a phase that
#: fits in the budget is fetched without waiting for slots.
MIN_WINDOWS = RING_SLOTS
MIN_SLOT = 1 << 20
#: Bytes of the ring's head per rank of the node (two counters, two of its claims and its
#: proof of sharing the node's memory, padded to a cache line).
_HEAD = 64
#: Where a rank's proof (8 bytes: :func:`_prove_node`) sits in its part of the head.
_PROOF = 32
_PAGE = 4096
#: Shortest and longest sleep between polls of the node's counters.
_POLL_MIN, _POLL_MAX = 0.0002, 0.004
#: Seconds between heartbeats and stall checks while waiting on the node.
_BEAT = 1.0


def plan_windows(sizes: Sequence[int], slot: int) -> list[int]:
    """The window of each block (``sizes``: the node's blocks' bytes, in order): blocks taken
    greedily in order, a new window when the next block would not fit in ``slot`` bytes."""
    out: list[int] = []
    w, used = 0, 0
    for n in sizes:
        if used and used + n > slot:
            w, used = w + 1, 0
        out.append(w)
        used += n
    return out


def ring_geometry(total: int, budget: int, unit: int) -> tuple[int, int]:
    """``(block, slot)`` bytes for a phase whose node needs ``total`` bytes: slots of
    ``budget / RING_SLOTS`` at most, small enough for ``MIN_WINDOWS`` windows (not under
    ``MIN_SLOT`` where the budget allows); blocks of ``BLOCK_UNITS`` work units, at most
    an eighth of a slot (every rank of a node and every node has blocks in each window)."""
    cap = max(1, budget // RING_SLOTS)
    slot = min(cap, max(MIN_SLOT, -(-total // MIN_WINDOWS)))
    block = max(1, min(BLOCK_UNITS * unit, slot // 8))
    return block, slot


class _Ring:
    """The node's ring: its counters (``landed``, ``released`` per rank of the node) and
    data (``RING_SLOTS`` slots of ``slot`` bytes), and this rank's view of them."""

    def __init__(
        self,
        files: NodeFiles,
        local: int,
        count: int,
        head: int,
        slot: int,
        monitor: Any,
        peers: list[int],
    ) -> None:
        self.files = files
        self.map = files.maps["ring"]
        self.local = local
        self.count = count
        self.head = head
        self.slot = slot
        self.monitor = monitor
        self.ranks = list(peers)  # the node's ranks, by local index (group ranks)
        self.peers = peers  # the other ranks of the node (group ranks)
        self.landed = 0  # the node's: lowest over its ranks
        self.released = 0
        self._changed = asyncio.Event()
        self._waiting = 0
        #: Seconds spent waiting: for windows to land (hand-over), for slots (fetch), claiming.
        self.times = {"landed": 0.0, "slot": 0.0, "claims": 0.0}
        #: What the waits on the node wait for (the latest one), and the node's ranks that
        #: hold it (those whose counter is not past it).
        self._what = ""
        self._holding: Callable[[], list[int]] = list

    def offset(self, window: int) -> int:
        return self.head + (window % RING_SLOTS) * self.slot

    def publish(self, landed: int, released: int) -> None:
        struct.pack_into("<qq", self.map, self.local * _HEAD, landed, released)
        self.refresh()

    def publish_claims(self, own_left: int, driven: int) -> None:
        """This rank's own blocks not claimed yet and windows handed to its claims."""
        struct.pack_into("<qq", self.map, self.local * _HEAD + 16, own_left, driven)

    def node_done_claiming(self, driven: int) -> bool:
        """Every rank of the node has claimed its own blocks of the windows it handed over,
        and handed over at least ``driven`` windows."""
        for i in range(self.count):
            own_left, their = struct.unpack_from("<qq", self.map, i * _HEAD + 16)
            if own_left or their < driven:
                return False
        return True

    def refresh(self) -> bool:
        """Read every rank's counters; wake the waiters if the node's moved."""
        lo_l = lo_r = 1 << 62
        for i in range(self.count):
            a, b = struct.unpack_from("<qq", self.map, i * _HEAD)
            lo_l, lo_r = min(lo_l, a), min(lo_r, b)
        if (lo_l, lo_r) == (self.landed, self.released):
            return False
        self.landed, self.released = lo_l, lo_r
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()
        return True

    async def wait_landed(self, window: int) -> None:
        """Until every rank of the node has landed its blocks of ``window``."""
        t0 = time.monotonic()
        self._what = f"window {window} of its node's ring to land (rank(s) fetching into it)"
        self._holding = lambda: self._behind(0, window)
        await self._wait(lambda: self.landed > window)
        self.times["landed"] += time.monotonic() - t0

    async def wait_released(self, window: int) -> None:
        """Until every rank of the node has released ``window``."""
        t0 = time.monotonic()
        self._what = (
            f"slot {window % RING_SLOTS} of its node's ring to be free (window {window} "
            "released by every rank of the node)"
        )
        self._holding = lambda: self._behind(1, window)
        await self._wait(lambda: self.released > window)
        self.times["slot"] += time.monotonic() - t0

    def _behind(self, field: int, window: int) -> list[int]:
        """The node's ranks whose counter ``field`` (0: landed, 1: released) is not past
        ``window``."""
        out = []
        for i in range(self.count):
            if struct.unpack_from("<qq", self.map, i * _HEAD)[field] <= window:
                out.append(self.ranks[i])
        return out

    async def _wait(self, ok: Callable[[], bool]) -> None:
        """Until ``ok()`` (a test of the node's counters); :meth:`poll` moves them."""
        self._waiting += 1
        try:
            while not ok():
                await self._changed.wait()
        finally:
            self._waiting -= 1

    async def poll(self, doing: Callable[[], str]) -> None:
        """Watch the node's counters (runs beside the phase); while a rank waits on them,
        beat and check the node's other ranks for a stall, once a second, and bound the wait
        (:class:`~asyncload.distributed.monitor.PeerWait`: the node's counters moving is
        progress on it)."""
        delay = _POLL_MIN
        beat = time.monotonic()
        wait = None
        while True:
            await asyncio.sleep(delay)
            moved = self.refresh()
            delay = _POLL_MIN if moved else min(_POLL_MAX, delay * 2)
            if not self._waiting:
                wait = None
            elif wait is None:
                wait = self.monitor.peer_wait(self.peers, self._what, lambda: self._holding())
            elif moved:
                wait.moved()
            now = time.monotonic()
            if wait is not None and now - beat >= _BEAT:
                beat = now
                self.monitor.beat()
                idle = self.monitor.idle_peer(self.peers)
                if idle is not None:
                    rank, seconds, status = idle
                    self.monitor._give_up(rank, None, seconds, status, doing())
                wait.what = self._what
                wait.check()


def _proof_bytes(value: str) -> bytes:
    """8 bytes of a rank's random value (hex) for its slot of the ring's head."""
    return bytes.fromhex(value)[:8].ljust(8, b"\0")


def _prove_node(
    files: NodeFiles, ranks: Sequence[int], proofs: Sequence[str], node_id: str, rank: int
) -> None:
    """After the node's barrier: every rank of the node wrote its random value into its slot
    of the ring's head before it, so each must be there now; a rank whose value is not there
    does not share this rank's memory (another host, or a container with its own /dev/shm,
    under the same ``node_id``): DistributedLoadError naming the node id, on each of them,
    instead of waiting on ring counters nobody writes."""
    ring = files.maps["ring"]
    unseen = [
        r
        for i, r in enumerate(ranks)
        if r != rank
        and ring[i * _HEAD + _PROOF : i * _HEAD + _PROOF + 8] != _proof_bytes(proofs[r])
    ]
    if not unseen:
        return
    raise DistributedLoadError(
        f"ranks {list(ranks)} say they run on node {node_id!r} but do not share its memory: "
        f"rank {rank} does not see in {files.paths.get('ring', 'its ring')} what rank(s) "
        f"{unseen} wrote into theirs (another host, or a container with its own /dev/shm, "
        "under the same node id); give each host (each /dev/shm) its own "
        "ShardedLoadPlanner(node_id=...)",
        rank=unseen[0],
        doing=f"proving that the ranks of node {node_id!r} share memory",
    )


class _Progress:
    """This rank's count of what is left in each window, and the counters it publishes."""

    def __init__(self, ring: _Ring, windows: int) -> None:
        self.ring = ring
        self.windows = windows
        self.fetch_left = [0] * windows  # blocks this rank fetches, not landed yet
        self.send_left = [0] * windows  # sends out of the window, not done yet
        self.use_left = [0] * windows  # bytes this rank copies out of the window, not yet
        self.driven = 0  # windows whose blocks this rank has claimed or asked for
        self.landed = 0
        self.released = 0

    def update(self) -> None:
        landed, released = self.landed, self.released
        while landed < self.windows and not self.fetch_left[landed]:
            landed += 1
        while (
            released < min(landed, self.driven)
            and not self.send_left[released]
            and not self.use_left[released]
        ):
            released += 1
        if (landed, released) != (self.landed, self.released):
            self.landed, self.released = landed, released
            self.ring.publish(landed, released)


class _FromRing(_SharedPipeline):
    """The hand-over: chunks dispatched in file order, each chunk's bytes copied from the
    ring window by window as the node lands them."""

    ring: _Ring
    progress: _Progress
    #: Per chunk: ``(window, ring offset, offset in the chunk, bytes)``.
    pieces: dict[int, list[tuple[int, int, int, int]]]

    async def run(self, chunks: Any) -> None:
        await self._run(_aiter(chunks))  # in file order: the windows' order

    async def _read_part(self, chunk: Chunk, part: _Part, view: memoryview) -> None:
        ring, progress = self.ring, self.progress
        data = memoryview(ring.map)
        try:
            for w, src, off, n in self.pieces.get(id(chunk), []):
                if ring.landed <= w:
                    await ring.wait_landed(w)
                copy_bytes(view[off : off + n], data[src : src + n])
                progress.use_left[w] -= n
                progress.update()
        finally:
            data.release()


def _chunk_pieces(
    mine: Sequence[Chunk], blocks: list[NodeBlock], places: dict[int, tuple[int, int]]
) -> dict[int, list[tuple[int, int, int, int]]]:
    """Where each chunk's bytes are in the ring: its overlaps with the node's blocks."""
    by_file: dict[str, list[NodeBlock]] = {}
    for b in blocks:
        by_file.setdefault(b.name, []).append(b)
    starts = {f: [b.start for b in bs] for f, bs in by_file.items()}
    out: dict[int, list[tuple[int, int, int, int]]] = {}
    for c in mine:
        bs = by_file.get(c.name, [])
        i = max(0, bisect.bisect_right(starts.get(c.name, []), c.start) - 1)
        got: list[tuple[int, int, int, int]] = []
        while i < len(bs) and bs[i].start < c.end:
            b = bs[i]
            a, e = max(b.start, c.start), min(b.end, c.end)
            if a < e:
                w, at = places[b.seq]
                got.append((w, at + a - b.start, a - c.start, e - a))
            i += 1
        out[id(c)] = got
    return out


def _overlap(ranges: list[tuple[int, int]], a: int, b: int) -> int:
    return sum(max(0, min(b, e) - max(a, s)) for s, e in ranges)


async def run_node_phase(
    share: Share,
    pipeline: Pipeline,
    mine: Sequence[Chunk],
    needs: Sequence[Any],
    nodes: list[list[int]],
    token: str,
    phase: int,
    tag_base: int,
    unit: int,
    adaptive: bool,
    what: str,
    proofs: Sequence[str] | None = None,
) -> None:
    """Run one read phase of node-aware sharing on this rank (see the module's docstring).
    ``proofs``: per group rank, the random hex value it sent in the first all-gather; the
    node's ranks prove with them that they share the ring (:func:`_prove_node`)."""
    rank = share.rank
    monitor = share.monitor
    node = next(k for k, ranks in enumerate(nodes) if rank in ranks)
    ranks = nodes[node]
    budget = pipeline.config.memory.budget
    # blocks of a provisional size give each node's total; the real ones follow from the
    # largest, the same on every rank (block numbers name tags and claim keys across nodes:
    # a node that sized its blocks from its own total would number them differently)
    totals = [0] * len(nodes)
    for b in plan_blocks(needs, nodes, 1 << 40):
        for k in b.nodes:
            totals[k] += b.nbytes
    total = max(totals)
    block, slot = ring_geometry(total, budget, unit)
    blocks = plan_blocks(needs, nodes, block, node)
    window_of = plan_windows([b.nbytes for b in blocks], slot)
    windows = (window_of[-1] + 1) if blocks else 0
    places: dict[int, tuple[int, int]] = {}
    head = -(-_HEAD * len(ranks) // _PAGE) * _PAGE
    used = 0
    for i, b in enumerate(blocks):
        if i and window_of[i] != window_of[i - 1]:
            used = 0
        places[b.seq] = (window_of[i], head + (window_of[i] % RING_SLOTS) * slot + used)
        used += b.nbytes
    ring_bytes = min(windows, RING_SLOTS) * slot
    files = NodeFiles(_token(token, phase, node), {"ring": head + ring_bytes})
    try:
        local = ranks.index(rank)
        if proofs is not None:  # this rank's value, in its slot of the head, for its node peers
            files.maps["ring"][local * _HEAD + _PROOF : local * _HEAD + _PROOF + 8] = _proof_bytes(
                proofs[rank]
            )
        await monitor.abarrier(
            f"node-open-{phase}", "waiting for the other ranks to open their node's ring"
        )
        if proofs is not None:
            _prove_node(files, ranks, proofs, share.node_id, rank)
        files.unlink()  # every rank of the node has mapped it
        pipeline.stats.maximum("node_shared_memory_bytes", ring_bytes)
        ring = _Ring(files, ranks.index(rank), len(ranks), head, slot, monitor, ranks)
        ring.peers = [r for r in ranks if r != rank]
        progress = _Progress(ring, windows)
        pieces = _chunk_pieces(mine, blocks, places)
        for ps in pieces.values():
            for w, _, _, n in ps:
                progress.use_left[w] += n
        for i, b in enumerate(blocks):
            if b.fetcher(node) == rank:
                progress.fetch_left[window_of[i]] += 1
        mine_needs = {
            f: [(int(lo), int(hi)) for lo, hi in arr.tolist()]
            for f, arr in _rank_arrays(needs[rank]).items()
        }
        own = sum(
            _overlap(mine_needs.get(b.name, []), b.start, b.end)
            for b in blocks
            if b.fetcher(node) != rank
        )
        pipeline.stats.add(bytes_from_own_node=own)
        parts = {id(c): [_Part(c.start, c.end, "read")] for c in mine}
        hand = _FromRing(pipeline, share, parts, tag_base, len(mine))
        hand.ring, hand.progress, hand.pieces = ring, progress, pieces
        progress.update()
        t0 = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            poller = tg.create_task(ring.poll(lambda: share.doing))
            try:
                async with asyncio.TaskGroup() as inner:
                    inner.create_task(
                        _drive(share, pipeline, ring, progress, blocks, window_of, places,
                               node, tag_base, adaptive, phase)
                    )  # fmt: skip
                    inner.create_task(hand.run(mine))
            finally:
                poller.cancel()
        log.debug(
            "rank %d, %s: %d windows of %d bytes, %d blocks of %d bytes for its node in %.3f s; "
            "waited %.3f s for windows to land, %.3f s for free slots, %.3f s claiming",
            rank, what, windows, slot, len(blocks), block, time.monotonic() - t0,
            ring.times["landed"], ring.times["slot"], ring.times["claims"],
        )  # fmt: skip
    finally:
        files.unlink()
        files.close()


async def _drive(
    share: Share,
    pipeline: Pipeline,
    ring: _Ring,
    progress: _Progress,
    blocks: list[NodeBlock],
    window_of: list[int],
    places: dict[int, tuple[int, int]],
    node: int,
    tag_base: int,
    adaptive: bool,
    phase: int,
) -> None:
    """Fetch, window by window as slots free up, the blocks this rank fetches for its node.
    A block several nodes need is read and sent to the other nodes' fetchers, or received
    from the one that read it: adaptive, as :class:`NodeClaims` decides (work stealing from
    the planned split); static, by the planned owner node's fetcher (in each window its
    node's planned blocks first, then the others' receives)."""
    rank = share.rank
    monitor = share.monitor
    stats = pipeline.stats
    verify = pipeline.config.checks.verify
    files = ring.files
    data = memoryview(ring.map)
    per_window: list[list[NodeBlock]] = [[] for _ in range(progress.windows)]
    for i, b in enumerate(blocks):
        if b.fetcher(node) == rank:
            per_window[window_of[i]].append(b)
    slots = Meter(
        max(2, min(16, pipeline.config.concurrency.initial)), name="node reads", unit="reads"
    )
    prefix = f"nb/{phase}/"
    store = monitor.store
    claims: NodeClaims | None = None

    def landed(w: int) -> None:
        progress.fetch_left[w] -= 1
        progress.update()
        monitor.progress()  # progress the node's ranks waiting on this window see

    tracing = log.isEnabledFor(logging.DEBUG)

    async def read(b: NodeBlock, view: memoryview) -> None:
        t0 = time.monotonic()
        await pipeline.storage.readinto(b.name, b.start, [view])
        t1 = time.monotonic()
        stats.add(chunks=1, storage_wait_seconds=t1 - t0)
        if tracing:
            log.debug("trace read rank=%d seq=%d bytes=%d t0=%.4f dt=%.4f",
                      rank, b.seq, b.nbytes, time.time() - (t1 - t0), t1 - t0)  # fmt: skip

    async def read_only(b: NodeBlock, view: memoryview, w: int) -> None:
        try:
            await read(b, view)
        finally:
            slots.release()
        landed(w)

    async def read_send(b: NodeBlock, view: memoryview, w: int) -> None:
        try:
            await read(b, view)
        finally:
            slots.release()
        if claims is not None:
            claims.landed(b.nbytes)
        landed(w)
        if b.owner != node:
            stats.add(bytes_taken_over=b.nbytes)
        peers = [f for k, f in zip(b.nodes, b.fetchers) if k != node]
        if verify:
            post_digest(share, tag_base + b.seq, view)
        await share.transport.exchange(
            "send", peers, tag_base + b.seq, b.seq, view, files, monitor,
            f"sending bytes [{b.start}, {b.end}) of {b.name} to rank(s) {peers}",
        )  # fmt: skip
        stats.add(bytes_sent=b.nbytes * len(peers))
        progress.send_left[w] -= 1
        progress.update()

    async def receive(b: NodeBlock, view: memoryview, src: int, w: int) -> None:
        t0 = time.monotonic()
        await share.transport.exchange(
            "recv", [src], tag_base + b.seq, b.seq, view, files, monitor,
            f"waiting for bytes [{b.start}, {b.end}) of {b.name} from rank {src}",
        )  # fmt: skip
        if verify:
            check_digest(
                share, tag_base + b.seq, view, src, f"bytes [{b.start}, {b.end}) of {b.name}"
            )
        if tracing:
            dt = time.monotonic() - t0
            log.debug("trace recv rank=%d seq=%d src=%d t0=%.4f dt=%.4f",
                      rank, b.seq, src, time.time() - dt, dt)  # fmt: skip
        stats.add(bytes_received=b.nbytes, bytes_from_other_nodes=b.nbytes)
        landed(w)

    def in_order(w: int) -> list[NodeBlock]:
        """Window ``w``'s blocks of this rank: its node's planned ones first, then the
        others' from the back (round-robin over their owners)."""
        todo = per_window[w]
        front = [b for b in todo if b.owner == node or len(b.nodes) == 1]
        queues: dict[int, list[NodeBlock]] = {}
        for b in todo:
            if not (b.owner == node or len(b.nodes) == 1):
                queues.setdefault(b.owner, []).append(b)
        back: list[NodeBlock] = []
        rest = [list(reversed(q)) for _, q in sorted(queues.items())]
        while any(rest):
            for q in rest:
                if q:
                    back.append(q.pop(0))
        return front + back

    claim_waits: list[Any] = []  # the deadline of the claims' wait on a block's owner

    def check_idle(peers: list[int]) -> None:
        idle = monitor.idle_peer(peers)
        if idle is not None:
            monitor._give_up(idle[0], None, idle[1], idle[2], share.doing)
        if not claim_waits or claim_waits[0].peers != peers:
            claim_waits[:] = [
                monitor.peer_wait(peers, f"rank(s) {peers} to claim or hand over their blocks")
            ]
        claim_waits[0].check()

    def lost(w: int) -> None:  # a block of window w this rank will not send
        progress.send_left[w] -= 1
        progress.update()

    try:
        async with asyncio.TaskGroup() as tg:
            if adaptive:
                claims = NodeClaims(
                    rank=rank, node=node, store=store, prefix=prefix, ring=ring, slots=slots,
                    read_send=read_send, receive=receive, lost=lost, written=monitor._written,
                    beat=monitor.beat, check_idle=check_idle, times=ring.times,
                    key_name=monitor.key_name,
                )  # fmt: skip
                claims_task = tg.create_task(claims.run(tg))
            for w in range(progress.windows):
                todo = per_window[w] if claims is not None else in_order(w)
                if w >= RING_SLOTS and ring.released <= w - RING_SLOTS:
                    share.monitor.progress(f"{share.doing}: waiting for a free window")
                    await ring.wait_released(w - RING_SLOTS)
                for b in todo:
                    _, at = places[b.seq]
                    files.reserve("ring", at, at + b.nbytes)
                    view = data[at : at + b.nbytes]
                    if len(b.nodes) == 1:
                        await slots.acquire()
                        tg.create_task(read_only(b, view, w))
                        continue
                    if claims is not None:  # decided by the claims (work stealing)
                        progress.send_left[w] += 1  # until the claim tells
                        claims.add(b, view, w)
                        continue
                    winner = b.fetcher(b.owner)
                    if winner == rank:
                        await slots.acquire()
                        progress.send_left[w] += 1
                        tg.create_task(read_send(b, view, w))
                    else:
                        tg.create_task(receive(b, view, winner, w))
                    monitor.progress(f"{share.doing}: fetching blocks for its node")
                progress.driven = w + 1
                progress.update()
                if claims is not None:
                    claims.drove(w + 1)
            if claims is not None:
                claims.close()
                await claims_task
                log.debug(
                    "rank %d: %d store operations for claims, %d blocks taken over",
                    rank, claims.ops, claims.stolen,
                )  # fmt: skip
    finally:
        try:
            data.release()
        except BufferError:  # pragma: no cover - a transfer abandoned after a failure
            pass
