"""LoadStats, the progress callback, LoadHandle.progress/statistics() and logging."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch

import asyncload
from asyncload import LoadOptions, LoadStats
from asyncload.common.stats import StatsRecorder
from asyncload.testing import status


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict:
    """What this module's ``ckpt`` holds (the fixture of tests/conftest.py)."""
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(512, 1024, generator=g),  # 2 MiB: split into many chunks
        "half": torch.randn(300, 700, generator=g).to(torch.bfloat16),
        "norms": {f"n{i}": torch.randn(64, generator=g) for i in range(12)},  # small: coalesced
        "ids": torch.arange(1000, dtype=torch.int64),
        "step": 42,
    }


def _zeros_like(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _zeros_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def _tensor_bytes(sd: dict) -> int:
    n = 0
    for v in sd.values():
        if isinstance(v, dict):
            n += _tensor_bytes(v)
        elif isinstance(v, torch.Tensor):
            n += v.numel() * v.element_size()
    return n


SMALL = LoadOptions(
    chunk_size=256 << 10, min_chunk_size=64 << 10, concurrency=4, memory_budget=1 << 20
)


# --- the recorder and the numbers ---------------------------------------------------------


def test_latency_percentiles_are_nearest_rank() -> None:
    rec = StatsRecorder()
    for v in range(100, 0, -1):  # 100 ... 1, out of order on purpose
        rec.latency(float(v))
    s = rec.snapshot()
    assert (s.latency_p50, s.latency_p90, s.latency_p99, s.latency_max) == (
        50.0,
        90.0,
        99.0,
        100.0,
    )
    one = StatsRecorder()
    one.latency(0.25)
    s1 = one.snapshot()
    assert (s1.latency_p50, s1.latency_p90, s1.latency_p99, s1.latency_max) == (
        0.25,
        0.25,
        0.25,
        0.25,
    )
    empty = StatsRecorder().snapshot()
    assert (empty.latency_p50, empty.latency_max) == (0.0, 0.0)


def test_retries_by_cause_and_timeouts() -> None:
    rec = StatsRecorder()
    for cause in ("timeout", "status_503", "timeout", "connection"):
        rec.retry(cause)
    rec.add(hedges=2)
    s = rec.snapshot()
    assert s.retries == 4
    assert s.timeouts == 2
    assert s.hedges == 2
    assert s.retries_by_cause == {"timeout": 2, "status_503": 1, "connection": 1}


def test_snapshot_is_a_copy() -> None:
    rec = StatsRecorder()
    rec.retry("timeout")
    s = rec.snapshot()
    rec.retry("timeout")
    rec.add(bytes_read=10)
    assert s.retries == 1 and s.retries_by_cause == {"timeout": 1} and s.bytes_read == 0


def test_throughput() -> None:
    assert LoadStats(bytes_assembled=3 << 30, seconds=1.5).throughput == 2 << 30
    assert LoadStats(bytes_assembled=100, seconds=0.0).throughput == 0.0


def test_to_dict_is_json_and_round_trips() -> None:
    s = LoadStats(
        bytes_read=10,
        bytes_assembled=8,
        chunks=2,
        retries=3,
        timeouts=1,
        hedges=1,
        seconds=2.0,
        retries_by_cause={"timeout": 1, "status_503": 2},
        unexpected_keys=["x"],
        latency_p50=0.5,
    )
    d = s.to_dict()
    assert d["throughput"] == 4.0
    assert d["retries_by_cause"] == {"timeout": 1, "status_503": 2}
    back = json.loads(json.dumps(d))
    assert LoadStats.from_dict(back) == s
    d["retries_by_cause"]["timeout"] = 99  # a copy, not the stats' own dict
    assert s.retries_by_cause["timeout"] == 1


def test_str_is_one_readable_paragraph() -> None:
    s = LoadStats(
        bytes_read=3 << 30,
        bytes_assembled=3 << 30,
        chunks=192,
        seconds=1.5,
        files=4,
        peak_buffered_bytes=256 << 20,
        peak_concurrency=16,
        latency_p50=0.0123,
        latency_p90=0.02,
        latency_p99=0.0415,
        latency_max=1.25,
        storage_wait_seconds=20.5,
        budget_wait_seconds=0.25,
        slot_wait_seconds=0.5,
        assembly_seconds=1.75,
    )
    text = str(s)
    assert "\n" not in text
    assert text == (
        "Loaded 3.00 GiB in 1.500 s (2.00 GiB/s) from 4 files: 3.00 GiB read in 192 requests, up to 16 in flight, "
        "at most 256.00 MiB buffered. Request latency p50 12.3 ms, p90 20.0 ms, p99 41.5 ms, max 1.25 s. "
        "Time summed over concurrent requests: 20.500 s waiting for storage (13.7 in flight on average), 1.750 s "
        "assembling. Wall-clock waits before a read: 0.250 s for memory budget (full), 0.500 s for a read slot "
        "(concurrency limit). No retries, timeouts or hedged requests."
    )


def test_str_names_retries_by_cause_and_extras() -> None:
    s = LoadStats(
        bytes_assembled=1024,
        seconds=1.0,
        chunks=1,
        files=1,
        retries=3,
        timeouts=2,
        hedges=1,
        retries_by_cause={"timeout": 2, "status_503": 1},
        verified_records=5,
        unexpected_keys=["a", "b", "c", "d"],
    )
    text = str(s)
    assert "3 retries (status_503 1, timeout 2), 2 timeouts, 1 hedged request." in text
    assert "5 records verified against stored CRC-32." in text
    assert "4 checkpoint keys not in the destination (a, b, c, ...)." in text
    assert "1 file:" in text and "1 request," in text
    one = str(LoadStats(retries=1, retries_by_cause={"connection": 1}))
    assert "1 retry (connection 1), 0 timeouts, 0 hedged requests." in one


# --- a real load's numbers -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stats_of_a_real_load(ckpt: tuple[Path, dict]) -> None:
    path, sd = ckpt
    dst = _zeros_like(sd)
    stats = asyncload.load(dst, path, options=SMALL)
    assert _bits_equal(dst["big"], sd["big"]) and dst["step"] == 42
    assert stats.bytes_assembled == _tensor_bytes(sd)
    assert stats.bytes_read >= stats.bytes_assembled
    assert stats.chunks >= (2 << 20) // (256 << 10)  # "big" alone needs 8 reads of 256 KiB
    assert stats.files == 2  # .metadata and the one .distcp
    assert 0 < stats.peak_buffered_bytes <= SMALL.memory_budget
    assert 1 <= stats.peak_concurrency <= 4
    assert 0 < stats.latency_p50 <= stats.latency_p90 <= stats.latency_p99 <= stats.latency_max
    assert stats.seconds > 0 and stats.throughput > 0
    assert (
        stats.storage_wait_seconds > 0
        and stats.assembly_seconds >= 0
        and stats.budget_wait_seconds >= 0
    )
    assert stats.retries == stats.timeouts == stats.hedges == 0 and stats.retries_by_cause == {}
    assert json.loads(json.dumps(stats.to_dict()))["bytes_assembled"] == stats.bytes_assembled


@pytest.mark.timeout(60)
def test_retries_by_cause_from_a_real_fault(
    ckpt: tuple[Path, dict], http_server, fault_proxy, bucket_name
) -> None:
    path, sd = ckpt
    http_server.upload_dir(path, bucket_name, "ck")
    proxy = fault_proxy(http_server)
    rule = proxy.add_rule(status(503), data_only=True, range_only=True, skip=1, times=2)
    url = http_server.url(bucket_name, "ck", endpoint_url=proxy.endpoint_url)
    dst = _zeros_like(sd)
    stats = asyncload.load(dst, url, options=SMALL.replace(backoff=0.01, hedge=False))
    assert rule.fired == 2
    assert (
        stats.retries == 2 and stats.retries_by_cause == {"status_503": 2} and stats.timeouts == 0
    )
    assert "2 retries (status_503 2)" in str(stats)
    assert _bits_equal(dst["half"], sd["half"])


# --- progress ------------------------------------------------------------------------------


def _check_progress(calls: list[tuple[int, int]], total: int) -> None:
    assert calls, "progress was never called"
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert all(b > a for a, b in itertools.pairwise(done)), done
    assert done[-1] == total
    assert done[0] > 0


@pytest.mark.timeout(60)
def test_progress_callback_of_load(ckpt: tuple[Path, dict]) -> None:
    path, sd = ckpt
    calls: list[tuple[int, int]] = []
    asyncload.load(
        _zeros_like(sd), path, options=SMALL, progress=lambda d, t: calls.append((d, t))
    )
    _check_progress(calls, _tensor_bytes(sd))
    assert len(calls) >= 8


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_progress_callback_of_aload(ckpt: tuple[Path, dict]) -> None:
    path, sd = ckpt
    calls: list[tuple[int, int]] = []
    await asyncload.aload(
        _zeros_like(sd), path, options=SMALL, progress=lambda d, t: calls.append((d, t))
    )
    _check_progress(calls, _tensor_bytes(sd))


@pytest.mark.timeout(60)
def test_progress_of_start_load_and_handle(ckpt: tuple[Path, dict]) -> None:
    path, sd = ckpt
    calls: list[tuple[int, int]] = []
    handle = asyncload.start_load(
        _zeros_like(sd), path, options=SMALL, progress=lambda d, t: calls.append((d, t))
    )
    stats = handle.result(timeout=60)
    _check_progress(calls, _tensor_bytes(sd))
    assert handle.progress == (_tensor_bytes(sd), _tensor_bytes(sd))
    assert handle.statistics() == stats  # final statistics once done


@pytest.mark.timeout(60)
def test_progress_from_a_remote_store(ckpt: tuple[Path, dict], s3_server, bucket_name) -> None:
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ck")
    calls: list[tuple[int, int]] = []
    asyncload.load(
        _zeros_like(sd),
        url,
        options=SMALL,
        storage_options=s3_server.storage_options(),
        progress=lambda d, t: calls.append((d, t)),
    )
    _check_progress(calls, _tensor_bytes(sd))


@pytest.mark.timeout(60)
def test_live_statistics_while_running(
    ckpt: tuple[Path, dict], http_server, fault_proxy, bucket_name
) -> None:
    path, sd = ckpt
    http_server.upload_dir(path, bucket_name, "ck")
    proxy = fault_proxy(http_server, latency=0.02)  # every request takes at least 40 ms
    url = http_server.url(bucket_name, "ck", endpoint_url=proxy.endpoint_url)
    handle = asyncload.start_load(
        _zeros_like(sd), url, options=SMALL.replace(concurrency=1, hedge=False)
    )
    seen: list[LoadStats] = []
    while not handle.done():
        seen.append(handle.statistics())
        time.sleep(0.05)
    final = handle.result(timeout=60)
    running = [s for s in seen if 0 < s.bytes_read < final.bytes_read]
    assert running, "no snapshot was taken mid-load"
    assert all(s.seconds > 0 for s in running)
    reads = [s.bytes_read for s in seen]
    assert reads == sorted(reads)


# --- logging: INFO per load, DEBUG per chunk, nothing printed -----------------------------


@pytest.mark.timeout(60)
def test_logging_and_nothing_printed(
    ckpt: tuple[Path, dict], caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    path, sd = ckpt
    with caplog.at_level(logging.DEBUG, logger="asyncload"):
        stats = asyncload.load(_zeros_like(sd), path, options=SMALL)
    ours = [r for r in caplog.records if r.name == "asyncload" or r.name.startswith("asyncload.")]
    infos = [r for r in ours if r.levelno == logging.INFO]
    assert len(infos) == 1
    assert infos[0].getMessage() == f"loaded {path}: {stats}"
    chunk_lines = [
        r.getMessage()
        for r in ours
        if r.levelno == logging.DEBUG and r.getMessage().startswith("chunk ")
    ]
    assert len(chunk_lines) >= 8
    pattern = re.compile(
        r"^chunk \S+ \[\d+, \d+\) \d+ bytes in \d+ segments: read \d+\.\d\d ms, assembled \d+\.\d\d ms$"
    )
    assert all(pattern.match(line) for line in chunk_lines), chunk_lines[:3]
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_aload_and_start_load_print_nothing(
    ckpt: tuple[Path, dict], capfd: pytest.CaptureFixture[str]
) -> None:
    path, sd = ckpt
    logging.getLogger("asyncload").setLevel(logging.DEBUG)
    try:
        await asyncload.aload(_zeros_like(sd), path, options=SMALL)
        await asyncio.to_thread(
            lambda: asyncload.start_load(_zeros_like(sd), path, options=SMALL).result(60)
        )
    finally:
        logging.getLogger("asyncload").setLevel(logging.NOTSET)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.timeout(60)
def test_a_failed_load_prints_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # torch's dcp.load logs its metadata fallback with a traceback on the root logger;
    # with no logging configured Python would print it: asyncload's own errors stay quiet
    with caplog.at_level(logging.DEBUG), pytest.raises(asyncload.CheckpointNotFoundError):
        asyncload.load({"w": torch.zeros(2)}, tmp_path / "missing")
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# --- help(LoadStats) and a time split that reads as true -----------------------------------


def test_help_explains_every_field() -> None:
    """Each field has its meaning and unit in ``help(LoadStats)``, with its default; a field
    added without an entry in ``STATS_DOCS`` fails here."""
    import dataclasses
    import inspect
    import pydoc

    from asyncload.common.stats import STATS_DOCS

    doc = pydoc.render_doc(LoadStats, renderer=pydoc.plaintext)
    assert "(undocumented)" not in doc
    names = [f.name for f in dataclasses.fields(LoadStats)]
    assert set(STATS_DOCS) == set(names)
    for f in dataclasses.fields(LoadStats):
        assert STATS_DOCS[f.name].meaning and STATS_DOCS[f.name].unit, f.name
        assert f"\n |  {f.name}: {f.type} = {getattr(LoadStats(), f.name)!r}" in doc, f.name
    for name in ("storage_wait_seconds", "assembly_seconds"):
        assert STATS_DOCS[name].unit == "seconds (summed over reads)"
    for name in ("seconds", "budget_wait_seconds", "slot_wait_seconds"):
        assert "summed" not in STATS_DOCS[name].unit
    params = inspect.signature(LoadStats).parameters
    for name in names:
        default = params[name].default
        assert (
            default == getattr(LoadStats(), name) or default is dataclasses.MISSING
        ) or default.__class__.__name__ == "_HAS_DEFAULT_FACTORY_CLASS", name


@pytest.mark.timeout(60)
def test_a_budget_that_never_fills_is_never_waited_for(
    ckpt: tuple[Path, dict], s3_server, bucket_name
) -> None:
    """Issue 44: "49.8 s waiting for budget with at most 34 MiB of 512 buffered" (1 GiB from
    moto). The dispatcher's waits for a read slot (concurrency 1 here: every read but the
    first waits for one) are not waits for the budget, 1 GiB for a 3 MiB checkpoint."""
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ck-budget")
    dst = _zeros_like(sd)
    options = LoadOptions(
        chunk_size=64 << 10, min_chunk_size=4 << 10, concurrency=1, memory_budget=1 << 30
    )
    stats = asyncload.load(dst, url, options=options, storage_options=s3_server.storage_options())
    assert _bits_equal(dst["big"], sd["big"])
    assert stats.peak_buffered_bytes < options.memory_budget
    assert stats.budget_wait_seconds == 0.0
    assert stats.slot_wait_seconds > 0.0 and stats.peak_concurrency == 1
    assert "0.000 s for memory budget (full)" in str(stats)


@pytest.mark.timeout(60)
def test_a_full_budget_is_waited_for_and_slots_are_not(ckpt: tuple[Path, dict]) -> None:
    """A budget of one chunk: every read after the first waits for the budget, never for one
    of the 8 read slots."""
    path, sd = ckpt
    dst = _zeros_like(sd)
    options = LoadOptions(
        chunk_size=64 << 10, min_chunk_size=4 << 10, concurrency=8, memory_budget=64 << 10
    )
    stats = asyncload.load(dst, path, options=options)
    assert _bits_equal(dst["big"], sd["big"]) and _bits_equal(dst["half"], sd["half"])
    assert stats.peak_buffered_bytes == options.memory_budget
    assert stats.budget_wait_seconds > 0.0
    assert stats.slot_wait_seconds == 0.0


def test_mean_concurrency_is_storage_time_over_wall_time() -> None:
    s = LoadStats(seconds=2.0, storage_wait_seconds=30.0)
    assert s.mean_concurrency == 15.0
    assert LoadStats().mean_concurrency == 0.0
    assert s.to_dict()["mean_concurrency"] == 15.0
    assert "30.000 s waiting for storage (15.0 in flight on average)" in str(s)


def test_a_shared_recorder_records_into_its_inner_one_and_counts_its_own_bytes() -> None:
    from asyncload.common.stats import SharedRecorder, StatsRecorder

    inner = StatsRecorder()
    inner.started = 5.0
    a, b = SharedRecorder(inner), SharedRecorder(inner)
    a.add(bytes_assembled=100, bytes_read=120)
    b.add(bytes_assembled=7)
    a.retry("timeout")
    b.latency(0.25)
    a.maximum("peak_buffered_bytes", 64)
    b.started = 6.0
    assert (a.assembled, b.assembled) == (100, 7)
    s = inner.snapshot()
    assert (s.bytes_assembled, s.bytes_read, s.retries, s.timeouts) == (107, 120, 1, 1)
    assert (s.latency_max, s.peak_buffered_bytes) == (0.25, 64)
    assert inner.started == a.started == 6.0
    assert a.snapshot() == s
