"""Rank 0's digest of the idle ranks (:mod:`asyncload.distributed.idle_watch`): a rank
waiting on many peers (``Monitor.wait_on``, as a send of one unit to every other rank does)
reads one key a beat instead of every peer's status, and a stalled peer is still given up on
by name with its last status, also when rank 0 is the stalled one, and when rank 0 posts no
digest (the waiters read their peers' statuses themselves, as before).

The digest's encoding and staleness are checked against a real ``TCPStore`` with given
clocks; the waits on gloo groups of 4 processes, their store operations counted by
``tests/distributed/test_waits.py``'s wrapper. Counts and names decide, never times.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _dist import free_port, run_ranks
from test_waits import _count_store, _wait_for

from asyncload.common.errors import DistributedLoadError
from asyncload.distributed.idle_watch import (
    IDLE_KEY,
    STALE_BEATS,
    IdlePoster,
    IdleView,
    decode_idle,
    encode_idle,
    listed_after,
)
from asyncload.distributed.monitor import Monitor

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]


@pytest.fixture
def store() -> Any:
    import datetime

    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))


def test_the_digest_lists_the_ranks_whose_status_stood_still(store: Any) -> None:
    """Rank 0's beat: every rank's status read at once; a rank is listed once the same
    value was seen ``listed_after`` seconds or more apart, with for how long; a rank that
    wrote nothing yet is listed too (it stands still as much as one that stopped)."""
    poster = IdlePoster(store, 4, listed_after=1.5)
    for r in (0, 1, 2):
        store.set(f"st/{r}", f"1|rank {r} at work")
    poster.post(100.0)
    assert decode_idle(store.get(IDLE_KEY)) == (1, {})
    store.set("st/1", "2|rank 1 moved")
    poster.post(101.5)
    assert decode_idle(store.get(IDLE_KEY)) == (2, {0: 1.5, 2: 1.5, 3: 1.5})
    store.set("st/3", "1|rank 3 started")
    store.set("st/0", "2|rank 0 moved")
    poster.post(103.0)
    assert decode_idle(store.get(IDLE_KEY)) == (3, {1: 1.5, 2: 3.0})
    assert encode_idle(3, {2: 3.0, 1: 1.5}) == "3|1:1.50,2:3.00"
    poster.post(104.4)  # ranks 0 and 3 idle 1.4 s: not yet
    assert decode_idle(store.get(IDLE_KEY)) == (4, {1: 2.9, 2: 4.4})


def test_ranks_are_listed_from_half_the_verdicts_timeout() -> None:
    """Ranks that only beat slowly (barrier waiters of 8,192 ranks: every 4.1 s) stay off
    the digest, which every waiting rank reads a beat."""
    assert listed_after(4, 300.0) == 150.0
    assert listed_after(4, 3.0) == 2.0  # two beats at least
    assert listed_after(8192, None) == 2 * 8192 / 2000


def test_a_waiter_ignores_a_digest_that_stopped_moving(store: Any) -> None:
    view = IdleView(4)
    assert view.read(store, 0.0) is None  # no digest yet: read the peers themselves
    assert store.get(IDLE_KEY) == b""  # the read left an empty key, not a wait
    store.set(IDLE_KEY, encode_idle(7, {3: 42.0}))
    assert view.read(store, 10.0) == {3: 42.0}
    assert view.read(store, 10.0 + STALE_BEATS * view.interval) == {3: 42.0}
    assert view.read(store, 10.1 + STALE_BEATS * view.interval) is None  # stood still
    store.set(IDLE_KEY, encode_idle(8, {}))
    assert view.read(store, 20.0) == {}  # moving again
    store.set(IDLE_KEY, "not a digest")
    assert view.read(store, 21.0) is None


def w_wait_on_everyone(rank: int, world: int, flags_dir: str, stalled: int, digest: bool) -> Any:
    """Every rank but ``stalled`` waits on every other rank (``Monitor.wait_on`` with a
    future that never ends, as a send of one unit to every peer); ``stalled`` writes its
    status and then neither beats nor ends. With ``digest``, rank 0 posts the idle ranks
    (a stalled rank 0 too: its digest thread still runs)."""
    import asyncio

    flags = Path(flags_dir)
    m = Monitor(None, 3.0, None)
    counting = _count_store(m)
    if digest:
        m.start_idle_watch()
    if rank == stalled:
        m.status("sending: stalled by the test")
        (flags / "stalled").touch()
        time.sleep(3600)
    _wait_for([flags / "stalled"])
    counting.ops.clear()
    peers = [r for r in range(world) if r != rank]

    async def wait() -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await m.wait_on(fut, peers, "waiting for the test's exchange")

    try:
        asyncio.run(wait())
    except DistributedLoadError as exc:
        return {"rank": exc.rank, "message": str(exc), "ops": list(counting.ops)}
    return {"rank": None}


def _status_reads(rank: int, ops: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, ...]]:
    """The other ranks' status keys each read operation of ``rank`` asked for."""
    return [
        keys
        for name, keys in ops
        if name in ("check", "multi_get", "get")
        and any(k.startswith("st/") and k != f"st/{rank}" for k in keys)
    ]


@pytest.mark.parametrize(
    "stalled, digest",
    [(3, True), (0, True), (3, False)],
    ids=["a-rank-with-the-digest", "rank-0-with-the-digest", "without-a-digest"],
)
def test_a_stalled_peer_is_given_up_on_by_every_rank_waiting_on_it(
    tmp_path: Path, stalled: int, digest: bool
) -> None:
    world = 4
    results = run_ranks(
        w_wait_on_everyone,
        world,
        str(tmp_path),
        stalled,
        digest,
        timeout=60,
        may_hang={stalled},
    )
    assert results[stalled].status == "timed_out", results[stalled]
    for res in results:
        if res.rank == stalled:
            continue
        assert res.ok, (res.rank, res.status, res.message, res.traceback)
        v = res.value
        assert v["rank"] == stalled, (res.rank, v)
        assert v["message"].startswith(f"rank {stalled} made no progress for "), v["message"]
        assert "its last status: sending: stalled by the test" in v["message"], v["message"]
        reads = _status_reads(res.rank, v["ops"])
        if digest and res.rank != 0:
            # the digest, then the stalled rank's status for the message: no peer's status
            # read a beat (rank 0's own reads are its digest's: every rank's, once a beat)
            # (besides the deadline's reads of the waited-on ranks' progress stamps, from half
            # the timeout on, every max(beat, timeout / 4): Monitor.PeerWait)
            peer_wait = tuple(f"st/{r}" for r in range(world) if r != res.rank)
            assert [k for k in reads if k != peer_wait] == [
                (f"st/{stalled}",),
                (f"st/{stalled}",),
            ], reads
            assert len(reads) <= 2 + 10, reads
            assert ("compare_set", (IDLE_KEY,)) in v["ops"]
        elif not digest:  # every peer's status, one round trip a beat
            assert reads and all(len(keys) == world - 1 for keys in reads[:-1]), reads


def w_real_load_with_a_stalled_rank(rank: int, world: int, path: str) -> Any:
    """A 4-rank ``ShardedLoadPlanner(wait_for_peers=True)`` load of a replicated checkpoint
    in which rank 2 stalls (``test_distributed.w_one_rank_fails``); each other rank returns
    its error and the last digest rank 0 posted (read from the group's store)."""
    from test_distributed import FAIL_OPTIONS, w_one_rank_fails

    try:
        w_one_rank_fails(rank, world, path, "sharded-wait", "load", "stall", 2, FAIL_OPTIONS)
    except DistributedLoadError as exc:
        store = dist.PrefixStore("asyncload/0/", dist.distributed_c10d._get_default_store())
        value = store.get(IDLE_KEY) if store.check([IDLE_KEY]) else b""
        return {"rank": exc.rank, "digest": decode_idle(value)[1] if value else None}
    return {"rank": None}


def test_a_real_load_gives_up_on_a_stalled_rank_through_the_digest(tmp_path: Path) -> None:
    """Under a real sharing load, rank 0 posts the digest while the ranks share, and it
    listed the stalled rank as idle for ``collective_timeout`` (4 s) by the time every other
    rank raised naming it."""
    from test_distributed import big_model, save_single

    path = tmp_path / "replicated"
    save_single(path, big_model())
    results = run_ranks(w_real_load_with_a_stalled_rank, 4, str(path), timeout=40, may_hang={2})
    assert results[2].status == "timed_out", results[2]
    for res in (results[0], results[1], results[3]):
        assert res.ok, (res.rank, res.status, res.message, res.traceback)
        assert res.value["rank"] == 2, (res.rank, res.value)
        digest = res.value["digest"]
        assert digest is not None and digest.get(2, 0.0) >= 4.0, (res.rank, digest)
        assert set(digest) == {2}, digest  # the others beat, or made progress
