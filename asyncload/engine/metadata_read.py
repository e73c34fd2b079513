"""How a load gets its ``.metadata``: as ``dcp.load`` does (the global one, else this rank's
own ``__{rank}.metadata``), and on several ranks once for the whole group
(``LoadOptions.share_metadata``; docs/distributed.md#metadata-read-once).

On N ranks every rank asking the store for the same object at the same moment is N requests
and N times its bytes: at 8,192 ranks and a 138 MiB ``.metadata``, 8,192 GETs of one key
(which S3 answers with ``503 SlowDown``) and 1.1 TB. Shared, the group's rank 0 reads it as a
single-rank load does and sends the other ranks one message over the process group: a
header (whether it read a global ``.metadata``, a digest of its URL) and the bytes. Every
rank decodes the bytes itself, with the allow-list: only bytes cross the group, never an
object. A rank that cannot use them (rank 0 read another format, a rank-local
``__0.metadata``, or failed; this rank's URL differs from rank 0's) reads its own, so the
metadata every rank plans from is what its own read would have given; only the requests
differ.

Waits, bounded as every wait on another rank is (the session's monitor): the ranks meet at a
monitored barrier first (rank 0 while its read is on the wire, the others while their own
storage opens and lists the data files), so that no rank enters the collective while another
has failed; the broadcast then runs on a daemon thread of its own while the ranks wait for
each other through the monitor (:meth:`~asyncload.distributed.monitor.Monitor.await_together`).
An error of rank 0's read is sent as "read it yourselves" and raised after the broadcast, so
the collective always completes; only a rank that dies or is interrupted inside it leaves the
others' threads to gloo's own timeout (the monitor has raised ``DistributedLoadError`` on them
by then).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import asyncload.formats as formats
from asyncload.common.errors import CheckpointNotFoundError, redact_url
from asyncload.common.loop import on_thread
from asyncload.engine.session import LoadSession
from asyncload.storage import Listed, is_local

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["aread_metadata_like_dcp", "aread_metadata_once", "exchanges_metadata"]

log = logging.getLogger("asyncload.driver")

#: The message's header: ``ok`` (a global ``.metadata`` follows), ``url`` (the digest of
#: the URL rank 0 read it from), after its length (4 bytes, big-endian).
_HEAD_LEN = 4
#: The broadcast's thread (gloo's collectives block until every rank has taken part).
_THREAD = "asyncload-metadata"


async def aread_metadata_like_dcp(
    session: LoadSession,
    rank: int,
    on_bytes: Callable[[memoryview, str], Awaitable[None]] | None = None,
) -> tuple[Metadata, bool]:
    """``.metadata``, or (as ``dcp.load`` falls back when it is absent) this rank's own
    ``__{rank}.metadata``, which ``dcp.save(..., use_collectives=False)`` writes instead;
    whether the global one was read (``on_bytes``: given its bytes before they are decoded).
    Only a missing ``.metadata`` falls back: a damaged one is reported as it is."""
    try:
        return await session.aread_metadata(on_bytes=on_bytes), True
    except CheckpointNotFoundError as missing:
        if session.checkpoint_missing:
            raise
        try:
            md = await session.aread_metadata(rank=rank)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{missing}; nor is there the rank-local {exc.path or f'__{rank}.metadata'} that "
                "dcp.save(..., use_collectives=False) writes for each rank.",
                path=missing.path,
                status=missing.status,
            ) from missing.__cause__  # the client's first error; this message says both
        log.debug(
            "%s has no .metadata: rank %d reads its rank-local __%d.metadata",
            redact_url(str(session.checkpoint)),
            rank,
            rank,
        )
        return md, False


def exchanges_metadata(session: LoadSession, world: int) -> bool:
    """Whether a load on ``world`` ranks exchanges ``.metadata`` over the group: on a group
    whose backend carries CPU tensors (not NCCL alone). The same on every rank of the group,
    whatever each rank's URL and options: a rank that would not take part while another
    waits for it would hold both at different barriers (each rank's own choice is
    :func:`_wants_shared`)."""
    if world < 2:
        return False
    backend = str(dist.get_backend(session.group)).lower()
    return not ("nccl" in backend and "gloo" not in backend)


def _wants_shared(session: LoadSession) -> bool:
    """This rank's ``LoadOptions.share_metadata``: ``"auto"`` for a remote directory,
    ``True`` for any checkpoint, ``False`` never (it reads its own, and rank 0 sends none)."""
    choice = session.config.ranks.share_metadata
    if choice == "auto":
        checkpoint = session.checkpoint
        return not is_local(checkpoint) and not formats.may_be_a_file(checkpoint)
    return bool(choice)


async def aread_metadata_once(session: LoadSession, rank: int) -> Metadata:
    """``.metadata`` for group rank ``rank`` of a load that exchanges it
    (:func:`exchanges_metadata`): read by rank 0, broadcast, decoded by each rank that wants it
    (:func:`_wants_shared`); a rank that does not reads its own meanwhile."""
    monitor = session.monitor
    group = session.group
    src = 0 if group is None else dist.get_global_rank(group, 0)
    wanted = _wants_shared(session)
    if rank == 0:
        if wanted:
            return await _read_and_send(session, monitor, src, group)
        # "read it yourselves" at once
        exchange = _exchange(session, src, group, _message(None, ""))
        return await _beside_own_read(session, rank, exchange)
    if not wanted:  # its own read, beside its part of the exchange
        return await _beside_own_read(session, rank, _exchange(session, src, group, None))
    doing = "waiting for .metadata from rank 0"
    early = asyncio.ensure_future(session.aopen_early())
    try:
        message = await _exchange(session, src, group, None, doing)
    finally:
        await asyncio.gather(early, return_exceptions=True)
    storage = await early  # an error opening the storage is this rank's error
    url = storage.url(".metadata")
    payload = _payload(message, url)
    if payload is None:  # rank 0 read no global .metadata, or another URL: read as ever
        md, _ = await aread_metadata_like_dcp(session, rank)
        return md
    raw, listing = payload
    if listing is None or not storage.use_listing(listing):
        session.start_listing()  # rank 0 had none to give: this rank lists for itself
    md = session.decode_metadata(raw, url)
    session.record(metadata_shared=True)
    return md


async def _exchange(
    session: LoadSession,
    src: int,
    group: Any,
    message: bytearray | None,
    doing: str = "exchanging .metadata with the other ranks",
) -> memoryview:
    """This rank's part of the exchange: the monitored barrier, then the broadcast
    (:func:`_broadcast_part`)."""
    await session.monitor.abarrier("metadata", doing)
    return await _broadcast_part(session, src, group, message, doing)


async def _broadcast_part(
    session: LoadSession, src: int, group: Any, message: bytearray | None, doing: str
) -> memoryview:
    """Rank 0's ``message`` (``None`` on the other ranks) broadcast on a thread of its own
    while the ranks wait for each other through the monitor; the message, on every rank."""
    fut = on_thread(lambda: _broadcast(message, src, group), _THREAD)
    return await session.monitor.await_together(fut, "md-sent", doing)


async def _beside_own_read(
    session: LoadSession, rank: int, exchange: Coroutine[Any, Any, memoryview]
) -> Metadata:
    """A rank that reads its own ``.metadata`` (``share_metadata=False``, a local or file
    checkpoint under ``"auto"``) while it takes part in the exchange; its read's error is
    raised once the exchange is done, the exchange's (another rank failed) at once."""
    own = asyncio.ensure_future(aread_metadata_like_dcp(session, rank))
    try:
        await exchange
    except BaseException:
        own.cancel()
        await asyncio.gather(own, return_exceptions=True)
        raise
    md, _ = await own
    return md


async def _read_and_send(session: LoadSession, monitor: Any, src: int, group: Any) -> Metadata:
    """Rank 0: read ``.metadata`` and send its bytes before decoding them (the other ranks
    decode beside it); "read it yourselves" when it read no global one or failed (raised
    after the message is sent)."""
    doing = "sending .metadata to the other ranks"
    # every rank arrives at once (rank 0 while its read is on the wire)
    barrier = asyncio.ensure_future(monitor.abarrier("metadata", "reading .metadata"))
    sent = False

    async def send(raw: memoryview | None, url: str) -> None:
        nonlocal sent
        sent = True
        await barrier
        listing = None
        if raw is not None:  # the data files' listing too, once back (its own bound)
            storage = await session.storage()
            listing = await storage.listing_for_peers(session.config.retry.timeout)
        await _broadcast_part(session, src, group, _message(raw, url, listing), doing)

    failed: Exception | None = None
    md: Metadata | None = None
    try:
        md, _ = await aread_metadata_like_dcp(session, 0, send)
    except Exception as exc:  # sent as "read it yourselves" (unless sending failed), raised
        failed = exc
    except BaseException:
        barrier.cancel()
        await asyncio.gather(barrier, return_exceptions=True)
        raise
    if not sent:  # another format, a rank-local __0.metadata, or an error
        try:
            await send(None, "")
        except Exception:
            if failed is None:
                raise  # else: this rank's own error is the one to raise
    if failed is not None:
        raise failed
    assert md is not None
    return md


def _digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def _message(
    raw: bytes | memoryview | None, url: str, listing: list[Listed] | None = None
) -> bytearray:
    """Header length, header, then ``raw`` (when rank 0 read a global ``.metadata``). The
    header: ``ok`` (``raw`` follows), ``url`` (a digest of the URL it was read from),
    ``listing`` (the data files' names, sizes and versions, when rank 0 listed them)."""
    head = json.dumps(
        {
            "ok": raw is not None,
            "url": _digest(url) if raw is not None else "",
            "listing": listing if raw is not None else None,
        }
    )
    encoded = head.encode()
    out = bytearray(_HEAD_LEN + len(encoded) + (0 if raw is None else len(raw)))
    out[:_HEAD_LEN] = len(encoded).to_bytes(_HEAD_LEN, "big")
    out[_HEAD_LEN : _HEAD_LEN + len(encoded)] = encoded
    if raw is not None:
        out[_HEAD_LEN + len(encoded) :] = raw
    return out


def _payload(message: memoryview, url: str) -> tuple[memoryview, list[Listed] | None] | None:
    """The ``.metadata`` bytes of rank 0's ``message`` and its listing of the data files, when
    they are this rank's (rank 0 read a global ``.metadata`` from the same URL), else None."""
    n = int.from_bytes(message[:_HEAD_LEN], "big")
    head = json.loads(bytes(message[_HEAD_LEN : _HEAD_LEN + n]))
    if not head.get("ok") or head.get("url") != _digest(url):
        return None
    entries = head.get("listing")
    listing = None
    if isinstance(entries, list):
        listing = [
            (str(name), int(size), None if v is None else str(v)) for name, size, v in entries
        ]
    return message[_HEAD_LEN + n :], listing


def _broadcast(message: bytearray | None, src: int, group: Any) -> memoryview:
    """Rank ``src``'s ``message`` on every rank of ``group`` (blocking: gloo's collectives
    complete inside the call): its length, then its bytes."""
    size = torch.tensor([0 if message is None else len(message)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if message is not None:
        buf = torch.frombuffer(message, dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=src, group=group)
    return buf.numpy().data.cast("B")
