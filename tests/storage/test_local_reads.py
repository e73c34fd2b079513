"""LocalStorage's read path (asyncload/storage/local.py): positional reads (``os.preadv``) from
a thread pool straight into caller memory, several destination buffers per read. Bit-exact
at unaligned starts and ends and at a file's tail, with the page cache warm and cold; a file
shorter than the read is the typed short read of a local file (a truncated checkpoint), the
same warm or cold; tmpfs reads the same.

A file is made cold for real: ``fsync`` then ``POSIX_FADV_DONTNEED`` (which drops a file's
clean pages, no root needed). An ``O_DIRECT`` path and readahead hints were measured and not
kept (docs/performance.md, "Cold page cache").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, evict_pages, resident_pages

import asyncload
from asyncload import CheckpointFormatError, CheckpointNotFoundError, LoadOptions
from asyncload.common.stats import StatsRecorder
from asyncload.storage import (
    BATCH_INLINE,
    INLINE_READ,
    LocalStorage,
    RetryingStorage,
    ShortReadError,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]

MiB = 1 << 20
PIECE = 4 * MiB  # sizes around it: pieces of a read that cross several destination buffers


class _CountingPool(concurrent.futures.ThreadPoolExecutor):
    """Counts the jobs given to the I/O threads."""

    def __init__(self) -> None:
        super().__init__(2)
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


async def _counted_reads(root: Path, reads: list[tuple[str, int, list[bytearray]]]) -> int:
    """Run ``reads`` (name, start, buffers) one after the other; the jobs the I/O threads got."""
    pool = _CountingPool()
    st = LocalStorage(str(root), pool)
    try:
        for name, start, bufs in reads:
            await st.readinto(name, start, [memoryview(b) for b in bufs])
    finally:
        await st.aclose()
        pool.shutdown()
    return pool.jobs


def test_small_reads_from_the_page_cache_need_no_io_thread(tmp_path: Path) -> None:
    """A read of at most INLINE_READ bytes lands on the loop thread when its pages are cached
    (``RWF_NOWAIT``); pages that are not go to an I/O thread, from the first missing one on;
    a larger read always does. Bit-exact whichever way."""
    # the cache may hold the file in folios of up to 2 MiB, and eviction drops only whole ones:
    # the uncached part starts at a 2 MiB boundary
    edge = 2 << 20
    data = random.Random(5).randbytes(edge + INLINE_READ)
    (tmp_path / "f").write_bytes(data)
    # the first 2 MiB are cached since they were written; the last INLINE_READ bytes leave the
    # cache (not on tmpfs). Checked with mincore: a probing read could start readahead.
    assert evict_pages(tmp_path / "f", edge)
    assert resident_pages(tmp_path / "f", 0, edge) == edge // mmap.PAGESIZE
    assert resident_pages(tmp_path / "f", edge, INLINE_READ) == 0
    cached = [("f", 100, [bytearray(5000), bytearray(1), bytearray(60_000)])]
    assert asyncio.run(_counted_reads(tmp_path, cached)) == 0
    assert bytes(b"".join(cached[0][2])) == data[100:65101]
    # cached, then not: the rest goes to an I/O thread. The kernel may itself read the missing
    # pages within the RWF_NOWAIT call (its readahead on a fast disk), and then nothing is left
    # for a thread; so evicted again and read again until a read found them missing.
    jobs = []
    for _ in range(20):
        assert evict_pages(tmp_path / "f", edge)
        across = [("f", edge - 10_000, [bytearray(7), bytearray(30_000)])]
        jobs.append(asyncio.run(_counted_reads(tmp_path, across)))
        assert bytes(b"".join(across[0][2])) == data[edge - 10_000 : edge + 20_007]
        if jobs[-1]:
            break
    assert jobs[-1] == 1, jobs
    large = [("f", 0, [bytearray(INLINE_READ + 1)])]
    assert asyncio.run(_counted_reads(tmp_path, large)) == 1
    assert bytes(large[0][2][0]) == data[: INLINE_READ + 1]


async def _counted_batch(
    root: Path, reads: list[tuple[str, int, int]]
) -> tuple[int, list[tuple[bytes, bool]]]:
    """``RetryingStorage.read_batch`` of ``reads`` (name, start, end): the jobs the I/O threads
    got, and each read's bytes with whether they were delivered on the calling thread."""
    pool = _CountingPool()
    st = RetryingStorage.for_options(
        LocalStorage(str(root), pool), LoadOptions(), StatsRecorder(), pool
    )
    got: list[tuple[bytes, bool]] = []

    def deliver(mv: memoryview) -> None:
        got.append((bytes(mv), threading.current_thread() is threading.main_thread()))

    try:
        await st.read_batch([(name, start, end, deliver) for name, start, end in reads])
    finally:
        await st.aclose()
        pool.shutdown()
    return pool.jobs, got


def test_a_batch_of_cached_reads_needs_no_io_thread(tmp_path: Path) -> None:
    """The probes and small records of a load (one ``read_batch``): reads the page cache holds
    land on the loop thread, up to BATCH_INLINE bytes; from the first that is not (an evicted
    page, or past the bound) the rest go to one I/O thread job, in order. Each read is
    delivered once, bit-exact."""
    cold = 2 * MiB  # the cache holds a file in large folios: evicted from a 2 MiB boundary on
    assert cold > BATCH_INLINE + INLINE_READ
    data = random.Random(6).randbytes(cold + MiB)
    (tmp_path / "f").write_bytes(data)
    assert evict_pages(tmp_path / "f", cold)
    cached = [("f", 0, 4096), ("f", 100, 70_000), ("f", 5, 6)]
    jobs, got = asyncio.run(_counted_batch(tmp_path, cached))
    assert jobs == 0
    assert got == [(data[s:e], True) for _, s, e in cached]
    then_cold = [("f", 10, 5000), ("f", cold + 3, cold + 9000), ("f", 0, 100)]
    for _ in range(20):  # until the kernel did not read the evicted pages within RWF_NOWAIT
        assert evict_pages(tmp_path / "f", cold)
        jobs, got = asyncio.run(_counted_batch(tmp_path, then_cold))
        if jobs:
            break
    assert jobs == 1
    assert got == [
        (data[10:5000], True),
        (data[cold + 3 : cold + 9000], False),
        (data[:100], False),
    ]
    # cached, but more than BATCH_INLINE bytes in all: the reads past the bound go to a thread
    many = [
        ("f", i * (INLINE_READ // 2), (i + 1) * (INLINE_READ // 2))
        for i in range(2 * BATCH_INLINE // INLINE_READ + 1)
    ]
    jobs, got = asyncio.run(_counted_batch(tmp_path, many))
    inline = BATCH_INLINE // (INLINE_READ // 2)
    assert jobs == 1
    assert got == [(data[s:e], i < inline) for i, (_, s, e) in enumerate(many)]


def test_a_local_files_size_and_fingerprint_are_asked_once_without_tasks(tmp_path: Path) -> None:
    """``size`` and ``fingerprint`` of a local file are a ``stat`` on the loop thread: the error
    boundary runs them as they are (no task, no timeout that could not fire anyway); an
    error still comes out of the boundary typed, after its attempts."""
    (tmp_path / "f").write_bytes(b"x" * 1234)

    async def run() -> tuple[int, object, int, int, CheckpointNotFoundError]:
        loop = asyncio.get_running_loop()
        made = [0]

        def factory(loop: asyncio.AbstractEventLoop, coro, **kw):  # type: ignore[no-untyped-def]
            made[0] += 1
            return asyncio.Task(coro, loop=loop, **kw)

        pool = _CountingPool()
        st = RetryingStorage.for_options(
            LocalStorage(str(tmp_path), pool), LoadOptions(retries=2), StatsRecorder(), pool
        )
        loop.set_task_factory(factory)
        try:
            size, fp = await st.size("f"), await st.fingerprint("f")
            quiet = made[0]
            with pytest.raises(CheckpointNotFoundError) as ei:
                await st.size("missing")
            return size, fp, quiet, made[0], ei.value
        finally:
            loop.set_task_factory(None)
            await st.aclose()
            pool.shutdown()

    size, fp, quiet, after, err = asyncio.run(run())
    st = os.stat(tmp_path / "f")
    assert (size, fp) == (1234, (1234, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    assert quiet == 0  # the two stats made no task
    assert after >= 1  # the missing file went through the boundary's attempts
    assert "missing" in str(err)


def test_a_small_read_past_the_end_names_the_whole_range(tmp_path: Path) -> None:
    """The cached part lands inline, the I/O thread finds the end: the error is about the read
    as asked, with every byte that was there."""
    (tmp_path / "f").write_bytes(b"x" * 10_000)
    with pytest.raises(ShortReadError) as ei:
        asyncio.run(_counted_reads(tmp_path, [("f", 4000, [bytearray(3000), bytearray(9000)])]))
    assert (ei.value.start, ei.value.end, ei.value.got) == (4000, 16_000, 6000)


def _scatter(rnd: random.Random, n: int) -> list[bytearray]:
    """``n`` bytes of destination in pieces of odd sizes (several tensors of one read)."""
    parts, left = [], n
    while left:
        k = min(left, rnd.choice([1, 7, 4095, 4097, 300_001, PIECE - 3, PIECE + 5, 3 * MiB]))
        parts.append(bytearray(k))
        left -= k
    return parts


@pytest.mark.parametrize("cold", [False, True])
def test_reads_are_bit_exact_at_unaligned_starts_ends_and_the_tail(
    tmp_path: Path, storage: LocalStorage, cold: bool
) -> None:
    size = 3 * PIECE + 187  # the tail is not a multiple of a block or page
    data = os.urandom(size)
    f = tmp_path / "f"
    f.write_bytes(data)
    rnd = random.Random(7)
    cases = [
        (0, PIECE),  # aligned both ends
        (1, PIECE + 1),  # one byte in
        (4095, PIECE + 2),  # one byte before a page boundary
        (size - PIECE - 5, PIECE + 5),  # up to the unaligned end of the file
        (0, size),  # the whole file
        (size - 1, 1),  # its last byte
        (PIECE - 1, PIECE + 2),
    ]
    cases += [
        (s, rnd.randrange(1, size - s + 1)) for s in (rnd.randrange(0, size) for _ in range(8))
    ]
    for start, n in cases:
        if cold:
            evict_pages(f)
        parts = _scatter(rnd, n)
        storage.readinto_sync("f", start, [memoryview(p) for p in parts])
        assert b"".join(parts) == data[start : start + n], (start, n)
        got = asyncio.run(storage.read("f", start, start + n))
        assert got == data[start : start + n], (start, n)


@pytest.mark.parametrize("cold", [False, True])
def test_a_read_past_the_end_is_the_short_read_of_a_local_file(
    tmp_path: Path, storage: LocalStorage, cold: bool
) -> None:
    size = 2 * PIECE + 1001
    data = os.urandom(size)
    f = tmp_path / "f"
    f.write_bytes(data)
    if cold:
        evict_pages(f)
    start, n = 513, size  # asks for 513 bytes more than the file holds
    buf = bytearray(n)
    with pytest.raises(ShortReadError) as err:
        storage.readinto_sync("f", start, [memoryview(buf)])
    assert (
        err.value.local
        and err.value.got == size - start
        and (err.value.start, err.value.end) == (start, start + n)
    )
    assert buf[: size - start] == data[start:]  # what the file holds was delivered


def test_tmpfs_reads_the_same() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    d = shm / f"asyncload-test-{os.getpid()}"
    d.mkdir()
    ex = concurrent.futures.ThreadPoolExecutor(2)
    st = LocalStorage(str(d), ex)
    try:
        data = os.urandom(PIECE + 12345)
        (d / "f").write_bytes(data)
        evict_pages(d / "f")  # a no-op on tmpfs: its pages are the file
        parts = _scatter(random.Random(1), len(data) - 11)
        st.readinto_sync("f", 11, [memoryview(p) for p in parts])
        assert b"".join(parts) == data[11:]
        with pytest.raises(ShortReadError):
            st.readinto_sync("f", 11, [memoryview(bytearray(len(data)))])
    finally:
        asyncio.run(st.aclose())
        ex.shutdown()
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


@pytest.fixture
def big_ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    sd = {
        "big": torch.randn(3 * PIECE // 4 + 13, generator=g),  # ~3 pieces, odd length
        "bf16": torch.randn(1537, 1031, generator=g).to(torch.bfloat16),  # ~3 MiB
        "small": torch.arange(100, dtype=torch.int32),
        "f64": torch.randn(301, 2011, generator=g, dtype=torch.float64),  # ~4.6 MiB
    }
    path = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path, sd


@pytest.mark.parametrize("verify", [False, True])
def test_a_cold_load_is_bit_exact(
    big_ckpt: tuple[Path, dict[str, torch.Tensor]], verify: bool
) -> None:
    path, sd = big_ckpt
    for f in path.iterdir():
        evict_pages(f)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    opts = LoadOptions(chunk_size=8 * MiB, verify=verify)
    asyncload.load(dest, path, options=opts)
    assert_bitwise_equal(dest, sd)


def test_a_file_truncated_under_a_cold_load_is_a_format_error(
    big_ckpt: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """The file shrinks under a cold load, after its size was checked: the short local
    read is the truncated file it is (CheckpointFormatError), as with a warm cache
    (tests/engine/test_integrity.py)."""
    path, sd = big_ckpt
    (data,) = path.glob("*.distcp")
    evict_pages(data)
    state = {"cut": False}

    def progress(done: int, total: int) -> None:
        if not state["cut"]:
            state["cut"] = True
            os.truncate(data, os.path.getsize(data) // 3)

    opts = LoadOptions(chunk_size=8 * MiB, concurrency=1, retries=3, backoff=5.0)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        asyncload.load(
            {k: torch.zeros_like(v) for k, v in sd.items()}, path, options=opts, progress=progress
        )
    assert state["cut"]
