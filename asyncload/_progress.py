"""Progress bars for the CLI and the demo (tqdm), fed from any thread.

The library itself never draws anything: :func:`asyncload.load` only calls a
``progress(bytes_done, bytes_total)`` callback. This module turns that callback
(or a :class:`~asyncload.LoadHandle` polled from the main thread) into a tqdm
bar on stderr showing bytes, throughput, ETA and retries. Bars switch themselves
off when stderr is not a terminal (tqdm's ``disable=None``), so logs and pipes
stay clean.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["ByteProgress", "follow_handle"]


class ByteProgress:
    """A byte-counting progress bar: ``update(done, total, retries=...)`` from any thread.
    (``unit="key"`` or any other word counts items instead of bytes.)

    ``enabled=None`` shows the bar only when ``file`` is a terminal; ``True``/``False``
    force it. Use as a context manager or call :meth:`close`.
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
    ) -> None:
        self.desc = desc
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
        if enabled:
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

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
