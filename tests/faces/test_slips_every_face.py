"""The slips ``asyncload.load`` names the fix for (tests/faces/test_api.py) are named the same
way by every other face that takes a checkpoint: ``read_state_dict``, ``aread_state_dict``,
``iter_tensors``, ``aiter_tensors`` and ``safe_open``, before anything is opened."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import asyncload


def _read(url: Any, **kw: Any) -> Any:
    return asyncload.read_state_dict(url, **kw)


def _aread(url: Any, **kw: Any) -> Any:
    return asyncio.run(asyncload.aread_state_dict(url, **kw))


def _iter(url: Any, **kw: Any) -> Any:
    return list(asyncload.iter_tensors(url, **kw))


def _aiter(url: Any, **kw: Any) -> Any:
    async def run() -> list[Any]:
        return [x async for x in asyncload.aiter_tensors(url, **kw)]

    return asyncio.run(run())


def _safe_open(url: Any, **kw: Any) -> Any:
    with asyncload.safe_open(url, **kw) as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safetensors' API


FACES: dict[str, Callable[..., Any]] = {
    "read_state_dict": _read,
    "aread_state_dict": _aread,
    "iter_tensors": _iter,
    "aiter_tensors": _aiter,
    "safe_open": _safe_open,
}


@pytest.mark.parametrize("face", list(FACES))
def test_unknown_scheme_lists_what_is_read(face: str) -> None:
    with pytest.raises(
        ValueError, match=r"'s4', which asyncload does not read: did you mean 's3://'"
    ):
        FACES[face]("s4://bucket/model.safetensors")


@pytest.mark.parametrize("face", list(FACES))
def test_lost_slash_names_the_url_meant(face: str) -> None:
    with pytest.raises(ValueError, match=r"did you mean 's3://bucket/model.safetensors'"):
        FACES[face]("s3:/bucket/model.safetensors")


@pytest.mark.parametrize("face", list(FACES))
def test_options_in_the_wrong_keyword(face: str, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    with pytest.raises(
        TypeError, match=r"got a LoadOptions as storage_options: pass it as `options=`"
    ):
        FACES[face](str(path), storage_options=asyncload.LoadOptions())
    with pytest.raises(
        TypeError, match=r"a dict for the storage client goes to `storage_options=`"
    ):
        FACES[face](str(path), options={"endpoint_url": "http://127.0.0.1:1"})
    # the same call, right: loads exactly what was saved
    got = FACES[face](str(path), options=asyncload.LoadOptions())
    got = dict(got) if not isinstance(got, dict) else got
    assert torch.equal(got["w"], torch.arange(6, dtype=torch.float32))
