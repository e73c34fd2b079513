"""The tasks of a session's loads and their cancellation: :class:`LoadTasks`, held by the
session (:class:`asyncload.engine.session.LoadSession`).

A sync face runs each coroutine of a load on the library's loop thread (:meth:`LoadTasks.run`,
on the loop :meth:`LoadTasks.library_loop` chose), ``aload`` on the caller's loop
(:meth:`LoadTasks.guard`); either way the task is tracked, so that :meth:`LoadTasks.cancel`,
from any thread, reaches every task running and refuses every task after it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from asyncload.common.loop import loop_thread, run_sync

__all__ = ["LoadTasks"]

T = TypeVar("T")


class LoadTasks:
    """The running tasks of a session's loads (under a lock: :meth:`cancel` comes from any
    thread), whether they were cancelled, and the library loop the sync faces chose."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = threading.Lock()
        #: Set once :meth:`cancel` was called.
        self.cancelled = threading.Event()
        #: (pid, loop) of the library loop thread the sync faces chose (:meth:`library_loop`).
        self._pinned_loop: tuple[int, asyncio.AbstractEventLoop] | None = None

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        loop: Callable[[], asyncio.AbstractEventLoop],
        *,
        cleanup: bool = False,
    ) -> T:
        """Run ``coro`` on ``loop()`` from another thread and wait (the sync faces). Once
        cancelled, nothing more runs but ``cleanup`` coroutines (closing: shielded)."""
        if self.cancelled.is_set() and not cleanup:
            coro.close()
            raise asyncio.CancelledError()
        track = None if cleanup else self._track
        return run_sync(coro, loop, on_task=track, shield=cleanup)

    def library_loop(self, use_uvloop: bool, *, local: bool) -> asyncio.AbstractEventLoop:
        """The library loop thread the session runs on: chosen once (its storage's clients
        belong to that loop), again in a forked child or once that loop has stopped."""
        pinned = self._pinned_loop
        if pinned is None or pinned[0] != os.getpid() or not pinned[1].is_running():
            loop = loop_thread(use_uvloop, local=local)
            pinned = self._pinned_loop = (os.getpid(), loop)
        return pinned[1]

    def _track(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._tasks.add(task)
        task.add_done_callback(self._untrack)
        if self.cancelled.is_set():
            task.cancel()

    def _untrack(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._tasks.discard(task)

    async def guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the running loop as a task :meth:`cancel` can reach (``aload``)."""
        if self.cancelled.is_set():
            coro.close()
            raise asyncio.CancelledError()
        task = asyncio.ensure_future(coro)
        self._track(task)
        return await task

    def cancel(self) -> None:
        """Cancel every task running (from any thread): each raises CancelledError."""
        self.cancelled.set()
        with self._lock:
            tasks = list(self._tasks)
        for t in tasks:
            t.get_loop().call_soon_threadsafe(t.cancel)
