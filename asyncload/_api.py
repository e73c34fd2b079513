"""The one-call API: ``load`` (sync), ``aload`` (async) and ``start_load`` (background)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import warnings
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner

from ._dcp import PipelinedLoadPlanner, PipelinedReader
from ._errors import AsyncLoadError, DistributedLoadError, LoadCancelledError
from ._options import LoadOptions
from ._sharded import collective_load
from ._stats import LoadStats

__all__ = ["load", "aload", "start_load", "LoadHandle"]

log = logging.getLogger("asyncload")

# dcp.load warns on every single-process load; asyncload passes no_dist on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _QuietDcpFallback(logging.Filter):
    """dcp.load logs "Global metadata is not found..." with a traceback on the *root* logger
    when the reader's read_metadata raises, then tries rank-local metadata; with no logging
    configured Python prints that to stderr. When the error is asyncload's own (it is raised
    to the caller anyway, as one clear exception), drop the record: the library never prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, AsyncLoadError) and record.name == "root"
                    and "metadata is not found" in str(record.msg))


if not any(isinstance(f, _QuietDcpFallback) for f in logging.getLogger().filters):
    logging.getLogger().addFilter(_QuietDcpFallback())

ProgressCallback = Callable[[int, int], None]


def _prepare(checkpoint: str | os.PathLike[str], options: LoadOptions | None,
             storage_options: Mapping[str, Any] | None, planner: LoadPlanner | None,
             progress: ProgressCallback | None) -> tuple[PipelinedReader, LoadPlanner]:
    if options is None:
        if isinstance(planner, PipelinedLoadPlanner) and planner.has_options:
            options = planner.options
        else:
            options = LoadOptions()
    elif not isinstance(options, LoadOptions):
        raise TypeError(f"options must be a LoadOptions, not {type(options).__name__}")
    reader = PipelinedReader(checkpoint, options=options, storage_options=dict(storage_options or {}))
    reader._close_after_metadata = False  # _load_sync closes it when the load ends
    reader.progress = progress
    if planner is None:
        planner = PipelinedLoadPlanner(options=options)
    return reader, planner


def _unwrap(exc: CheckpointException, rank: int) -> BaseException:
    """The error to raise for a DCP CheckpointException: this rank's own, else a named remote one."""
    failures = exc.failures
    if rank in failures:
        own = failures[rank][0]
        return own
    first_rank = min(failures)
    remote = failures[first_rank][0]
    return DistributedLoadError(f"rank {first_rank} failed during the load: {type(remote).__name__}: {remote}"[:2000])


def _load_sync(state_dict: dict[str, Any], reader: PipelinedReader, planner: LoadPlanner,
               process_group: Any) -> LoadStats:
    use_dist = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if use_dist else 0
    log.debug("loading %s into %d keys", reader.checkpoint, len(state_dict))
    try:
        if use_dist and dist.get_world_size(process_group) > 1:
            # dcp.load's collective steps, with every wait on another rank bounded by
            # LoadOptions.collective_timeout and one rank's failure raised on all of them
            collective_load(state_dict, reader, planner, process_group)
        else:
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group,
                     no_dist=not use_dist)
    except CheckpointException as exc:
        err = _unwrap(exc, rank)
        if isinstance(err, AssertionError) and reader.metadata_error is not None:
            err = reader.metadata_error  # dcp.load's "metadata is None" hides the real cause
        raise err from (None if err.__traceback__ is not None else exc)
    finally:
        try:
            reader.close()
        except Exception:  # noqa: BLE001 - never mask the load's own outcome
            log.debug("closing the reader failed", exc_info=True)
    stats = reader.stats
    assert stats is not None
    log.info("loaded %s: %s", reader.checkpoint, stats)
    return stats


def load(state_dict: dict[str, Any], checkpoint: str | os.PathLike[str], *, options: LoadOptions | None = None,
         storage_options: Mapping[str, Any] | None = None, planner: LoadPlanner | None = None,
         process_group: Any = None, progress: ProgressCallback | None = None) -> LoadStats:
    """Load ``checkpoint`` into ``state_dict`` in place, like ``dcp.load``; return its :class:`LoadStats`.

    ``checkpoint`` is a local path, a ``PathLike``, a ``file://`` URL or any fsspec URL
    (``storage_options`` go to the filesystem). Works in a plain script and when the
    calling thread already runs an event loop. With ``torch.distributed`` initialised
    (or ``process_group`` given) every rank of the group must call it.
    ``progress(bytes_done, bytes_total)`` is called as data lands (from a library thread).
    """
    reader, planner = _prepare(checkpoint, options, storage_options, planner, progress)
    return _load_sync(state_dict, reader, planner, process_group)


async def aload(state_dict: dict[str, Any], checkpoint: str | os.PathLike[str], *,
                options: LoadOptions | None = None, storage_options: Mapping[str, Any] | None = None,
                planner: LoadPlanner | None = None, process_group: Any = None,
                progress: ProgressCallback | None = None) -> LoadStats:
    """:func:`load` as a coroutine. Reads run on the caller's event loop (uvloop too);
    planning and the planner's hooks run on a worker thread so the loop stays free.
    Cancelling it cancels the reads and returns once nothing of the load is left running."""
    reader, planner = _prepare(checkpoint, options, storage_options, planner, progress)
    loop = asyncio.get_running_loop()
    reader._use_loop(loop)
    done = asyncio.Event()
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["stats"] = _load_sync(state_dict, reader, planner, process_group)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result["error"] = exc
        finally:
            loop.call_soon_threadsafe(done.set)

    thread = threading.Thread(target=work, name="asyncload-aload", daemon=True)
    thread.start()
    try:
        await done.wait()
    except asyncio.CancelledError:
        reader.cancel()
        # the worker needs this loop to finish its cleanup: keep serving it until it does
        while not done.is_set():
            try:
                await asyncio.shield(done.wait())
            except asyncio.CancelledError:
                continue
        thread.join()
        raise
    thread.join()
    if "error" in result:
        err = result["error"]
        if isinstance(err, asyncio.CancelledError):
            raise err
        raise err
    return result["stats"]


class LoadHandle:
    """A load running in the background (:func:`start_load`).

    ``result(timeout)`` waits and returns :class:`LoadStats` (or raises the load's error,
    :class:`LoadCancelledError` after ``cancel()``, ``TimeoutError`` if it is still running);
    ``done()`` says whether it finished; ``cancel()`` stops it; ``progress`` is
    ``(bytes_done, bytes_total)`` so far (``(0, 0)`` until the plan is made);
    ``statistics()`` a live :class:`LoadStats` snapshot.
    """

    def __init__(self, reader: PipelinedReader, future: concurrent.futures.Future[LoadStats],
                 thread: threading.Thread) -> None:
        self._reader = reader
        self._future = future
        self._thread = thread
        self._cancelled = False
        self.progress: tuple[int, int] = (0, 0)

    def result(self, timeout: float | None = None) -> LoadStats:
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the load of {self._reader.checkpoint} is still running after {timeout} s") from None
        except (asyncio.CancelledError, concurrent.futures.CancelledError) as exc:
            raise LoadCancelledError(f"the load of {self._reader.checkpoint} was cancelled") from exc

    def done(self) -> bool:
        return self._future.done()

    def statistics(self) -> LoadStats:
        """A snapshot of the load's :class:`LoadStats` so far (retries, bytes, latencies...);
        ``seconds`` counts from the start of the load. The final stats once it is done."""
        return self._reader.live_stats()

    def cancel(self) -> bool:
        """Ask the load to stop; returns False if it had already finished."""
        if self._future.done():
            return False
        self._cancelled = True
        self._reader.cancel()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load and its cleanup have finished; True if they have."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as exc:  # noqa: BLE001
            return exc
        return None


def start_load(state_dict: dict[str, Any], checkpoint: str | os.PathLike[str], *,
               options: LoadOptions | None = None, storage_options: Mapping[str, Any] | None = None,
               planner: LoadPlanner | None = None, process_group: Any = None,
               progress: ProgressCallback | None = None) -> LoadHandle:
    """Start :func:`load` in a background thread and return a :class:`LoadHandle` at once.

    Do not touch ``state_dict``'s tensors until ``handle.result()`` returns.
    """
    box: list[LoadHandle] = []

    def on_progress(done: int, total: int) -> None:
        if box:
            box[0].progress = (done, total)
        if progress is not None:
            progress(done, total)

    reader, planner = _prepare(checkpoint, options, storage_options, planner, on_progress)
    future: concurrent.futures.Future[LoadStats] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def work() -> None:
        try:
            future.set_result(_load_sync(state_dict, reader, planner, process_group))
        except BaseException as exc:  # noqa: BLE001 - delivered through the handle
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)) and handle._cancelled:
                future.set_exception(LoadCancelledError(f"the load of {checkpoint} was cancelled"))
            else:
                future.set_exception(exc)

    thread = threading.Thread(target=work, name="asyncload-start-load", daemon=True)
    handle = LoadHandle(reader, future, thread)
    box.append(handle)
    thread.start()
    return handle
