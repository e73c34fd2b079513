"""Moving bytes between ranks: :class:`_Transport`, point-to-point sends and receives of
byte ranges over the process group, and the waits on their works (a thread for gloo, whose
works complete only inside ``wait()``; polling for NCCL)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from asyncload.common.errors import AsyncLoadError, DistributedLoadError
from asyncload.distributed.monitor import Monitor
from asyncload.distributed.share_plan import Transfer
from asyncload.engine import copy_bytes


def _transport_kind(group: Any) -> tuple[str, torch.device]:
    """``("thread", cpu)`` for gloo and other CPU backends (waits run in a thread: gloo's
    point-to-point works only complete inside ``wait()``), ``("poll", cuda)`` for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return "thread", torch.device("cpu")
    return "poll", torch.device("cuda", torch.cuda.current_device())


#: Buffers of point-to-point operations abandoned after a failure (NCCL): kept alive until
#: the operation completes, so that a late transfer never writes into freed memory.
_orphans: list[tuple[list[Any], Any]] = []


class _Transport:
    """Point-to-point sends and receives of byte ranges over the process group.

    With NCCL the bytes travel through a CUDA buffer on the caller's current device; with
    ``ordered`` (always for NCCL) the operations between two ranks are issued in transfer
    order on both sides, so that NCCL's in-order matching pairs them correctly.
    """

    def __init__(self, group: Any, *, ordered: bool | None = None) -> None:
        self.group = group
        self.kind, self.device = _transport_kind(group)
        self.ordered = self.kind == "poll" if ordered is None else ordered
        self._turns: dict[int, list[int]] = {}
        self._next: dict[int, int] = {}
        self._cond: asyncio.Condition | None = None

    def set_order(self, transfers: Sequence[Transfer], rank: int) -> None:
        """The transfers this rank takes part in, per peer, in the order both sides issue them."""
        self._turns = {}
        self._next = {}
        for t in transfers:
            if rank not in t.consumers:
                continue
            peers = [c for c in t.consumers if c != rank] if t.owner == rank else [t.owner]
            for p in peers:
                self._turns.setdefault(p, []).append(t.index)
        for p in self._turns:
            self._next[p] = 0

    async def _my_turn(self, peer: int, index: int) -> None:
        if not self.ordered:
            return
        if self._cond is None:
            self._cond = asyncio.Condition()
        turns = self._turns[peer]
        async with self._cond:
            await self._cond.wait_for(lambda: turns[self._next[peer]] == index)

    async def _done_turn(self, peer: int) -> None:
        if not self.ordered:
            return
        assert self._cond is not None
        async with self._cond:
            self._next[peer] += 1
            self._cond.notify_all()

    def _tensor(self, view: memoryview) -> torch.Tensor:
        return torch.frombuffer(view, dtype=torch.uint8)

    async def exchange(
        self,
        op: str,
        peers: Sequence[int],
        tag: int,
        index: int,
        view: memoryview,
        keep: Any,
        monitor: Monitor,
        doing: str,
    ) -> None:
        """Send ``view`` to every rank in ``peers`` (``op="send"``) or receive it from the one
        peer (``op="recv"``), then wait, watching the peers for a stall."""
        loop = asyncio.get_running_loop()
        works: list[Any] = []
        buffers: list[Any] = []
        dev: torch.Tensor | None = None
        current: int | None = None
        try:
            for peer in peers:
                await self._my_turn(peer, index)
                current = peer
                try:
                    if dev is None:
                        cpu = torch.frombuffer(view, dtype=torch.uint8)
                        if self.kind == "poll":
                            dev = (
                                cpu.to(self.device)
                                if op == "send"
                                else torch.empty(len(view), dtype=torch.uint8, device=self.device)
                            )
                        else:
                            dev = cpu
                        buffers.append(dev)
                    with (
                        torch.cuda.device(self.device)
                        if self.device.type == "cuda"
                        else _nullcontext()
                    ):
                        if op == "send":
                            works.append(
                                dist.isend(dev, group=self.group, group_dst=peer, tag=tag)
                            )
                        else:
                            works.append(
                                dist.irecv(dev, group=self.group, group_src=peer, tag=tag)
                            )
                finally:
                    await self._done_turn(peer)
            current = None
            fut: asyncio.Future[None] = loop.create_future()
            if self.kind == "thread":
                _wait_in_thread(works, (buffers, keep), loop, fut)
            else:
                poller = loop.create_task(_poll_works(works, fut))
                _pollers.add(poller)  # a reference until it ends (the loop keeps only a weak one)
                poller.add_done_callback(_pollers.discard)
            await monitor.wait_on(fut, peers, doing)
            if self.kind == "poll" and op == "recv" and dev is not None:
                copy_bytes(view, dev.cpu().numpy().data)
            works = []
        except BaseException as exc:
            if works and self.kind == "poll":
                _orphans.append((buffers, keep))
            cause: BaseException = exc
            if isinstance(exc, _WorkFailed):
                current, cause = peers[exc.index], exc.cause
            elif current is None and len(peers) == 1:
                current = peers[0]
            if isinstance(cause, RuntimeError) and not isinstance(
                cause, AsyncLoadError
            ):  # gloo/NCCL: peer gone
                who = f"rank {current}" if current is not None else f"rank(s) {list(peers)}"
                raise DistributedLoadError(
                    f"rank {monitor.rank} lost its connection to {who} while {doing}: {cause}",
                    rank=current,
                    doing=doing,
                ) from cause
            if cause is not exc:
                raise cause from None
            raise


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _WorkFailed(Exception):
    """Work number ``index`` of an exchange raised ``cause``."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(index, cause)
        self.index = index
        self.cause = cause


def _wait_in_thread(
    works: list[Any], keep: Any, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]
) -> None:
    """Wait for gloo works on a daemon thread (it holds ``keep``, the buffers, until they
    finish)."""

    def settle(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def run() -> None:
        err: BaseException | None = None
        for i, w in enumerate(works):
            try:
                w.wait()
            except BaseException as exc:
                err = _WorkFailed(i, exc)
                break
        try:
            loop.call_soon_threadsafe(settle, err)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass
        _ = keep

    threading.Thread(target=run, name="asyncload-share-wait", daemon=True).start()


_pollers: set[asyncio.Task[None]] = set()


async def _poll_works(works: list[Any], fut: asyncio.Future[None]) -> None:
    """Wait for NCCL works by polling (their ``is_completed`` is non-blocking and exact)."""
    delay = 0.0002
    for i, w in enumerate(works):
        try:
            while not w.is_completed():
                if fut.done():
                    return
                await asyncio.sleep(delay)
                delay = min(0.005, delay * 2)
            w.wait()
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(_WorkFailed(i, exc))
            return
    if not fut.done():
        fut.set_result(None)
