"""The dtype rule (``asyncload.engine.plan.cast_loss`` / ``widening_is_lossless``, tabulated in
docs/errors.md): with asyncload's planners, lossless widening loads by default and every lossy
conversion is a typed refusal unless ``allow_dtype_cast=True``; with torch's own
``DefaultLoadPlanner`` behind ``PipelinedReader``, dtypes convert as torch's ``FileSystemReader``
converts them, bit for bit.

The rule is checked three ways: against the table (every pair), against the values themselves
(every pair called lossless round-trips every tested value exactly, every pair called lossy has a
value that does not), and end to end (loads of real ``dcp.save`` output compared bit for bit with
``saved.to(dst_dtype)``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import SAVEABLE_DTYPES, assert_bitwise_equal, make_checkpoint, random_tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import asyncload
from asyncload import LoadOptions, PipelinedReader, StateDictMismatchError
from asyncload.engine.plan import can_copy, cast_loss, widening_is_lossless


def _dt(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


ALL = [
    d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        _dt("uint16"),
        _dt("uint32"),
        _dt("uint64"),
        _dt("float8_e4m3fn"),
        _dt("float8_e4m3fnuz"),
        _dt("float8_e5m2"),
        _dt("float8_e5m2fnuz"),
        _dt("float8_e8m0fnu"),
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
    )
    if isinstance(d, torch.dtype)
]

# The table of docs/errors.md: each dtype and the dtypes it widens into without loss.
_C = ["complex32", "complex64", "complex128"]
_F8 = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]
TABLE: dict[str, list[str]] = {
    "bool": [
        *["uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"],
        *_F8[:4],  # not float8_e8m0fnu: it has no zero
        *["float16", "bfloat16", "float32", "float64", *_C],
    ],
    "uint8": [
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        *_C,
    ],
    "int8": ["int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", *_C],
    "int16": ["int32", "int64", "float32", "float64", "complex64", "complex128"],
    "int32": ["int64", "float64", "complex128"],
    "int64": [],
    "uint16": [
        "int32",
        "int64",
        "uint32",
        "uint64",
        "float32",
        "float64",
        "complex64",
        "complex128",
    ],
    "uint32": ["int64", "uint64", "float64", "complex128"],
    "uint64": [],
    "float8_e4m3fn": ["float16", "bfloat16", "float32", "float64", *_C],
    "float8_e4m3fnuz": ["float16", "bfloat16", "float32", "float64", *_C],
    "float8_e5m2": ["float16", "bfloat16", "float32", "float64", *_C],
    "float8_e5m2fnuz": ["float16", "bfloat16", "float32", "float64", *_C],
    "float8_e8m0fnu": ["bfloat16", "float32", "float64", "complex64", "complex128"],
    "float16": ["float32", "float64", *_C],
    "bfloat16": ["float32", "float64", "complex64", "complex128"],
    "float32": ["float64", "complex64", "complex128"],
    "float64": ["complex128"],
    "complex32": ["complex64", "complex128"],
    "complex64": ["complex128"],
    "complex128": [],
}


def name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


PAIRS = [(s, d) for s in ALL for d in ALL if s != d]


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{name(s)}->{name(d)}" for s, d in PAIRS])
def test_rule_matches_the_table(src: torch.dtype, dst: torch.dtype) -> None:
    assert widening_is_lossless(src, dst) == (name(dst) in TABLE[name(src)]), cast_loss(src, dst)
    assert widening_is_lossless(src, src)


def _samples(dt: torch.dtype) -> torch.Tensor:
    """Values of ``dt``: every bit pattern of a 1- or 2-byte dtype, else random bits and the extremes."""
    if dt == torch.bool:
        return torch.tensor([False, True])
    if dt.is_complex:
        part = _samples(
            {torch.complex32: torch.float16, torch.complex64: torch.float32}.get(dt, torch.float64)
        )
        n = part.numel()
        g = torch.Generator().manual_seed(5)
        return (
            torch.complex(part, part[torch.randperm(n, generator=g)]).to(dt)
            if dt != torch.complex32
            else (torch.complex(part.float(), part[torch.randperm(n, generator=g)].float()).to(dt))
        )
    if dt.itemsize <= 2:
        return (
            torch.arange(1 << (8 * dt.itemsize), dtype=torch.int32)
            .to(torch.int16 if dt.itemsize == 2 else torch.uint8)
            .view(dt)
        )
    vals = random_tensor((1 << 16,), dt, seed=7)
    if dt.is_floating_point:
        fi = torch.finfo(dt)
        extra = torch.tensor(
            [fi.max, fi.min, fi.tiny, -fi.tiny, 0.0, -0.0, float("inf"), float("-inf")],
            dtype=torch.float64,
        )
        return torch.cat([vals, extra.to(dt), (vals.to(torch.float64) * 0).to(dt)])
    ii = torch.iinfo(dt)
    return torch.cat(
        [
            vals,
            torch.tensor(
                [ii.min, ii.max, 0, 1], dtype=torch.int64 if dt != torch.uint64 else dt
            ).to(dt),
        ]
    )


def _exact(t: torch.Tensor) -> torch.Tensor | list[Any]:
    """The values as numbers compared exactly: float64 holds every value of the floats and of
    integers up to 32 bits; 64-bit integers go to Python ints."""
    if t.dtype in (torch.int64, _dt("uint64")):
        return t.tolist()
    if t.dtype.is_complex:
        return torch.view_as_real(t.to(torch.complex128))
    return t.to(torch.float64)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: ``b`` holds the value of ``a`` (NaN for NaN; zeros keep their sign)."""
    ea, eb = _exact(a), _exact(b)
    if isinstance(ea, list) or isinstance(eb, list):
        la = ea if isinstance(ea, list) else _listed(ea)
        lb = eb if isinstance(eb, list) else _listed(eb)
        return torch.tensor([x == y for x, y in zip(la, lb)])
    if ea.dim() != eb.dim():  # complex against real: the imaginary part must be zero
        if ea.dim() == 2:
            ea, eb = eb, ea
        eb_imag_zero = (eb[:, 1] == 0) & ~torch.signbit(eb[:, 1])
        return _same_float(ea, eb[:, 0]) & eb_imag_zero
    if ea.dim() == 2:
        return _same_float(ea[:, 0], eb[:, 0]) & _same_float(ea[:, 1], eb[:, 1])
    return _same_float(ea, eb)


def _listed(t: torch.Tensor) -> list[Any]:
    """Exact Python numbers of a float64 (or float64 pairs for complex) tensor."""
    if t.dim() == 2:
        return [complex(r, i) for r, i in t.tolist()]
    return t.tolist()  # Python compares ints with floats exactly


def _same_float(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    both_nan = a.isnan() & b.isnan()
    return both_nan | ((a == b) & (torch.signbit(a) == torch.signbit(b)))


CONVERTIBLE = [(s, d) for s, d in PAIRS if can_copy(s, d) and can_copy(d, s)]


@pytest.mark.parametrize(
    "src,dst", CONVERTIBLE, ids=[f"{name(s)}->{name(d)}" for s, d in CONVERTIBLE]
)
def test_rule_matches_the_values(src: torch.dtype, dst: torch.dtype) -> None:
    """Lossless: every sample keeps its value in dst (and back). Lossy: some sample does not."""
    with warnings.catch_warnings():  # torch's note on complex32, once per process
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
        x = _samples(src)
        y = x.to(dst)
    same = _same_values(x, y)
    if widening_is_lossless(src, dst):
        assert bool(same.all()), f"{name(src)} -> {name(dst)} changed {int((~same).sum())} values"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
            assert bool(_same_values(y.to(src), x).all())  # and back
    else:
        assert not bool(same.all()), (
            f"{name(src)} -> {name(dst)} is called lossy ({cast_loss(src, dst)}) but kept every value"
        )


# --- end to end: real dcp.save output --------------------------------------------------------------


@pytest.fixture(scope="module")
def per_dtype(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """One tensor of each saveable dtype (random bits: NaNs, infinities, subnormals included)."""
    sd = {name(d): random_tensor((37, 11), d, seed=i) for i, d in enumerate(SAVEABLE_DTYPES)}
    return make_checkpoint(tmp_path_factory.mktemp("dtypes") / "ckpt", sd), sd


WIDE = [
    (s, d)
    for s in SAVEABLE_DTYPES
    for d in ALL
    if s != d and widening_is_lossless(s, d) and can_copy(s, d)
]
TARGETS = sorted({d for _, d in WIDE}, key=ALL.index)


@pytest.mark.parametrize("dst", TARGETS, ids=[name(d) for d in TARGETS])
def test_widening_loads_by_default(
    per_dtype: tuple[Path, dict[str, torch.Tensor]], dst: torch.dtype
) -> None:
    path, sd = per_dtype
    keys = [name(s) for s, d in WIDE if d == dst]
    dest = {k: torch.zeros(37, 11, dtype=dst) for k in keys}
    stats = asyncload.load(dest, path)  # default options: allow_dtype_cast=False
    for k in keys:
        assert_bitwise_equal(dest[k], sd[k].to(dst), where=f"{k} -> {name(dst)}")
    assert stats.bytes_assembled == sum(t.numel() * t.element_size() for t in dest.values())


LOSSY = [
    (s, d)
    for s in SAVEABLE_DTYPES
    for d in SAVEABLE_DTYPES
    if s != d and not widening_is_lossless(s, d)
]


@pytest.mark.parametrize("src,dst", LOSSY, ids=[f"{name(s)}->{name(d)}" for s, d in LOSSY])
def test_lossy_cast_refused_unless_allowed(
    per_dtype: tuple[Path, dict[str, torch.Tensor]], src: torch.dtype, dst: torch.dtype
) -> None:
    path, sd = per_dtype
    k = name(src)
    dest = {k: torch.zeros(37, 11, dtype=dst)}
    with pytest.raises(StateDictMismatchError) as ei:
        asyncload.load(dest, path)
    msg = str(ei.value)
    assert f"key '{k}'" in msg and f"dtype {dst}" in msg and f"checkpoint {src}" in msg
    assert "allow_dtype_cast=True" in msg and (cast_loss(src, dst) or "") in msg
    assert not bool(dest[k].view(torch.uint8).any())
    if can_copy(src, dst):
        asyncload.load(dest, path, options=LoadOptions(allow_dtype_cast=True))
        assert_bitwise_equal(dest[k], sd[k].to(dst))
    else:
        with pytest.raises(StateDictMismatchError, match="cannot be converted"):
            asyncload.load(dest, path, options=LoadOptions(allow_dtype_cast=True))


def test_refusal_messages_say_why() -> None:
    assert "mantissa" in (cast_loss(torch.float32, torch.bfloat16) or "")
    assert "exponent range" in (cast_loss(torch.bfloat16, torch.float16) or "")
    assert "integer" in (cast_loss(torch.float32, torch.int64) or "")
    assert "imaginary" in (cast_loss(torch.complex64, torch.float64) or "")
    assert "negative" in (cast_loss(torch.int8, torch.uint8) or "")
    assert "significant bits" in (cast_loss(torch.int64, torch.float64) or "")
    assert "bool" in (cast_loss(torch.uint8, torch.bool) or "")


# --- torch's own planner: what torch does ------------------------------------------------------------


def _realistic(sd_dtypes: list[torch.dtype]) -> dict[str, torch.Tensor]:
    """Finite values in range of every destination below (no NaN: conversions of NaN or of
    out-of-range floats into integers are undefined in C, and may differ between code paths)."""
    g = torch.Generator().manual_seed(3)
    return {
        name(d): (torch.randn(64, 33, generator=g, dtype=torch.float64) * 50)
        .clamp(-120, 120)
        .to(d)
        for d in sd_dtypes
    }


TORCH_SRC = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
]
TORCH_DST = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
]


@pytest.fixture(scope="module")
def realistic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = _realistic(TORCH_SRC)
    return make_checkpoint(tmp_path_factory.mktemp("realistic") / "ckpt", sd), sd


def _torch_load(dest: dict[str, Any], reader: Any, planner: Any = None) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)


@pytest.mark.parametrize("dst", TORCH_DST, ids=[name(d) for d in TORCH_DST])
def test_torch_planner_casts_as_torch_does(
    realistic: tuple[Path, dict[str, torch.Tensor]], dst: torch.dtype
) -> None:
    path, sd = realistic
    ours = {k: torch.zeros(64, 33, dtype=dst) for k in sd}
    theirs = {k: torch.zeros(64, 33, dtype=dst) for k in sd}
    _torch_load(ours, PipelinedReader(path))  # DefaultLoadPlanner
    _torch_load(theirs, FileSystemReader(path))
    assert_bitwise_equal(ours, theirs)
    # asyncload.load with torch's planner does the same
    again = {k: torch.zeros(64, 33, dtype=dst) for k in sd}
    asyncload.load(again, path, planner=DefaultLoadPlanner())
    assert_bitwise_equal(again, theirs)


def test_asyncload_planner_refuses_what_torch_planner_casts(
    realistic: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, sd = realistic
    dest = {"float32": torch.zeros(64, 33, dtype=torch.bfloat16)}
    with pytest.raises(
        StateDictMismatchError, match=r"key 'float32'.*torch.bfloat16.*allow_dtype_cast"
    ):
        asyncload.load(dest, path)
    _torch_load(dest, PipelinedReader(path), DefaultLoadPlanner(allow_partial_load=True))
    assert_bitwise_equal(dest["float32"], sd["float32"].to(torch.bfloat16))


# --- the format modules' path (_plan.plan_tensor): safetensors and torch.save files -----------------


def test_safetensors_widening_and_refusal(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    saved = {
        "h": random_tensor((16, 8), torch.float16, 1),
        "i": torch.arange(-64, 64, dtype=torch.int8),
    }
    f = tmp_path / "model.safetensors"
    st.save_file(saved, str(f))
    dest = {"h": torch.zeros(16, 8, dtype=torch.float32), "i": torch.zeros(128, dtype=torch.int32)}
    asyncload.load(dest, f)
    assert_bitwise_equal(dest["h"], saved["h"].to(torch.float32))
    assert_bitwise_equal(dest["i"], saved["i"].to(torch.int32))
    dest = {"h": torch.zeros(16, 8, dtype=torch.int16), "i": torch.zeros(128, dtype=torch.int32)}
    with pytest.raises(StateDictMismatchError, match=r"key 'h'.*float into an integer"):
        asyncload.load(dest, f)


def test_torchsave_file_widening(tmp_path: Path) -> None:
    saved = {"w": random_tensor((9, 7), torch.bfloat16, 2), "b": torch.tensor([True, False, True])}
    f = tmp_path / "model.pt"
    torch.save(saved, f)
    dest = {"w": torch.zeros(9, 7, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.int64)}
    asyncload.load(dest, f)
    assert_bitwise_equal(dest["w"], saved["w"].to(torch.float64))
    assert_bitwise_equal(dest["b"], saved["b"].to(torch.int64))
