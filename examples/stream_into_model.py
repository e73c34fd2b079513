"""Stream a checkpoint into a model tensor by tensor, without a state dict in memory.

    python examples/stream_into_model.py

``asyncload.iter_tensors`` yields ``(name, tensor)`` as each tensor's bytes land, the way
inference servers feed a model loader: here each one is copied into a model built on the
``meta`` device (no memory until ``to_empty``), so at most ``memory_budget`` of tensors is
held besides the model itself. Then the same checkpoint is written as Hugging Face
safetensors shards (``asyncload convert``) and read back with ``read_state_dict``, only the
keys wanted. The script saves its checkpoint with ``dcp.save`` first; set
ASYNCLOAD_EXAMPLE_SMALL=1 for a tiny one.

Needs: torch only (local files).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import asyncload
from asyncload.cli import main as asyncload_command

# torch warns on every single-process dcp.save; this script calls it on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

SMALL = os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1"
WIDTH, DEPTH = (64, 4) if SMALL else (2048, 12)


def make_model() -> nn.Module:
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(DEPTH))
    )


def main(tmp: str) -> None:
    torch.manual_seed(0)
    trained = make_model()
    ckpt = os.path.join(tmp, "ckpt")
    dcp.save(trained.state_dict(), checkpoint_id=ckpt)

    with torch.device("meta"):
        model = make_model()  # shapes only
    model = model.to_empty(device="cpu")
    targets = model.state_dict(keep_vars=True)
    options = asyncload.LoadOptions(
        memory_budget=4 * WIDTH * WIDTH * 4
    )  # about four weight matrices
    n = nbytes = 0
    with torch.no_grad():
        for name, tensor in asyncload.iter_tensors(ckpt, options=options):
            targets[name].copy_(tensor)
            n, nbytes = n + 1, nbytes + tensor.nbytes
    same = all(
        torch.equal(a, b)
        for a, b in zip(trained.state_dict().values(), model.state_dict().values())
    )
    print(
        f"Loaded {n} tensors ({nbytes / 2**20:.1f} MiB) into the model one by one; identical: {same}"
    )

    hf = os.path.join(
        tmp, "hf"
    )  # `asyncload convert CKPT HF --max-shard-size ...` (prints what it wrote)
    shard, budget = str(nbytes // 3 + 1), str(options.memory_budget)
    assert (
        asyncload_command(
            ["convert", ckpt, hf, "--max-shard-size", shard, "--budget", budget, "--no-progress"]
        )
        == 0
    )
    norms = asyncload.read_state_dict(hf, keys=["*.1.weight", "*.1.bias"])  # the LayerNorms only
    print(f"read back {len(norms)} LayerNorm tensors from the safetensors shards")
    assert same and all(torch.equal(v, trained.state_dict()[k]) for k, v in norms.items())


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="asyncload-stream-") as tmp:
        main(tmp)
