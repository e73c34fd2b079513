"""Waits at scale (issue 29): a rank waiting at a monitored barrier polls one key and reads
no other rank's keys but its watcher's status; only the barrier's watcher reads the missing
ranks' keys (and only theirs). The guarantees stay: a stalled rank is given up on by name
with its last status (also when the watcher itself died), and every waiting rank logs the
late-rank line naming the late rank.

Store operations are counted by a wrapper around the store each rank's monitor talks to
(the group's store under the monitor's prefix). Counts decide, never times: the late rank
arrives only once every waiting rank has beaten a few times and logged its line (files in
``flags/``), and the deadlines are failure cut-offs. Multi-rank tests run on gloo process
groups of 4 processes (``tests/_dist.py``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _dist import all_ok, run_ranks

from asyncload.distributed import InFlightRequest, RankProgress
from asyncload.distributed.barrier import CHUNK, present, read_present
from asyncload.distributed.lateness import digest, digest_message, late_message
from asyncload.distributed.monitor import Monitor

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

#: Seconds a rank waits for the others' flags at most (a failure cut-off, never a result).
CUT_OFF = 60.0


class Counting:
    """A store that records every operation made through it: (name, keys), and what each
    ``check`` answered (``checked``: keys, answer)."""

    def __init__(self, inner: Any, on_set: Any = None) -> None:
        self.inner = inner
        self.ops: list[tuple[str, tuple[str, ...]]] = []
        self.checked: list[tuple[tuple[str, ...], bool]] = []
        self.on_set = on_set

    def set(self, key: str, value: Any) -> None:
        self.ops.append(("set", (key,)))
        self.inner.set(key, value)
        if self.on_set is not None:
            self.on_set(key)

    def get(self, key: str) -> bytes:
        self.ops.append(("get", (key,)))
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        self.ops.append(("check", tuple(keys)))
        got = bool(self.inner.check(keys))
        self.checked.append((tuple(keys), got))
        return got

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops.append(("multi_get", tuple(keys)))
        return self.inner.multi_get(keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.ops.append(("compare_set", (key,)))
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self.ops.append(("add", (key,)))
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        self.ops.append(("delete_key", (key,)))
        return self.inner.delete_key(key)


def _wait_for(files: list[Path]) -> None:
    end = time.monotonic() + CUT_OFF
    while not all(f.exists() for f in files) and time.monotonic() < end:
        time.sleep(0.01)


def _catch_lines(rank: int, flags: Path) -> list[str]:
    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                lines.append(record.getMessage())
                (flags / f"logged-{rank}").touch()

    logger = logging.getLogger("asyncload.monitor")
    logger.addHandler(Catch())
    logger.setLevel(logging.WARNING)
    return lines


def _count_store(m: Monitor, flags: Path | None = None, rank: int = 0, after: int = 0) -> Counting:
    """Put a :class:`Counting` store under ``m``'s client; with ``flags``, touch
    ``beats-{rank}`` there once this rank's status has been written more than ``after``
    times."""
    own, writes = f"st/{rank}", [0]

    def on_set(key: str) -> None:
        if flags is not None and key == own:
            writes[0] += 1
            if writes[0] > after:
                (flags / f"beats-{rank}").touch()

    counting = Counting(m.store._store, on_set)
    m.store._store = counting
    return counting


def w_barrier_with_a_late_rank(
    rank: int, world: int, flags_dir: str, beats: int
) -> dict[str, Any]:
    """Rank world-1 arrives at the barrier only once every other rank has beaten ``beats``
    times there and logged a late-rank line, and the watcher has seen them all arrive."""
    flags = Path(flags_dir)
    lines = _catch_lines(rank, flags)
    m = Monitor(None, 60.0, 0.2)
    late = world - 1
    counting = _count_store(m, flags, rank, beats)  # the barrier's status, then its beats
    m.start_reporting(lambda: None)  # a progress record, as under asyncload.load
    if rank == late:
        m.status("reading data: held by the test")
        m.count_bytes(1000, 4000)
        m.publish(force=True)
        others = range(late)
        _wait_for([flags / f"beats-{r}" for r in others] + [flags / f"logged-{r}" for r in others])
        # and until the watcher has seen every other rank arrive (its digest names this one)
        end = time.monotonic() + CUT_OFF
        while time.monotonic() < end:
            if m.store.check(["late/b"]) and json.loads(m.store.get("late/b"))["n"] == 1:
                break
            time.sleep(0.01)
        start = len(counting.ops)
        m.barrier("b", "arriving late")
        return {"ops": counting.ops[start:], "lines": lines, "watcher": -1}
    counting.ops.clear()
    counting.checked.clear()
    m.barrier("b", "waiting at the test's barrier")
    ops, checked = list(counting.ops), list(counting.checked)
    watcher = int(m.store.get("wa/b"))
    return {"ops": ops, "checked": checked, "lines": lines, "watcher": watcher}


def test_waiting_ranks_poll_one_key_and_only_the_watcher_reads_the_late_rank(
    tmp_path: Path,
) -> None:
    world, beats = 4, 3
    late = world - 1
    results = run_ranks(w_barrier_with_a_late_rank, world, str(tmp_path), beats, timeout=90)
    assert all_ok(results), [(r.rank, r.status, r.message, r.traceback) for r in results]
    watchers = {r.value["watcher"] for r in results[:late]}
    assert len(watchers) == 1, watchers
    (watcher,) = watchers
    assert watcher in range(late)
    for res in results[:late]:
        r, ops = res.rank, res.value["ops"]
        # every waiting rank logged the late rank, its status and its bytes
        named = [x for x in res.value["lines"] if f"for rank {late} while " in x]
        assert named, (r, res.value["lines"])
        line = named[0]
        assert line.startswith(f"rank {r} has waited ")
        assert "while waiting at the test's barrier (LoadOptions.late_rank_log_after=0.2)" in line
        assert f"rank {late}: 1000 B of 3.91 KiB done" in line, line
        assert "reading data: held by the test" in line
        beat_writes = sum(1 for op in ops if op == ("set", (f"st/{r}",)))
        assert beat_writes >= beats + 1  # the barrier's status, then at least `beats` beats
        if r != watcher:  # its first status write is the barrier's, not a beat
            _non_watcher_bound(r, watcher, "b", ops, len(res.value["lines"]), statuses=1)
        else:
            _watched_only_the_missing(r, late, ops, res.value["checked"])
    # the late rank arrived last: it counted the barrier done at once
    last = results[late].value["ops"]
    assert [name for name, _ in last].count("check") <= 1, last


def _watched_only_the_missing(
    me: int,
    late: int,
    ops: list[tuple[str, tuple[str, ...]]],
    checked: list[tuple[tuple[str, ...], bool]],
) -> None:
    """The watcher never checks an arrival it has seen, never reads the status or record
    of a rank it has seen arrive, and reads the late rank's."""
    answers = iter(checked)
    seen: set[int] = set()
    read: set[str] = set()
    for name, keys in ops:
        ranks = {int(k.rsplit("/", 1)[1]) for k in keys if k.startswith(("at/b/", "st/", "pg/"))}
        if name == "check":
            got_keys, got = next(answers)
            assert got_keys == keys
            arrivals = {int(k.rsplit("/", 1)[1]) for k in keys if k.startswith("at/b/")}
            assert not arrivals & seen, (keys, seen)
            if got:
                seen |= arrivals
        others = {k for k in keys if k.startswith(("st/", "pg/")) and k != f"st/{me}"}
        if others and name in ("get", "multi_get", "check"):
            assert not (ranks - {me}) & seen, (name, keys, seen)
            read |= others
    assert {f"st/{late}", f"pg/{late}"} <= read, read
    assert seen == set(range(late)) - {me}, seen


def w_stall_with_a_dead_watcher(rank: int, world: int, flags_dir: str) -> None:
    """Rank 1 arrives first (it watches), then dies once ranks 0 and 3 have arrived;
    rank 2 never arrives (stalled). Ranks 0 and 3 must take over and give up on rank 2."""
    flags = Path(flags_dir)
    m = Monitor(None, 3.0, None)
    if rank == 2:
        m.status("reading data: stalled by the test")
        time.sleep(3600)
    if rank == 1:

        def die_when_the_others_arrived() -> None:
            end = time.monotonic() + CUT_OFF
            while time.monotonic() < end:
                if m.store.check(["n/b"]) and m.store.add("n/b", 0) >= 3:
                    os._exit(5)
                time.sleep(0.01)

        def flag_when_watching() -> None:
            end = time.monotonic() + CUT_OFF
            while time.monotonic() < end and not m.store.check(["wa/b"]):
                time.sleep(0.01)
            (flags / "watching").touch()
            die_when_the_others_arrived()

        threading.Thread(target=flag_when_watching, daemon=True).start()
    else:
        _wait_for([flags / "watching"])
    m.barrier("b", "waiting for rank 2")


def test_a_stalled_rank_is_given_up_on_after_the_watcher_died(tmp_path: Path) -> None:
    results = run_ranks(w_stall_with_a_dead_watcher, 4, str(tmp_path), timeout=60, may_hang={1, 2})
    assert results[1].status == "timed_out" and results[1].exitcode == 5, results[1]
    for r in (results[0], results[3]):
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.status,
            r.message,
            r.traceback,
        )
        assert r.attrs["rank"] == 2, r.message
        assert r.message.startswith("rank 2 made no progress for "), r.message
        assert "collective_timeout=3.0" in r.message
        assert "its last status: reading data: stalled by the test" in r.message


def w_failure_while_others_wait(rank: int, world: int) -> None:
    m = Monitor(None, 60.0, None)
    if rank == 2:
        m.fail(RuntimeError("injected failure"), "reading data")
        raise RuntimeError("injected failure")
    m.barrier("b", "waiting for rank 2")


def test_a_failure_reaches_every_waiting_rank() -> None:
    results = run_ranks(w_failure_while_others_wait, 4, timeout=30)
    assert results[2].status == "error" and results[2].error_type == "RuntimeError"
    for r in (results[0], results[1], results[3]):
        assert r.status == "error" and r.error_type == "DistributedLoadError", r
        assert r.attrs["rank"] == 2
        assert r.message == "rank 2 failed while reading data: RuntimeError: injected failure"


# --- the pieces, on a real TCPStore ----------------------------------------------------------------


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )
    yield dist.PrefixStore("t/", server)


@pytest.mark.parametrize("missing", [(), (700,), (3, 64, 1000)])
def test_present_finds_the_missing_keys_in_few_operations(
    store: Any, missing: tuple[int, ...]
) -> None:
    n = 1024
    keys = [f"k/{i}" for i in range(n)]
    for i in range(n):
        if i not in missing:
            store.set(keys[i], str(i))
    counting = Counting(store)
    found = present(counting, keys)
    assert [i for i, f in enumerate(found) if not f] == list(missing)
    # a check per chunk, and two per halving down to each missing key
    halvings = (CHUNK - 1).bit_length()
    assert len(counting.ops) <= n // CHUNK + 2 * halvings * len(missing)
    counting.ops.clear()
    values = read_present(counting, keys)
    assert values == [b"" if i in missing else str(i).encode() for i in range(n)]
    if not missing:
        assert [name for name, _ in counting.ops] == ["check", "multi_get"]


def test_the_digest_line_is_the_records_line() -> None:
    stuck = InFlightRequest("https://h/b/__1_0.distcp?X-Amz-Signature=abc", (0, 64), 1, 12.04)
    records = [
        RankProgress(r, 100 * r, 1000, 10.0 * r, (stuck,) if r == 5 else (), f"reading {r}", 0.5)
        for r in range(3, 15)
    ]
    args = (0, 30.0, "waiting for the other ranks to finish reading", 5.0)
    expected = late_message(*args, records)
    assert digest_message(*args, digest(records)) == expected
    assert "12 ranks (3, 4, 5, 6, 7, 8, 9, 10, ...)" in expected and "(and 9 more)" in expected
    one = records[:1]
    assert digest_message(*args, digest(one)) == late_message(*args, one)


# --- waiting on a collective that runs on a thread (the gloo side group's creation) --------------


def _non_watcher_bound(
    r: int,
    watcher: int,
    name: str,
    ops: list[tuple[str, tuple[str, ...]]],
    lines: int,
    statuses: int = 0,
) -> None:
    """A rank that waits and does not watch: one key per operation, no other rank's keys but
    the watcher's status, and a few operations per poll and beat (a poll is one operation; a
    beat two, its status and the watcher's; a late line two, the digest's check and get; its
    record, arriving and leaving a few). ``statuses``: its status writes that are not beats."""
    allowed = {
        "ev",
        "abort",
        f"n/{name}",
        f"wa/{name}",
        f"late/{name}",
        f"at/{name}/{r}",
        f"st/{r}",
        f"pg/{r}",
        f"st/{watcher}",
    }
    assert all(len(keys) == 1 for _, keys in ops), ops
    assert {k for _, keys in ops for k in keys} <= allowed, ops
    polls = sum(1 for op in ops if op == ("add", ("ev",)))
    beat_writes = sum(1 for op in ops if op == ("set", (f"st/{r}",)))
    records = sum(1 for op in ops if op == ("set", (f"pg/{r}",)))
    bound = polls + 2 * (beat_writes - statuses) + 2 * lines + records + 10
    assert len(ops) <= bound, (r, len(ops), polls, beat_writes, lines, Counter(ops))


def _done_when(files: list[Path]) -> Any:
    """A future (of the running loop) that a thread completes once ``files`` exist."""
    import asyncio

    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        _wait_for(files)
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result("made"))

    threading.Thread(target=run, daemon=True).start()
    return fut


def w_together_with_a_late_rank(
    rank: int, world: int, flags_dir: str, beats: int
) -> dict[str, Any]:
    """Every rank waits on its part of a collective (a future a thread completes); rank
    world-1's part is done only once every other rank has beaten ``beats`` times and logged a
    late-rank line, and the watcher's digest names it alone. Rank world-1 enters the wait
    once the watcher is elected (so it waits as a non-watcher before its part is done)."""
    import asyncio

    flags = Path(flags_dir)
    lines = _catch_lines(rank, flags)
    m = Monitor(None, 60.0, 0.2)
    late = world - 1
    counting = _count_store(m, flags, rank, beats)
    m.start_reporting(lambda: None)
    others = range(late)

    async def part() -> Any:
        loop = asyncio.get_running_loop()
        if rank != late:
            fut = loop.create_future()
            fut.set_result("made")
            return await m.await_together(fut, "b", "waiting at the test's collective")
        fut = _done_when(
            [flags / f"beats-{r}" for r in others]
            + [flags / f"logged-{r}" for r in others]
            + [flags / "digest"]
        )
        return await m.await_together(fut, "b", "making its part: held by the test")

    def digest_names_the_late_rank() -> None:  # the test's reads, not counted
        inner = counting.inner
        end = time.monotonic() + CUT_OFF
        while time.monotonic() < end:
            if inner.check(["late/b"]) and json.loads(inner.get("late/b"))["n"] == 1:
                (flags / "digest").touch()
                return
            time.sleep(0.05)

    if rank == late:
        m.status("making its part: held by the test")
        m.count_bytes(1000, 4000)
        m.publish(force=True)
        end = time.monotonic() + CUT_OFF
        while not m.store.check(["wa/b"]) and time.monotonic() < end:
            time.sleep(0.01)
        threading.Thread(target=digest_names_the_late_rank, daemon=True).start()
    counting.ops.clear()
    counting.checked.clear()
    got = asyncio.run(part())
    ops, checked = list(counting.ops), list(counting.checked)
    return {
        "got": got,
        "ops": ops,
        "checked": checked,
        "lines": lines,
        "watcher": int(m.store.get("wa/b")),
    }


def test_ranks_waiting_on_a_collective_read_o1_keys_and_only_the_watcher_reads_the_late_rank(
    tmp_path: Path,
) -> None:
    """The wait of the gloo side group's creation (``Monitor.await_together``): a rank that
    does not watch reads one key per operation, its own and the watcher's status only, also
    while its own part is not done (the late rank); the watcher reads only the late rank's
    keys once it has seen the others' parts done; every rank logs the late rank."""
    world, beats = 4, 3
    late = world - 1
    results = run_ranks(w_together_with_a_late_rank, world, str(tmp_path), beats, timeout=90)
    assert all_ok(results), [(r.rank, r.status, r.message, r.traceback) for r in results]
    assert all(r.value["got"] == "made" for r in results)
    watchers = {r.value["watcher"] for r in results}
    assert len(watchers) == 1, watchers
    (watcher,) = watchers
    assert watcher in range(late)
    for res in results:
        r, ops = res.rank, res.value["ops"]
        if r != late:
            named = [x for x in res.value["lines"] if f"for rank {late} while " in x]
            assert named, (r, res.value["lines"])
            assert f"rank {late}: 1000 B of 3.91 KiB done" in named[0], named[0]
            assert "making its part: held by the test" in named[0]
            beat_writes = sum(1 for op in ops if op == ("set", (f"st/{r}",)))
            assert beat_writes >= beats  # it waited: not a test that cannot fail
        if r != watcher:
            _non_watcher_bound(r, watcher, "b", ops, len(res.value["lines"]))
        else:
            _watched_only_the_missing(r, late, ops, res.value["checked"])


def w_together_with_a_stalled_rank(rank: int, world: int, flags_dir: str, stalled: int) -> None:
    """``stalled`` never does its part and never beats (when it is rank 1 it enters first,
    so it is the watcher, and stops there); the others' parts are done at once."""
    import asyncio

    from asyncload.distributed.barrier import BarrierWait

    flags = Path(flags_dir)
    m = Monitor(None, 3.0, None)
    if rank == stalled:
        m.status("making its part: stalled by the test")
        if rank == 1:
            BarrierWait(m, "b", "making its part").enter()
            (flags / "watching").touch()
        time.sleep(3600)
    if stalled == 1:
        _wait_for([flags / "watching"])

    async def part() -> Any:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return await m.await_together(fut, "b", "waiting for the others' parts")

    asyncio.run(part())


@pytest.mark.parametrize("stalled", [2, 1], ids=["a-waiter", "the-watcher"])
def test_a_stalled_rank_is_given_up_on_while_the_ranks_wait_on_a_collective(
    tmp_path: Path, stalled: int
) -> None:
    results = run_ranks(
        w_together_with_a_stalled_rank,
        4,
        str(tmp_path),
        stalled,
        timeout=60,
        may_hang={stalled},
    )
    assert results[stalled].status == "timed_out", results[stalled]
    for r in results:
        if r.rank == stalled:
            continue
        assert r.status == "error" and r.error_type == "DistributedLoadError", (
            r.status,
            r.message,
            r.traceback,
        )
        assert r.attrs["rank"] == stalled, r.message
        assert r.message.startswith(f"rank {stalled} made no progress for "), r.message
        assert "collective_timeout=3.0" in r.message
        assert "its last status: making its part: stalled by the test" in r.message


def w_together_with_a_failure(rank: int, world: int) -> None:
    """Rank 2's part fails (it posts the failure, as a load's session does); rank 0's part
    is done (it waits for the others), ranks 1 and 3's never end."""
    import asyncio

    m = Monitor(None, 60.0, None)

    async def part() -> Any:
        fut = asyncio.get_running_loop().create_future()
        if rank == 2:
            fut.set_exception(RuntimeError("injected failure"))
        elif rank == 0:
            fut.set_result(None)
        try:
            return await m.await_together(fut, "b", "waiting for the others' parts")
        except RuntimeError as exc:
            if rank == 2:
                m.fail(exc, "making its part")
            raise

    asyncio.run(part())


def test_a_failure_reaches_every_rank_waiting_on_a_collective() -> None:
    results = run_ranks(w_together_with_a_failure, 4, timeout=30)
    assert results[2].status == "error" and results[2].error_type == "RuntimeError"
    for r in (results[0], results[1], results[3]):
        assert r.status == "error" and r.error_type == "DistributedLoadError", r
        assert r.attrs["rank"] == 2
        assert r.message == "rank 2 failed while making its part: RuntimeError: injected failure"


def w_make_side_group(rank: int, world: int, flags_dir: str, beats: int) -> dict[str, Any]:
    """The side group's creation, with a counting store under the monitor: rank world-1's
    part of ``dist.new_group`` ends only once every other rank has beaten ``beats`` times
    waiting for it; the group made carries an all_reduce."""
    import asyncio

    import torch

    from asyncload.distributed.side_group import make_side_group

    flags = Path(flags_dir)
    late = world - 1
    m = Monitor(None, 60.0, None)
    # the barrier's and the creation's status, then its beats
    counting = _count_store(m, flags, rank, beats + 1)
    if rank == late:
        real = dist.new_group

        def held(*args: Any, **kw: Any) -> Any:
            # after the rendezvous: a rank waiting in it holds its store connection (shared
            # with its monitor), so the others wait on this rank's part with theirs done
            group = real(*args, **kw)
            _wait_for([flags / f"beats-{r}" for r in range(late)])
            return group

        dist.new_group = held  # type: ignore[assignment]
    side = asyncio.run(make_side_group(None, m, 0))
    ops = list(counting.ops)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=side)
    watcher = int(m.store.get("wa/side-group-made-0"))
    return {"sum": int(t), "ops": ops, "watcher": watcher, "backend": dist.get_backend(side)}


def test_the_side_groups_creation_waits_at_o1_keys_per_beat(tmp_path: Path) -> None:
    """``make_side_group`` (every rank at once, rank 3's part held until the others beat 3
    times waiting for it): the group carries an all_reduce, every rank returns once every
    rank has it, and a rank that does not watch read no other rank's keys but the watcher's
    status (before: every rank read every other rank's status at every beat)."""
    world, beats = 4, 3
    results = run_ranks(w_make_side_group, world, str(tmp_path), beats, timeout=90)
    assert all_ok(results), [(r.rank, r.status, r.message, r.traceback) for r in results]
    watchers = {r.value["watcher"] for r in results}
    assert len(watchers) == 1, watchers
    (watcher,) = watchers
    for res in results:
        assert res.value["sum"] == 10 and res.value["backend"] == "gloo"
        ops = res.value["ops"]
        if res.rank == watcher:
            continue
        # the barrier before the creation (side-group-0) and the creation's wait
        theirs = {
            k
            for _, keys in ops
            for k in keys
            if k.startswith(("st/", "pg/", "at/")) and not k.endswith(f"/{res.rank}")
        }
        assert theirs <= {f"st/{watcher}"}, theirs
        if res.rank != world - 1:
            waited = [op for op in ops if op == ("set", (f"st/{res.rank}",))]
            assert len(waited) >= beats + 2, len(waited)


# --- ranks whose load returned before the others' (wait_for_peers=False) -------------------------


def w_returned_early(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Ranks 0-2 return from their load at once (nothing left to send); rank 3 stalls
    (``stall``) or fails (``fail``) while still loading."""
    from asyncload.distributed.sends import BackgroundSends

    m = Monitor(None, 3.0, None)
    counting = _count_store(m)
    if rank == 3:
        m.status("reading data: stalled by the test")
        if mode == "fail":
            time.sleep(1.5)  # the others wait at "done"
            m.fail(RuntimeError("injected failure"), "reading data")
            raise RuntimeError("injected failure")
        time.sleep(3600)
    sends = BackgroundSends(m, 1 << 20)
    m.returns_early = True
    m.after_return = sends.after_return
    m.finish("finishing its load")
    drained = sends.wait(CUT_OFF)
    err = sends.error
    return {
        "drained": drained,
        "error": type(err).__name__,
        "rank": getattr(err, "rank", None),
        "message": str(err),
        "ops": list(counting.ops),
        "watcher": int(m.store.get("wa/done")),
    }


@pytest.mark.parametrize("mode", ["stall", "fail"])
def test_ranks_that_returned_wait_for_the_others_at_o1_keys(mode: str) -> None:
    """Ranks that returned before the others (their sends landed) wait at "done" as at a
    barrier: one that does not watch reads no other rank's keys but the watcher's status
    (before: every one checked every rank's "done" key and read the statuses of those still
    loading, every beat); the watcher gives up on the stalled rank, and a failure posted by
    the rank still loading reaches every one of them."""
    results = run_ranks(w_returned_early, 4, mode, timeout=60, may_hang={3})
    if mode == "fail":
        assert results[3].status == "error" and results[3].error_type == "RuntimeError"
    watchers = {r.value["watcher"] for r in results[:3]}
    assert len(watchers) == 1, watchers
    (watcher,) = watchers
    for res in results[:3]:
        assert res.ok, (res.rank, res.status, res.message, res.traceback)
        v = res.value
        assert v["drained"] and v["error"] == "DistributedLoadError", v["message"]
        assert v["rank"] == 3, v["message"]
        if mode == "stall":
            assert v["message"].startswith("rank 3 made no progress for "), v["message"]
            assert "its last status: reading data: stalled by the test" in v["message"]
        else:
            assert v["message"] == (
                "rank 3 failed while reading data: RuntimeError: injected failure"
            )
        if res.rank != watcher:
            _non_watcher_bound(res.rank, watcher, "done", v["ops"], 0)
