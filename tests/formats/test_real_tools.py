"""Checkpoints as the real tools write them, read by asyncload, compared with each tool's own
reader bit for bit, then used through the tool's own resume or a forward.

* PyTorch Lightning 2.6: a plain ``.ckpt`` (hparams, AdamW + OneCycleLR, callbacks' and
  loops' state) read whole with ``read_state_dict`` and loaded into a resume's destination
  with ``load``; Lightning's own ``fit(ckpt_path=...)`` through a ``CheckpointIO`` that reads
  with asyncload equals its default resume. Its ``ModelParallelStrategy`` (FSDP2, gloo, one
  CPU process) sharded checkpoint: a DCP directory plus ``meta.pt``.
* transformers 5.23 ``Trainer``: a checkpoint folder (``model.safetensors``, ``optimizer.pt``,
  ``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``); a ``Trainer`` whose resume
  reads every file through asyncload (locally and from S3) reaches the parameters Trainer's
  own resume reaches; ``training_args.bin`` is refused saying what it holds.
* PEFT 0.21: ``adapter_model.safetensors`` read locally and from S3, applied to a fresh LoRA
  model: logits equal ``PeftModel.from_pretrained``'s.
* DeepSpeed 0.19.8, ZeRO-2 and ZeRO-3 (one CPU process, gloo, in a child process): the
  model-states files, ZeRO-2's optimizer file (with DeepSpeed's classes in ``safe_globals``)
  and DeepSpeed's own ``load_checkpoint`` reading through asyncload; ZeRO-3's optimizer file
  (tensors with a Python attribute) refused clearly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_training_state import assert_same

import asyncload
from asyncload import UnsafeCheckpointError

pytestmark = pytest.mark.timeout(240)

WHERE = ["local", "s3"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def quiet() -> Iterator[None]:
    """The tools' own deprecation notices and tips (Lightning's pytree, transformers' logging)
    are not what these tests are about; asyncload's warnings are checked outside this block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_params_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- PyTorch Lightning ---------------------------------------------------------------------------


def _lightning() -> Any:
    """The module and data of the Lightning runs (built on first use: importing Lightning
    takes seconds)."""
    import pytorch_lightning as pl

    class Data(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return torch.randn(6, generator=g), torch.randn(3, generator=g)

    class Net(pl.LightningModule):
        def __init__(self, hidden: int = 5, lr: float = 0.01, name: str = "net") -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)
            )

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return pl, Net, lambda: torch.utils.data.DataLoader(Data(), batch_size=2)


def _trainer(pl: Any, max_steps: int, root: Path, **kw: Any) -> Any:
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(root),
        **kw,
    )


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step Lightning run saved by its ``ModelCheckpoint`` (monitoring the loss) beside an
    ``EarlyStopping``: ``epoch=0-step=4.ckpt``."""
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

    root = tmp_path_factory.mktemp("lightning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl, Net, data = _lightning()
        torch.manual_seed(0)
        callbacks = [
            ModelCheckpoint(
                dirpath=root / "ck", every_n_train_steps=4, save_top_k=-1, monitor="train_loss"
            ),
            EarlyStopping(monitor="train_loss", patience=5, check_on_train_epoch_end=True),
        ]
        _trainer(pl, 4, root, callbacks=callbacks).fit(Net(), data())
    return root / "ck" / "epoch=0-step=4.ckpt"


@pytest.mark.parametrize("where", WHERE)
def test_lightning_ckpt_as_torch_load_gives_it(
    lightning_ckpt: Path, publish: Any, where: str
) -> None:
    url, so = publish(lightning_ckpt)
    got = asyncload.read_state_dict(url, storage_options=so)
    want = torch.load(lightning_ckpt, weights_only=True)  # as Lightning 2.6 itself loads it
    assert_same(got, want)
    assert got["hyper_parameters"] == {"hidden": 5, "lr": 0.01, "name": "net"}
    assert got["global_step"] == 4 and set(got["optimizer_states"][0]["state"]) == {0, 1, 2, 3}
    assert len(got["callbacks"]) == 2  # ModelCheckpoint's and EarlyStopping's state


@pytest.mark.parametrize("where", WHERE)
def test_lightning_ckpt_into_a_fresh_resume(
    lightning_ckpt: Path, publish: Any, where: str, quiet: None
) -> None:
    """A resume's destination as Lightning builds it before restoring (the module, the
    optimizer and scheduler ``configure_optimizers`` returns, nothing stepped), the rest as
    empty containers: filled as ``torch.load`` gives them; the next step equals the torch path's."""
    _, Net, data = _lightning()
    url, so = publish(lightning_ckpt)
    want = torch.load(lightning_ckpt, weights_only=True)

    def fresh() -> tuple[Any, torch.optim.Optimizer, Any]:
        torch.manual_seed(1)  # other weights than the run's: the load must replace them
        m = Net()
        conf = m.configure_optimizers()
        return m, conf["optimizer"], conf["lr_scheduler"]["scheduler"]

    m, opt, sched = fresh()
    assert opt.state_dict()["state"] == {}
    dest: dict[str, Any] = {
        "epoch": -1,
        "global_step": -1,
        "state_dict": m.state_dict(),
        "loops": {},
        "callbacks": {},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "hyper_parameters": {},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asyncload's own: none
        stats = asyncload.load(dest, url, storage_options=so)
    for key in dest:
        assert_same(dest[key], want[key], key)
    assert stats.unexpected_keys == [] or all(
        k.split(".")[0] in ("pytorch-lightning_version", "hparams_name")
        for k in stats.unexpected_keys
    )

    def step(
        m: Any, opt: torch.optim.Optimizer, sched: Any, ckpt: dict[str, Any]
    ) -> list[torch.Tensor]:
        m.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer_states"][0])
        sched.load_state_dict(ckpt["lr_schedulers"][0])
        x, y = next(iter(data()))
        opt.zero_grad()
        torch.nn.functional.mse_loss(m.net(x), y).backward()
        opt.step()
        sched.step()
        return _params(m)

    got = step(m, opt, sched, dest)
    ref = step(*fresh(), want)
    _assert_params_equal(got, ref)
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0]


def test_lightning_resume_through_asyncload(
    lightning_ckpt: Path, tmp_path: Path, quiet: None
) -> None:
    """Lightning's own ``fit(ckpt_path=...)`` with a ``CheckpointIO`` that reads with
    ``asyncload.read_state_dict`` continues exactly as its default resume (``torch.load``)."""
    from pytorch_lightning.plugins.io import TorchCheckpointIO

    pl, Net, data = _lightning()
    reads: list[str] = []

    class AsyncloadIO(TorchCheckpointIO):
        def load_checkpoint(self, path: Any, map_location: Any = None, **kw: Any) -> Any:
            reads.append(str(path))
            return asyncload.read_state_dict(str(path))

    def resume(plugins: list[Any]) -> list[torch.Tensor]:
        torch.manual_seed(1)
        m = Net()
        trainer = _trainer(pl, 7, tmp_path, plugins=plugins, enable_checkpointing=False)
        trainer.fit(m, data(), ckpt_path=str(lightning_ckpt))
        assert trainer.global_step == 7
        return _params(m)

    got = resume([AsyncloadIO()])
    assert reads == [str(lightning_ckpt)]
    want = resume([])
    _assert_params_equal(got, want)
    saved = torch.load(lightning_ckpt, weights_only=True)["state_dict"]
    assert not torch.equal(got[0], saved["net.0.weight"])  # three steps were taken


_LIGHTNING_FSDP = """
import sys, warnings, torch
warnings.simplefilter("ignore")
sys.path.insert(0, {tests!r})
from test_real_tools import _lightning, _trainer
from pathlib import Path
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

pl, Net, data = _lightning()

class Sharded(Net):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

torch.manual_seed(0)
m = Sharded()
strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
root = Path({root!r})
trainer = _trainer(pl, 4, root, strategy=strategy, enable_checkpointing=False)
trainer.fit(m, data())
trainer.save_checkpoint(root / "sharded")
# the full weights and the optimizer as Lightning's module holds them after the 4 steps
from torch.distributed.checkpoint.state_dict import get_state_dict
msd, osd = get_state_dict(m, trainer.optimizers[0])
torch.save({{"model": {{k: v.full_tensor() for k, v in msd.items()}}}}, root / "reference.pt")
"""


@pytest.fixture(scope="module")
def lightning_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, gloo, one CPU process; its
    ``FSDPStrategy`` needs CUDA) saves a sharded checkpoint: ``.metadata``, ``__0_0.distcp``
    (``state_dict`` and ``optimizer_0``, DTensors) and ``meta.pt`` (the rest, torch.save). It
    runs in a child process: the strategy initialises a process group for its life."""
    root = tmp_path_factory.mktemp("lightning_fsdp")
    code = _LIGHTNING_FSDP.format(tests=str(Path(__file__).parent), root=str(root))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return root


@pytest.mark.parametrize("where", WHERE)
def test_lightning_sharded_checkpoint(
    lightning_sharded: Path, publish: Any, where: str, quiet: None
) -> None:
    """The DCP directory as torch's reader gives it, ``meta.pt`` as ``torch.load`` gives it;
    loaded into a plain (unsharded) module and a fresh optimizer: the weights are the run's,
    the next step equals the one from ``dcp.load``'s state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt = lightning_sharded / "sharded"
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    url, so = publish(ckpt)
    _, Net, data = _lightning()

    # meta.pt: the loops', callbacks' and hparams' part, a torch.save file
    assert_same(
        asyncload.read_state_dict(f"{url}/meta.pt", storage_options=so),
        torch.load(ckpt / "meta.pt", weights_only=True),
    )

    def fresh() -> tuple[Any, torch.optim.Optimizer, dict[str, Any]]:
        torch.manual_seed(1)
        m = Net()
        opt = m.configure_optimizers()["optimizer"]
        msd, osd = get_state_dict(m, opt)
        return m, opt, {"state_dict": msd, "optimizer_0": osd}

    m, opt, dest = fresh()  # get_state_dict gives the optimizer's state zeroed, keyed by name
    asyncload.load(dest, url, storage_options=so)
    rm, ropt, ref = fresh()
    dcp.load(ref, checkpoint_id=str(ckpt))  # torch's reader, into the same destination
    assert_same(dest, ref)
    reference = torch.load(lightning_sharded / "reference.pt", weights_only=True)["model"]
    assert_same(dict(dest["state_dict"]), dict(reference))  # the run's weights after 4 steps
    assert sorted(dest["optimizer_0"]["state"]) == sorted(n for n, _ in m.named_parameters())
    assert dest["optimizer_0"]["state"]["net.0.weight"]["step"].item() == 4

    def step(m: Any, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> list[torch.Tensor]:
        set_state_dict(
            m, opt, model_state_dict=sd["state_dict"], optim_state_dict=sd["optimizer_0"]
        )
        x, y = next(iter(data()))
        opt.zero_grad()
        torch.nn.functional.mse_loss(m.net(x), y).backward()
        opt.step()
        return _params(m)

    _assert_params_equal(step(m, opt, dest), step(rm, ropt, ref))


# --- transformers Trainer ------------------------------------------------------------------------


def _llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) * 7 + i) % 64
        return {"input_ids": ids, "labels": ids}


def _train(trainer_class: Any, out: Path, max_steps: int, save: bool, resume: Any = None) -> Any:
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        save_steps=2,
        save_strategy="steps" if save else "no",
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    model = _llama(0 if resume is None else 5)  # a resume must replace these weights
    trainer_class(model=model, args=args, train_dataset=_Tokens()).train(
        resume_from_checkpoint=resume
    )
    return model


@pytest.fixture(scope="module")
def trainer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``Trainer.train`` of a tiny random Llama for 2 steps, ``save_steps=2``: the folder
    ``checkpoint-2`` as the Trainer writes it."""
    from transformers import Trainer

    out = tmp_path_factory.mktemp("trainer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(Trainer, out, 2, save=True)
    ckpt = out / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= names
    assert "training_args.bin" in names
    return ckpt


@pytest.mark.parametrize("where", WHERE)
def test_trainer_folder_files(trainer_folder: Path, publish: Any, where: str) -> None:
    """Each file of the folder as its own reader gives it; ``training_args.bin`` refused
    saying what it holds, in one message."""
    url, so = publish(trainer_folder)
    got = asyncload.read_state_dict(f"{url}/model.safetensors", storage_options=so)
    assert_same(got, load_file(trainer_folder / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt"):
        assert_same(
            asyncload.read_state_dict(f"{url}/{name}", storage_options=so),
            torch.load(trainer_folder / name, weights_only=True),
            name,
        )
    assert_same(
        asyncload.read_state_dict(f"{url}/rng_state.pth", storage_options=so),
        torch.load(trainer_folder / "rng_state.pth", weights_only=False),  # numpy's state
    )
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(f"{url}/training_args.bin", storage_options=so)
    message = str(err.value)
    assert "training_args.bin" in message
    assert (
        "holds a `TrainingArguments` object, not tensors: nothing to load into a model" in message
    )


@pytest.mark.parametrize("where", WHERE)
def test_trainer_resume_through_asyncload(
    trainer_folder: Path, publish: Any, where: str, tmp_path: Path, quiet: None
) -> None:
    """A ``Trainer`` whose resume reads the model, optimizer, scheduler and RNG files with
    asyncload (the optimizer into the fresh one's ``state_dict()``, its ``"state"`` empty)
    reaches, after 2 more steps, the parameters Trainer's own resume reaches, bit for bit."""
    import numpy as np
    from transformers import Trainer

    url, so = publish(trainer_folder)
    used: list[str] = []

    class AsyncloadTrainer(Trainer):
        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            target = model if model is not None else self.model
            stats = asyncload.load(
                target.state_dict(), f"{url}/model.safetensors", storage_options=so
            )
            assert not stats.missing_keys
            used.append("model")

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            if checkpoint is None:
                return
            dest = self.optimizer.state_dict()
            assert dest["state"] == {}  # fresh: filled from the checkpoint
            asyncload.load(dest, f"{url}/optimizer.pt", storage_options=so)
            self.optimizer.load_state_dict(dest)
            sched = asyncload.read_state_dict(f"{url}/scheduler.pt", storage_options=so)
            self.lr_scheduler.load_state_dict(sched)
            used.append("optimizer")

        def _load_rng_state(self, checkpoint: str | None) -> None:
            import random

            if checkpoint is None:
                return
            rng = asyncload.read_state_dict(f"{url}/rng_state.pth", storage_options=so)
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.random.set_rng_state(rng["cpu"])
            used.append("rng")

    got = _train(AsyncloadTrainer, tmp_path / "a", 4, save=False, resume=str(trainer_folder))
    assert sorted(used) == ["model", "optimizer", "rng"]
    want = _train(Trainer, tmp_path / "b", 4, save=False, resume=str(trainer_folder))
    _assert_params_equal(_params(got), _params(want))
    saved = load_file(trainer_folder / "model.safetensors")
    assert not torch.equal(got.lm_head.weight, saved["lm_head.weight"])  # it trained on


# --- PEFT / LoRA ---------------------------------------------------------------------------------


def _lora_config(init: bool) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=init,  # False: lora_B random, so the adapter changes the logits
    )


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``save_pretrained`` of a LoRA adapter (random A and B) on a tiny random Llama:
    ``adapter_model.safetensors`` and ``adapter_config.json``."""
    from peft import get_peft_model

    out = tmp_path_factory.mktemp("lora") / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(_llama(0), _lora_config(init=False))
        model.save_pretrained(str(out))
    assert {p.name for p in out.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    return out


@pytest.mark.parametrize("where", WHERE)
def test_lora_adapter(lora_adapter: Path, publish: Any, where: str, quiet: None) -> None:
    """``adapter_model.safetensors`` read as safetensors gives it; loaded into a fresh LoRA
    model (``get_peft_model_state_dict`` names the adapter's tensors as the file does) or
    applied with ``set_peft_model_state_dict``: logits equal ``PeftModel.from_pretrained``'s."""
    from peft import (
        PeftModel,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )

    url, so = publish(lora_adapter)
    file = f"{url}/adapter_model.safetensors"
    got = asyncload.read_state_dict(file, storage_options=so)
    assert_same(got, load_file(lora_adapter / "adapter_model.safetensors"))
    assert any(".lora_A." in k for k in got) and any(".lora_B." in k for k in got)

    ids = (torch.arange(12).unsqueeze(0) * 5) % 64

    def logits(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits

    want = logits(PeftModel.from_pretrained(_llama(0), str(lora_adapter)).eval())
    base = logits(_llama(0).eval())
    assert not torch.equal(want, base)  # the adapter matters

    # asyncload.load straight into the adapter's parameters
    fresh = get_peft_model(_llama(0), _lora_config(init=True)).eval()
    assert torch.equal(logits(fresh), base)  # lora_B zero: nothing applied yet
    dest = get_peft_model_state_dict(fresh)
    stats = asyncload.load(dest, file, storage_options=so)
    assert not stats.missing_keys and not stats.unexpected_keys
    _assert_params_equal([logits(fresh)], [want])

    # PEFT's own loader, given asyncload's tensors
    other = get_peft_model(_llama(0), _lora_config(init=True)).eval()
    result = set_peft_model_state_dict(other, got)
    assert not result.unexpected_keys
    _assert_params_equal([logits(other)], [want])


def test_filled_container_keeps_empty_dicts_and_order(tmp_path: Path) -> None:
    """What Lightning's loops save (``"state_dict": {}`` beside dotted keys), reduced: an
    empty dict of the destination is filled with the saved shape, empty dicts and key order
    included, as ``torch.load`` gives it (Lightning's loops index ``"state_dict"`` on resume)."""
    saved = {
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.progress": {"total": {"ready": 4}, "current": {}},
                "nested": {"a": {}, "b": {"c": {}}},
                "t": torch.arange(3),
            },
            "validate_loop": {"state_dict": {}},
        },
        "step": 4,
    }
    path = tmp_path / "loops.pt"
    torch.save(saved, path)
    dest: dict[str, Any] = {"loops": {}, "step": 0}
    asyncload.load(dest, path)
    assert_same(dest, torch.load(path, weights_only=True))


# --- DeepSpeed ZeRO -----------------------------------------------------------------------------

_DEEPSPEED = """
import os, sys, warnings
warnings.simplefilter("ignore")
import torch
import deepspeed
import deepspeed.comm.torch

# the shared-memory all-reduce op is JIT-compiled (C++, about 90 s here) at init; one process
# never uses it (``deepspeed.comm.torch`` as an attribute is torch itself)
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
mode, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0 if mode == "write" else 3)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
    "zero_optimization": {"stage": stage},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))


def step(seed):
    g = torch.Generator().manual_seed(seed)
    loss = engine(torch.randn(2, 6, generator=g)).square().sum()
    engine.backward(loss)
    engine.step()


if mode == "write":
    for i in range(2):
        step(i)
    engine.save_checkpoint(out, tag="zero")
    with torch.no_grad():
        torch.save({"x": x, "y": engine(x)}, os.path.join(out, "forward.pt"))
else:  # resume through deepspeed's own load_checkpoint, its files read by torch or asyncload
    if mode == "asyncload":
        import asyncload
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        opts = asyncload.LoadOptions(safe_globals=[LossScaler, ZeroStageEnum, fragment_address])
        reads = []

        def load(path, map_location=None):
            reads.append(os.path.basename(path))
            return asyncload.read_state_dict(str(path), options=opts)

        engine.checkpoint_engine.load = load
    engine.load_checkpoint(sys.argv[4], tag="zero")
    loaded = [p.detach().clone() for p in engine.module.parameters()]
    step(7)
    stepped = [p.detach().clone() for p in engine.module.parameters()]
    torch.save({"loaded": loaded, "stepped": stepped}, os.path.join(out, mode + ".pt"))
    if mode == "asyncload":
        assert set(reads) == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}, reads
"""


def _deepspeed(*args: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "DS_ACCELERATOR": "cpu",
    }
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        [sys.executable, "-c", _DEEPSPEED, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def deepspeed_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """DeepSpeed 0.19.8 ``save_checkpoint`` after 2 AdamW steps, ZeRO stage 2 and 3, one CPU
    process (gloo): ``zero/{mp_rank_00,zero_pp_rank_0_mp_rank_00}_model_states.pt`` and
    ``zero/zero_pp_rank_0_mp_rank_00_optim_states.pt``; ``forward.pt``: the engine's output."""
    out = {}
    for stage in (2, 3):
        root = tmp_path_factory.mktemp(f"zero{stage}")
        _deepspeed("write", str(stage), str(root))
        out[stage] = root
    return out


_ZERO_GLOBALS = [
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_model_states(
    deepspeed_ckpts: dict[int, Path], publish: Any, where: str, stage: int
) -> None:
    """The model-states file as ``torch.load(weights_only=True)`` gives it; ZeRO-2's full
    ``module`` weights loaded into a plain module give the engine's forward."""
    ckpt = deepspeed_ckpts[stage] / "zero"
    name = (
        "mp_rank_00_model_states.pt" if stage == 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    )
    url, so = publish(ckpt)
    got = asyncload.read_state_dict(f"{url}/{name}", storage_options=so)
    assert_same(got, torch.load(ckpt / name, weights_only=True))
    assert got["global_steps"] == 2 and got["ds_config"]["zero_optimization"]["stage"] == stage
    if stage == 3:
        return  # the module's parameters are partitions: the weights are in the optimizer file
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    stats = asyncload.load(model.state_dict(), f"{url}/{name}", storage_options=so)
    assert stats.key_prefix == "module"
    ref = torch.load(deepspeed_ckpts[stage] / "forward.pt", weights_only=True)
    with torch.no_grad():
        _assert_params_equal([model(ref["x"])], [ref["y"]])


@pytest.mark.parametrize("where", WHERE)
def test_deepspeed_zero2_optimizer_states(
    deepspeed_ckpts: dict[int, Path], publish: Any, where: str
) -> None:
    """ZeRO-2's optimizer file names three DeepSpeed classes: refused naming all of them at
    once, read with them in ``safe_globals`` as ``torch.load`` gives it."""
    ckpt = deepspeed_ckpts[2] / "zero"
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    url, so = publish(ckpt)
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(f"{url}/{name}", storage_options=so)
    message = str(err.value)
    assert name in message
    assert all(g in message for g in _ZERO_GLOBALS)
    opts = asyncload.LoadOptions(safe_globals=_ZERO_GLOBALS)
    got = asyncload.read_state_dict(f"{url}/{name}", storage_options=so, options=opts)
    want = torch.load(ckpt / name, weights_only=False)  # the test's own file
    assert_same(got, want)
    state = got["optimizer_state_dict"]["base_optimizer_state"]["state"]
    assert state[0]["step"].item() == 2


def test_deepspeed_zero2_resume_through_asyncload(
    deepspeed_ckpts: dict[int, Path], tmp_path: Path
) -> None:
    """DeepSpeed's own ``load_checkpoint`` with its checkpoint engine reading through
    ``asyncload.read_state_dict``: the next step equals its default resume's (``torch.load``)."""
    ckpt = deepspeed_ckpts[2]
    _deepspeed("asyncload", "2", str(tmp_path), str(ckpt))
    _deepspeed("torch", "2", str(tmp_path), str(ckpt))
    got = torch.load(tmp_path / "asyncload.pt", weights_only=True)
    want = torch.load(tmp_path / "torch.pt", weights_only=True)
    saved = torch.load(ckpt / "zero" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    _assert_params_equal(got["loaded"], list(saved.values()))  # the run's weights, not seed 3's
    _assert_params_equal(got["stepped"], want["stepped"])
    assert not torch.equal(got["stepped"][0], got["loaded"][0])


def test_deepspeed_zero3_optimizer_states_refused(deepspeed_ckpts: dict[int, Path]) -> None:
    """ZeRO-3 saves its fp32 partitions as tensors with a Python attribute (``ds_id``), which
    asyncload does not read (``torch.load(weights_only=True)`` does, with DeepSpeed's classes
    allowed): refused, naming the file, the key and the reason; never an internal error."""
    ckpt = deepspeed_ckpts[3] / "zero"
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    opts = asyncload.LoadOptions(safe_globals=_ZERO_GLOBALS)
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(ckpt / name, options=opts)
    message = str(err.value)
    assert name in message and "optimizer_state_dict.fp32_flat_groups.0" in message
    assert "asyncload does not read" in message


def test_prefix_holding_the_tensors_wins_over_one_holding_sizes(tmp_path: Path) -> None:
    """DeepSpeed's model-states layout, reduced: the module's names under ``module`` (tensors)
    and under ``param_shapes.0`` (``torch.Size`` objects): a ``model.state_dict()``
    destination is loaded from under ``module``, not refused as ambiguous."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sd = model.state_dict()
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": sd, "param_shapes": [{k: v.shape for k, v in sd.items()}]}, path)
    dest = torch.nn.Linear(3, 2).state_dict()
    stats = asyncload.load(dest, path)
    assert stats.key_prefix == "module"
    assert_same(dict(dest), dict(sd))
