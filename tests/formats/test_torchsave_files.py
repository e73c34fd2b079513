"""Plain ``torch.save`` files through asyncload's pipeline: the zip directory and the
(allow-listed) pickle first, then each storage's bytes by range into the destination.
Nested dicts, shared storages, views, legacy files, hostile pickles. Bit for bit."""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import SAVEABLE_DTYPES, assert_bitwise_equal, random_tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import asyncload
from asyncload import (
    CheckpointFormatError,
    LoadOptions,
    StateDictMismatchError,
    UnsafeCheckpointError,
)

TINY = LoadOptions(chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10, concurrency=1)
MANY = LoadOptions(chunk_size=8192, min_chunk_size=1024, memory_budget=256 << 10, concurrency=16)


def flat_state(seed: int = 0) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {
        "embed.weight": random_tensor((64, 48), torch.bfloat16, seed),
        "layers.0.mlp.w": random_tensor((48, 96), torch.float32, seed + 1),
        "layers.0.norm": random_tensor((48,), torch.float16, seed + 2),
        "scalar": random_tensor((), torch.float64, seed + 3),
        "empty": torch.empty(0, 5),
        "transposed": random_tensor(
            (24, 40), torch.float32, seed + 4
        ).t(),  # saved with its strides
    }
    for i, dt in enumerate(SAVEABLE_DTYPES):
        sd[f"dtypes.{str(dt).removeprefix('torch.')}"] = random_tensor(
            (4, 3 + i), dt, seed + 10 + i
        )
    return sd


def zeros_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: zeros_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeros_tree(v) for v in obj]
    return obj


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def saved(obj: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [None, TINY, MANY], ids=["default", "tiny-c1", "small-c16"])
@pytest.mark.parametrize("suffix", [".pt", ".bin", ".weights"])
def test_flat_state_dict_bit_exact(
    tmp_path: Path, options: LoadOptions | None, suffix: str
) -> None:
    sd = flat_state()
    path = tmp_path / f"model{suffix}"
    torch.save(sd, path)
    dest = zeros_tree(sd)
    stats = asyncload.load(dest, path, options=options)
    assert_bitwise_equal(dest, sd)
    assert stats.bytes_assembled == nbytes(sd)
    assert stats.unexpected_keys == []


@pytest.mark.timeout(60)
def test_layout_reads_headers_not_data(tmp_path: Path) -> None:
    """The directory, the pickle and each storage's local header, then each storage's bytes once:
    the whole file is never read twice over."""
    sd = {f"layer{i}.w": random_tensor((256, 256), torch.float32, i) for i in range(8)}
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    dest = zeros_tree(sd)
    stats = asyncload.load(dest, path)
    assert_bitwise_equal(dest, sd)
    assert stats.bytes_read <= os.path.getsize(path) + 3 * 4096


@pytest.mark.timeout(60)
def test_file_url_and_memory_fs(tmp_path: Path) -> None:
    sd = flat_state(1)
    path = tmp_path / "model.pt"
    torch.save(sd, path)
    dest = zeros_tree(sd)
    asyncload.load(dest, path.as_uri())
    assert_bitwise_equal(dest, sd)
    fs = fsspec.filesystem("memory")
    fs.pipe("/tsv/run/model.pt", path.read_bytes())
    fs.pipe("/tsv/run/ckpt_noext", path.read_bytes())
    try:
        for url in ("memory://tsv/run/model.pt", "memory://tsv/run/ckpt_noext"):
            dest = zeros_tree(sd)
            stats = asyncload.load(dest, url, options=MANY)
            assert_bitwise_equal(dest, sd, url)
            assert stats.bytes_assembled == nbytes(sd)
    finally:
        fs.rm("/tsv", recursive=True)


@pytest.mark.timeout(120)
def test_s3_reads_by_range_without_downloading_it_whole(
    tmp_path: Path, s3_server: Any, bucket_name: str
) -> None:
    sd = {f"layer{i}.w": random_tensor((128, 64), torch.float32, i) for i in range(12)}
    raw = saved(sd)
    url = s3_server.put_object(bucket_name, "run/model.pt", raw)
    opts = s3_server.storage_options()
    dest = zeros_tree(sd)
    stats = asyncload.load(dest, url, storage_options=opts, options=MANY)
    assert_bitwise_equal(dest, sd)
    # one tensor of twelve: a fraction of the file
    dest = {"layer7.w": torch.zeros(128, 64)}
    stats = asyncload.load(dest, url, storage_options=opts, options=MANY)
    assert_bitwise_equal(dest["layer7.w"], sd["layer7.w"])
    assert stats.bytes_read < len(raw) // 3
    assert len(stats.unexpected_keys) == 11


@pytest.mark.timeout(60)
def test_nested_checkpoint_keys(tmp_path: Path) -> None:
    """``{"model": ..., "optimizer": ..., "epoch": ...}``: DCP-style dotted keys, or the model's own
    keys straight from under ``model``."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 7, "tag": "run-3"}
    path = tmp_path / "ckpt.pt"
    torch.save(ck, path)

    # 1) the whole tree, DCP-style
    dest = {
        "model": zeros_tree(ck["model"]),
        "optimizer": zeros_tree(ck["optimizer"]),
        "epoch": 0,
        "tag": "",
    }
    stats = asyncload.load(dest, path)
    assert_bitwise_equal(dest, ck)
    assert stats.unexpected_keys == []

    # 2) a model's state dict: found under "model."
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    stats = asyncload.load(fresh.state_dict(), path)
    assert_bitwise_equal(fresh.state_dict(), ck["model"])
    assert stats.unexpected_keys == []

    # 3) dotted keys in a flat destination
    dest = {"model.0.weight": torch.zeros(16, 8), "epoch": 0}
    stats = asyncload.load(dest, path)
    assert torch.equal(dest["model.0.weight"], ck["model"]["0.weight"]) and dest["epoch"] == 7
    assert (
        "model.2.bias" in stats.unexpected_keys
        and "optimizer.state.0.exp_avg" in stats.unexpected_keys
    )

    # 4) a key that is nowhere: the planner's usual error, naming it
    with pytest.raises(StateDictMismatchError, match="(?i)missing.*nowhere.weight"):
        asyncload.load({"nowhere.weight": torch.zeros(2)}, path)


@pytest.mark.timeout(60)
def test_ddp_module_prefix(tmp_path: Path) -> None:
    sd = {
        "module.fc.weight": random_tensor((6, 4), torch.float32, 1),
        "module.fc.bias": random_tensor((6,), torch.float32, 2),
    }
    torch.save(sd, tmp_path / "ddp.pt")
    dest = {"fc.weight": torch.zeros(6, 4), "fc.bias": torch.zeros(6)}
    asyncload.load(dest, tmp_path / "ddp.pt")
    assert_bitwise_equal(
        dest, {"fc.weight": sd["module.fc.weight"], "fc.bias": sd["module.fc.bias"]}
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [None, TINY], ids=["default", "tiny"])
def test_shared_storages_tied_weights_and_views(
    tmp_path: Path, options: LoadOptions | None
) -> None:
    base = random_tensor((40, 32), torch.float32, 5)
    emb = random_tensor((50, 16), torch.bfloat16, 6)
    sd = {
        "emb": emb,
        "head": emb,  # tied: one storage, two keys
        "full": base,
        "rows": base[3:9],  # a view at an offset
        "col": base[:, 5],  # a strided view (stride 32)
        "block": base[10:20, 4:12],  # a 2-D window
        "t": base.t(),  # transposed view of the same storage
    }
    path = tmp_path / "tied.pt"
    torch.save(sd, path)
    with zipfile.ZipFile(path) as z:
        assert sum(1 for n in z.namelist() if "/data/" in n) == 2  # really two storages
    dest = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    stats = asyncload.load(dest, path, options=options)
    assert_bitwise_equal(dest, {k: v.contiguous() for k, v in sd.items()})
    assert dest["emb"].data_ptr() != dest["head"].data_ptr()
    # the layout (the tail probe, then here the small file once), then each storage once for all
    # the keys viewing it (one read per key would be 20 KiB of data alone)
    assert stats.bytes_read <= 4096 + os.path.getsize(path) + 40 * 32 * 4 + 50 * 16 * 2


@pytest.mark.timeout(60)
def test_many_storages_layout_in_a_few_requests(tmp_path: Path) -> None:
    sd = {f"t{i}": random_tensor((i % 7 + 1, 3), torch.float32, i) for i in range(300)}
    path = tmp_path / "many.pt"
    torch.save(sd, path)
    fs = fsspec.filesystem("memory")
    fs.pipe("/many/m.pt", path.read_bytes())
    try:
        dest = zeros_tree(sd)
        stats = asyncload.load(
            dest, "memory://many/m.pt", options=LoadOptions(min_chunk_size=1 << 20)
        )
        assert_bitwise_equal(dest, sd)
        assert stats.chunks <= 4  # the data: all 300 small storages coalesced
    finally:
        fs.rm("/many", recursive=True)


@pytest.mark.timeout(60)
def test_objects_and_tuples_with_tensors(tmp_path: Path) -> None:
    t = random_tensor((3, 3), torch.float32, 9)
    ck = {
        "w": random_tensor((4,), torch.float32, 8),
        "pair": (t, 5),
        "cfg": {"lr": 0.1, "betas": [0.9, 0.99]},
        "names": ["a", "b"],
    }
    path = tmp_path / "obj.pt"
    torch.save(ck, path)
    dest: dict[str, Any] = {
        "w": torch.zeros(4),
        "pair": None,
        "cfg": {"lr": 0.0, "betas": [0.0, 0.0]},
        "names": [],
    }
    asyncload.load(dest, path)
    assert_bitwise_equal(dest["w"], ck["w"])
    assert isinstance(dest["pair"], tuple) and dest["pair"][1] == 5
    assert_bitwise_equal(dest["pair"][0], t)
    assert dest["cfg"] == {"lr": 0.1, "betas": [0.9, 0.99]} and dest["names"] == ["a", "b"]


@pytest.mark.timeout(60)
def test_dcp_load_with_reader_and_default_planner(tmp_path: Path) -> None:
    sd: dict[str, Any] = {**flat_state(2), "step": 3}
    path = tmp_path / "model.pt"
    torch.save(sd, path)
    for planner in (asyncload.PipelinedLoadPlanner(), DefaultLoadPlanner()):
        dest = {**zeros_tree(flat_state(2)), "step": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                dest, storage_reader=asyncload.PipelinedReader(path), planner=planner, no_dist=True
            )
        assert_bitwise_equal(dest, sd, type(planner).__name__)


@pytest.mark.timeout(60)
def test_verify_checks_the_zip_crc(tmp_path: Path) -> None:
    sd = {
        "a": random_tensor((64, 64), torch.float32, 1),
        "b": random_tensor((100,), torch.int64, 2),
    }
    path = tmp_path / "v.pt"
    torch.save(sd, path)
    dest = zeros_tree(sd)
    stats = asyncload.load(dest, path, options=LoadOptions(verify=True))
    assert_bitwise_equal(dest, sd)
    assert stats.verified_records == 2
    raw = bytearray(path.read_bytes())
    target = sd["a"].reshape(-1).view(torch.uint8).numpy().tobytes()[1000:1016]
    pos = raw.find(target)
    assert pos > 0
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
        asyncload.load(zeros_tree(sd), path, options=LoadOptions(verify=True))


# --- what is refused -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_legacy_non_zip_file_is_a_clear_error(tmp_path: Path) -> None:
    sd = {"w": torch.ones(3)}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointFormatError, match="legacy") as info:
        asyncload.load({"w": torch.zeros(3)}, path)
    assert "_use_new_zipfile_serialization" in str(info.value)
    fs = fsspec.filesystem("memory")
    fs.pipe("/legacy/w.pt", path.read_bytes())
    try:
        with pytest.raises(CheckpointFormatError, match="legacy"):
            asyncload.load({"w": torch.zeros(3)}, "memory://legacy/w.pt")
    finally:
        fs.rm("/legacy", recursive=True)


class Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /dev/null",))


class Plain:
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", [Evil(), Plain()], ids=["reduce-os-system", "unknown-class"])
def test_hostile_pickle_runs_nothing(tmp_path: Path, payload: Any) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": payload}, path)
    dest = {"w": torch.zeros(2)}
    with pytest.raises(UnsafeCheckpointError, match="allow-list"):
        asyncload.load(dest, path)
    assert torch.equal(dest["w"], torch.zeros(2))


@pytest.mark.timeout(60)
def test_not_a_state_dict(tmp_path: Path) -> None:
    torch.save(torch.ones(4), tmp_path / "t.pt")
    with pytest.raises(CheckpointFormatError, match="not a dict"):
        asyncload.load({"w": torch.zeros(4)}, tmp_path / "t.pt")
    (tmp_path / "junk.bin").write_bytes(b"hello world, not a checkpoint" * 10)
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        asyncload.load({"w": torch.zeros(4)}, tmp_path / "junk.bin")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", [10, 5000])
def test_truncated_archive(tmp_path: Path, cut: int) -> None:
    sd = {"w": random_tensor((64, 64), torch.float32, 3)}
    raw = saved(sd)
    path = tmp_path / "cut.pt"
    path.write_bytes(raw[:-cut])
    with pytest.raises(CheckpointFormatError):
        asyncload.load(zeros_tree(sd), path)


@pytest.mark.timeout(60)
def test_wrong_shape_names_the_key(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3, 4)}, tmp_path / "m.pt")
    with pytest.raises(StateDictMismatchError, match="'w'.*\\[4, 3\\].*\\[3, 4\\]"):
        asyncload.load({"w": torch.zeros(4, 3)}, tmp_path / "m.pt")


@pytest.mark.timeout(60)
def test_hf_bin_shards_with_index(tmp_path: Path) -> None:
    """``pytorch_model.bin.index.json`` + zip-format torch.save shards (older HF checkpoints)."""
    import json

    sd = flat_state(4)
    keys = list(sd)
    root = tmp_path / "hf"
    root.mkdir()
    wm = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, root / name)
        wm.update(dict.fromkeys(part, name))
    (root / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm})
    )
    for target in (root, root / "pytorch_model.bin.index.json"):
        dest = zeros_tree(sd)
        asyncload.load(dest, target)
        assert_bitwise_equal(dest, sd)


# --- a record's data.pkl decoded once per distinct pickle -------------------------------------


def _archive(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _parse(raw: bytes) -> Any:
    from asyncload.formats.torchsave import ByteWindow, parse_archive

    win = ByteWindow()
    win.add(0, memoryview(raw))
    return parse_archive(win, 0, len(raw), "record 'k' of __0_0.distcp")


def test_records_with_the_same_pickle_share_its_decode_and_keep_their_own_checks() -> None:
    from asyncload.formats import archive as torchsave

    torchsave._TENSOR_PICKLES.clear()
    a, b = (
        _archive(torch.arange(12.0).reshape(3, 4)),
        _archive(torch.ones(3, 4)),
    )  # same data.pkl bytes
    la, lb = _parse(a), _parse(b)
    assert lb.obj is la.obj and len(torchsave._TENSOR_PICKLES) == 1  # decoded once
    assert la.storages["0"].crc32 != lb.storages["0"].crc32  # each archive's own directory
    # an archive with that pickle whose storage entry disagrees with it is still refused:
    # the shared decode skips the pickle, never the checks of the record's own entries
    with zipfile.ZipFile(io.BytesIO(b)) as z:
        prefix = z.namelist()[0].split("/")[0]
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
            for info in z.infolist():
                data = z.read(info)
                w.writestr(info, data[:-4] if info.filename == f"{prefix}/data/0" else data)
    with pytest.raises(
        CheckpointFormatError, match=r"storage data/0 holds 44 bytes, data.pkl says 48"
    ):
        _parse(out.getvalue())
    # only single-tensor records are kept (a dict of tensors is not), and hostile pickles never
    _parse(_archive({"w": torch.zeros(2)}))
    assert len(torchsave._TENSOR_PICKLES) == 1


def test_a_hostile_record_pickle_is_refused_every_time() -> None:
    from asyncload.formats import archive as torchsave

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("true",))

    raw = _archive(Evil())
    for _ in range(2):
        with pytest.raises(UnsafeCheckpointError):
            _parse(raw)
    assert all(type(v).__name__ == "TensorRef" for v in torchsave._TENSOR_PICKLES.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("saved", "paths", "key"),
    [
        ({"a": {"b": torch.zeros(2)}, "a.b": torch.ones(2)}, "['a']['b'] and ['a.b']", "a.b"),
        ({"s": {0: torch.zeros(2), "0": torch.ones(2)}}, "['s'][0] and ['s']['0']", "s.0"),
    ],
)
def test_keys_that_flatten_alike_are_refused_naming_the_file_and_both_paths(
    tmp_path: Path, saved: dict[str, Any], paths: str, key: str
) -> None:
    """torch.load reads such a file; asyncload's flattened names cannot tell the two entries
    apart: every face refuses it, naming the file and both key paths."""
    path = tmp_path / "clash.pt"
    torch.save(saved, path)
    torch.load(path, weights_only=True)  # the tool's own reader reads it
    want = f"{path}: two entries of its dict, {paths}, flatten to the same key {key!r}"
    for face in (
        lambda: asyncload.read_state_dict(path),
        lambda: list(asyncload.iter_tensors(path)),
        lambda: asyncload.load({"x": torch.zeros(2)}, path),
    ):
        with pytest.raises(CheckpointFormatError) as info:
            face()
        assert str(info.value).startswith(want), str(info.value)
