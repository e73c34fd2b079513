"""Checkpoints that ``dcp.save`` wrote through stream transforms (``FileSystemWriter(_extensions=
[...])``): torch's ``ZStandard`` and the ``Rot13Example`` of torch's own tests, read by
``dcp.load(storage_reader=PipelinedReader(...))`` and by ``asyncload.load``, locally and over
HTTP on loopback; unknown transforms, damaged and forged records end in typed errors that name
the key, the file and the descriptor, with the destination untouched and nothing left open.
"""

from __future__ import annotations

import asyncio
import io
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import (
    assert_bitwise_equal,
    asyncload_threads,
    live_threads,
    open_fds_under,
    random_tensor,
    zeros_like_tree,
)
from _corrupt import mutate_metadata, read_metadata
from _dist import all_ok, run_ranks
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

import asyncload
from asyncload import CheckpointFormatError, LoadOptions, PipelinedLoadPlanner, PipelinedReader
from asyncload.testing.faults import status

pytestmark = pytest.mark.skipif(
    not ZStandard.is_available(), reason="needs the zstandard package (test extra)"
)

KiB = 1 << 10


def model() -> dict[str, Any]:
    """Several dtypes, a compressible tensor, nested dicts and objects (about 200 KiB)."""
    return {
        "w": random_tensor((128, 256), torch.float32, 1),
        "emb": random_tensor((100, 70), torch.bfloat16, 2),
        "zeros": torch.zeros(4096),  # compresses to almost nothing
        "layers": {
            "0": {
                "q": random_tensor((64, 64), torch.int8, 3),
                "mask": random_tensor((333,), torch.bool, 4),
            }
        },
        "step": 4000,
        "meta": {"name": "run7", "lr": [0.1, 0.01]},
    }


def save(path: Path, sd: dict[str, Any], extensions: list[Any]) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=FileSystemWriter(path, _extensions=extensions), no_dist=True)
    return path


def dcp_load(dest: dict[str, Any], reader: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(dest, storage_reader=reader, no_dist=True, **kwargs)


def fresh(sd: dict[str, Any]) -> dict[str, Any]:
    return zeros_like_tree(sd, object_placeholder=None)


def root_error(exc: BaseException) -> BaseException:
    """dcp.load wraps a reader's error in its CheckpointException."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return exc
    first = next(iter(failures.values()))
    return first[0] if isinstance(first, tuple) else first


def untouched(t: torch.Tensor) -> bool:
    return not bool(t.view(torch.uint8).any())


def all_zero(sd: dict[str, Any]) -> bool:
    out = True
    for v in sd.values():
        if isinstance(v, dict):
            out = out and all_zero(v)
        elif isinstance(v, torch.Tensor):
            out = out and not bool(v.view(torch.uint8).any()) if v.numel() else out
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return model()


@pytest.fixture(scope="module")
def zstd_ckpt(tmp_path_factory: pytest.TempPathFactory, saved: dict[str, Any]) -> Path:
    return save(tmp_path_factory.mktemp("zstd") / "ckpt", saved, [ZStandard()])


@pytest.fixture(scope="module")
def rot13_ckpt(tmp_path_factory: pytest.TempPathFactory, saved: dict[str, Any]) -> Path:
    return save(tmp_path_factory.mktemp("rot13") / "ckpt", saved, [Rot13Example()])


def stored_bytes(path: Path) -> int:
    """Bytes of every record as stored (compressed), from the metadata."""
    return sum(info.length for info in read_metadata(path).storage_data.values())


def test_metadata_really_holds_transforms(zstd_ckpt: Path, rot13_ckpt: Path) -> None:
    for path, desc in ((zstd_ckpt, "stream.zstd/1"), (rot13_ckpt, "stream.rot13/1")):
        infos = list(read_metadata(path).storage_data.values())
        assert infos and all(list(i.transform_descriptors) == [desc] for i in infos)


@pytest.mark.parametrize("planner", ["torch", "asyncload"])
def test_zstd_under_plain_dcp_load(zstd_ckpt: Path, saved: dict[str, Any], planner: str) -> None:
    dest = fresh(saved)
    reader = PipelinedReader(zstd_ckpt)
    dcp_load(
        dest, reader, **({"planner": PipelinedLoadPlanner()} if planner == "asyncload" else {})
    )
    assert_bitwise_equal(dest, saved)
    # the same as torch's own reader
    theirs = fresh(saved)
    dcp_load(theirs, FileSystemReader(zstd_ckpt))
    assert_bitwise_equal(dest, theirs)
    assert reader.stats is not None and reader.stats.bytes_read == stored_bytes(zstd_ckpt)
    assert open_fds_under(zstd_ckpt) == []


def test_zstd_with_plain_asyncload_load(zstd_ckpt: Path, saved: dict[str, Any]) -> None:
    dest = fresh(saved)
    options = LoadOptions(verify=True)
    stats = asyncload.load(dest, zstd_ckpt, options=options)
    assert_bitwise_equal(dest, saved)
    assert stats.bytes_read == stored_bytes(zstd_ckpt)  # each record fetched whole, once
    tensors = 5
    assert stats.verified_records == tensors  # decoded archives are CRC-checked
    assert 0 < stats.peak_buffered_bytes <= options.memory_budget
    assert open_fds_under(zstd_ckpt) == []


@pytest.mark.asyncio
async def test_zstd_with_aload(zstd_ckpt: Path, saved: dict[str, Any]) -> None:
    dest = fresh(saved)
    await asyncload.aload(dest, zstd_ckpt)
    assert_bitwise_equal(dest, saved)


def test_rot13_with_its_registry(rot13_ckpt: Path, saved: dict[str, Any]) -> None:
    dest = fresh(saved)
    dcp_load(dest, PipelinedReader(rot13_ckpt, get_test_extension_registry()))
    assert_bitwise_equal(dest, saved)
    dest = fresh(saved)
    asyncload.load(dest, rot13_ckpt, extension_registry=get_test_extension_registry())
    assert_bitwise_equal(dest, saved)
    dest = fresh(saved)
    handle = asyncload.start_load(
        dest, rot13_ckpt, extension_registry=get_test_extension_registry()
    )
    handle.result(timeout=60)
    assert_bitwise_equal(dest, saved)


@pytest.mark.parametrize("entry", ["load", "dcp"])
def test_unknown_transform_is_a_typed_error_naming_key_file_descriptor(
    rot13_ckpt: Path, saved: dict[str, Any], entry: str
) -> None:
    dest = fresh(saved)
    with pytest.raises((CheckpointFormatError, CheckpointException)) as ei:
        if entry == "load":
            asyncload.load(dest, rot13_ckpt)  # torch's default registry knows only ZStandard
        else:
            dcp_load(dest, PipelinedReader(rot13_ckpt))
    err = root_error(ei.value)
    assert isinstance(err, CheckpointFormatError), repr(err)
    msg = str(err)
    assert (
        "stream.rot13/1" in msg
        and ".distcp" in msg
        and "key '" in msg
        and "_extension_registry" in msg
    )
    assert all_zero(dest)
    assert open_fds_under(rot13_ckpt) == []


def test_unknown_version_of_a_known_transform(tmp_path: Path, saved: dict[str, Any]) -> None:
    path = save(tmp_path / "ckpt", saved, [ZStandard()])

    def bump(md: Any) -> None:
        for info in md.storage_data.values():
            info.transform_descriptors = ["stream.zstd/2"]

    mutate_metadata(path, bump)
    dest = fresh(saved)
    with pytest.raises(CheckpointFormatError, match=r"stream\.zstd/2.*Unknown extension") as ei:
        asyncload.load(dest, path)
    assert "__0_0.distcp" in str(ei.value)
    assert all_zero(dest)


def _record(path: Path, fqn: str) -> tuple[Path, Any]:
    md = read_metadata(path)
    info = next(v for i, v in md.storage_data.items() if i.fqn == fqn)
    return path / info.relative_path, info


def test_damaged_compressed_record(tmp_path: Path, saved: dict[str, Any]) -> None:
    path = save(tmp_path / "ckpt", saved, [ZStandard()])
    f, info = _record(path, "w")
    raw = bytearray(f.read_bytes())
    raw[info.offset] ^= 0xFF  # the zstd frame's magic number
    f.write_bytes(bytes(raw))
    dest = fresh(saved)
    with pytest.raises(CheckpointFormatError) as ei:
        asyncload.load(dest, path)
    msg = str(ei.value)
    assert "'w'" in msg and "stream.zstd/1" in msg and "damaged" in msg and "__0_0.distcp" in msg
    assert untouched(dest["w"])  # other records may have landed already


def test_damaged_compressed_payload_never_gives_garbage(
    tmp_path: Path, saved: dict[str, Any]
) -> None:
    """Bytes flipped inside the compressed data: zstd may decode them to other bytes without a
    word (its frames carry no checksum by default); the archive's CRC-32 is always checked."""
    path = save(tmp_path / "ckpt", saved, [ZStandard()])
    f, info = _record(path, "w")
    raw = bytearray(f.read_bytes())
    for k in range(8):
        raw[info.offset + info.length // 2 + 97 * k] ^= 0x5A
    f.write_bytes(bytes(raw))
    dest = fresh(saved)
    with pytest.raises(CheckpointFormatError) as ei:
        asyncload.load(dest, path)
    assert "'w'" in str(ei.value)
    assert untouched(dest["w"])


def _forge_record(path: Path, fqn: str, payload: bytes) -> None:
    """Append ``payload`` (already transformed) to ``fqn``'s file and point its entry at it."""
    f, _ = _record(path, fqn)
    start = f.stat().st_size
    with open(f, "ab") as out:
        out.write(payload)

    def point(md: Any) -> None:
        for i, v in md.storage_data.items():
            if i.fqn == fqn:
                v.offset, v.length = start, len(payload)

    mutate_metadata(path, point)


def _zstd(data: bytes) -> bytes:
    """A zstd frame, as ZStandard().transform_to writes one."""
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def _archive(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_lying_size_is_a_typed_error(tmp_path: Path, saved: dict[str, Any]) -> None:
    """The record decodes to a tensor of the claimed shape and dtype on a larger storage."""
    path = save(tmp_path / "ckpt", saved, [ZStandard()])
    bigger = random_tensor((128 * 256 + 1024,), torch.float32, 9)
    _forge_record(path, "w", _zstd(_archive(bigger[: 128 * 256].view(128, 256))))
    dest = fresh(saved)
    with pytest.raises(
        CheckpointFormatError, match=r"storage of 135168 bytes, the metadata claims 131072"
    ) as ei:
        asyncload.load(dest, path)
    assert "'w'" in str(ei.value)
    assert untouched(dest["w"])


def test_wrong_shape_inside_is_a_typed_error(tmp_path: Path, saved: dict[str, Any]) -> None:
    path = save(tmp_path / "ckpt", saved, [ZStandard()])
    _forge_record(path, "w", _zstd(_archive(random_tensor((256, 128), torch.float32, 9))))
    dest = fresh(saved)
    with pytest.raises(
        CheckpointFormatError, match=r"shape \[256, 128\], the metadata says \[128, 256\]"
    ):
        asyncload.load(dest, path)
    assert untouched(dest["w"])


def test_decompression_bomb_stays_bounded(tmp_path: Path, saved: dict[str, Any]) -> None:
    """64 MiB of zeros compressed to a few KiB, in the slot of a 128 KiB tensor: decoding
    stops past what the metadata allows; Python allocations stay far below 64 MiB."""
    path = save(tmp_path / "ckpt", saved, [ZStandard()])
    bomb = _zstd(_archive(torch.zeros(16 << 20)))
    assert len(bomb) < 64 * KiB
    _forge_record(path, "w", bomb)
    dest = fresh(saved)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match=r"'w'.*decodes to more than \d+ bytes"):
            asyncload.load(dest, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert untouched(dest["w"])


def test_object_bomb_stays_within_the_budget(tmp_path: Path) -> None:
    sd = {"w": torch.ones(16), "obj": {"blob": "x"}}
    path = save(tmp_path / "ckpt", sd, [ZStandard()])
    buf = io.BytesIO()
    torch.save(b"\0" * (32 << 20), buf)
    _forge_record(path, "obj.blob", _zstd(buf.getvalue()))
    dest = {"w": torch.zeros(16), "obj": {"blob": None}}
    with pytest.raises(CheckpointFormatError, match=r"'obj.blob'.*decodes to more than \d+ bytes"):
        asyncload.load(dest, path, options=LoadOptions(memory_budget=4 << 20))


def test_large_object_takes_the_second_pass(tmp_path: Path) -> None:
    """An object decoding to more than the first pass allows (1 MiB) is read again, alone."""
    blob = bytes(range(256)) * (12 << 10)  # 3 MiB, compresses well
    sd = {"w": random_tensor((64,), torch.float32, 3), "obj": {"blob": blob}}
    path = save(tmp_path / "ckpt", sd, [ZStandard()])
    dest = {"w": torch.zeros(64), "obj": {"blob": None}}
    asyncload.load(dest, path)
    assert dest["obj"]["blob"] == blob
    assert_bitwise_equal(dest["w"], sd["w"])


def test_budget_bounds_the_decoding(tmp_path: Path) -> None:
    sd = {f"t{i}": random_tensor((64, 64), torch.float32, i) for i in range(8)}  # 16 KiB each
    path = save(tmp_path / "ckpt", sd, [ZStandard()])
    options = LoadOptions(memory_budget=256 * KiB)
    dest = zeros_like_tree(sd)
    stats = asyncload.load(dest, path, options=options)
    assert_bitwise_equal(dest, sd)
    assert stats.peak_buffered_bytes <= options.memory_budget
    # a record that cannot be decoded within the budget: a typed error that names the fix
    big = {"big": random_tensor((256, 256), torch.float32, 1)}  # 256 KiB decoded
    path = save(tmp_path / "big", big, [ZStandard()])
    dest = zeros_like_tree(big)
    with pytest.raises(CheckpointFormatError, match=r"'big'.*memory_budget=262144.*at least \d+"):
        asyncload.load(dest, path, options=options)
    assert all_zero(dest)


def test_widening_into_a_transformed_record(zstd_ckpt: Path, saved: dict[str, Any]) -> None:
    dest = fresh(saved)
    dest["w"] = torch.zeros(128, 256, dtype=torch.float64)
    dest["emb"] = torch.zeros(100, 70, dtype=torch.float32)
    asyncload.load(dest, zstd_ckpt)
    assert_bitwise_equal(dest["w"], saved["w"].to(torch.float64))
    assert_bitwise_equal(dest["emb"], saved["emb"].to(torch.float32))


def test_custom_registry_is_used_not_the_default(zstd_ckpt: Path, saved: dict[str, Any]) -> None:
    """A registry without ZStandard cannot read a ZStandard checkpoint: the argument is honoured."""
    registry = ExtensionRegistry()
    registry.extensions.clear()
    dest = fresh(saved)
    with pytest.raises(CheckpointFormatError, match=r"stream\.zstd/1"):
        asyncload.load(dest, zstd_ckpt, extension_registry=registry)


# --- over HTTP on loopback -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["zstd", "rot13"])
def test_over_http(
    request: pytest.FixtureRequest,
    http_server: Any,
    fault_proxy: Any,
    bucket_name: str,
    saved: dict[str, Any],
    which: str,
) -> None:
    path = request.getfixturevalue(f"{which}_ckpt")
    registry = get_test_extension_registry() if which == "rot13" else None
    http_server.upload_dir(path, bucket_name, "ckpt")
    proxy = fault_proxy(http_server)
    # the first ranged read of a data file fails with a 503: retried by the engine
    rule = proxy.add_rule(status(503), path=".distcp", range_only=True, data_only=True, times=1)
    url = http_server.url(bucket_name, "ckpt", endpoint_url=proxy.endpoint_url)
    opts = http_server.storage_options()
    dest = fresh(saved)
    stats = asyncload.load(
        dest,
        url,
        storage_options=opts,
        extension_registry=registry,
        options=LoadOptions(backoff=0.01),
    )
    assert_bitwise_equal(dest, saved)
    assert rule.fired == 1 and stats.retries == 1
    assert stats.bytes_read == stored_bytes(path)
    dest = fresh(saved)
    reader = PipelinedReader(url, registry, storage_options=opts)
    dcp_load(dest, reader)
    assert_bitwise_equal(dest, saved)


def test_read_state_dict_and_iter_tensors(zstd_ckpt: Path, saved: dict[str, Any]) -> None:
    """Destinations allocated from the metadata: a compressed record is shorter than its tensor,
    and that is not a lying claim."""
    assert_bitwise_equal(asyncload.read_state_dict(zstd_ckpt), saved)
    tensors = dict(asyncload.iter_tensors(zstd_ckpt))
    assert sorted(tensors) == ["emb", "layers.0.mask", "layers.0.q", "w", "zeros"]
    assert_bitwise_equal(tensors["w"], saved["w"])
    assert_bitwise_equal(tensors["layers.0.q"], saved["layers"]["0"]["q"])


def w_sharded_zstd(rank: int, world: int, path: str) -> bool:
    saved = model()
    dest = fresh(saved)
    asyncload.load(dest, path, planner=asyncload.ShardedLoadPlanner(sharing="always"))
    assert_bitwise_equal(dest, saved, where=f"rank {rank}")
    return True


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_with_sharded_planner(zstd_ckpt: Path) -> None:
    """Transformed records are read by each rank itself, beside the shared reads of the others."""
    assert all_ok(run_ranks(w_sharded_zstd, 2, str(zstd_ckpt), timeout=90)) == [True, True]


@pytest.fixture(scope="module")
def many_records(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    # 512 records: each takes a storage read and a decode, two loop iterations of its own, and
    # concurrency=2 runs two at once, so no load of it ends in fewer than 512 iterations, far
    # more than the test's spins however slow a thread makes each one.
    sd = {f"t{i}": random_tensor((32, 32), torch.float32, i) for i in range(512)}  # 4 KiB each
    return save(tmp_path_factory.mktemp("many") / "ckpt", sd, [ZStandard()]), sd


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spins", [0, 3, 10, 30, 100])
async def test_aload_cancelled_while_decoding(
    many_records: tuple[Path, dict[str, torch.Tensor]], spins: int
) -> None:
    path, sd = many_records
    before = set(live_threads("asyncload-io"))
    dest = zeros_like_tree(sd)
    options = LoadOptions(memory_budget=256 * KiB, concurrency=2)
    task = asyncio.create_task(asyncload.aload(dest, path, options=options))
    for _ in range(spins):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert asyncload_threads("asyncload-io", ignore=before) == []
    assert open_fds_under(path) == []
    # the same destination loads afterwards
    await asyncload.aload(dest, path, options=options)
    assert_bitwise_equal(dest, sd)
