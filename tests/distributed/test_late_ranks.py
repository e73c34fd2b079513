"""Who is late, while it is late (issue 29, item 6): during a multi-rank load every rank can
see every rank's progress (``LoadHandle.rank_progress()``), and a rank that has waited on
others for ``LoadOptions.late_rank_log_after`` seconds logs a WARNING naming the slowest
of them with the file and byte range they have in flight.

One rank's read is held by the server (:class:`GatedRangeServer`, an HTTP range server in
this process): its first ranged GET of a data file under ``/slow/`` gets no answer until
every other rank has logged a line naming exactly that request (file, byte range,
attempt); the others read the same checkpoint under ``/fast/``. So "the others logged
while it was late" is observed as an ordering (the held read cannot finish before the log
lines exist), never as a timing; the deadline is only a failure cut-off. After the load
every rank's records are checked against the bytes each rank loaded, and every tensor bit
for bit.

Multi-rank tests run on gloo process groups of 3 processes (``tests/_dist.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import all_ok, run_ranks
from test_distributed import big_model, same_bits, tensor_bytes

import asyncload
from asyncload import LoadOptions, PipelinedLoadPlanner, ShardedLoadPlanner
from asyncload.distributed import InFlightRequest, RankProgress
from asyncload.distributed.lateness import Rate, decode, encode, late_message
from asyncload.testing._serve import RangeNotSatisfiable, parse_byte_range

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]

KiB = 1 << 10
SLOW = 1
WORLD = 3
#: Seconds the held read waits for the other ranks' log lines at most (a failure cut-off).
CUT_OFF = 40.0
OPTIONS = LoadOptions(
    chunk_size=256 * KiB,
    min_chunk_size=16 * KiB,
    hedge=False,  # a hedge would end the held read on its own
    timeout=CUT_OFF + 20,
    collective_timeout=CUT_OFF + 20,
    late_rank_log_after=0.2,
)


class GatedRangeServer:
    """Serves ``root`` over HTTP on 127.0.0.1 (GET/HEAD, one ``Range``, ``ETag``), each
    path under any first segment (``/fast/ckpt/x`` and ``/slow/ckpt/x`` are ``root/ckpt/x``).
    The first ranged GET of a ``.distcp`` file under ``/slow/`` is held: the server writes
    ``flags/held.txt`` (``bytes [a, b) of URL``, as asyncload's log lines name a request)
    and answers only once ``flags/logged-<r>`` exists for every rank in ``waiters``."""

    def __init__(self, root: Path, flags: Path, waiters: list[int]) -> None:
        self.root, self.flags, self.waiters = root, flags, waiters
        self.port = 0
        self.held: str | None = None
        self.released_in_time: bool | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gated-range-server", daemon=True)

    def __enter__(self) -> GatedRangeServer:
        self._thread.start()
        assert self._ready.wait(10), "the gated server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def url(self, prefix: str) -> str:
        return f"http://127.0.0.1:{self.port}/{prefix}/ckpt"

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{prefix}/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        prefix, tail = request.match_info["prefix"], request.match_info["tail"]
        target = self.root / tail
        if request.method not in ("GET", "HEAD") or not target.is_file():
            return web.Response(status=404)
        size = target.stat().st_size
        headers = {"Accept-Ranges": "bytes", "ETag": f'"{target.stat().st_mtime_ns:x}"'}
        try:
            rng = parse_byte_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        start, stop = rng if rng is not None else (0, size)
        if prefix == "slow" and rng is not None and tail.endswith(".distcp") and not self.held:
            self.held = f"bytes [{start}, {stop}) of {self.url('slow')}/{Path(tail).name}"
            (self.flags / "held.txt").write_text(self.held)
            self.released_in_time = await self._wait_for_logs()
        body = await asyncio.to_thread(_read, target, start, stop)
        if rng is not None:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        return web.Response(status=206 if rng else 200, body=body, headers=headers)

    async def _wait_for_logs(self) -> bool:
        end = time.monotonic() + CUT_OFF
        files = [self.flags / f"logged-{r}" for r in self.waiters]
        while not all(f.exists() for f in files):
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.01)
        return True


def _read(path: Path, start: int, stop: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(stop - start)


def _catch_late_lines(rank: int, flags: str) -> tuple[list[str], list[float]]:
    """WARNING lines of ``asyncload.monitor`` on this rank and when each was logged; once one
    names the held request, ``flags/logged-<rank>`` says so."""
    lines: list[str] = []
    times: list[float] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno != logging.WARNING:
                return
            text = record.getMessage()
            lines.append(text)
            times.append(record.created)
            held = Path(flags) / "held.txt"
            if held.exists() and held.read_text() in text:
                (Path(flags) / f"logged-{rank}").touch()

    monitor_log = logging.getLogger("asyncload.monitor")
    monitor_log.addHandler(Catch())
    monitor_log.setLevel(logging.WARNING)
    return lines, times


def w_late(rank: int, world: int, urls: tuple[str, str], flags: str, kind: str) -> dict[str, Any]:
    lines, times = _catch_late_lines(rank, flags)
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    planner = (
        PipelinedLoadPlanner()
        if kind == "pipelined"
        else ShardedLoadPlanner(adaptive=False, sharing="always")
    )
    url = urls[1] if rank == SLOW else urls[0]
    handle = asyncload.start_load(sd, url, options=OPTIONS, planner=planner)
    handle.result(CUT_OFF + 30)
    records = handle.rank_progress()
    return {
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
        "lines": lines,
        "times": times,
        "records": records,
        "progress": handle.progress,
    }


@pytest.mark.parametrize("kind", ["pipelined", "sharded"])
def test_ranks_waiting_on_a_held_read_name_its_rank_file_and_range(
    tmp_path: Path, kind: str
) -> None:
    """Pipelined: the others wait at the final barrier (the 704-rank report); sharded
    (static plan): they wait for the held rank's bytes. Either way each of them logs the
    held rank, its file and its byte range while the read is held."""
    full = big_model()
    dcp.save(
        {k: v.clone() for k, v in full.items()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True
    )
    flags = tmp_path / "flags"
    flags.mkdir()
    others = [r for r in range(WORLD) if r != SLOW]
    with GatedRangeServer(tmp_path, flags, others) as server:
        urls = (server.url("fast"), server.url("slow"))
        results = run_ranks(w_late, WORLD, urls, str(flags), kind, timeout=CUT_OFF + 60)
        held, in_time = server.held, server.released_in_time
    assert all_ok(results), [(r.rank, r.status, r.message, r.traceback) for r in results]
    assert held is not None and in_time is True, (held, in_time)
    total = tensor_bytes(full)
    for res in results:
        v = res.value
        assert v["bad"] == [], res.rank
        assert v["progress"] == (total, total)
        # after the load: every rank's record, seen from every rank, has all its bytes
        assert [(p.rank, p.bytes_done, p.bytes_total) for p in v["records"]] == [
            (r, total, total) for r in range(WORLD)
        ]
        assert all(p.in_flight == () for p in v["records"]), v["records"]
        mine = v["records"][res.rank]
        assert mine.age == 0.0
        assert all(p.age is not None and p.age >= 0 for p in v["records"])
    for r in others:
        named = [line for line in results[r].value["lines"] if held in line]
        assert named, (r, held, results[r].value["lines"])
        line = named[0]
        # the held rank is named, with its request: file, range, attempt
        assert f"rank {r} has waited " in line
        assert f"for rank {SLOW} while " in line
        assert f"rank {SLOW}: " in line
        assert f"{held} for " in line and " s (attempt 1)" in line.split(held, 1)[1]
        assert "LoadOptions.late_rank_log_after=0.2" in line
        # repeated while the wait lasts, at most every late_rank_log_after seconds
        times = results[r].value["times"]
        assert all(b - a >= 0.2 - 0.01 for a, b in itertools.pairwise(times)), times


def w_records_are_visible_while_loading(
    rank: int, world: int, path: str, flags: str
) -> dict[str, Any]:
    """Rank 0's progress callback blocks, once a quarter of its bytes are in, until rank 1
    has seen (through its own handle) rank 0's record with those bytes."""
    full = big_model()
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    total = tensor_bytes(full)
    seen: dict[str, Any] = {}
    go = Path(flags) / "seen"

    def progress(done: int, total_: int) -> None:
        if rank == 0 and "q" not in seen and done >= total_ // 4:
            seen["q"] = done
            (Path(flags) / "quarter").write_text(str(done))
            end = time.monotonic() + CUT_OFF
            while not go.exists() and time.monotonic() < end:
                time.sleep(0.01)

    options = OPTIONS.replace(concurrency=1, chunk_size=64 * KiB)
    handle = asyncload.start_load(sd, path, options=options, progress=progress)
    watched: list[RankProgress] = []
    if rank == 1:
        quarter = Path(flags) / "quarter"
        end = time.monotonic() + CUT_OFF
        while time.monotonic() < end and not go.exists():
            if quarter.exists():
                at_least = int(quarter.read_text())
                records = handle.rank_progress()
                if records[0].bytes_done >= at_least and records[0].bytes_done < total:
                    watched = records
                    go.touch()
            time.sleep(0.02)
    handle.result(CUT_OFF + 30)
    return {
        "watched": [(p.rank, p.bytes_done, p.bytes_total, p.status) for p in watched],
        "bad": [k for k in full if not same_bits(sd[k], full[k])],
    }


def test_rank_progress_shows_another_rank_during_the_load(tmp_path: Path) -> None:
    full = big_model()
    path = tmp_path / "ckpt"
    dcp.save({k: v.clone() for k, v in full.items()}, checkpoint_id=str(path), no_dist=True)
    flags = tmp_path / "flags"
    flags.mkdir()
    results = run_ranks(w_records_are_visible_while_loading, 2, str(path), str(flags), timeout=90)
    assert all_ok(results), [(r.rank, r.status, r.message, r.traceback) for r in results]
    watched = results[1].value["watched"]
    total = tensor_bytes(full)
    assert len(watched) == 2, watched
    r0 = watched[0]
    quarter = int((flags / "quarter").read_text())
    assert r0[0] == 0 and quarter <= r0[1] < total and r0[2] == total
    assert r0[3].startswith("reading data")
    assert all(r.value["bad"] == [] for r in results)


# --- one rank, and the pieces --------------------------------------------------------------------


def test_a_single_rank_load_shows_this_rank_alone(tmp_path: Path) -> None:
    full = big_model()
    path = tmp_path / "ckpt"
    dcp.save({k: v.clone() for k, v in full.items()}, checkpoint_id=str(path), no_dist=True)
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    handle = asyncload.start_load(sd, str(path))
    handle.result(60)
    (only,) = handle.rank_progress()
    total = tensor_bytes(full)
    assert (only.rank, only.bytes_done, only.bytes_total) == (0, total, total)
    assert only.in_flight == () and only.status == "done" and only.age == 0.0
    assert handle.progress == (total, total)  # the tuple it always was
    assert all(same_bits(sd[k], full[k]) for k in full)


def test_the_option_is_validated() -> None:
    assert LoadOptions().late_rank_log_after == 60.0
    assert LoadOptions(late_rank_log_after=None).late_rank_log_after is None
    for bad in (0, -1.0, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ValueError, match=r"LoadOptions\.late_rank_log_after="):
            LoadOptions(late_rank_log_after=bad)  # type: ignore[arg-type]


def test_a_record_round_trips_with_its_age_added() -> None:
    req = InFlightRequest("http://u:***@h/ckpt/__0_0.distcp", (4096, 8192), 2, 3.0, True)
    text = encode(1000, 4000, 250.0, [req])
    got = decode(5, text.encode(), "reading data")
    assert (got.rank, got.bytes_done, got.bytes_total, got.rate, got.status) == (
        5,
        1000,
        4000,
        250.0,
        "reading data",
    )
    assert got.age is not None and 0 <= got.age < 60
    (back,) = got.in_flight
    assert (back.path, back.byte_range, back.attempt, back.hedge) == (
        req.path,
        (4096, 8192),
        2,
        True,
    )
    assert back.seconds == pytest.approx(3.0 + got.age)
    assert decode(2, None, "") == RankProgress(2, 0, None, 0.0, (), "", None)


def test_the_log_line_puts_the_slowest_first_and_redacts() -> None:
    stuck = InFlightRequest("https://h/b/__1_0.distcp?X-Amz-Signature=abc", (0, 64), 1, 12.0)
    a = RankProgress(1, 100, 400, 0.0, (stuck,), "reading data", 0.5)
    b = RankProgress(2, 300, 400, 10.0, (), "reading data", 0.1)
    line = late_message(0, 12.5, "waiting for the other ranks to finish reading", 5.0, [b, a])
    assert line.startswith(
        "rank 0 has waited 12.5 s for 2 ranks (1, 2) while waiting for the other ranks to "
        "finish reading (LoadOptions.late_rank_log_after=5.0); slowest: rank 1: "
    )
    assert line.index("rank 1: ") < line.index("rank 2: ")
    assert (
        "bytes [0, 64) of https://h/b/__1_0.distcp?X-Amz-Signature=*** for 12.0 s (attempt 1)"
        in line
    )
    assert "abc" not in line


def test_rate_over_a_window() -> None:
    r = Rate(start=0.0)
    r.add(100, now=1.0)
    assert r.rate(now=1.0) == pytest.approx(100.0)
    r.add(1100, now=11.0)
    r.add(1100, now=30.0)  # nothing more for a while: the rate falls to 0
    assert r.rate(now=30.0) == 0.0
