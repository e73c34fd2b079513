"""Round trips: what torch's own ``dcp.save`` wrote comes back bit for bit through ``asyncload.load``."""

from __future__ import annotations

import math

import pytest
import torch
from _ckpt import (
    SAVEABLE_DTYPES,
    assert_bitwise_equal,
    make_checkpoint,
    random_tensor,
    total_tensor_bytes,
    zeros_like_tree,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

import asyncload

pytestmark = pytest.mark.timeout(120)

#: Defaults: every record here is small, so it is fetched whole and parsed in one go.
DEFAULT = asyncload.LoadOptions()
#: Tiny reads: large records go through the header probes and chunked, split reads.
TINY = asyncload.LoadOptions(
    chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10, concurrency=4
)


def _dtype_state_dict(dtype: torch.dtype) -> dict:
    return {
        "small": random_tensor((5, 7), dtype, seed=1),
        "scalar": random_tensor((), dtype, seed=2),
        "empty": torch.empty((0, 3), dtype=dtype),
        "empty1d": torch.empty((0,), dtype=dtype),
        # big enough (>= 12 KiB even for 1-byte dtypes) to take the probe + chunked path with TINY
        "big": random_tensor((96, 130), dtype, seed=3),
        # saved non-contiguous: torch.save keeps the transposed strides
        "big_t": random_tensor((140, 100), dtype, seed=4).t(),
        "vec": random_tensor((12345,), dtype, seed=5),
    }


@pytest.mark.parametrize("options", [DEFAULT, TINY], ids=["default", "tiny"])
@pytest.mark.parametrize("dtype", SAVEABLE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype, options):
    sd = _dtype_state_dict(dtype)
    assert not sd["big_t"].is_contiguous()
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    dst = zeros_like_tree(sd)
    stats = asyncload.load(dst, ckpt, options=options)
    assert_bitwise_equal(sd, dst)
    assert stats.bytes_assembled == total_tensor_bytes(sd)
    assert 0 < stats.peak_buffered_bytes <= options.memory_budget
    assert stats.chunks > 0


def test_special_float_values_bit_exact(tmp_path):
    # NaNs with payloads, signed zeros, infinities and subnormals must survive as bits
    bits = torch.tensor(
        [
            0x7FC00001,
            0xFFC00000,
            0x80000000,
            0x00000000,
            0x7F800000,
            0xFF800000,
            0x00000001,
            0x7F800001,
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    f32 = bits.view(torch.float32).clone()
    sd = {
        "f32": f32,
        "bf16": torch.tensor([-0.0, float("nan"), float("inf"), 1e-40], dtype=torch.bfloat16),
    }
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    dst = zeros_like_tree(sd)
    asyncload.load(dst, ckpt)
    assert_bitwise_equal(sd, dst)
    assert dst["f32"].view(torch.int32).tolist() == bits.tolist()


@pytest.mark.parametrize("options", [DEFAULT, TINY], ids=["default", "tiny"])
def test_nested_dicts_lists_and_objects(tmp_path, options):
    sd = {
        "model": {
            "layers": {
                str(i): {"w": random_tensor((64, 48), torch.float32, seed=i), "b": torch.randn(48)}
                for i in range(3)
            },
            "norm": {"weight": torch.ones(48, dtype=torch.bfloat16)},
        },
        "optim": {
            "state": {
                "step": torch.tensor(7),
                "exp_avg": random_tensor((64, 48), torch.float16, seed=9),
            },
            "param_groups": [
                {"lr": 0.001, "betas": [0.9, 0.95], "name": "adamw", "params": [0, 1, 2]}
            ],
        },
        "tensors_in_list": [
            torch.arange(10, dtype=torch.int64),
            random_tensor((4, 4), torch.float64, seed=11),
        ],
        "mixed_list": [3, "three", torch.full((2, 2), 3.0)],
        "step": 4000,
        "name": "run7",
        "ratio": 0.125,
        "flags": [True, False, None],
        "config": {"hidden": 48, "names": ["a", "b"], "nested": {"k": (1, 2)}},
        # an object record larger than TINY's chunk_size: read in several pieces
        "big_obj": {"text": "y" * 20000, "ints": list(range(3000))},
    }
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    dst = zeros_like_tree(sd, object_placeholder=None)
    stats = asyncload.load(dst, ckpt, options=options)
    assert_bitwise_equal(sd, dst)
    assert stats.bytes_assembled == total_tensor_bytes(sd)


def test_objects_match_torchs_own_reader(tmp_path):
    """Whatever shape torch's own dcp.load gives non-tensor leaves, asyncload gives the same."""
    import torch.distributed.checkpoint as dcp

    sd = {"a": {"b": [1, 2, {"c": "d"}]}, "t": torch.randn(3), "s": "x" * 1000, "i": 2**70}
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    ref = zeros_like_tree(sd, object_placeholder=None)
    dcp.load(ref, checkpoint_id=ckpt, no_dist=True)
    ours = zeros_like_tree(sd, object_placeholder=None)
    asyncload.load(ours, ckpt)
    assert_bitwise_equal(ref, ours)
    assert_bitwise_equal(sd, ours)


@pytest.mark.parametrize("options", [DEFAULT, TINY], ids=["default", "tiny"])
def test_permuted_and_offset_saved_tensors(tmp_path, options):
    base = random_tensor((50, 60, 7), torch.float32, seed=21)
    sd = {
        "t2": random_tensor((200, 33), torch.float32, seed=22).t(),
        "p3": base.permute(2, 0, 1),
        "p3b": base.permute(1, 2, 0),
        "expanded_like": random_tensor((1, 33, 1, 40), torch.int16, seed=23).permute(3, 2, 1, 0),
        # a view into a bigger tensor: dcp may save it with a storage offset or clone it
        "slice": random_tensor((300, 40), torch.float64, seed=24)[100:180, 5:30],
        "column": random_tensor((128, 64), torch.bfloat16, seed=25)[:, 3],
    }
    for k in ("t2", "p3", "p3b", "slice", "column"):
        assert not sd[k].is_contiguous(), k
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    dst = zeros_like_tree(sd)
    asyncload.load(dst, ckpt, options=options)
    assert_bitwise_equal(sd, dst)


@pytest.mark.parametrize(
    "single_file_per_rank", [False, True], ids=["file_per_item", "file_per_rank"]
)
@pytest.mark.parametrize("options", [DEFAULT, TINY], ids=["default", "tiny"])
def test_file_per_item_and_per_rank(tmp_path, single_file_per_rank, options):
    sd = {f"w{i}": random_tensor((40 + i, 50), torch.float32, seed=i) for i in range(6)}
    sd["obj"] = {"epoch": 3}
    sd["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    ckpt = tmp_path / "ckpt"
    make_checkpoint(
        ckpt, sd, storage_writer=FileSystemWriter(ckpt, single_file_per_rank=single_file_per_rank)
    )
    files = sorted(p.name for p in ckpt.glob("*.distcp"))
    if single_file_per_rank:
        assert len(files) == 1
    else:
        assert len(files) == len(sd)
    dst = zeros_like_tree(sd, object_placeholder=None)
    stats = asyncload.load(dst, ckpt, options=options)
    assert_bitwise_equal(sd, dst)
    assert stats.files >= len(files)


def test_thread_count_writer_many_files(tmp_path):
    sd = {f"k{i}": random_tensor((17, 31), torch.float16, seed=i) for i in range(10)}
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, sd, storage_writer=FileSystemWriter(ckpt, thread_count=3))
    assert len(list(ckpt.glob("*.distcp"))) == 3
    dst = zeros_like_tree(sd)
    asyncload.load(dst, ckpt, options=TINY)
    assert_bitwise_equal(sd, dst)


@pytest.mark.parametrize("options", [DEFAULT, TINY], ids=["default", "tiny"])
def test_non_contiguous_destinations(tmp_path, options):
    sd = {
        "a": random_tensor((64, 80), torch.float32, seed=31),
        "b": random_tensor((30, 20, 10), torch.int32, seed=32),
        "c": random_tensor((100,), torch.float16, seed=33),
        "d": random_tensor((48, 96), torch.bfloat16, seed=34).t(),  # saved transposed too
        "e": random_tensor((70, 50), torch.complex64, seed=35),
    }
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    big_a = torch.zeros(80, 64)  # "a" lands in its transpose
    big_b = torch.zeros(10, 30, 20, dtype=torch.int32)
    big_c = torch.zeros(300, dtype=torch.float16)
    big_d = torch.zeros(200, 100, dtype=torch.bfloat16)
    big_e = torch.zeros(90, 60, dtype=torch.complex64)
    dst = {
        "a": big_a.t(),
        "b": big_b.permute(1, 2, 0),
        "c": big_c[::3],
        "d": big_d[10:106, 20:68],
        "e": big_e[5:75, 3:53],
    }
    for k, v in dst.items():
        assert not v.is_contiguous(), k
    keep = {k: v.clone() for k, v in {"big_c": big_c, "big_d": big_d, "big_e": big_e}.items()}
    asyncload.load(dst, ckpt, options=options)
    assert_bitwise_equal(
        {k: v.contiguous() for k, v in sd.items()}, {k: v.contiguous() for k, v in dst.items()}
    )
    # the bytes around the views were not touched
    untouched_c = big_c.clone()
    untouched_c[::3] = 0
    assert torch.count_nonzero(untouched_c) == 0
    mask_d = torch.ones_like(big_d, dtype=torch.bool)
    mask_d[10:106, 20:68] = False
    assert torch.equal(big_d[mask_d], keep["big_d"][mask_d])
    mask_e = torch.ones(big_e.shape, dtype=torch.bool)
    mask_e[5:75, 3:53] = False
    assert torch.equal(big_e[mask_e], keep["big_e"][mask_e])


def test_destination_views_share_one_storage(tmp_path):
    # two destinations that are disjoint slices of one flat buffer (like a flat-param layout)
    sd = {
        "x": random_tensor((33, 17), torch.float32, seed=41),
        "y": random_tensor((1000,), torch.float32, seed=42),
    }
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    flat = torch.full((7 + 33 * 17 + 1000 + 5,), -1.0)
    dst = {"x": flat[7 : 7 + 561].view(33, 17), "y": flat[7 + 561 : 7 + 561 + 1000]}
    asyncload.load(dst, ckpt, options=TINY)
    assert_bitwise_equal(sd, {k: v.clone() for k, v in dst.items()})
    assert flat[:7].eq(-1).all() and flat[-5:].eq(-1).all()


@pytest.mark.parametrize("options", [DEFAULT, TINY], ids=["default", "tiny"])
def test_dtype_cast_when_allowed(tmp_path, options):
    sd = {
        "w": torch.randn(64, 70),
        "h": torch.randn(33).half(),
        "i": torch.arange(5000, dtype=torch.int32),
    }
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    dst = {
        "w": torch.zeros(64, 70, dtype=torch.bfloat16),
        "h": torch.zeros(33, dtype=torch.float64),
        "i": torch.zeros(5000, dtype=torch.int64),
    }
    with pytest.raises(asyncload.StateDictMismatchError) as ei:
        asyncload.load(dst, ckpt, options=options)
    msg = str(ei.value)
    assert "dtype" in msg and "allow_dtype_cast" in msg
    assert any(f"'{k}'" in msg for k in dst)
    for v in dst.values():
        assert torch.count_nonzero(v) == 0
    asyncload.load(dst, ckpt, options=options.replace(allow_dtype_cast=True))
    assert torch.equal(dst["w"], sd["w"].to(torch.bfloat16))
    assert torch.equal(dst["h"], sd["h"].to(torch.float64))
    assert torch.equal(dst["i"], sd["i"].to(torch.int64))


def test_large_tensor_split_into_many_chunks(tmp_path):
    t = random_tensor((1 << 20,), torch.uint8, seed=51)  # 1 MiB
    sd = {"t": t, "tail": torch.arange(3)}
    ckpt = make_checkpoint(tmp_path / "ckpt", sd)
    dst = zeros_like_tree(sd)
    opts = asyncload.LoadOptions(
        chunk_size=64 << 10, min_chunk_size=4 << 10, memory_budget=256 << 10
    )
    stats = asyncload.load(dst, ckpt, options=opts)
    assert_bitwise_equal(sd, dst)
    assert stats.chunks >= math.ceil(t.numel() / opts.chunk_size)
    assert stats.peak_buffered_bytes <= opts.memory_budget
    assert stats.bytes_assembled == total_tensor_bytes(sd)


def test_load_into_a_modules_own_state_dict(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Sequential(
        torch.nn.Linear(40, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8, bias=False)
    )
    src[1].weight.data.uniform_()
    ckpt = make_checkpoint(tmp_path / "ckpt", src.state_dict())
    dst = torch.nn.Sequential(
        torch.nn.Linear(40, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8, bias=False)
    )
    sd = dst.state_dict()  # detached tensors sharing the parameters' memory
    asyncload.load(sd, ckpt, options=TINY)
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), name)
        assert b.requires_grad


# --- property: random state dicts, random layouts, random knobs ------------------------------


@st.composite
def _tensor_cases(draw):
    dtype = draw(st.sampled_from(SAVEABLE_DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=ndim, max_size=ndim)))
    perm = draw(st.permutations(range(ndim))) if ndim else []
    dest_kind = draw(st.sampled_from(["plain", "transposed", "padded"]))
    return dtype, shape, perm, dest_kind


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    cases=st.lists(_tensor_cases(), min_size=1, max_size=6),
    chunk_size=st.sampled_from([4096, 5000, 65536, 16 << 20]),
    min_chunk_size=st.sampled_from([1, 512, 4096, 1 << 20]),
    concurrency=st.sampled_from([1, 3, 64, "auto"]),
    budget=st.sampled_from([64 << 10, 100_000, 512 << 20]),
)
def test_property_random_state_dicts_round_trip(
    tmp_path_factory, cases, chunk_size, min_chunk_size, concurrency, budget
):
    sd, dst = {}, {}
    for i, (dtype, shape, perm, dest_kind) in enumerate(cases):
        phys = [shape[p] for p in perm]
        inv = [perm.index(d) for d in range(len(perm))]
        base = random_tensor(tuple(phys), dtype, seed=i)
        sd[f"t{i}"] = base.permute(inv) if shape else base
        if dest_kind == "transposed" and len(shape) >= 2:
            dst[f"t{i}"] = torch.zeros(tuple(reversed(shape)), dtype=dtype).permute(
                *reversed(range(len(shape)))
            )
        elif dest_kind == "padded" and len(shape) >= 1:
            big = torch.zeros(tuple(n + 2 for n in shape), dtype=dtype)
            v = big
            for d, n in enumerate(shape):
                v = v.narrow(d, 1, n)
            dst[f"t{i}"] = v
        else:
            dst[f"t{i}"] = torch.zeros(shape, dtype=dtype)
    ckpt = make_checkpoint(tmp_path_factory.mktemp("prop") / "ckpt", sd)
    opts = asyncload.LoadOptions(
        chunk_size=chunk_size,
        min_chunk_size=min(min_chunk_size, chunk_size),
        concurrency=concurrency,
        memory_budget=budget,
    )
    stats = asyncload.load(dst, ckpt, options=opts)
    assert_bitwise_equal(sd, dst)
    assert stats.bytes_assembled == total_tensor_bytes(sd)
    assert stats.peak_buffered_bytes <= budget
