"""Integrity: CRC-32 verification, every size checked, incomplete checkpoints, keys.

Checkpoints are written by torch's own ``dcp.save``; damage is done to the real files.
Where a tensor's bytes are is found with the standard library's ``zipfile``
(``_corrupt.records``), independently of asyncload's parser.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, zeros_like_tree
from _corrupt import (
    flip_byte,
    is_sentinel,
    mutate_metadata,
    read_metadata,
    record_of,
    records,
    sentinel_like,
    write_metadata,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import asyncload
from asyncload import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadOptions,
    StateDictMismatchError,
)

pytestmark = pytest.mark.timeout(60)

KiB = 1 << 10

#: Small chunks so that the 512 KiB tensor is read in 8 pieces, out of order, by 8 readers
#: (the record's CRC is combined from pieces); "small" stays a whole-record read.
PIECES = LoadOptions(
    chunk_size=64 * KiB, min_chunk_size=16 * KiB, concurrency=8, memory_budget=256 * KiB, retries=0
)


@pytest.fixture(scope="module")
def ckpt_state_dict() -> dict[str, Any]:
    """What this module's ``fresh_ckpt`` holds (the fixture of tests/conftest.py)."""
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(512, 256, generator=g),  # 512 KiB: header probes, then chunked reads
        "small": torch.arange(300, dtype=torch.int16),  # a whole-record read
        "half": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "nested": {"w": torch.randn(40, 7, generator=g, dtype=torch.float64), "step": 11},
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def _distcp(path: Path) -> Path:
    (f,) = sorted(path.glob("*.distcp"))
    return f


# --- verify=True --------------------------------------------------------------------


@pytest.mark.parametrize(
    "options", [LoadOptions(verify=True), PIECES.replace(verify=True)], ids=["default", "pieces"]
)
def test_verify_passes_on_intact_checkpoint(
    fresh_ckpt: tuple[Path, dict[str, Any]], options: LoadOptions
) -> None:
    path, sd = fresh_ckpt
    dest = zeros_like_tree(sd)
    stats = asyncload.load(dest, path, options=options)
    assert_bitwise_equal(dest, sd)
    # every tensor record read is checked: big, small, half, nested.w, scalar (an empty
    # tensor has no bytes: DCP plans no read for it)
    assert stats.verified_records == 5


@pytest.mark.parametrize("key", ["big", "small", "nested.w"])
@pytest.mark.parametrize("options", [LoadOptions(), PIECES], ids=["default", "pieces"])
def test_flipped_byte_is_caught_with_file_record_key_and_range(
    fresh_ckpt: tuple[Path, dict[str, Any]], key: str, options: LoadOptions
) -> None:
    path, sd = fresh_ckpt
    rec = record_of(path, key)
    assert rec.data_start is not None and rec.data_end is not None
    flip_byte(path / rec.file, rec.data_start + (rec.data_end - rec.data_start) // 3)
    dest = zeros_like_tree(sd)
    with pytest.raises(CheckpointFormatError) as err:
        asyncload.load(dest, path, options=options.replace(verify=True))
    msg = str(err.value)
    assert "checksum mismatch" in msg
    assert rec.file in msg
    assert f"key {key!r}" in msg
    assert f"[{rec.offset}, {rec.offset + rec.length})" in msg  # the record
    assert f"tensor bytes [{rec.data_start}, {rec.data_end})" in msg  # the byte range checked
    assert f"the record says {rec.crc32:#010x}" in msg


def test_verify_off_loads_the_damaged_byte_and_checks_sizes(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, sd = fresh_ckpt
    rec = record_of(path, "big")
    assert rec.data_start is not None
    pos = rec.data_start + 1000
    flip_byte(path / rec.file, pos, 0x80)
    dest = zeros_like_tree(sd)
    stats = asyncload.load(dest, path, options=PIECES)
    assert stats.verified_records == 0
    got = dest["big"].view(torch.uint8).reshape(-1)
    want = sd["big"].view(torch.uint8).reshape(-1)
    diff = (got != want).nonzero().reshape(-1).tolist()
    assert diff == [pos - rec.data_start]  # exactly the flipped byte, nothing else
    # sizes are still checked without verify: a truncated file is an error
    os.truncate(path / rec.file, os.path.getsize(path / rec.file) - 1)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        asyncload.load(zeros_like_tree(sd), path, options=PIECES)


class _SlicePlanner(asyncload.PipelinedLoadPlanner):
    """Loads rows [r0, r1) of the saved 2-D tensor ``key`` only: a narrow read, like a rank
    whose shard covers part of a saved chunk."""

    def __init__(self, key: str, r0: int, r1: int, dest: torch.Tensor, **kw: Any) -> None:
        super().__init__(**kw)
        self.key, self.r0, self.r1, self.dest = key, r0, r1, dest

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        smd = self.metadata.state_dict_metadata[self.key]
        assert isinstance(smd, TensorStorageMetadata)
        cols = smd.size[1]
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(self.key, torch.Size([self.r0, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex(self.key, torch.Size([0, 0]), 0),
            storage_offsets=torch.Size([self.r0, 0]),
            lengths=torch.Size([self.r1 - self.r0, cols]),
        )
        return LoadPlan([item])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _dcp_load(*args: Any, **kwargs: Any) -> None:
    """``dcp.load``, raising this rank's own error instead of DCP's CheckpointException."""
    try:
        dcp.load(*args, **kwargs)
    except CheckpointException as exc:  # a BaseException, holding each rank's error
        raise exc.failures[0][0] from None


def _narrow_load(path: Path, options: LoadOptions, dest: torch.Tensor) -> asyncload.LoadStats:
    reader = asyncload.PipelinedReader(path, options=options)
    planner = _SlicePlanner("big", 100, 140, dest, options=options)
    _dcp_load({"big": torch.empty(0)}, storage_reader=reader, planner=planner, no_dist=True)
    assert reader.stats is not None
    return reader.stats


def test_narrow_read_with_verify_reads_and_checks_the_whole_storage(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    """A partial read of a record checks the CRC of the whole storage: the bytes the
    destination does not need are read too (counted in bytes_read, not bytes_assembled)."""
    path, sd = fresh_ckpt
    rec = record_of(path, "big")
    assert rec.data_start is not None and rec.data_end is not None
    storage_bytes = rec.data_end - rec.data_start
    dest = torch.zeros(40, 256)
    stats = _narrow_load(path, PIECES.replace(verify=True), dest)
    assert torch.equal(dest, sd["big"][100:140])
    assert stats.verified_records == 1
    assert stats.bytes_assembled == 40 * 256 * 4
    assert stats.bytes_read >= storage_bytes
    # without verify only the slice (plus header probes) is read
    dest2 = torch.zeros(40, 256)
    stats2 = _narrow_load(path, PIECES, dest2)
    assert torch.equal(dest2, sd["big"][100:140])
    assert stats2.verified_records == 0
    assert stats2.bytes_read < storage_bytes // 2
    # damage outside the slice: caught with verify, unseen without
    flip_byte(path / rec.file, rec.data_start + 5)  # row 0
    with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
        _narrow_load(path, PIECES.replace(verify=True), torch.zeros(40, 256))
    dest3 = torch.zeros(40, 256)
    _narrow_load(path, PIECES, dest3)
    assert torch.equal(dest3, sd["big"][100:140])


# --- sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 4096, "half"])
def test_file_shorter_than_metadata_leaves_destination_untouched(
    fresh_ckpt: tuple[Path, dict[str, Any]], cut: Any
) -> None:
    path, sd = fresh_ckpt
    f = _distcp(path)
    size = os.path.getsize(f)
    new = size // 2 if cut == "half" else size - cut
    os.truncate(f, new)
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointFormatError) as err:
        asyncload.load(dest, path, options=PIECES)
    assert f"{f.name} is {new} bytes" in str(err.value) and "truncated" in str(err.value)
    assert is_sentinel(dest)


@pytest.mark.parametrize("delta", [-1, 1, -100])
def test_record_length_in_metadata_that_lies(
    fresh_ckpt: tuple[Path, dict[str, Any]], delta: int
) -> None:
    """A record's length in .metadata that does not match the record: the zip directory is
    not where it should be; never a shorter or zero-filled tensor."""
    path, sd = fresh_ckpt
    rec = record_of(path, "big")

    def change(md: Any) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == "big":
                info.length += delta

    mutate_metadata(path, change)
    dest = zeros_like_tree(sd)
    with pytest.raises(CheckpointFormatError) as err:
        asyncload.load(dest, path, options=PIECES)
    assert "'big'" in str(err.value) and rec.file in str(err.value)
    assert torch.count_nonzero(dest["big"]) == 0


@pytest.mark.parametrize("target", ["first", "small"])
def test_record_offset_into_another_record(
    fresh_ckpt: tuple[Path, dict[str, Any]], target: str
) -> None:
    """.metadata places "big" at another record's offset (with big's length): the zip
    directory is not at the end of the range (or the range runs past the end of the file)."""
    path, sd = fresh_ckpt
    big = record_of(path, "big")
    other = (
        min(records(path).values(), key=lambda r: r.offset)
        if target == "first"
        else record_of(path, "small")
    )
    assert other.offset != big.offset

    def change(md: Any) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == "big":
                info.offset = other.offset

    mutate_metadata(path, change)
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointFormatError, match="'big'"):
        asyncload.load(dest, path, options=PIECES)
    if other.offset + big.length > os.path.getsize(path / big.file):
        assert is_sentinel(dest)  # found by the size check, before any read


def test_record_and_metadata_disagree_on_dtype(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, sd = fresh_ckpt

    def change(md: Any) -> None:
        md.state_dict_metadata["big"].properties.dtype = torch.int32  # same itemsize as float32

    mutate_metadata(path, change)
    dest = zeros_like_tree(sd)
    dest["big"] = torch.zeros(512, 256, dtype=torch.int32)
    with pytest.raises(
        CheckpointFormatError, match=r"holds torch.float32, the metadata says torch.int32"
    ):
        asyncload.load(dest, path, options=PIECES)


def test_record_and_metadata_disagree_on_shape(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, sd = fresh_ckpt

    def change(md: Any) -> None:
        smd = md.state_dict_metadata["big"]
        smd.size = torch.Size([256, 512])
        smd.chunks[0].sizes = torch.Size([256, 512])

    mutate_metadata(path, change)
    dest = zeros_like_tree(sd)
    dest["big"] = torch.zeros(256, 512)
    with pytest.raises(
        CheckpointFormatError, match=r"shape \[512, 256\], the metadata says \[256, 512\]"
    ):
        asyncload.load(dest, path, options=PIECES)


def test_file_truncated_while_loading_is_a_format_error(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    """The file passes the size check, then shrinks under the load (a writer rewriting
    it): the short local read is a CheckpointFormatError at once, not a smaller tensor
    and not a round of retries."""
    path, sd = fresh_ckpt
    f = _distcp(path)
    rec = record_of(path, "big")
    state = {"cut": False}

    def progress(done: int, total: int) -> None:
        if not state["cut"]:
            state["cut"] = True
            os.truncate(f, rec.offset + rec.length // 2)

    opts = PIECES.replace(concurrency=1, retries=3, backoff=5.0)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        asyncload.load(zeros_like_tree(sd), path, options=opts, progress=progress)
    assert state["cut"]


# --- incomplete checkpoints ---------------------------------------------------------


def test_missing_metadata(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, sd = fresh_ckpt
    (path / ".metadata").unlink()
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointNotFoundError) as err:
        asyncload.load(dest, path)
    assert isinstance(err.value, FileNotFoundError)
    assert ".metadata does not exist" in str(err.value) and "did not finish" in str(err.value)
    assert is_sentinel(dest)


def test_metadata_names_a_file_that_does_not_exist(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, sd = fresh_ckpt

    def change(md: Any) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == "half":
                info.relative_path = "__7_0.distcp"

    mutate_metadata(path, change)
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointNotFoundError) as err:
        asyncload.load(dest, path)
    assert "__7_0.distcp" in str(
        err.value
    ) and "named by the checkpoint's metadata but does not exist" in str(err.value)
    assert is_sentinel(dest)


def test_data_file_deleted(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, sd = fresh_ckpt
    f = _distcp(path)
    f.unlink()
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointNotFoundError, match=re.escape(f.name)):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


@pytest.mark.parametrize("version", ["9.9.9", "2.0.0", 3])
def test_unknown_dcp_version(fresh_ckpt: tuple[Path, dict[str, Any]], version: Any) -> None:
    path, sd = fresh_ckpt
    mutate_metadata(path, lambda md: setattr(md, "version", version))
    dest = sentinel_like(sd)
    with pytest.raises(
        CheckpointFormatError, match=f"unknown DCP version {re.escape(repr(version))}"
    ):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


@pytest.mark.parametrize(
    "content", [b"", b"\x80\x04garbage", b"not a pickle at all", b"\x80\x04K\x05."]
)
def test_empty_or_garbage_metadata(
    fresh_ckpt: tuple[Path, dict[str, Any]], content: bytes
) -> None:
    path, sd = fresh_ckpt
    write_metadata(path, None, raw=content)
    dest = sentinel_like(sd)
    with pytest.raises(CheckpointFormatError, match=r"\.metadata"):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


def test_metadata_with_a_chunk_outside_its_tensor(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, sd = fresh_ckpt

    def change(md: Any) -> None:
        md.state_dict_metadata["big"].chunks[0].offsets = torch.Size([1, 0])

    mutate_metadata(path, change)
    dest = sentinel_like(sd)
    with pytest.raises(
        CheckpointFormatError, match=r"key 'big': chunk 0 .* lies outside the tensor"
    ):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


# --- keys ---------------------------------------------------------------------------


def test_destination_key_missing_from_checkpoint_is_an_error(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, sd = fresh_ckpt
    dest = sentinel_like({**sd, "not_saved": torch.zeros(3)})
    with pytest.raises(StateDictMismatchError, match="not_saved"):
        asyncload.load(dest, path)
    assert is_sentinel(dest)


def test_unexpected_keys_are_reported_and_optionally_an_error(
    fresh_ckpt: tuple[Path, dict[str, Any]],
) -> None:
    path, sd = fresh_ckpt
    dest = {"big": torch.zeros(512, 256), "nested": {"w": torch.zeros(40, 7, dtype=torch.float64)}}
    # 'nested.step' is below a dict the destination names: not dropped silently (issue 42)
    with pytest.raises(StateDictMismatchError, match="'nested.step'"):
        asyncload.load(sentinel_like(dest), path)
    with pytest.warns(UserWarning, match="'nested.step'"):
        stats = asyncload.load(dest, path, allow_partial_load=True)
    assert torch.equal(dest["big"], sd["big"]) and torch.equal(
        dest["nested"]["w"], sd["nested"]["w"]
    )
    assert stats.unexpected_keys == ["empty", "half", "nested.step", "scalar", "small"]

    dest2 = sentinel_like(dest)
    with (
        pytest.raises(StateDictMismatchError) as err,
        pytest.warns(UserWarning, match="'nested.step'"),
    ):
        asyncload.load(
            dest2,
            path,
            options=LoadOptions(strict_unexpected_keys=True),
            allow_partial_load=True,
        )
    msg = str(err.value)
    assert "5 keys the destination lacks" in msg and "'half'" in msg and "'nested.step'" in msg
    assert "strict_unexpected_keys" in msg
    assert is_sentinel(dest2)


def test_strict_unexpected_keys_through_dcp_load(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    path, sd = fresh_ckpt
    dest = {"big": torch.zeros(512, 256)}
    opts = LoadOptions(strict_unexpected_keys=True)
    with pytest.raises(StateDictMismatchError, match="strict_unexpected_keys"):
        _dcp_load(
            dest,
            storage_reader=asyncload.PipelinedReader(path),
            planner=asyncload.PipelinedLoadPlanner(options=opts),
            no_dist=True,
        )
    assert torch.count_nonzero(dest["big"]) == 0
    # all keys present: strict mode loads
    full = zeros_like_tree(sd)
    stats = asyncload.load(full, path, options=opts)
    assert stats.unexpected_keys == []
    assert_bitwise_equal(full, sd)


def test_records_helper_agrees_with_metadata(fresh_ckpt: tuple[Path, dict[str, Any]]) -> None:
    """The test helper itself: every tensor record located, sizes as saved."""
    path, _ = fresh_ckpt
    recs = records(path)
    md = read_metadata(path)
    assert set(recs) == set(md.state_dict_metadata)
    assert recs["big"].data_end - recs["big"].data_start == 512 * 256 * 4  # type: ignore[operator]
    assert recs["small"].data_end - recs["small"].data_start == 300 * 2  # type: ignore[operator]


# --- the CRC machinery --------------------------------------------------------------


def test_crc_pieces_in_any_order_overlapping_and_from_threads() -> None:
    """CrcTracker: pieces out of order, overlapping, duplicated, from 8 threads, give
    zlib.crc32 of the whole range; missing bytes are reported, not guessed."""
    import random
    import threading
    import zlib

    from asyncload.engine.crc import CrcTracker, crc32, crc32_combine, gaps

    rng = random.Random(7)
    data = bytes(rng.randrange(256) for _ in range(200_003))
    base = 1000  # absolute file offset of data[0]
    assert crc32(data) == zlib.crc32(data)
    for trial in range(20):
        start, end = base + rng.randrange(0, 500), base + len(data) - rng.randrange(0, 500)
        tr = CrcTracker(start, end, zlib.crc32(data[start - base : end - base]))
        cuts = sorted(rng.sample(range(base, base + len(data)), 40))
        pieces = [(a, b) for a, b in zip([base, *cuts], [*cuts, base + len(data)])]
        # overlaps: every piece widened a little at random, some twice
        pieces = [
            (
                max(base, a - rng.randrange(0, 3000)),
                min(base + len(data), b + rng.randrange(0, 3000)),
            )
            for a, b in pieces
        ] + pieces[:5]
        rng.shuffle(pieces)
        threads = [
            threading.Thread(target=lambda a=a, b=b, tr=tr: tr.add(a, data[a - base : b - base]))
            for a, b in pieces
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert tr.complete and tr.covered == end - start
        assert tr.value() == tr.expected, trial
    tr = CrcTracker(base, base + 100, 0)
    tr.add(base, data[:40])
    tr.add(base + 60, data[60:100])
    assert not tr.complete
    with pytest.raises(ValueError, match=r"\[1040, 1060\)"):
        tr.value()
    assert gaps([(10, 20), (15, 30), (50, 60)], 0, 70) == [(0, 10), (30, 50), (60, 70)]
    assert gaps([], 5, 9) == [(5, 9)] and gaps([(0, 100)], 5, 9) == []
    a, b = data[:777], data[777:5000]
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), 0, 0) == zlib.crc32(a)
