"""Hugging Face safetensors checkpoints through asyncload's pipeline: single files, shards
with an index, DCP checkpoints saved with torch's safetensors serialization, hostile
headers, partial and sliced (sharded-destination) loads. Everything bit for bit."""

from __future__ import annotations

import json
import math
import struct
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import SAVEABLE_DTYPES, assert_bitwise_equal, random_tensor, tensor_bytes
from _dist import all_ok, run_ranks
from _remote import BACKENDS
from _st_blob import GOOD, st_blob
from safetensors.torch import save as st_save
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import asyncload
from asyncload import CheckpointFormatError, LoadOptions
from asyncload.formats.safetensors import SAFETENSORS_DTYPES, parse_header

# every dtype both torch and the safetensors package can hold
ST_DTYPES = [
    d
    for d in SAVEABLE_DTYPES
    if d in SAFETENSORS_DTYPES.values() and d is not getattr(torch, "float8_e8m0fnu", None)
]

TINY = LoadOptions(chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10, concurrency=1)
MANY = LoadOptions(chunk_size=8192, min_chunk_size=1024, memory_budget=256 << 10, concurrency=16)


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformer-ish tensors of every dtype safetensors holds, plus 0-d and empty ones."""
    sd: dict[str, torch.Tensor] = {
        "embed.weight": random_tensor((64, 48), torch.bfloat16, seed),
        "layers.0.attn.qkv": random_tensor((48, 144), torch.float32, seed + 1),
        "layers.0.norm": random_tensor((48,), torch.float16, seed + 2),
        "scalar": random_tensor((), torch.float64, seed + 3),
        "empty": torch.empty(0, 7, dtype=torch.float32),
    }
    for i, dt in enumerate(ST_DTYPES):
        sd[f"dtypes.{str(dt).removeprefix('torch.')}"] = random_tensor(
            (5, 3 + i), dt, seed + 10 + i
        )
    return sd


def zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def write_sharded(root: Path, sd: dict[str, torch.Tensor], shards: int = 3) -> Path:
    """HF layout written with the safetensors package: model-0000i-of-0000n.safetensors + index."""
    root.mkdir(parents=True, exist_ok=True)
    keys = list(sd)
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in part}, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": nbytes(sd)}, "weight_map": weight_map})
    )
    return root


# --- round trips -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [None, TINY, MANY], ids=["default", "tiny-c1", "small-c16"])
@pytest.mark.parametrize("spelling", ["path", "pathlike", "file-url"])
def test_single_file_bit_exact(tmp_path: Path, options: LoadOptions | None, spelling: str) -> None:
    sd = model_state()
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    ckpt: Any = {"path": str(path), "pathlike": path, "file-url": path.as_uri()}[spelling]
    dest = zeros(sd)
    stats = asyncload.load(dest, ckpt, options=options)
    assert_bitwise_equal(dest, sd)
    assert stats.bytes_assembled == nbytes(sd)
    assert stats.unexpected_keys == []
    if options is not None:
        assert stats.peak_buffered_bytes <= options.memory_budget


@pytest.mark.timeout(60)
def test_any_safetensors_file_name_and_directory(tmp_path: Path) -> None:
    sd = model_state(1)
    save_file(sd, str(tmp_path / "weights.v2.safetensors"))
    dest = zeros(sd)
    asyncload.load(dest, tmp_path / "weights.v2.safetensors")
    assert_bitwise_equal(dest, sd)
    d = tmp_path / "hf"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"))
    dest = zeros(sd)
    asyncload.load(dest, d)  # a directory with model.safetensors
    assert_bitwise_equal(dest, sd)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["dir", "index"])
def test_sharded_index_bit_exact(tmp_path: Path, target: str) -> None:
    sd = model_state(2)
    root = write_sharded(tmp_path / "hf", sd)
    dest = zeros(sd)
    stats = asyncload.load(
        dest, root if target == "dir" else root / "model.safetensors.index.json", options=MANY
    )
    assert_bitwise_equal(dest, sd)
    assert stats.files == 3


@pytest.mark.timeout(60)
def test_memory_fs_single_and_sharded(tmp_path: Path) -> None:
    sd = model_state(3)
    fs = fsspec.filesystem("memory")
    fs.pipe("/st/single/model.safetensors", st_save(sd))
    root = write_sharded(tmp_path / "hf", sd, shards=2)
    for p in root.iterdir():
        fs.pipe(f"/st/sharded/{p.name}", p.read_bytes())
    try:
        for url in (
            "memory://st/single/model.safetensors",
            "memory://st/single",
            "memory://st/sharded",
            "memory://st/sharded/model.safetensors.index.json",
        ):
            dest = zeros(sd)
            stats = asyncload.load(dest, url, options=MANY)
            assert_bitwise_equal(dest, sd, url)
            assert stats.bytes_assembled == nbytes(sd)
    finally:
        fs.rm("/st", recursive=True)


@pytest.mark.timeout(120)
def test_s3_single_and_sharded(tmp_path: Path, s3_server: Any, bucket_name: str) -> None:
    sd = model_state(4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    single = s3_server.put_object(
        bucket_name, "single/model.safetensors", (tmp_path / "model.safetensors").read_bytes()
    )
    sharded = s3_server.upload_dir(write_sharded(tmp_path / "hf", sd), bucket_name, "sharded")
    opts = s3_server.storage_options()
    for url in (single, sharded, sharded + "/model.safetensors.index.json"):
        dest = zeros(sd)
        stats = asyncload.load(dest, url, storage_options=opts, options=MANY)
        assert_bitwise_equal(dest, sd, url)
        assert stats.bytes_assembled == nbytes(sd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("header_pad", [0, 100_000])
def test_remote_single_file_asks_no_head(
    request: pytest.FixtureRequest,
    backend: str,
    bucket_name: str,
    fault_proxy: Any,
    header_pad: int,
) -> None:
    """A URL naming one .safetensors file: its first 64 KiB and its size come in one ranged
    GET (wire), no HEAD before it; a header longer than that is read with one more GET."""
    sd = model_state(6)
    metadata = {"pad": "x" * header_pad} if header_pad else None
    blob = st_save(sd, metadata=metadata)
    server = request.getfixturevalue(f"{backend}_server")
    server.put_object(bucket_name, "one/model.safetensors", blob)
    proxy = fault_proxy(server)
    if backend == "http":
        url, opts = (
            server.url(bucket_name, "one/model.safetensors", endpoint_url=proxy.endpoint_url),
            {},
        )
    else:
        url, opts = (
            f"{server.protocol}://{bucket_name}/one/model.safetensors",
            server.storage_options(proxy.endpoint_url),
        )
    dest = zeros(sd)
    stats = asyncload.load(dest, url, storage_options=opts, options=LoadOptions(transport="wire"))
    assert_bitwise_equal(dest, sd, url)
    assert stats.bytes_assembled == nbytes(sd)
    log = [
        e for e in proxy.log if urllib.parse.unquote(e.path).endswith("one/model.safetensors")
    ]  # GCS quotes it
    assert [e.method for e in log] == ["GET"] * len(log)
    assert log[0].range == "bytes=0-65535"
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    header_gets = [
        e for e in log if e.range and int(e.range.split("=")[1].split("-")[0]) < header_end
    ]
    assert len(header_gets) == (1 if header_end <= 65536 else 2)


# --- partial and sliced loads -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_partial_load_reports_unexpected_keys_and_reads_only_those(tmp_path: Path) -> None:
    sd = {f"layer{i}.w": random_tensor((256, 64), torch.float32, i) for i in range(8)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    wanted = ["layer2.w", "layer5.w"]
    dest = {k: torch.zeros(256, 64) for k in wanted}
    stats = asyncload.load(
        dest, path, options=LoadOptions(min_chunk_size=4096, chunk_size=1 << 20)
    )
    for k in wanted:
        assert_bitwise_equal(dest[k], sd[k], k)
    assert stats.unexpected_keys == sorted(set(sd) - set(wanted))
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    # the header probe plus the two tensors, nothing else
    assert stats.bytes_read <= max(header, 64 << 10) + 2 * 256 * 64 * 4
    assert stats.bytes_assembled == 2 * 256 * 64 * 4
    with pytest.raises(asyncload.StateDictMismatchError, match="strict_unexpected_keys"):
        asyncload.load(
            {k: torch.zeros(256, 64) for k in wanted},
            path,
            options=LoadOptions(strict_unexpected_keys=True),
        )


class SlicePlanner(asyncload.PipelinedLoadPlanner):
    """What a rank of a sharded load does: its local chunk of each tensor (``boxes``: fqn ->
    (offsets, sizes)), read items made by torch's own helper for DTensor/ShardedTensor
    destinations, the destination being the rank's local tensor."""

    def __init__(self, boxes: dict[str, tuple[list[int], list[int]]], **kw: Any) -> None:
        super().__init__(**kw)
        self.boxes = boxes

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.planner import LoadPlan

        assert self.metadata is not None
        items = []
        for fqn, (offs, sizes) in self.boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], [chunk]
            )
        return LoadPlan(items)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        from torch.distributed.checkpoint._traverse import set_element  # noqa: F401

        t = self.state_dict[read_item.dest_index.fqn]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["single", "sharded", "dcp-safetensors"])
def test_slice_destination_reads_only_its_slice(tmp_path: Path, fmt: str) -> None:
    rows, cols = 512, 96
    sd = {
        "w": random_tensor((rows, cols), torch.bfloat16, 7),
        "v": random_tensor((rows, 40), torch.float32, 8),
    }
    if fmt == "single":
        save_file(sd, str(tmp_path / "model.safetensors"))
        ckpt = tmp_path / "model.safetensors"
    elif fmt == "sharded":
        ckpt = write_sharded(tmp_path / "hf", sd, shards=2)
    else:
        ckpt = tmp_path / "dcp"
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(
                ckpt, serialization_format=SerializationFormat.SAFETENSORS
            ),
            no_dist=True,
        )
    # rank 1 of 4 along dim 0 for w; a column block (strided in the file) for v
    boxes = {"w": ([128, 0], [128, cols]), "v": ([0, 10], [rows, 20])}
    dest = {"w": torch.zeros(128, cols, dtype=torch.bfloat16), "v": torch.zeros(rows, 20)}
    planner = SlicePlanner(boxes, options=LoadOptions(min_chunk_size=256, chunk_size=1 << 20))
    stats = asyncload.load(dest, ckpt, planner=planner)
    assert torch.equal(dest["w"].view(torch.int16), sd["w"][128:256].view(torch.int16))
    assert_bitwise_equal(dest["v"], sd["v"][:, 10:30])
    # w: only the slice's rows; v: the span of its column block; plus one header probe per file (and the index)
    files = 2 if fmt == "sharded" else 1
    assert (
        stats.bytes_read <= 128 * cols * 2 + ((rows - 1) * 40 + 20) * 4 + files * (64 << 10) + 1024
    )


def _rank_load(rank: int, world: int, ckpt: str, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """A 2-rank gloo load into DTensors sharded on dim 0 (w) and dim 1 (v)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dest = {
        "w": distribute_tensor(torch.zeros(shapes["w"], dtype=torch.bfloat16), mesh, [Shard(0)]),
        "v": distribute_tensor(torch.zeros(shapes["v"]), mesh, [Shard(1)]),
    }
    stats = asyncload.load(dest, ckpt, options=LoadOptions(min_chunk_size=256, chunk_size=1 << 20))
    # raw bytes, not tensors: tensors would travel as shared memory the exiting rank takes along
    return {
        "w": tensor_bytes(dest["w"].to_local()),
        "v": tensor_bytes(dest["v"].to_local()),
        "bytes_read": stats.bytes_read,
        "assembled": stats.bytes_assembled,
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_rank_dtensor_load(tmp_path: Path) -> None:
    sd = {
        "w": random_tensor((256, 64), torch.bfloat16, 11),
        "v": random_tensor((32, 128), torch.float32, 12),
    }
    save_file(sd, str(tmp_path / "model.safetensors"))
    values = all_ok(
        run_ranks(
            _rank_load,
            2,
            str(tmp_path / "model.safetensors"),
            {"w": [256, 64], "v": [32, 128]},
            timeout=90,
        )
    )
    for rank, got in enumerate(values):
        assert got["w"] == tensor_bytes(sd["w"][rank * 128 : (rank + 1) * 128])
        assert got["v"] == tensor_bytes(sd["v"][:, rank * 64 : (rank + 1) * 64])
        # half of w's rows, the span of v's column block, the header probe: never the other rank's rows of w
        assert got["bytes_read"] <= 128 * 64 * 2 + (31 * 128 + 64) * 4 + (64 << 10)


# --- torch's own writers ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dcp_filesystem_writer_safetensors_serialization(tmp_path: Path) -> None:
    """torch's own FileSystemReader cannot read these back (it torch.loads the slice); we can."""
    sd: dict[str, Any] = {**model_state(5), "step": 42, "names": ["a", "b"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(
                tmp_path / "ck", serialization_format=SerializationFormat.SAFETENSORS
            ),
            no_dist=True,
        )
    for options in (None, TINY):
        dest: dict[str, Any] = {**zeros(model_state(5)), "step": 0, "names": []}
        stats = asyncload.load(dest, tmp_path / "ck", options=options)
        assert_bitwise_equal(dest, sd)
        assert stats.bytes_assembled == nbytes(model_state(5))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mapping", [None, "split"])
def test_huggingface_storage_writer(tmp_path: Path, mapping: str | None) -> None:
    sd = model_state(6)
    fqn_map = {k: 1 + i % 2 for i, k in enumerate(sd)} if mapping else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            sd,
            storage_writer=HuggingFaceStorageWriter(
                str(tmp_path / "hf"), fqn_to_index_mapping=fqn_map
            ),
            no_dist=True,
        )
    dest = zeros(sd)
    stats = asyncload.load(dest, tmp_path / "hf", options=MANY)
    assert_bitwise_equal(dest, sd)
    assert stats.files == (2 if mapping else 1)
    # and with torch's own dcp.load and our reader
    dest = zeros(sd)
    dcp.load(
        dest,
        storage_reader=asyncload.PipelinedReader(tmp_path / "hf"),
        planner=asyncload.PipelinedLoadPlanner(),
        no_dist=True,
    )
    assert_bitwise_equal(dest, sd)


def _save_distributed_shard(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = random_tensor((64, 24), torch.float32, 21)
    sd = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": distribute_tensor(random_tensor((10,), torch.bfloat16, 22), mesh, [Shard(0)]),
    }
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_huggingface_save_distributed_shards_without_index(tmp_path: Path) -> None:
    """``save_distributed=True``: one file per rank with DCP_SHARDING_INFO chunk offsets, no index."""
    all_ok(run_ranks(_save_distributed_shard, 2, str(tmp_path / "hf"), timeout=90))
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert all(f.endswith(".safetensors") for f in files) and len(files) == 2, files
    dest = {"w": torch.zeros(64, 24), "b": torch.zeros(10, dtype=torch.bfloat16)}
    asyncload.load(dest, tmp_path / "hf")
    assert_bitwise_equal(dest["w"], random_tensor((64, 24), torch.float32, 21))
    assert torch.equal(
        dest["b"].view(torch.int16), random_tensor((10,), torch.bfloat16, 22).view(torch.int16)
    )


# --- hostile and damaged headers ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "blob, match",
    [
        (b"\x01\x02", "too small"),
        (st_blob(GOOD, bytes(16), length=1 << 40), "exceeds"),
        (st_blob(GOOD, bytes(16), length=10_000), "runs past the end"),
        (st_blob(None, bytes(16), raw_header=b"[1, 2]"), "not start with"),
        (
            st_blob(None, bytes(16), raw_header=b'{"w": {"dtype": "F32",' + b"\xff" * 4 + b"}"),
            "UTF-8 JSON",
        ),
        (
            st_blob(
                None,
                bytes(32),
                raw_header=b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, '
                b'"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}}',
            ),
            "duplicate key",
        ),
        (
            st_blob({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1)),
            "dtype 'F4'",
        ),
        (
            st_blob({"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, bytes(16)),
            "malformed shape",
        ),
        (
            st_blob(
                {"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, bytes(16)
            ),
            "malformed shape",
        ),
        (
            st_blob({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(8)),
            "outside",
        ),
        (
            st_blob({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 4]}}, bytes(16)),
            "outside",
        ),
        (
            st_blob({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(16)),
            "needs 16 bytes",
        ),
        (
            st_blob(
                {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": ["0", 16]}}, bytes(16)
            ),
            "malformed data_offsets",
        ),
        (
            st_blob(
                {
                    "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
                },
                bytes(16),
            ),
            "overlap",
        ),
        (st_blob({"__metadata__": {"k": 1}, **GOOD}, bytes(16)), "__metadata__"),
        (st_blob({"w": [1, 2]}, bytes(16)), "not an object"),
    ],
)
def test_hostile_headers_are_format_errors(tmp_path: Path, blob: bytes, match: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    dest = {"w": torch.zeros(2, 2)}
    with pytest.raises(CheckpointFormatError, match=match):
        asyncload.load(dest, path)
    assert torch.equal(dest["w"], torch.zeros(2, 2))  # nothing was written


@pytest.mark.timeout(60)
def test_header_limit_follows_max_metadata_size(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.zeros(1) for i in range(200)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    with pytest.raises(CheckpointFormatError, match="max_metadata_size"):
        asyncload.load(zeros(sd), path, options=LoadOptions(max_metadata_size=n - 1))
    dest = zeros(sd)
    asyncload.load(
        dest, path, options=LoadOptions(max_metadata_size=n)
    )  # exactly at the limit: fine


@pytest.mark.timeout(60)
def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    sd = model_state(9)
    raw = st_save(sd)
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointFormatError):
        asyncload.load(zeros(sd), path)


@pytest.mark.timeout(60)
def test_index_with_escaping_file_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../outside.safetensors"}})
    )
    with pytest.raises(CheckpointFormatError, match="not a plain path inside the checkpoint"):
        asyncload.load({"w": torch.zeros(2)}, tmp_path / "hf")


@pytest.mark.timeout(60)
def test_index_naming_a_missing_key(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "hf", {"a": torch.ones(3), "b": torch.ones(4)}, shards=2)
    idx = json.loads((root / "model.safetensors.index.json").read_text())
    idx["weight_map"]["c"] = idx["weight_map"]["a"]
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointFormatError, match="'c'"):
        asyncload.load({"a": torch.zeros(3)}, root)


def test_parse_header_locations_are_exact() -> None:
    sd = {"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros(2, 5, dtype=torch.int64)}
    raw = st_save(sd)
    n = struct.unpack("<Q", raw[:8])[0]
    h = parse_header(raw[8 : 8 + n], name="m.safetensors", base=0, blob_size=len(raw))
    for key, t in sd.items():
        loc = h.tensors[key]
        assert loc.dtype == t.dtype and loc.size == tuple(t.shape)
        assert loc.stride == tuple(t.stride())
        got = torch.frombuffer(
            bytearray(raw[loc.data_start : loc.data_start + loc.storage_nbytes]), dtype=torch.uint8
        )
        assert torch.equal(got, t.reshape(-1).view(torch.uint8))
    assert h.data_start == 8 + n and h.data_size == len(raw) - 8 - n
    assert math.prod(h.tensors["b"].size) * 8 == h.tensors["b"].storage_nbytes
