"""Resume a training loop from a checkpoint with asyncload.

    python examples/resume_training.py [--steps 20] [--ckpt-dir DIR]

Trains a small model, saves model + optimizer + step with torch's ``dcp.save`` every few
steps, "crashes" half-way, then resumes in a fresh model and optimizer with
``asyncload.load`` and trains to the end. It checks that the resumed run ends with exactly
the weights (bit for bit) of a run that never stopped. Set ASYNCLOAD_EXAMPLE_SMALL=1 for a
tiny model.

Needs: torch only (local files).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import asyncload

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

WIDTH = 32 if os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1" else 512


def make_model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.LayerNorm(WIDTH)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)  # the data of step N is the same in every run
    x = torch.randn(64, WIDTH, generator=g)
    loss = nn.functional.mse_loss(model(x), x.flip(1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def save(ckpt_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save(
        {"model": model_sd, "optim": optim_sd, "step": step},
        checkpoint_id=str(ckpt_dir / f"step-{step:06d}"),
    )


def resume(ckpt_dir: Path) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """A fresh model and optimizer, loaded from the newest checkpoint in ``ckpt_dir``."""
    latest = max(ckpt_dir.glob("step-*"))
    model, opt = make_model_and_optimizer()
    # get_state_dict gives the destination: the model's own tensors and the optimizer's
    # (freshly initialised) state; asyncload fills them in place, like dcp.load.
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": None}
    stats = asyncload.load(state, latest)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    print(f"resumed from {latest.name}: {stats}")
    return model, opt, state["step"]


def main() -> None:
    # The check at the end compares weights bit for bit, so every step must be exactly
    # reproducible. On several threads torch's CPU kernels may split a sum differently from one
    # call to the next: on a busy 2-core machine about one run in eight "differed" already in
    # the state saved at step 10, before any checkpoint was read. One thread makes it exact.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="asyncload-resume-") as tmp:
        ckpt_dir = args.ckpt_dir or Path(tmp)
        ckpt_dir.mkdir(parents=True, exist_ok=True)

        # the reference: a run that never stops
        ref, ref_opt = make_model_and_optimizer()
        for step in range(args.steps):
            train_step(ref, ref_opt, step)

        # a run that checkpoints, and dies after step `crash`
        crash = args.steps // 2
        model, opt = make_model_and_optimizer()
        for step in range(crash + 1):
            loss = train_step(model, opt, step)
            if (step + 1) % args.every == 0:
                save(ckpt_dir, model, opt, step + 1)
        print(f"step {crash}: loss {loss:.4f} - the job dies here")
        del model, opt

        # the restarted job: resume from the newest checkpoint and finish
        model, opt, start = resume(ckpt_dir)
        for step in range(start, args.steps):
            loss = train_step(model, opt, step)
        print(f"step {args.steps - 1}: loss {loss:.4f}")

        same = all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), ref.state_dict().values())
        )
        if not same:
            raise SystemExit("the resumed run differs from the uninterrupted one")
        print("the resumed run ends with exactly the weights of the uninterrupted run")


if __name__ == "__main__":
    main()
