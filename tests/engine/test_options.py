"""LoadOptions: validation that names the field and value, and the knobs at their extremes
(tiny chunk_size, the minimum memory_budget, concurrency 1 and 64) against real checkpoints."""

from __future__ import annotations

import dataclasses
import inspect
import math
import pydoc
import uuid
from typing import ClassVar

import fsspec
import pytest
import torch
from _ckpt import (
    assert_bitwise_equal,
    copy_dir_to_fsspec,
    make_checkpoint,
    random_tensor,
    total_tensor_bytes,
    zeros_like_tree,
)
from fsspec.implementations.memory import MemoryFileSystem

import asyncload
from asyncload import LoadOptions

pytestmark = pytest.mark.timeout(60)

KiB = 1 << 10
MIN_BUDGET = 64 * KiB


# --- validation --------------------------------------------------------------------------------


def test_defaults_are_valid_and_documented_units():
    o = LoadOptions()
    assert o.chunk_size == 16 << 20 and o.min_chunk_size == 1 << 20
    assert o.memory_budget >= o.chunk_size
    assert o.timeout is None or o.timeout > 0
    assert o.retries >= 0 and o.verify is False
    assert o.effective_chunk_size == o.chunk_size


def test_frozen_and_keyword_only():
    o = LoadOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.chunk_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        LoadOptions(4096)  # type: ignore[misc]


def test_replace_validates_too():
    o = LoadOptions().replace(chunk_size=4096, min_chunk_size=512)
    assert (o.chunk_size, o.min_chunk_size) == (4096, 512)
    assert dataclasses.replace(o, concurrency=3).concurrency == 3
    with pytest.raises(ValueError, match="memory_budget"):
        o.replace(memory_budget=1)


@pytest.mark.parametrize("budget", [MIN_BUDGET - 1, 1, 0, -5])
def test_memory_budget_below_the_minimum_names_the_field(budget):
    with pytest.raises(ValueError) as ei:
        LoadOptions(memory_budget=budget)
    msg = str(ei.value)
    assert "memory_budget" in msg and repr(budget) in msg


def test_memory_budget_minimum_is_accepted():
    assert LoadOptions(memory_budget=MIN_BUDGET).memory_budget == MIN_BUDGET


BAD = [
    ("chunk_size", 0),
    ("chunk_size", -1),
    ("chunk_size", 1.5),
    ("chunk_size", True),
    ("chunk_size", "16M"),
    ("min_chunk_size", 0),
    ("memory_budget", 2.0),
    ("max_metadata_size", 0),
    ("timeout", 0),
    ("timeout", -1.0),
    ("timeout", float("inf")),
    ("timeout", float("nan")),
    ("timeout", True),
    ("timeout", "30"),
    ("retries", -1),
    ("retries", 1.0),
    ("retries", False),
    ("backoff", -0.1),
    ("backoff", float("nan")),
    ("max_backoff", -1),
    ("concurrency", 0),
    ("concurrency", "fast"),
    ("concurrency", 2.0),
    ("concurrency", True),
    ("hedge_factor", 0.5),
    ("hedge_min_delay", -1),
    ("io_threads", 0),
    ("io_threads", 1.0),
    ("verify", 1),
    ("hedge", "yes"),
    ("allow_dtype_cast", None),
    ("use_uvloop", 0),
    ("strict_unexpected_keys", "no"),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ValueError) as ei:
        LoadOptions(**{field: value})
    msg = str(ei.value)
    assert f"LoadOptions.{field}=" in msg and repr(value) in msg


def test_min_chunk_size_may_not_exceed_chunk_size():
    with pytest.raises(ValueError, match=r"min_chunk_size=8192.*chunk_size=4096"):
        LoadOptions(chunk_size=4096, min_chunk_size=8192)


def test_good_edge_values():
    LoadOptions(
        timeout=None,
        retries=0,
        backoff=0,
        concurrency="auto",
        io_threads=1,
        chunk_size=1,
        min_chunk_size=1,
    )
    assert LoadOptions(concurrency="auto").max_in_flight == 64
    assert LoadOptions(concurrency=5).max_in_flight == 5


def test_chunk_size_is_clamped_to_the_budget():
    o = LoadOptions(chunk_size=1 << 20, min_chunk_size=1024, memory_budget=MIN_BUDGET)
    assert o.effective_chunk_size == MIN_BUDGET


def test_options_must_be_load_options(tmp_path):
    with pytest.raises(TypeError, match="LoadOptions"):
        asyncload.load({}, tmp_path, options={"chunk_size": 4096})  # type: ignore[arg-type]


def test_planner_knobs_override_options_and_validate():
    base = LoadOptions(retries=1, concurrency=3)
    p = asyncload.PipelinedLoadPlanner(chunk_size=8192, timeout=None, options=base)
    assert p.options.chunk_size == 8192 and p.options.timeout is None
    assert p.options.retries == 1 and p.options.concurrency == 3
    # min_chunk_size follows a chunk_size set below the default min_chunk_size
    assert p.options.min_chunk_size == 8192
    assert asyncload.PipelinedLoadPlanner().options == LoadOptions()
    with pytest.raises(ValueError, match="LoadOptions.timeout"):
        asyncload.PipelinedLoadPlanner(timeout=-1)
    with pytest.raises(ValueError, match="LoadOptions.min_chunk_size"):
        asyncload.PipelinedLoadPlanner(chunk_size=4096, min_chunk_size=8192)


# --- knobs at their extremes, bit exact and within the budget ---------------------------------


def _model_like() -> dict:
    # a few large matrices (several chunks each), many small norms (coalesced), odd sizes
    sd = {}
    for i in range(4):
        sd[f"layers.{i}.attn"] = random_tensor((96, 257), torch.bfloat16, seed=i)
        sd[f"layers.{i}.mlp_t"] = random_tensor((130, 64), torch.float32, seed=10 + i).t()
        sd[f"layers.{i}.norm"] = random_tensor((96,), torch.float32, seed=20 + i)
        sd[f"layers.{i}.bias"] = random_tensor((7,), torch.float16, seed=30 + i)
    sd["emb"] = random_tensor(
        (300, 300), torch.float32, seed=99
    )  # 351 KiB: larger than the budget
    sd["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 5)
    return sd


@pytest.fixture(scope="module")
def model_ckpt(tmp_path_factory):
    sd = _model_like()
    return make_checkpoint(tmp_path_factory.mktemp("opts") / "ckpt", sd), sd


TINY_CASES = [
    {
        "chunk_size": 4 * KiB,
        "min_chunk_size": 1 * KiB,
        "memory_budget": MIN_BUDGET,
        "concurrency": 1,
    },
    {
        "chunk_size": 4 * KiB,
        "min_chunk_size": 1 * KiB,
        "memory_budget": MIN_BUDGET,
        "concurrency": 64,
    },
    {
        "chunk_size": 4 * KiB,
        "min_chunk_size": 1,
        "memory_budget": MIN_BUDGET,
        "concurrency": "auto",
    },
    {
        "chunk_size": 1 << 20,
        "min_chunk_size": 64 * KiB,
        "memory_budget": MIN_BUDGET,
        "concurrency": 64,
    },  # clamped
    {
        "chunk_size": 1000,
        "min_chunk_size": 999,
        "memory_budget": MIN_BUDGET,
        "concurrency": 7,
        "io_threads": 1,
    },
]


@pytest.mark.parametrize(
    "kw", TINY_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items())
)
def test_tiny_chunks_and_budget_local(model_ckpt, kw):
    path, sd = model_ckpt
    opts = LoadOptions(**kw)
    dst = zeros_like_tree(sd)
    stats = asyncload.load(dst, path, options=opts)
    assert_bitwise_equal(sd, dst)
    assert 0 < stats.peak_buffered_bytes <= opts.memory_budget
    assert stats.bytes_assembled == total_tensor_bytes(sd)
    assert stats.chunks >= math.ceil(total_tensor_bytes(sd) / opts.effective_chunk_size)
    if opts.concurrency != "auto":
        assert stats.peak_concurrency <= opts.concurrency


@pytest.mark.parametrize("concurrency", [1, 64])
def test_tiny_chunks_and_budget_fsspec_memory(model_ckpt, concurrency):
    path, sd = model_ckpt
    root = f"/asyncload-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    copy_dir_to_fsspec(path, fs, root)
    try:
        opts = LoadOptions(
            chunk_size=4 * KiB,
            min_chunk_size=1 * KiB,
            memory_budget=MIN_BUDGET,
            concurrency=concurrency,
        )
        dst = zeros_like_tree(sd)
        stats = asyncload.load(dst, f"memory://{root}", options=opts)
        assert_bitwise_equal(sd, dst)
        assert 0 < stats.peak_buffered_bytes <= opts.memory_budget
        assert stats.bytes_assembled == total_tensor_bytes(sd)
        assert stats.peak_concurrency <= concurrency
    finally:
        fs.rm(root, recursive=True)


def test_concurrency_one_never_has_two_reads_in_flight(model_ckpt):
    path, sd = model_ckpt
    dst = zeros_like_tree(sd)
    stats = asyncload.load(
        dst,
        path,
        options=LoadOptions(
            chunk_size=4 * KiB, min_chunk_size=KiB, memory_budget=MIN_BUDGET, concurrency=1
        ),
    )
    assert stats.peak_concurrency == 1
    assert_bitwise_equal(sd, dst)


def test_large_min_chunk_size_makes_fewer_requests(model_ckpt):
    """min_chunk_size coalesces small neighbours: fewer requests, same tensors."""
    path, sd = model_ckpt
    few = zeros_like_tree(sd)
    s_few = asyncload.load(
        few, path, options=LoadOptions(chunk_size=256 * KiB, min_chunk_size=256 * KiB)
    )
    many = zeros_like_tree(sd)
    s_many = asyncload.load(
        many, path, options=LoadOptions(chunk_size=256 * KiB, min_chunk_size=1)
    )
    assert_bitwise_equal(sd, few)
    assert_bitwise_equal(sd, many)
    assert s_few.chunks < s_many.chunks


class RecordingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem that records every ranged read it serves (a scripted layer)."""

    protocol = "asyncload-test-recmem"
    reads: ClassVar[list[tuple[str, int | None, int | None]]] = []

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith(cls.protocol + "://"):
            path = path[len(cls.protocol) + 3 :]
        return super()._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        RecordingMemoryFileSystem.reads.append((path, start, end))
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation(
    RecordingMemoryFileSystem.protocol, RecordingMemoryFileSystem, clobber=True
)


@pytest.mark.parametrize(
    "chunk_size,min_chunk_size", [(4 * KiB, 1 * KiB), (16 * KiB, 4 * KiB), (1000, 999)]
)
def test_no_single_read_exceeds_chunk_size(model_ckpt, chunk_size, min_chunk_size):
    """chunk_size is the largest read of tensor data; a record's header probes are at most
    4 KiB, so below 4 KiB those probes are the largest reads (the whole .metadata excepted)."""
    path, sd = model_ckpt
    root = f"/asyncload-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    copy_dir_to_fsspec(path, fs, root)
    RecordingMemoryFileSystem.reads.clear()
    try:
        opts = LoadOptions(
            chunk_size=chunk_size, min_chunk_size=min_chunk_size, memory_budget=MIN_BUDGET
        )
        dst = zeros_like_tree(sd)
        stats = asyncload.load(dst, f"{RecordingMemoryFileSystem.protocol}://{root}", options=opts)
        assert_bitwise_equal(sd, dst)
    finally:
        fs.rm(root, recursive=True)
    data_reads = [
        (s, e) for p, s, e in RecordingMemoryFileSystem.reads if not p.endswith(".metadata")
    ]
    assert data_reads and all(s is not None and e is not None for s, e in data_reads)
    assert max(e - s for s, e in data_reads) <= max(chunk_size, 4 * KiB)
    assert len(data_reads) >= math.ceil(total_tensor_bytes(sd) / chunk_size)
    assert stats.chunks <= len(data_reads)


def test_empty_destination_loads_nothing(model_ckpt):
    path, sd = model_ckpt
    stats = asyncload.load({}, path)
    assert stats.bytes_assembled == 0
    assert sorted(stats.unexpected_keys) == sorted(sd)


# --- help(LoadOptions): every field explained, the signature shows the effective defaults ------


def test_help_explains_every_field():
    """Each field has its meaning, unit and when to change it in ``help(LoadOptions)``, with
    its default; a field added without an entry in ``OPTION_DOCS`` fails here."""
    from asyncload.common.options import OPTION_DOCS

    doc = pydoc.render_doc(LoadOptions, renderer=pydoc.plaintext)
    assert "(undocumented)" not in doc
    for f in dataclasses.fields(LoadOptions):
        entry = OPTION_DOCS.get(f.name)
        assert entry is not None, f"LoadOptions.{f.name} has no entry in OPTION_DOCS"
        assert entry.meaning and entry.unit and entry.change, f.name
        shown = repr(getattr(LoadOptions(), f.name))
        assert f"\n |  {f.name}: {f.type} = {shown}" in doc, f.name
    assert set(OPTION_DOCS) == {f.name for f in dataclasses.fields(LoadOptions)}
    assert "min_chunk_size: int | None = 1048576 (1 MiB)" in doc


def test_signature_defaults_are_the_effective_ones():
    defaults = LoadOptions()
    params = inspect.signature(LoadOptions).parameters
    assert list(params) == [f.name for f in dataclasses.fields(LoadOptions)]
    for name, p in params.items():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert p.default == getattr(defaults, name), name
        assert repr(p.default) == repr(getattr(defaults, name)), name
    assert params["min_chunk_size"].default == 1 << 20


def test_min_chunk_size_default_is_derived_from_chunk_size():
    assert LoadOptions(chunk_size=4096).min_chunk_size == 4096
    assert LoadOptions().replace(chunk_size=8192).min_chunk_size == 8192
    assert LoadOptions(chunk_size=64 << 20).min_chunk_size == 1 << 20
    assert LoadOptions(min_chunk_size=None).min_chunk_size == 1 << 20  # None still derives
    assert (
        LoadOptions(chunk_size=4096, min_chunk_size=512).replace(chunk_size=8192).min_chunk_size
        == 512
    )  # an explicit value is kept


@pytest.mark.parametrize(
    ("typo", "closest"),
    [
        ("concurency", "concurrency"),
        ("chunksize", "chunk_size"),
        ("memory_budgte", "memory_budget"),
    ],
)
def test_an_unknown_field_names_the_closest(typo, closest):
    msg = f"LoadOptions has no field '{typo}' (did you mean '{closest}'?); its fields are chunk_size,"
    with pytest.raises(TypeError) as info:
        LoadOptions(**{typo: 8})
    assert str(info.value).startswith(msg)
    with pytest.raises(TypeError) as info:
        LoadOptions().replace(**{typo: 8})
    assert str(info.value).startswith(msg)


def test_an_unknown_field_with_nothing_close_lists_the_fields():
    with pytest.raises(TypeError) as info:
        LoadOptions(zzz=1)
    assert str(info.value) == (
        "LoadOptions has no field 'zzz'; its fields are "
        + ", ".join(f.name for f in dataclasses.fields(LoadOptions))
    )


def test_obstore_transport_is_deprecated_where_it_is_asked_for() -> None:
    # the warning points at the caller's line (shown by Python's default filters in a
    # script), and the options read as "auto" from then on: no later warning on a loop thread
    with pytest.warns(DeprecationWarning, match='transport="obstore" is deprecated') as rec:
        opts = LoadOptions(transport="obstore")
    assert opts.transport == "auto"
    assert rec[0].filename == __file__
    with pytest.warns(DeprecationWarning) as rec:
        again = LoadOptions().replace(transport="obstore")
    assert again.transport == "auto" and rec[0].filename == __file__
