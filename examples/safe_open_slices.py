"""Read a tensor-parallel rank's share of a safetensors file with ``asyncload.safe_open``.

    python examples/safe_open_slices.py

``asyncload.safe_open`` is ``safetensors.safe_open`` on any store: the same ``keys()``,
``metadata()``, ``get_tensor`` and ``get_slice(name)[...]``, from a local path or an
``s3://``, ``gs://``, ``http(s)://`` URL, and a slice reads only its own bytes (a block of
rows is one ranged read; a block of columns one per row, neighbours joined under
``LoadOptions.max_over_read_ratio``). The script writes a small model with safetensors'
own ``save_file``, serves it from an HTTP server on 127.0.0.1 (asyncload's test server),
and reads each of 4 ranks' shards the way tensor-parallel loaders do (rows of a
column-parallel weight, columns of a row-parallel one), checking every shard bit for bit
against safetensors' ``safe_open`` on the local file and printing what was read. Set
ASYNCLOAD_EXAMPLE_SMALL=1 for a tiny model.

Needs: torch, safetensors (the ``safetensors`` extra) and aiohttp (the ``http`` extra: the
loopback HTTP server).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open as safetensors_safe_open
from safetensors.torch import save_file

import asyncload
from asyncload.testing import HTTPRangeServer

SMALL = os.environ.get("ASYNCLOAD_EXAMPLE_SMALL") == "1"
RANKS = 4


def make_model(path: Path) -> int:
    """A few transformer-ish weights in one .safetensors file; returns the hidden size."""
    g = torch.Generator().manual_seed(0)
    hidden = 128 if SMALL else 1024
    weights = {
        f"layers.{i}.{name}": torch.randn(shape, generator=g).to(torch.bfloat16)
        for i in range(2)
        for name, shape in (
            ("attn.qkv.weight", (3 * hidden, hidden)),  # column-parallel: rows split
            ("attn.out.weight", (hidden, hidden)),  # row-parallel: columns split
            ("norm.weight", (hidden,)),  # replicated
        )
    }
    save_file(weights, str(path), metadata={"format": "pt"})
    return hidden


def rank_shard(f: Any, name: str, rank: int) -> torch.Tensor:
    """The part of weight ``name`` that tensor-parallel rank ``rank`` holds."""
    weight = f.get_slice(name)
    shape = weight.get_shape()
    if name.endswith("qkv.weight"):
        n = shape[0] // RANKS
        return weight[rank * n : (rank + 1) * n]  # rows: one ranged read
    if name.endswith("out.weight"):
        n = shape[1] // RANKS
        return weight[:, rank * n : (rank + 1) * n]  # columns: one read per row, joined
    return weight[:]  # replicated


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="asyncload-safe-open-") as tmp:
        root = Path(tmp)
        path = root / "model.safetensors"
        hidden = make_model(path)
        size = path.stat().st_size
        with HTTPRangeServer(root) as http:
            url = http.url("", "model.safetensors")
            print(f"serving {size} bytes at {url} (hidden size {hidden})")
            with (
                asyncload.safe_open(url) as f,
                safetensors_safe_open(str(path), framework="pt") as local,
            ):
                names = f.keys()  # sorted, as safetensors gives them
                assert names == local.keys() and f.metadata() == local.metadata()
                for rank in range(RANKS):
                    before = f.stats.bytes_read
                    for name in names:
                        shard = rank_shard(f, name, rank)
                        want = rank_shard(local, name, rank)
                        assert torch.equal(shard.view(torch.int16), want.view(torch.int16))
                    read = f.stats.bytes_read - before
                    print(
                        f"rank {rank}: its shards of {len(names)} tensors, {read} bytes "
                        f"read ({read / size:.0%} of the file), equal to safetensors' own"
                    )
                print(f.stats)


if __name__ == "__main__":
    main()
