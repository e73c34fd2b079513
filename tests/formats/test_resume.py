"""A resume into the objects of a fresh run: nothing the destination asked for is dropped.

A freshly built optimizer's ``state_dict()["state"]`` is ``{}``, a fresh scheduler's dict is
passed as ``{}``: asyncload fills such empty containers from the checkpoint as ``torch.load``
+ ``load_state_dict`` would, refuses what it cannot place below a container the destination
names (``allow_partial_load=True``: a warning and ``LoadStats.unexpected_keys``), and leaves
keys outside the destination as ``dcp.load`` does. Checkpoints are written by ``torch.save``
and ``dcp.save``, the result compared exactly with torch's own reader, then used: the next
optimizer step equals the torch path's bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_training_state import assert_same
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import asyncload
from asyncload import StateDictMismatchError

pytestmark = pytest.mark.timeout(180)


WHERE = ["local", "s3"]


def _run(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    return model, opt, sched


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _next_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(11))
    model(x).square().sum().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, opt, sched = _run()
    _train(model, opt, sched, 3)
    return model, opt, sched


def _saved(trained: Any) -> dict[str, Any]:
    model, opt, sched = trained
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "epoch": 3,
    }


def _torch_path(ckpt: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    ref = torch.load(ckpt, weights_only=True)
    model, opt, sched = _run()
    model.load_state_dict(ref["model"])
    opt.load_state_dict(ref["optimizer"])
    sched.load_state_dict(ref["scheduler"])
    return model, opt


@pytest.mark.parametrize("where", WHERE)
def test_fresh_optimizer_is_filled_from_a_torch_save_file(
    tmp_path: Path, trained: Any, publish: Any, where: str
) -> None:
    ckpt = tmp_path / "ckpt.pt"
    torch.save(_saved(trained), ckpt)
    url, storage_options = publish(ckpt)
    model, opt, sched = _run()
    assert opt.state_dict()["state"] == {}
    dest = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": {},
        "epoch": 0,
    }
    stats = asyncload.load(dest, url, storage_options=storage_options)
    ref = torch.load(ckpt, weights_only=True)
    assert stats.unexpected_keys == []
    assert dest["epoch"] == 3
    # the optimizer state and the scheduler exactly as torch.load gives them (int keys,
    # exp_avg, exp_avg_sq, step, initial_lr, the tensors' dtypes and bits)
    assert_same(dest["optimizer"], ref["optimizer"])
    assert_same(dest["scheduler"], ref["scheduler"])
    opt.load_state_dict(dest["optimizer"])
    sched.load_state_dict(dest["scheduler"])
    assert_same(opt.state_dict(), _torch_path(ckpt)[1].state_dict())
    want_model, want_opt = _torch_path(ckpt)
    assert _same_tensors(_next_step(model, opt), _next_step(want_model, want_opt))


def test_optimizer_passed_as_itself_is_loaded_through_load_state_dict(
    tmp_path: Path, trained: Any
) -> None:
    """An optimizer (a ``Stateful``) in the destination: its fresh state is filled, then
    its own ``load_state_dict`` runs, as the torch path would."""
    ckpt = tmp_path / "ckpt.pt"
    torch.save(_saved(trained), ckpt)
    model, opt, _ = _run()
    asyncload.load({"model": model, "optimizer": opt}, ckpt)  # scheduler, epoch: outside
    want_model, want_opt = _torch_path(ckpt)
    assert_same(opt.state_dict()["state"], want_opt.state_dict()["state"])
    assert _same_tensors(_next_step(model, opt), _next_step(want_model, want_opt))


@pytest.mark.parametrize("where", WHERE)
def test_dcp_checkpoint_fills_a_fresh_optimizer(
    tmp_path: Path, trained: Any, publish: Any, where: str
) -> None:
    """``dcp.load`` leaves the fresh optimizer's ``state`` empty (the reference below shows
    it); asyncload fills it, its parameter ids back to the ints ``param_groups`` name."""
    saved = _saved(trained)
    dcp.save(saved, checkpoint_id=tmp_path / "dcp")
    url, storage_options = publish(tmp_path / "dcp")
    model, opt, _ = _run()
    dest = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 0}
    model2, opt2, _ = _run()
    theirs = {"model": model2.state_dict(), "optimizer": opt2.state_dict(), "epoch": 0}
    dcp.load(theirs, checkpoint_id=tmp_path / "dcp")
    assert theirs["optimizer"]["state"] == {}  # what dcp.load does
    stats = asyncload.load(dest, url, storage_options=storage_options)
    assert [k for k in stats.unexpected_keys if not k.startswith("scheduler.")] == []
    assert_same(dest["optimizer"]["state"], saved["optimizer"]["state"])
    opt.load_state_dict(dest["optimizer"])
    model.load_state_dict(dest["model"])
    want_model, want_opt = _torch_path_from(saved)
    assert _same_tensors(_next_step(model, opt), _next_step(want_model, want_opt))


def _torch_path_from(saved: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt, _ = _run()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return model, opt


def test_get_state_dict_destination_maps_int_ids_to_names(tmp_path: Path, trained: Any) -> None:
    """A ``get_state_dict`` optimizer (keyed by parameter names) from a torch.save'd
    ``opt.state_dict()`` (keyed by int ids), then ``set_state_dict``: the torch path's step."""
    ckpt = tmp_path / "ckpt.pt"
    torch.save(_saved(trained), ckpt)
    model, opt, _ = _run()
    msd, osd = get_state_dict(model, opt)
    dest = {"model": msd, "optimizer": osd}
    asyncload.load(dest, ckpt)
    names = [n for n, _ in model.named_parameters()]
    assert list(dest["optimizer"]["state"]) == names
    assert dest["optimizer"]["param_groups"][0]["params"] == names
    set_state_dict(model, opt, model_state_dict=dest["model"], optim_state_dict=dest["optimizer"])
    want_model, want_opt = _torch_path(ckpt)
    assert_same(opt.state_dict()["state"], want_opt.state_dict()["state"])
    assert _same_tensors(_next_step(model, opt), _next_step(want_model, want_opt))


@pytest.mark.parametrize("fmt", ["torch.save", "dcp"])
def test_entries_that_cannot_be_placed_are_refused(tmp_path: Path, trained: Any, fmt: str) -> None:
    saved = _saved(trained)
    if fmt == "dcp":
        dcp.save(saved, checkpoint_id=tmp_path / "ck")
    else:
        torch.save(saved, tmp_path / "ck")
    model, _, _ = _run()
    small = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    with pytest.raises(StateDictMismatchError) as info:
        asyncload.load({"model": small, "epoch": 0}, tmp_path / "ck")
    assert "'model.2.bias'" in str(info.value) and "allow_partial_load=True" in str(info.value)
    assert str(info.value).startswith(f"{tmp_path / 'ck'}: ")  # the file (DCP: its directory)
    small = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    with pytest.warns(UserWarning, match="'model.2.bias'") as caught:
        stats = asyncload.load(
            {"model": small, "epoch": 0}, tmp_path / "ck", allow_partial_load=True
        )
    assert len(caught) == 1
    assert "model.2.bias" in stats.unexpected_keys
    assert_same(small["2.weight"], saved["model"]["2.weight"])


def test_keys_outside_the_destination_stay_legal(tmp_path: Path, trained: Any) -> None:
    """A model-only load of a training checkpoint: optimizer, scheduler and epoch are
    outside the destination, as ``dcp.load`` treats them."""
    saved = _saved(trained)
    torch.save(saved, tmp_path / "ckpt.pt")
    model, _, _ = _run()
    dest = {"model": model.state_dict()}
    stats = asyncload.load(dest, tmp_path / "ckpt.pt")
    assert (
        "epoch" in stats.unexpected_keys and "optimizer.state.0.exp_avg" in stats.unexpected_keys
    )
    assert_same(dest["model"], saved["model"])


# --- a training checkpoint into its model (issue 44) ------------------------------------------


def _forward(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.randn(4, 6, generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("dcp", "model"),
        ("dcp", "module"),
        ("torch.save", "model_state_dict"),
        ("torch.save", "state_dict"),
    ],
)
def test_training_checkpoint_loads_into_its_model(
    tmp_path: Path, trained: Any, fmt: str, name: str
) -> None:
    """``{"model": ..., "optim": ..., "step": ...}`` (as the quickstart saves it) loads into
    ``model.state_dict()``; ``LoadStats.key_prefix`` names the prefix; the model then gives
    the source model's output bit for bit."""
    source, opt, _ = trained
    saved = {name: source.state_dict(), "optim": opt.state_dict(), "step": 3}
    if fmt == "dcp":
        dcp.save(saved, checkpoint_id=tmp_path / "ck")
    else:
        torch.save(saved, tmp_path / "ck")
    model, _, _ = _run(seed=1)
    dest = model.state_dict()
    stats = asyncload.load(dest, tmp_path / "ck")
    assert stats.key_prefix == name
    assert_same(dict(dest), dict(source.state_dict()))
    assert _same_tensors([_forward(model)], [_forward(source)])
    # through torch's own entry point and asyncload's reader and planner alike
    model2, _, _ = _run(seed=2)
    dcp.load(
        model2.state_dict(),
        storage_reader=asyncload.PipelinedReader(tmp_path / "ck"),
        planner=asyncload.PipelinedLoadPlanner(),
    )
    assert _same_tensors([_forward(model2)], [_forward(source)])


def test_two_candidate_prefixes_are_an_error_naming_both(tmp_path: Path, trained: Any) -> None:
    source = trained[0]
    dcp.save(
        {"model": source.state_dict(), "ema": source.state_dict()}, checkpoint_id=tmp_path / "ck"
    )
    model, _, _ = _run(seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StateDictMismatchError) as info:
        asyncload.load(model.state_dict(), tmp_path / "ck")
    msg = str(info.value)
    assert str(tmp_path / "ck") in msg and "'ema'" in msg and "'model'" in msg
    assert _same_tensors([p.detach() for p in model.parameters()], before)  # nothing written
    # nesting the destination under the one meant loads it
    stats = asyncload.load({"ema": model.state_dict()}, tmp_path / "ck")
    assert stats.key_prefix == "" and stats.unexpected_keys[0].startswith("model.")
    assert _same_tensors([_forward(model)], [_forward(source)])


def test_no_destination_key_found_gets_the_prefix_fix_not_partial_load(
    tmp_path: Path, trained: Any
) -> None:
    """A destination none of whose keys the checkpoint holds: the closest keys and the fix
    for their prefix, never ``allow_partial_load`` (which would load nothing)."""
    source = trained[0]
    dcp.save(source.state_dict(), checkpoint_id=tmp_path / "plain")
    wrapped = {f"module.{k}": v.clone() for k, v in source.state_dict().items()}
    with pytest.raises(StateDictMismatchError) as info:
        asyncload.load(wrapped, tmp_path / "plain")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'plain'}: none of the destination's 4 keys")
    assert "'module.0.weight' (closest checkpoint key: '0.weight')" in msg
    assert "consume_prefix_in_state_dict_if_present(state_dict, 'module.')" in msg
    assert "allow_partial_load" not in msg
    dcp.save({"model": source.state_dict()}, checkpoint_id=tmp_path / "nested")
    renamed = {f"net.{k}": v.clone() for k, v in source.state_dict().items()}
    with pytest.raises(StateDictMismatchError) as info:
        asyncload.load(renamed, tmp_path / "nested")
    msg = str(info.value)
    assert "'net.0.weight' (closest checkpoint key: 'model.0.weight')" in msg
    assert "start with 'net' where the checkpoint's start with 'model'" in msg
    assert "allow_partial_load" not in msg


@pytest.mark.parametrize("fmt", ["torch.save", "dcp"])
def test_empty_list_and_dict_of_a_training_loop_are_filled(
    tmp_path: Path, trained: Any, fmt: str
) -> None:
    """What a Lightning-style loop saves beside its weights: a list of scheduler states and
    callbacks' dicts, asked for as ``[]`` and ``{}``: filled as saved."""
    model, _, sched = trained
    saved = {
        "state_dict": model.state_dict(),
        "lr_schedulers": [sched.state_dict()],
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.25), "k": 3}},
    }
    if fmt == "dcp":
        dcp.save(saved, checkpoint_id=tmp_path / "ck")
        want = saved
    else:
        torch.save(saved, tmp_path / "ck")
        want = torch.load(tmp_path / "ck", weights_only=True)
    fresh, _, fresh_sched = _run(seed=1)
    dest = {"state_dict": fresh.state_dict(), "lr_schedulers": [], "callbacks": {}}
    stats = asyncload.load(dest, tmp_path / "ck")
    assert stats.unexpected_keys == []
    assert_same(dest["lr_schedulers"], want["lr_schedulers"])
    assert_same(dest["callbacks"], want["callbacks"])
    fresh_sched.load_state_dict(dest["lr_schedulers"][0])
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
