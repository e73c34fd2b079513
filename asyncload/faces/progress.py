"""Progress bars for the CLI and the demo (tqdm), fed from any thread.

The library itself never draws anything: :func:`asyncload.load` only calls a
``progress(bytes_done, bytes_total)`` callback. This module turns that callback
(or a :class:`~asyncload.LoadHandle` polled from the main thread) into a tqdm
bar on stderr showing bytes, throughput, ETA and retries. Bars switch themselves
off when stderr is not a terminal (tqdm's ``disable=None``), so logs and pipes
stay clean. A terminal that reports no width (0 columns, as some CI consoles and
serial terminals do), where a bar would draw nothing, gets one line of progress
every ``line_interval`` seconds instead, and a last one when it closes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["ByteProgress", "follow_handle", "terminal_width"]


class ByteProgress:
    """A byte-counting progress bar: ``update(done, total, retries=...)`` from any thread.
    (``unit="key"`` or any other word counts items instead of bytes.)

    ``enabled=None`` shows the bar only when ``file`` is a terminal; ``True``/``False``
    force it. On a terminal that reports no width (:func:`terminal_width` 0 or unknown) it
    writes a line such as ``load: 42% 430.00 MiB of 1.00 GiB, 212.31 MiB/s`` at most every
    ``line_interval`` seconds (and when it closes) instead of a bar. Use as a context manager
    or call :meth:`close`.
    """

    def __init__(
        self,
        desc: str,
        *,
        total: int = 0,
        file: IO[str] | None = None,
        enabled: bool | None = None,
        leave: bool = True,
        unit: str = "bytes",
        line_interval: float = 5.0,
    ) -> None:
        self.desc = desc
        self._unit = unit
        self._line_interval = line_interval
        self._started = time.monotonic()
        self._last_line: float | None = None
        self._last_done = 0
        #: periodic lines instead of a bar (a terminal with no width)
        self.lines = False
        self._file = file if file is not None else sys.stderr
        self._lock = threading.Lock()
        self._done = 0
        self._total = total
        self._retries = 0
        self._bar: Any = None
        if enabled is None:
            isatty = getattr(self._file, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        if enabled and _is_tty(self._file) and not terminal_width(self._file):
            self.lines = True
        elif enabled:
            from tqdm import tqdm

            # "iB" with divisor 1024 reads KiB, MiB, GiB: the units of LoadStats
            scaled = unit == "bytes"
            self._bar = tqdm(
                desc=desc,
                total=total or None,
                unit="iB" if scaled else unit,
                unit_scale=scaled,
                unit_divisor=1024,
                file=self._file,
                leave=leave,
                dynamic_ncols=True,
                smoothing=0.1,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                "[{elapsed}<{remaining}, {rate_fmt}{postfix}]",
            )

    @property
    def done(self) -> int:
        return self._done

    @property
    def total(self) -> int:
        return self._total

    def __call__(self, done: int, total: int) -> None:
        """The ``progress=`` callback form of :meth:`update`."""
        self.update(done, total)

    def update(self, done: int, total: int, retries: int | None = None) -> None:
        with self._lock:
            if total and total != self._total:
                self._total = total
                if self._bar is not None:
                    self._bar.total = total
                    self._bar.refresh()
            if done > self._done:
                if self._bar is not None:
                    self._bar.update(done - self._done)
                self._done = done
            if retries is not None and retries != self._retries:
                self._retries = retries
                if self._bar is not None:
                    self._bar.set_postfix_str(f"retries {retries}", refresh=False)
            if self.lines:
                now = time.monotonic()
                if self._last_line is None or now - self._last_line >= self._line_interval:
                    self._write_line(now)

    def _write_line(self, now: float) -> None:
        """One line of progress (lines mode), under the lock."""
        from asyncload.common.stats import _fmt_bytes

        self._last_line, self._last_done = now, self._done
        if self._unit == "bytes":
            fmt: Callable[[float], str] = _fmt_bytes
        else:
            unit = self._unit

            def fmt(n: float) -> str:
                return f"{n:.0f} {unit}" if n == 1 else f"{n:.0f} {unit}s"

        elapsed = now - self._started
        text = f"{self.desc}: "
        if self._total:
            text += f"{100 * self._done // self._total}% {fmt(self._done)} of {fmt(self._total)}"
        else:
            text += fmt(self._done)
        if elapsed > 0:
            text += f", {fmt(self._done / elapsed)}/s"
        if self._retries:
            text += f", {self._retries} {'retry' if self._retries == 1 else 'retries'}"
        try:
            self._file.write(text + "\n")
            self._file.flush()
        except (OSError, ValueError):  # the terminal went away: stop writing
            self.lines = False

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self.lines:
                if self._last_done != self._done or self._last_line is None:
                    self._write_line(time.monotonic())
                self.lines = False

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(file: IO[str]) -> bool:
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty())


def terminal_width(file: IO[str]) -> int:
    """The columns of the terminal ``file`` writes to, as tqdm reads them: 0 when it reports
    none or cannot tell."""
    try:
        return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def follow_handle(
    handle: Any,
    bar: ByteProgress,
    *,
    interval: float = 0.1,
    on_tick: Callable[[], None] | None = None,
) -> Any:
    """Wait for a :class:`~asyncload.LoadHandle`, feeding ``bar`` from its ``progress`` and
    ``statistics()`` every ``interval`` seconds; return ``handle.result()``.

    Runs on the calling (main) thread, so Ctrl-C arrives here: the load is then cancelled,
    its cleanup awaited (files and sessions closed), and KeyboardInterrupt re-raised.
    """
    try:
        while not handle.wait(interval):
            done, total = handle.progress
            bar.update(done, total, handle.statistics().retries)
            if on_tick is not None:
                on_tick()
        done, total = handle.progress
        if handle.done() and handle.exception(0) is None:
            bar.update(done, total, handle.statistics().retries)
        return handle.result()
    except KeyboardInterrupt:
        handle.cancel()
        deadline = time.monotonic() + 30.0
        while not handle.wait(0.1) and time.monotonic() < deadline:
            pass
        raise
