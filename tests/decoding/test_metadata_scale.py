"""A large DCP ``.metadata`` (100k chunks, pickled as torch's ``FileSystemWriter`` does it)
decodes through the allow-list machine to exactly what ``pickle.loads`` gives, field by
field; and the fast paths that make this quick (fused opcodes, the list memo, the collector
paused while decoding, ``check_metadata``'s checks in bulk) keep every check: sparse memo
indices, a class that is a nested tuple, grids with holes or overlaps. Timings are printed
(``pytest -s``), never asserted.
"""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import metadata as dm
from torch.distributed.checkpoint.filesystem import _StorageInfo

from asyncload import CheckpointFormatError, UnsafeCheckpointError
from asyncload.decoding.allowlist import check_metadata, safe_loads
from asyncload.formats import decode_metadata

pytestmark = pytest.mark.timeout(300)


def _rows(n: int, parts: int, i: int) -> tuple[int, int]:
    step = -(-n // parts)  # DTensor's Shard(0): ceil-sized, trailing parts empty
    a = min(i * step, n)
    return a, max(0, min(step, n - a))


def sharded_metadata(tensors: int, ranks: int) -> dm.Metadata:
    """``tensors`` tensors (2-D and 1-D, some with empty shards), each saved by ``ranks``
    ranks along dim 0, one storage entry per chunk in the rank's file; and one object."""
    sdm: dict[str, Any] = {}
    storage: dict[dm.MetadataIndex, _StorageInfo] = {}
    pos = [0] * ranks
    dtypes = (torch.bfloat16, torch.float32, torch.int64)
    for t in range(tensors):
        shape = (ranks * 4 + t % 5 - 2, 64) if t % 3 else (ranks + 3 * t - 7,)
        props = dm.TensorProperties(dtype=dtypes[t % 3], requires_grad=t % 7 == 0)
        chunks = []
        for r in range(ranks):
            a, n = _rows(shape[0], ranks, r)
            offsets, sizes = torch.Size((a, *[0] * (len(shape) - 1))), torch.Size((n, *shape[1:]))
            chunks.append(dm.ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            length = n * 64 * 4 + 1577
            storage[dm.MetadataIndex(f"layers.{t}.w", torch.Size(offsets), r)] = _StorageInfo(
                f"__{r}_0.distcp", pos[r], length
            )
            pos[r] += length
        sdm[f"layers.{t}.w"] = dm.TensorStorageMetadata(
            properties=props, size=torch.Size(shape), chunks=chunks
        )
    sdm["step"] = dm.BytesStorageMetadata()
    storage[dm.MetadataIndex("step")] = _StorageInfo("__0_0.distcp", pos[0], 420)
    return dm.Metadata(state_dict_metadata=sdm, storage_data=storage, version="1.0.0")


def _same(ours: Any, ref: Any, where: str) -> None:
    """Equal and of the same type, field by field (dataclasses), item by item (containers)."""
    assert type(ours) is type(ref), f"{where}: {type(ours).__name__} != {type(ref).__name__}"
    if isinstance(
        ref, (dm.ChunkStorageMetadata, dm.MetadataIndex, _StorageInfo, dm.TensorStorageMetadata)
    ):
        assert vars(ours).keys() == vars(ref).keys(), where
        for k, v in vars(ref).items():
            _same(vars(ours)[k], v, f"{where}.{k}")
    elif isinstance(ref, dm.TensorProperties):
        assert ours.__getstate__() == ref.__getstate__(), where
    elif isinstance(ref, list):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert ours == ref, where


def _compare(ours: dm.Metadata, ref: dm.Metadata) -> None:
    assert ours.version == ref.version and ours.planner_data == ref.planner_data
    assert (ours.storage_meta or dm.StorageMeta()) == (
        ref.storage_meta or dm.StorageMeta()
    )  # decode_metadata fills it
    assert list(ours.state_dict_metadata) == list(ref.state_dict_metadata)
    for key, smd in ref.state_dict_metadata.items():
        _same(ours.state_dict_metadata[key], smd, key)
    assert list(ours.storage_data) == list(ref.storage_data)  # same keys, same order
    for (ka, va), (kb, vb) in zip(ours.storage_data.items(), ref.storage_data.items()):
        _same(ka, kb, f"storage key {kb.fqn}")
        _same(va, vb, f"storage entry {kb.fqn}")


@pytest.fixture(scope="module")
def big() -> tuple[dm.Metadata, bytes]:
    md = sharded_metadata(100, 1000)
    return md, pickle.dumps(md)  # torch's FileSystemWriter: pickle.dump, default protocol


def test_100k_chunks_decode_as_pickle_loads(big: tuple[dm.Metadata, bytes]) -> None:
    md, raw = big
    assert (
        sum(len(v.chunks) for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
        == 100_000
    )
    t0 = time.perf_counter()
    ref = pickle.loads(raw)
    t1 = time.perf_counter()
    ours = decode_metadata(raw, "scale/.metadata", max_size=len(raw))
    t2 = time.perf_counter()
    _compare(ours, ref)
    _compare(
        safe_loads(raw, what="scale/.metadata", check_structure=False, expect=dm.Metadata), ref
    )
    print(
        f"\n{len(raw) / 2**20:.1f} MiB .metadata, 100k chunks: pickle.loads {t1 - t0:.2f} s, "
        f"decode_metadata {t2 - t1:.2f} s ({(t2 - t1) / (t1 - t0):.2f}x)"
    )


def test_the_collector_is_resumed_after_decoding() -> None:
    raw = pickle.dumps(sharded_metadata(12, 1000))  # past the size from which it is paused
    assert len(raw) > 1 << 20 and gc.isenabled()
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            safe_loads(raw, what="scale/.metadata", check_structure=False, expect=dm.Metadata)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=decode) for _ in range(2)]  # overlapping pauses
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and gc.isenabled()
    with pytest.raises(CheckpointFormatError):  # a failed decode resumes it too
        safe_loads(raw[: len(raw) - 7], what="cut/.metadata", check_structure=False)
    assert gc.isenabled()
    gc.disable()  # and a collector the caller paused stays paused
    try:
        safe_loads(raw, what="scale/.metadata", check_structure=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "data",
    [
        # PUT out of order, then MEMOIZE (stored at len(memo)), GETs of both
        b"\x80\x04]q\x03\x94}\x94h\x01h\x03h\x02\x87.",
        # PUT past a gap, then the gap filled: the later index moves into the list
        b"\x80\x02]q\x02K\x01q\x00K\x05q\x01h\x00h\x01h\x02\x87.",
        # PUT overwriting an index, then MEMOIZE counting entries, not the largest index
        b"\x80\x04K\x07\x94K\x08\x94K\tq\x00\x94h\x00h\x01h\x02\x87.",
        # protocol 0 PUT/GET with a gap
        b"(I5\np7\nI6\np0\ng7\ng0\ntp1\n.",
    ],
)
def test_memo_out_of_order_as_pickle_loads(data: bytes) -> None:
    assert safe_loads(data, what="memo.pkl", check_structure=False) == pickle.loads(data)


@pytest.mark.parametrize(
    "data", [b"\x80\x04K\x01h\x05.", b"\x80\x02K\x01g-1\n.", b"\x80\x02K\x01q\x05h\x04."]
)
def test_memo_gets_of_missing_indices_are_format_errors(data: bytes) -> None:
    with pytest.raises(CheckpointFormatError):
        safe_loads(data, what="memo.pkl", check_structure=False)


@pytest.mark.parametrize(
    "data", [b"\x8b\xfb\xff\xff\xff.", b"T\xfb\xff\xff\xff.", b"\x8b\xfc\xff\xff\xff."]
)
@pytest.mark.timeout(20)
def test_negative_lengths_are_format_errors_not_a_loop(data: bytes) -> None:
    # LONG4 / BINSTRING with a negative length moved the decoder back onto the same opcode
    with pytest.raises(CheckpointFormatError, match="negative length"):
        safe_loads(data, what="neg.pkl")


def test_newobj_of_a_deeply_nested_tuple_is_refused_without_hashing_it() -> None:
    # ``cls in record_classes`` hashed the "class" first: a 1M-deep tuple crashed the
    # interpreter (C stack overflow in tuplehash). In a child: a crash must not end pytest.
    code = (
        "from asyncload import UnsafeCheckpointError\n"
        "from asyncload.decoding.allowlist import safe_loads\n"
        "p = b'\\x80\\x04)' + b'\\x85' * 1_000_000 + b')\\x81.'\n"
        "try:\n    safe_loads(p, what='deep.pkl')\n"
        "except UnsafeCheckpointError as e:\n    print('refused:', str(e)[:80])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: deep.pkl: asks to create a 'tuple' object" in out.stdout


def _md(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> dm.Metadata:
    chunks = [
        dm.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in boxes
    ]
    smd = dm.TensorStorageMetadata(
        properties=dm.TensorProperties(dtype=torch.float32), size=torch.Size(size), chunks=chunks
    )
    storage = {
        dm.MetadataIndex("w", torch.Size(o), i): _StorageInfo(f"__{i}_0.distcp", 0, 100)
        for i, (o, _) in enumerate(boxes)
    }
    return pickle.loads(
        pickle.dumps(dm.Metadata(state_dict_metadata={"w": smd}, storage_data=storage))
    )


def test_layouts_accepted_in_bulk_or_field_by_field() -> None:
    grid = [((r, c), (2, 4)) for r in (0, 2, 4) for c in (0, 4)]
    check_metadata(_md((6, 8), grid), "grid")  # FSDP x TP: a 3 x 2 grid
    check_metadata(_md((6, 8), [*grid, ((6, 0), (0, 8))]), "grid")  # plus an empty shard
    # not a grid, still disjoint and complete: the sweep accepts it
    check_metadata(
        _md((4, 8), [((0, 0), (2, 8)), ((2, 0), (2, 3)), ((2, 3), (2, 5))]), "irregular"
    )


@pytest.mark.parametrize(
    ("boxes", "message"),
    [
        (
            [((0, 0), (2, 4)), ((0, 4), (2, 4)), ((2, 0), (2, 4))],
            "the chunks hold 24 of the tensor's 32 elements",
        ),
        (
            [
                ((0, 0), (2, 4)),
                ((0, 4), (2, 4)),
                ((2, 0), (2, 4)),
                ((2, 4), (2, 4)),
                ((2, 4), (2, 4)),
            ],
            "overlap",
        ),
        ([((0, 0), (4, 4)), ((0, 4), (4, 4)), ((1, 2), (1, 1))], "overlap"),
        ([((0, 0), (4, 4)), ((0, 4), (4, 5))], "lies outside the tensor"),
        ([((0, 0), (4, 8)), ((0, -1), (0, 1))], "is not a shape"),
    ],
)
def test_bad_layouts_are_named_field_by_field(boxes: list[Any], message: str) -> None:
    with pytest.raises(CheckpointFormatError, match=message):
        check_metadata(_md((4, 8), boxes), "bad")


def test_bad_storage_entries_are_named_field_by_field() -> None:
    md = _md((4, 8), [((0, 0), (4, 8))])
    (index,) = md.storage_data
    md.storage_data[index].relative_path = "../../etc/passwd"
    with pytest.raises(CheckpointFormatError, match="storage entry of 'w'.*not a plain path"):
        check_metadata(md, "bad")
    md.storage_data[index].relative_path, md.storage_data[index].length = "__0_0.distcp", -1
    with pytest.raises(
        CheckpointFormatError, match="storage entry of 'w' has offset 0 and length -1"
    ):
        check_metadata(md, "bad")
    md.storage_data[index].length = 100
    md.storage_data[dm.MetadataIndex("w", (0, -3))] = md.storage_data.pop(index)
    with pytest.raises(CheckpointFormatError, match="storage_data key 'w' offset is not a shape"):
        check_metadata(md, "bad")


def test_unsafe_is_still_unsafe_at_scale(big: tuple[dm.Metadata, bytes]) -> None:
    _, raw = big
    cut = raw.index(b"TensorStorageMetadata") + len("TensorStorageMetadata")
    hostile = raw[:cut].replace(b"\x8c\x15TensorStorageMetadata", b"\x8c\x15TensorStorageMetadatb")
    with pytest.raises(UnsafeCheckpointError, match="TensorStorageMetadatb"):
        safe_loads(hostile + raw[cut:], what="scale/.metadata", check_structure=False)


# --- planner_data's flat shape, checked without the walk ------------------------------------


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("extra", [0, 1, 7, 100])
def test_flat_planner_data_is_accepted_exactly_when_the_walk_accepts_it(
    shared: bool, extra: int
) -> None:
    """DCP's planner_data ({fqn: (path, ...)}) takes a fast path; its verdict, budget by budget,
    is the walk's (shared tuples counted each time they are referenced, as the walk counts)."""
    from asyncload.decoding.allowlist import _check_structure, _children, _flat_within
    from asyncload.decoding.vm import check_structure as walk

    one = tuple(f"p{i}" for i in range(3))
    data = {
        f"layers.{i}.w": one if shared else tuple(f"p{i}.{j}" for j in range(3))
        for i in range(20 + extra)
    }
    n = 1 + len(data) + sum(1 + len(v) for v in data.values())
    for budget in (n - 1, n, n + 1):
        try:
            walk(data, "pd", 64, budget, _children)
            walked = True
        except UnsafeCheckpointError:
            walked = False
        assert _flat_within(data, 64, budget) is walked is (budget >= n)
        if not walked:  # the fast path leaves it to the walk, which names the problem
            with pytest.raises(UnsafeCheckpointError, match="expands to more than"):
                _check_structure(data, "pd", 64, budget)
    # anything else is the walk's
    assert not _flat_within({"k": ("a", ("nested",))}, 64, 1 << 20)
    assert not _flat_within({"k": ("a",)}, 1, 1 << 20)
    assert not _flat_within({1: ("a",)}, 64, 1 << 20)
    assert not _flat_within([("a",)], 64, 1 << 20)
