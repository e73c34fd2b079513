"""The sync face: a dedicated, named event-loop thread that runs the async core.

One per process and loop kind (uvloop or asyncio), started on first use, recreated
in a forked child (the parent's thread does not survive a fork). Works when the
calling thread already runs an event loop: the caller blocks, our loop works.

A local load runs on uvloop only when uvloop is imported already (by the program, or by an
earlier remote load), on the standard loop otherwise: importing uvloop takes 2-4 ms, more
than it saves in a load of local files (a fresh process's first 1 GiB load is faster
without it), and a load must not import it lazily: a fork while another thread imports it
leaves the child waiting forever for the import's lock. Remote loads run on uvloop (many
small requests), importing it on their first use. docs/performance.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from asyncload.common.errors import LoadReentryError

__all__ = [
    "close_through_interrupt",
    "loop_thread",
    "on_thread",
    "refuse_on_library_loop",
    "run_sync",
    "uvloop_available",
]

log = logging.getLogger("asyncload.loop")
T = TypeVar("T")

_lock = threading.Lock()
_threads: dict[bool, _LoopThread] = {}


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported and its import has finished (one still under way
    in another thread, or in a thread that a fork left behind, is not)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


class _LoopThread:
    def __init__(self, use_uvloop: bool) -> None:
        self.uvloop = use_uvloop
        if use_uvloop:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(
            target=main, name=f"asyncload-loop{'-uvloop' if use_uvloop else ''}", daemon=True
        )
        self.thread.start()
        ready.wait()


def loop_thread(use_uvloop: bool, *, local: bool = False) -> asyncio.AbstractEventLoop:
    """The library's loop (started on first use), uvloop when asked and installed.

    ``local``: for a load of local files: uvloop only when it is imported already (see the
    module's docstring). Callers keep the loop they got for the whole load."""
    _watch_forks()
    with _lock:
        if use_uvloop and local and not _imported("uvloop"):
            use_uvloop = False
        use_uvloop = use_uvloop and uvloop_available()
        lt = _threads.get(use_uvloop)
        if lt is None or lt.pid != os.getpid() or not lt.thread.is_alive():
            lt = _threads[use_uvloop] = _LoopThread(use_uvloop)
        return lt.loop


_fork_hook = False


def _watch_forks() -> None:
    """Forget the parent's loop threads in a forked child (registered on first use, not
    at import: importing asyncload changes nothing process-wide)."""
    global _fork_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        _fork_hook = True
        os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _threads.clear()


def refuse_on_library_loop(coro: Coroutine[Any, Any, Any]) -> None:
    """Raise :class:`LoadReentryError` (closing ``coro``) when called on one of the library's
    loop threads (a progress callback that calls ``asyncload.load``): waiting there would
    stop the loop that has to do the work, or another library loop's loads for as long.
    Checked before a loop is chosen, so that a refused call starts no loop thread."""
    if on_library_loop():
        coro.close()
        raise _reentry_error()


def _reentry_error() -> LoadReentryError:
    return LoadReentryError(
        "asyncload's blocking API was called from its own event-loop thread (for example from a "
        "progress callback): it would wait forever; call it from another thread, or use "
        "asyncload.aload from async code"
    )


def on_library_loop() -> bool:
    """Whether the calling thread is one of the library's own loop threads."""
    running = asyncio._get_running_loop()
    return running is not None and any(lt.loop is running for lt in list(_threads.values()))


def run_sync(
    coro: Coroutine[Any, Any, T],
    loop: asyncio.AbstractEventLoop | Callable[[], asyncio.AbstractEventLoop],
    *,
    grace: float = 30.0,
    on_task: Any = None,
    shield: bool = False,
) -> T:
    """Run ``coro`` on ``loop`` (another thread's; or the one a callable ``loop`` chooses,
    called once the call is known not to come from a library loop) and wait for it.

    On KeyboardInterrupt (or any exception) while waiting, the task is cancelled and
    given up to ``grace`` seconds to clean up (close files and sessions) before re-raising;
    ``shield``: not cancelled, given up to ``grace`` seconds to finish (a coroutine that
    closes what the load opened). Wherever the interrupt lands, ``coro`` either never
    starts (it is closed) or is cancelled (or finishes) before this returns.
    ``on_task(task)`` is called on the loop thread once the task exists (for cancellation).
    """
    try:
        refuse_on_library_loop(coro)
        if callable(loop):
            loop = loop()
        if asyncio._get_running_loop() is loop:
            raise _reentry_error()
        done = threading.Event()
        box: dict[str, asyncio.Task[T]] = {}
    except BaseException:
        coro.close()
        raise

    def start() -> None:
        task = loop.create_task(coro)
        box["task"] = task
        task.add_done_callback(lambda _t: done.set())
        if on_task is not None:
            on_task(task)

    def give_up() -> None:
        """Runs after ``start`` if ``start`` was queued (one queue, in order)."""
        task = box.get("task")
        if task is None:  # the interrupt came before ``start`` was queued: it never runs
            done.set()
            coro.close()
        elif not shield:
            task.cancel()

    try:
        loop.call_soon_threadsafe(start)
        # a timed wait, so that a Ctrl-C the main thread did not receive itself (delivered to
        # another thread, or _thread.interrupt_main) is seen within 0.1 s
        while not done.wait(0.1):
            pass
        return box["task"].result()
    except BaseException:
        try:
            if not done.is_set():
                loop.call_soon_threadsafe(give_up)
                done.wait(timeout=grace)
            task = box.get("task")
            if task is not None and task.done() and not task.cancelled():
                task.exception()  # it ended as the interrupt came: its outcome is dropped, quietly
        except BaseException:  # a second Ctrl-C: stop waiting
            pass
        raise


def close_through_interrupt(still_open: Callable[[], bool], close: Callable[[], None]) -> None:
    """``close()`` if ``still_open()``; a Ctrl-C that lands before the closing reached the
    loop (which then does not cancel it: ``run_sync(..., shield=True)``) closes all the same,
    then goes on."""
    try:
        if still_open():
            close()
    except KeyboardInterrupt:
        if still_open():
            close()
        raise


def on_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """``fn()`` on a daemon thread of its own (a blocking call that may never return: a
    collective waiting for a rank that died is left to its own timeout); its outcome as a
    future of the running loop, set once it returns or raises (never after the loop closed)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(value)
        else:
            fut.set_exception(exc)

    def run() -> None:
        value: Any = None
        err: BaseException | None = None
        try:
            value = fn()
        except BaseException as exc:
            err = exc
        try:
            loop.call_soon_threadsafe(settle, value, err)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
