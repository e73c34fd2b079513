"""Local reads the kernel's copy would alias (a destination 1-31 bytes past its file offset
modulo 4096) copied out of the page cache through leased mappings (asyncload/storage/mapped.py):
only those reads are mapped; bit-exact at unaligned offsets, across windows and several
destination buffers; a window with a page not in the cache, a file open for writing, a read
past the end of the file and a program that handles SIGURG all fall back to ``preadv``; a
writer that arrives while a window is being copied waits for that window only, and the read
then ends in the typed short read; loads racing a process that truncates and rewrites the
file never crash (a mapping read past the end of a file would be SIGBUS) and are exact
whenever they succeed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import fcntl
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, evict_pages

import asyncload
from asyncload import AsyncLoadError, LoadOptions
from asyncload.storage import LocalStorage, ShortReadError
from asyncload.storage import mapped as _mapped

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]

MiB = 1 << 20

if _mapped.mapped_copies_available() is not None:  # pragma: no cover - not this machine
    pytest.skip(
        f"no mapped copies here: {_mapped.mapped_copies_available()}", allow_module_level=True
    )


@pytest.fixture
def always_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every large read counts as aliasing: the lease and window machinery on every read."""
    monkeypatch.setattr(
        _mapped.MappedCopies,
        "aliasing",
        staticmethod(lambda pos, buf: len(buf) >= _mapped.MIN_MAPPED_READ),
    )


def _file(tmp_path: Path, size: int) -> bytes:
    """``size`` random bytes, written to ``tmp_path / "f"``."""
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    return data


def _address(b: bytearray | memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(b))


def _at(n: int, file_offset: int, shift: int) -> tuple[bytearray, memoryview]:
    """``n`` bytes of destination whose address is ``shift`` bytes past ``file_offset``
    modulo 4096 (the bytearray that holds it, and the view)."""
    raw = bytearray(n + 8192)
    k = (file_offset + shift - _address(raw)) % 4096
    return raw, memoryview(raw)[k : k + n]


@pytest.mark.parametrize("shift", [0, 1, 8, 31, 32, 64, 2049, 4095])
def test_only_reads_the_kernel_would_alias_are_mapped(
    tmp_path: Path, storage: LocalStorage, shift: int
) -> None:
    data = _file(tmp_path, 4 * MiB + 99)
    start = 77
    _, view = _at(len(data) - start, start, shift)
    assert _mapped.MappedCopies.aliasing(start, view) == (0 < shift < 32)
    storage.readinto_sync("f", start, [view])
    assert view == data[start:]
    assert storage.mapped_bytes == (len(view) if 0 < shift < 32 else 0)


def test_a_read_into_several_buffers_maps_only_the_aliasing_ones(
    tmp_path: Path, storage: LocalStorage
) -> None:
    data = _file(tmp_path, 6 * MiB)
    sizes = [2 * MiB + 3, 100, 3 * MiB - 3, MiB - 100]  # the second and last too small to map
    shifts = [8, 1, 0, 5]
    views, keep, pos = [], [], 0
    for n, sh in zip(sizes, shifts, strict=True):
        raw, v = _at(n, pos, sh)
        keep.append(raw)
        views.append(v)
        pos += n
    storage.readinto_sync("f", 0, views)
    assert b"".join(bytes(v) for v in views) == data
    assert storage.mapped_bytes == sizes[0]


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch, always_mapped: None) -> int:
    """Windows of an odd size, so that a read of a few MiB is several windows."""
    window = MiB + 4097
    monkeypatch.setattr(_mapped, "WINDOW", window)
    return window


def _cached_pages(path: Path, start: int, n: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _mapped._get_libc().cached_pages(fd, start, n)
    finally:
        os.close(fd)


def _pieces(rnd: random.Random, n: int) -> list[bytearray]:
    parts, left = [], n
    while left:
        k = min(left, rnd.choice([1, 63, 4097, 700_001, MiB + 5, 3 * MiB - 1]))
        parts.append(bytearray(k))
        left -= k
    return parts


def test_warm_reads_are_copied_through_mappings_bit_exact(
    tmp_path: Path, storage: LocalStorage, small_windows: int
) -> None:
    size = 9 * MiB + 187
    data = _file(tmp_path, size)
    rnd = random.Random(11)
    mapped = 0
    for start, n in [
        (0, size),
        (1, 5 * MiB),
        (4095, 3 * MiB + 2),
        (size - 4 * MiB - 3, 4 * MiB + 3),
        (77, MiB),
    ]:
        parts = _pieces(rnd, n)
        before = storage.mapped_bytes
        storage.readinto_sync("f", start, [memoryview(p) for p in parts])
        assert b"".join(parts) == data[start : start + n], (start, n)
        big = sum(len(p) for p in parts if len(p) >= _mapped.MIN_MAPPED_READ)
        assert storage.mapped_bytes - before == big, (start, n)  # every window of them was mapped
        mapped += big
    small = bytearray(_mapped.MIN_MAPPED_READ - 1)
    storage.readinto_sync("f", 3, [memoryview(small)])
    assert small == data[3 : 3 + len(small)]
    assert storage.mapped_bytes == mapped  # a read below MIN_MAPPED_READ is a plain preadv


def test_a_window_with_a_page_not_cached_is_read_with_preadv(
    tmp_path: Path, storage: LocalStorage, small_windows: int
) -> None:
    size = 8 * MiB
    data = _file(tmp_path, size)
    f = tmp_path / "f"
    evict_pages(f, 4 * MiB)  # from inside the fourth window to the end (whole folios)
    if _cached_pages(f, 4 * MiB, 4096) != 0:
        pytest.skip("this file system keeps every page (tmpfs)")
    buf = bytearray(size)
    storage.readinto_sync("f", 0, [memoryview(buf)])
    assert buf == data
    assert storage.mapped_bytes == 3 * small_windows  # the windows before the cold page


def test_a_file_open_for_writing_is_read_with_preadv(
    tmp_path: Path, storage: LocalStorage, caplog: pytest.LogCaptureFixture, always_mapped: None
) -> None:
    data = _file(tmp_path, 4 * MiB + 3)
    f = tmp_path / "f"
    buf = bytearray(len(data) - 5)
    with open(f, "r+b"), caplog.at_level(logging.DEBUG, logger="asyncload.local"):
        storage.readinto_sync("f", 5, [memoryview(buf)])
    assert buf == data[5:]
    assert storage.mapped_bytes == 0
    assert "open for writing" in caplog.text


def test_a_read_past_the_end_maps_what_is_there_then_is_the_typed_short_read(
    tmp_path: Path, storage: LocalStorage, small_windows: int
) -> None:
    size = 5 * MiB + 1001
    data = _file(tmp_path, size)
    start = 513
    buf = bytearray(size)  # 513 bytes more than the file holds from start
    with pytest.raises(ShortReadError) as err:
        storage.readinto_sync("f", start, [memoryview(buf)])
    assert err.value.local and (err.value.start, err.value.end, err.value.got) == (
        start,
        start + size,
        size - start,
    )
    assert buf[: size - start] == data[start:]
    assert storage.mapped_bytes == 4 * small_windows  # the windows inside the file


def test_every_lease_signals_its_break_with_sigurg_not_sigio(
    tmp_path: Path, storage: LocalStorage, small_windows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease's break is signalled to this process; SIGIO (the kernel's default) would end
    it. Letting a lease go resets the file's signal, so every lease, not only a file's
    first, must set SIGURG again (this failed once: a rewrite of the checkpoint during a
    load ended the test process with SIGIO)."""
    data = _file(tmp_path, 4 * MiB)
    real = _mapped._copy_window
    signals: list[tuple[int, int]] = []

    def check(libc: object, fd: int, pos: int, dst: int, n: int) -> bool:
        signals.append((fcntl.fcntl(fd, fcntl.F_GETLEASE), fcntl.fcntl(fd, fcntl.F_GETSIG)))
        return real(libc, fd, pos, dst, n)  # type: ignore[arg-type]

    monkeypatch.setattr(_mapped, "_copy_window", check)
    for start in (0, 7, 4096):  # three reads, each window under a lease of its own
        buf = bytearray(len(data) - start)
        storage.readinto_sync("f", start, [memoryview(buf)])
        assert buf == data[start:]
    assert len(signals) >= 9
    assert set(signals) == {(fcntl.F_RDLCK, signal.SIGURG)}


def test_a_writer_waits_for_the_window_being_copied_only(
    tmp_path: Path, storage: LocalStorage, small_windows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process opens the file for writing (then truncates it) while the first window is
    being copied: the kernel holds it in ``open`` (the lease); another window asked for
    meanwhile is refused (a writer waits), so the file gets no more mappings; the window
    being copied is copied whole; the lease is let go as it ends, the writer goes on, and
    the read ends in the typed short read of what is left of the file."""
    size = 6 * MiB
    data = _file(tmp_path, size)
    f = tmp_path / "f"
    writer = (
        "import os, sys, time\n"
        "t = time.monotonic()\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
        "print(time.monotonic() - t, flush=True)\n"
        "os.ftruncate(fd, 100)\n"
        "os.close(fd)\n"
    )
    copy_window, leave = _mapped._copy_window, _mapped.MappedCopies._leave
    seen: dict[str, object] = {}

    def first_window_meets_a_writer(libc: object, fd: int, pos: int, dst: int, n: int) -> bool:
        if "child" not in seen:
            assert fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK  # held for this window
            seen["child"] = child = subprocess.Popen(
                [sys.executable, "-c", writer, str(f)], stdout=subprocess.PIPE, text=True
            )
            deadline = time.monotonic() + 20
            while fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK:  # until the writer is held
                assert child.poll() is None, "the writer was not held by the lease"
                assert time.monotonic() < deadline, "the writer never asked for the file"
                time.sleep(0.005)
            assert child.poll() is None
            mapped = storage._mapped
            assert mapped is not None
            (lease,) = mapped._leases.values()
            seen["refused"] = not mapped._enter(fd, str(f), lease, pos + 2 * n)
            seen["dead"] = lease.dead
        return copy_window(libc, fd, pos, dst, n)  # type: ignore[arg-type]

    def leave_then_let_the_writer_finish(
        self: _mapped.MappedCopies, fd: int, lease: object
    ) -> None:
        leave(self, fd, lease)  # type: ignore[arg-type]
        child = seen["child"]
        assert isinstance(child, subprocess.Popen)
        child.wait(timeout=30)

    monkeypatch.setattr(_mapped, "_copy_window", first_window_meets_a_writer)
    monkeypatch.setattr(_mapped.MappedCopies, "_leave", leave_then_let_the_writer_finish)
    buf = bytearray(size)
    with pytest.raises(ShortReadError) as err:
        storage.readinto_sync("f", 0, [memoryview(buf)])
    child = seen["child"]
    assert isinstance(child, subprocess.Popen)
    out, _ = child.communicate(timeout=30)
    waited = float(out)
    assert child.returncode == 0 and seen["refused"] and seen["dead"]
    assert waited < 15, f"the writer waited {waited:.1f} s (the lease-break time is 45 s)"
    assert (err.value.start, err.value.end, err.value.got) == (0, size, small_windows)
    assert buf[:small_windows] == data[:small_windows]  # the window copied under the lease
    assert storage.mapped_bytes == small_windows


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    sd = {
        "a": torch.randn(3 * MiB // 4 + 13, generator=g),  # ~3 MiB, odd length
        "b": torch.randn(1537, 1031, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 255, (2 * MiB + 7,), dtype=torch.uint8, generator=g),
        "small": torch.arange(10, dtype=torch.int64),
    }
    path = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path, sd


def test_a_load_copies_through_mappings_and_is_bit_exact(
    ckpt: tuple[Path, dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    always_mapped: None,
) -> None:
    path, sd = ckpt
    copied: list[tuple[int, int]] = []  # (bytes copied, bytes asked for) per buffer
    real = _mapped.MappedCopies.copy

    def spy(self: _mapped.MappedCopies, fd: int, name: str, start: int, buf: memoryview) -> int:
        n = real(self, fd, name, start, buf)
        copied.append((n, len(buf)))
        return n

    monkeypatch.setattr(_mapped.MappedCopies, "copy", spy)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    asyncload.load(dest, path)
    assert_bitwise_equal(dest, sd)
    # every buffer of at least MIN_MAPPED_READ was copied whole through mappings: most of
    # the bytes (the rest: the last pieces of the reads, cut smaller to end together)
    assert copied and all(n == want for n, want in copied)
    big = sum(v.nbytes for k, v in sd.items() if k != "small")
    assert big - 6 * _mapped.MIN_MAPPED_READ < sum(n for n, _ in copied) <= big

    copied.clear()
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    asyncload.load(dest, path, options=LoadOptions(local_mapped_copies=False))
    assert_bitwise_equal(dest, sd)
    assert copied == []


def test_local_mapped_copies_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="local_mapped_copies"):
        LoadOptions(local_mapped_copies="yes")  # type: ignore[arg-type]


def test_a_program_that_handles_sigurg_gets_no_mappings(
    tmp_path: Path, always_mapped: None
) -> None:
    old = signal.signal(signal.SIGURG, lambda *_: None)
    try:
        assert "SIGURG" in (_mapped.mapped_copies_available() or "")
        ex = concurrent.futures.ThreadPoolExecutor(1)
        st = LocalStorage(str(tmp_path), ex)
        data = os.urandom(2 * MiB)
        (tmp_path / "f").write_bytes(data)
        buf = bytearray(len(data))
        st.readinto_sync("f", 0, [memoryview(buf)])
        assert buf == data and st.mapped_bytes == 0
        asyncio.run(st.aclose())
        ex.shutdown()
    finally:
        signal.signal(signal.SIGURG, old)
    assert _mapped.mapped_copies_available() is None


_HAMMER = """
import os, sys, time
path, until = sys.argv[1], float(sys.argv[2])
data = open(path, "rb").read()
n = 0
while time.time() < until:
    os.truncate(path, len(data) // 3)
    with open(path, "r+b") as f:
        f.seek(len(data) // 3)
        f.write(data[len(data) // 3:])
    n += 1
print(n)
"""


def test_loads_racing_a_process_that_truncates_the_file_never_crash(
    ckpt: tuple[Path, dict[str, torch.Tensor]], always_mapped: None
) -> None:
    """Another process truncates the data file to a third and writes it back, over and over,
    while this one loads it: every load either is bit-exact or raises an asyncload error;
    none crashes this process (with a mapping and no lease, a copy past the new end of the
    file is SIGBUS)."""
    path, sd = ckpt
    (data,) = path.glob("*.distcp")
    hammer = subprocess.Popen(
        [sys.executable, "-c", _HAMMER, str(data), str(time.time() + 3.0)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ok = failed = 0
    opts = LoadOptions(retries=0)
    try:
        while hammer.poll() is None:
            dest = {k: torch.zeros_like(v) for k, v in sd.items()}
            try:
                asyncload.load(dest, path, options=opts)
            except AsyncLoadError:
                failed += 1
            else:
                assert_bitwise_equal(dest, sd)
                ok += 1
    finally:
        out, _ = hammer.communicate(timeout=60)
    assert hammer.returncode == 0 and int(out) > 0
    assert ok + failed > 0
