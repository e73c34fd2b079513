"""Loads into untouched destinations (issue 45, item 1): ``torch.empty`` tensors and a
module made on the meta device then ``module.to_empty(device="cpu")``, whose pages the load's
own reads fault in, filled bit for bit from every local layout: a model-shaped DCP checkpoint
in one file (large records read straight into the destinations, many small norm records read
whole), the many files of ``dcp.FileSystemWriter(thread_count=8)``, safetensors shards with
their index and one ``torch.save`` zip. Large records are read in several chunks
(``chunk_size`` below their size) so that the direct runs of the I/O threads write into memory
no one has touched; a second test fills each destination with a sentinel byte first (which
touches it), so that a byte the load left unwritten would show.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import asyncload

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]

LAYOUTS = ("dcp", "dcp-many", "safetensors", "torchsave")


def _model(layers: int = 3) -> dict[str, torch.Tensor]:
    """The issue's model shape, scaled down: per layer a 256x512 and a 512x512 float32, a
    256x512 bfloat16 and 16 norms of 256 floats (19 keys)."""
    g = torch.Generator().manual_seed(45)
    sd: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.weight"] = torch.randn(256, 512, generator=g)
        sd[p + "mlp.weight"] = torch.randn(512, 512, generator=g)
        sd[p + "proj.weight"] = torch.randn(256, 512, generator=g).to(torch.bfloat16)
        for j in range(16):
            sd[p + f"norm{j}.weight"] = torch.randn(256, generator=g)
    return sd


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Path], dict[str, torch.Tensor]]:
    sd = _model()
    root = tmp_path_factory.mktemp("untouched")
    paths: dict[str, Path] = {}
    dcp.save(sd, checkpoint_id=root / "dcp", no_dist=True)
    paths["dcp"] = root / "dcp"
    dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(str(root / "many"), thread_count=8), no_dist=True
    )
    paths["dcp-many"] = root / "many"
    st = root / "st"
    st.mkdir()
    names = list(sd)
    weight_map: dict[str, str] = {}
    for j in range(4):
        fname = f"model-{j + 1:05d}-of-00004.safetensors"
        keys = names[j::4]
        save_file({k: sd[k] for k in keys}, str(st / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    (st / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    paths["safetensors"] = st
    torch.save(sd, root / "model.pt")
    paths["torchsave"] = root / "model.pt"
    return paths, sd


def _sentinel(dest: dict[str, torch.Tensor]) -> None:
    """Fill each destination's bytes with 0xA5 through a byte view (the load sees the tensor)."""
    for t in dest.values():
        t.view(torch.uint8).fill_(0xA5)


def _empty(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in sd.items()}


def _to_empty(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    module = torch.nn.Module()
    with torch.device("meta"):
        for i, v in enumerate(sd.values()):
            module.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty_like(v), False))
    module.to_empty(device="cpu")
    return {k: getattr(module, f"p{i}").data for i, k in enumerate(sd)}


def _same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("make", [_empty, _to_empty], ids=["torch.empty", "to_empty"])
def test_untouched_destinations_bit_for_bit(
    saved: tuple[dict[str, Path], dict[str, torch.Tensor]], layout: str, make: object
) -> None:
    paths, sd = saved
    dest = make(sd)  # type: ignore[operator]
    # large records in several reads each (512 KiB and 1 MiB tensors, 256 KiB chunks)
    opts = asyncload.LoadOptions(chunk_size=256 << 10)
    asyncload.load(dest, str(paths[layout]), options=opts)
    _same_bytes(dest, sd)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_byte_left_unwritten(
    saved: tuple[dict[str, Path], dict[str, torch.Tensor]], layout: str
) -> None:
    """Every byte of every destination written: a sentinel in each one is overwritten."""
    paths, sd = saved
    dest = _empty(sd)
    _sentinel(dest)
    asyncload.load(dest, str(paths[layout]), options=asyncload.LoadOptions(chunk_size=256 << 10))
    _same_bytes(dest, sd)
    # and with the default options (each large record one read)
    dest = _to_empty(sd)
    _sentinel(dest)
    asyncload.load(dest, str(paths[layout]))
    _same_bytes(dest, sd)
