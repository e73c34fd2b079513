"""What the metadata claims for a record saved through stream transforms (issue 25, item
3(c)): a compressed record may be much shorter than its tensor, so its claim cannot be
checked against the record's length as a plain record's is. Before anything is allocated,
``read_state_dict``, ``iter_tensors`` and the CLI check the claim against what the stored
bytes can decode to (zstd: at most 32768:1, bounded at 65536:1) and against
``memory_budget`` (the record is decoded whole): a :class:`CheckpointFormatError` (CLI exit
status 3), not an 8 GiB allocation or a raw ``RuntimeError``.

Every case starts from a real ``dcp.save(..., FileSystemWriter(_extensions=[ZStandard()]))``.
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, random_tensor
from _corrupt import mutate_metadata, read_metadata
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

import asyncload
from asyncload import CheckpointFormatError, LoadOptions
from asyncload.cli import EXIT_DAMAGED, main

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not ZStandard.is_available(), reason="needs the zstandard package (test extra)"
    ),
]

MiB = 1 << 20
HUGE = 1 << 31  # float32 elements: 8 GiB


def _save(path: Path, sd: dict[str, Any], extensions: list[Any]) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=FileSystemWriter(path, _extensions=extensions), no_dist=True)
    return path


def _state_dict() -> dict[str, Any]:
    return {"w": random_tensor((64, 32), torch.float32, 1), "z": torch.zeros(4096), "step": 3}


def _claim(path: Path, key: str, numel: int) -> int:
    """``key`` claims ``numel`` elements; the stored length of its record."""

    def change(md: Any) -> None:
        smd = md.state_dict_metadata[key]
        smd.size = torch.Size([numel])
        smd.chunks[0].sizes = torch.Size([numel])

    mutate_metadata(path, change)
    return next(
        info.length for idx, info in read_metadata(path).storage_data.items() if idx.fqn == key
    )


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


@pytest.fixture
def huge_claim(tmp_path: Path) -> tuple[Path, int]:
    path = _save(tmp_path / "ck", _state_dict(), [ZStandard()])
    return path, _claim(path, "z", HUGE)


def _ratio_message(stored: int) -> str:
    return (
        f"the metadata claims {HUGE * 4} tensor bytes for a record of {stored} bytes stored through "
        f"['stream.zstd/1'], which decode to at most {stored * 65536 + 65536}: the metadata does not match"
    )


def test_read_state_dict_refuses_an_impossible_claim_before_allocating(
    huge_claim: tuple[Path, int],
) -> None:
    path, stored = huge_claim
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    with pytest.raises(CheckpointFormatError) as info:
        asyncload.read_state_dict(path)
    assert _status("VmHWM:") - base < 32 * MiB  # not 8 GiB
    text = str(info.value)
    assert text.startswith(f"{path}, record 'z' at [")
    assert _ratio_message(stored) in text


def test_iter_tensors_refuses_before_yielding_anything(huge_claim: tuple[Path, int]) -> None:
    path, stored = huge_claim
    got = []
    with pytest.raises(CheckpointFormatError) as info:
        for name, _ in asyncload.iter_tensors(path):
            got.append(name)
    assert got == []
    assert _ratio_message(stored) in str(info.value)


@pytest.mark.parametrize("command", ["load", "verify"])
def test_cli_exits_with_damaged(
    huge_claim: tuple[Path, int], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, stored = huge_claim
    code = main([command, str(path)])
    out, err = capsys.readouterr()
    assert code == EXIT_DAMAGED
    assert _ratio_message(stored) in out + err


def test_a_claim_within_the_ratio_but_over_the_budget(tmp_path: Path) -> None:
    """A claim the bytes could decode to, but that does not fit ``memory_budget`` decoded whole."""
    path = _save(tmp_path / "ck", _state_dict(), [ZStandard()])
    stored = _claim(path, "z", 4 * MiB)  # 16 MiB of float32
    options = LoadOptions(memory_budget=8 * MiB)
    expected = (
        f"is stored with stream transforms and is decoded whole: its {stored} stored bytes and the {16 * MiB} "
        f"tensor bytes the metadata claims do not fit LoadOptions.memory_budget={8 * MiB}; "
        f"raise memory_budget to at least {stored + 16 * MiB + 65536}"
    )
    with pytest.raises(CheckpointFormatError) as info:
        asyncload.read_state_dict(path, options=options)
    assert expected in str(info.value)
    with pytest.raises(CheckpointFormatError) as info:
        list(asyncload.iter_tensors(path, options=options))
    assert expected in str(info.value)


def test_an_unknown_transform_is_bounded_by_the_budget(tmp_path: Path) -> None:
    """A transform asyncload has no ratio for (torch's Rot13 example): the budget bounds the claim."""
    path = _save(tmp_path / "ck", _state_dict(), [Rot13Example()])
    stored = _claim(path, "z", HUGE)
    with pytest.raises(CheckpointFormatError) as info:
        asyncload.read_state_dict(path)  # the claim is checked before the registry is asked
    assert (
        f"its {stored} stored bytes and the {HUGE * 4} tensor bytes the metadata claims do not fit"
        in str(info.value)
    )


def test_a_legitimate_record_near_zstd_s_ratio_loads(tmp_path: Path) -> None:
    """64 MiB of zeros in a torch.save archive compress about 24000:1 (zstd caps 32768:1): accepted, bit for bit."""
    sd = {"zeros": torch.zeros(16 * MiB), "w": random_tensor((8, 8), torch.float32, 2)}
    path = _save(tmp_path / "ck", sd, [ZStandard()])
    stored = next(
        i.length for x, i in read_metadata(path).storage_data.items() if x.fqn == "zeros"
    )
    assert 64 * MiB > 20000 * stored  # the ratio the bound must allow (archive headers included)
    got = asyncload.read_state_dict(path)
    assert_bitwise_equal(got, sd)


def test_forged_claims_end_typed_or_load_exactly(tmp_path: Path) -> None:
    """The fuzz surface of benchmarks/fuzz_long.py --forged-minutes, bounded: claims of 0 to
    2^40 elements for zstd records, read under a 64 MiB budget."""
    import random

    from _forging import forge_state_dict, random_claim, read_forged_claim
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sd = forge_state_dict()
    path = _save(tmp_path / "ck", forge_state_dict(), [ZStandard()])
    original = read_metadata(path)
    seen: set[str] = set()

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(st.integers(0, 1 << 32))
    def run(seed: int) -> None:
        rng = random.Random(seed)
        seen.add(
            read_forged_claim(
                path, original, sd, [random_claim(rng) for _ in range(rng.randint(1, 2))]
            )
        )

    run()
    assert "CheckpointFormatError" in seen
