"""``load --compare-torch``: the same checkpoint through torch's own readers
(:func:`load_with_torch`), timed beside asyncload's load, and compared bit for bit
(:func:`same_bits`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from asyncload.storage import is_local, local_root


class _TorchProgressPlanner:
    """torch's DefaultLoadPlanner that reports committed bytes (for a bar over torch's load)."""

    def __new__(cls, on_bytes: Callable[[int], None]) -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class Planner(DefaultLoadPlanner):
            def commit_tensor(self, read_item: Any, tensor: Any) -> None:
                super().commit_tensor(read_item, tensor)
                on_bytes(tensor.numel() * tensor.element_size())

        return Planner()


def torch_reader(url: str, storage_options: dict[str, Any]) -> Any:
    """torch's own reader for ``url``: FileSystemReader for local paths, FsspecReader otherwise."""
    if is_local(url):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(local_root(url))
    try:
        from torch.distributed.checkpoint import FsspecReader  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    return FsspecReader(url, **storage_options)


def load_with_torch(
    url: str,
    dest: dict[str, Any],
    storage_options: dict[str, Any],
    on_bytes: Callable[[int], None] | None = None,
) -> float:
    """``dcp.load`` with torch's own reader into ``dest``; returns the wall seconds (from the
    call to its end: ``.metadata`` read, planning and the data, as :func:`load_timed` times
    asyncload). torch's warning that it loads without a process group is not shown: one
    process is what this command means."""
    import warnings

    import torch.distributed.checkpoint as dcp

    planner = _TorchProgressPlanner(on_bytes) if on_bytes is not None else None
    reader = torch_reader(url, storage_options)
    with warnings.catch_warnings():  # this call's warning only, on this (the only) thread
        warnings.filterwarnings("ignore", message=_TORCH_SINGLE_PROCESS, category=UserWarning)
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)
        return time.perf_counter() - t0


#: The start of the warning torch gives for every load without a process group.
_TORCH_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def load_timed(
    url: str,
    dest: dict[str, Any],
    options: Any,
    storage_options: dict[str, Any],
    progress: Any = None,
) -> tuple[Any, float]:
    """``asyncload.load`` into ``dest`` (allocated before); its stats and the wall seconds,
    timed as :func:`load_with_torch` times torch."""
    from asyncload.faces.api import load

    t0 = time.perf_counter()
    stats = load(dest, url, options=options, storage_options=storage_options, progress=progress)
    return stats, time.perf_counter() - t0


def warm_local_files(url: str, names: list[str]) -> None:
    """Read the files ``names`` of the local checkpoint ``url`` once, outside every clock, so
    that the loads compared start from the same (warm) page cache."""
    if not is_local(url):
        return
    root = local_root(url)
    buf = bytearray(8 << 20)
    for name in names:
        try:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        except OSError:  # the loads will say what is wrong with it
            pass


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (tensors compared bit for bit, objects with ``==``)."""
    import torch

    bad = []
    for k, va in a.items():
        vb = b.get(k)
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            if (
                va.dtype != vb.dtype
                or va.shape != vb.shape
                or not torch.equal(
                    va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8)
                )
            ):
                bad.append(k)
        elif va != vb:
            bad.append(k)
    return bad
