"""A small torchtitan training run on CPU, built from torchtitan's own parts.

torchtitan's llama3 ``debugmodel`` flavour (the smallest it ships) cut to 2 layers, its
AdamW (``default_adamw``), its warm-up/decay LR schedulers, its ``ParallelAwareDataloader``
over a deterministic token stream, and a train state shaped like ``Trainer.state_dict``;
the checkpoint manager built from a ``Config`` the way ``Trainer`` builds it
(``config.checkpoint.build(...)``). Two deviations from a GPU run, both for CPU: the inner
attention is SDPA (FlexAttention has no backward on CPU; torchtitan's own graph_trainer
tests swap it the same way) and sequences are 32 tokens.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

SEQ_LEN = 32
BATCH = 2
LAYERS = 2
TRAINING_STEPS = 10


def model_spec() -> Any:
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:LAYERS]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


class TokenStream(IterableDataset, Stateful):  # type: ignore[type-arg]
    """Sample ``i`` is drawn from a generator seeded with ``i``; the state is the position."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pos = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(10_000 + self.pos)
            tokens = torch.randint(0, self.vocab_size, (SEQ_LEN + 1,), generator=g)
            self.pos += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = state_dict["pos"]


class TrainState(Stateful):
    """What ``torchtitan.trainer.Trainer`` saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class Run:
    """One training process: the parts, their checkpoint manager, and ``train_step``.

    ``seed`` sets the model's initial weights (a resumed run starts from other weights than
    the run that saved, so a load that misses something shows).
    """

    def __init__(
        self, checkpoint: BaseCheckpointManager.Config, base_folder: Path | str, *, seed: int
    ) -> None:
        spec = model_spec()
        self.model_config = spec.model
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = spec.model.build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        self.optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ).build(optimizers=self.optimizers, training_steps=TRAINING_STEPS)
        self.dataloader = ParallelAwareDataloader(
            TokenStream(spec.model.vocab_size), dp_rank=0, dp_world_size=1, batch_size=BATCH
        )
        self.train_state = TrainState()
        self.sd_adapter = spec.state_dict_adapter(spec.model, None)
        self.checkpointer = checkpoint.build(
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=self.sd_adapter,
            base_folder=str(base_folder),
        )
        self._batches: Iterator[Any] | None = None

    def train_step(self) -> torch.Tensor:
        """One step as torchtitan's trainer takes it; returns the loss (detached)."""
        if self._batches is None:  # after a load: the dataloader resumes where it was saved
            self._batches = iter(self.dataloader)
        input_dict, labels = next(self._batches)
        inputs = input_dict["input"]
        positions = torch.arange(SEQ_LEN).repeat(inputs.shape[0], 1)
        self.train_state.ntokens_seen += labels.numel()
        pred = self.model(inputs, positions=positions)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.step += 1
        return loss.detach()

    def states(self) -> dict[str, Any]:
        """Everything a checkpoint holds, as plain values: model, optimizer (flat, FQN-keyed),
        LR scheduler, dataloader (its pickled state decoded) and train state."""
        dataloader = self.dataloader.state_dict()
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in self.optimizers.state_dict().items()
            },
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "dataloader": {
                k: pickle.loads(v) if isinstance(v, bytes) else v for k, v in dataloader.items()
            },
            "dataloader_bytes": dataloader,
            "train_state": self.train_state.state_dict(),
            "lr": [g["lr"] for opt in self.optimizers.optimizers for g in opt.param_groups],
        }

    def close(self) -> None:
        self.checkpointer.close()


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bit for bit: tensors by ``torch.equal`` with dtype, shape and type; containers by
    type, keys and entries; other values by type and ``==``."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{list(got.shape)}"
        )
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), (
            f"{where}: keys {sorted(set(got) ^ set(want))[:5]}"
        )
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
