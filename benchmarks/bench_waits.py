"""Waits at scale: the store traffic of a multi-rank load's waits against the number of ranks
(issue 29, "claims at scale": rank 0's store is the bottleneck at thousands of ranks).

Every wait of a multi-rank load goes through the monitor (``asyncload/distributed/monitor.py``)
and rank 0's ``TCPStore``. This benchmark runs the monitor's own code, ``before`` (the
monitor of commit ``a507923``, read with ``git show``) and ``after`` (this checkout's), for
simulated ranks: each simulated rank is a real ``Monitor`` over a ``TCPStore`` client
connection, as on a rank (its process group is replaced by a stand-in that only gives the
rank, the group size and the store). The store server runs in this process, as on rank 0.

Scenarios, for each group size W (``--ranks``):

* ``barrier``: ranks 0 .. W-2 arrive at a barrier, rank W-1 is late. Simulated waiting ranks
  (all W-1 up to ``--full`` ranks, else a sample of ``--sample`` (the ``after`` watcher, the
  first to arrive, among them)) poll as ``Monitor.barrier`` does, for ``--window`` seconds,
  in ``--clients`` processes (each with its own connection), with
  ``late_rank_log_after=1`` (the late check fires every second on every waiting rank) and a
  ``collective_timeout`` long enough that nobody is given up on. Counted: store operations
  per waiting rank per second (one beat). Then the operations recorded are replayed against
  the store from ``--clients`` processes, scaled to the whole group ("store load": the store's
  seconds of work per second of waiting; above 1 it falls behind, and every claim, status
  write and barrier arrival queues behind the backlog). Replays are capped at ``--max-ops``
  operations and ``--max-keys`` keys and projected at their measured rate ("~"). Then rank W-1
  arrives: "done after" is the time until the last waiting rank returns, measured when every
  waiting rank is simulated, else projected: a poll interval plus the group's completion
  reads (replayed) at the store's spare capacity (``inf`` when the load is >= 1).
* ``late``: the late-rank check firing on every waiting rank at once, with 1 and with W/8
  ranks late: ``before``, each waiting rank reads the late ranks' status and records;
  ``after``, the barrier's watcher reads them and posts a digest, and each waiting rank reads
  the digest. Operations, keys, and the store seconds of the burst (replayed).
* ``rank_progress``: ``LoadHandle.rank_progress()`` called on one rank, and on every rank at
  once: operations, keys, store seconds (replayed).
* ``returned``: ranks whose load returned before the others' (``wait_for_peers=False``,
  every send landed: :mod:`asyncload.distributed.sends`) waiting for rank W-1, still
  loading: ``before``, the drain of ``sends.py`` before the ``sidewait`` branch (each poll
  ``abort`` and the count of ``done``; each beat a check of every rank's ``done`` key and the
  statuses of those missing); ``after``, a wait at "done" as at a barrier. As ``side``.
* ``side``: the wait of the gloo side group's creation (``make_side_group``), every rank's
  part still running (``dist.new_group`` on its thread: the whole group waits at once). Both
  schemes run this checkout's monitor: ``before``, the wait of ``side_group.py`` before the
  ``sidewait`` branch (``Monitor.wait_on`` with every other rank: each beat, a heartbeat and
  every other rank's status, and the late check reading every other rank's record);
  ``after``, ``Monitor.await_together`` (a barrier waited at before arriving: one watcher
  reads the ranks' status and records, every other rank polls one key). Simulated ranks as in
  ``barrier`` (a sample above ``--full``); store operations per rank per second over
  ``--window`` seconds, and the group's traffic replayed and scaled ("store load").

* ``sends``: every rank waits in ``Monitor.wait_on`` for its send of one unit to every other
  rank (static sharing of a replicated checkpoint), a beat a second: ``before`` without rank
  0's digest of the idle ranks (each waiting rank reads every other rank's status a beat, and
  on its late check every other rank's record), ``after`` with it
  (:mod:`asyncload.distributed.idle_watch`: rank 0 reads every status once a beat and posts
  the idle ranks; the others read that key; a late check reads at most 64 records). Both
  run this checkout's monitor. As ``side``.

Run:  python benchmarks/bench_waits.py                          # ~5 min on 2 cores
      python benchmarks/bench_waits.py --ranks 64,256 --schemes after
      python benchmarks/bench_waits.py --ranks 1024,8192 --parts side,returned
      python benchmarks/bench_waits.py --ranks 64,256,1024,8192 --parts sends
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import torch.distributed as dist

BEFORE_COMMIT = "a507923"
DOING = "waiting for the other ranks to finish reading"
SIDE_DOING = "making the gloo side group for adaptive sharing"
SENDS_DOING = "sending a unit to every other rank"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# --- the monitor of a scheme, for simulated ranks ------------------------------------------------


def before_source() -> str:
    path = os.path.join(tempfile.gettempdir(), f"asyncload_monitor_{BEFORE_COMMIT}.py")
    if not os.path.exists(path):
        src = subprocess.check_output(
            ["git", "-C", REPO, "show", f"{BEFORE_COMMIT}:asyncload/distributed/monitor.py"]
        )
        with open(path, "wb") as f:
            f.write(src)
    return path


def scheme_module(scheme: str, before_path: str) -> Any:
    if scheme == "after":
        import asyncload.distributed.monitor as mod

        return mod
    spec = importlib.util.spec_from_file_location("asyncload_monitor_before", before_path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Group:
    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world


class _Dist:
    """What ``Monitor.__init__`` asks of torch.distributed, for a simulated rank."""

    PrefixStore = dist.PrefixStore

    @staticmethod
    def get_rank(g: _Group) -> int:
        return g.rank

    @staticmethod
    def get_world_size(g: _Group) -> int:
        return g.world


class Tally:
    """A store that counts the operations and keys passed to it, and records them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops = 0
        self.keys = 0
        self.trace: list[tuple[Any, ...]] = []
        self.recording = False

    def reset(self, recording: bool = True) -> None:
        self.ops = self.keys = 0
        self.trace = []
        self.recording = recording

    def _note(self, op: tuple[Any, ...], keys: int) -> None:
        self.ops += 1
        self.keys += keys
        if self.recording:
            self.trace.append(op)

    def set(self, key: str, value: Any) -> None:
        self._note(("set", key, value), 1)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._note(("get", key), 1)
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        self._note(("check", list(keys)), len(keys))
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._note(("multi_get", list(keys)), len(keys))
        return self.inner.multi_get(keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._note(("compare_set", key, expected, desired), 1)
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self._note(("add", key, amount), 1)
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        self._note(("delete_key", key), 1)
        return self.inner.delete_key(key)


def make_monitor(
    mod: Any, store: Any, seq: int, rank: int, world: int, late_after: float | None = 1.0
) -> tuple[Any, Tally]:
    mod.dist = _Dist
    mod._group_store = lambda g: g.store
    mod._next_seq = lambda g: ("bench", seq)
    m = mod.Monitor(_Group(store, rank, world), 3600.0, late_after)
    m._to_delete = None
    mod._previous.clear()
    tally = Tally(m.store._store)
    m.store._store = tally
    return m, tally


def record(done: int, total: int, path: str | None = None) -> str:
    from asyncload.distributed import encode
    from asyncload.storage import InFlightRequest

    flights = [InFlightRequest(path, (0, 4096), 1, 2.0)] if path else []
    return encode(done, total, 0.0 if path else 1e6, flights)


class Waiter:
    """One simulated rank waiting at a barrier, as ``Monitor.barrier`` does (arrive, then
    poll with a sleep doubling from 0.5 ms up to the scheme's longest)."""

    def __init__(self, scheme: str, m: Any, name: str) -> None:
        self.scheme, self.m, self.name = scheme, m, name
        self.delay = 0.0005
        self.max_delay = 0.05
        self.wait: Any = None
        self.keys: list[str] = []
        self.state: dict[str, float] = {}

    def arrive(self) -> None:
        self.m.status(DOING)
        if self.scheme == "after":
            from asyncload.distributed import BarrierWait

            self.wait = BarrierWait(self.m, self.name, DOING)
            self.wait.arrive()
            self.max_delay = self.wait.max_delay
            self.delay = self.wait.first_delay
        else:
            self.keys = self.m._arrive(self.name)
            self.state = {"stall": time.monotonic()}

    def poll(self) -> bool:
        if self.scheme == "after":
            return bool(self.wait.poll())
        return bool(self.m._poll(self.name, self.keys, DOING, self.state))

    def watching(self) -> bool:
        return self.scheme == "after" and self.wait._watcher == self.m.rank


def arrive_plain(scheme: str, m: Any, name: str) -> None:
    m.status(DOING)
    if scheme == "after":
        from asyncload.distributed import arrive

        arrive(m, name)
    else:
        m._arrive(name)


# --- client processes ----------------------------------------------------------------------------


def _client(port: int, jobs: Any, out: Any, before_path: str, start: Any, go: Any) -> None:
    logging.getLogger("asyncload").setLevel(logging.ERROR)  # the late lines are counted, not shown
    base = dist.TCPStore("127.0.0.1", port, is_master=False)
    while True:
        job = jobs.get()
        if job is None:
            return
        kind = job[0]
        if kind == "replay":
            _, prefix, ops = job
            store = dist.PrefixStore(prefix, base)
            out.put("ready")
            start.wait()
            t0 = time.perf_counter()
            for op in ops:
                getattr(store, op[0])(*op[1:])
            out.put(time.perf_counter() - t0)
        elif kind == "barrier":
            _, scheme, seq, world, ranks, window = job
            mod = scheme_module(scheme, before_path)
            waiters = []
            tallies = []
            for r in ranks:
                m, t = make_monitor(mod, base, seq, r, world)
                waiters.append(Waiter(scheme, m, "b"))
                tallies.append(t)
            for w in waiters:  # the first to arrive watches (after)
                w.arrive()
            out.put("arrived")
            go.wait()
            for t in tallies:
                t.reset()
            t0 = time.monotonic()
            due = [t0] * len(waiters)
            done = [False] * len(waiters)
            reported = False
            last = 0.0
            while not all(done):
                now = time.monotonic()
                if not reported and now - t0 >= window:
                    reported = True
                    out.put(
                        (
                            "window",
                            [
                                (w.watching(), t.ops, t.keys, t.trace)
                                for w, t in zip(waiters, tallies)
                            ],
                        )
                    )
                    for t in tallies:
                        t.reset()  # the completion's operations from here
                i = min((j for j in range(len(waiters)) if not done[j]), key=lambda j: due[j])
                if due[i] > now:
                    time.sleep(min(due[i] - now, 0.01) if not reported else due[i] - now)
                    continue
                w = waiters[i]
                if w.poll():
                    done[i] = True
                    last = time.time()
                else:
                    due[i] = time.monotonic() + w.delay  # as Monitor.barrier sleeps
                    w.delay = min(w.max_delay, w.delay * 2)
            out.put(("done", last, [t.trace for t in tallies]))
        elif kind in _WAITS:
            _, scheme, seq, world, ranks, window = job
            wait = _WAITS[kind]
            out.put(("window", wait(scheme, base, seq, world, ranks, window, go, out)))


_Result = list[tuple[bool, int, int, list[tuple[Any, ...]]]]
#: ``before(mons, mod, t0)``: the old scheme's step, ``step(i, now)`` -> when rank i acts next.
_Before = Callable[[list[Any], Any, float], Callable[[int, float], float]]


def _simulate(
    scheme: str,
    base: Any,
    seq: int,
    world: int,
    ranks: list[int],
    window: float,
    go: Any,
    out: Any,
    *,
    doing: str,
    join: Callable[[Any], Any],
    before: _Before,
    reporting: bool = False,
    after: _Before | None = None,
) -> _Result:
    """Simulated ranks ``ranks`` waiting for ``window`` seconds, each at its own schedule:
    ``after``, a :class:`BarrierWait` each (``join(monitor)`` makes it: entered or arrived
    before), polled with its back-off, or the ``after`` step when given (then rank 0 counts
    as the watcher); ``before``, the old scheme's step. Per rank: whether it watches, its
    store operations, keys read and trace."""
    mod = scheme_module("after", "")
    mons, tallies = [], []
    for r in ranks:
        m, t = make_monitor(mod, base, seq, r, world)
        if reporting:
            m._reporting = object()  # it keeps a progress record (a load under asyncload.load)
        m.status(doing)
        mons.append(m)
        tallies.append(t)
    chosen = before if scheme != "after" else after  # None: barrier waits
    waits = [join(m) for m in mons] if chosen is None else []  # the first to join watches
    out.put("arrived")
    go.wait()
    for t in tallies:
        t.reset()
    t0 = time.monotonic()
    delays = [w.first_delay for w in waits]
    due = [t0] * len(mons)
    step = chosen(mons, mod, t0) if chosen is not None else None
    while True:
        now = time.monotonic()
        if now - t0 >= window:
            break
        i = min(range(len(mons)), key=lambda j: due[j])
        if due[i] > now:
            time.sleep(min(due[i] - now, t0 + window - now))
            continue
        if step is None:
            waits[i].poll()
            due[i] = time.monotonic() + delays[i]
            delays[i] = min(waits[i].max_delay, delays[i] * 2)
        else:
            due[i] = step(i, now)
    watching = [w._watcher == w.host.rank for w in waits] or [
        chosen is after and m.rank == 0 for m in mons
    ]
    return [(w, t.ops, t.keys, t.trace) for w, t in zip(watching, tallies)]


def _returned_wait(
    scheme: str,
    base: Any,
    seq: int,
    world: int,
    ranks: list[int],
    window: float,
    go: Any,
    out: Any,
) -> _Result:
    """Simulated ranks whose load returned (``wait_for_peers=False``, every send landed),
    waiting for rank W-1 to finish, for ``window`` seconds: ``before``, as the drain of
    ``sends.py`` did before the ``sidewait`` branch (each poll: ``abort`` and the count of
    ``done``; each beat: which ranks have not finished (a check of every ``done`` key, halved
    where one is missing), then their statuses); ``after``, as it does now
    (``BarrierWait.arrived_before``, then polls)."""
    from asyncload.distributed import BarrierWait, present

    def join(m: Any) -> Any:
        w = BarrierWait(m, "done", "waiting, its load returned, for the others")
        w.arrived_before()
        return w

    def before(mons: list[Any], mod: Any, t0: float) -> Callable[[int, float], float]:
        delays = [0.005] * len(mons)
        checked = [t0 - 1.0] * len(mons)  # the steady state: a beat is due
        keys = [f"at/done/{r}" for r in range(world)]

        def step(i: int, now: float) -> float:  # the body of the drain's loop before
            m = mons[i]
            m.store.add("n/done", 0)
            m.store.check(["abort"])
            if now - checked[i] >= 1.0:
                checked[i] = now
                waiting = [r for r, f in enumerate(present(m.store, keys)) if not f]
                m.idle_peer(waiting)
            due = time.monotonic() + delays[i]
            delays[i] = min(0.05, delays[i] * 2)
            return due

        return step

    return _simulate(
        scheme,
        base,
        seq,
        world,
        ranks,
        window,
        go,
        out,
        doing="finished its load",
        join=join,
        before=before,
    )


def _side_wait(
    scheme: str,
    base: Any,
    seq: int,
    world: int,
    ranks: list[int],
    window: float,
    go: Any,
    out: Any,
) -> _Result:
    """Simulated ranks waiting on their part of the side group's creation for ``window``
    seconds (no part ends): ``before``, as ``Monitor.wait_on(fut, others)`` does (a beat a
    second: heartbeat, then every other rank's status; the late check); ``after``, as
    ``Monitor.await_together`` does (``BarrierWait.enter``, then polls)."""
    from asyncload.distributed import BarrierWait

    def join(m: Any) -> Any:
        w = BarrierWait(m, "s", SIDE_DOING)
        w.enter()
        return w

    def before(mons: list[Any], mod: Any, t0: float) -> Callable[[int, float], float]:
        others = [[p for p in range(world) if p != m.rank] for m in mons]
        due = [t0] * len(mons)  # the steady state: the wait has lasted a beat already

        def step(i: int, now: float) -> float:  # the body of Monitor.wait_on's loop, a beat
            mons[i].beat()
            mons[i].idle_peer(others[i])
            due[i] += mod._BEAT_INTERVAL
            return due[i]

        return step

    return _simulate(
        scheme,
        base,
        seq,
        world,
        ranks,
        window,
        go,
        out,
        doing=SIDE_DOING,
        join=join,
        before=before,
        reporting=True,
    )


def _sends_wait(
    scheme: str,
    base: Any,
    seq: int,
    world: int,
    ranks: list[int],
    window: float,
    go: Any,
    out: Any,
) -> _Result:
    """Simulated ranks each waiting in ``Monitor.wait_on`` for a send of one unit to every
    other rank (static sharing of a replicated checkpoint), for ``window`` seconds, a beat a
    second: a heartbeat, then ``idle_peer(every other rank)`` (and its late check).
    ``before``: no digest (the code path before the idle watch, and where rank 0 posts
    none): every other rank's status, and on the late check every other rank's record;
    ``after``: rank 0 posts the idle ranks once a beat (its poster's reads and write are in
    rank 0's trace) and each waiting rank reads that one key."""
    from asyncload.distributed import IdlePoster, listed_after

    def steps(use_digest: bool) -> _Before:
        def make(mons: list[Any], mod: Any, t0: float) -> Callable[[int, float], float]:
            others = [[p for p in range(world) if p != m.rank] for m in mons]
            due = [t0] * len(mons)
            posters: dict[int, Any] = {}
            posted = [t0 - 3600.0]
            for i, m in enumerate(mons):
                if not use_digest:
                    m._idle_view.read = lambda store, now: None
                elif m.rank == 0:
                    posters[i] = IdlePoster(m.store, world, listed_after(world, m.timeout))

            def step(i: int, now: float) -> float:  # the body of Monitor.wait_on's loop
                poster = posters.get(i)
                if poster is not None and now - posted[0] >= poster.interval:
                    posted[0] = now
                    poster.post(now)
                mons[i].beat()
                mons[i].idle_peer(others[i])
                due[i] += mod._BEAT_INTERVAL
                return due[i]

            return step

        return make

    return _simulate(
        scheme,
        base,
        seq,
        world,
        ranks,
        window,
        go,
        out,
        doing=SENDS_DOING,
        join=lambda m: None,
        before=steps(False),
        reporting=True,
        after=steps(True),
    )


#: The waits a client simulates by name (``side_scenario``'s kinds).
_WAITS: dict[str, Callable[..., _Result]] = {
    "side": _side_wait,
    "returned": _returned_wait,
    "sends": _sends_wait,
}


class Clients:
    """``n`` client processes, each with its own connection to the store."""

    def __init__(self, port: int, n: int, before_path: str) -> None:
        ctx = mp.get_context("spawn")
        self.ctx = ctx
        self.out = ctx.Queue()
        self.start, self.go = ctx.Event(), ctx.Event()  # shared at start-up (not picklable)
        self.jobs = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=_client,
                args=(port, q, self.out, before_path, self.start, self.go),
                daemon=True,
            )
            for q in self.jobs
        ]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(30)

    def replay(self, prefix: str, ops: list[tuple[Any, ...]]) -> float:
        """Wall seconds for the clients to issue ``ops`` (dealt round-robin), together."""
        self.start.clear()
        n = len(self.jobs)
        for k, q in enumerate(self.jobs):
            q.put(("replay", prefix, ops[k::n]))
        for _ in self.jobs:
            assert self.out.get(timeout=300) == "ready"
        self.start.set()
        return max(self.out.get(timeout=600) for _ in self.jobs)


def scaled_replay(
    clients: Clients, prefix: str, parts: list[tuple[list[tuple[Any, ...]], float]], args: Any
) -> tuple[int, int, float, bool]:
    """``parts``: (trace, how many times the group issues it). Replays up to ``--max-ops``
    operations and ``--max-keys`` keys of the whole, interleaved, and projects. Returns the
    group's operations, keys, store seconds, and whether projected."""

    def nkeys(op: tuple[Any, ...]) -> int:
        return len(op[1]) if op[0] in ("check", "multi_get") else 1

    total_ops = round(sum(len(t) * k for t, k in parts))
    total_keys = round(sum(sum(map(nkeys, t)) * k for t, k in parts))
    if total_ops == 0:
        return 0, 0, 0.0, False
    share = min(1.0, args.max_ops / total_ops, args.max_keys / max(1, total_keys))
    run: list[tuple[Any, ...]] = []
    for t, k in parts:
        reps = k * share
        whole = int(reps)
        run.extend(itertools.chain.from_iterable([t] * whole))
        frac = reps - whole
        run.extend(t[: int(len(t) * frac)])
    if not run:
        run = list(parts[0][0])
    run_keys = sum(map(nkeys, run))
    wall = clients.replay(prefix, run)
    seconds = wall * (total_keys / run_keys if share < 1 else 1.0)
    return total_ops, total_keys, seconds, share < 1


# --- scenarios -----------------------------------------------------------------------------------


def barrier_scenario(
    scheme: str, world: int, seq: int, server: Any, clients: Clients, args: Any, mod: Any
) -> dict[str, Any]:
    late = world - 1
    full = world - 1 <= args.full
    sim = (
        list(range(world - 1))
        if full
        else sorted({0, *range(1, world - 1, max(1, (world - 2) // (args.sample - 1)))})[
            : args.sample
        ]
    )
    # every rank's status and progress record exist, as during a load; the late rank reads
    m_late, _ = make_monitor(mod, server, seq, late, world)
    m_late.status("reading data: 1.0 GiB of 2.0 GiB")
    m_late.store.set(f"pg/{late}", record(1 << 30, 2 << 30, "s3://bucket/ckpt/__7_0.distcp"))
    n = len(clients.jobs)
    go = clients.go
    go.clear()
    for k, q in enumerate(clients.jobs):
        q.put(("barrier", scheme, seq, world, sim[k::n], args.window))
    for _ in clients.jobs:
        assert clients.out.get(timeout=600) == "arrived"
    rest = [r for r in range(world - 1) if r not in set(sim)]
    for r in rest:  # the ranks not simulated arrive (and write their records), not polling
        m, _ = make_monitor(mod, server, seq, r, world)
        m.store.set(f"pg/{r}", record(2 << 30, 2 << 30))
        arrive_plain(scheme, m, "b")
    for r in sim:
        server.set(f"asyncload/{seq}/pg/{r}", record(2 << 30, 2 << 30))
    go.set()
    windows = [clients.out.get(timeout=900) for _ in clients.jobs]
    t_arrive = time.time()
    arrive_plain(scheme, m_late, "b")
    ends = [clients.out.get(timeout=900) for _ in clients.jobs]
    measured = max(e[1] for e in ends) - t_arrive
    rows = [row for w in windows for row in w[1]]
    watcher = [r for r in rows if r[0]]
    plain = [r for r in rows if not r[0]]
    per = sum(r[1] for r in plain) / len(plain) / args.window
    per_keys = sum(r[2] for r in plain) / len(plain) / args.window
    watch_ops = sum(r[1] for r in watcher) / args.window
    # the group's traffic for one window, replayed
    others = world - 1 - len(watcher)
    parts = [(r[3], others / len(plain)) for r in plain] + [(r[3], 1.0) for r in watcher]
    ops, keys, store_s, projected = scaled_replay(clients, f"asyncload/{seq}/", parts, args)
    load = store_s / args.window
    # the completion: every waiting rank's reads after the last arrival
    traces = [t for e in ends for t in e[2]]
    cparts = [(t, (world - 1) / len(traces)) for t in traces]
    _, _, done_s, _ = scaled_replay(clients, f"asyncload/{seq}/", cparts, args)
    max_poll = mod.poll_interval(world) if scheme == "after" else 0.05
    projected_done = max_poll + done_s / (1 - load) if load < 1 else float("inf")
    return {
        "per_rank_ops": per,
        "per_rank_keys": per_keys,
        "watcher_ops": watch_ops,
        "group_ops": ops / args.window,
        "group_keys": keys / args.window,
        "load": load,
        "projected": projected,
        "done": measured if full else projected_done,
        "done_measured": full,
        "simulated": len(sim),
    }


def side_scenario(
    scheme: str,
    world: int,
    seq: int,
    server: Any,
    clients: Clients,
    args: Any,
    kind: str = "side",
) -> dict[str, Any]:
    """``side``: every rank waits on its part of the side group's creation (none ends in the
    window). ``sends``: every rank waits on its send of a unit to every other rank.
    ``returned``: ranks 0 .. W-2 returned from their load (every send landed) and wait for
    rank W-1, still loading."""
    waiting = world - 1 if kind == "returned" else world
    sim = (
        list(range(waiting))
        if waiting <= args.full
        else sorted({0, *range(1, waiting, max(1, (waiting - 1) // (args.sample - 1)))})[
            : args.sample
        ]
    )
    keys = dist.PrefixStore(f"asyncload/{seq}/", server)  # the monitors' prefix
    for r in range(world):  # every rank's status and record exist, as during a load
        keys.set(f"st/{r}", f"1|{SIDE_DOING}")
        keys.set(f"pg/{r}", record(1 << 30, 2 << 30))
    if kind == "sends" and scheme == "after":  # rank 0 posted the digest as its watch began
        from asyncload.distributed import IDLE_KEY, encode_idle

        keys.set(IDLE_KEY, encode_idle(0, {}))
    if kind == "returned":  # ranks 0 .. W-2 arrived at "done" (and the first of them watches)
        for r in range(waiting):
            keys.set(f"at/done/{r}", "arrived")
        keys.add("n/done", waiting)
    n = len(clients.jobs)
    go = clients.go
    go.clear()
    for k, q in enumerate(clients.jobs):
        q.put((kind, scheme, seq, world, sim[k::n], args.window))
    for _ in clients.jobs:
        assert clients.out.get(timeout=600) == "arrived"
    go.set()
    windows = [clients.out.get(timeout=900) for _ in clients.jobs]
    rows = [row for w in windows for row in w[1]]
    watcher = [r for r in rows if r[0]]
    plain = [r for r in rows if not r[0]]
    per = sum(r[1] for r in plain) / len(plain) / args.window
    per_keys = sum(r[2] for r in plain) / len(plain) / args.window
    watch_ops = sum(r[1] for r in watcher) / args.window
    others = waiting - len(watcher)
    parts = [(r[3], others / len(plain)) for r in plain] + [(r[3], 1.0) for r in watcher]
    ops, keys, store_s, projected = scaled_replay(clients, f"asyncload/{seq}/", parts, args)
    return {
        "per_rank_ops": per,
        "per_rank_keys": per_keys,
        "watcher_ops": watch_ops,
        "group_ops": ops / args.window,
        "group_keys": keys / args.window,
        "load": store_s / args.window,
        "projected": projected,
        "simulated": len(sim),
    }


def late_scenario(
    scheme: str,
    world: int,
    seq: int,
    server: Any,
    clients: Clients,
    args: Any,
    mod: Any,
    late: int,
) -> dict[str, Any]:
    """The late-rank check firing on every waiting rank at once, ``late`` ranks late."""
    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            lines.append(rec.getMessage())

    handler = Catch()
    logger = logging.getLogger("asyncload.monitor")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        waiting = world - late
        sample = set(range(min(waiting, args.sample)))
        mons: dict[int, tuple[Any, Tally, Any]] = {}
        for r in range(world):
            m, t = make_monitor(mod, server, seq, r, world)
            if r >= waiting:
                m.status("reading data: 1.0 GiB of 2.0 GiB")
                m.store.set(f"pg/{r}", record(1 << 30, 2 << 30, f"s3://b/ckpt/__{r}_0.distcp"))
                continue
            m.store.set(f"pg/{r}", record(2 << 30, 2 << 30))
            m._reporting = object()  # it keeps a progress record (a load under asyncload.load)
            w = Waiter(scheme, m, "b")
            w.arrive()
            if r in sample:
                mons[r] = (m, t, w)
        now = time.monotonic()
        missing = list(range(waiting, world))
        traces = []
        watcher_trace: list[tuple[Any, ...]] = []
        for r in sorted(mons):
            m, t, w = mons[r]
            m._own_progress_at = now - 2.0
            m._late_logged_at = None
            t.reset()
            if scheme == "before":
                m._check_late(missing)
                traces.append(t.trace)
            elif w.watching():
                w.wait._watch(now)
                watcher_trace = t.trace
            else:
                w.wait._log_late(now)
                traces.append(t.trace)
        count = waiting - (1 if watcher_trace else 0)
        parts = [(tr, count / len(traces)) for tr in traces]
        if watcher_trace:
            parts.append((watcher_trace, 1.0))
        ops, keys, store_s, projected = scaled_replay(clients, f"asyncload/{seq}/", parts, args)
        return {
            "ops": ops,
            "keys": keys,
            "store_s": store_s,
            "projected": projected,
            "line": lines[-1] if lines else "",
        }
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def progress_scenario(
    scheme: str, world: int, seq: int, server: Any, clients: Clients, args: Any, mod: Any
) -> dict[str, Any]:
    m0, t0 = None, None
    for r in range(world):
        m, t = make_monitor(mod, server, seq, r, world)
        m.store.set(f"pg/{r}", record(1 << 30, 2 << 30))
        if r == 0:
            m0, t0 = m, t
    assert m0 is not None and t0 is not None
    t0.reset()
    c0 = time.perf_counter()
    got = m0.rank_progress()
    one_s = time.perf_counter() - c0
    assert len(got) == world
    ops, keys, store_s, projected = scaled_replay(
        clients, f"asyncload/{seq}/", [(t0.trace, float(world))], args
    )
    return {
        "one_ops": len(t0.trace),
        "one_s": one_s,
        "all_ops": ops,
        "all_keys": keys,
        "store_s": store_s,
        "projected": projected,
    }


def tilde(b: bool) -> str:
    return "~" if b else ""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", default="64,256,1024,4096,8192")
    ap.add_argument("--schemes", default="before,after")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--full", type=int, default=256, help="simulate every waiting rank up to this")
    ap.add_argument("--sample", type=int, default=8)
    ap.add_argument("--max-ops", type=int, default=150_000)
    ap.add_argument("--max-keys", type=int, default=4_000_000)
    ap.add_argument("--parts", default="barrier,late,progress")
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    schemes = args.schemes.split(",")
    parts = args.parts.split(",")
    before_path = before_source()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = Clients(server.port, args.clients, before_path)
    mods = {s: scheme_module(s, before_path) for s in schemes}
    print(
        f"store server in this process, {args.clients} client processes; window {args.window} s; "
        f"every waiting rank simulated up to {args.full}, else {args.sample}; load average "
        f"{loadavg()}",
        flush=True,
    )
    seq = 0
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    try:
        for world in ranks:
            for scheme in schemes:
                mod = mods[scheme]
                if "barrier" in parts:
                    seq += 1
                    res = barrier_scenario(scheme, world, seq, server, clients, args, mod)
                    results[("barrier", scheme, world)] = res
                    print(
                        f"{world:>5} {scheme:>6} barrier: {res['per_rank_ops']:.1f} ops/s per "
                        f"waiting rank ({res['per_rank_keys']:.0f} keys), watcher "
                        f"{res['watcher_ops']:.1f} ops/s; group {res['group_ops']:,.0f} ops/s, "
                        f"{res['group_keys']:,.0f} keys/s; store load {tilde(res['projected'])}"
                        f"{res['load']:.3f}; done after {'' if res['done_measured'] else '~'}"
                        f"{res['done']:.3f} s ({res['simulated']} simulated)",
                        flush=True,
                    )
                if "late" in parts:
                    for late in sorted({1, max(1, world // 8)}):
                        seq += 1
                        res = late_scenario(scheme, world, seq, server, clients, args, mod, late)
                        results[(f"late{late}", scheme, world)] = res
                        print(
                            f"{world:>5} {scheme:>6} late check ({late} late): {res['ops']:,} ops, "
                            f"{res['keys']:,} keys, store {tilde(res['projected'])}"
                            f"{res['store_s']:.3f} s",
                            flush=True,
                        )
                        if world == ranks[0]:
                            print(f"       line: {res['line'][:400]}", flush=True)
                if "side" in parts:
                    seq += 1
                    res = side_scenario(scheme, world, seq, server, clients, args)
                    results[("side", scheme, world)] = res
                    print(
                        f"{world:>5} {scheme:>6} side group's creation: {res['per_rank_ops']:.1f} "
                        f"ops/s per waiting rank ({res['per_rank_keys']:.0f} keys), watcher "
                        f"{res['watcher_ops']:.1f} ops/s; group {res['group_ops']:,.0f} ops/s, "
                        f"{res['group_keys']:,.0f} keys/s; store load {tilde(res['projected'])}"
                        f"{res['load']:.3f} ({res['simulated']} simulated)",
                        flush=True,
                    )
                if "sends" in parts:
                    seq += 1
                    res = side_scenario(scheme, world, seq, server, clients, args, "sends")
                    results[("sends", scheme, world)] = res
                    print(
                        f"{world:>5} {scheme:>6} sends to every rank: {res['per_rank_ops']:.1f} "
                        f"ops/s per waiting rank ({res['per_rank_keys']:.0f} keys), rank 0 "
                        f"{res['watcher_ops']:.1f} ops/s; group {res['group_ops']:,.0f} ops/s, "
                        f"{res['group_keys']:,.0f} keys/s; store load {tilde(res['projected'])}"
                        f"{res['load']:.3f} ({res['simulated']} simulated)",
                        flush=True,
                    )
                if "returned" in parts:
                    seq += 1
                    res = side_scenario(scheme, world, seq, server, clients, args, "returned")
                    results[("returned", scheme, world)] = res
                    print(
                        f"{world:>5} {scheme:>6} returned ranks: {res['per_rank_ops']:.1f} "
                        f"ops/s per waiting rank ({res['per_rank_keys']:.0f} keys), watcher "
                        f"{res['watcher_ops']:.1f} ops/s; group {res['group_ops']:,.0f} ops/s, "
                        f"{res['group_keys']:,.0f} keys/s; store load {tilde(res['projected'])}"
                        f"{res['load']:.3f} ({res['simulated']} simulated)",
                        flush=True,
                    )
                if "progress" in parts:
                    seq += 1
                    res = progress_scenario(scheme, world, seq, server, clients, args, mod)
                    results[("progress", scheme, world)] = res
                    print(
                        f"{world:>5} {scheme:>6} rank_progress: one call {res['one_ops']} ops "
                        f"{res['one_s'] * 1e3:.1f} ms; on every rank {res['all_ops']:,} ops "
                        f"{res['all_keys']:,} keys, store {tilde(res['projected'])}"
                        f"{res['store_s']:.2f} s",
                        flush=True,
                    )
    finally:
        clients.close()
    print(f"\nload average after: {loadavg()}")
    if "barrier" in parts:
        print(
            "\n| ranks | scheme | ops/s per waiting rank | group ops/s | group keys/s | store load | done after last arrival (s) |"
        )
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for (part, scheme, world), r in results.items():
            if part != "barrier":
                continue
            print(
                f"| {world:,} | {scheme} | {r['per_rank_ops']:.1f} | {r['group_ops']:,.0f} | "
                f"{r['group_keys']:,.0f} | {tilde(r['projected'])}{r['load']:.3f} | "
                f"{'' if r['done_measured'] else '~'}{r['done']:.3f} |"
            )
    for wait in ("side", "sends", "returned"):
        if wait not in parts:
            continue
        what = {
            "side": "side group's creation",
            "sends": "sends to every rank",
            "returned": "ranks that returned",
        }[wait]
        print(
            f"\n| ranks | scheme | {what}: ops/s per waiting rank | keys/s per "
            "rank | watcher ops/s | group ops/s | group keys/s | store load |"
        )
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for (part, scheme, world), r in results.items():
            if part == wait:
                print(
                    f"| {world:,} | {scheme} | {r['per_rank_ops']:.1f} | "
                    f"{r['per_rank_keys']:,.0f} | {r['watcher_ops']:.1f} | {r['group_ops']:,.0f} | {r['group_keys']:,.0f} | "
                    f"{tilde(r['projected'])}{r['load']:.3f} |"
                )
    if "late" in parts:
        print("\n| ranks | ranks late | scheme | ops | keys | store s |")
        print("| ---: | ---: | --- | ---: | ---: | ---: |")
        for (part, scheme, world), r in results.items():
            if part.startswith("late"):
                print(
                    f"| {world:,} | {part[4:]} | {scheme} | {r['ops']:,} | {r['keys']:,} | "
                    f"{tilde(r['projected'])}{r['store_s']:.3f} |"
                )
    if "progress" in parts:
        print(
            "\n| ranks | scheme | one call: ops | ms | every rank at once: ops | keys | store s |"
        )
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for (part, scheme, world), r in results.items():
            if part == "progress":
                print(
                    f"| {world:,} | {scheme} | {r['one_ops']} | {r['one_s'] * 1e3:.1f} | "
                    f"{r['all_ops']:,} | {r['all_keys']:,} | {tilde(r['projected'])}"
                    f"{r['store_s']:.2f} |"
                )


if __name__ == "__main__":
    main()
