"""Adaptive sharing's claims of work units: who reads a shared unit is decided when a rank
gets to it, by an atomic compare-and-set on the unit's key in the group's store.

- :class:`ClaimSlots`: this rank's unit reads in flight, a :class:`~asyncload.engine.meter.Meter`
  of bytes, waiters served by priority (its own planned units first) and admission bounded
  by the slots and by the rate measured so far;
- :class:`Claims`: one read phase's claims: the claim itself, with the room of a send copy
  reserved for it, and who is left out of the unit's sends;
- :func:`_unit_keys` (claim priorities) and :func:`_parse_claim` (a claim's value).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from asyncload.distributed.policy import SharingPolicy
from asyncload.distributed.share_plan import Transfer
from asyncload.distributed.shared import Share
from asyncload.distributed.values import bad_store_value, parse_rank
from asyncload.engine import Meter, MeterStatistics

__all__ = ["ClaimSlots", "Claims"]

#: Seconds of reading a rank may have claimed ahead at its own measured rate: a slow rank
#: holds few units at a time, so little is left on it when the others run out of work.
CLAIM_HORIZON = 0.1
#: The claim meter's capacity in bytes: no bound of its own (the slots and the rate bound it).
_UNBOUNDED = 1 << 62
#: The priority of a unit outside this rank's keys (after every other).
_LAST = (3, 0, 0)


class ClaimSlots:
    """At most ``slots`` unit reads at once, and (once a rate is known) at most ``rate x
    CLAIM_HORIZON`` bytes among them (one holder always may; before a rate is known, two at
    a time); waiters are served lowest ``key`` first, not FIFO, so that a rank claims its own
    planned units before it takes over other ranks'. ``rate``: the bytes per second of time
    with a holder, measured. The bytes are held in a :class:`Meter` whose ``admit`` hook
    applies the slots and the rate."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.meter = Meter(_UNBOUNDED, name="unit claims", oversize="alone", admit=self._admit)
        self._done_bytes = 0
        self._busy = 0.0
        self._busy_since = 0.0

    @property
    def rate(self) -> float | None:
        """Bytes read per second of time with a unit read in flight; None before any."""
        active = time.monotonic() - self._busy_since if self.meter.used else 0.0
        busy = self._busy + active
        return self._done_bytes / busy if self._done_bytes and busy > 0 else None

    def _admit(self, used: int, nbytes: int) -> bool:
        holders = self.meter.holders
        if holders >= self.slots:
            return False
        rate = self.rate
        if rate is None:  # nothing measured yet: two at a time
            return holders < 2
        return used + nbytes <= rate * CLAIM_HORIZON

    async def acquire(self, key: Any, nbytes: int = 0) -> None:
        """Wait for a slot for a unit of ``nbytes``, served by ``key`` (lowest first)."""
        if not self.meter.used:
            self._busy_since = time.monotonic()
        await self.meter.acquire(max(1, nbytes), key=key)

    def release(self, nbytes: int = 0, *, done: bool = False) -> None:
        """Give a slot back; ``done``: its ``nbytes`` were read (they count for the rate)."""
        n = max(1, nbytes)
        if done:
            self._done_bytes += nbytes
        if self.meter.used == n:  # the last holder: the busy time ends (or the next one's begins)
            now = time.monotonic()
            self._busy += now - self._busy_since
            self._busy_since = now
        self.meter.release(n)

    def statistics(self) -> MeterStatistics:
        return self.meter.statistics()


class Claims:
    """The claims of one read phase of adaptive sharing on this rank: each shared unit is
    claimed by the first rank that needs it and has a free slot (``compare_set`` on
    ``<prefix><unit index>``: the winner's rank). A claimant that would send from a copy
    reserves its room here: from the load's :class:`BackgroundSends` when returning before
    the peers, else from this phase's meter of send copies (``send_budget``)."""

    def __init__(
        self,
        share: Share,
        policy: SharingPolicy,
        keys: dict[int, tuple[int, int, int]],
        prefix: str,
    ) -> None:
        self.share = share
        self.keys = keys
        #: The prefix of the units' claim keys in the store (the phase, and the component
        #: their numbers are within).
        self.prefix = prefix
        self.slots = ClaimSlots(policy.claim_slots)
        self.sends = share.sends
        #: Bytes of send copies (units claimed in staged chunks) allowed at once.
        self.copies = Meter(policy.send_budget, name="send copies")

    def key(self, unit: Transfer) -> tuple[int, int, int]:
        """The claim priority of ``unit`` (lower first)."""
        return self.keys.get(unit.index, _LAST)

    async def claim(
        self, unit: Transfer, send_bytes: int, direct_ok: bool = False
    ) -> tuple[int, frozenset[int], int]:
        """Who reads ``unit``, which of its consumers read it themselves instead of receiving
        it, and the bytes of send copy reserved: ``(this rank, ...)`` when it claims it now
        (holding a slot, which the caller releases), else the claimant's rank.

        A claimant that would send from a copy (a staged chunk; every unit when returning
        before the peers) needs ``send_bytes`` of send memory, so that the chunk does not
        wait for slow consumers; without that room it claims the unit without sending (value
        ``"<rank>!"``) and every consumer reads it itself: sends never wait for memory, so they
        never hold up a receive. Returning before the peers, a consumer far behind
        (:meth:`BackgroundSends.behind`) is left out (``"<rank>!<peer>,<peer>"``): it reads the
        unit itself; the others receive it from a copy or, without room, from the destination
        (``direct_ok``; sent in the background and waited for at the end of the phase)."""
        share = self.share
        rank = share.rank
        await self.slots.acquire(self.key(unit), unit.nbytes)
        peers = [c for c in unit.consumers if c != rank]
        reserved = 0
        skip: list[int] = []
        sends = self.sends
        if sends is not None and peers:
            # without room for a copy, a peer far behind (holding this rank's copies) reads it
            # itself; the others get a copy if there is room, else the destination's bytes
            # (waited for before the load returns) or, from a staging buffer, nothing (each
            # reads it)
            skip = sends.behind(peers, unit.nbytes)
            if len(skip) < len(peers) and sends.reserve(unit.nbytes):
                reserved = unit.nbytes
            elif not direct_ok:
                skip = peers
        elif send_bytes and self.copies.try_acquire(send_bytes):
            reserved = send_bytes
        elif send_bytes:
            skip = peers
        try:
            key = f"{self.prefix}{unit.index}"
            raw = share.monitor.store.compare_set(key, "", _mark(rank, skip, peers))
            got = raw.decode("utf-8", "replace")
            winner, left_out = _parse_claim(got, unit.consumers, share.monitor.key_name(key))
        except BaseException:
            self.unreserve(reserved)
            self.slots.release(unit.nbytes)
            raise
        if winner == rank:
            share.monitor._written.append(key)
        else:
            self.unreserve(reserved)
            reserved = 0
            if rank not in left_out:
                self.slots.release(
                    unit.nbytes
                )  # a transfer is coming; else: read it under this slot
        return winner, left_out, reserved

    def unreserve(self, nbytes: int) -> None:
        """Give back the room of a send copy (sent, or never made)."""
        if not nbytes:
            return
        if self.sends is not None:
            self.sends.unreserve(nbytes)
        else:
            self.copies.release(nbytes)


def _mark(rank: int, skip: Sequence[int], peers: Sequence[int]) -> str:
    """A claim's value (see :func:`_parse_claim`)."""
    if not skip:
        return str(rank)
    if len(skip) == len(peers):
        return f"{rank}!"
    return f"{rank}!" + ",".join(map(str, skip))


def _unit_keys(units: Sequence[Transfer], rank: int) -> dict[int, tuple[int, int, int]]:
    """Claim priority of each unit this rank needs (lower first): the units the plan gave
    it, in order; then other ranks' units from the back of each one's queue, round-robin
    over the owners, so that a rank taking over work meets the slow owner in the middle."""
    queues: dict[int, list[int]] = {}
    for u in units:
        if rank in u.consumers:
            queues.setdefault(u.owner, []).append(u.index)
    keys: dict[int, tuple[int, int, int]] = {}
    for owner, q in queues.items():
        for pos, i in enumerate(q):
            keys[i] = (0, pos, 0) if owner == rank else (2, len(q) - 1 - pos, owner)
    return keys


def _parse_claim(
    value: str, consumers: Sequence[int], key: str = ""
) -> tuple[int, frozenset[int]]:
    """A claim's value: the claimant and the consumers that read the unit themselves
    (``"3"``: none; ``"3!"``: all; ``"3!1,2"``: ranks 1 and 2). Checked: the claimant is one
    of the unit's ``consumers`` and so is every rank left out (not the claimant); anything
    else is a :class:`DistributedLoadError` naming ``key`` (:mod:`~asyncload.distributed.values`)."""
    what = f"the claim of a unit consumed by ranks {list(consumers)}"
    who, bang, rest = value.partition("!")
    winner = parse_rank(key, who, consumers, what=what, writer="an unknown writer")
    if not bang:
        return winner, frozenset()
    if not rest:
        return winner, frozenset(c for c in consumers if c != winner)
    left: set[int] = set()
    for x in rest.split(","):
        r = parse_rank(key, x, consumers, what=what, writer=f"rank {winner} (as the value says)")
        if r == winner:
            raise bad_store_value(
                key, value, f"its claimant, rank {winner}, is also among those left out", what=what
            )
        left.add(r)
    return winner, frozenset(left)
