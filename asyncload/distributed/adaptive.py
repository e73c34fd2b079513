"""The reader pool of adaptive sharing: :class:`_AdaptivePipeline`. Each shared unit is
claimed (:mod:`asyncload.distributed.claims`) by the first rank that needs it and has a free
unit reader, read by it and sent to the other consumers; they receive it from the claimant,
or, when it is late, read it themselves (first copy wins). Late is decided by the one
hedging rule, :func:`asyncload.common.latency.hedge_delay`, over a :class:`LoadClock` of this
rank's own unit reads: a transfer is hedged when it takes longer than reading the unit
would.

Why it cannot deadlock under any budget: a unit is claimed only when its claimant starts
reading it, so a receive waits only on a storage read already in flight on the claimant;
sends never hold memory a receive needs and never hold up the sender's chunks (they run in
the background, from destination memory or from a copy whose room was reserved at the
claim; without room the unit is claimed "without sending" and each consumer reads it).
Every consumer that did not claim a unit posts exactly one receive for it (unless it was
claimed without sending), so every send is matched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from asyncload.common.errors import DistributedLoadError, first_error
from asyncload.common.latency import LoadClock, hedge_delay
from asyncload.distributed.claims import Claims
from asyncload.distributed.policy import SharingPolicy
from asyncload.distributed.share_plan import Transfer, _Part
from asyncload.distributed.shared import Share, _SharedPipeline
from asyncload.engine import Chunk, Meter, Pipeline

log = logging.getLogger("asyncload.sharded")

_T = TypeVar("_T")

#: How often a late unit whose hedge found every hedge slot taken looks again, seconds.
_HEDGE_SLOT_POLL = 0.05


class _AdaptivePipeline(_SharedPipeline):
    """Adaptive sharing's reads of one phase: claims (:class:`Claims`), the claimant's reads
    and sends (:meth:`_own_unit`), and the consumers' hedged receives (:meth:`_receive`)."""

    def __init__(
        self,
        base: Pipeline,
        session: Share,
        parts: dict[int, list[_Part]],
        tag_base: int,
        total_chunks: int,
        claims: Claims,
        policy: SharingPolicy,
    ) -> None:
        super().__init__(base, session, parts, tag_base, total_chunks)
        self.claims = claims
        self.hedge = policy.hedge
        #: Cross-rank hedges in flight (at most the hedge policy's ``max_in_flight``).
        self.hedges = Meter(policy.hedge.max_in_flight, name="cross-rank hedges")
        #: Returning before the peers (``wait_for_peers=False``): every send from a private
        #: copy, handed to this load's BackgroundSends.
        self.sends = session.sends
        #: This rank's own unit reads (seconds, bytes): what a late transfer is measured by.
        self.clock = LoadClock()
        self._bg: asyncio.TaskGroup | None = None

    async def run(self, chunks: Iterable[Chunk]) -> None:
        # background sends (from destination memory) and late copies of hedged units are
        # awaited here, before the phase ends; a failure of one cancels the phase
        try:
            async with asyncio.TaskGroup() as tg:
                self._bg = tg
                await super().run(chunks)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            self._bg = None

    def _background(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        assert self._bg is not None
        return self._bg.create_task(coro)

    def hedge_delay(self, nbytes: int) -> float | None:
        """Seconds after which a transfer of ``nbytes`` still on its way is read from storage
        instead (None: hedging is off): the storage reads' rule over this rank's unit reads."""
        return hedge_delay(self.hedge, self.clock, nbytes)

    async def _claimed(self, chunk: Chunk, part: _Part, view: memoryview, unit: Transfer) -> None:
        """Read a unit under the slot the claim left held; its time goes on the clock."""
        done = False
        try:
            t0 = time.monotonic()
            await self._read_part(chunk, part, view)
            self.clock.finished(time.monotonic() - t0, unit.nbytes)
            done = True
        finally:
            self.claims.slots.release(unit.nbytes, done=done)

    async def _send_copy(self, unit: Transfer, copy: bytearray, peers: list[int]) -> None:
        try:
            await self._send(unit, memoryview(copy), copy, peers)
        finally:
            self.claims.unreserve(len(copy))

    async def _send(self, unit: Transfer, view: memoryview, keep: Any, peers: list[int]) -> None:
        session = self.session
        where = f"bytes [{unit.start}, {unit.end}) of {unit.name}"
        await session.transport.exchange(
            "send",
            peers,
            self.tag_base + unit.index,
            unit.index,
            view,
            keep,
            session.monitor,
            f"sending {where} to rank(s) {peers}",
        )
        self.stats.add(bytes_sent=unit.nbytes * len(peers))

    async def _recv(
        self, unit: Transfer, owner: int, view: memoryview, keep: Any
    ) -> BaseException | None:
        """Receive ``unit`` from ``owner`` (counted once posted: a late copy of a hedged unit
        lands too, in memory nobody reads). Returning before the peers, a failure is returned,
        not raised (the caller decides: a sender that returned and died is read around)."""
        session = self.session
        where = f"bytes [{unit.start}, {unit.end}) of {unit.name}"
        self.stats.add(bytes_received=unit.nbytes)
        try:
            await session.transport.exchange(
                "recv",
                [owner],
                self.tag_base + unit.index,
                unit.index,
                view,
                keep,
                session.monitor,
                f"waiting for {where} from rank {owner}",
            )
        except Exception as exc:
            if self.sends is None:
                raise
            return exc
        return None

    async def _own_copy(self, chunk: Chunk, unit: Transfer) -> memoryview:
        """A unit read from storage into memory of its own (a cross-rank hedge)."""
        if self.storage.supports_readinto:
            buf = memoryview(bytearray(unit.nbytes))
            await self.storage.readinto(chunk.name, unit.start, [buf])
            return buf
        return await self.storage.read(chunk.name, unit.start, unit.end)

    async def _unit(
        self, chunk: Chunk, part: _Part, buf: memoryview, direct: bool, state: dict[str, Any]
    ) -> None:
        unit = part.transfer
        assert unit is not None
        view = buf[part.start - chunk.start : part.end - chunk.start]
        rank = self.session.rank
        peers = len(unit.consumers) - 1
        send_bytes = 0 if direct else unit.nbytes if peers else 0
        owner, left_out, reserved = await self.claims.claim(unit, send_bytes, direct)
        if owner == rank:
            await self._own_unit(chunk, part, view, unit, left_out, reserved, direct)
        elif (
            rank in left_out
        ):  # claimed without a send to this rank (its memory for sends was full)
            await self._claimed(chunk, part, view, unit)
            self.stats.add(bytes_hedged=unit.nbytes)
        else:
            await self._receive(chunk, view, unit, owner, direct, state)

    async def _own_unit(
        self,
        chunk: Chunk,
        part: _Part,
        view: memoryview,
        unit: Transfer,
        left_out: frozenset[int],
        reserved: int,
        direct: bool,
    ) -> None:
        """This rank claimed ``unit``: read it, then send it on without holding the chunk."""
        rank = self.session.rank
        try:
            await self._claimed(chunk, part, view, unit)
        except BaseException:
            self.claims.unreserve(reserved)
            raise
        if unit.owner != rank:
            self.stats.add(bytes_taken_over=unit.nbytes)
        to = [c for c in unit.consumers if c != rank and c not in left_out]
        if to:
            self._post_digest(self.tag_base + unit.index, view)
        if reserved and self.sends is not None:  # from a copy that may outlive the load
            self.sends.post(
                self.session.transport.group, to, self.tag_base + unit.index, bytearray(view)
            )
            self.stats.add(bytes_sent=unit.nbytes * len(to))
        elif (
            to and direct
        ):  # from the destination's memory, ready and unchanging: the chunk does not wait
            self._background(self._send(unit, view, chunk, to))
        elif to:  # from a copy (room reserved at the claim), so the chunk does not wait either
            self._background(self._send_copy(unit, bytearray(view), to))

    async def _receive(
        self,
        chunk: Chunk,
        view: memoryview,
        unit: Transfer,
        owner: int,
        direct: bool,
        state: dict[str, Any],
    ) -> None:
        """Receive ``unit`` from ``owner``, or, when it is late (:meth:`hedge_delay`) and a
        hedge slot is free, read it from storage too: the first copy wins. Received into the
        staging buffer, or (direct chunks) into memory of its own, never into a destination;
        a receive that may still land keeps that memory alive."""
        rank = self.session.rank
        target = view if not direct else memoryview(bytearray(unit.nbytes))
        state["pending"] = True
        recv = self._background(self._recv(unit, owner, target, chunk))
        hedge: asyncio.Task[memoryview] | None = None
        try:
            delay = self.hedge_delay(unit.nbytes)
            if delay is not None:
                await asyncio.wait({recv}, timeout=delay)
                # late, with every hedge slot taken: wait for one to free, not for the owner
                # alone (an owner that stalls must not hold this unit up for ever)
                while not recv.done() and not self.hedges.try_acquire():
                    await asyncio.wait({recv}, timeout=_HEDGE_SLOT_POLL)
            if delay is not None and not recv.done():  # late, holding a hedge slot
                try:
                    hedge = asyncio.ensure_future(self._own_copy(chunk, unit))
                    await asyncio.wait({recv, hedge}, return_when=asyncio.FIRST_COMPLETED)
                    if not recv.done() and hedge.done() and hedge.exception() is None:
                        view[:] = hedge.result()  # first copy wins; the late one lands in `target`
                        self.stats.add(bytes_hedged=unit.nbytes)
                        state["tainted"] = True
                        log.debug(
                            "rank %d read %s [%d, %d) itself: rank %d was late",
                            rank,
                            unit.name,
                            unit.start,
                            unit.end,
                            owner,
                        )
                        if self.sends is not None:
                            # nobody waits for the late copy: its receive stays posted (so the
                            # owner's send is matched) and its thread keeps `target` alive
                            recv.cancel()
                        return
                finally:
                    self.hedges.release()
            failed = await recv
            if failed is not None:
                await self._sender_lost(chunk, unit, owner, view, failed)
                return
            self._check_digest(
                self.tag_base + unit.index,
                target,
                owner,
                f"bytes [{unit.start}, {unit.end}) of {unit.name}",
            )
            if direct:
                view[:] = target
        finally:
            if hedge is not None and not hedge.done():
                hedge.cancel()
                await asyncio.wait({hedge})
            if hedge is not None and hedge.done() and not hedge.cancelled():
                hedge.exception()  # retrieved: a failed hedge only means waiting for the transfer

    async def _sender_lost(
        self, chunk: Chunk, unit: Transfer, owner: int, view: memoryview, exc: BaseException
    ) -> None:
        """A receive failed while returning before the peers: when its sender had already
        finished its load (and then exited, or destroyed its group), read the unit from
        storage; anything else is this load's failure."""
        monitor = self.session.monitor
        if not (
            isinstance(exc, DistributedLoadError) and exc.rank == owner and monitor.finished(owner)
        ):
            raise exc
        log.info(
            "rank %d read %s [%d, %d) itself: rank %d finished its load and can no longer "
            "send it (%s)",
            self.session.rank,
            unit.name,
            unit.start,
            unit.end,
            owner,
            exc,
        )
        view[:] = await self._own_copy(chunk, unit)
        self.stats.add(bytes_hedged=unit.nbytes)

    def _direct(self, chunk: Chunk, parts: list[_Part]) -> bool:
        # who sends is only known at the claims: received units land in memory of their own
        return len(chunk.segments) == 1 and chunk.tiles_into()

    async def _run_parts(
        self,
        chunk: Chunk,
        parts: list[_Part],
        buf: memoryview,
        direct: bool,
        state: dict[str, Any],
    ) -> None:
        claims = self.claims
        order = sorted(parts, key=lambda p: claims.key(p.transfer) if p.transfer else (-1, 0, 0))
        async with asyncio.TaskGroup() as tg:
            for p in order:
                if p.transfer is None:
                    view = buf[p.start - chunk.start : p.end - chunk.start]
                    tg.create_task(self._read_part(chunk, p, view))
                else:
                    tg.create_task(self._unit(chunk, p, buf, direct, state))
