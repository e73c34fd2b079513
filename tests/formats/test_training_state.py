"""What training loops save next to their weights, read back as torch's own reader gives it.

Optimizer state dicts (int keys, tuples, param groups), RNG states (numpy's, Python's,
torch's), schedulers, written by the real tools (``torch.save``, accelerate's
``save_state``, the Hugging Face Trainer, ``dcp.save``), read by asyncload locally and from
S3 on loopback, compared exactly with ``torch.load`` (types of keys and containers, key
order, tensors bit for bit) and then used: the optimizer's next step and the next random
draws equal the reference's. Then the allow-list: numpy data decoded but never object
arrays or forged states, ``LoadOptions.safe_globals`` for what the user trusts, and a
planner that decodes objects itself (``load_bytes``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import dataclasses
import io
import os
import pickle
import random
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncload
from asyncload import (
    CheckpointFormatError,
    LoadOptions,
    PipelinedLoadPlanner,
    PipelinedReader,
    UnsafeCheckpointError,
)

pytestmark = pytest.mark.timeout(180)

WHERE = ["local", "s3"]


# --- exact comparison -------------------------------------------------------------------


def assert_same(got: Any, want: Any, where: str = "root") -> None:
    """``got`` is ``want`` as torch.load gives it: the same types (of keys and containers
    too), key order, attributes of state dicts (``_metadata``), tensors bit for bit with
    dtype, shape, stride and requires_grad, numpy arrays byte for byte with dtype and strides."""
    assert type(got) is type(want), (
        f"{where}: {type(got).__name__} where torch.load gives {type(want).__name__}"
    )
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.requires_grad) == (
            want.dtype,
            want.shape,
            want.stride(),
            want.requires_grad,
        ), (
            f"{where}: {got.dtype} {list(got.shape)} {got.stride()} vs {want.dtype} {list(want.shape)} {want.stride()}"
        )
        a, b = got.detach().contiguous(), want.detach().contiguous()
        assert a.view(-1).view(torch.uint8).tolist() == b.view(-1).view(torch.uint8).tolist(), (
            where
        )
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape, got.strides) == (want.dtype, want.shape, want.strides), where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], (
            f"{where}: keys {list(got)} vs {list(want)}"
        )
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
        assert vars(got).keys() == vars(want).keys() if hasattr(want, "__dict__") else True, where
        if hasattr(want, "_metadata"):
            assert_same(got._metadata, want._metadata, f"{where}._metadata")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items vs {len(want)}"
        for i, (x, y) in enumerate(zip(got, want)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(want, float) and want != want:
        assert got != got, where
    elif hasattr(want, "__dict__") and not isinstance(want, type):
        assert_same(vars(got), vars(want), f"{where}.__dict__")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def test_assert_same_can_fail() -> None:
    """The comparison above tells apart what the issue reported as lost."""
    for got, want in [
        ({"0": 1}, {0: 1}),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({"t": [1, 2]}, {"t": (1, 2)}),
        ({}, collections.OrderedDict()),
        (torch.ones(2, 3).t().contiguous(), torch.ones(2, 3).t()),
        (np.zeros(2, dtype=">u4"), np.zeros(2, dtype="<u4")),
    ]:
        with pytest.raises(AssertionError):
            assert_same(got, want)


# --- where the checkpoint is read from -----------------------------------------------------


# --- optimizer state dicts ------------------------------------------------------------------


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def _resumed_step(
    model: torch.nn.Module, make: Callable[[Any], torch.optim.Optimizer], state: Any
) -> list[torch.Tensor]:
    """The parameters after one step of a fresh copy of ``model`` whose optimizer was loaded from ``state``."""
    m = copy.deepcopy(model)
    opt = make(m.parameters())
    opt.load_state_dict(state)
    _step(m, opt, 99)
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_dict_is_what_torch_load_gives(
    tmp_path: Path, publish: Any, name: str, where: str
) -> None:
    make = OPTIMIZERS[name]
    model = _model()
    opt = make(model.parameters())
    for i in range(2):
        _step(model, opt, i)
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    url, so = publish(path)

    got = asyncload.read_state_dict(url, storage_options=so)
    want = torch.load(path, weights_only=True)
    assert_same(got, want)
    assert list(got["state"]) == [0, 1, 2, 3]  # the parameter indices, as ints
    assert type(got["param_groups"][0]["params"]) is list
    # used as a resume uses it: the next step is the reference's, bit for bit
    after_got = _resumed_step(model, make, got)
    after_want = _resumed_step(model, make, want)
    for a, b in zip(after_got, after_want):
        assert torch.equal(a, b)
    untouched = _resumed_step(model, make, make(_model().parameters()).state_dict())
    assert not all(torch.equal(a, b) for a, b in zip(after_got, untouched))  # the state mattered


def test_structure_and_storages_as_torch_load(tmp_path: Path) -> None:
    """Int, tuple and str keys in the saved order, tuples, OrderedDict (with a state dict's
    ``_metadata``), empty containers, scalars; tied and transposed tensors share one storage."""
    model = _model()
    w = torch.randn(4, 6)
    sd = {
        "t": (1, 2.5, "x", None, True, b"ab", 1 + 2j),
        "od": collections.OrderedDict(b=torch.ones(2), a=torch.zeros(1)),
        "l": [torch.zeros(1), 3],
        "empty": {},
        "nested_empty": {"x": {}, "y": []},
        "tied_a": w,
        "tied_b": w,
        "w_t": w.t(),
        "row": w[1],
        (1, 2): "tuple key",
        3: torch.arange(3),
        "model": model.state_dict(),
        "p": torch.nn.Parameter(torch.ones(2)),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "set": {1, 2},
    }
    path = tmp_path / "mixed.pt"
    torch.save(sd, path)
    got = asyncload.read_state_dict(path)
    want = torch.load(path, weights_only=True)
    assert_same(got, want)
    assert got["tied_a"] is got["tied_b"]
    assert got["w_t"].untyped_storage().data_ptr() == got["tied_a"].untyped_storage().data_ptr()
    assert got["row"].storage_offset() == want["row"].storage_offset() == 6
    assert got["model"]._metadata == want["model"]._metadata

    # a selection keeps the structure of what it selects (names as iter_tensors gives them)
    part = asyncload.read_state_dict(path, keys=["od.a", "l.1", "3", "model.0.weight"])
    assert list(part) == ["od", "l", 3, "model"]
    assert type(part["od"]) is collections.OrderedDict and list(part["od"]) == ["a"]
    assert part["l"] == [None, 3]
    assert list(part["model"]) == ["0.weight"] and torch.equal(
        part["model"]["0.weight"], want["model"]["0.weight"]
    )
    names = [n for n, _ in asyncload.iter_tensors(path, keys="od")]
    assert names == ["od.b", "od.a"]


def test_indexed_torch_save_shards_merge_in_file_order(tmp_path: Path) -> None:
    """``pytorch_model.bin.index.json`` shards: one dict, keys in the shards' order."""
    import json

    a = {"x.weight": torch.randn(3), "x.bias": torch.randn(2)}
    b = {"y.weight": torch.randn(4)}
    torch.save(a, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save(b, tmp_path / "pytorch_model-00002-of-00002.bin")
    wm = dict.fromkeys(a, "pytorch_model-00001-of-00002.bin") | dict.fromkeys(
        b, "pytorch_model-00002-of-00002.bin"
    )
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm})
    )
    got = asyncload.read_state_dict(tmp_path)
    assert_same(got, {**a, **b})


# --- accelerate ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """``Accelerator().save_state(dir)`` after one step of AdamW with a StepLR schedule: its
    ``optimizer.bin``, ``scheduler.bin`` and ``random_states_0.pkl``, and the model before the step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    out = tmp_path_factory.mktemp("accelerate") / "state"
    model = _model(1)
    before = copy.deepcopy(model)
    opt = OPTIMIZERS["AdamW"](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    try:
        with warnings.catch_warnings():  # the tool's own warnings, not asyncload's
            warnings.simplefilter("ignore")
            acc = Accelerator(cpu=True)
            model, opt, sched = acc.prepare(model, opt, sched)
            np.random.seed(5)
            random.seed(5)
            acc.backward(model(torch.randn(3, 4)).square().sum())
            opt.step()
            sched.step()
            acc.save_state(str(out))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return out, before


@pytest.mark.parametrize("where", WHERE)
def test_accelerate_save_state(
    accelerate_state: tuple[Path, torch.nn.Module], publish: Any, where: str
) -> None:
    state_dir, model = accelerate_state
    url, so = publish(state_dir)
    assert {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= set(os.listdir(state_dir))

    def read(name: str) -> Any:
        return asyncload.read_state_dict(f"{url}/{name}", storage_options=so)

    opt_got, opt_want = (
        read("optimizer.bin"),
        torch.load(state_dir / "optimizer.bin", weights_only=True),
    )
    assert_same(opt_got, opt_want)
    assert len(opt_got["state"]) == 4  # every parameter's state restored (the issue: 0 of 4)
    for a, b in zip(
        _resumed_step(model, OPTIMIZERS["AdamW"], opt_got),
        _resumed_step(model, OPTIMIZERS["AdamW"], opt_want),
    ):
        assert torch.equal(a, b)
    assert_same(read("scheduler.bin"), torch.load(state_dir / "scheduler.bin", weights_only=True))

    rng_got = read("random_states_0.pkl")
    # numpy's state: torch.load refuses it with weights_only=True; this is the test's own file
    rng_want = torch.load(state_dir / "random_states_0.pkl", weights_only=False)
    assert_same(rng_got, rng_want)
    assert _draws(
        rng_got["random_state"], rng_got["numpy_random_seed"], rng_got["torch_manual_seed"]
    ) == _draws(
        rng_want["random_state"], rng_want["numpy_random_seed"], rng_want["torch_manual_seed"]
    )


def _draws(py: Any, np_state: Any, torch_state: torch.Tensor) -> tuple[Any, ...]:
    """Draws after restoring the three generators (their state before and after is kept)."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        return (
            [random.random() for _ in range(3)],
            np.random.rand(3).tolist(),
            np.random.randn(2).tolist(),  # the cached Gaussian too
            torch.rand(3).tolist(),
        )
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


# --- the Hugging Face Trainer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A 2-step ``Trainer`` run of a tiny random ``LlamaForCausalLM`` (no hub) saving at step 2:
    ``checkpoint-2/{optimizer.pt,rng_state.pth,scheduler.pt}``; and a copy of the model at step 2."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(8) * 7 + i) % 64
            return {"input_ids": ids, "labels": ids}

    out = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return out / "checkpoint-2", copy.deepcopy(model)


@pytest.mark.parametrize("where", WHERE)
def test_trainer_checkpoint_files(
    trainer_checkpoint: tuple[Path, torch.nn.Module], publish: Any, where: str
) -> None:
    ckpt, model = trainer_checkpoint
    url, so = publish(ckpt)

    rng_got = asyncload.read_state_dict(f"{url}/rng_state.pth", storage_options=so)
    rng_want = torch.load(
        ckpt / "rng_state.pth", weights_only=False
    )  # numpy's state: the test's own file
    assert_same(rng_got, rng_want)
    assert _draws(rng_got["python"], rng_got["numpy"], rng_got["cpu"]) == _draws(
        rng_want["python"], rng_want["numpy"], rng_want["cpu"]
    )

    opt_got = asyncload.read_state_dict(f"{url}/optimizer.pt", storage_options=so)
    opt_want = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert_same(opt_got, opt_want)
    n_params = len(list(model.parameters()))
    assert sorted(opt_got["state"]) == list(range(n_params))

    from transformers import Trainer

    def resume(state: Any) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        decay = set(Trainer.get_decay_parameter_names(None, m))  # type: ignore[arg-type]  # the Trainer's two groups
        named = list(m.named_parameters())
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if n in decay]},
                {"params": [p for n, p in named if n not in decay]},
            ]
        )
        opt.load_state_dict(state)
        ids = torch.arange(8).unsqueeze(0) % 64
        opt.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        return [p.detach().clone() for p in m.parameters()]

    for a, b in zip(resume(opt_got), resume(opt_want)):
        assert torch.equal(a, b)
    assert_same(
        asyncload.read_state_dict(f"{url}/scheduler.pt", storage_options=so),
        torch.load(ckpt / "scheduler.pt", weights_only=True),
    )


# --- DCP objects -----------------------------------------------------------------------------


def _training_state(seed: int) -> dict[str, Any]:
    model = _model(seed)
    opt = OPTIMIZERS["Adam"](model.parameters())
    _step(model, opt, seed)
    rs = np.random.RandomState(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": {
            "numpy": rs.get_state(),
            "python": random.Random(seed).getstate(),
            "torch": torch.get_rng_state(),
        },
        "np_scalar": np.float32(1.5),
        "np_array": np.arange(6, dtype=">i4").reshape(2, 3),
        "step": 7,
    }


@pytest.mark.parametrize("where", WHERE)
def test_dcp_objects_as_torch_reader_gives_them(tmp_path: Path, publish: Any, where: str) -> None:
    """A DCP checkpoint with objects: read_state_dict equals torch's own reader
    (``dcp_to_torch_save``: its ``_EmptyStateDictLoadPlanner``), numpy data included."""
    ckpt = tmp_path / "ckpt"
    dcp.save(_training_state(3), checkpoint_id=ckpt)
    dcp_to_torch_save(ckpt, tmp_path / "torch.pt")
    want = torch.load(tmp_path / "torch.pt", weights_only=False)  # numpy: the test's own file
    url, so = publish(ckpt)
    got = asyncload.read_state_dict(url, storage_options=so)
    assert_same(got, want)
    assert list(got["optim"]["state"]) == [
        "0",
        "1",
        "2",
        "3",
    ]  # DCP saved them as strings: torch's reader too

    # and into a destination, as dcp.load with torch's reader fills it
    def dest() -> dict[str, Any]:
        d = _training_state(4)
        d["rng"]["torch"] = torch.zeros_like(d["rng"]["torch"])
        return d

    mine, theirs = dest(), dest()
    asyncload.load(mine, url, storage_options=so)
    dcp.load(theirs, checkpoint_id=ckpt)
    assert_same(mine, theirs)
    assert_same(mine["rng"]["numpy"], _training_state(3)["rng"]["numpy"])


def test_numpy_and_python_rng_in_a_torch_save_file(tmp_path: Path) -> None:
    """numpy 1.x names (``numpy.core.multiarray``) too, and every plain dtype numpy pickles."""
    values = {
        "state": np.random.RandomState(1).get_state(),
        "py": random.Random(2).getstate(),
        "scalars": [
            np.float16(1.5),
            np.int64(-3),
            np.bool_(True),
            np.complex64(1 - 2j),
            np.uint8(7),
        ],
        "arrays": [
            np.arange(12, dtype="<f8").reshape(3, 4).T,  # Fortran order
            np.array([b"ab", b"c"], dtype="S2"),
            np.array(["x", "yz"], dtype="U2"),
            np.array([1, 2], dtype="datetime64[ns]"),
            np.array([3], dtype="timedelta64[10s]"),
            np.zeros((0, 3), dtype="u2"),
            np.array(5.0),
            np.ones(3, dtype=">c16"),
        ],
        "dtype": np.dtype(">i2"),
    }
    path = tmp_path / "np.pt"
    torch.save(values, path)
    assert_same(asyncload.read_state_dict(path), torch.load(path, weights_only=False))
    # as numpy 1.x writes them
    raw = _with_pickle(
        path, lambda p: p.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    )
    old = tmp_path / "np1.pt"
    old.write_bytes(raw)
    assert b"numpy.core.multiarray" in raw
    assert_same(asyncload.read_state_dict(old), torch.load(path, weights_only=False))


def _with_pickle(path: Path, edit: Callable[[bytes], bytes]) -> bytes:
    """The torch.save file at ``path`` with its data.pkl edited (the zip written again)."""
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, edit(data) if info.filename.endswith("data.pkl") else data)
    return buf.getvalue()


# --- hostile numpy data ----------------------------------------------------------------------


class _Reduce:
    """Pickles as ``func(*args)`` then BUILD ``state``: a forged numpy record."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _np_core() -> Any:
    from numpy._core import multiarray

    return multiarray


def _forged_array(shape: Any, dtype: Any, raw: Any, version: int = 1) -> _Reduce:
    return _Reduce(
        _np_core()._reconstruct, (np.ndarray, (0,), b"b"), (version, shape, dtype, False, raw)
    )


HOSTILE_NUMPY: dict[str, tuple[Any, type[Exception], str]] = {
    "object array": (np.array([1, "a"], dtype=object), UnsafeCheckpointError, "dtype 'O'"),
    "structured with objects": (
        np.zeros(1, dtype=[("a", "i4"), ("b", "O")]),
        UnsafeCheckpointError,
        "dtype 'O'",
    ),
    "structured": (
        np.zeros(1, dtype=[("a", "i4")]),
        UnsafeCheckpointError,
        "structured numpy dtype",
    ),
    "shape past the bytes": (
        _forged_array((10,), np.dtype("f8"), b"\0" * 8),
        CheckpointFormatError,
        "needs 80 bytes",
    ),
    "huge shape": (
        _forged_array((1 << 40, 1 << 20), np.dtype("f8"), b"\0" * 8),
        CheckpointFormatError,
        "needs",
    ),
    "negative shape": (
        _forged_array((-1,), np.dtype("f8"), b""),
        CheckpointFormatError,
        "malformed shape",
    ),
    "object data": (
        _forged_array((1,), np.dtype("f8"), [1.0]),
        UnsafeCheckpointError,
        "dtype 'O'",
    ),
    "bad version": (
        _forged_array((1,), np.dtype("f8"), b"\0" * 8, version=2),
        CheckpointFormatError,
        "state",
    ),
    "bad type code": (
        _Reduce(np.dtype, ("q9", False, True)),
        CheckpointFormatError,
        "numpy.dtype",
    ),
    "shared dtype (copy=False)": (
        _Reduce(np.dtype, ("f8", False, False)),
        CheckpointFormatError,
        "numpy.dtype",
    ),
    "dtype state not numpy's": (
        _Reduce(np.dtype, ("f8", False, True), (3, "<", None, None, None, 99, -1, 0)),
        CheckpointFormatError,
        "state numpy does not write",
    ),
    "dtype byte order": (
        _Reduce(np.dtype, ("f8", False, True), (3, "!", None, None, None, -1, -1, 0)),
        CheckpointFormatError,
        "byte order",
    ),
    "scalar of the wrong size": (
        _Reduce(_np_core().scalar, (np.dtype("f8"), b"\0" * 3)),
        CheckpointFormatError,
        "numpy scalar",
    ),
    "Generator (not data)": (np.random.default_rng(0), UnsafeCheckpointError, "safe_globals"),
}


@pytest.mark.parametrize("case", list(HOSTILE_NUMPY))
def test_hostile_numpy_data_is_refused(tmp_path: Path, case: str) -> None:
    obj, error, says = HOSTILE_NUMPY[case]
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2), "x": obj}, path)
    tracemalloc.start()
    try:
        with pytest.raises(error) as err:
            asyncload.read_state_dict(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert says in str(err.value)
    assert "data.pkl" in str(err.value) and str(path) in str(err.value)
    assert peak < 32 << 20  # nothing allocated for what the forged shape claims

    # the same object in a DCP checkpoint: the record's decode refuses it the same way
    ckpt = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "x": obj}, checkpoint_id=ckpt)
    with pytest.raises(error) as err:
        asyncload.read_state_dict(ckpt)
    assert says in str(err.value) and "object 'x'" in str(err.value)


# --- LoadOptions.safe_globals ----------------------------------------------------------------


@dataclasses.dataclass
class RunConfig:
    """A user's own class saved with its checkpoint."""

    lr: float
    layers: list[int]


class WithState:
    """A class that restores itself (``__setstate__``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __getstate__(self) -> dict[str, Any]:
        return {"stored": self.value}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.value = state["stored"] * 10


@pytest.mark.parametrize("where", WHERE)
def test_safe_globals(tmp_path: Path, publish: Any, where: str) -> None:
    saved = {
        "args": argparse.Namespace(
            lr=0.1, name="run", sizes=(1, 2), scale=torch.full((2,), 0.5)
        ),  # a tensor inside
        "config": RunConfig(0.5, [1, 2]),
        "custom": WithState(4),
        "w": torch.arange(4.0),
    }
    path = tmp_path / "with_objects.pt"
    torch.save(saved, path)
    url, so = publish(path)

    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(url, storage_options=so)
    msg = str(err.value)
    # every name the file needs, in one refusal (the pickle scanned whole, nothing run)
    assert 'LoadOptions(safe_globals=["argparse.Namespace", "' in msg
    assert "RunConfig" in msg and "WithState" in msg and "(3 data-only)" in msg
    assert "nothing from it was executed" in msg

    with pytest.raises(UnsafeCheckpointError, match=r'safe_globals=\["[\w.]*RunConfig", "'):
        asyncload.read_state_dict(
            url, storage_options=so, options=LoadOptions(safe_globals=[argparse.Namespace])
        )

    trusted = LoadOptions(safe_globals=["argparse.Namespace", RunConfig, WithState])
    got = asyncload.read_state_dict(url, storage_options=so, options=trusted)
    torch.serialization.add_safe_globals([argparse.Namespace, RunConfig, WithState])
    try:
        want = torch.load(path, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
    assert_same(got, want)
    assert got["custom"].value == 40  # its __setstate__ ran, as torch.load runs it

    # load into a destination: the objects placed, the tensor in place
    dest = {"args": None, "config": None, "custom": None, "w": torch.zeros(4)}
    asyncload.load(dest, url, storage_options=so, options=trusted)
    assert_same(dest, want)


def test_safe_globals_reach_dcp_objects_and_not_metadata(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"args": argparse.Namespace(lr=0.25), "w": torch.ones(3)}, checkpoint_id=ckpt)
    trusted = LoadOptions(safe_globals=[argparse.Namespace])
    with pytest.raises(UnsafeCheckpointError, match=r'safe_globals=\["argparse.Namespace"\]'):
        asyncload.read_state_dict(ckpt)
    assert asyncload.read_state_dict(ckpt, options=trusted)["args"] == argparse.Namespace(lr=0.25)
    for face in ("load", "aload", "start_load", "dcp", "iter"):
        dest: dict[str, Any] = {"args": None, "w": torch.zeros(3)}
        if face == "load":
            asyncload.load(dest, ckpt, options=trusted)
        elif face == "aload":
            asyncio.run(asyncload.aload(dest, ckpt, options=trusted))
        elif face == "start_load":
            asyncload.start_load(dest, ckpt, options=trusted).result(timeout=60)
        elif face == "dcp":
            dcp.load(dest, storage_reader=PipelinedReader(ckpt, options=trusted))
        else:
            assert [n for n, _ in asyncload.iter_tensors(ckpt, options=trusted)] == ["w"]
            continue
        assert dest["args"] == argparse.Namespace(lr=0.25) and torch.equal(
            dest["w"], torch.ones(3)
        )

    # .metadata keeps its own strict list, whatever the user trusts
    md = tmp_path / "ckpt" / ".metadata"
    md.write_bytes(pickle.dumps(argparse.Namespace(x=1), protocol=2))
    with pytest.raises(UnsafeCheckpointError) as err:
        asyncload.read_state_dict(ckpt, options=trusted)
    assert ".metadata" in str(err.value) and "argparse.Namespace" in str(err.value)
    assert "LoadOptions(safe_globals" not in str(err.value)


def test_safe_globals_validation() -> None:
    opts = LoadOptions(safe_globals=[argparse.Namespace, "collections.Counter"])
    assert opts.safe_globals == (argparse.Namespace, "collections.Counter")
    assert hash(opts) == hash(
        LoadOptions(safe_globals=(argparse.Namespace, "collections.Counter"))
    )
    for bad, says in [
        ("argparse.Namespace", "expected a list or tuple"),
        (["Namespace"], "entry 0 ('Namespace') is not a 'module.qualname' string"),
        ([argparse.Namespace, 3], "entry 1 (3) is not a class, a function"),
        ([lambda: 0], "is a local or lambda object"),
    ]:
        with pytest.raises(ValueError, match="LoadOptions.safe_globals=") as err:
            LoadOptions(safe_globals=bad)
        assert says in str(err.value)


# --- planners that decode objects themselves (load_bytes) ---------------------------------------


class RawBytesPlanner(PipelinedLoadPlanner):
    """Decodes objects itself: gets each object's bytes, not asyncload's decode."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        self.raw[read_item.dest_index.fqn] = data
        self.load_object(
            read_item, torch.load(io.BytesIO(data), weights_only=False)
        )  # the user's own choice


def _record_bytes(ckpt: Path, fqn: str) -> bytes:
    md = dcp.FileSystemReader(ckpt).read_metadata()
    [info] = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


@pytest.mark.parametrize("face", ["dcp.load", "asyncload.load"])
def test_planner_overriding_load_bytes_gets_raw_bytes(tmp_path: Path, face: str) -> None:
    ckpt = tmp_path / "ckpt"
    saved = {"args": argparse.Namespace(lr=0.5), "w": torch.arange(3.0)}
    dcp.save(saved, checkpoint_id=ckpt)
    planner = RawBytesPlanner()
    dest: dict[str, Any] = {"args": None, "w": torch.zeros(3)}
    if face == "dcp.load":
        dcp.load(dest, storage_reader=PipelinedReader(ckpt), planner=planner)
    else:
        asyncload.load(dest, ckpt, planner=planner)
    # the record as written, untouched by the allow-list (which would refuse the Namespace)
    assert planner.raw == {"args": _record_bytes(ckpt, "args")}
    assert dest["args"] == argparse.Namespace(lr=0.5) and torch.equal(dest["w"], saved["w"])

    # a torch.save file: its objects are part of its one pickle, handed over saved again
    path = tmp_path / "plain.pt"
    torch.save({"epoch": (3, "x"), "w": torch.arange(3.0)}, path)
    planner = RawBytesPlanner()
    dest = {"epoch": None, "w": torch.zeros(3)}
    asyncload.load(dest, path, planner=planner)
    assert list(planner.raw) == ["epoch"] and dest["epoch"] == (3, "x")
