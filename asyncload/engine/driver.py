"""One driver for 1..N ranks: the planner sequence of a load, written once, run by two runners.

The sequence is ``dcp.load``'s (the same planner and reader calls, in the same order)::

    read .metadata -> set_up_planner -> set_up_storage_reader -> create_local_plan
      -> [N ranks: gather local plans -> create_global_plan on the coordinator -> scatter]
      -> finish_plan -> session reads -> commit tensors and objects -> Stateful.load_state_dict

It is a generator of steps (:func:`load_steps`): a :class:`Call` is planner work, a
collective or a hook (CPU, blocking); an :class:`Await` is the engine's I/O (a coroutine of
the :class:`~asyncload.engine.session.LoadSession`). The driver drives a session, not a
reader: the read sequence (:func:`read_steps`) is written here once, and
:meth:`asyncload.PipelinedReader.read_data` runs it too. The two runners decide where each runs:

* :func:`run_sync` (``load``, ``start_load``): calls on the caller's thread, coroutines on
  the library's loop thread;
* :func:`run_async` (``aload``): coroutines on the caller's own loop, calls on a worker
  thread so the loop stays free.

With N ranks every wait on another rank goes through the session's monitor (a
:class:`~asyncload.distributed.monitor.Monitor`, given to the session when the face made it;
bounded by the config's ``collective_timeout``; a failure on one rank is raised on all), and
the collectives are entered only after a monitored barrier saw every rank arrive.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from asyncload.common.errors import (
    CheckpointFormatError,
    DistributedLoadError,
    redact_url,
)
from asyncload.common.stats import LoadStats
from asyncload.engine.config import PlannerTerms
from asyncload.engine.destinations import PLAIN_TENSOR_TYPES, check_destinations
from asyncload.engine.metadata_read import (
    aread_metadata_like_dcp,
    aread_metadata_once,
    exchanges_metadata,
)
from asyncload.engine.session import LoadSession

if TYPE_CHECKING:  # DCP's types: annotations only (a load of a non-DCP file needs none)
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

__all__ = ["Await", "Call", "load_steps", "read_steps", "run_async", "run_sync"]

log = logging.getLogger("asyncload.driver")
T = TypeVar("T")

#: The members of ``torch.distributed.checkpoint.stateful.Stateful``.
_STATEFUL = ("state_dict", "load_state_dict")


class Call:
    """Blocking work: a planner hook, planning, a collective: ``fn(*args)``."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn = fn
        self.args = args


@dataclass
class Await:
    """A coroutine of the engine. ``cleanup``: runs even after the load was cancelled."""

    coro: Coroutine[Any, Any, Any]
    cleanup: bool = False


Step = Call | Await
Steps = Generator[Step, Any, T]


def run_sync(steps: Steps[T], session: LoadSession) -> T:
    """Drive ``steps`` from the calling thread: calls here, coroutines on the session's loop.

    An exception raised here (a Ctrl-C lands on this thread at any line, the loop's own
    included) goes into ``steps``, whose ``finally`` blocks then yield the steps that close
    what is open; only an exception that ``steps`` itself raised (it has ended) leaves. If
    an interrupt cut a ``finally`` block of the steps short, the session is closed here."""
    try:
        try:
            return _drive(steps, session, None)
        except BaseException as exc:
            if inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED:
                steps.close()  # never started (nothing is open), or ended
                raise
            return _drive(steps, session, exc)
    except BaseException:
        if session.open:
            session.close_quietly()
        raise


def _drive(steps: Steps[T], session: LoadSession, error: BaseException | None) -> T:
    """:func:`run_sync`'s loop, from ``error`` thrown into ``steps`` (or none)."""
    value: Any = None
    while True:
        step: Step | None = None
        try:
            try:
                step = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            value = error = None
            if isinstance(step, Call):
                value = step.fn(*step.args)
            else:
                value = session.run(step.coro, cleanup=step.cleanup)
        except BaseException as exc:
            if inspect.getgeneratorstate(steps) == inspect.GEN_CLOSED:
                raise
            value, error = None, exc
            if isinstance(step, Await):
                _missed(step, session)


def _missed(step: Await, session: LoadSession) -> None:
    """A step that an interrupt kept from being handed to the loop (it came between the
    step's arrival and :meth:`LoadSession.run`, which runs or closes what it is given): a
    cleanup step runs all the same (its own error is logged: the interrupt goes on), any
    other is closed unrun."""
    coro = step.coro
    if not inspect.iscoroutine(coro) or inspect.getcoroutinestate(coro) != inspect.CORO_CREATED:
        return
    if not step.cleanup:
        coro.close()
        return
    try:
        session.run(coro, cleanup=True)
    except Exception:
        log.warning("cleaning up after an interrupt failed", exc_info=True)


async def run_async(steps: Steps[T], session: LoadSession) -> T:
    """Drive ``steps`` on the running loop: coroutines here, calls on a worker thread."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        value = error = None
        try:
            if isinstance(step, Call):
                value = await _in_thread(step.fn, *step.args)
            elif step.cleanup:
                value = await step.coro
            else:
                value = await session.guard(step.coro)
        except BaseException as exc:
            error = exc


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn`` on a worker thread; a cancel waits for it to return (it cannot be interrupted,
    and the steps after it must not run beside it), then is raised."""
    ctx = contextvars.copy_context()
    fut = asyncio.get_running_loop().run_in_executor(None, functools.partial(ctx.run, fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        raise


def load_steps(
    state_dict: dict[str, Any],
    session: LoadSession,
    planner: LoadPlanner | None,
    choose: Callable[[Any, Any], tuple[Any, Any, PlannerTerms]] | None = None,
) -> Steps[LoadStats]:
    """The steps of one load into ``state_dict`` (in place), on every rank of the session's
    group (a session made with a monitor: more than one rank). What ``planner`` brings
    comes from the session's config (``config.planner``: the face resolved it). ``planner``
    None (one rank): ``choose(state_dict, metadata)`` makes it once the metadata is read,
    and may convert the metadata: ``(planner, metadata, terms)``, the terms handed to
    :meth:`LoadSession.planner_arrived` (``asyncload.faces.api._default_planner``)."""
    group = session.group
    use_dist = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if use_dist else 1
    keys = sorted(state_dict.keys())
    stateful = {
        k: state_dict[k].state_dict() if _is_stateful(state_dict[k]) else state_dict[k]
        for k in keys
    }
    check_destinations(stateful)  # before any I/O: memory that cannot be written, meta, sparse
    if planner is not None:
        _checked(session, stateful)  # the planner need not check them again
    log.debug(
        "loading %s into %d keys on %d rank(s)",
        redact_url(str(session.checkpoint)),
        len(state_dict),
        world,
    )
    try:
        if world > 1:
            if planner is None:
                raise DistributedLoadError("a load on more than one rank needs its planner")
            yield from _collective_steps(stateful, session, planner)
        else:
            session.begin()
            metadata, _ = yield Await(aread_metadata_like_dcp(session, 0))
            if planner is None:
                if choose is None:
                    raise DistributedLoadError("a load needs a planner or a way to make one")
                # (a call: it may import DCP, which aload keeps off its loop)
                planner, metadata, terms = yield Call(choose, stateful, metadata)
                session.planner_arrived(terms)
                _checked(session, stateful)
            yield Call(planner.set_up_planner, stateful, metadata, True)
            _check_storage_table(session, metadata)
            local = yield Call(planner.create_local_plan)
            central = yield Call(planner.create_global_plan, [local])
            final = yield Call(planner.finish_plan, central[0])
            yield from read_steps(session, metadata, final, planner)
    finally:
        if session.open:  # the reads' end closed everything already when they ran
            yield Await(session.aclose(), cleanup=True)
    for k in keys:
        if _is_stateful(state_dict[k]):
            state_dict[k].load_state_dict(stateful[k])
        else:
            state_dict[k] = stateful[k]
    stats = session.stats
    if stats is None:  # pragma: no cover - read_steps finishes the stats
        raise DistributedLoadError("the load ended without statistics")
    log.info("loaded %s: %s", redact_url(str(session.checkpoint)), stats)
    return stats


def _checked(session: LoadSession, state_dict: dict[str, Any]) -> None:
    """Tell the load's planner (its terms) that ``state_dict`` was checked before any I/O."""
    note = session.config.planner.destinations_checked
    if note is not None:
        note(state_dict)


def _check_storage_table(session: LoadSession, metadata: Metadata) -> None:
    """What ``PipelinedReader.set_up_storage_reader`` checks: the metadata locates its data."""
    if metadata.storage_data is None:
        raise CheckpointFormatError(f"{session.checkpoint}: metadata has no storage table")


def _is_stateful(value: Any) -> bool:
    """``isinstance(value, Stateful)``, skipping the protocol check (tens of microseconds a
    key) for a plain tensor or parameter, which has neither of its methods."""
    if type(value) in PLAIN_TENSOR_TYPES:
        return False
    stateful = sys.modules.get("torch.distributed.checkpoint.stateful")
    if stateful is not None and isinstance(value, stateful.Stateful):
        return True
    # the protocol's own test (``Stateful`` is a runtime-checkable Protocol): both methods
    # present, neither None; done here so that a load need not import DCP for it
    return all(getattr(value, name, None) is not None for name in _STATEFUL)


def read_steps(
    session: LoadSession, metadata: Metadata, plan: LoadPlan, planner: LoadPlanner
) -> Steps[None]:
    """The read sequence, written once (``load``'s driver and ``PipelinedReader.read_data``
    both run it): destinations resolved and committed by calls (planner hooks), the reads
    awaited, the reads' end (device copies finished, storage closed) on every path.

    A planner that shares bytes across ranks (``ShardedLoadPlanner``) takes over the reads
    through the share session its terms make (``session.config.planner.share``:
    :class:`~asyncload.engine.config.PlannerTerms`): ``share.run`` replaces ``Pipeline.run``,
    ``share.fail`` tells the other ranks."""
    make_share = session.config.planner.share
    share = make_share(session) if make_share is not None else None
    try:
        records = yield Call(session.prepare_reads, plan, planner, metadata)
        yield Await(session.aread(records, share.run if share is not None else None))
    except BaseException as exc:
        if share is not None:
            share.fail(exc)
        raise
    finally:
        yield Await(session.aend_reads(), cleanup=True)
    yield Call(session.commit, records, planner)
    session.finish()


def _collective_steps(
    state_dict: dict[str, Any], session: LoadSession, planner: LoadPlanner
) -> Steps[None]:
    """The N-rank sequence, with every wait on another rank bounded by the session's monitor."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    monitor = session.monitor
    if monitor is None:
        raise DistributedLoadError(
            "a load on more than one rank needs a session made with a monitor (asyncload.load "
            "makes one)"
        )
    session.begin()
    dist_w = _DistWrapper(session.group, True, 0)
    doing = "reading the checkpoint metadata"
    try:
        monitor.status(doing)
        if exchanges_metadata(session, dist_w.get_world_size()):  # read by rank 0 alone
            metadata = yield Await(aread_metadata_once(session, dist_w.rank))
        else:
            metadata, _ = yield Await(aread_metadata_like_dcp(session, dist_w.rank))
        yield Call(planner.set_up_planner, state_dict, metadata, dist_w.is_coordinator)
        _check_storage_table(session, metadata)
        doing = "making its local plan"
        monitor.status(doing)
        local_plan = yield Call(planner.create_local_plan)
        doing = "waiting for the other ranks' local plans"
        yield Call(monitor.barrier, "local-plan", doing)
        # every rank is here and well: the collectives below cannot wait on a failed rank
        plans = yield Call(dist_w.gather_object, local_plan)
        scattered: list[LoadPlan] | None = None
        if dist_w.is_coordinator:
            doing = "making the global plan"
            monitor.status(doing)
            if plans is None:  # pragma: no cover - the coordinator always gathers
                raise DistributedLoadError("the coordinator gathered no local plans")
            scattered = yield Call(planner.create_global_plan, plans)
        doing = "waiting for the global plan"
        yield Call(monitor.barrier, "global-plan", doing)
        central = yield Call(dist_w.scatter_object, scattered)
        doing = "reading data"
        monitor.status(doing)
        final = yield Call(planner.finish_plan, central)
        yield from read_steps(session, metadata, final, planner)
        doing = "waiting for the other ranks to finish reading"
        # the "done" barrier and one collective (so that no rank leaves while another still
        # reads the barrier's keys), or, when ShardedLoadPlanner returns early, neither
        yield Call(monitor.finish, doing)
    except BaseException as exc:
        monitor.fail(exc, monitor.doing if doing == "reading data" else doing)
        raise
