"""The engine's read loop (``engine/read_loop.read_chunks``, used by safe_open and the
torch-checkpointing integration) against real stores: bit-exact bytes, its bounds counted in
the storage's statistics, the first failure raised as that read's own typed error, and the
read slots of the formats' probes (a Meter of reads)."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Any

import pytest
from _ckpt import open_fds_under

from asyncload import CheckpointFormatError, LoadOptions
from asyncload.common.stats import StatsRecorder
from asyncload.engine import Meter, read_chunks, resolve_config
from asyncload.engine.chunks import Chunk, Piece
from asyncload.engine.read_loop import SMALL_READ, group_chunks, probe_slots
from asyncload.storage import LocalStorage, RetryingStorage, open_storage

pytestmark = pytest.mark.timeout(60)


def _chunks(dest: bytearray, spans: list[tuple[int, int]], gap_every: int = 0) -> list[Chunk]:
    """A chunk per ``[lo, hi)`` of ``f.bin`` into the same bytes of ``dest``; every
    ``gap_every``-th one with a 16-byte gap in the middle (read and dropped: not tiled)."""
    mv = memoryview(dest)
    out = []
    for i, (lo, hi) in enumerate(spans):
        if gap_every and i % gap_every == 0 and hi - lo > 64:
            mid = (lo + hi) // 2
            pieces = [
                Piece("f.bin", lo, mid, into=mv[lo:mid]),
                Piece("f.bin", mid + 16, hi, into=mv[mid + 16 : hi]),
            ]
        else:
            pieces = [Piece("f.bin", lo, hi, into=mv[lo:hi])]
        out.append(Chunk("f.bin", lo, hi, pieces))
    return out


def _spans(size: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, pos, i = [], 0, 0
    while pos < size:
        n = min(sizes[i % len(sizes)], size - pos)
        out.append((pos, pos + n))
        pos, i = pos + n, i + 1
    return out


def _expected(data: bytes, chunks: list[Chunk]) -> bytes:
    want = bytearray(len(data))
    for c in chunks:
        for p in c.segments:
            want[p.start : p.end] = data[p.start : p.end]
    return bytes(want)


@pytest.mark.asyncio
@pytest.mark.parametrize("max_in_flight", [1, 3, 16])
async def test_local_chunks_are_read_bit_exact_within_the_bounds(
    tmp_path: Path, max_in_flight: int
) -> None:
    data = os.urandom(3 << 20)
    (tmp_path / "f.bin").write_bytes(data)
    budget = 512 << 10
    # small chunks (read in batches), large ones alone, some with a gap (read, then copied)
    spans = _spans(len(data), [4096, 300 << 10, 100, 70 << 10, 12345])
    rec = StatsRecorder()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        storage = RetryingStorage.for_options(
            LocalStorage(str(tmp_path), ex), LoadOptions(), rec, ex
        )
        dest = bytearray(len(data))
        chunks = _chunks(dest, spans, gap_every=4)
        assert any(len(g) > 1 for g in group_chunks(storage, chunks, budget))
        await read_chunks(storage, chunks, memory_budget=budget, max_in_flight=max_in_flight)
        await storage.aclose()
    assert bytes(dest) == _expected(data, chunks)
    s = rec.snapshot()
    assert s.bytes_read == len(data)
    assert 1 <= s.peak_concurrency <= max_in_flight
    assert 0 < s.peak_buffered_bytes <= budget
    assert open_fds_under(tmp_path) == []


@pytest.mark.asyncio
async def test_a_chunk_larger_than_the_budget_is_read_alone(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    (tmp_path / "f.bin").write_bytes(data)
    rec = StatsRecorder()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        storage = RetryingStorage.for_options(
            LocalStorage(str(tmp_path), ex), LoadOptions(), rec, ex
        )
        dest = bytearray(len(data))
        chunks = _chunks(dest, [(0, 100 << 10), (100 << 10, 1 << 20)])
        await read_chunks(storage, chunks, memory_budget=256 << 10, max_in_flight=8)
        await storage.aclose()
    assert bytes(dest) == data
    s = rec.snapshot()
    assert s.peak_buffered_bytes == (1 << 20) - (100 << 10)  # the large one, alone
    assert s.peak_concurrency == 1  # it waited for the small one to land


@pytest.mark.asyncio
async def test_the_first_failure_is_raised_as_that_reads_error(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    (tmp_path / "f.bin").write_bytes(data[: (2 << 20) - 1000])  # truncated under the plan
    opts = LoadOptions(retries=1)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        storage = RetryingStorage.for_options(
            LocalStorage(str(tmp_path), ex), opts, StatsRecorder(), ex
        )
        dest = bytearray(len(data))
        chunks = _chunks(dest, _spans(len(data), [128 << 10]))
        with pytest.raises(CheckpointFormatError) as ei:
            await read_chunks(storage, chunks, memory_budget=1 << 20, max_in_flight=4)
        await storage.aclose()
    msg = str(ei.value)
    # the read that failed, named: the last chunk of 128 KiB, [1.875 MiB, 2 MiB)
    assert "f.bin" in msg and f"bytes [{15 << 17}, {2 << 20})" in msg, msg
    assert open_fds_under(tmp_path) == []


@pytest.mark.asyncio
async def test_remote_chunks_are_read_one_by_one_bit_exact(http_server: Any) -> None:
    data = os.urandom(1 << 20)
    root = http_server.root / "bkt" / "rl"
    root.mkdir(parents=True, exist_ok=True)
    (root / "f.bin").write_bytes(data)
    rec = StatsRecorder()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        raw = open_storage(http_server.url("bkt", "rl"), http_server.storage_options(), ex)
        storage = RetryingStorage.for_options(raw, LoadOptions(), rec, ex)
        dest = bytearray(len(data))
        chunks = _chunks(dest, _spans(len(data), [1000, 200 << 10]), gap_every=3)
        assert not storage.supports_readinto  # one request per chunk: no batches
        assert group_chunks(storage, chunks, 1 << 20) == [[c] for c in chunks]
        await read_chunks(storage, chunks, memory_budget=1 << 20, max_in_flight=4)
        await storage.aclose()
    assert bytes(dest) == _expected(data, chunks)
    s = rec.snapshot()
    assert s.bytes_read == len(data) and 1 <= s.peak_concurrency <= 4


def test_probe_slots_are_a_meter_of_max_in_flight_reads() -> None:
    slots = probe_slots(resolve_config(LoadOptions(concurrency=5)))
    assert isinstance(slots, Meter)
    assert (slots.capacity, slots.unit, slots.used) == (5, "reads", 0)
    assert probe_slots(resolve_config(LoadOptions(concurrency="auto"))).capacity == 64
    assert SMALL_READ == 64 * 1024
