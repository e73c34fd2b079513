"""The derived hedge floor (``hedge_min_delay=None``, the default): the delay comes from
this load's measured first-byte latency and per-stream rate, a request whose answer has
not begun while later requests had theirs is hedged after a few first-byte latencies, and
a uniformly slow link hedges nothing. The delay function is tested on a synthetic clock;
the loads run against loopback servers behind the FaultProxy (no timing decides a test)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _ckpt import assert_bitwise_equal, make_checkpoint, random_tensor, zeros_like_tree
from _remote import BACKENDS, make_remote, no_unclosed_session_warnings, wait_closed

import asyncload
from asyncload import LoadOptions
from asyncload.common.latency import HEDGE_COLD_FACTOR, HEDGE_DERIVED_FLOOR, LoadClock, hedge_delay
from asyncload.common.stats import StatsRecorder
from asyncload.storage import call_with_retry, first_byte
from asyncload.testing import stall

MiB = 1 << 20


class FakeTime:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _clock() -> tuple[LoadClock, FakeTime]:
    t = FakeTime()
    return LoadClock(now=t), t


DERIVED = LoadOptions().hedge_policy  # hedge_min_delay=None, hedge_factor=3


# --- the delay function, on a synthetic clock -------------------------------------------------


def test_the_default_floor_is_derived_and_explicit_values_keep_working():
    assert LoadOptions().hedge_min_delay is None
    assert DERIVED.derived and DERIVED.enabled and DERIVED.factor == 3.0
    assert DERIVED.min_delay == 0.5  # what peer transfers of multi-rank loads keep as their floor
    fixed = LoadOptions(hedge_min_delay=0.3).hedge_policy
    assert not fixed.derived and fixed.min_delay == 0.3
    assert LoadOptions(hedge_min_delay=0).hedge_policy.min_delay == 0
    with pytest.raises(ValueError, match="hedge_min_delay"):
        LoadOptions(hedge_min_delay=-0.1)
    with pytest.raises(ValueError, match="or None"):
        LoadOptions(hedge_min_delay="0.5")  # type: ignore[arg-type]


def test_derived_no_body_hedge_before_comparable_history():
    """Derived: before 4 comparable reads have finished, the body rule hedges nothing (the
    first reads share the link and finish together, however long a congested link makes them)."""
    clock, _ = _clock()
    assert hedge_delay(DERIVED, clock, 8 * MiB) is None
    # a request waiting for its answer, with no first-byte history: nothing either
    assert hedge_delay(DERIVED, clock, 8 * MiB, waiting_since=clock.now()) is None
    for _ in range(3):
        clock.finished(2.5, 8 * MiB, 2.48)
    assert hedge_delay(DERIVED, clock, 8 * MiB) is None
    clock.finished(2.5, 8 * MiB, 2.48)  # the 4th: now the peers say what normal is
    assert hedge_delay(DERIVED, clock, 8 * MiB) == pytest.approx(3 * 2.5)
    assert hedge_delay(LoadOptions(hedge=False).hedge_policy, clock, 8 * MiB) is None


def _answers(clock: LoadClock, t: FakeTime, n: int, ttfb: float) -> None:
    """``n`` requests started one after the other, each answered after ``ttfb``."""
    for _ in range(n):
        started = t.t
        t.t += 0.001
        clock.answered(ttfb, started)


def test_a_request_without_an_answer_is_hedged_after_a_few_first_byte_latencies():
    clock, t = _clock()
    waiting_since = t.t
    t.t += 0.001
    _answers(clock, t, 10, 0.02)  # ten later requests had their answers within 20 ms
    assert clock.first_byte_time() == pytest.approx(0.02)
    assert clock.overtaken(waiting_since) == 10
    # 3 x p90 of the first-byte latencies, not the 1 s cold delay of the body rule
    assert hedge_delay(DERIVED, clock, 8 * MiB, waiting_since=waiting_since) == pytest.approx(0.06)
    # never below the derived floor, however fast the answers
    fast, ft = _clock()
    since = ft.t
    ft.t += 0.001
    _answers(fast, ft, 10, 0.001)
    assert hedge_delay(DERIVED, fast, 8 * MiB, waiting_since=since) == pytest.approx(
        HEDGE_DERIVED_FLOOR
    )
    # an explicit floor bounds the first-byte rule too
    fixed = LoadOptions(hedge_min_delay=0.25).hedge_policy
    assert hedge_delay(fixed, clock, 8 * MiB, waiting_since=waiting_since) == pytest.approx(0.25)
    # once the answer has begun, only the body rule applies (no comparable history: none)
    assert hedge_delay(DERIVED, clock, 8 * MiB) is None


def test_a_request_not_overtaken_is_left_to_the_body_rule():
    """Answers in the order of the requests (a uniformly slow link): no straggler."""
    clock, t = _clock()
    _answers(clock, t, 10, 0.02)
    last = t.t  # the newest request: nothing started after it has been answered
    assert clock.overtaken(last) == 0
    assert hedge_delay(DERIVED, clock, 8 * MiB, waiting_since=last) is None
    t.t += 0.001
    clock.answered(0.02, t.t)  # one later answer is not enough (HEDGE_OVERTAKEN = 2)
    assert hedge_delay(DERIVED, clock, 8 * MiB, waiting_since=last) is None
    t.t += 0.001
    clock.answered(0.02, t.t)
    assert hedge_delay(DERIVED, clock, 8 * MiB, waiting_since=last) == pytest.approx(0.06)


def test_the_body_floor_is_the_expected_time_at_the_measured_rate():
    clock, t = _clock()
    _answers(clock, t, 8, 0.02)
    for _ in range(8):  # 8 MiB reads whose bodies came at 100 MiB/s per stream
        clock.finished(0.02 + 0.08, 8 * MiB, 0.08)
    assert clock.expected_time(8 * MiB) == pytest.approx(0.02 + 0.08)
    # comparable history: max(floor, 3 x p90) with the floor 3 x the expected time
    assert hedge_delay(DERIVED, clock, 8 * MiB) == pytest.approx(0.3)
    # the same history under the old fixed floor of 0.5 s
    assert hedge_delay(
        LoadOptions(hedge_min_delay=0.5).hedge_policy, clock, 8 * MiB
    ) == pytest.approx(0.5)
    # a read 4x larger than any so far: no comparable history, so no body hedge though its
    # expected time is known
    big = 64 * MiB
    assert clock.straggler_time(big) is None and clock.expected_time(big) == pytest.approx(
        0.02 + 0.64
    )
    assert hedge_delay(DERIVED, clock, big) is None


def test_a_slow_stream_raises_the_floor_above_the_peers_p90():
    """The expected time at the measured per-stream rate is a floor under the peers' p90:
    1 MiB reads at 5 MiB/s, then 16 MiB reads that happened to be fast are no yardstick
    for hedging a 16 MiB read after 3 x 0.5 s when the stream rate says it takes 3.2 s."""
    clock, t = _clock()
    _answers(clock, t, 8, 0.05)
    for _ in range(8):
        clock.finished(0.05 + 0.2, 1 * MiB, 0.2)  # 1 MiB reads at 5 MiB/s
    expected = 0.05 + 16 / 5
    assert clock.expected_time(16 * MiB) == pytest.approx(expected)
    for _ in range(4):
        clock.finished(0.5, 16 * MiB, None)  # comparable, but no body time (not rate samples)
    assert clock.straggler_time(16 * MiB) == pytest.approx(0.5)
    assert hedge_delay(DERIVED, clock, 16 * MiB) == pytest.approx(3 * expected)


def test_uniform_slowness_scales_every_yardstick():
    """Every read 10x slower (a congested link): the delay is 10x longer, so the same
    reads relative to their peers are hedged, and none of the uniform ones."""
    fast, ft = _clock()
    slow, st = _clock()
    for clock, t, k in ((fast, ft, 1.0), (slow, st, 10.0)):
        _answers(clock, t, 8, 0.02 * k)
        for _ in range(8):
            clock.finished(0.1 * k, 8 * MiB, 0.08 * k)
    for waiting in (False, True):
        f = hedge_delay(DERIVED, fast, 8 * MiB, waiting_since=ft.t - 1 if waiting else None)
        s = hedge_delay(DERIVED, slow, 8 * MiB, waiting_since=st.t - 1 if waiting else None)
        assert f is not None and s is not None
        assert s == pytest.approx(10 * f)
        # a uniform read's answer begins (0.2 s) and it ends (1 s) well inside the delay
        assert 2 * (0.2 if waiting else 1.0) < s


def test_explicit_floor_keeps_the_fixed_rules():
    clock, _ = _clock()
    fixed = LoadOptions(hedge_min_delay=0.25).hedge_policy
    assert hedge_delay(fixed, clock, 8 * MiB) == pytest.approx(HEDGE_COLD_FACTOR * 0.25)
    for _ in range(10):
        clock.finished(0.5, 8 * MiB, 0.45)
    assert hedge_delay(fixed, clock, 8 * MiB) == pytest.approx(1.5)


def test_stream_rates_come_from_large_reads_only():
    clock, _ = _clock()
    for _ in range(10):
        clock.finished(0.02, 64 << 10, 0.0001)  # probes: their time is latency, not transfer
    assert len(clock.stream_rates) == 0
    clock.finished(0.1, 1 * MiB, None)  # a store that does not tell when the answer began
    assert len(clock.stream_rates) == 0
    clock.finished(0.1, 1 * MiB, 0.05)
    assert list(clock.stream_rates) == [pytest.approx(20 * MiB)]


# --- the attempt: requests that tell when their answer begins ---------------------------------


def test_a_request_without_an_answer_is_hedged_once_its_peers_answered():
    """In process, no network: one request of 12 never answers (until cancelled), the
    others answer at once; the stalled one is hedged and its duplicate wins."""
    stats = StatsRecorder()
    clock = LoadClock()
    policy = LoadOptions().hedge_policy
    retry = LoadOptions(timeout=30, retries=0).retry_policy
    calls: list[int] = []

    async def main() -> list[bytes]:
        async def op(i: int) -> bytes:
            calls.append(i)
            if i == 0 and calls.count(0) == 1:
                await asyncio.sleep(60)  # the stalled GET: no answer
            first_byte()
            await asyncio.sleep(0)
            return bytes([i])

        async def read(i: int) -> bytes:
            await asyncio.sleep(0.001 * i)  # requests start one after the other
            return await call_with_retry(
                lambda: op(i),
                retry=retry,
                stats=stats,
                clock=clock,
                url=f"mem://{i}",
                byte_range=(0, 1),
                hedge=policy,
            )

        return await asyncio.gather(*(read(i) for i in range(12)))

    got = asyncio.run(asyncio.wait_for(main(), 20))
    assert got == [bytes([i]) for i in range(12)]
    assert stats.snapshot().hedges == 1 and calls.count(0) == 2
    assert clock.hedges_in_flight == 0
    assert len(clock.first_bytes) == 12  # the duplicate's answer, not the stalled request's


# --- loads behind the FaultProxy --------------------------------------------------------------


@pytest.fixture(scope="module")
def many_chunks(tmp_path_factory):
    """2 MiB in 32 records of 64 KiB: many data requests after the first ones."""
    sd = {f"t{i}": random_tensor((128, 128), torch.float32, 300 + i) for i in range(32)}
    return make_checkpoint(tmp_path_factory.mktemp("floor") / "ckpt", sd), sd


OPTS = LoadOptions(
    chunk_size=64 << 10, min_chunk_size=8 << 10, timeout=10.0, retries=2, backoff=0.02
)
DATA = {"path": ".distcp", "range_only": True, "data_only": True}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["fsspec", "wire"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_gets_are_hedged_under_the_derived_floor(
    request, backend, transport, many_chunks, bucket_name, fault_proxy
):
    path, sd = many_chunks
    r = make_remote(request, backend, path, bucket_name, fault_proxy, latency=0.005)
    rule = r.proxy.add_rule(stall(5.0), times=2, **DATA)
    dst = zeros_like_tree(sd)
    with no_unclosed_session_warnings():
        stats = asyncload.load(
            dst,
            r.url,
            options=OPTS.replace(transport=transport),
            storage_options=r.storage_options,
        )
    assert_bitwise_equal(dst, sd)
    assert rule.fired == 2
    assert stats.hedges >= 2 and stats.retries == 0 and stats.timeouts == 0
    log = r.proxy.log
    for stalled in [e for e in log if e.rule is rule]:  # each stalled range was asked for again
        assert sum(1 for e in log if (e.path, e.range) == (stalled.path, stalled.range)) >= 2
    assert wait_closed(r.proxy.port) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["s3", "http"])
def test_a_uniformly_slow_link_hedges_nothing(
    request, backend, many_chunks, bucket_name, fault_proxy
):
    """60 ms per round trip and 8 MiB/s shared by every request: each read is slow, none
    is a straggler among its peers."""
    path, sd = many_chunks
    r = make_remote(
        request, backend, path, bucket_name, fault_proxy, latency=0.03, bandwidth=8 * MiB
    )
    dst = zeros_like_tree(sd)
    stats = asyncload.load(
        dst, r.url, options=OPTS.replace(transport="wire"), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)
    assert stats.hedges == 0, stats
