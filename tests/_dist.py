"""Multi-process test harness: run a function on every rank of a fresh gloo process group.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forkserver, with
torch and asyncload preloaded, so a rank starts in a fraction of a second), each joins a
gloo process group on a free TCP port of 127.0.0.1 and calls ``fn(rank, world_size,
*args)``; the return value or the exception comes back as a :class:`RankResult`. Ranks
still running at the deadline are killed (by the process ids started here) and
reported as ``timed_out``. ``fn`` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankResult", "all_ok", "free_port", "run_ranks"]

_CTX: Any = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            [
                "torch",
                "torch._dynamo",
                "torch.distributed",
                "torch.distributed.checkpoint",
                "torch.distributed.tensor",
                "asyncload",
            ]
        )
        _CTX = ctx
    return _CTX


@dataclass
class RankResult:
    rank: int
    #: ``ok``, ``error`` or ``timed_out`` (killed at the deadline, or died without a word).
    status: str
    value: Any = None
    error_type: str = ""
    #: The exception's class and its bases' names (``DistributedLoadError``, ``AsyncLoadError``...).
    error_types: tuple[str, ...] = ()
    message: str = ""
    traceback: str = ""
    #: ``rank`` and ``doing`` of a DistributedLoadError.
    attrs: dict[str, Any] = field(default_factory=dict)
    #: Seconds from the start of the run until this rank reported.
    seconds: float = 0.0
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    results: Any,
    release: Any,
    pg_timeout: float,
    linger: float,
    args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world, *args)
        results.put((rank, "ok", value, None))
    except BaseException as exc:
        info = {
            "type": type(exc).__name__,
            "types": tuple(c.__name__ for c in type(exc).__mro__),
            "message": str(exc),
            "traceback": traceback.format_exc(),
            "attrs": {k: getattr(exc, k) for k in ("rank", "doing") if hasattr(exc, k)},
        }
        results.put((rank, "error", None, info))
    finally:
        # flush the result; stay until every rank has reported (rank 0 hosts the store the
        # others may still be reading), then leave at once: a failed load may leave gloo
        # transfers pending that would make an orderly interpreter exit wait for them
        results.close()
        results.join_thread()
        release.wait(linger)
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 30.0,
    pg_timeout: float = 60.0,
    may_hang: frozenset[int] | set[int] = frozenset(),
    grace: float = 1.0,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; wait at most ``timeout`` s.

    Ranks in ``may_hang`` are not waited for once every other rank has reported (plus
    ``grace`` seconds): a test of a stalled rank kills it as soon as the others are done.
    """
    ctx = _context()
    results = ctx.Queue()
    release = ctx.Event()
    port = free_port()
    t0 = time.monotonic()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, results, release, pg_timeout, timeout, args),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, RankResult] = {}
    deadline = t0 + timeout
    try:
        others_done_at: float | None = None
        while len(out) < world_size:
            if others_done_at is None and all(
                r in out for r in range(world_size) if r not in may_hang
            ):
                others_done_at = time.monotonic()
            if others_done_at is not None and time.monotonic() - others_done_at >= grace:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value, info = results.get(timeout=min(left, 0.2))
            except queue.Empty:
                # a rank that died without reporting (killed, segfault) will never report
                if (
                    all(not p.is_alive() for i, p in enumerate(procs) if i not in out)
                    and results.empty()
                ):
                    time.sleep(0.2)
                    if results.empty():
                        break
                continue
            r = RankResult(rank, status, value, seconds=time.monotonic() - t0)
            if info is not None:
                r.error_type = info["type"]
                r.error_types = info["types"]
                r.message = info["message"]
                r.traceback = info["traceback"]
                r.attrs = info["attrs"]
            out[rank] = r
    finally:
        release.set()
        for p in procs:
            p.join(2)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        results.close()
    for r, p in enumerate(procs):
        if r not in out:
            out[r] = RankResult(r, "timed_out", seconds=time.monotonic() - t0)
        out[r].exitcode = p.exitcode
    return [out[r] for r in range(world_size)]


def all_ok(results: list[RankResult]) -> list[Any]:
    """The ranks' return values; fails the test with every rank's traceback otherwise."""
    bad = [r for r in results if not r.ok]
    if bad:
        lines = [
            f"rank {r.rank}: {r.status} {r.error_type}: {r.message}\n{r.traceback}" for r in bad
        ]
        raise AssertionError("not every rank succeeded:\n" + "\n".join(lines))
    return [r.value for r in results]
