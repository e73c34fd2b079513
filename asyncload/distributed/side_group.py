"""The gloo side group of adaptive sharing: for a load whose process group matches sends to
receives by order (NCCL), the shared bytes travel over a gloo group of the same ranks, where
point-to-point operations match by tag, in any order (``ShardedLoadPlanner(side_group=...)``).

- :func:`check_side_group`: a group given by the user is usable (gloo-like, the load's
  ranks in the load's order);
- :func:`cached_side_group`: the side group made for a process group by an earlier load (one
  per process group and process, reused by every later load on it);
- :func:`make_side_group`: makes it, on every rank of the group at once (``dist.new_group``
  is a collective): after a monitored barrier, on a thread of its own, the wait bounded by
  the load's monitor like every other wait on another rank, at the cost of a barrier's wait
  (one watcher reads the ranks whose part is not done, every other rank polls one key:
  :meth:`~asyncload.distributed.monitor.Monitor.await_together`).

The bytes stay in host memory: received into the request's staging memory, then copied once
to the device by the CUDA staging path (:mod:`asyncload.engine.cuda_ring`), as any chunk read from
storage is.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from asyncload.common.errors import AsyncLoadError, DistributedLoadError
from asyncload.common.loop import on_thread
from asyncload.distributed.monitor import Monitor

__all__ = ["cached_side_group", "check_side_group", "group_ranks", "make_side_group"]

log = logging.getLogger("asyncload.sharded")

#: Per process group (weakly: a destroyed group's entry goes with it): the side group made
#: for it, and how many loads used it.
_made: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _pg(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    pg = _pg(group)
    return [dist.get_global_rank(pg, r) for r in range(dist.get_world_size(pg))]


def _alive(group: Any) -> bool:
    """Whether ``group`` is still registered (``destroy_process_group`` removes it)."""
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return False
    return True


def check_side_group(side: Any, group: Any) -> None:
    """``side`` (given as ``ShardedLoadPlanner(side_group=...)``) can carry ``group``'s
    shared bytes: registered, a backend that matches point-to-point operations by tag (not
    NCCL), and the same ranks in the same order (group rank r of both is one process).

    Raised: ``AsyncLoadError`` naming what differs."""
    if not _alive(side):
        raise AsyncLoadError(
            "ShardedLoadPlanner(side_group=...) is not an initialised process group (it was "
            "destroyed, or never made): pass a gloo group of the load's ranks, 'auto' or None"
        )
    backend = str(dist.get_backend(side)).lower()
    if "nccl" in backend:
        raise AsyncLoadError(
            f"ShardedLoadPlanner(side_group=...) is a {backend} group, which matches sends by "
            "order: pass a gloo group of the load's ranks (or side_group='auto', which makes one)"
        )
    mine, theirs = group_ranks(group), group_ranks(side)
    if mine != theirs:
        raise AsyncLoadError(
            f"ShardedLoadPlanner(side_group=...) holds the global ranks {theirs} and the load's "
            f"process group {mine}: the side group needs the same ranks in the same order "
            f"(dist.new_group({mine}, backend='gloo'))"
        )


def cached_side_group(group: Any) -> Any | None:
    """The gloo side group made for ``group`` by an earlier load of this process, if it is
    still registered; else None."""
    pg = _pg(group)
    with _lock:
        side = _made.get(pg)
    if side is None or not _alive(side) or not _alive(pg):
        return None
    return side


def side_group_name(side: Any) -> str:
    """A name every rank gives the same side group (its torch group name)."""
    return str(
        getattr(side, "group_name", "") or dist.distributed_c10d._get_process_group_name(side)
    )


def _ops_timeout(side: Any) -> None:
    """Operations on the side group wait as long as torch's default for gloo (30 min; the
    monitor bounds the waits of a load), not the creation's bound."""
    try:
        dist.distributed_c10d._set_pg_timeout(default_pg_timeout, side)
    except (AttributeError, ValueError, RuntimeError):  # pragma: no cover - other torch versions
        log.debug("could not reset the side group's timeout", exc_info=True)


async def make_side_group(group: Any, monitor: Monitor, phase: int) -> Any:
    """Make a gloo group of ``group``'s ranks (every rank of ``group`` calls this at the same
    point, in the same order: ``dist.new_group`` is a collective) and cache it for later
    loads on ``group``. Bounded like every wait on another rank: a monitored barrier first (so
    that no rank enters while another has failed), then the creation on a daemon thread of
    its own while the ranks wait for each other through ``monitor``
    (:meth:`~asyncload.distributed.monitor.Monitor.await_together`: one watcher reads the
    ranks whose part is not done, every other rank polls one key; a failure posted by any rank
    ends the wait on every rank; a creation not done within ``collective_timeout`` ends it
    with ``DistributedLoadError``, on every rank: the thread is left to gloo's own timeout,
    the same bound). Every rank returns once every rank has the group.

    Raised: ``DistributedLoadError`` when torch cannot make the group."""
    doing = "making the gloo side group for adaptive sharing"
    await monitor.abarrier(f"side-group-{phase}", f"waiting for the other ranks before {doing}")
    pg = _pg(group)
    ranks = group_ranks(pg)
    # a group of the whole world: the plain collective, entered by every process; a subgroup:
    # only its members enter (torch's local synchronisation, hashed group name)
    local = len(ranks) < dist.get_world_size()
    # the rendezvous waits on the group's store, whose client connection the monitor shares:
    # gloo's own wait must end within the bound, or it would hold the monitor up too (a rank
    # whose rendezvous waits for a rank that has not entered it cannot beat meanwhile: so the
    # bound, not a stall verdict, ends a creation that waits for a rank, and it comes before
    # any verdict could, which would name a rank that only waits in gloo's rendezvous)
    bound = None if monitor.timeout is None else timedelta(seconds=monitor.timeout)

    def make() -> Any:
        value = dist.new_group(
            ranks,
            backend="gloo",
            timeout=bound,
            use_local_synchronization=local,
            group_desc="asyncload_side_group",
        )
        if bound is not None:
            _ops_timeout(value)
        return value

    monitor.status(doing)
    fut = on_thread(make, "asyncload-side-group")
    try:
        # every rank arrived at the barrier: a creation that takes longer than a rank may go
        # without progress is stuck in gloo's rendezvous (a connection between two ranks that
        # cannot be made), which the ranks' heartbeats would otherwise hide
        side = await asyncio.wait_for(
            monitor.await_together(fut, f"side-group-made-{phase}", doing), monitor.timeout
        )
    except TimeoutError as exc:
        raise DistributedLoadError(
            f"rank {monitor.rank} could not make the gloo side group of the ranks {ranks} within "
            f"LoadOptions.collective_timeout={monitor.timeout} s, although every rank had "
            "arrived to make it: gloo could not connect the ranks (check GLOO_SOCKET_IFNAME and "
            "that the ranks reach each other over TCP); pass ShardedLoadPlanner(side_group=None) "
            "to share statically over the load's group instead",
            rank=monitor.rank,
            doing=doing,
        ) from exc
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, DistributedLoadError):
            raise
        raise DistributedLoadError(
            f"rank {monitor.rank} could not make the gloo side group of the ranks {ranks} to share "
            f"bytes adaptively ({type(exc).__name__}: {exc}); pass "
            "ShardedLoadPlanner(side_group=None) to share statically over the load's group, or "
            "a gloo group of your own",
            rank=monitor.rank,
            doing=doing,
        ) from exc
    finally:
        if not fut.done():  # given up on (a peer failed or stalled): a late group is not used
            fut.cancel()
    with _lock:
        _made[pg] = side
    log.debug("rank %d made the gloo side group %s of ranks %s", monitor.rank, side, ranks)
    return side
