"""Resume from a plain ``torch.save`` checkpoint with ``asyncload.read_state_dict``.

    python examples/resume_from_torch_save.py [--url s3://bucket/ckpt.pt]

What a training loop saves in one file: the model, the optimizer (its state keyed by
parameter index), the step, the RNG states (Python's, numpy's and torch's) and the run's
``argparse.Namespace``. ``read_state_dict`` gives back exactly what ``torch.load`` gives, so
``Optimizer.load_state_dict`` restores every parameter's state and the generators draw on as
if the run had never stopped. The Namespace is not data: asyncload refuses it unless the
caller trusts it (``LoadOptions(safe_globals=[argparse.Namespace])``), as ``torch.load``
needs ``torch.serialization.add_safe_globals``. The resumed run must end with exactly the
weights of a run that never stopped.

Needs: torch and numpy; with ``--url s3://...``, the ``s3`` extra and the bucket's credentials in
``storage_options`` (edit the script) or the environment.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import asyncload


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    # the data comes from all three generators, as in a real loop (shuffling, augmentation, dropout)
    x = torch.randn(8, 16) * float(np.random.rand()) + random.random()
    loss = nn.functional.mse_loss(model(x), x.flip(1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def seed_all() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)


def main() -> None:
    torch.set_num_threads(1)  # bit-exact steps on a busy machine
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--url", default=None, help="read the checkpoint from here (upload it there yourself)"
    )
    args = parser.parse_args()

    ref, ref_opt = make()
    seed_all()
    for _ in range(args.steps):
        train_step(ref, ref_opt)

    model, opt = make()
    seed_all()
    half = args.steps // 2
    for _ in range(half):
        train_step(model, opt)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": half,
                "rng": {
                    "python": random.getstate(),
                    "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                },
                "args": args,
            },
            path,
        )
        del model, opt
        random.seed(99)  # the restarted process starts with other states
        np.random.seed(99)

        url = args.url or str(path)
        try:
            asyncload.read_state_dict(url)
        except asyncload.UnsafeCheckpointError as exc:
            print(f"refused until trusted: {str(exc)[:160]}...")
        trusted = asyncload.LoadOptions(safe_globals=[argparse.Namespace])
        # the model's weights in place (from under "model."), the rest as torch.load gives it
        model, opt = make()
        print(asyncload.load(model.state_dict(), url, options=trusted))
        ckpt = asyncload.read_state_dict(
            url, keys=["optimizer", "step", "rng", "args"], options=trusted
        )

    opt.load_state_dict(ckpt["optimizer"])  # state keyed 0, 1, ...: every parameter restored
    random.setstate(ckpt["rng"]["python"])
    np.random.set_state(ckpt["rng"]["numpy"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    print(f"resumed at step {ckpt['step']} of a run started with {ckpt['args']}")
    for _ in range(ckpt["step"], args.steps):
        train_step(model, opt)

    if not all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
    ):
        raise SystemExit("the resumed run differs from the uninterrupted one")
    print("the resumed run ends with exactly the weights of the uninterrupted run")


if __name__ == "__main__":
    main()
