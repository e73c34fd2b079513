"""Ctrl-C at a chosen line: a trace function that raises KeyboardInterrupt once, and what a
test checks after (tasks on the library's loops, files left open).

Python delivers a Ctrl-C between lines (among other points) of the thread it lands on. A
trace function raising before the ``n``-th line run in chosen frames puts it there exactly,
so a test can try every line of a sync face in turn (``tests/engine/test_robustness.py``,
``scripts/interrupt_probe.py``). It can also raise where a signal cannot: at the exit of a
``with lock:`` block (before the release's call; Python checks for a signal after it).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "InterruptAtLine",
    "dcp_load",
    "interrupted",
    "open_files_under",
    "tasks_on_library_loops",
]


class InterruptAtLine:
    """A trace function (for the calling thread) that raises KeyboardInterrupt once, before
    the ``n``-th line run in the frames whose code ``traced`` accepts (``n=0``: never);
    ``seen`` counts the lines. ``skip``: names of functions whose lines are not counted."""

    def __init__(
        self, traced: Callable[[Any], bool], n: int, *, skip: frozenset[str] = frozenset()
    ) -> None:
        self.traced, self.n, self.skip, self.seen = traced, n, skip, 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line if event == "call" and self.traced(frame.f_code) else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_code.co_name not in self.skip:
            self.seen += 1
            if self.seen == self.n:
                raise KeyboardInterrupt(f"{frame.f_code.co_name}, line {frame.f_lineno}")
        return self._line


def interrupted(
    run: Callable[[], Any],
    traced: Callable[[Any], bool],
    n: int,
    *,
    skip: frozenset[str] = frozenset(),
) -> tuple[int, str | None]:
    """``run()`` under :class:`InterruptAtLine`: the lines it saw, and where the
    KeyboardInterrupt was raised (``None``: ``run`` returned)."""
    trace = InterruptAtLine(traced, n, skip=skip)
    sys.settrace(trace)
    try:
        run()
        where = None
    except KeyboardInterrupt as exc:
        where = str(exc)
    finally:
        sys.settrace(None)
    return trace.seen, where


def tasks_on_library_loops() -> int:
    """Tasks pending on asyncload's loop threads (a load left nothing running: as before)."""
    from asyncload.common import loop as _loop

    async def count() -> int:
        return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

    return sum(
        asyncio.run_coroutine_threadsafe(count(), lt.loop).result(5)
        for lt in list(_loop._threads.values())
    )


def open_files_under(directory: str | os.PathLike[str]) -> list[str]:
    """Paths under ``directory`` that this process holds open (from /proc/self/fd)."""
    d = os.path.realpath(directory)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == d or target.startswith(d + os.sep):
            out.append(target)
    return out


def dcp_load(state_dict: dict[str, Any], checkpoint: str | os.PathLike[str]) -> None:
    """``dcp.load`` through ``PipelinedReader`` and ``PipelinedLoadPlanner`` in one process;
    a KeyboardInterrupt that ``dcp.load`` wrapped in its CheckpointException is raised as it
    was (``dcp.load`` catches what a rank raises, Ctrl-C included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import asyncload

    reader = asyncload.PipelinedReader(str(checkpoint))
    planner = asyncload.PipelinedLoadPlanner()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        for inner, _ in exc.failures.values():
            if isinstance(inner, KeyboardInterrupt):
                raise inner from None
        raise
