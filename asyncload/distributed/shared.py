"""The reader pool of static sharing: :class:`_SharedPipeline`, a ``Pipeline`` where a
chunk's bytes may come from storage, from another rank, or both; bytes this rank owns are
sent on as soon as they are read. :class:`Share` is what a pipeline needs of the share
session that made it."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any, Protocol

from asyncload.common.errors import DistributedLoadError, first_error
from asyncload.distributed.monitor import Monitor
from asyncload.distributed.sends import BackgroundSends
from asyncload.distributed.share_plan import _Part
from asyncload.distributed.transport import _Transport
from asyncload.distributed.values import bad_store_value
from asyncload.engine import Chunk, Pipeline, _DirectRun, assemble, direct_run, track


class Share(Protocol):
    """This rank's side of a sharded load, as its read pipelines see it."""

    group: Any
    rank: int
    monitor: Monitor
    transport: _Transport
    #: What the rank is doing now (its status's words).
    doing: str
    #: The load's sends that may outlive it (returning before the peers), or None.
    sends: BackgroundSends | None
    #: The node this rank says it runs on (node-aware sharing).
    node_id: str


class _SharedPipeline(Pipeline):
    """The reader pool, where a chunk's bytes may come from storage, from another rank, or
    both; bytes this rank owns are sent on as soon as they are read."""

    def __init__(
        self,
        base: Pipeline,
        session: Share,
        parts: dict[int, list[_Part]],
        tag_base: int,
        total_chunks: int,
    ) -> None:
        super().__init__(
            base.storage,
            base.config,
            base.stats,
            base.executor,
            budget=base.budget,
            chunking=base.chunking,
        )
        self.on_progress = base.on_progress
        # chunks for CUDA destinations: unshared ones go through the pinned ring as usual;
        # shared ones are assembled from host memory (the stager bounces them into pinned memory)
        self.staging = base.staging
        self.session = session
        self.parts = parts
        self.tag_base = tag_base
        self.total = total_chunks
        self.done = 0

    def _post_digest(self, tag: int, view: memoryview) -> None:
        if self.config.checks.verify:
            post_digest(self.session, tag, view)

    def _check_digest(self, tag: int, view: memoryview, sender: int, what: str) -> None:
        if self.config.checks.verify:
            check_digest(self.session, tag, view, sender, what)

    async def _read_and_assemble(self, chunk: Chunk) -> None:
        members: list[Chunk] | None = getattr(
            chunk, "members", None
        )  # the base pipeline's batch of tiny reads
        if members is not None and any(id(c) in self.parts for c in members):
            # shared members one by one; a run's others still as a run (of their own)
            rest = (
                [c for c in members if id(c) not in self.parts]
                if isinstance(chunk, _DirectRun)
                else []
            )
            async with asyncio.TaskGroup() as tg:
                for c in members:
                    if id(c) in self.parts or not rest:
                        tg.create_task(self._read_and_assemble(c))
                if rest:
                    tg.create_task(super()._read_and_assemble(direct_run(rest, chunk.nbytes)))
            if rest:
                self.done += len(rest)
                self.session.monitor.progress(
                    f"{self.session.doing}: {self.done} of {self.total} chunks done"
                )
            return
        parts = self.parts.get(id(chunk))
        if parts is None:
            await super()._read_and_assemble(chunk)
        else:
            await self._shared(chunk, parts)
        self.done += len(members) if members is not None else 1
        self.session.monitor.progress(
            f"{self.session.doing}: {self.done} of {self.total} chunks done"
        )

    async def _read_part(self, chunk: Chunk, part: _Part, view: memoryview) -> None:
        t0 = time.monotonic()
        await self.storage.readinto(chunk.name, part.start, [view])
        self.stats.add(chunks=1, storage_wait_seconds=time.monotonic() - t0)

    async def _part(
        self, chunk: Chunk, part: _Part, buf: memoryview, state: dict[str, bool]
    ) -> None:
        view = buf[part.start - chunk.start : part.end - chunk.start]
        t = part.transfer
        if part.kind == "read":
            await self._read_part(chunk, part, view)
            return
        assert t is not None
        session = self.session
        tag = self.tag_base + t.index
        where = f"bytes [{t.start}, {t.end}) of {t.name}"
        if part.kind == "own":
            await self._read_part(chunk, part, view)
            peers = [c for c in t.consumers if c != session.rank]
            self._post_digest(tag, view)
            state["pending"] = True
            await session.transport.exchange(
                "send",
                peers,
                tag,
                t.index,
                view,
                chunk,
                session.monitor,
                f"sending {where} to rank(s) {peers}",
            )
            self.stats.add(bytes_sent=t.nbytes * len(peers))
        else:
            state["pending"] = True
            await session.transport.exchange(
                "recv",
                [t.owner],
                tag,
                t.index,
                view,
                chunk,
                session.monitor,
                f"waiting for {where} from rank {t.owner}",
            )
            self._check_digest(tag, view, t.owner, where)
            self.stats.add(bytes_received=t.nbytes)

    def _direct(self, chunk: Chunk, parts: list[_Part]) -> bool:
        """Whether the chunk's bytes land straight in its destination: one contiguous CPU
        view, and nothing received (receive into a staging buffer, never into the
        destination: after a failure, a transfer still pending can then only ever land in a
        buffer that was given up on)."""
        return (
            len(chunk.segments) == 1
            and chunk.tiles_into()
            and all(p.kind != "recv" for p in parts)
        )

    async def _run_parts(
        self,
        chunk: Chunk,
        parts: list[_Part],
        buf: memoryview,
        direct: bool,
        state: dict[str, Any],
    ) -> None:
        if len(parts) == 1:
            await self._part(chunk, parts[0], buf, state)
        else:
            async with asyncio.TaskGroup() as tg:
                for p in parts:
                    tg.create_task(self._part(chunk, p, buf, state))

    async def _shared(self, chunk: Chunk, parts: list[_Part]) -> None:
        loop = asyncio.get_running_loop()
        direct = self._direct(chunk, parts)
        pooled: bytearray | None = None
        if direct:
            buf = chunk.segments[0].into
            assert buf is not None
        else:
            pooled = self._pool.get(chunk.nbytes)
            buf = memoryview(pooled)[: chunk.nbytes]
        #: pending: a transfer into ``buf`` was started; tainted: one may still land after the
        #: chunk is done
        state: dict[str, Any] = {"pending": False, "tainted": False}
        ok = False
        try:
            await self._run_parts(chunk, parts, buf, direct, state)
            t1 = time.monotonic()
            if direct:
                if chunk.trackers:
                    await loop.run_in_executor(self.executor, track, chunk, [buf])
            else:
                await loop.run_in_executor(self.executor, assemble, chunk, buf)
            ok = True
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        finally:
            # a buffer a transfer may still write into (a hedged unit's late copy, or after a
            # failure) is never reused: the thread waiting for it keeps it alive until it lands
            if pooled is not None and not state["tainted"] and (ok or not state["pending"]):
                self._pool.put(pooled)
        self._count_assembled(chunk, t1)


# --- verify=True: bytes from a peer are checked against the sender's CRC-32 --------------------


def post_digest(session: Share, tag: int, view: memoryview) -> None:
    """``LoadOptions.verify``: the CRC-32 of the bytes this rank sends under ``tag``, as it
    read them from storage, for its receivers (one store key, set before the send)."""
    monitor = session.monitor
    key = f"vd/{tag}"
    monitor.store.set(key, str(zlib.crc32(view)))
    monitor._written.append(key)


def check_digest(session: Share, tag: int, view: memoryview, sender: int, what: str) -> None:
    """``LoadOptions.verify``: the bytes received under ``tag`` from ``sender`` (``what``:
    which) are those it read; DistributedLoadError naming it otherwise."""
    monitor = session.monitor
    key = f"vd/{tag}"
    raw = monitor.store.get(key)  # set before the send: there
    text = raw.decode("utf-8", "replace")
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and int(text) < 1 << 32):
        raise bad_store_value(
            monitor.store.key_name(key),
            raw,
            "not a CRC-32",
            writer=f"rank {sender} (it sent {what}) or an unknown writer",
            what=f"the CRC-32 of {what}",
        )
    got = zlib.crc32(view)
    if got != int(text):
        rank = session.rank
        raise DistributedLoadError(
            f"rank {rank} received {what} from rank {sender}, and they are not the bytes "
            f"rank {sender} read (CRC-32 {got:#010x} received, {int(text):#010x} as rank "
            f"{sender} read them; LoadOptions.verify=True): damaged between the ranks, or "
            f"rank {sender} sent other bytes than it read",
            rank=sender,
            doing=f"sending {what} to rank {rank}",
        )
