"""Node-aware sharing: ranks grouped into nodes (hosts), every byte entering each node once.

When the ranks of a ``ShardedLoadPlanner`` load sit on two or more nodes and some node holds
two or more of them, a read phase runs node by node instead of rank to rank: the union of
what a node's ranks need is cut into *blocks* (each at most a few work units); every block a
node needs is fetched for it by one of its ranks (its *fetcher*, rotating over the node's
ranks block by block) into the node's shared memory (``/dev/shm``). A block that several
nodes need is read from storage by one of them: the first fetcher to get to it claims it for
its node with one ``compare_set`` in the group's store (each node starts with its planned
blocks and then takes over other nodes' blocks from the back, as adaptive sharing does
between ranks), reads it and sends it (gloo, point to point) to the fetcher of every other
node that needs it. Claim traffic is one store operation per block and node that needs it:
it grows with nodes, not ranks x units. The node's ranks copy their chunks out of shared
memory (nothing crosses the process group inside a node), window by window while the next
window is fetched: :mod:`asyncload.distributed.node_phase` runs a phase.

:func:`plan_blocks` is the pure plan (the same on every rank of a node); :class:`NodeFiles`
owns the shared-memory files (removed on every exit path: once every rank of the node has
them mapped, each unlinks them; an error unlinks them too, and interpreter exit removes any
left behind).
"""

from __future__ import annotations

import atexit
import hashlib
import mmap
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from asyncload.common.errors import AsyncLoadError

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
    it rotates over the node's ranks (the blocks a node is planned to read in the file, and
    those it receives, each kind in its own turn); its planned owner node is, among the nodes that need it, the one with the fewest
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
        # per node, blocks it reads (as the owner) and blocks it receives so far in the file:
        # each kind rotates over the node's ranks on its own (reads from the first rank up,
        # receives from the last down), so every rank reads its share and fetches within a
        # block or so of the others (one rotation over both gave all of a node's reads to
        # one rank when the owners alternate over an even number of nodes)
        reads: dict[int, int] = {}  # blocks the node reads, so far in the file
        recvs: dict[int, int] = {}  # blocks it receives, before the current piece
        i = 0
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
            owned: dict[int, int] = {}  # blocks each member reads in this piece so far
            for j in range(count):
                a = pos + j * block_size
                b = min(end, a + block_size)
                owner = members[0]  # the member with the fewest planned bytes in this file
                for n in members:
                    if planned.get(n, 0) < planned.get(owner, 0):
                        owner = n
                planned[owner] = planned.get(owner, 0) + (b - a)
                if make:  # reads from a node's first rank up, receives from its last down
                    picks = tuple(
                        nodes[n][reads.get(n, 0) % len(nodes[n])]
                        if n == owner
                        else nodes[n][-1 - (recvs.get(n, 0) + j - owned.get(n, 0)) % len(nodes[n])]
                        for n in members
                    )
                    blocks.append(NodeBlock(base, name, a, b, members, picks, owner))
                reads[owner] = reads.get(owner, 0) + 1
                owned[owner] = owned.get(owner, 0) + 1
                base += 1
            for n in members:
                recvs[n] = recvs.get(n, 0) + count - owned.get(n, 0)
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
