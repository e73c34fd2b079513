"""A fake CUDA device for CPU-only machines: the device path without a GPU.

:func:`fake_device` makes chosen CPU tensors take exactly the path CUDA destinations
take in :mod:`asyncload.engine.cuda_ring` (pinned ring, staging, deliverers, events, the pipeline
hook) with a :class:`FakeCopier` whose "stream" is a worker thread that runs each copy
later (after ``delay`` seconds), and whose "pinned" memory is tracked, so tests can check
that every copy's source was a ring slot or a bounce buffer, that the bytes are exact,
and that nothing stays pinned::

    from asyncload.testing import fake_device

    with fake_device(delay=0.001) as fake:
        asyncload.load(dest, checkpoint)   # every CPU destination is "on the device"
    assert fake.pageable_sources == 0 and fake.pinned_bytes == 0

It plugs into the library through :func:`asyncload.engine.cuda_ring.use_copier`, the one
injection point for a device copier other than CUDA's.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from asyncload.engine import DeviceCopier, use_copier

__all__ = ["FakeCopier", "fake_device"]


class FakeCopier(DeviceCopier):
    """A stand-in device for CPU-only machines: claimed CPU tensors are "device" memory,
    a worker thread is the side stream (ops run later, in order, after ``delay`` seconds
    each), and host buffers it handed out are "pinned". Counters say what happened.

    Use through :func:`fake_device`.
    """

    name = "fake"

    def __init__(
        self, claim: Callable[[torch.Tensor], bool] | None = None, delay: float = 0.0
    ) -> None:
        self._claim = claim
        self.delay = delay
        self._pinned: set[int] = set()
        self._lock = threading.Lock()
        self._q: queue.Queue[Any] = queue.Queue()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        #: Copies run, bytes they read from host memory, copies whose source was not pinned.
        self.copies = 0
        self.bytes_copied = 0
        self.pageable_sources = 0
        #: Host bytes handed out (ring slots and bounce buffers) and the most pinned at once.
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        #: Loads that set up side streams (``begin``) and synchronised them.
        self.begun = 0
        self.synchronized = 0
        #: Ops submitted but not yet run, at most.
        self.peak_pending = 0
        self._pending = 0

    def start(self) -> FakeCopier:
        self._thread = threading.Thread(
            target=self._work, name="asyncload-fake-stream", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, payload = item
            if kind == "op":
                op, src, _ptr = payload
                try:
                    if self.delay:
                        time.sleep(self.delay)
                    op()
                except BaseException as exc:
                    self._errors.append(exc)
                finally:
                    with self._lock:
                        self._pending -= 1
                    del op, src
            else:
                payload.set()

    def claims(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and (self._claim is None or bool(self._claim(t)))

    def _register(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        n = t.untyped_storage().nbytes()
        with self._lock:
            self._pinned.add(ptr)
            self.pinned_bytes += n
            self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    def _unregister(self, ptr: int, n: int) -> None:
        with self._lock:
            self._pinned.discard(ptr)
            self.pinned_bytes -= n

    def host_empty(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(max(1, nbytes), dtype=torch.uint8)[:nbytes]
        self._register(t)
        return t

    def release_host(self, t: torch.Tensor) -> None:
        self._unregister(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def begin(self, devices: Iterable[torch.device]) -> None:
        with self._lock:
            self.begun += 1

    def submit(self, device: torch.device, op: Callable[[], None], src: torch.Tensor) -> None:
        ptr = src.untyped_storage().data_ptr()
        with self._lock:
            pinned = ptr in self._pinned
            self.copies += 1
            self.bytes_copied += src.numel()
            if not pinned:
                self.pageable_sources += 1
            self._pending += 1
            self.peak_pending = max(self.peak_pending, self._pending)
        self._q.put(("op", (op, src, ptr)))

    def submit_release(self, t: torch.Tensor) -> None:
        ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        self._q.put(("op", (lambda: self._unregister(ptr, n), t, ptr)))
        with self._lock:
            self._pending += 1

    def record(self) -> threading.Event:
        ev = threading.Event()
        self._q.put(("event", ev))
        return ev

    def query(self, token: threading.Event) -> bool:
        return token.is_set()

    def synchronize(self) -> None:
        ev = self.record()
        ev.wait()
        with self._lock:
            self.synchronized += 1
        if self._errors:
            err = self._errors.pop(0)
            self._errors.clear()
            raise err


@contextlib.contextmanager
def fake_device(
    claim: Callable[[torch.Tensor], bool] | None = None, delay: float = 0.0
) -> Iterator[FakeCopier]:
    """Within the block, CPU destinations for which ``claim(t)`` is true (all, by default)
    are filled through the device path with a :class:`FakeCopier`, which it yields.
    Blocks nest: the innermost fake device is the one in use."""
    copier = FakeCopier(claim, delay).start()
    try:
        with use_copier(copier):
            yield copier
    finally:
        copier.stop()
