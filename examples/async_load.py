"""Load checkpoints from async code with ``await asyncload.aload(...)``.

    python examples/async_load.py

The reads run on the caller's event loop, the copies and the planner on threads: the loop
stays responsive (a heartbeat task measures it), two checkpoints (weights and an EMA copy)
load at the same time with ``asyncio.gather``, and a load can be cancelled like any task.
The script writes the two checkpoints with ``dcp.save`` first. Set
ASYNCLOAD_EXAMPLE_SMALL=1 for tiny ones.

Needs: torch only (local files).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

import asyncload

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

SMALL = os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1"
N = 64 if SMALL else 1536


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"block{i}.weight": torch.randn(N, N, generator=g) for i in range(8)} | {
        f"block{i}.norm": torch.randn(N, generator=g) for i in range(8)
    }


async def heartbeat(lags: list[float], stop: asyncio.Event) -> None:
    """How late the loop wakes us up: the loop's responsiveness during the loads."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(time.perf_counter() - t - 0.01)


async def main(weights: str, ema: str) -> None:
    dest_w = {k: torch.zeros_like(v) for k, v in make_state(0).items()}
    dest_e = {k: torch.zeros_like(v) for k, v in make_state(0).items()}
    lags: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(heartbeat(lags, stop))

    stats_w, stats_e = await asyncio.gather(
        asyncload.aload(dest_w, weights), asyncload.aload(dest_e, ema)
    )
    stop.set()
    await beat
    print(f"weights: {stats_w}")
    print(f"ema:     {stats_e}")
    print(
        f"event loop stayed responsive: worst heartbeat delay {max(lags, default=0.0) * 1e3:.1f} ms"
    )

    # a load is a task like any other: cancel it, and nothing of it is left running
    task = asyncio.create_task(
        asyncload.aload({k: torch.zeros_like(v) for k, v in dest_w.items()}, weights)
    )
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
        print("the load finished before the cancel arrived")
    except asyncio.CancelledError:
        print("cancelled a load cleanly")

    assert all(torch.equal(dest_w[k], v) for k, v in make_state(0).items())
    assert all(torch.equal(dest_e[k], v) for k, v in make_state(1).items())
    print("both loads identical to what was saved")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="asyncload-async-") as tmp:
        weights, ema = os.path.join(tmp, "weights"), os.path.join(tmp, "ema")
        dcp.save(make_state(0), checkpoint_id=weights)
        dcp.save(make_state(1), checkpoint_id=ema)
        asyncio.run(main(weights, ema))
