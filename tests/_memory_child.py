"""Child process of tests/engine/test_robustness.py (and benchmarks): peak RSS of one load above
the destination tensors. The destination is allocated and touched first, one load warms
the page cache and starts the library's threads, then the peak RSS (VmHWM) is reset and
a second load measured. Prints one JSON line.

    python _memory_child.py CKPT N ROWS COLS CONCURRENCY MEMORY_BUDGET CHUNK_SIZE LAYOUT[,LAYOUT]

Prints one JSON object per LAYOUT, in a list. LAYOUT ``contiguous``: reads land in the destination's own memory; ``transposed``: the
destination tensors are transposed views, so every byte goes through staging buffers
(the memory the budget bounds).
"""

from __future__ import annotations

import gc
import json
import sys

import torch

import asyncload

CKPT = sys.argv[1]
N, ROWS, COLS, CONC, BUDGET = (int(x) for x in sys.argv[2:7])
CHUNK = int(sys.argv[7])
LAYOUTS = sys.argv[8].split(",")


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measure(layout: str) -> dict[str, object]:
    if layout == "transposed":
        dest = {f"t{i}": torch.zeros(COLS, ROWS).t() for i in range(N)}
    else:
        dest = {
            f"t{i}": torch.zeros(ROWS, COLS) for i in range(N)
        }  # touched: counted in the baseline
    opts = asyncload.LoadOptions(
        concurrency=CONC,
        memory_budget=BUDGET,
        chunk_size=min(CHUNK, BUDGET),
        min_chunk_size=min(1 << 20, CHUNK, BUDGET),
    )
    asyncload.load(dest, CKPT, options=opts)  # warm-up
    for t in dest.values():
        t.zero_()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    base = status("VmRSS:")
    stats = asyncload.load(dest, CKPT, options=opts)
    peak = status("VmHWM:")
    good = all(torch.equal(dest[f"t{i}"], torch.full((ROWS, COLS), float(i))) for i in range(N))
    out = {
        "layout": layout,
        "above_destination": peak - base,
        "peak_buffered_bytes": stats.peak_buffered_bytes,
        "dest_bytes": N * ROWS * COLS * 4,
        "ok": good,
        "seconds": stats.seconds,
        "peak_concurrency": stats.peak_concurrency,
    }
    del dest
    gc.collect()
    return out


def main() -> None:
    print(json.dumps([measure(layout) for layout in LAYOUTS]))


if __name__ == "__main__":
    main()
