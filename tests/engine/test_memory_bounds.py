"""Memory a forged checkpoint can make a load take (issue 11, item 3): the peak RSS above
the destination stays within ``max_metadata_size`` (+ a few MiB) whatever the file claims.

Each case starts from a real ``dcp.save`` / ``torch.save`` output, makes a claim of
``CLAIM`` bytes backed by a sparse hole (so the claim is consistent with the file size and
the reads really happen), and measures this process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the load).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _corrupt import mutate_metadata
from torch.distributed.checkpoint.metadata import MetadataIndex

import asyncload
from asyncload import AsyncLoadError, CheckpointFormatError, LoadOptions

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]

MiB = 1 << 20
CLAIM = 160 * MiB
SLACK = 24 * MiB  # the few MiB the docs allow: thread stacks, a chunk in flight, allocator slack


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _peak_above(fn: Callable[[], Any]) -> tuple[int, BaseException | None]:
    """Peak RSS above the current RSS while ``fn`` runs, and what it raised."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    err: BaseException | None = None
    try:
        fn()
    except AsyncLoadError as exc:
        err = exc
    return _status("VmHWM:") - base, err


def _grow(path: Path, extra: int) -> int:
    """Append a sparse hole of ``extra`` bytes; the old size."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size + extra)
    return size


def _object_ckpt(tmp_path: Path) -> tuple[Path, str]:
    ckpt = tmp_path / "obj"
    dcp.save(
        {"w": torch.arange(64, dtype=torch.float32), "extra": "step seven"},
        checkpoint_id=ckpt,
        no_dist=True,
    )
    (data,) = [p for p in ckpt.iterdir() if p.suffix == ".distcp"]
    return ckpt, data.name


def _claim_object(ckpt: Path, name: str, length: int) -> None:
    """The object record ``extra`` claims ``length`` bytes: its real bytes, then a hole."""
    old = _grow(ckpt / name, length)

    def change(md: Any) -> None:
        idx = next(k for k in md.storage_data if isinstance(k, MetadataIndex) and k.fqn == "extra")
        info = md.storage_data[idx]
        assert info.offset + info.length <= old
        md.storage_data[idx] = dataclasses.replace(info, length=length)

    mutate_metadata(ckpt, change)


def test_an_object_claim_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    ckpt, name = _object_ckpt(tmp_path)
    _claim_object(ckpt, name, CLAIM)
    dest = {"w": torch.zeros(64), "extra": None}
    opts = LoadOptions(max_metadata_size=64 * MiB)
    peak, err = _peak_above(lambda: asyncload.load(dest, ckpt, options=opts))
    assert isinstance(err, CheckpointFormatError), err
    msg = str(err)
    assert "'extra'" in msg and name in msg and f"{CLAIM}" in msg and "max_metadata_size" in msg
    assert peak < SLACK, f"{peak / MiB:.1f} MiB"
    assert torch.equal(dest["w"], torch.zeros(64))  # refused before any destination was touched


def test_an_object_claim_under_the_limit_is_read_once_not_copied(tmp_path: Path) -> None:
    """Allowed by the limit: read whole once (one buffer of the claim), then refused by the decoder."""
    ckpt, name = _object_ckpt(tmp_path)
    _claim_object(ckpt, name, CLAIM)
    dest = {"w": torch.zeros(64), "extra": None}
    peak, err = _peak_above(lambda: asyncload.load(dest, ckpt))
    assert isinstance(err, CheckpointFormatError), err
    assert "'extra'" in str(err)
    assert peak < CLAIM + SLACK, f"{peak / MiB:.1f} MiB for a {CLAIM / MiB:.0f} MiB claim"


def _forge_directory_claim(path: Path, claim: int) -> None:
    """A torch.save file whose end-of-central-directory record claims a ``claim``-byte
    directory at offset 0: the file grows by a hole so the claim fits inside it."""
    data = path.read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    assert eocd > 0
    _grow(path, claim)
    (n,) = struct.unpack_from("<H", data, eocd + 10)
    record = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, claim, 0, 0)
    with open(path, "ab") as f:
        f.write(record)
    assert path.stat().st_size == len(data) + claim + len(record)


@pytest.mark.parametrize("limit", [None, 64 * MiB], ids=["under-limit", "over-limit"])
def test_a_huge_zip_directory_claim_costs_at_most_the_claim(
    tmp_path: Path, limit: int | None
) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, path)
    _forge_directory_claim(path, CLAIM)
    dest = {"w": torch.zeros(64)}
    opts = LoadOptions() if limit is None else LoadOptions(max_metadata_size=limit)
    peak, err = _peak_above(lambda: asyncload.load(dest, path, options=opts))
    assert isinstance(err, CheckpointFormatError), err
    assert os.fspath(path) in str(err) or path.name in str(err)
    bound = SLACK if limit is not None else CLAIM + SLACK
    assert peak < bound, f"{peak / MiB:.1f} MiB for a {CLAIM / MiB:.0f} MiB directory claim"
    assert torch.equal(dest["w"], torch.zeros(64))
