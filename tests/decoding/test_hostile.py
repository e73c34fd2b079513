"""Hostile input: a corpus of hostile pickles (``_hostile.corpus``) placed as ``.metadata``,
as the ``data.pkl`` of an object record and of a tensor record; damaged zip records;
paths that leave the checkpoint. Every case ends in UnsafeCheckpointError or
CheckpointFormatError, runs nothing (no marker file, no global state changed), leaves
the destination untouched where the error comes before the reads, and takes bounded
work (counted in units, not timed) and memory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt import make_checkpoint, zeros_like_tree
from _corrupt import (
    is_sentinel,
    mutate_metadata,
    read_metadata,
    record_of,
    sentinel_like,
    write_metadata,
)
from _fuzzing import work_bound
from _hostile import Hostile, corpus, record_pickle, replace_record_pickle

import asyncload
from asyncload import CheckpointFormatError, LoadOptions, UnsafeCheckpointError
from asyncload.decoding.allowlist import record_globals, safe_loads, storage_persistent_load
from asyncload.decoding.work import WorkBudget
from asyncload.formats import ByteWindow, decode_metadata, parse_archive

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).parents[1]  # the child scripts live beside conftest.py
ERRORS = {"unsafe": UnsafeCheckpointError, "format": CheckpointFormatError}


def _decode(data: bytes, placement: str, work: WorkBudget) -> Any:
    """What a load does with these bytes at ``placement``, with ``work`` counting."""
    if placement == "metadata":
        return decode_metadata(
            data, "ckpt/.metadata", max_size=LoadOptions().max_metadata_size, work=work
        )
    return safe_loads(
        data,
        what="data.pkl",
        allowed=record_globals(),
        persistent_load=storage_persistent_load,
        work=work,
    )


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g),
        "step": 1234,
        "cfg": {"lr": 0.5, "name": "run"},
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt", _state())


@pytest.fixture(scope="module")
def markers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("markers")


@pytest.fixture(scope="module")
def hostile_items(markers: Path) -> list[Hostile]:
    return corpus(markers)


def _copy(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def _nothing_ran(markers: Path) -> None:
    assert sorted(p.name for p in markers.iterdir()) == ["evil.npy", "evil.pt"], (
        "a hostile payload ran"
    )
    assert torch.is_grad_enabled()
    assert not hasattr(torch.float32, "x")
    assert record_globals()[("torch", "FloatStorage")].dtype == torch.float32


PLACEMENTS = ["metadata", "object record", "tensor record"]


def test_corpus_is_broad(hostile_items: list[Hostile]) -> None:
    kinds = {h.kind for h in hostile_items}
    assert {
        "code: os.system",
        "code: eval/exec",
        "code: subprocess",
        "code: __reduce__ tricks",
        "torch/numpy non-data globals",
        "misused allowed names",
        "memory: memo / declared lengths",
        "memory: huge structures",
        "depth: deep nesting",
        "hash: keys",
    } <= kinds
    assert len(hostile_items) >= 50


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_hostile_pickles_in_a_checkpoint(
    pristine: Path, tmp_path: Path, markers: Path, hostile_items: list[Hostile], placement: str
) -> None:
    sd = _state()
    seen: dict[str, str] = {}
    for i, h in enumerate(hostile_items):
        if h.heavy and placement != "metadata":
            continue  # megabytes of opcodes: end to end once; with the record policy in the memory test
        path = _copy(pristine, tmp_path / str(i))
        if placement == "metadata":
            write_metadata(path, None, raw=h.data)
        else:
            replace_record_pickle(path, "step" if placement == "object record" else "w", h.data)
        dest = sentinel_like(sd)
        with pytest.raises((UnsafeCheckpointError, CheckpointFormatError)) as err:
            asyncload.load(dest, path)
        want = ERRORS[h.expected(placement)]
        assert type(err.value) is want, (
            f"{h.name} as {placement}: {type(err.value).__name__}: {err.value}"
        )
        # bounded work, counted (not timed): the same decode with a WorkBudget that counts
        work = WorkBudget()
        with pytest.raises(want):
            _decode(h.data, placement, work)
        assert work.spent <= work_bound(len(h.data)), f"{h.name} as {placement}: {work}"
        if placement == "metadata":
            assert ".metadata" in str(err.value)
            assert is_sentinel(dest), h.name  # nothing is read before the metadata is accepted
        else:
            assert "data.pkl" in str(err.value), f"{h.name}: {err.value}"
        seen[h.name] = type(err.value).__name__
        _nothing_ran(markers)
    assert len(seen) >= 45


def test_hostile_pickles_through_dcp_load_and_planner_load_bytes(
    pristine: Path, tmp_path: Path, markers: Path, hostile_items: list[Hostile]
) -> None:
    """torch's own entry point with asyncload's reader and planner: the same errors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    for i, h in enumerate(hostile_items[:20]):
        path = _copy(pristine, tmp_path / str(i))
        replace_record_pickle(path, "step", h.data)
        with pytest.raises(CheckpointException) as err:
            dcp.load(
                zeros_like_tree(_state()),
                storage_reader=asyncload.PipelinedReader(path),
                planner=asyncload.PipelinedLoadPlanner(),
                no_dist=True,
            )
        assert isinstance(err.value.failures[0][0], ERRORS[h.expected("object record")]), h.name
    _nothing_ran(markers)


def test_resource_attacks_stay_bounded_in_memory(markers: Path, tmp_path: Path) -> None:
    """Peak RSS of a fresh process decoding each resource attack (``ru_maxrss`` after
    minus RSS before, in MiB): a generous bound of 200 MiB each. The stock C unpickler
    grows by 1 GiB on a 9-byte LONG_BINPUT 2^26 and segfaults on the 1M-deep tuple key."""
    script = f"""
import gc, json, sys
sys.path.insert(0, {str(TESTS)!r})
from _hostile import corpus
from asyncload.decoding.allowlist import safe_loads, record_globals, storage_persistent_load
from asyncload import AsyncLoadError

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

out = {{}}
for h in corpus({str(markers)!r}):
    if not h.kind.startswith(("memory", "depth", "hash")):
        continue
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = status("VmRSS:")
    try:
        safe_loads(h.data, what="x", allowed=record_globals(), persistent_load=storage_persistent_load)
        err = "none"
    except AsyncLoadError as exc:
        err = type(exc).__name__
    out[h.name] = [err, max(0, status("VmHWM:") - before) / 2**20, len(h.data), h.expected("record")]
print(json.dumps(out))
"""
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=110, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out) >= 12
    for name, (err, grew_mib, size, expect) in out.items():
        assert err == ERRORS[expect].__name__, (name, err)
        assert grew_mib < 200, f"{name}: {size} bytes of pickle grew RSS by {grew_mib:.0f} MiB"


# --- hostile .metadata that decodes fine but points elsewhere -----------------------


@pytest.mark.parametrize(
    "bad", ["../outside.distcp", "/etc/passwd", "sub/../../x", "a\\..\\b", "", "x\x00y", "C:/x"]
)
def test_metadata_paths_that_leave_the_checkpoint(
    pristine: Path, tmp_path: Path, bad: str
) -> None:
    path = _copy(pristine, tmp_path)
    (tmp_path / "outside.distcp").write_bytes((path / "__0_0.distcp").read_bytes())

    def change(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = bad

    mutate_metadata(path, change)
    dest = sentinel_like(_state())
    with pytest.raises(CheckpointFormatError, match="not a (relative|plain) path"):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


@pytest.mark.parametrize(
    "field,value",
    [("offset", -1), ("length", -5), ("offset", 1 << 70), ("offset", "12"), ("length", 2.5)],
)
def test_metadata_storage_entries_with_bad_numbers(
    pristine: Path, tmp_path: Path, field: str, value: Any
) -> None:
    path = _copy(pristine, tmp_path)

    def change(md: Any) -> None:
        for info in md.storage_data.values():
            setattr(info, field, value)

    mutate_metadata(path, change)
    dest = sentinel_like(_state())
    with pytest.raises(CheckpointFormatError, match="storage entry of"):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


def test_metadata_with_wrong_types_in_its_fields(pristine: Path, tmp_path: Path) -> None:
    cases: list[Callable[[Any], None]] = [
        lambda md: setattr(md, "state_dict_metadata", [1, 2]),
        lambda md: md.state_dict_metadata.__setitem__("w", {"not": "metadata"}),
        lambda md: setattr(md.state_dict_metadata["w"], "size", [64, "32"]),
        lambda md: setattr(md.state_dict_metadata["w"], "chunks", None),
        lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", torch.Size([64])),
        lambda md: setattr(md, "storage_data", None),
        lambda md: md.storage_data.__setitem__("x", next(iter(md.storage_data.values()))),
        lambda md: setattr(md, "storage_meta", 5),
        lambda md: md.state_dict_metadata.__setitem__(7, md.state_dict_metadata["w"]),
    ]
    for i, change in enumerate(cases):
        path = _copy(pristine, tmp_path / str(i))
        mutate_metadata(path, change)
        dest = sentinel_like(_state())
        with pytest.raises(CheckpointFormatError, match=r"\.metadata"):
            asyncload.load(dest, path)
        assert is_sentinel(dest), i


# --- damaged zip records ------------------------------------------------------------


def _record_bytes(pristine: Path, key: str) -> bytes:
    rec = record_of(pristine, key)
    with open(pristine / rec.file, "rb") as f:
        f.seek(rec.offset)
        return f.read(rec.length)


def _sigs(b: bytes, sig: bytes) -> list[int]:
    out, i = [], b.find(sig)
    while i >= 0:
        out.append(i)
        i = b.find(sig, i + 1)
    return out


def _zip_damage(rec: bytes) -> dict[str, bytes]:
    """Targeted damage to a torch.save record, same length (so it can be put back in place)."""
    eocd = _sigs(rec, b"PK\x05\x06")[-1]
    eocd64 = _sigs(rec, b"PK\x06\x06")[-1]
    cdh = _sigs(rec, b"PK\x01\x02")
    lfh = _sigs(rec, b"PK\x03\x04")

    def put(b: bytes, pos: int, fmt: str, *vals: int) -> bytes:
        ba = bytearray(b)
        struct.pack_into(fmt, ba, pos, *vals)
        return bytes(ba)

    def cd_name(p: int) -> bytes:
        return rec[p + 46 : p + 46 + int.from_bytes(rec[p + 28 : p + 30], "little")]

    # the CD entries of the storage (".../data/0", or data.pkl for an object record) and of data.pkl
    pkl_cd = next(p for p in cdh if cd_name(p).endswith(b"/data.pkl"))
    data_cd = next((p for p in cdh if b"/data/" in cd_name(p)), pkl_cd)
    data_lfh = int.from_bytes(rec[data_cd + 42 : data_cd + 46], "little")
    zip64_all = put(
        put(put(rec, eocd + 8, "<HH", 0xFFFF, 0xFFFF), eocd + 12, "<I", 0xFFFFFFFF),
        eocd + 16,
        "<I",
        0xFFFFFFFF,
    )
    return {
        "EOCD signature": put(rec, eocd, "<I", 0x06054B51),
        "EOCD directory offset past EOF": put(rec, eocd + 16, "<I", 0xFFFFFFF0),
        "EOCD directory size past EOF": put(rec, eocd + 12, "<I", 0x7FFFFFF0),
        "EOCD entry count 0xFFFF, no zip64 locator": put(
            put(rec, eocd + 8, "<HH", 0xFFFF, 0xFFFF), eocd - 20, "<I", 0
        ),
        "zip64 locator points past EOF": put(zip64_all, eocd - 20 + 8, "<Q", (1 << 63) - 1),
        "zip64 end record claims 2^64-1 entries": put(zip64_all, eocd64 + 32, "<Q", (1 << 64) - 1),
        "zip64 end record directory offset 2^63": put(zip64_all, eocd64 + 48, "<Q", 1 << 63),
        "zip64 end record signature": put(zip64_all, eocd64, "<I", 0),
        "CD entry signature": put(rec, cdh[0], "<I", 0x02014B51),
        "CD name length past the directory": put(rec, cdh[-1] + 28, "<H", 0xFFFF),
        "CD sizes 0xFFFFFFFF without zip64 extra": put(
            rec, data_cd + 20, "<II", 0xFFFFFFFF, 0xFFFFFFFF
        ),
        "CD local header offset past EOF": put(rec, data_cd + 42, "<I", 0xFFFFFF00),
        "CD stored sizes disagree": put(rec, data_cd + 24, "<I", 17),
        "CD storage size smaller than the tensor": put(rec, data_cd + 20, "<II", 3, 3),
        "CD data.pkl compressed": put(rec, pkl_cd + 10, "<H", 8),
        "CD data.pkl size past EOF": put(rec, pkl_cd + 20, "<II", 0x00FFFFFF, 0x00FFFFFF),
        "local header signature": put(rec, data_lfh, "<I", 0x04034B51),
        "local header name": put(rec, data_lfh + 30, "<B", ord("X")),
        "local header extra length 65535": put(rec, data_lfh + 28, "<H", 0xFFFF),
        "local header compressed": put(rec, data_lfh + 8, "<H", 8),
        "every byte of the directory zeroed": rec[: cdh[0]] + b"\x00" * (len(rec) - cdh[0]),
        "data.pkl zeroed": rec[: lfh[0] + 40] + b"\x00" * 100 + rec[lfh[0] + 140 :],
    }


def test_damaged_records_parse_to_format_errors(pristine: Path) -> None:
    """Every damage: CheckpointFormatError from the parser, never struct.error, zipfile's
    BadZipFile, IndexError, or a hang."""
    for key in ("w", "step"):
        rec = _record_bytes(pristine, key)
        for name, bad in _zip_damage(rec).items():
            assert len(bad) == len(rec), name
            win = ByteWindow()
            win.add(0, bad)
            work = WorkBudget()
            with pytest.raises(CheckpointFormatError):
                parse_archive(win, 0, len(bad), f"{key}: {name}", work=work)
            assert work.spent <= work_bound(len(bad)), f"{name}: {work}"
        # cut short: every length from nothing to all but one byte
        for n in range(0, len(rec), 97):
            win = ByteWindow()
            win.add(0, rec[:n])
            with pytest.raises(CheckpointFormatError):
                parse_archive(win, 0, n, f"{key}: first {n} bytes")


@pytest.mark.parametrize(
    "options",
    [LoadOptions(), LoadOptions(chunk_size=4096, min_chunk_size=1024, memory_budget=1 << 16)],
    ids=["whole-record", "probed"],
)
def test_damaged_records_in_a_checkpoint(
    pristine: Path, tmp_path: Path, options: LoadOptions
) -> None:
    """The same damage written into the .distcp in place: the load raises
    CheckpointFormatError naming the file and the key (or, for a damaged object record,
    the object), whichever read path finds it."""
    for key in ("w", "step"):
        rec_info = record_of(pristine, key)
        damage = _zip_damage(_record_bytes(pristine, key))
        for i, (name, bad) in enumerate(damage.items()):
            path = _copy(pristine, tmp_path / f"{key}{i}")
            with open(path / rec_info.file, "r+b") as f:
                f.seek(rec_info.offset)
                f.write(bad)
            with pytest.raises(CheckpointFormatError) as err:
                asyncload.load(zeros_like_tree(_state()), path, options=options)
            assert repr(key) in str(err.value), f"{name}: {err.value}"


def test_corpus_decodes_nothing_with_the_record_policy(
    hostile_items: list[Hostile], markers: Path
) -> None:
    """The corpus straight through safe_loads with the record allow-list (the widest)."""
    for h in hostile_items:
        if h.heavy:
            continue  # test_resource_attacks_stay_bounded_in_memory decodes these with this policy
        with pytest.raises((UnsafeCheckpointError, CheckpointFormatError)) as err:
            obj = safe_loads(
                h.data,
                what=h.name,
                allowed=record_globals(),
                persistent_load=storage_persistent_load,
            )
            if h.name.startswith("FRAME"):
                pytest.fail(f"decoded {obj!r}")
        assert type(err.value) is ERRORS[h.expected("record")], f"{h.name}: {err.value}"
    _nothing_ran(markers)


def test_a_real_record_pickle_still_decodes(pristine: Path) -> None:
    """The guards cost no legitimate pickle: torch.save's own data.pkl decodes."""
    pkl = record_pickle(_record_bytes(pristine, "w"))
    ref = safe_loads(
        pkl, what="w", allowed=record_globals(), persistent_load=storage_persistent_load
    )
    assert ref.size == (64, 32) and ref.dtype == torch.float32
    md = read_metadata(pristine)
    assert set(md.state_dict_metadata) == {"w", "b", "step", "cfg.lr", "cfg.name"}
    _ = os.environ


def test_a_work_budget_counts_a_decode_and_its_limit_refuses_it() -> None:
    """``safe_loads(work=...)``: the units are counted (a unit a byte, plus the VM's own: keys
    checked, objects built); a limit below them ends the decode with a CheckpointFormatError
    naming it, while the VM's own limit (proportional to the pickle) stays an
    UnsafeCheckpointError."""
    import pickle

    obj = {f"k{i}": (i, [i, str(i)]) for i in range(2000)}
    data = pickle.dumps(obj, protocol=4)
    counted = WorkBudget()
    assert safe_loads(data, what="dict.pkl", allowed=record_globals(), work=counted) == obj
    assert len(data) < counted.spent <= work_bound(len(data))
    for limit in (len(data) // 2, len(data) + 10):  # refused before the first opcode, then midway
        budget = WorkBudget(limit=limit)
        with pytest.raises(
            CheckpointFormatError,
            match=rf"^dict.pkl needs more than the {limit} units of decoding",
        ):
            safe_loads(data, what="dict.pkl", allowed=record_globals(), work=budget)
        assert budget.spent > limit
    # a budget with room to spare changes nothing: same value, same units
    roomy = WorkBudget(limit=counted.spent)
    assert safe_loads(data, what="dict.pkl", allowed=record_globals(), work=roomy) == obj
    assert roomy.spent == counted.spent
