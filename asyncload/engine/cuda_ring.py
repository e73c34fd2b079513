"""Destinations on a CUDA device: storage -> pinned host ring -> device, overlapped.

A chunk whose bytes go to device tensors is read into one slot of a small ring of
pinned (page-locked) host buffers - straight from the file for local storage, or copied
from the network's bytes for remote stores - and each destination's piece is copied
with ``non_blocking=True`` on a side stream. The slot goes back to the ring only when
an event recorded after those copies has completed, so reads of later chunks, host
staging and host-to-device copies overlap, and at most ``slots x slot_size`` bytes
(<= ``LoadOptions.memory_budget``: the ``pinned`` share of the memory plan,
:mod:`asyncload.engine.config`) are pinned. The load returns only after every copy
has finished (the side streams are synchronised).

Nothing pageable or mmap-backed is handed to the device: a piece whose bytes arrive in
ordinary memory (a small DCP record read whole) is first copied into a pinned bounce
buffer. A destination view that is not contiguous, or needs a dtype cast, is filled on
the device: the raw bytes go to a device scratch buffer, then one strided copy on the
side stream.

The side streams first wait for the caller's current stream, so that work already
queued on the destination tensors (their initialisation, say) finishes before the
copies land.

What a "device" is, is a :class:`DeviceCopier`: :class:`CudaCopier` for CUDA
destinations. :func:`use_copier` is the one injection point for another one: within its
block, destinations that copier claims take the device path through it, before any CUDA
destination. CI has no GPU: :func:`asyncload.testing.fake_device` uses it to make chosen
CPU tensors take the very same path (ring, staging, deliverers, events) with a fake
copier whose "stream" is a worker thread and whose "pinned" memory is tracked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncload.engine.assembly import assemble, copy_bytes, memory_of
from asyncload.engine.chunks import Chunk
from asyncload.engine.config import MemoryPlan
from asyncload.engine.meter import Meter, MeterStatistics
from asyncload.engine.plan import _contiguous_box as _row_major

__all__ = [
    "CudaCopier",
    "DeviceCopier",
    "DeviceStager",
    "PinnedRing",
    "stager_for",
    "use_copier",
]

log = logging.getLogger("asyncload.cuda")


def _address(data: memoryview | bytes | bytearray) -> int:
    if len(data) == 0:
        return 0
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


# --- copiers: what a "device" is ------------------------------------------------------------


class DeviceCopier:
    """What the staging code needs from a device: pinned host memory, a side stream per
    device, events. :class:`CudaCopier` for CUDA; another through :func:`use_copier`."""

    name = "device"

    def claims(self, t: torch.Tensor) -> bool:
        """Whether destination ``t`` is filled through this copier."""
        raise NotImplementedError

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 host tensor of ``nbytes``."""
        raise NotImplementedError

    def release_host(self, t: torch.Tensor) -> None:
        """``t`` (a ring slot from :meth:`host_empty`) is no longer used: its copies have finished."""

    def submit_release(self, t: torch.Tensor) -> None:
        """``t`` (a bounce buffer from :meth:`host_empty`) is no longer used once the ops
        submitted so far have run."""

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Scratch uint8 memory on ``device``, usable by the side stream."""
        raise NotImplementedError

    def begin(self, devices: Iterable[torch.device]) -> None:
        """On the caller's thread: side streams for ``devices``, ordered after the caller's current streams."""

    def submit(self, device: torch.device, op: Callable[[], None], src: torch.Tensor) -> None:
        """Run ``op`` (copies from pinned ``src``) on ``device``'s side stream."""
        raise NotImplementedError

    def record(self) -> Any:
        """An event after everything submitted so far (all side streams)."""
        raise NotImplementedError

    def query(self, token: Any) -> bool:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until everything submitted has finished."""
        raise NotImplementedError


class CudaCopier(DeviceCopier):
    """CUDA side streams (one per device), events, pinned memory from torch's host allocator."""

    name = "cuda"

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def claims(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device=device)
                s.wait_stream(torch.cuda.current_stream(device))
            return s

    def begin(self, devices: Iterable[torch.device]) -> None:
        for d in devices:
            self._stream(d)

    def submit(self, device: torch.device, op: Callable[[], None], src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(device)):
            op()

    def record(self) -> Any:
        with self._lock:
            streams = list(self._streams.values())
        events = []
        for s in streams:
            ev = torch.cuda.Event()
            ev.record(s)
            events.append(ev)
        return events

    def query(self, token: Any) -> bool:
        return all(ev.query() for ev in token)

    def synchronize(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.synchronize()


#: The copier :func:`use_copier` installed, if any.
_extra_copier: DeviceCopier | None = None


@contextlib.contextmanager
def use_copier(copier: DeviceCopier) -> Iterator[DeviceCopier]:
    """Within the block, every load whose destinations ``copier`` claims (some of them)
    fills those through ``copier``, on the device path, instead of CUDA's. Blocks nest
    (the innermost copier is used). This is how :mod:`asyncload.testing.cuda` puts a fake
    device in; the library itself never installs one."""
    global _extra_copier
    prev, _extra_copier = _extra_copier, copier
    try:
        yield copier
    finally:
        _extra_copier = prev


# --- the ring ---------------------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    tensor: torch.Tensor
    view: memoryview
    address: int


class PinnedRing:
    """``slots`` pinned host buffers of ``slot_size`` bytes; a chunk holds one while its
    bytes are read and copied to the device. The bytes held are counted by a
    :class:`~asyncload.engine.meter.Meter` (``slot_size`` per slot held, FIFO waiters):
    :meth:`statistics`."""

    def __init__(self, copier: DeviceCopier, slots: int, slot_size: int) -> None:
        self.copier = copier
        self.slot_size = slot_size
        self._slots: list[_Slot] = []
        for i in range(slots):
            t = copier.host_empty(slot_size)
            self._slots.append(_Slot(i, t, memory_of(t), int(t.data_ptr())))
        self._free = list(reversed(self._slots))
        self.meter = Meter(slots * slot_size, name="pinned staging", unit="bytes")
        #: Times a chunk waited for a free slot.
        self.waits = 0

    @property
    def slots(self) -> int:
        return len(self._slots)

    def statistics(self) -> MeterStatistics:
        return self.meter.statistics()

    async def acquire(self) -> _Slot:
        meter = self.meter
        if not meter.try_acquire(self.slot_size):
            self.waits += 1
            await meter.acquire(self.slot_size)
        return self._free.pop()

    def release(self, slot: _Slot) -> None:
        self._free.append(slot)
        self.meter.release(self.slot_size)

    def find(self, address: int, nbytes: int) -> tuple[_Slot, int] | None:
        """The slot holding ``[address, address + nbytes)`` and the offset in it, if any."""
        for s in self._slots:
            off = address - s.address
            if off >= 0 and off + nbytes <= self.slot_size:
                return s, off
        return None

    def close(self) -> None:
        """Drop the buffers (after the copier synchronised)."""
        for s in self._slots:
            self.copier.release_host(s.tensor)
        self._slots = []


# --- one load's device path -------------------------------------------------------------------


class DeviceStager:
    """The device path of one load: the ring, deliverers for the planner, the pipeline hook."""

    def __init__(self, copier: DeviceCopier, slots: int, slot_size: int) -> None:
        self.copier = copier
        self.slots, self.slot_size = slots, slot_size
        self._ring: PinnedRing | None = None
        self._lock = threading.Lock()
        #: Copies to the device, bytes they moved, bytes bounced through extra pinned memory.
        self.copies = 0
        self.bytes_to_device = 0
        self.bounced_bytes = 0
        self.waited_seconds = 0.0

    # caller's thread
    def claims(self, t: torch.Tensor) -> bool:
        return self.copier.claims(t)

    def begin(self, dests: Iterable[torch.Tensor]) -> None:
        """Side streams for the destinations' devices, and the ring (the caller's thread: pinning
        memory takes a while and must not stall the event loop)."""
        self.copier.begin({t.device for t in dests if self.copier.claims(t)})
        self.ring  # noqa: B018 - allocated now

    @property
    def ring(self) -> PinnedRing:
        if self._ring is None:
            with self._lock:
                if self._ring is None:
                    self._ring = PinnedRing(self.copier, self.slots, self.slot_size)
        return self._ring

    # planner: a deliver function for one staged piece
    def deliverer(
        self,
        view: torch.Tensor,
        src_dtype: torch.dtype,
        shape: Sequence[int],
        strides: Sequence[int],
    ) -> Callable[[memoryview], None]:
        """``deliver(data)``: the piece's raw bytes (``data``, as stored) into ``view`` on the device."""
        shape, strides = list(shape), list(strides)
        device = view.device
        raw = view.is_contiguous() and view.dtype == src_dtype and _row_major(shape, strides)
        copier = self.copier

        def deliver(data: memoryview) -> None:
            src, bounced = self._pinned(data)
            n = len(data)
            if raw:
                dst = view.reshape(-1).view(torch.uint8)

                def op() -> None:
                    dst.copy_(src, non_blocking=True)
            else:

                def op() -> None:
                    scratch = copier.device_empty(n, device)
                    scratch.copy_(src, non_blocking=True)
                    view.copy_(
                        scratch.view(src_dtype).as_strided(shape, strides, 0), non_blocking=True
                    )

            copier.submit(device, op, src)
            if bounced is not None:
                copier.submit_release(bounced)
            with self._lock:
                self.copies += 1
                self.bytes_to_device += n

        return deliver

    def _pinned(self, data: memoryview) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pinned uint8 tensor holding ``data``: the slot slice it lies in, or a bounce copy."""
        n = len(data)
        hit = self.ring.find(_address(data), n) if n else None
        if hit is not None:
            slot, off = hit
            return slot.tensor[off : off + n], None
        buf = self.copier.host_empty(n)
        if n:
            copy_bytes(memory_of(buf), data)
        with self._lock:
            self.bounced_bytes += n
        return buf, buf

    # pipeline hook: a chunk that feeds device destinations
    async def read_and_assemble(self, pipeline: Any, chunk: Chunk) -> None:
        """Read ``chunk`` into a ring slot, deliver its pieces, and return the slot once the
        device copies finished (the pipeline's budget is held until then)."""
        loop = asyncio.get_running_loop()
        storage = pipeline.storage
        n = chunk.nbytes
        ring = self.ring
        t0 = time.monotonic()
        raw: Any = None
        if not storage.supports_readinto:
            raw = await storage.read(chunk.name, chunk.start, chunk.end)
        slot = await ring.acquire()
        done = False
        try:
            view = slot.view[:n]
            if raw is None:
                # the read's job holds ``slot`` (its tensor owns the memory) through ``then``: a
                # cancelled load's thread may still be reading into it after the ring was dropped
                await storage.readinto(
                    chunk.name, chunk.start, [view], then=lambda slot=slot: None
                )
            t1 = time.monotonic()
            pipeline.stats.add(chunks=1, storage_wait_seconds=t1 - t0)
            token = await loop.run_in_executor(
                pipeline.executor, self._stage, chunk, view, raw, slot
            )
            pipeline._count_assembled(chunk, t1)
            t2 = time.monotonic()
            delay = 0.00005
            while not self.copier.query(token):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.002)
            self.waited_seconds += time.monotonic() - t2
            done = True
        finally:
            if done:
                ring.release(slot)
            # else: copies from this slot may still be in flight; the slot stays out of the
            # ring until finish_sync() has synchronised (the load is failing anyway)

    def _stage(self, chunk: Chunk, view: memoryview, raw: Any, slot: _Slot) -> Any:
        """Raw bytes into the slot (remote stores), pieces delivered, an event after their copies.
        ``slot`` is held for the memory's sake (see :meth:`read_and_assemble`)."""
        if raw is not None:
            copy_bytes(view, memoryview(raw))
        assemble(chunk, view)
        return self.copier.record()

    def finish_sync(self) -> None:
        """Wait for every copy to finish, then free the ring."""
        try:
            self.copier.synchronize()
        finally:
            ring, self._ring = self._ring, None
            if ring is not None:
                ring.close()
        log.debug(
            "device path: %d copies, %d bytes to the device, %d bounced, %.3f s waiting for copies",
            self.copies,
            self.bytes_to_device,
            self.bounced_bytes,
            self.waited_seconds,
        )


def stager_for(
    dests: Iterable[torch.Tensor], memory: MemoryPlan, copier: DeviceCopier | None = None
) -> DeviceStager | None:
    """A :class:`DeviceStager` (its ring as the memory plan sizes it) when some destination
    is claimed by ``copier`` (the session's own, when it was made with one), else by the
    copier of :func:`use_copier`, else is on a CUDA device; ``None`` otherwise. Call on the
    caller's thread."""
    dests = list(dests)
    chosen: DeviceCopier | None = None
    for candidate in (copier, _extra_copier):
        if candidate is not None and any(candidate.claims(t) for t in dests):
            chosen = candidate
            break
    else:
        if any(t.device.type == "cuda" for t in dests):
            chosen = CudaCopier()
    if chosen is None:
        return None
    stager = DeviceStager(chosen, memory.pinned_slots, memory.slot_size)
    stager.begin(dests)
    return stager
