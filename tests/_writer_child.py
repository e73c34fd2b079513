"""Child process of tests/engine/test_robustness.py: overwrites a DCP checkpoint in place again and
again with torch's own dcp.save (save k fills every tensor with the value k), for a given
number of seconds. Prints "ready" when it starts saving, then the number of saves completed.

    python _writer_child.py CKPT SECONDS N ROWS COLS SINGLE_FILE(0|1)
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

CKPT = sys.argv[1]
SECONDS = float(sys.argv[2])
N, ROWS, COLS, SINGLE = (int(x) for x in sys.argv[3:7])


def main() -> None:
    warnings.simplefilter("ignore")
    print("ready", flush=True)
    end = time.monotonic() + SECONDS
    k = 1
    while time.monotonic() < end:
        sd = {f"t{i}": torch.full((ROWS, COLS), float(k)) for i in range(N)}
        dcp.save(
            sd,
            storage_writer=FileSystemWriter(
                CKPT, single_file_per_rank=bool(SINGLE), overwrite=True
            ),
            no_dist=True,
        )
        k += 1
    print(k - 1)


if __name__ == "__main__":
    main()
