"""Shared test helpers: checkpoints written by torch's own ``dcp.save``, and exact comparisons.

Import from a test module as ``from _ckpt import make_checkpoint, zeros_like_tree, assert_bitwise_equal``
(pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

__all__ = [
    "SAVEABLE_DTYPES",
    "assert_bitwise_equal",
    "asyncload_threads",
    "copy_dir_to_fsspec",
    "float8_dtypes",
    "iter_tensors",
    "live_threads",
    "make_checkpoint",
    "open_fds_under",
    "random_tensor",
    "small_state_dict",
    "tensor_bytes",
    "total_tensor_bytes",
    "zeros_like_tree",
]


def make_checkpoint(
    path: str | os.PathLike[str], state_dict: dict[str, Any], **dcp_save_kwargs: Any
) -> Path:
    """Write ``state_dict`` with torch's own ``dcp.save`` (single process) to ``path``; return the path.

    Extra keyword arguments go to ``dcp.save`` (e.g. ``storage_writer=FileSystemWriter(path,
    single_file_per_rank=False)``). Without a ``storage_writer``, ``path`` is the checkpoint id.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = dict(dcp_save_kwargs)
    if "storage_writer" not in kwargs:
        kwargs["checkpoint_id"] = path
    kwargs.setdefault("no_dist", True)
    with (
        warnings.catch_warnings()
    ):  # also outside pytest (child scripts): torch's single-process note
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        dcp.save(state_dict, **kwargs)
    assert (path / ".metadata").is_file(), f"dcp.save wrote no .metadata in {path}"
    return path


_KEEP: Any = object()


def zeros_like_tree(obj: Any, *, object_placeholder: Any = _KEEP) -> Any:
    """The same tree with every tensor replaced by zeros of its shape and dtype (fresh,
    contiguous memory). Non-tensor leaves are kept, or replaced by ``object_placeholder``
    when one is given (so a test can see that the load really put the saved object back)."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {
            k: zeros_like_tree(v, object_placeholder=object_placeholder) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [zeros_like_tree(v, object_placeholder=object_placeholder) for v in obj]
    if isinstance(obj, tuple):
        return tuple(zeros_like_tree(v, object_placeholder=object_placeholder) for v in obj)
    return obj if object_placeholder is _KEEP else object_placeholder


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes in row-major order (any dtype, any layout)."""
    if t.numel() == 0:
        return b""
    # a fresh tensor has standard strides (``contiguous()`` may keep odd strides of size-1 dims)
    c = torch.empty((t.numel(),), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))
    return c.view(torch.uint8).numpy().tobytes()


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Every tensor equal in dtype, shape and every bit (NaN payloads and -0.0 included);
    every other leaf equal with ``==``; containers of the same type and keys."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (
            f"{where}: {type(a)} vs {type(b)}"
        )
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), (
            f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        )
        ba, bb = tensor_bytes(a), tensor_bytes(b)
        if ba != bb:
            n = next(i for i, (x, y) in enumerate(zip(ba, bb)) if x != y)
            raise AssertionError(f"{where}: tensors differ, first at byte {n} of {len(ba)}")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b)}"
        assert list(a.keys()) == list(b.keys()) or set(a) == set(b), (
            f"{where}: keys {sorted(a)} != {sorted(b)}"
        )
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}" if where else str(k))
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}.{i}")


def total_tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(obj))


def float8_dtypes() -> list[torch.dtype]:
    names = (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


SAVEABLE_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    *float8_dtypes(),
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    *[getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)],
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (every bit pattern, NaNs included for floats), except bool (0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).reshape(shape)
    isz = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * isz,), dtype=torch.int64, generator=g).to(torch.uint8)
    return raw.view(dtype).reshape(shape).clone()


def small_state_dict(seed: int = 0) -> dict[str, Any]:
    """~1.3 MiB in several records of several dtypes, nested dicts and objects."""
    return {
        "w": random_tensor((256, 512), torch.float32, seed),  # 512 KiB
        "emb": random_tensor((300, 700), torch.bfloat16, seed + 1),  # ~410 KiB
        "layers": {
            "0": {
                "norm": random_tensor((512,), torch.float16, seed + 2),
                "q": random_tensor((128, 256), torch.int8, seed + 3),
            }
        },
        "mask": random_tensor((1000,), torch.bool, seed + 4),
        "c": random_tensor((64, 64), torch.complex64, seed + 5),
        "step": 4000,
        "name": "run7",
    }


def copy_dir_to_fsspec(local_dir: str | os.PathLike[str], fs: Any, root: str) -> None:
    """Copy every file of ``local_dir`` (recursively) to ``root`` on fsspec filesystem ``fs``."""
    local_dir = Path(local_dir)
    for p in sorted(local_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(local_dir).as_posix()
            fs.pipe_file(f"{root.rstrip('/')}/{rel}", p.read_bytes())


def resident_pages(path: str | os.PathLike[str], start: int, n: int) -> int:
    """How many of ``path``'s pages in ``[start, start + n)`` the page cache holds, by
    ``mincore`` over a private mapping that is never touched: unlike a probing read (even one
    with ``RWF_NOWAIT``), asking starts no readahead."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    first = start - start % page
    length = start + n - first
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, length, offset=first, access=mmap.ACCESS_COPY) as m:
            vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec)
    finally:
        os.close(fd)


def evict_pages(path: str | os.PathLike[str], start: int = 0, n: int = 0) -> bool:
    """Drop ``path``'s pages of ``[start, start + n)`` (``n=0``: to the end) from the page
    cache (written back first; a no-op on tmpfs). The cache may hold a file in large folios,
    and a folio the range covers only in part stays: start at a 2 MiB boundary. The kernel
    sometimes keeps pages one ``POSIX_FADV_DONTNEED`` asked it to drop, so it is asked again
    until the page at ``start`` is gone (up to 100 times); whether it is gone is returned."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        for _ in range(100):
            os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
            if start >= size or resident_pages(path, start, 1) == 0:
                return True
        return False
    finally:
        os.close(fd)


def open_fds_under(directory: str | os.PathLike[str]) -> list[str]:
    """Paths under ``directory`` that this process holds open (from /proc/self/fd)."""
    from asyncload.testing.interrupts import open_files_under

    return open_files_under(directory)


def live_threads(prefix: str = "asyncload-") -> set[Any]:
    """The live threads whose name starts with ``prefix`` (thread objects, not names: two
    executors may both have an ``asyncload-io_0``)."""
    import threading

    return {t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()}


def asyncload_threads(
    prefix: str = "asyncload-io", *, ignore: set[Any] | frozenset[Any] = frozenset()
) -> list[str]:
    """Names of live threads starting with ``prefix``, except those in ``ignore`` (a
    :func:`live_threads` snapshot taken before the code under test ran)."""
    return sorted(t.name for t in live_threads(prefix) if t not in ignore)


#: asyncload threads alive before the current test (left by other tests, if any): not ours to judge
THREADS_BEFORE: set = set()


@pytest.fixture(autouse=True)
def thread_baseline():
    """Autouse in the modules that import it: records :data:`THREADS_BEFORE` for the test."""
    THREADS_BEFORE.clear()
    THREADS_BEFORE.update(live_threads("asyncload-"))
    yield
