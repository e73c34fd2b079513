"""torch.save files of tensors with any strides torch.save writes: ``expand()``'s stride 0,
overlapping strides (``as_strided``), transposed and sliced views, storage offsets, several
tensors of one storage, channels_last. Written by ``torch.save``, read by every face
(``read_state_dict``, ``iter_tensors``, ``load``, ``asyncload convert``) and compared
exactly with ``torch.load``; then used: a forward of a model loaded from each result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import asyncload
from asyncload.cli import main

pytestmark = pytest.mark.timeout(120)


def _strided(dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(48, generator=g).to(dtype)
    four_d = torch.randn(2, 3, 4, 5, generator=g).to(dtype)
    return {
        "expand": base[:6].reshape(6, 1).expand(6, 4),  # stride (1, 0)
        "expand_scalar": base[7].expand(3, 2),  # stride (0, 0) at an offset
        "overlap": base.as_strided((5, 4), (2, 1), 3),  # rows overlap
        "transposed": base.reshape(6, 8).t(),
        "offset": base[11:29],
        "rows": base.reshape(8, 6)[2:5],  # the same storage as the three above
        "step": base[::5],
        "channels_last": four_d.contiguous(memory_format=torch.channels_last),
        "nested": {"w": base.reshape(4, 12)[:, 1::3], "b": base.as_strided((3,), (0,))},
        "plain": torch.randn(5, 6, generator=g).to(dtype),
        "count": 3,
    }


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()


def _same_values(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), where
    assert _bits(got) == _bits(want), where


def _tensors(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[prefix + k] = v
        elif isinstance(v, dict):
            out.update(_tensors(v, f"{prefix}{k}."))
    return out


def _forward(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """A model whose parameters are the loaded ``expand`` (6x4, stride 0), ``transposed``
    (8x6) and part of ``step`` (a strided view)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(6, 8))
    model.load_state_dict(
        {
            "0.weight": weights["expand"],
            "1.weight": weights["transposed"],
            "1.bias": weights["step"][:8],
        }
    )
    dtype = weights["expand"].dtype
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        return model.to(dtype)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_face_reads_strided_views_as_torch_load(tmp_path: Path, dtype: torch.dtype) -> None:
    ckpt = tmp_path / "views.pt"
    torch.save(_strided(dtype), ckpt)
    ref = torch.load(ckpt, weights_only=True)
    want = _tensors(ref)

    # read_state_dict: what torch.load gives, layout included (strides, offsets, shared storages)
    got = asyncload.read_state_dict(ckpt)
    assert got["count"] == 3
    flat = _tensors(got)
    assert list(flat) == list(want)
    for k, t in want.items():
        _same_values(flat[k], t, k)
        assert (flat[k].stride(), flat[k].storage_offset()) == (t.stride(), t.storage_offset()), k
    ptr = {k: t.untyped_storage().data_ptr() for k, t in flat.items()}
    assert ptr["expand"] == ptr["offset"] == ptr["rows"] == ptr["transposed"]

    # iter_tensors: the same values (each a tensor of its own)
    streamed = dict(asyncload.iter_tensors(ckpt))
    assert sorted(streamed) == sorted(want)  # (in the order they land)
    for k, t in want.items():
        _same_values(streamed[k], t, k)

    # load: into destinations of memory of their own
    dest = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in want.items()}
    asyncload.load(dest, ckpt, allow_partial_load=True)
    for k, t in want.items():
        _same_values(dest[k], t, k)

    # asyncload convert: safetensors' own loader reads contiguous tensors of the same values
    assert main(["convert", str(ckpt), str(tmp_path / "st")]) == 0
    converted = safetensors.torch.load_file(str(tmp_path / "st" / "model.safetensors"))
    assert sorted(converted) == sorted(want)
    for k, t in want.items():
        assert converted[k].is_contiguous(), k
        _same_values(converted[k], t, k)

    # then used: the same forward from each
    reference = _forward(want)
    for weights in (flat, streamed, dest, converted):
        _same_values(_forward(weights), reference, "forward")
