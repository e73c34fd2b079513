"""asyncload.integrations.torchtitan against torchtitan 0.3.0's own CheckpointManager.

A debug llama3 trains 3 steps and torchtitan's manager saves it (DCP, step-3); a fresh run
(other initial weights, dataloader at its start) resumes it with torchtitan's manager, and
another with asyncload's: every model, optimizer, LR scheduler, dataloader and train-state
entry must be equal bit for bit, and so must the losses and every entry after 3 more steps.
From local disk and from S3 and GCS servers on loopback (both transports), and the Hugging Face
import (``initial_load_in_hf``) of a model torchtitan exported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from _titan import Run, assert_same
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from asyncload import LoadOptions, LoadStats
from asyncload.integrations.torchtitan import AsyncLoadCheckpointManager

pytestmark = [
    # torchdata's StatefulDataLoader (torchtitan's dataloader) calls torch's deprecated set_vital
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    # torchtitan's LRSchedulersContainer.load_state_dict recomputes the LR with get_lr()
    pytest.mark.filterwarnings(
        "ignore:To get the last learning rate computed by the scheduler:UserWarning"
    ),
]

#: asyncload's clients for remote stores (LoadOptions.transport)
TRANSPORTS = ["wire", "fsspec"]
SAVE_STEP = 3
MORE_STEPS = 3


def titan_config(**kwargs: Any) -> CheckpointManager.Config:
    return CheckpointManager.Config(enable=True, interval=SAVE_STEP, **kwargs)


def asyncload_config(**kwargs: Any) -> AsyncLoadCheckpointManager.Config:
    return AsyncLoadCheckpointManager.Config(enable=True, interval=SAVE_STEP, **kwargs)


@dataclasses.dataclass
class Resumed:
    """A run after its load, and after MORE_STEPS more steps."""

    loaded: dict[str, Any]
    losses: list[torch.Tensor]
    after: dict[str, Any]
    stats: LoadStats | None


def resume(checkpoint: Any, base_folder: Path | str) -> Resumed:
    run = Run(checkpoint, base_folder, seed=1)
    try:
        fresh = run.states()["model"]
        assert run.checkpointer.load() is True
        loaded = run.states()
        # the load replaced the fresh weights (a load that did nothing cannot pass)
        assert not torch.equal(
            fresh["norm.weight"], loaded["model"]["norm.weight"]
        ) or not torch.equal(
            fresh["tok_embeddings.weight"], loaded["model"]["tok_embeddings.weight"]
        )
        losses = [run.train_step() for _ in range(MORE_STEPS)]
        return Resumed(
            loaded, losses, run.states(), getattr(run.checkpointer, "last_load_stats", None)
        )
    finally:
        run.close()


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[str, Any], list[torch.Tensor]]]:
    """torchtitan's manager saves the run at step 3: ``(base folder, the states saved, the
    losses of the 3 steps the saving run takes next)``."""
    base = tmp_path_factory.mktemp("titan")
    run = Run(titan_config(), base, seed=0)
    try:
        for _ in range(SAVE_STEP):
            run.train_step()
        assert run.checkpointer.save(curr_step=SAVE_STEP) is True
        assert (base / "checkpoint" / f"step-{SAVE_STEP}" / ".metadata").is_file()
        states = run.states()
        losses = [run.train_step() for _ in range(MORE_STEPS)]
        yield base, states, losses
    finally:
        run.close()


@pytest.fixture(scope="module")
def titan_resumed(saved: tuple[Path, dict[str, Any], list[torch.Tensor]]) -> Resumed:
    """The reference: torchtitan's own manager resumes the local checkpoint."""
    base, states, losses = saved
    got = resume(titan_config(), base)
    assert got.stats is None
    # torchtitan's resume is itself exact: what was saved, and the saving run's next steps
    assert_same(got.loaded, states, "torchtitan resume")
    assert_same(got.losses, losses, "torchtitan losses")
    return got


def data_bytes(base: Path) -> int:
    """The size of the saved checkpoint's data files (torchtitan's save: one per rank)."""
    files = list((base / "checkpoint" / f"step-{SAVE_STEP}").glob("*.distcp"))
    assert len(files) == 1
    return files[0].stat().st_size


def assert_resumed_alike(got: Resumed, want: Resumed) -> None:
    assert_same(got.loaded, want.loaded, "loaded")
    assert_same(got.losses, want.losses, "losses")
    assert_same(got.after, want.after, "after")


def test_selected_from_torchtitan_config(tmp_path: Path) -> None:
    """Chosen in a torchtitan Trainer.Config as torchtitan's managers are: the nested
    Config, built by ``config.checkpoint.build(...)`` as the trainer builds it."""
    config = llama3_debugmodel()
    assert type(config.checkpoint) is CheckpointManager.Config
    config.checkpoint = AsyncLoadCheckpointManager.Config(
        enable=True,
        folder="ckpt",
        interval=10,
        last_save_model_only=False,
        load_options=LoadOptions(concurrency=4),
        storage_options={
            "endpoint_url": "http://127.0.0.1:1",
            "key": "AKIA-not-logged",
            "secret": "not-logged",
        },
    )
    assert isinstance(config, Trainer.Config)
    assert AsyncLoadCheckpointManager.Config._owner is AsyncLoadCheckpointManager
    run = Run(config.checkpoint, tmp_path, seed=0)
    try:
        manager = run.checkpointer
        assert type(manager) is AsyncLoadCheckpointManager
        assert isinstance(manager, CheckpointManager)
        assert manager.folder == str(tmp_path / "ckpt")
        assert manager.load_options == LoadOptions(concurrency=4)
        assert manager.storage_options["endpoint_url"] == "http://127.0.0.1:1"
        assert manager.last_load_stats is None
        assert manager.load() is False  # nothing saved yet: a fresh start, as torchtitan's
    finally:
        run.close()
    # the trainer logs config.to_dict(): no secret in it
    logged = config.checkpoint.to_dict()
    assert logged["storage_options"] == {
        "endpoint_url": "http://127.0.0.1:1",
        "key": "<redacted>",
        "secret": "<redacted>",
    }
    assert logged["interval"] == 10 and logged["load_options"]["concurrency"] == 4
    # a disabled manager is torchtitan's no-op
    off = AsyncLoadCheckpointManager.Config().build(
        dataloader=None,
        model_parts=[],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )
    assert off.load() is False and off.save(curr_step=1) is False


def test_config_validation() -> None:
    with pytest.raises(
        ValueError,
        match=r"load_options=\{'concurrency': 4\} is invalid: it must be an asyncload.LoadOptions",
    ):
        AsyncLoadCheckpointManager.Config(load_options={"concurrency": 4})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"storage_options is invalid: it must be a dict with str keys, not a list$",
    ):
        AsyncLoadCheckpointManager.Config(storage_options=[("secret", "s")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"storage_options is invalid: its key 1 is not a str$"):
        AsyncLoadCheckpointManager.Config(storage_options={1: "s"})  # type: ignore[dict-item]
    # torchtitan's own checks still run
    with pytest.raises(ValueError, match="Checkpoint interval needs to be at least 1 step"):
        AsyncLoadCheckpointManager.Config(interval=0)


def test_resume_local_bit_exact(
    saved: tuple[Path, dict[str, Any], list[torch.Tensor]], titan_resumed: Resumed
) -> None:
    base, _, _ = saved
    got = resume(asyncload_config(), base)
    assert_resumed_alike(got, titan_resumed)
    # the load went through asyncload: every byte of the data file read once
    assert (
        got.stats is not None
        and got.stats.bytes_read == data_bytes(base)
        and got.stats.unexpected_keys == []
    )


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_resume_remote_bit_exact(
    saved: tuple[Path, dict[str, Any], list[torch.Tensor]],
    titan_resumed: Resumed,
    store: str,
    bucket_name: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``checkpoint.folder`` in a bucket on a loopback server: torchtitan finds the step (and
    its own manager reads) through fsspec, configured as a torchtitan user configures it
    (fsspec's config); asyncload reads with the manager's options, on both transports."""
    server = request.getfixturevalue(f"{store}_server")
    base, _, _ = saved
    folder = server.upload_dir(base / "checkpoint", bucket_name, "run/checkpoint")
    monkeypatch.setitem(fsspec.config.conf, server.protocol, server.storage_options())
    titan_remote = resume(titan_config(folder=folder), "")
    assert_resumed_alike(titan_remote, titan_resumed)
    for transport in TRANSPORTS:
        got = resume(
            asyncload_config(
                folder=folder,
                load_options=LoadOptions(transport=transport),
                storage_options=server.storage_options(),
            ),
            "",
        )
        assert_resumed_alike(got, titan_resumed)
        assert got.stats is not None and got.stats.bytes_read == data_bytes(base), transport


def test_hf_import_bit_exact(
    saved: tuple[Path, dict[str, Any], list[torch.Tensor]], tmp_path: Path
) -> None:
    """``initial_load_in_hf``: the safetensors torchtitan exported (``last_save_in_hf``),
    read through asyncload and mapped by the model's state-dict adapter."""
    _, states, _ = saved
    export = Run(
        titan_config(folder="export", last_save_in_hf=True, last_save_model_only=True),
        tmp_path,
        seed=0,
    )
    try:
        export.model.load_state_dict(states["model"])
        assert export.checkpointer.save(curr_step=SAVE_STEP, last_step=True) is True
    finally:
        export.close()
    hf_dir = tmp_path / "export" / f"step-{SAVE_STEP}"
    assert sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert not (hf_dir / ".metadata").exists()

    def imported(config: Any) -> tuple[dict[str, torch.Tensor], LoadStats | None]:
        run = Run(config, tmp_path / "fresh", seed=1)
        try:
            assert run.checkpointer.load() is True
            return run.states()["model"], getattr(run.checkpointer, "last_load_stats", None)
        finally:
            run.close()

    hf = {
        "initial_load_path": str(hf_dir),
        "initial_load_in_hf": True,
        "initial_load_model_only": True,
    }
    want, _ = imported(titan_config(**hf))
    got, stats = imported(asyncload_config(**hf))
    assert_same(got, want, "hf import")
    assert_same(got, states["model"], "hf import vs saved")
    assert stats is not None and stats.bytes_read > 0
