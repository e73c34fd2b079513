"""The one-call API: ``load`` (sync), ``aload`` (async) and ``start_load`` (background)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from asyncload.common.errors import LoadCancelledError, LoadReentryError
from asyncload.common.loop import on_library_loop
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats, _fmt_bytes
from asyncload.distributed import SHOWN_IN_FLIGHT, Monitor, RankProgress, Rate
from asyncload.engine import (
    LoadSession,
    governing_options,
    in_flight,
    load_steps,
    resolve_config,
    run_async,
    run_sync,
)
from asyncload.faces.arguments import check_load_arguments
from asyncload.faces.terms import planner_terms

if TYPE_CHECKING:  # annotations only: the default planner's module is imported when made
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.planner import LoadPlanner

__all__ = ["LoadHandle", "aload", "load", "start_load"]

log = logging.getLogger("asyncload")

ProgressCallback = Callable[[int, int], None]


def _prepare(
    checkpoint: str | os.PathLike[str],
    options: LoadOptions | None,
    storage_options: Mapping[str, Any] | None,
    planner: LoadPlanner | None,
    progress: ProgressCallback | None,
    extension_registry: ExtensionRegistry | None = None,
    allow_partial_load: bool = False,
    process_group: Any = None,
) -> tuple[LoadSession, LoadPlanner | None, Callable[[Any, Any], tuple[Any, Any, Any]] | None]:
    """The load's session and planner (or, with no ``planner`` on one rank, ``None`` and
    the function that makes it once the metadata is read, :func:`_default_planner`: a
    safetensors or torch.save file into plain tensors imports no DCP), with its
    configuration resolved once (:func:`asyncload.engine.config.resolve_config`:
    ``options``, else an explicitly configured :class:`PipelinedLoadPlanner`'s, else the
    defaults; both get them) with what the planner brings (:func:`planner_terms`). With
    more than one rank in ``process_group`` the session is made with the monitor that bounds
    every wait on another rank. ``extension_registry`` decodes stream transforms (``None``:
    torch's default registry). ``allow_partial_load=True`` goes to the planner (see
    :func:`load`)."""
    if not isinstance(allow_partial_load, bool):
        raise TypeError(
            f"allow_partial_load must be a bool, not {type(allow_partial_load).__name__}"
        )
    if allow_partial_load and planner is not None:
        if not hasattr(planner, "allow_partial_load"):
            raise TypeError(
                "allow_partial_load=True was passed with a planner of type "
                f"{type(planner).__name__}, which "
                "has no allow_partial_load attribute (torch's DefaultLoadPlanner and asyncload's "
                "planners have "
                "one): make the planner skip missing keys itself, or pass no planner"
            )
        planner.allow_partial_load = True
    terms = planner_terms(planner)
    options = governing_options(options, terms)  # handed on to the planners made here
    config = resolve_config(options, terms)
    monitor: Monitor | None = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        monitor = Monitor(
            process_group,
            config.collective_timeout,
            late_after=config.ranks.late_rank_log_after,
        )
        progress = _reporting_to(monitor, progress)
    if planner is None and monitor is not None:
        from asyncload.faces.dcp_reader import PipelinedLoadPlanner

        planner = PipelinedLoadPlanner(options=options, allow_partial_load=allow_partial_load)
        config = config.with_planner(planner_terms(planner))  # its options are the config's
    session = LoadSession(
        checkpoint,
        config=config,
        options=options,
        storage_options=dict(storage_options or {}),
        group=process_group,
        monitor=monitor,
        progress=progress,
        extension_registry=extension_registry,
    )
    if monitor is not None:
        monitor.cancelled = session.cancelled  # a cancelled load stops waiting on the others
        monitor.start_reporting(lambda: in_flight(session))
    if planner is None:
        session.plain_metadata = True
        return session, None, _default_planner(options, allow_partial_load)
    return session, planner, None


def _default_planner(
    options: LoadOptions, allow_partial_load: bool
) -> Callable[[Any, Any], tuple[Any, Any, Any]]:
    """``choose(state_dict, metadata) -> (planner, metadata, terms)``: the planner of a load
    made with no ``planner`` on one rank, once its metadata is read, and what it brings
    (:func:`planner_terms`). A safetensors or torch.save file (metadata of
    :mod:`asyncload.formats.plain`'s types) into plain tensors gets a
    :class:`~asyncload.faces.plain_planner.PlainLoadPlanner` (no DCP imported); anything else a
    :class:`PipelinedLoadPlanner`, with the metadata converted to DCP's types."""

    def choose(state_dict: Any, md: Any) -> tuple[Any, Any, Any]:
        from asyncload.faces.plain_planner import PlainLoadPlanner, fits

        if fits(state_dict, md):
            plain = PlainLoadPlanner(options=options, allow_partial_load=allow_partial_load)
            return plain, md, planner_terms(plain)
        from asyncload.faces.dcp_reader import PipelinedLoadPlanner
        from asyncload.formats import to_dcp

        planner = PipelinedLoadPlanner(options=options, allow_partial_load=allow_partial_load)
        return planner, to_dcp(md), planner_terms(planner)

    return choose


def _reporting_to(monitor: Monitor, user: ProgressCallback | None) -> ProgressCallback:
    """Progress that tells the other ranks how far this one is (the monitor's status),
    then ``user``."""

    def on_progress(done: int, total: int) -> None:
        monitor.count_bytes(done, total)
        monitor.progress(f"reading data: {_fmt_bytes(done)} of {_fmt_bytes(total)}")
        if user is not None:
            user(done, total)

    return on_progress


def load(
    state_dict: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    *,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    progress: ProgressCallback | None = None,
    extension_registry: ExtensionRegistry | None = None,
    allow_partial_load: bool = False,
) -> LoadStats:
    """Load ``checkpoint`` into ``state_dict`` in place, like ``dcp.load``; return its
    :class:`LoadStats`.

    ``checkpoint`` is a local path, a ``PathLike``, a ``file://`` URL or any fsspec URL
    (``storage_options`` go to the filesystem). Works in a plain script and when the
    calling thread already runs an event loop. With ``torch.distributed`` initialised
    (or ``process_group`` given) every rank of the group must call it.
    ``progress(bytes_done, bytes_total)`` is called as data lands (from a library thread).
    ``extension_registry`` (torch's ``ExtensionRegistry``; default: torch's own, which knows
    ``ZStandard``) decodes records saved with stream transforms (docs/formats.md).

    Every destination key must be in the checkpoint (else :class:`StateDictMismatchError`
    naming each missing key and the closest checkpoint key, before anything is read), except
    tied keys (one tensor's memory under two keys, such as ``lm_head.weight`` and
    ``model.embed_tokens.weight``), which are filled through the other (``LoadStats.tied_keys``).
    ``allow_partial_load=True`` loads the keys the checkpoint has and leaves the others as
    they were (``LoadStats.missing_keys`` lists them). With a ``planner``, the load is partial
    when either says so: ``allow_partial_load=True`` here sets the planner's attribute of
    that name (torch's ``DefaultLoadPlanner`` has it), which it keeps; a planner made with
    ``allow_partial_load=True`` loads partially whatever is passed here.

    Raised before anything is opened, naming the fix (docs/errors.md): ``TypeError`` for a
    module as ``state_dict`` (pass ``model.state_dict()``), the two arguments swapped, a
    :class:`LoadOptions` as ``storage_options`` (pass it as ``options=``); ``ValueError`` for a
    URL scheme asyncload does not read or one that lost a slash (``s3:/bucket``).
    """
    check_load_arguments(state_dict, checkpoint, options, storage_options, face="asyncload.load")
    _hint_aload_if_loop_running()
    session, planner, choose = _prepare(
        checkpoint,
        options,
        storage_options,
        planner,
        progress,
        extension_registry,
        allow_partial_load,
        process_group,
    )
    return run_sync(load_steps(state_dict, session, planner, choose), session)


_hinted = threading.Event()


def _hint_aload_if_loop_running() -> None:
    """Log once per process (INFO) when :func:`load` is called on a thread that runs an event
    loop: the load works (on asyncload's own loop thread), but this loop stands still until
    it returns; ``await asyncload.aload(...)`` keeps it running."""
    if _hinted.is_set():
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    _hinted.set()
    log.info(
        "asyncload.load was called on a thread that runs an event loop: that loop is blocked "
        "until the load "
        "returns; use 'await asyncload.aload(...)' in async code to keep it running"
    )


async def aload(
    state_dict: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    *,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    progress: ProgressCallback | None = None,
    extension_registry: ExtensionRegistry | None = None,
    allow_partial_load: bool = False,
) -> LoadStats:
    """:func:`load` as a coroutine, natively on the caller's event loop (uvloop too): reads
    run on it; planning, collectives and the planner's hooks run on a worker thread so the
    loop stays free. Cancelling it cancels the reads and returns once nothing of the load
    is left running (files and sessions closed)."""
    check_load_arguments(state_dict, checkpoint, options, storage_options, face="asyncload.aload")
    session, planner, choose = _prepare(
        checkpoint,
        options,
        storage_options,
        planner,
        progress,
        extension_registry,
        allow_partial_load,
        process_group,
    )
    return await run_async(load_steps(state_dict, session, planner, choose), session)


class LoadHandle:
    """A load running in the background (:func:`start_load`).

    ``result(timeout)`` waits and returns :class:`LoadStats` (or raises the load's error,
    :class:`LoadCancelledError` after ``cancel()``, ``TimeoutError`` if it is still running);
    ``done()`` says whether it finished; ``cancel()`` stops it; ``progress`` is
    ``(bytes_done, bytes_total)`` so far, ``bytes_total`` ``None`` while it is not known yet
    (``(0, None)`` until the metadata is read and the plan made);
    ``statistics()`` a live :class:`LoadStats` snapshot; ``rank_progress()`` every rank's
    progress (bytes, rate, the storage requests in flight). ``repr(handle)`` shows the
    checkpoint, the state (running, done, failed, cancelled) and the progress.
    """

    def __init__(
        self,
        session: LoadSession,
        future: concurrent.futures.Future[LoadStats],
        thread: threading.Thread,
    ) -> None:
        self._session = session
        self._future = future
        self._thread = thread
        self._cancelled = False
        #: Orders cancel() against the load's end: once cancel() returned True, result() raises.
        self._ending = threading.Lock()
        self.progress: tuple[int, int | None] = (0, None)
        #: This rank's rate (single-rank loads; a multi-rank load's monitor keeps its own).
        self._rate = Rate()

    def _landed(self, done: int, total: int) -> None:
        """Progress of this load (the library's threads)."""
        self.progress = (done, total)
        self._rate.add(done)

    def result(self, timeout: float | None = None) -> LoadStats:
        if not self._future.done() and on_library_loop():
            # the load needs this very thread's loop to make progress: waiting would hang
            raise LoadReentryError(
                "LoadHandle.result() was called from asyncload's own event-loop thread (for "
                "example from a "
                "progress callback) while the load is still running: it would wait forever; wait "
                "from another "
                "thread, or use asyncload.aload from async code"
            )
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the load of {self._session.checkpoint} is still running after {timeout} s"
            ) from None
        except (asyncio.CancelledError, concurrent.futures.CancelledError) as exc:
            raise LoadCancelledError(
                f"the load of {self._session.checkpoint} was cancelled"
            ) from exc

    def done(self) -> bool:
        return self._future.done()

    def statistics(self) -> LoadStats:
        """A snapshot of the load's :class:`LoadStats` so far (retries, bytes, latencies...);
        ``seconds`` counts from the start of the load. The final stats once it is done."""
        return self._session.live_stats()

    def rank_progress(self) -> list[RankProgress]:
        """Every rank's progress in this load, by rank: a list of :class:`RankProgress`
        (bytes done and in all, rate over the last 10 s, the oldest storage requests in
        flight with their files, byte ranges, attempts and seconds, status, the record's
        age). A multi-rank load reads the other ranks' records from the process group's store
        (written at most twice a second, when they change; one round trip); a single-rank load
        returns this rank's alone. Callable from any thread, during the load and after it
        (until the next load on the group, or the group, ends); raises
        :class:`DistributedLoadError` when the store is gone (docs/distributed.md#watching-a-multi-rank-load)."""
        monitor = self._session.monitor
        if isinstance(monitor, Monitor):
            return monitor.rank_progress()
        done, total = self.progress
        registry = in_flight(self._session)
        requests = tuple(registry.oldest(SHOWN_IN_FLIGHT)) if registry is not None else ()
        group = self._session.group
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        return [RankProgress(rank, done, total, self._rate.rate(), requests, self._state(), 0.0)]

    def _state(self) -> str:
        if not self._future.done():
            return "cancelling" if self._cancelled else "running"
        if self._future.exception() is None:
            return "done"
        if isinstance(self._future.exception(), LoadCancelledError):
            return "cancelled"
        return f"failed: {type(self._future.exception()).__name__}"

    def cancel(self) -> bool:
        """Ask the load to stop; returns False if it had already finished. After True,
        ``result()`` raises :class:`LoadCancelledError` (even if the reads had just
        completed: a cancelled load's destination is not to be relied on)."""
        with self._ending:
            if self._future.done():
                return False
            self._cancelled = True
        self._session.cancel()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load and its cleanup have finished; True if they have."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as exc:
            return exc
        return None

    def __repr__(self) -> str:
        done, total = self.progress
        state = self._state()
        of = f" of {_fmt_bytes(total)}" if total is not None else " (total not known yet)"
        return f"<LoadHandle {self._session.checkpoint} {state}, {_fmt_bytes(done)}{of}>"


def start_load(
    state_dict: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    *,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    progress: ProgressCallback | None = None,
    extension_registry: ExtensionRegistry | None = None,
    allow_partial_load: bool = False,
) -> LoadHandle:
    """Start :func:`load` in a background thread and return a :class:`LoadHandle` at once.

    Do not touch ``state_dict``'s tensors until ``handle.result()`` returns.
    """
    check_load_arguments(
        state_dict, checkpoint, options, storage_options, face="asyncload.start_load"
    )
    box: list[LoadHandle] = []

    def on_progress(done: int, total: int) -> None:
        if box:
            box[0]._landed(done, total)
        if progress is not None:
            progress(done, total)

    session, planner, choose = _prepare(
        checkpoint,
        options,
        storage_options,
        planner,
        on_progress,
        extension_registry,
        allow_partial_load,
        process_group,
    )
    future: concurrent.futures.Future[LoadStats] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def work() -> None:
        outcome: LoadStats | BaseException
        try:
            outcome = run_sync(load_steps(state_dict, session, planner, choose), session)
        except BaseException as exc:  # delivered through the handle
            outcome = exc
        with handle._ending:
            if handle._cancelled and (
                not isinstance(outcome, BaseException)
                or isinstance(outcome, (asyncio.CancelledError, KeyboardInterrupt))
            ):
                future.set_exception(LoadCancelledError(f"the load of {checkpoint} was cancelled"))
            elif isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    thread = threading.Thread(target=work, name="asyncload-start-load", daemon=True)
    handle = LoadHandle(session, future, thread)
    box.append(handle)
    thread.start()
    return handle
