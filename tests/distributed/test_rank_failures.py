"""A rank that dies or hangs at each phase of a shared load (issue 43, items 3 and 6).

One rank (rank 1) either dies (``os._exit``) or hangs (its event loop blocked in a sleep while
a thread of its own keeps its heartbeat going, so the others cannot tell it from a rank that
waits on them) at a phase reached through a small hook, injected from here into that rank's
process: before the needs exchange (the metadata every rank all-gathers), during claims,
mid-transfer, holding a window of its node's ring, after writing into the ring and before the
ring's barrier, and at the last barrier. Every other rank raises ``DistributedLoadError`` in
bounded time (the harness kills what is still running at its deadline and reports it as
``timed_out``), no rank reports a load, and nothing is left in the shared-memory directory.
A ``/dev/shm`` too small for the ring (a 64 KiB tmpfs) fails every rank the same way.

Real gloo process groups of 2 and 4 ranks on loopback against a real DCP checkpoint on local
disk; nodes are simulated by ``ShardedLoadPlanner(node_id=...)``, and every rank's node files
go to a directory of the test (``nodes.shm_dir`` patched in each rank).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import RankResult, run_ranks
from test_distributed import big_model

import asyncload
from asyncload import LoadOptions, ShardedLoadPlanner
from asyncload.distributed import nodes

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10
MiB = 1 << 20
TIMEOUT = 2.0
#: The harness's deadline for a run (every surviving rank must have raised by then).
DEADLINE = 45.0
FAULTY = 1
#: Copies out of the ring the faulty rank makes before it faults in "window".
WINDOW_COPIES = 30


def _save(tmp_path: Path) -> str:
    path = str(tmp_path / "ck")
    dcp.save({k: v.clone() for k, v in big_model().items()}, checkpoint_id=path, no_dist=True)
    return path


def _left(where: str) -> set[str]:
    return (
        {n for n in os.listdir(where) if n.startswith("asyncload-")}
        if os.path.isdir(where)
        else set()
    )


# --- the faults (in the faulty rank's process) -----------------------------------------------

_monitors: list[Any] = []


def _fault(how: str) -> None:
    """Die at once, or hang: block this thread (the event loop's) for good while another
    thread keeps the rank's heartbeat going."""
    if how == "dies":
        os._exit(3)
    monitor = _monitors[-1]

    def beat() -> None:
        while True:
            monitor.beat()
            time.sleep(0.2)

    threading.Thread(target=beat, daemon=True).start()
    time.sleep(3600)


def _after(n: int, how: str) -> Any:
    """A hook that lets ``n`` calls pass, then faults."""
    calls = [0]

    def hit() -> None:
        calls[0] += 1
        if calls[0] > n:
            _fault(how)

    return hit


def _install(phase: str, how: str) -> None:
    from asyncload.distributed import claims, monitor, node_phase, transport

    init = monitor.Monitor.__init__

    def keep(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        _monitors.append(self)

    monitor.Monitor.__init__ = keep  # type: ignore[method-assign]
    if phase in ("needs", "ring-barrier"):
        prefix = "needs-" if phase == "needs" else "node-open-"
        real_ab = monitor.Monitor.abarrier

        async def abarrier(self: Any, name: str, doing: str) -> None:
            if name.startswith(prefix):
                _fault(how)
            await real_ab(self, name, doing)

        monitor.Monitor.abarrier = abarrier  # type: ignore[method-assign]
    elif phase == "done":
        real_b = monitor.Monitor.barrier

        def barrier(self: Any, name: str, doing: str) -> None:
            if name == "done":
                _fault(how)
            real_b(self, name, doing)

        monitor.Monitor.barrier = barrier  # type: ignore[method-assign]
    elif phase == "claims":
        hit = _after(2, how)
        real_claim = claims.Claims.claim

        async def claim(self: Any, *a: Any, **kw: Any) -> Any:
            hit()
            return await real_claim(self, *a, **kw)

        claims.Claims.claim = claim  # type: ignore[method-assign]
    elif phase == "transfer":
        hit = _after(1, how)
        real_ex = transport._Transport.exchange

        async def exchange(self: Any, op: str, *a: Any) -> Any:
            if op == "send":
                hit()
            return await real_ex(self, op, *a)

        transport._Transport.exchange = exchange  # type: ignore[method-assign]
    elif phase == "window":  # in the tensor data's phase (many windows: a 1 MiB budget)
        hit = _after(WINDOW_COPIES, how)
        real_copy = node_phase.copy_bytes

        def copy(*a: Any) -> Any:
            hit()
            return real_copy(*a)

        node_phase.copy_bytes = copy
    else:  # pragma: no cover - a phase this file does not know
        raise AssertionError(phase)


def w_fault(rank: int, world: int, path: str, shm: str, phase: str, how: str, node: str) -> Any:
    nodes.shm_dir = lambda: shm
    if rank == FAULTY and how:
        _install(phase, how)
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    planner: dict[str, Any] = {"sharing": "always", "unit_size": 16 * KiB, "wait_for_peers": True}
    if node:
        planner["node_id"] = node[rank]
    asyncload.load(
        sd, path,
        options=LoadOptions(
            chunk_size=64 * KiB, min_chunk_size=16 * KiB,
            memory_budget=1 * MiB if phase == "window" else 8 * MiB,
            collective_timeout=TIMEOUT,
        ),
        planner=ShardedLoadPlanner(**planner),
    )  # fmt: skip
    return "loaded"


def _survivors_raise(results: list[RankResult], faulty: int | None) -> None:
    for r in results:
        if r.rank == faulty:  # dead (no report) or hung (killed by the harness)
            assert r.status != "ok", (r.rank, r.status, r.value)
            continue
        assert r.status == "error", (r.rank, r.status, r.value, r.traceback)
        assert "DistributedLoadError" in r.error_types or "AsyncLoadError" in r.error_types, (
            r.rank,
            r.error_type,
            r.traceback,
        )


#: phase: the ranks' node ids ("": 2 ranks sharing rank to rank; "aabb": 4 ranks as nodes
#: a, a, b, b).
PHASES = {
    "needs": "",
    "claims": "",
    "transfer": "",
    "window": "aabb",
    "ring-barrier": "aabb",
    "done": "aabb",
}


@pytest.mark.parametrize("how", ["dies", "hangs"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_rank_that_dies_or_hangs_ends_every_other_rank(
    tmp_path: Path, phase: str, how: str
) -> None:
    """Rank 1 dies or hangs (beating) at ``phase``: every other rank raises, none reports a
    load, nothing is left in the node files' directory. A hung rank keeps beating: before
    every wait had a deadline, ranks waiting on it waited for ever."""
    path = _save(tmp_path)
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    node = PHASES[phase]
    results = run_ranks(
        w_fault, max(2, len(node)), path, shm, phase, how, node,
        timeout=DEADLINE, may_hang={FAULTY},
    )  # fmt: skip
    _survivors_raise(results, FAULTY)
    if how == "hangs":  # a deadline ended it: it names a rank that made no progress (the
        # hung one, or, in a chain of waits, a rank that waited on it)
        for r in results:
            if r.rank != FAULTY:
                assert "no progress" in r.message, (r.rank, r.message)
                assert r.attrs.get("rank") in range(len(results)), (r.rank, r.attrs)
    assert _left(shm) == set()


def test_the_control_loads(tmp_path: Path) -> None:
    """The control: the same load without a fault, on nodes a, a, b, b, loads on every rank."""
    path = _save(tmp_path)
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    results = run_ranks(w_fault, 4, path, shm, "window", "", "aabb", timeout=DEADLINE)
    assert [r.value for r in results] == ["loaded"] * 4, [(r.rank, r.message) for r in results]
    assert _left(shm) == set()


def test_a_full_dev_shm_fails_every_rank(tmp_path: Path) -> None:
    """The node's ring does not fit in its shared-memory directory (a 64 KiB tmpfs): every
    rank raises (the rank that could not stage names the directory), nothing is left."""
    shm = str(tmp_path / "tiny")
    os.makedirs(shm)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", shm], check=True)
    try:
        path = _save(tmp_path)
        results = run_ranks(w_fault, 4, path, shm, "", "", "aabb", timeout=DEADLINE)
        _survivors_raise(results, None)
        assert any("could not stage" in r.message for r in results), [r.message for r in results]
        assert _left(shm) == set()
    finally:
        subprocess.run(["umount", shm], check=True)


# --- the rule itself: a wait's deadline, progress that resets it -----------------------------


def w_waits(rank: int, world: int, chain: bool) -> Any:
    """``chain=False``: every rank waits on the next one (a cycle), nobody working, everybody
    beating. ``chain=True``: rank r waits on rank r - 1 and rank 0 works slowly (progress
    every 0.3 s for two timeouts), then tells rank 1, which tells rank 2 (a timeout of 1 s for
    the cycle, 3 s for the chain: progress crosses a hop of the chain within a beat or two)."""
    import asyncio

    from asyncload.distributed.monitor import Monitor

    timeout = 3.0 if chain else 1.0
    monitor = Monitor(None, timeout, None)

    async def main() -> str:
        loop = asyncio.get_running_loop()
        if not chain:
            never: asyncio.Future[None] = loop.create_future()
            await monitor.wait_on(never, [(rank + 1) % world], f"rank {rank}'s test")
            return "returned"
        store = monitor.store
        if rank == 0:
            for _ in range(20):
                monitor.progress("working slowly")
                await asyncio.sleep(0.3)
            store.set("t/0", "x")
            return "worked"

        async def told() -> None:
            while True:  # (the store cannot wake anyone: polled)
                if store.check([f"t/{rank - 1}"]):
                    return
                await asyncio.sleep(0.05)

        await monitor.wait_on(asyncio.ensure_future(told()), [rank - 1], "the one before")
        store.set(f"t/{rank}", "x")
        return "waited"

    return asyncio.run(main())  # (the harness keeps rank 0, the store's host, until all report)


def test_ranks_that_wait_on_each_other_in_a_cycle_all_raise(tmp_path: Path) -> None:
    """Three ranks each waiting on the next while beating (nobody is stalled by the old rule):
    every rank raises DistributedLoadError saying who made no progress on what, and since when."""
    results = run_ranks(w_waits, 3, False, timeout=DEADLINE)
    _survivors_raise(results, None)
    for r in results:
        assert "made no progress on it" in r.message and "since" in r.message, r.message
        assert r.attrs["rank"] in (0, 1, 2)


def test_a_slow_but_progressing_chain_is_waited_for(tmp_path: Path) -> None:
    """Rank 2 waits on rank 1, which waits on rank 0, which works for two timeouts before it
    tells rank 1: rank 1 relays rank 0's progress to rank 2, and nobody fails."""
    results = run_ranks(w_waits, 3, True, timeout=DEADLINE)
    assert [r.value for r in results] == ["worked", "waited", "waited"], [
        (r.rank, r.message) for r in results
    ]
