"""A training job resumes from S3 through records read by a guess (issue 30's guessed reads).

The checkpoint is what a trainer writes with torch's own tools: the model's and AdamW's state
dicts from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (as FSDP2 and
torchtitan take them), saved by ``dcp.save``, uploaded to S3 on loopback (moto). asyncload
loads it into a fresh model's and optimizer's state dicts (most records read by a guess of
where their tensor starts: the log says how many), ``set_state_dict`` hands them back, and
the next training step must equal, bit for bit, the step after torch's own ``dcp.load`` of
the same checkpoint, and the step the original job would have taken.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import asyncload
from asyncload import LoadOptions

pytestmark = pytest.mark.timeout(180)

#: records of 512 KiB are "large" (probed or guessed), not read whole
OPTS = LoadOptions(min_chunk_size=64 << 10)


def _job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 256, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _resume(load: Any) -> list[torch.Tensor]:
    """A fresh job (other initial weights), its state loaded by ``load``, one step on."""
    model, opt = _job(seed=1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(model, opt, 3)
    return _params(model)


def test_a_job_resumes_from_s3_through_guessed_records(
    tmp_path: Path, s3_server: Any, bucket_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _job(seed=0)
    for i in range(3):
        _step(model, opt, i)
    msd, osd = get_state_dict(model, opt)
    ckpt = tmp_path / "step-3"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    url = s3_server.upload_dir(ckpt, bucket_name, "step-3")
    so = s3_server.storage_options()

    with caplog.at_level(logging.DEBUG, logger="asyncload.session"):
        ours = _resume(lambda s: asyncload.load(s, url, options=OPTS, storage_options=so))
    theirs = _resume(lambda s: dcp.load(s, checkpoint_id=ckpt))
    _step(model, opt, 3)
    original = _params(model)

    guessed = [r.getMessage() for r in caplog.records if "read by guessing" in r.getMessage()]
    # 2 weights, their AdamW exp_avg and exp_avg_sq: 6 records of 512 KiB, every one read by
    # a guess (the first by this process's torch.save header length)
    assert guessed and guessed[0].startswith("6 records read by guessing"), guessed
    assert guessed[0].endswith("0 guessed wrong, read again, 0 at another start, moved into place")
    for a, b, c in zip(ours, theirs, original, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    untouched = _resume(lambda s: None)
    assert not all(torch.equal(a, b) for a, b in zip(ours, untouched))  # the state mattered
