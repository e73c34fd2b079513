"""Structural mutations of real ``.metadata`` (chunk lists, offsets, sizes, dtypes,
properties, storage entries) and the property every forged load must satisfy: it ends
in an ``AsyncLoadError``, or every tensor is bit-exact and fully written. Also (issue 25)
forged ``planner_data`` paths and forged claimed sizes of zstd-transformed records, read by
``read_state_dict``.

Shared by ``tests/decoding/test_forged.py`` (hypothesis draws the mutations) and
``benchmarks/fuzz_long.py --structural-minutes`` (``random.Random`` draws them).
"""

from __future__ import annotations

import copy
import pickle
import random
from pathlib import Path
from typing import Any

import torch
from _ckpt import assert_bitwise_equal
from _corrupt import sentinel_like
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import asyncload
from asyncload import AsyncLoadError, LoadOptions

__all__ = [
    "DTYPES",
    "INTS",
    "KEYS",
    "KINDS",
    "PATH_KINDS",
    "PIECES",
    "apply_mutation",
    "apply_path_mutation",
    "forge_state_dict",
    "load_forged",
    "random_claim",
    "random_mutation",
    "random_path_mutation",
    "read_forged_claim",
    "read_forged_paths",
    "tensor_bytes",
]

KiB = 1 << 10
#: Small chunks: "big" goes through probes and chunked reads, the rest are whole-record reads.
PIECES = LoadOptions(chunk_size=4 * KiB, min_chunk_size=1 * KiB, concurrency=4, retries=0)
KINDS = [
    "drop chunk",
    "dup chunk",
    "add chunk",
    "offset",
    "size",
    "tensor size",
    "dtype",
    "grad",
    "entry",
]
KEYS = ["big", "small", "nested.w", "empty", "scalar"]
INTS = [300, 1 << 31, 1 << 62, -(1 << 40)]  # besides -2..70
DTYPES = [torch.float32, torch.float16, torch.int16, torch.int64, torch.bool, torch.bits8]


def forge_state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "big": torch.randn(64, 64, generator=g),  # 16 KiB: chunked reads
        "small": torch.arange(300, dtype=torch.int16),
        "nested": {"w": torch.randn(10, 7, generator=g, dtype=torch.float64), "step": 11},
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    return 0


def random_mutation(rng: random.Random) -> tuple[Any, ...]:
    """One mutation, drawn like test_forged's hypothesis strategy."""
    value = rng.randint(-2, 70) if rng.random() < 0.8 else rng.choice(INTS)
    return (
        rng.choice(KINDS),
        rng.choice(KEYS),
        rng.randint(0, 3),
        value,
        rng.choice(DTYPES),
        rng.randint(-64, 64),
    )


def apply_mutation(md: Any, mutation: tuple[Any, ...]) -> None:
    kind, key, dim, value, dtype, delta = mutation
    smd = md.state_dict_metadata[key]
    chunks = smd.chunks
    ndim = len(smd.size)
    if kind == "drop chunk" and chunks:
        chunks.pop()
    elif kind == "dup chunk" and chunks:
        chunks.append(copy.deepcopy(chunks[0]))
    elif kind == "add chunk":
        chunks.append(
            ChunkStorageMetadata(
                offsets=torch.Size([abs(value) % 64] * ndim), sizes=torch.Size([1 + dim] * ndim)
            )
        )
    elif kind in ("offset", "size") and chunks and ndim:
        field = "offsets" if kind == "offset" else "sizes"
        old = list(getattr(chunks[0], field))
        old[dim % ndim] = max(0, value)
        setattr(chunks[0], field, torch.Size(old))
    elif kind == "tensor size" and ndim:
        size = list(smd.size)
        size[dim % ndim] = max(0, value)
        smd.size = torch.Size(size)
    elif kind == "dtype":
        smd.properties.dtype = dtype
    elif kind == "grad":
        smd.properties.requires_grad = not smd.properties.requires_grad
    elif kind == "entry":
        idx = next((i for i in md.storage_data if i.fqn == key), None)
        if idx is None:  # deleted by an earlier mutation
            return
        info = md.storage_data[idx]
        if dim == 0:
            info.offset = max(0, info.offset + delta)
        elif dim == 1:
            info.length = max(0, info.length + delta)
        elif dim == 2:
            info.relative_path = info.relative_path + ("x" if delta > 0 else "")
        else:
            del md.storage_data[idx]


def load_forged(
    work: Path, original: Any, sd: dict[str, Any], mutations: list[tuple[Any, ...]]
) -> str:
    """Write ``original`` with ``mutations`` applied as ``work/.metadata`` and load it into a
    sentinel destination: the name of the typed error, or ``"loaded"`` after checking that
    every tensor is bit-exact and every destination byte was written (AssertionError if not;
    any other exception escapes)."""
    md = copy.deepcopy(original)
    for m in mutations:
        apply_mutation(md, m)
    (work / ".metadata").write_bytes(pickle.dumps(md))
    dest = sentinel_like(sd)
    try:
        stats = asyncload.load(dest, work, options=PIECES)
    except AsyncLoadError as exc:
        return type(exc).__name__
    assert_bitwise_equal(
        {k: v for k, v in dest.items() if k != "nested"},
        {k: v for k, v in sd.items() if k != "nested"},
    )
    assert_bitwise_equal(dest["nested"]["w"], sd["nested"]["w"])
    assert stats.bytes_assembled == tensor_bytes(sd), (
        stats.bytes_assembled,
        tensor_bytes(sd),
        mutations,
    )
    return "loaded"


# --- issue 25: forged planner_data and claimed sizes of transformed records ------------------

#: Ways to forge one key's planner path (read_state_dict nests through them).
PATH_KINDS = [
    "other's path",
    "under other",
    "int step",
    "huge int",
    "negative",
    "float",
    "bool",
    "int first",
    "empty",
]


def random_path_mutation(rng: random.Random) -> tuple[Any, ...]:
    keys = [*KEYS, "nested.step"]
    return (
        rng.choice(PATH_KINDS),
        rng.choice(keys),
        rng.choice(keys),
        rng.choice([0, 1, 4, 5, 6, 1 << 40]),
    )


def apply_path_mutation(md: Any, mutation: tuple[Any, ...]) -> None:
    kind, key, other, n = mutation
    pd = md.planner_data
    theirs = tuple(pd.get(other, (other,)))
    path: Any = {
        "other's path": theirs,
        "under other": (*theirs, "x"),
        "int step": (*theirs, n % 7),
        "huge int": (key, n + (1 << 40)),
        "negative": (key, -1 - n),
        "float": (key, 0.5),
        "bool": (key, True),
        "int first": (n,),
        "empty": (),
    }[kind]
    pd[key] = path


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        tree = tree[step]
    return tree


def read_forged_paths(
    work: Path, original: Any, sd: dict[str, Any], mutations: list[tuple[Any, ...]]
) -> str:
    """``original`` with planner paths forged, loaded by ``read_state_dict``: the name of the
    typed error, or ``"loaded"`` after checking that every key sits at its path, bit-exact
    (an object written into a tensor, a tensor replaced, a raw IndexError: AssertionError or
    the exception itself)."""
    md = copy.deepcopy(original)
    for m in mutations:
        apply_path_mutation(md, m)
    (work / ".metadata").write_bytes(pickle.dumps(md))
    try:
        got = asyncload.read_state_dict(work)
    except AsyncLoadError as exc:
        return type(exc).__name__
    flat = {
        "big": sd["big"],
        "small": sd["small"],
        "nested.w": sd["nested"]["w"],
        "nested.step": 11,
    }
    flat |= {"empty": sd["empty"], "scalar": sd["scalar"]}
    for key, want in flat.items():
        path = md.planner_data.get(key)
        value = _at(got, tuple(path) if isinstance(path, (tuple, list)) and path else (key,))
        if isinstance(want, torch.Tensor):
            assert_bitwise_equal(value, want, key)
        else:
            assert value == want, (key, value, mutations)
    return "loaded"


def random_claim(rng: random.Random) -> tuple[str, int]:
    """A transformed record's claimed element count: small, near the truth, or huge."""
    key = rng.choice(["big", "small", "nested.w", "scalar"])
    return key, rng.choice([0, 1, rng.randint(2, 5000), 4096, 1 << rng.randint(20, 40)])


def read_forged_claim(
    work: Path, original: Any, sd: dict[str, Any], claims: list[tuple[str, int]]
) -> str:
    """A zstd-saved ``original`` whose tensors claim other element counts (one dimension):
    ``read_state_dict`` under a 64 MiB budget must end typed, never allocate the claim
    (a claim of 2^40 elements would be a raw RuntimeError or a slow example), or load exactly."""
    md = copy.deepcopy(original)
    for key, numel in claims:
        smd = md.state_dict_metadata[key]
        smd.size = torch.Size([numel])
        for ch in smd.chunks:
            ch.offsets, ch.sizes = torch.Size([0]), torch.Size([numel])
    (work / ".metadata").write_bytes(pickle.dumps(md))
    try:
        got = asyncload.read_state_dict(work, options=LoadOptions(memory_budget=64 << 20))
    except AsyncLoadError as exc:
        return type(exc).__name__
    assert_bitwise_equal(got["big"], sd["big"])
    assert_bitwise_equal(got["nested"]["w"], sd["nested"]["w"])
    return "loaded"
