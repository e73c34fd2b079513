"""Load the weights in the background while the rest of the job is being built.

    python examples/background_load.py [CHECKPOINT]

``asyncload.start_load`` returns at once with a ``LoadHandle``; the bytes stream into the
model's own tensors while the main thread builds the optimizer, the data pipeline and so
on. ``handle.progress`` says how far it got, ``handle.result()`` waits for the end (or
raises the load's error). Without CHECKPOINT the script first writes one with
``dcp.save``. Set ASYNCLOAD_EXAMPLE_SMALL=1 for a tiny model.

Needs: torch only (local files).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import asyncload

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

SMALL = os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1"
WIDTH, LAYERS = (64, 2) if SMALL else (1024, 12)


def build_model() -> nn.Module:
    return nn.Sequential(
        *(
            nn.Sequential(
                nn.Linear(WIDTH, 4 * WIDTH),
                nn.GELU(),
                nn.Linear(4 * WIDTH, WIDTH),
                nn.LayerNorm(WIDTH),
            )
            for _ in range(LAYERS)
        )
    )


def build_rest_of_the_job(model: nn.Module) -> torch.optim.Optimizer:
    """Stands for the slow parts of start-up: optimizer, tokenizer, data loader, compilation."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4
    )  # refers to the parameters, touches no data
    time.sleep(0.2)  # e.g. a data loader spinning up its workers
    return opt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", nargs="?")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncload-bg-") as tmp:
        ckpt = args.checkpoint
        saved = None
        if ckpt is None:
            torch.manual_seed(1)
            saved = build_model().state_dict()
            dcp.save(saved, checkpoint_id=tmp)
            ckpt = tmp

        # The model's skeleton first: on the meta device it costs nothing, then real
        # (uninitialised) memory. No time spent on random initialisation we overwrite.
        with torch.device("meta"):
            model = build_model()
        model.to_empty(device="cpu")

        t0 = time.perf_counter()
        handle = asyncload.start_load(model.state_dict(), ckpt)
        opt = build_rest_of_the_job(model)  # runs while the weights stream in
        # the handle's repr: its state and progress (handle.progress: (done, total), total None until known)
        print(f"job built after {time.perf_counter() - t0:.2f} s; {handle!r}")
        stats = handle.result(timeout=600)
        print(f"weights in after {time.perf_counter() - t0:.2f} s: {stats}")

        if saved is not None:
            assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
            print(f"all {len(saved)} tensors identical to what was saved")
        del opt


if __name__ == "__main__":
    main()
