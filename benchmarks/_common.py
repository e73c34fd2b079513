"""Shared pieces of the benchmarks: a transformer-like state dict, peak-RSS measurement."""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def transformer_state_dict(
    total_bytes: int, *, hidden: int = 2048, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Layers of a few large matrices (attention, MLP) and many small norms/biases, ~``total_bytes``."""
    g = torch.Generator().manual_seed(seed)
    item = torch.empty((), dtype=dtype).element_size()
    per_layer = (4 * hidden * hidden + 2 * hidden * 4 * hidden) * item
    layers = max(1, total_bytes // per_layer)
    sd: dict[str, torch.Tensor] = {}
    sd["embed.weight"] = torch.randn(8192, hidden, generator=g).to(dtype)
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            sd[p + f"attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g).to(dtype)
        sd[p + "mlp.up.weight"] = torch.randn(4 * hidden, hidden, generator=g).to(dtype)
        sd[p + "mlp.down.weight"] = torch.randn(hidden, 4 * hidden, generator=g).to(dtype)
        for name in (
            "ln1.weight",
            "ln1.bias",
            "ln2.weight",
            "ln2.bias",
            "attn.o.bias",
            "mlp.down.bias",
        ):
            sd[p + name] = torch.randn(hidden, generator=g).to(dtype)
        sd[p + "mlp.up.bias"] = torch.randn(4 * hidden, generator=g).to(dtype)
    sd["norm.weight"] = torch.randn(hidden, generator=g).to(dtype)
    return sd


def nbytes(sd: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))


def zeros_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destinations made by torch.zeros: memory already touched, like a model's state dict."""
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process (Linux: VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def ensure_bytecode(package_dir: str | None = None) -> None:
    """Write the bytecode of asyncload (or of the package in ``package_dir``) before fresh
    processes are timed, as ``pip install`` does for an installed package. Run from a source
    tree with ``PYTHONDONTWRITEBYTECODE=1`` (this machine's environment), every fresh process
    would compile each module a load imports lazily, inside the clock (0.5 ms of the fixed
    cost of a first load here), while torch and the peers import their installed bytecode."""
    import compileall

    if package_dir is None:
        import asyncload

        package_dir = os.path.dirname(asyncload.__file__)
    compileall.compile_dir(package_dir, quiet=1)


def measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak RSS above the RSS before the call) for one call of ``fn``."""
    base = rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    peak = rss_bytes("VmHWM")
    return dt, max(0, peak - base)


def raw_into_destination(
    files: list[str], dest: memoryview, threads: int = 2, block: int = 8 << 20
) -> None:
    """Positional reads (``os.preadv``, ``block`` bytes each, on ``threads`` threads) of every
    byte of ``files`` into one destination-sized, already-touched buffer: a loader's physical
    limit, since it must write every byte into DRAM-resident tensors."""
    jobs = []
    pos = 0
    for f in files:
        size = os.path.getsize(f)
        for off in range(0, size, block):
            n = min(block, size - off)
            jobs.append((f, off, pos, n))
            pos += n
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    try:

        def work(i: int) -> None:
            for f, off, at, n in jobs[i::threads]:
                os.preadv(fds[f], [dest[at : at + n]], off)

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def join_gloo(rank: int, world: int, port: int, timeout: float = 600.0) -> None:
    """Join the gloo group of :func:`spawn_ranks` (in a rank's process)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def spawn_ranks(
    target: Callable[..., None],
    world: int,
    args: tuple[Any, ...],
    timeout: float = 600.0,
    what: str = "ranks",
) -> list[dict[str, Any]]:
    """Run ``target(rank, world, port, out, *args)`` in ``world`` fresh forkserver processes
    (a gloo group on a free port of 127.0.0.1); each puts ``(rank, result)`` on ``out``, a
    result with ``"error"`` for a failure. The results by rank; SystemExit when a rank failed
    or did not answer within ``timeout`` seconds (leftover processes killed)."""
    import queue
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [
        ctx.Process(target=target, args=(r, world, port, out, *args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, res = out.get(timeout=1.0)
            except queue.Empty:
                continue
            results[rank] = res
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {res['error']}" for r, res in results.items() if "error" in res]
    if errors or len(results) < world:
        missing = sorted(set(range(world)) - set(results))
        why = errors or [f"ranks {missing} did not answer within {timeout} s"]
        raise SystemExit(f"{what} failed:\n" + "\n".join(why))
    return [results[r] for r in range(world)]
