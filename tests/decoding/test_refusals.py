"""One refusal tells everything at once (issue 42, item 4).

Every file here is written by the real tool: transformers' ``Trainer.save_model`` (its
``training_args.bin``), ``torch.save(model)``, torch's sparse layouts, quantized tensors and
``quantize_dynamic``'s state dict. ``torch.load(weights_only=True)`` reads each of the tensor
files; asyncload either reads them or refuses them saying it does not read them, naming the
file and the key, on every face, also after the user trusts the rebuild function the first
refusal named (never an internal error). A refused pickle is scanned whole without running
anything: the refusal lists every global it needs at once, says which are data-only, and
whether the file would be a state dict at all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import pickletools
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import asyncload
from asyncload import LoadOptions, UnsafeCheckpointError
from asyncload.decoding.allowlist import record_globals, safe_loads

pytestmark = pytest.mark.timeout(120)


def _pickle_globals(path: Path) -> list[str]:
    """Every global a torch.save file's pickle names that the record allow-list lacks, read
    with pickletools (the reference the refusal is checked against)."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        data = z.read(name)
    out: list[tuple[str, str]] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, _, qualname = str(arg).partition(" ")
            out.append((module, qualname))
        elif op.name == "STACK_GLOBAL":
            out.append((strings[-2], strings[-1]))
        elif isinstance(arg, str):
            strings.append(arg)
    allowed = record_globals()
    return [f"{m}.{n}" for m, n in dict.fromkeys(out) if (m, n) not in allowed]


def _faces(path: Path, options: LoadOptions | None = None) -> list[BaseException]:
    """The error of every face reading ``path``."""
    errors: list[BaseException] = []
    calls = [
        lambda: asyncload.read_state_dict(path, options=options),
        lambda: asyncload.load({}, path, options=options, allow_partial_load=True),
        lambda: asyncio.run(asyncload.aload({}, path, options=options, allow_partial_load=True)),
        lambda: list(asyncload.iter_tensors(path, options=options)),
    ]
    for call in calls:
        with pytest.raises(asyncload.AsyncLoadError) as err:
            call()
        errors.append(err.value)
    return errors


# --- a Trainer checkpoint's training_args.bin ------------------------------------------------


@pytest.fixture(scope="module")
def trainer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder written by transformers' own ``Trainer.save_model``: ``training_args.bin``
    (``torch.save(self.args)``) beside the model's safetensors."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("trainer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.GPT2Config(
            n_layer=1,
            n_embd=8,
            n_head=2,
            vocab_size=16,
            n_positions=8,
            eos_token_id=0,
            bos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
        args = transformers.TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True)
        transformers.Trainer(model=model, args=args).save_model(str(out))
    assert (out / "training_args.bin").is_file()
    return out


def test_training_args_bin_says_it_holds_no_tensors(trainer_dir: Path) -> None:
    path = trainer_dir / "training_args.bin"
    needed = _pickle_globals(path)
    assert "accelerate.state.PartialState" in needed and len(needed) >= 5
    for err in _faces(path):
        msg = str(err)
        assert isinstance(err, UnsafeCheckpointError), msg
        assert str(path) in msg and "nothing from it was executed" in msg
        assert (
            "holds a `TrainingArguments` object, not tensors: nothing to load into a model" in msg
        )
        # every name at once, each said to be data-only (transformers is imported here: its
        # enums and dataclasses are known without importing anything)
        assert (
            f"It names {len(needed)} globals outside the allow-list ({len(needed)} data-only)"
            in msg
        )
        for name in needed:
            assert name in msg, name
        # the key path of each
        assert "'lr_scheduler_type'" in msg and "'distributed_state'" in msg
        # no round of "add this safe_global": the file is not a state dict
        assert "LoadOptions(safe_globals=" not in msg

    # trusting some of them: the refusal lists the rest, and still says what the file is
    trusted = LoadOptions(safe_globals=["transformers.training_args.TrainingArguments"])
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(path, options=trusted)
    msg = str(err.value)
    assert f"It names {len(needed) - 1} globals" in msg
    assert "nothing to load into a model" in msg

    # the model beside it loads as usual
    st = trainer_dir / "model.safetensors"
    from safetensors.torch import load_file

    want = load_file(st)
    got = asyncload.read_state_dict(st)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))


# --- torch.save(model) -------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_pickled_module_says_save_its_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(_model(), path)
    needed = _pickle_globals(path)
    assert {"torch.nn.modules.container.Sequential", "torch.nn.modules.linear.Linear"} <= set(
        needed
    )
    for err in _faces(path):
        msg = str(err)
        assert isinstance(err, UnsafeCheckpointError), msg
        assert str(path) in msg
        assert "pickled nn.Module (Sequential: torch.save(model))" in msg
        assert "save `model.state_dict()` instead" in msg
        for name in needed:
            assert name in msg
        assert "LoadOptions(safe_globals=" not in msg  # listing classes one by one is no fix

    # inside a dict: the key that holds it
    path2 = tmp_path / "bundle.pt"
    torch.save({"epoch": 3, "model": _model()}, path2)
    with pytest.raises(UnsafeCheckpointError) as bundle:
        asyncload.read_state_dict(path2)
    assert "it holds a pickled nn.Module, at 'model'" in str(bundle.value)
    assert "state_dict()" in str(bundle.value)

    # the fix the message gives works: the state dict loads bit for bit
    path3 = tmp_path / "weights.pt"
    torch.save(_model().state_dict(), path3)
    dest = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).state_dict()
    asyncload.load(dest, path3)
    for k, v in torch.load(path3, weights_only=True).items():
        assert torch.equal(dest[k], v)


# --- what torch.load(weights_only=True) reads and asyncload does not -----------------------


def _dense() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    d = torch.randn(4, 6, generator=g)
    d[d < 0.3] = 0
    return d


def _quantize_dynamic_state_dict() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(_model(), {nn.Linear}, dtype=torch.qint8)
        return q.state_dict()


def _qtensor(per_channel: bool) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if per_channel:
            return torch.quantize_per_channel(
                x, torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2]), 0, torch.qint8
            )
        return torch.quantize_per_tensor(x, 0.1, 2, torch.quint8)


#: case -> (what torch.save writes, the key path named, what the refusal calls it, the rebuild
#: function a user might trust after the first refusal)
UNREAD: dict[str, tuple[Any, str, str, str]] = {
    "sparse COO": (
        lambda: {"w": _dense().to_sparse()},
        "'w'",
        "sparse tensor (torch.sparse_coo)",
        "_rebuild_sparse_tensor",
    ),
    "sparse CSR": (
        lambda: {"w": _dense().to_sparse_csr()},
        "'w'",
        "sparse tensor (torch.sparse_csr)",
        "_rebuild_sparse_tensor",
    ),
    "sparse CSC": (
        lambda: {"w": _dense().to_sparse_csc()},
        "'w'",
        "sparse tensor (torch.sparse_csc)",
        "_rebuild_sparse_tensor",
    ),
    "sparse BSR": (
        lambda: {"w": _dense().to_sparse_bsr((2, 2))},
        "'w'",
        "sparse tensor (torch.sparse_bsr)",
        "_rebuild_sparse_tensor",
    ),
    "sparse BSC": (
        lambda: {"w": _dense().to_sparse_bsc((2, 2))},
        "'w'",
        "sparse tensor (torch.sparse_bsc)",
        "_rebuild_sparse_tensor",
    ),
    "per-tensor quantized": (
        lambda: {"q": _qtensor(False)},
        "'q'",
        "a quantized tensor",
        "_rebuild_qtensor",
    ),
    "per-channel quantized": (
        lambda: {"q": _qtensor(True)},
        "'q'",
        "a quantized tensor",
        "_rebuild_qtensor",
    ),
    "quantize_dynamic packed params": (
        _quantize_dynamic_state_dict,
        "'0._packed_params._packed_params.0', '2._packed_params._packed_params.0'",
        "the packed weights of a quantized module",
        "_rebuild_qtensor",
    ),
}


@pytest.mark.parametrize("case", list(UNREAD))
def test_tensors_asyncload_does_not_read_are_refused_as_such(tmp_path: Path, case: str) -> None:
    make, keys, what, rebuild = UNREAD[case]
    path = tmp_path / "t.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that quantized tensors are deprecated
        torch.save(make(), path)
        assert torch.load(path, weights_only=True)  # torch's own safe reader reads it
    for options in (
        None,
        # the advice a user followed before: trusting the rebuild function
        LoadOptions(safe_globals=[f"torch._utils.{rebuild}"]),
        LoadOptions(safe_globals=[getattr(torch._utils, rebuild)]),
    ):
        for err in _faces(path, options):
            msg = str(err)
            assert type(err) is UnsafeCheckpointError, msg
            assert str(path) in msg and keys in msg and what in msg, msg
            assert "which asyncload does not read: " in msg
            assert "torch.load(path, weights_only=True)" in msg
            assert "nothing from it was executed" in msg


def test_one_refusal_names_unreadable_tensors_and_missing_globals(tmp_path: Path) -> None:
    path = tmp_path / "mixed.pt"
    torch.save(
        {"w": torch.ones(3), "s": _dense().to_sparse(), "args": argparse.Namespace(lr=0.1)}, path
    )
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(path)
    msg = str(err.value)
    assert "Key 's' holds a sparse tensor (torch.sparse_coo)" in msg
    assert "argparse.Namespace (data-only: plain data, at 'args')" in msg


def test_data_only_and_code_are_told_apart_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Runs:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "hostile.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(a=1), "x": Runs()}, path)
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(path)
    msg = str(err.value)
    assert not marker.exists()
    assert "it holds a dict (a state dict once what it needs is there)" in msg
    assert "(1 data-only)" in msg
    assert "argparse.Namespace (data-only: plain data, at 'args')" in msg
    system = f"{os.system.__module__}.system"
    assert f"{system} (a function or constructor called with a value, at 'x')" in msg
    assert f'LoadOptions(safe_globals=["argparse.Namespace", "{system}"])' in msg
    assert f"({system} then runs their own code)" in msg


def test_a_damaged_pickle_after_a_refused_name_is_still_refused(tmp_path: Path) -> None:
    """The scan of a refusal never raises its own error: a pickle cut after the refused
    global lists what it saw."""
    data = pickle.dumps({"a": argparse.Namespace(x=1)}, protocol=2)
    cut = data[: data.index(b"Namespace") + 20]
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_loads(cut, what="cut.pkl", allowed=record_globals(), safe_globals=())
    assert "argparse.Namespace" in str(err.value) and "The scan stopped early" in str(err.value)


def test_a_refused_value_names_its_key(tmp_path: Path) -> None:
    """A refusal of data an allowed name is given (a numpy object array) names the key it
    was building, found by scanning the pickle up to the refused opcode, and then whole."""
    import numpy as np

    path = tmp_path / "opt.pt"
    torch.save(
        {
            "w": torch.ones(2),
            "opt": {"lr": 0.1, "x": np.array([1, "a"], dtype=object), "y": np.zeros(2)},
        },
        path,
    )
    for err in _faces(path):
        msg = str(err)
        assert isinstance(err, UnsafeCheckpointError), msg
        assert msg.startswith(f"{path} (data.pkl) (key 'opt.x'): ") and "dtype 'O'" in msg
