"""Node-aware sharing: ranks grouped into nodes (hosts), every byte entering each node once.

When the ranks of a ``ShardedLoadPlanner`` load sit on two or more nodes and some node holds
two or more of them, a read phase runs in two stages instead of rank-to-rank sharing:

1. **fetch**: the union of what a node's ranks need is cut into *blocks* (each at most a few
   work units); every block a node needs is fetched for it by one of its ranks (its
   *fetcher*, chosen per block so that a node's ranks fetch about equal bytes), into a file
   in shared memory (``/dev/shm``) at the block's file offset. A block that several nodes
   need is read from storage by one of them: the first fetcher to get to it claims it for
   its node with one ``compare_set`` in the group's store (each node starts with its planned
   queue and then takes over other nodes' blocks from the back, as adaptive sharing does
   between ranks), reads it and sends it (gloo, point to point) to the fetcher of every
   other node that needs it. Claim traffic is one store operation per block and node that
   needs it: it grows with nodes, not ranks x units;
2. **hand-over**: after a monitored barrier, each rank assembles its chunks from its node's
   shared-memory files (a memory copy; nothing crosses the process group inside a node).

:func:`plan_blocks` is the pure plan (the same on every rank); :func:`run_node_phase` runs one
phase on this rank; :class:`NodeFiles` owns the shared-memory files (removed on every exit
path: after the barrier every rank has them mapped, so each unlinks them; an error unlinks
them too, and interpreter exit removes any left behind).
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncload._errors import AsyncLoadError
from asyncload.distributed.plan import _Part
from asyncload.distributed.shared import Share, _SharedPipeline
from asyncload.engine.assembly import copy_bytes
from asyncload.engine.chunks import Chunk
from asyncload.engine.pipeline import Pipeline

__all__ = ["NodeBlock", "NodeFiles", "node_layout", "plan_blocks"]

#: Blocks are at most this many work units (one claim covers them all).
BLOCK_UNITS = 4


def node_layout(node_ids: Sequence[str]) -> list[list[int]] | None:
    """The ranks of each node (nodes in order of their lowest rank) when node-aware sharing
    applies: at least two nodes, and one of them with two ranks or more; else None."""
    nodes: dict[str, list[int]] = {}
    for r, n in enumerate(node_ids):
        nodes.setdefault(str(n), []).append(r)
    groups = list(nodes.values())
    if len(groups) < 2 or all(len(g) == 1 for g in groups):
        return None
    return groups


@dataclass(frozen=True)
class NodeBlock:
    """Bytes ``[start, end)`` of file ``name`` that the nodes ``nodes`` need (node indexes,
    ascending); ``fetchers[i]`` is the rank of node ``nodes[i]`` that fetches it for its
    node; ``owner``: the node planned to read it from storage (where claims start)."""

    index: int
    name: str
    start: int
    end: int
    nodes: tuple[int, ...]
    fetchers: tuple[int, ...]
    owner: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def fetcher(self, node: int) -> int:
        return self.fetchers[self.nodes.index(node)]


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def plan_blocks(
    needs: Sequence[Sequence[tuple[str, int, int]]],
    nodes: Sequence[Sequence[int]],
    block_size: int,
) -> list[NodeBlock]:
    """The node-level plan of one read phase (the same on every rank): per node the union of
    its ranks' needed ranges ``(file, start, end)``, cut at every node's boundaries and into
    blocks of at most ``block_size`` bytes; each block's fetcher in each node that needs it
    (the node's rank with the fewest fetched bytes so far) and its planned owner node (among
    those that need it, the one with the fewest planned bytes so far)."""
    # per file, the nodes' unions as events: (offset, +1 starts / -1 ends, node)
    events: dict[str, list[tuple[int, int, int]]] = {}
    for k, ranks in enumerate(nodes):
        by_file: dict[str, list[tuple[int, int]]] = {}
        for r in ranks:
            for name, a, b in needs[r]:
                if b > a:
                    by_file.setdefault(name, []).append((a, b))
        for name, rs in by_file.items():
            ev = events.setdefault(name, [])
            for a, b in _union(rs):
                ev.append((a, 1, k))
                ev.append((b, -1, k))
    fetched = {r: 0 for ranks in nodes for r in ranks}
    planned = [0] * len(nodes)
    blocks: list[NodeBlock] = []
    for name in sorted(events):
        ev = sorted(events[name])
        active: set[int] = set()
        i = 0
        while i < len(ev):
            pos = ev[i][0]
            while i < len(ev) and ev[i][0] == pos:  # every change at this offset
                _, d, k = ev[i]
                if d > 0:
                    active.add(k)
                else:
                    active.discard(k)
                i += 1
            if not active or i == len(ev):
                continue
            members = sorted(active)
            for s in range(pos, ev[i][0], block_size):
                e = min(ev[i][0], s + block_size)
                n = e - s
                fetchers = []
                for k in members:
                    r = min(nodes[k], key=lambda x: (fetched[x], x))
                    fetched[r] += n
                    fetchers.append(r)
                owner = min(members, key=lambda k: (planned[k], k))
                planned[owner] += n
                blocks.append(
                    NodeBlock(len(blocks), name, s, e, tuple(members), tuple(fetchers), owner)
                )
    return blocks


# --- shared memory ---------------------------------------------------------------------------

_live_paths: set[str] = set()
_live_lock = threading.Lock()
_exit_hook: list[bool] = []


def _remove_left_behind() -> None:
    with _live_lock:
        paths = list(_live_paths)
        _live_paths.clear()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def shm_dir() -> str:
    """Where node files live: ``/dev/shm`` (memory) where it exists, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class NodeFiles:
    """One node's shared-memory files of one read phase: per checkpoint file, a sparse file
    as long as the furthest byte the node needs, mapped by every rank of the node (each
    creates or opens it: same name, same size). :meth:`unlink` once every rank has mapped
    them (the mappings stay valid); :meth:`close` unmaps. Names carry a token agreed by the
    node (unique per load), so two jobs on one host never meet."""

    def __init__(self, token: str, sizes: dict[str, int]) -> None:
        self.paths: dict[str, str] = {}
        self.maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, int] = {}
        base = shm_dir()
        with _live_lock:
            if not _exit_hook:
                _exit_hook.append(True)
                atexit.register(_remove_left_behind)
        try:
            for i, name in enumerate(sorted(sizes)):
                size = sizes[name]
                if size <= 0:
                    continue
                path = os.path.join(base, f"asyncload-{token}-{i}")
                with _live_lock:
                    _live_paths.add(path)
                self.paths[name] = path
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                self._fds[name] = fd
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self.maps[name] = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            self.close()
            raise

    def reserve(self, name: str, start: int, end: int) -> None:
        """Allocate ``[start, end)`` of ``name``'s file before writing into its mapping, so
        that a full ``/dev/shm`` fails here, as an error, not later with SIGBUS."""
        if not hasattr(os, "posix_fallocate"):  # pragma: no cover - not on Linux
            return
        try:
            os.posix_fallocate(self._fds[name], start, end - start)
        except OSError as exc:
            raise AsyncLoadError(
                f"node-aware sharing could not stage bytes [{start}, {end}) of {name} in "
                f"{self.paths[name]} ({exc}): free space in {shm_dir()}, or load with "
                "ShardedLoadPlanner(node_id=<one id for every rank>) to share rank to rank"
            ) from exc

    def view(self, name: str, start: int, end: int) -> memoryview:
        return memoryview(self.maps[name])[start:end]

    def unlink(self) -> None:
        for path in self.paths.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            with _live_lock:
                _live_paths.discard(path)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a transfer abandoned after a failure still holds a view
                pass
        self.maps = {}


def _token(gathered_token: str, phase: int, node: int) -> str:
    return hashlib.sha256(f"{gathered_token}/{phase}/{node}".encode()).hexdigest()[:20]


# --- one phase on this rank -------------------------------------------------------------------


class _FromNode(_SharedPipeline):
    """The hand-over: every chunk's bytes copied from the node's shared-memory files."""

    files: NodeFiles

    async def _read_part(self, chunk: Chunk, part: _Part, view: memoryview) -> None:
        src = self.files.view(chunk.name, part.start, part.end)
        try:
            copy_bytes(view, src)
        finally:
            src.release()


def _overlap(ranges: list[tuple[int, int]], a: int, b: int) -> int:
    return sum(max(0, min(b, e) - max(a, s)) for s, e in ranges)


async def run_node_phase(
    share: Share,
    pipeline: Pipeline,
    mine: Sequence[Chunk],
    needs: Sequence[Sequence[tuple[str, int, int]]],
    nodes: list[list[int]],
    token: str,
    phase: int,
    tag_base: int,
    unit: int,
    adaptive: bool,
    what: str,
) -> None:
    """Run one read phase of node-aware sharing on this rank (see the module's docstring):
    fetch this rank's blocks into the node's files, then assemble its chunks from them."""
    rank = share.rank
    monitor = share.monitor
    node = next(k for k, ranks in enumerate(nodes) if rank in ranks)
    block = max(unit, BLOCK_UNITS * unit)
    blocks = plan_blocks(needs, nodes, block)
    sizes: dict[str, int] = {}
    for b in blocks:
        if node in b.nodes:
            sizes[b.name] = max(sizes.get(b.name, 0), b.end)
    files = NodeFiles(_token(token, phase, node), sizes)
    try:
        await _fetch(share, pipeline, files, blocks, node, tag_base, adaptive, phase)
        await monitor.abarrier(
            f"node-fetch-{phase}", f"waiting for the other ranks to fetch {what} for their nodes"
        )
        files.unlink()  # every rank of the node has mapped them
        mine_needs: dict[str, list[tuple[int, int]]] = {}
        for name, lo, hi in needs[rank]:
            mine_needs.setdefault(name, []).append((lo, hi))
        own = sum(
            _overlap(mine_needs.get(b.name, []), b.start, b.end)
            for b in blocks
            if node in b.nodes and b.fetcher(node) != rank
        )
        pipeline.stats.add(bytes_from_own_node=own)
        parts = {id(c): [_Part(c.start, c.end, "read")] for c in mine}
        hand = _FromNode(pipeline, share, parts, tag_base, len(mine))
        hand.files = files
        await hand.run(mine)
    finally:
        files.unlink()
        files.close()


async def _fetch(
    share: Share,
    pipeline: Pipeline,
    files: NodeFiles,
    blocks: list[NodeBlock],
    node: int,
    tag_base: int,
    adaptive: bool,
    phase: int,
) -> None:
    """Fetch the blocks this rank fetches for its node: its node's planned blocks first,
    then the others' from the back (round-robin over their owners); a block several nodes
    need is claimed for the node (one ``compare_set``), read and sent to the other nodes'
    fetchers, or received from the claimant."""
    rank = share.rank
    monitor = share.monitor
    stats = pipeline.stats
    todo = [b for b in blocks if node in b.nodes and b.fetcher(node) == rank]
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
    order = front + back
    slots = asyncio.Semaphore(max(2, min(16, pipeline.options.initial_concurrency)))
    prefix = f"nb/{phase}/"
    store = monitor.store

    async def read(b: NodeBlock, view: memoryview) -> None:
        t0 = time.monotonic()
        await pipeline.storage.readinto(b.name, b.start, [view])
        stats.add(chunks=1, storage_wait_seconds=time.monotonic() - t0)

    async def send(b: NodeBlock, view: memoryview, peers: list[int]) -> None:
        await share.transport.exchange(
            "send",
            peers,
            tag_base + b.index,
            b.index,
            view,
            files,
            monitor,
            f"sending bytes [{b.start}, {b.end}) of {b.name} to rank(s) {peers}",
        )
        stats.add(bytes_sent=b.nbytes * len(peers))

    async def receive(b: NodeBlock, view: memoryview, src: int) -> None:
        await share.transport.exchange(
            "recv",
            [src],
            tag_base + b.index,
            b.index,
            view,
            files,
            monitor,
            f"waiting for bytes [{b.start}, {b.end}) of {b.name} from rank {src}",
        )
        stats.add(bytes_received=b.nbytes, bytes_from_other_nodes=b.nbytes)

    for b in order:  # every block this rank writes, allocated up front
        files.reserve(b.name, b.start, b.end)
    async with asyncio.TaskGroup() as tg:
        for b in order:
            view = files.view(b.name, b.start, b.end)
            if len(b.nodes) == 1:
                await slots.acquire()
                task = tg.create_task(read(b, view))
                task.add_done_callback(lambda _t: slots.release())
                continue
            if adaptive:
                await slots.acquire()
                got = store.compare_set(f"{prefix}{b.index}", "", str(rank)).decode()
                winner = int(got)
                if winner == rank:
                    monitor._written.append(f"{prefix}{b.index}")
                else:
                    slots.release()
            else:
                winner = b.fetcher(b.owner)
                if winner == rank:
                    await slots.acquire()
            if winner == rank:

                async def read_send(b: NodeBlock = b, view: memoryview = view) -> None:
                    try:
                        await read(b, view)
                    finally:
                        slots.release()
                    if b.owner != node:
                        stats.add(bytes_taken_over=b.nbytes)
                    await send(b, view, [f for k, f in zip(b.nodes, b.fetchers) if k != node])

                tg.create_task(read_send())
            else:
                tg.create_task(receive(b, view, winner))
            monitor.progress(f"{share.doing}: fetching blocks for its node")
