"""A planner of your own on top of asyncload's: rename keys and load a subset.

A model trained under DDP saves its keys as ``module.encoder.weight``; the model you load
it into calls that key ``encoder.weight``, and you only want the encoder (a fresh head).
``RenamingPlanner`` maps destination keys to checkpoint keys and leaves out keys that
``keep`` rejects; everything else (the pipeline, the allow-list, the error messages, and
on several ranks ShardedLoadPlanner's read-once sharing) comes from the base class.

The same subclass works with ``asyncload.load`` and with ``dcp.load``, in one process (as
here: the sharing part has nobody to share with and stays idle) or on every rank of a job.

    python examples/custom_planner.py

Needs: torch only (local files).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import asyncload

# torch warns on every single-process dcp.save / dcp.load; this script calls them on purpose
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)


class RenamingPlanner(asyncload.ShardedLoadPlanner):
    """Load checkpoint key ``prefix + k`` into destination key ``k``, for the ``k`` that ``keep`` accepts.

    The extension point is ``set_up_planner``: after the base class has flattened the
    destination (``self.state_dict``, and ``self.mappings`` from flat keys back to nested
    paths), the keys are renamed to the checkpoint's names and filtered. The tensors are
    the same objects, so the load still lands in place in the caller's state dict.
    """

    def __init__(
        self,
        *,
        prefix: str = "module.",
        keep: Callable[[str], bool] = lambda key: True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.prefix = prefix
        self.keep = keep

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.state_dict = {self.prefix + k: v for k, v in self.state_dict.items() if self.keep(k)}
        self.mappings = {self.prefix + k: v for k, v in self.mappings.items() if self.keep(k)}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 10)


def main() -> None:
    torch.manual_seed(0)
    trained = torch.nn.Module()  # a stand-in for DDP's wrapper: its keys carry "module."
    trained.module = Model()
    with tempfile.TemporaryDirectory() as ckpt:
        dcp.save(trained.state_dict(), checkpoint_id=ckpt, no_dist=True)
        print("checkpoint keys:", sorted(trained.state_dict()))

        fresh = Model()
        head_before = fresh.head.weight.detach().clone()
        state = fresh.state_dict()
        planner = RenamingPlanner(prefix="module.", keep=lambda key: key.startswith("encoder."))
        stats = asyncload.load(state, ckpt, planner=planner)
        fresh.load_state_dict(state)
        print(stats)

        assert torch.equal(fresh.encoder.weight, trained.module.encoder.weight)
        assert torch.equal(fresh.encoder.bias, trained.module.encoder.bias)
        assert torch.equal(fresh.head.weight, head_before)  # left alone
        print(
            f"loaded {sorted(k for k in state if k.startswith('encoder.'))} from the 'module.' keys; "
            f"head left as initialised; checkpoint keys not loaded: {stats.unexpected_keys}"
        )

        # the same planner under torch's own entry point
        again = Model().state_dict()
        dcp.load(
            again,
            storage_reader=asyncload.PipelinedReader(ckpt),
            planner=RenamingPlanner(keep=lambda key: key.startswith("encoder.")),
        )
        assert torch.equal(again["encoder.weight"], trained.module.encoder.weight)
        print("dcp.load with the same planner: identical")


if __name__ == "__main__":
    main()
