"""Node-aware sharing: ranks grouped into nodes (hosts), every byte entering each node once.

When the ranks of a ``ShardedLoadPlanner`` load sit on two or more nodes and some node holds
two or more of them, a read phase runs in two stages instead of rank-to-rank sharing:

1. **fetch**: the union of what a node's ranks need is cut into *blocks* (each at most a few
   work units); every block a node needs is fetched for it by one of its ranks (its
   *fetcher*, rotating over the node's ranks block by block), into a file
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
from typing import Any, NamedTuple

import numpy as np

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


class NodeBlock(NamedTuple):
    """Bytes ``[start, end)`` of file ``name`` that the nodes ``nodes`` need (node indexes,
    ascending); ``fetchers[i]`` is the rank of node ``nodes[i]`` that fetches it for its
    node; ``owner``: the node planned to read it from storage (where claims start).
    ``seq``: its number in the phase (the same on every rank: tags and claim keys)."""

    seq: int
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


#: Node offsets in the merge's keys (file offsets stay below it).
_BIG = 1 << 42


def _rank_arrays(need: Any) -> dict[str, Any]:
    """One rank's needs as ``(n, 2)`` int64 arrays per file: from the packed form
    (``plan._pack``: per file, flat little-endian int64 offsets) or from ``(file, start,
    end)`` tuples."""
    if isinstance(need, dict):
        return {f: np.frombuffer(b, dtype="<i8").reshape(-1, 2) for f, b in need.items() if b}
    out: dict[str, list[tuple[int, int]]] = {}
    for name, a, b in need:
        out.setdefault(name, []).append((a, b))
    return {f: np.asarray(v, dtype=np.int64).reshape(-1, 2) for f, v in out.items()}


def _node_unions(parts: list[tuple[Any, int]]) -> tuple[Any, Any, Any]:
    """The union of each node's ranges in one file (ranges that overlap or touch joined):
    starts, ends and nodes, sorted by node then start."""
    s = np.concatenate([a[:, 0] for a, _ in parts])
    e = np.concatenate([a[:, 1] for a, _ in parts])
    k = np.concatenate([np.full(len(a), n, dtype=np.int64) for a, n in parts])
    keep = e > s
    s, e, k = s[keep], e[keep], k[keep]
    if not len(s):
        return s, e, k
    order = np.lexsort((s, k))
    s, e, k = s[order], e[order], k[order]
    off = k * _BIG  # a running maximum per node, in one pass
    top = np.maximum.accumulate(e + off)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] + off[1:] > top[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], top[last] - off[first], k[first]


def _block_count(s: Any, e: Any, block_size: int) -> int:
    """The number of blocks of a file whose node unions are ``s``, ``e``."""
    if not len(s):
        return 0
    bounds = np.unique(np.concatenate((s, e)))
    cnt = np.zeros(len(bounds), dtype=np.int64)
    np.add.at(cnt, np.searchsorted(bounds, s), 1)
    np.add.at(cnt, np.searchsorted(bounds, e), -1)
    covered = np.cumsum(cnt)[:-1] > 0
    lens = (bounds[1:] - bounds[:-1])[covered]
    return int(((lens + block_size - 1) // block_size).sum())


def plan_blocks(
    needs: Sequence[Any],
    nodes: Sequence[Sequence[int]],
    block_size: int,
    node: int | None = None,
) -> list[NodeBlock]:
    """The node-level plan of one read phase (the same on every rank): per node the union of
    its ranks' needed ranges (``needs[r]``: ``(file, start, end)`` tuples, or the packed form
    of the all-gather), cut at every node's boundaries and into blocks of at most
    ``block_size`` bytes, numbered in file order. A block's fetcher in each node that needs
    it rotates over the node's ranks (by the block's place in its piece and the piece's
    place in the file); its planned owner node is, among the nodes that need it, the one with the fewest
    planned bytes in the file so far (lowest first on ties). Both depend only on the file, so with
    ``node`` only the blocks that node needs are made (the others only counted, for the
    numbering): what a rank plans is proportional to its node's files."""
    node_of = {r: k for k, ranks in enumerate(nodes) for r in ranks}
    per_file: dict[str, list[tuple[Any, int]]] = {}
    for r, need in enumerate(needs):
        for f, arr in _rank_arrays(need).items():
            per_file.setdefault(f, []).append((arr, node_of[r]))
    blocks: list[NodeBlock] = []
    base = 0
    for name in sorted(per_file):
        s, e, k = _node_unions(per_file[name])
        if node is not None and node not in set(k.tolist()):
            base += _block_count(s, e, block_size)
            continue
        events = sorted(
            [(a, 1, n) for a, n in zip(s.tolist(), k.tolist())]
            + [(b, -1, n) for b, n in zip(e.tolist(), k.tolist())]
        )
        active: set[int] = set()
        planned: dict[int, int] = {}
        i = 0
        piece = 0
        while i < len(events):
            pos = events[i][0]
            while i < len(events) and events[i][0] == pos:  # every change at this offset
                _, d, n = events[i]
                if d > 0:
                    active.add(n)
                else:
                    active.discard(n)
                i += 1
            if not active or i == len(events):
                continue
            end = events[i][0]
            count = -(-(end - pos) // block_size)
            members = tuple(sorted(active))
            make = node is None or node in active  # else only numbered and balanced
            for j in range(count):
                a = pos + j * block_size
                b = min(end, a + block_size)
                owner = members[0]  # the member with the fewest planned bytes in this file
                for n in members:
                    if planned.get(n, 0) < planned.get(owner, 0):
                        owner = n
                planned[owner] = planned.get(owner, 0) + (b - a)
                if make:
                    fetchers = tuple(nodes[n][(j + piece) % len(nodes[n])] for n in members)
                    blocks.append(NodeBlock(base, name, a, b, members, fetchers, owner))
                base += 1
            piece += 1
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
    needs: Sequence[Any],
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
    blocks = plan_blocks(needs, nodes, block, node)
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
        mine_needs = {
            f: [(int(lo), int(hi)) for lo, hi in arr.tolist()]
            for f, arr in _rank_arrays(needs[rank]).items()
        }
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
            tag_base + b.seq,
            b.seq,
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
            tag_base + b.seq,
            b.seq,
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
                got = store.compare_set(f"{prefix}{b.seq}", "", str(rank)).decode()
                winner = int(got)
                if winner == rank:
                    monitor._written.append(f"{prefix}{b.seq}")
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
