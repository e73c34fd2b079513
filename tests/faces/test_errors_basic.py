"""Errors a user meets first: mismatched destinations, hostile pickles, missing and damaged
files. Each asserts the exception, its message, and the state afterwards (destination
untouched where promised, no code run, no file or thread left open)."""

from __future__ import annotations

import asyncio
import builtins
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import (
    THREADS_BEFORE,
    assert_bitwise_equal,
    asyncload_threads,
    make_checkpoint,
    open_fds_under,
    random_tensor,
    tensor_bytes,
    thread_baseline,  # noqa: F401 - autouse fixture
    zeros_like_tree,
)
from torch.distributed.checkpoint import FileSystemWriter

import asyncload

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict:
    """What this module's ``fresh_ckpt`` holds (the fixture of tests/conftest.py)."""
    return {
        "w": random_tensor((64, 100), torch.float32, seed=1),
        "b": random_tensor((100,), torch.float32, seed=2),
        "big": random_tensor((200, 300), torch.bfloat16, seed=3),
        "extra": {"step": 5},
    }


def _all_zero(dst: dict) -> bool:
    return all(
        torch.count_nonzero(v.view(torch.uint8) if v.dtype == torch.bool else v) == 0
        for v in dst.values()
        if isinstance(v, torch.Tensor)
    )


def _nothing_left(path) -> None:
    assert asyncload_threads("asyncload-io", ignore=THREADS_BEFORE) == []
    assert open_fds_under(path) == []


# --- destination vs checkpoint ---------------------------------------------------------------


def test_missing_key_names_the_key(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    dst["not_saved.weight"] = torch.zeros(3, 3)
    with pytest.raises(asyncload.StateDictMismatchError) as ei:
        asyncload.load(dst, path)
    assert "'not_saved.weight'" in str(ei.value)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, asyncload.AsyncLoadError)
    assert _all_zero(dst)
    _nothing_left(path)


def test_missing_nested_key_names_the_flattened_key(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    dst["extra"]["lr_sched"] = {"gamma": torch.zeros(1)}
    with pytest.raises(asyncload.StateDictMismatchError, match=r"extra\.lr_sched\.gamma"):
        asyncload.load(dst, path)


def test_partial_load_when_the_planner_allows_it(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    dst["not_saved"] = torch.zeros(3)
    asyncload.load(dst, path, planner=asyncload.PipelinedLoadPlanner(allow_partial_load=True))
    assert torch.count_nonzero(dst.pop("not_saved")) == 0
    assert_bitwise_equal(sd, dst)


@pytest.mark.parametrize("entry", ["load", "aload", "start_load", "dcp"])
def test_wrong_shape_names_key_and_both_shapes(fresh_ckpt, entry):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    dst["w"] = torch.zeros(64, 99)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((asyncload.StateDictMismatchError, CheckpointException)) as ei:
        if entry == "load":
            asyncload.load(dst, path)
        elif entry == "aload":
            asyncio.run(asyncload.aload(dst, path))
        elif entry == "start_load":
            asyncload.start_load(dst, path).result(30)
        else:
            dcp.load(
                dst,
                storage_reader=asyncload.PipelinedReader(path),
                planner=asyncload.PipelinedLoadPlanner(),
                no_dist=True,
            )
    msg = str(ei.value)
    if entry == "dcp":  # dcp.load wraps every error in its CheckpointException
        assert isinstance(ei.value.failures[0][0], asyncload.StateDictMismatchError)
    else:
        assert isinstance(ei.value, asyncload.StateDictMismatchError)
    assert "'w'" in msg and "[64, 99]" in msg and "[64, 100]" in msg
    assert _all_zero(dst)
    _nothing_left(path)


def test_wrong_dtype_names_both_dtypes(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    dst["big"] = torch.zeros(200, 300, dtype=torch.float16)
    with pytest.raises(asyncload.StateDictMismatchError) as ei:
        asyncload.load(dst, path)
    msg = str(ei.value)
    assert (
        "'big'" in msg
        and "torch.float16" in msg
        and "torch.bfloat16" in msg
        and "allow_dtype_cast" in msg
    )
    assert _all_zero(dst)


def test_tensor_where_checkpoint_has_object(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    dst["extra"] = {"step": torch.zeros(())}
    with pytest.raises(asyncload.StateDictMismatchError, match=r"extra\.step"):
        asyncload.load(dst, path)


def test_unexpected_keys_are_reported_and_strict_mode_raises(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = {"w": torch.zeros(64, 100)}
    stats = asyncload.load(dst, path)
    assert_bitwise_equal(dst["w"], sd["w"])
    assert stats.unexpected_keys == sorted(["b", "big", "extra.step"])
    dst = {"w": torch.zeros(64, 100)}
    with pytest.raises(asyncload.StateDictMismatchError, match="strict_unexpected_keys"):
        asyncload.load(dst, path, options=asyncload.LoadOptions(strict_unexpected_keys=True))
    assert _all_zero(dst)
    _nothing_left(path)


# --- hostile pickles -------------------------------------------------------------------------


class _RunsShell:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _RunsExec:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


class _ImportsModule:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import subprocess

        return (subprocess.call, (["touch", self.marker],))


HOSTILE = {"os.system": _RunsShell, "builtins.exec": _RunsExec, "subprocess.call": _ImportsModule}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_metadata_pickle_runs_nothing(fresh_ckpt, tmp_path, kind):
    path, sd = fresh_ckpt
    marker = tmp_path / "PWNED"
    (path / ".metadata").write_bytes(pickle.dumps(HOSTILE[kind](str(marker))))
    dst = zeros_like_tree(sd)
    for attempt in ("load", "aload", "reader"):
        with pytest.raises(asyncload.UnsafeCheckpointError) as ei:
            if attempt == "load":
                asyncload.load(dst, path)
            elif attempt == "aload":
                asyncio.run(asyncload.aload(dst, path))
            else:
                asyncload.PipelinedReader(path).read_metadata()
        assert ".metadata" in str(ei.value)
        assert not marker.exists()
    assert _all_zero(dst)
    _nothing_left(path)


def test_hostile_object_nested_inside_real_metadata(fresh_ckpt, tmp_path):
    path, sd = fresh_ckpt
    marker = tmp_path / "PWNED"
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written by dcp.save a moment ago
    md.planner_data = {"x": _RunsShell(str(marker))}
    (path / ".metadata").write_bytes(pickle.dumps(md))
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.UnsafeCheckpointError, match="system"):
        asyncload.load(dst, path)
    assert not marker.exists()
    assert _all_zero(dst)


def test_hostile_object_record_in_distcp_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    sd = {"w": random_tensor((10, 10), torch.float32, seed=4), "evil": _RunsShell(str(marker))}
    path = make_checkpoint(tmp_path / "ckpt", sd)  # torch.save pickles the object's os.system call
    assert not marker.exists()
    dst = {"w": torch.zeros(10, 10), "evil": None}
    with pytest.raises(asyncload.UnsafeCheckpointError) as ei:
        asyncload.load(dst, path)
    assert "evil" in str(ei.value)
    assert not marker.exists()
    _nothing_left(path)


# --- missing and damaged files ---------------------------------------------------------------


def test_missing_metadata_is_checkpoint_not_found(fresh_ckpt):
    path, sd = fresh_ckpt
    os.remove(path / ".metadata")
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointNotFoundError) as ei:
        asyncload.load(dst, path)
    assert isinstance(ei.value, FileNotFoundError)
    assert ".metadata" in str(ei.value) and str(path) in str(ei.value)
    with pytest.raises(asyncload.CheckpointNotFoundError):
        asyncio.run(asyncload.aload(dst, path))
    assert _all_zero(dst)
    _nothing_left(path)


def test_checkpoint_directory_does_not_exist(tmp_path):
    with pytest.raises(asyncload.CheckpointNotFoundError):
        asyncload.load({"w": torch.zeros(1)}, tmp_path / "nowhere")
    with pytest.raises(asyncload.CheckpointNotFoundError):
        asyncload.load({"w": torch.zeros(1)}, "memory://asyncload-test-nowhere")


@pytest.mark.parametrize(
    "content",
    [b"", b"not a pickle at all", pickle.dumps({"a": 1}), pickle.dumps([1, 2, 3])[:-3]],
    ids=["empty", "garbage", "dict", "cut"],
)
def test_bad_metadata_is_checkpoint_format_error(fresh_ckpt, content):
    path, sd = fresh_ckpt
    (path / ".metadata").write_bytes(content)
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointFormatError):
        asyncload.load(dst, path)
    assert _all_zero(dst)
    _nothing_left(path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
@pytest.mark.parametrize(
    "options",
    [
        asyncload.LoadOptions(),
        asyncload.LoadOptions(
            chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10, concurrency=1
        ),
    ],
    ids=["default", "tiny"],
)
def test_truncated_distcp_fails_before_touching_the_destination(fresh_ckpt, keep, options):
    path, sd = fresh_ckpt
    f = path / "__0_0.distcp"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(int(size * keep))
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointFormatError) as ei:
        asyncload.load(dst, path, options=options)
    assert "__0_0.distcp" in str(ei.value) and "truncated" in str(ei.value)
    assert _all_zero(dst)
    _nothing_left(path)


def test_one_truncated_file_of_many_fails_before_touching_the_destination(tmp_path):
    sd = {f"t{i}": random_tensor((50, 50), torch.float32, seed=i) for i in range(5)}
    path = tmp_path / "ckpt"
    make_checkpoint(path, sd, storage_writer=FileSystemWriter(path, single_file_per_rank=False))
    files = sorted(path.glob("*.distcp"))
    assert len(files) == 5
    victim = files[-1]
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 1)
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointFormatError, match=victim.name):
        asyncload.load(dst, path)
    assert _all_zero(dst)


def test_missing_distcp_file_is_not_found_before_touching_the_destination(tmp_path):
    sd = {f"t{i}": random_tensor((50, 50), torch.float32, seed=i) for i in range(3)}
    path = tmp_path / "ckpt"
    make_checkpoint(path, sd, storage_writer=FileSystemWriter(path, single_file_per_rank=False))
    victim = sorted(path.glob("*.distcp"))[1]
    os.remove(victim)
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointNotFoundError, match=victim.name):
        asyncload.load(dst, path)
    assert _all_zero(dst)
    _nothing_left(path)


def _find(data: bytes, needle: bytes) -> int:
    pos = data.find(needle)
    assert pos >= 0 and data.find(needle, pos + 1) < 0
    return pos


@pytest.mark.parametrize(
    "options",
    [
        asyncload.LoadOptions(verify=True),
        asyncload.LoadOptions(
            verify=True, chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10
        ),
    ],
    ids=["default", "tiny"],
)
def test_flipped_tensor_byte_is_caught_by_verify(fresh_ckpt, options):
    path, sd = fresh_ckpt
    f = path / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    pos = _find(bytes(data), tensor_bytes(sd["big"])[:256]) + 1000
    data[pos] ^= 0x01
    f.write_bytes(bytes(data))
    # without verify the flipped bit is loaded as it is
    dst = zeros_like_tree(sd)
    asyncload.load(dst, path, options=options.replace(verify=False))
    diff = (dst["big"].view(torch.int16) != sd["big"].view(torch.int16)).sum().item()
    assert diff == 1
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointFormatError, match="checksum mismatch") as ei:
        asyncload.load(dst, path, options=options)
    assert "big" in str(ei.value)
    _nothing_left(path)


def test_verify_counts_records_on_a_good_checkpoint(fresh_ckpt):
    path, sd = fresh_ckpt
    dst = zeros_like_tree(sd)
    stats = asyncload.load(dst, path, options=asyncload.LoadOptions(verify=True))
    assert_bitwise_equal(sd, dst)
    assert stats.verified_records == 3


def test_damaged_record_header_is_format_error(fresh_ckpt):
    path, sd = fresh_ckpt
    f = path / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    assert data[:4] == b"PK\x03\x04"  # the first record's zip local header
    data[:4] = b"XXXX"
    f.write_bytes(bytes(data))
    dst = zeros_like_tree(sd)
    with pytest.raises(asyncload.CheckpointFormatError):
        asyncload.load(dst, path)
