"""Forged checkpoints: metadata that lies about coverage, rebuild calls with impossible
arguments, destinations that cannot take what the checkpoint holds (issue 11, items 1 and 4).

Every hostile input starts from a real ``dcp.save`` / ``torch.save`` / safetensors file.
The rule checked: a typed ``AsyncLoadError`` naming the key, and the destination left
untouched where the docs promise it; never a load that returns normally with part of
the destination unwritten.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt import assert_bitwise_equal, make_checkpoint
from _corrupt import is_sentinel, mutate_metadata, read_metadata, sentinel_like, write_metadata
from _forging import DTYPES, INTS, KEYS, KINDS, PIECES, forge_state_dict, load_forged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import asyncload
from asyncload import (
    CheckpointFormatError,
    LoadOptions,
    PipelinedLoadPlanner,
    StateDictMismatchError,
)
from asyncload.decoding.allowlist import check_metadata
from asyncload.decoding.dcp_checks import _check_coverage as check_coverage
from asyncload.decoding.work import WorkBudget

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    return forge_state_dict()


def _chunks(md: Any, key: str) -> list[Any]:
    return md.state_dict_metadata[key].chunks


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        ("no chunks", r"key 'big'.* lists no chunk"),
        ("short chunk", r"key 'big': the chunks hold 2048 of the tensor's 4096 elements"),
        ("empty chunk", r"key 'big'.* lists no chunk"),
        ("overlap", r"key 'big': chunks 0 .* and 1 .* overlap"),
        ("duplicate", r"key 'big': chunks 0 .* and 1 .* overlap"),
        ("scalar twice", r"key 'scalar'.* overlapping chunks"),
        ("half of nested", r"key 'nested.w': the chunks hold 35 of the tensor's 70 elements"),
    ],
)
def test_chunks_that_do_not_cover_the_tensor_exactly(
    fresh_ckpt: tuple[Path, dict[str, Any]], forge: str, message: str
) -> None:
    path, sd = fresh_ckpt

    def change(md: Any) -> None:
        big = _chunks(md, "big")
        if forge == "no chunks":
            big.clear()
        elif forge == "short chunk":
            big[0].sizes = torch.Size([32, 64])
        elif forge == "empty chunk":
            big[0].sizes = torch.Size([0, 64])
        elif forge == "overlap":
            big[0].sizes = torch.Size([40, 64])
            big.append(
                ChunkStorageMetadata(offsets=torch.Size([24, 0]), sizes=torch.Size([40, 64]))
            )
        elif forge == "duplicate":
            big.append(copy.deepcopy(big[0]))
        elif forge == "scalar twice":
            _chunks(md, "scalar").append(copy.deepcopy(_chunks(md, "scalar")[0]))
        elif forge == "half of nested":
            _chunks(md, "nested.w")[0].sizes = torch.Size([5, 7])

    mutate_metadata(path, change)
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointFormatError, match=message):
        asyncload.load(dest, path, options=PIECES)
    assert is_sentinel(dest)


def test_chunked_metadata_that_covers_exactly_passes(ckpt: tuple[Path, dict[str, Any]]) -> None:
    """A grid of disjoint chunks (how a sharded save describes a tensor) passes; the same
    grid with one chunk missing or one shifted by one element does not."""
    md = read_metadata(ckpt[0])
    smd = md.state_dict_metadata["big"]
    smd.chunks = [
        ChunkStorageMetadata(offsets=torch.Size([r, c]), sizes=torch.Size([16, 32]))
        for r in range(0, 64, 16)
        for c in (0, 32)
    ]
    check_metadata(md, "forged")
    smd.chunks.pop(3)
    with pytest.raises(
        CheckpointFormatError, match=r"key 'big': the chunks hold 3584 of the tensor's 4096"
    ):
        check_metadata(md, "forged")
    smd.chunks.append(
        ChunkStorageMetadata(offsets=torch.Size([16, 31]), sizes=torch.Size([16, 32]))
    )
    with pytest.raises(CheckpointFormatError, match=r"key 'big': chunks .* overlap"):
        check_metadata(md, "forged")


def test_coverage_check_is_cheap_for_thousands_of_chunks(
    ckpt: tuple[Path, dict[str, Any]],
) -> None:
    """2,000 tensors of 64 chunks each (a grid, row- and column-sharded): work linear in the chunks."""
    md = read_metadata(ckpt[0])
    proto = md.state_dict_metadata["big"]
    for i in range(2000):
        smd = copy.copy(proto)
        smd.size = torch.Size([1024, 1024])
        if i % 2:  # column-sharded: every chunk starts at row 0
            smd.chunks = [
                ChunkStorageMetadata(offsets=torch.Size([0, c * 16]), sizes=torch.Size([1024, 16]))
                for c in range(64)
            ]
        else:
            smd.chunks = [
                ChunkStorageMetadata(
                    offsets=torch.Size([r * 128, c * 128]), sizes=torch.Size([128, 128])
                )
                for r in range(8)
                for c in range(8)
            ]
        md.state_dict_metadata[f"t{i}"] = smd
    # the work is counted, not timed: linear in keys, chunk dimensions and storage entries
    work = WorkBudget()
    check_metadata(md, "many", work)
    sdm = md.state_dict_metadata
    dims = sum(len(v.chunks) * max(1, len(v.size)) for v in sdm.values() if hasattr(v, "chunks"))
    assert dims >= 2000 * 64 * 2
    assert work.spent <= 4 * (len(sdm) + dims + len(md.storage_data)), work
    # the sweep of the field-by-field check too: a chunk is compared only with those that
    # still reach it, at most its own row of the 8 x 8 grid and the row before
    sweep = WorkBudget()
    for i in (0, 1):
        check_coverage(sdm[f"t{i}"].chunks, tuple(sdm[f"t{i}"].size), f"t{i}", sweep)
    assert sweep.spent <= 2 * 64 * (1 + 2 * 8), sweep
    # a budget is a limit: over it, a CheckpointFormatError naming it
    refused = r"many: key 't\d+' needs more than the 10000 units of decoding work allowed \(its work budget\)"
    with pytest.raises(CheckpointFormatError, match=refused):
        check_metadata(md, "many", WorkBudget(limit=10_000))


def test_planner_refuses_a_plan_that_leaves_destination_elements_unread(
    ckpt: tuple[Path, dict[str, Any]],
) -> None:
    """Independently of check_metadata: the planner counts what its plan reads for every
    destination against the destination's size (metadata handed over unchecked)."""
    md = read_metadata(ckpt[0])
    _chunks(md, "big")[0].sizes = torch.Size([32, 64])
    planner = PipelinedLoadPlanner()
    planner.set_up_planner({"big": torch.zeros(64, 64)}, md, True)
    planner.allow_partial_load = True
    with pytest.raises(
        CheckpointFormatError,
        match=r"key 'big': the checkpoint's chunks give 2048 of the destination's 4096",
    ):
        planner.create_local_plan()


def test_load_that_did_not_write_every_byte_does_not_report_success(
    fresh_ckpt: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session counts what it wrote against the destinations' sizes: a read that
    silently went missing (here: the pipeline drops its last chunk) is an error."""
    from asyncload.engine import pipeline as _pipeline

    path, sd = fresh_ckpt
    real = _pipeline.Pipeline.run

    async def lossy(self: Any, chunks: list[Any]) -> None:
        payload = [c for c in chunks if any(s.payload for s in c.segments)]
        drop = payload[-1] if payload else None
        await real(self, [c for c in chunks if c is not drop])

    monkeypatch.setattr(_pipeline.Pipeline, "run", lossy)
    dest = sentinel_like(sd)
    with pytest.raises(
        CheckpointFormatError, match=r"the load wrote \d+ of the \d+ destination bytes.*'big'"
    ):
        asyncload.load(dest, path, options=PIECES)


# --- item 4: impossible rebuild arguments -------------------------------------------------


def _flip_requires_grad(pkl: bytes) -> bytes:
    """The data.pkl with its last ``requires_grad=False`` (NEWFALSE) made True (NEWTRUE):
    the tensor's, or a Parameter's own (which follows its tensor's)."""
    at = pkl.rfind(b"\x89")
    assert at > 0, "expected a NEWFALSE opcode"
    return pkl[:at] + b"\x88" + pkl[at + 1 :]


def _rezip(archive: bytes, fix_pickle: Any) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = fix_pickle(data)
            dst.writestr(info.filename, data)
    return out.getvalue()


def _forged_int_tensor(dtype: torch.dtype, parameter: bool) -> bytes:
    t = torch.zeros(3, dtype=dtype)
    obj: Any = torch.nn.Parameter(t, requires_grad=False) if parameter else t
    buf = io.BytesIO()
    torch.save(obj, buf)
    return _rezip(buf.getvalue(), _flip_requires_grad)


def _replace_record(ckpt: Path, fqn: str, record: bytes) -> None:
    """Splice ``record`` in place of key ``fqn``'s record; .metadata's offsets follow."""
    md = read_metadata(ckpt)
    target = next(info for idx, info in md.storage_data.items() if idx.fqn == fqn)
    f = ckpt / target.relative_path
    blob = f.read_bytes()
    delta = len(record) - target.length
    f.write_bytes(blob[: target.offset] + record + blob[target.offset + target.length :])
    for info in md.storage_data.values():
        if info.relative_path == target.relative_path and info.offset > target.offset:
            info.offset += delta
    target.length = len(record)
    write_metadata(ckpt, md)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("parameter", [False, True], ids=["tensor", "parameter"])
def test_integer_tensor_requiring_grad_in_a_dcp_object_record(
    fresh_ckpt: tuple[Path, dict[str, Any]], dtype: torch.dtype, parameter: bool
) -> None:
    path, sd = fresh_ckpt
    _replace_record(path, "nested.step", _forged_int_tensor(dtype, parameter))
    dest = sentinel_like(sd)
    kind = "parameter" if parameter else "tensor"
    with pytest.raises(
        CheckpointFormatError,
        match=rf"'nested.step'.*{kind} record of dtype {dtype} has requires_grad=True",
    ):
        asyncload.load(dest, path, options=PIECES)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("parameter", [False, True], ids=["tensor", "parameter"])
def test_integer_tensor_requiring_grad_in_a_torch_save_file(
    tmp_path: Path, dtype: torch.dtype, parameter: bool
) -> None:
    t = torch.zeros(3, dtype=dtype)
    value: Any = torch.nn.Parameter(t, requires_grad=False) if parameter else t
    buf = io.BytesIO()
    torch.save({"ok": torch.ones(2), "w": value}, buf)  # "w" last: its flag is the last NEWFALSE
    f = tmp_path / "model.pt"
    f.write_bytes(_rezip(buf.getvalue(), _flip_requires_grad))
    dest = sentinel_like({"ok": torch.ones(2), "w": t})
    kind = "parameter" if parameter else "tensor"
    with pytest.raises(
        CheckpointFormatError,
        match=rf"model\.pt.*{kind} record of dtype {dtype} has requires_grad",
    ):
        asyncload.load(dest, f)
    assert is_sentinel(dest)


def test_float_tensor_requiring_grad_still_loads(tmp_path: Path) -> None:
    """The check costs no legitimate file: a float Parameter that requires grad loads."""
    sd = {"p": torch.nn.Parameter(torch.randn(3, 2)), "n": torch.arange(4)}
    f = tmp_path / "model.pt"
    torch.save(sd, f)
    dest = {"p": torch.zeros(3, 2), "n": torch.zeros(4, dtype=torch.long)}
    asyncload.load(dest, f)
    assert_bitwise_equal(dest, {k: v.detach() for k, v in sd.items()})


# --- item 4: destinations that cannot take the checkpoint's tensor ------------------------


@pytest.mark.parametrize("value", [3, [1.0, 2.0], "np"], ids=["int", "list", "numpy"])
def test_destination_that_is_not_a_tensor(ckpt: tuple[Path, dict[str, Any]], value: Any) -> None:
    import numpy as np

    path, sd = ckpt
    dest = sentinel_like(sd)
    given = np.zeros((64, 64), dtype=np.float32) if value == "np" else value
    dest["big"] = given
    shown = {"int": "int", "list": "list", "np": "numpy.ndarray"}[
        value if isinstance(value, str) else type(value).__name__
    ]
    with pytest.raises(
        StateDictMismatchError,
        match=r"key 'big': the checkpoint holds a tensor of shape \[64, 64\]",
    ) as ei:
        asyncload.load(dest, path, options=PIECES)
    assert f"the destination holds a {shown}:" in str(ei.value)
    assert (
        dest["big"] is given
    )  # the caller's dict is left as it was (torch's set-up would put None there)
    assert is_sentinel({k: v for k, v in dest.items() if k != "big"})


@pytest.mark.parametrize("dtype", ["bits8", "float4_e2m1fn_x2"])
def test_cast_towards_a_dtype_without_conversion(
    ckpt: tuple[Path, dict[str, Any]], dtype: str
) -> None:
    dt = getattr(torch, dtype, None)
    if dt is None:
        pytest.skip(f"torch has no {dtype}")
    path, sd = ckpt
    dest = sentinel_like(sd)
    dest["big"] = torch.zeros(64, 64 * dt.itemsize, dtype=torch.uint8).view(dt)
    with pytest.raises(
        StateDictMismatchError,
        match=r"key 'big': the checkpoint's torch.float32 cannot be converted",
    ):
        asyncload.load(dest, path, options=LoadOptions(allow_dtype_cast=True))
    assert is_sentinel({k: v for k, v in dest.items() if k != "big"})


def test_cast_without_conversion_from_a_safetensors_file(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    f = tmp_path / "model.safetensors"
    safetensors.save_file({"w": torch.randn(4, 4), "b": torch.ones(4)}, str(f))
    dest = {"w": torch.zeros(4, 4, dtype=torch.uint8).view(torch.bits8), "b": torch.zeros(4)}
    with pytest.raises(StateDictMismatchError, match=r"key 'w'.* cannot be converted"):
        asyncload.load(dest, f, options=LoadOptions(allow_dtype_cast=True))
    assert bool((dest["b"] == 0).all())


# --- property: structural mutations of real metadata --------------------------------------

_EXAMPLES = int(os.environ.get("ASYNCLOAD_FORGED_EXAMPLES", "400"))


@st.composite
def _mutation(draw: st.DrawFn) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(KINDS))
    key = draw(st.sampled_from(KEYS))
    value = draw(st.one_of(st.integers(-2, 70), st.sampled_from(INTS)))
    return (
        kind,
        key,
        draw(st.integers(0, 3)),
        value,
        draw(st.sampled_from(DTYPES)),
        draw(st.integers(-64, 64)),
    )


@pytest.fixture(scope="module")
def forge_dir(
    tmp_path_factory: pytest.TempPathFactory, ckpt_state_dict: dict[str, Any]
) -> tuple[Path, Any]:
    path = make_checkpoint(
        tmp_path_factory.mktemp("forge") / "ckpt", copy.deepcopy(ckpt_state_dict)
    )
    return path, read_metadata(path)


def test_structural_metadata_mutations_end_typed_or_load_exactly(
    forge_dir: tuple[Path, Any], ckpt_state_dict: dict[str, Any], tmp_path: Path
) -> None:
    base, original = forge_dir
    work = tmp_path / "ckpt"
    shutil.copytree(base, work)

    @settings(
        max_examples=_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.lists(_mutation(), min_size=1, max_size=3))
    def run(mutations: list[tuple[Any, ...]]) -> None:
        load_forged(work, original, ckpt_state_dict, mutations)

    run()
