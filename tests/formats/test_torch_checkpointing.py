"""torch-checkpointing (DCPv2) checkpoints, written by torch-checkpointing 0.1.1 itself, read by
asyncload and compared bit for bit with what torch-checkpointing's own loader gives: one rank
and two gloo ranks (DTensors, ``metadata.pkl``), resharded into destinations split differently,
locally and from S3; forged and half-written directories end in typed errors.

Writing on CPU: torch-checkpointing's O_DIRECT writes fail with EINVAL on this disk
(``LocalFileSystemStorageConfig(use_direct_io=False)``), and its multi-rank metadata gather
moves the pickled metadata through CUDA tensors; the 2-rank saves here use its public
``make_sync_checkpoint_saver`` with a ``DefaultMetadataManager`` whose gather is
``all_gather_object`` on the gloo group (the only change; every file is written by its writer).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal
from _dist import all_ok, run_ranks

import asyncload
from asyncload import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadOptions,
    UnsafeCheckpointError,
)

pytest.importorskip("torch_checkpointing")

pytestmark = pytest.mark.timeout(120)


# --- writing with torch-checkpointing ------------------------------------------------------------


def _storage() -> Any:
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return LocalFileSystemStorageConfig(use_direct_io=False)


def _manager(resharded: tuple[str, ...] = ("model",)) -> Any:
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder

    items = {k: ItemSpec(resharder=DefaultResharder()) for k in resharded}
    cfg = CheckpointManager.Config(
        items=items, save=SyncCheckpointSaverConfig(), storage_config=_storage()
    )
    return CheckpointManager(cfg)


def _training_state() -> dict[str, Any]:
    """A model (nested, several dtypes), its AdamW state after one step, and scalars."""
    g = torch.Generator().manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6, generator=g)).square().sum().backward()
    opt.step()
    sd = model.state_dict()
    sd["buffers"] = {
        "ids": torch.arange(10, dtype=torch.int64),
        "half": torch.randn(3, 2, generator=g).half(),
    }
    return {"model": sd, "optimizer": opt.state_dict(), "step": 1234, "lr": 0.25}


def _zeros_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeros_like(v) for v in obj]
    return obj


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves by their dotted path (keys as strings: how DCP flattens, either key type)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}.{i}"))
        return out
    return {prefix: obj}


def _assert_same_leaves(got: Any, want: Any) -> None:
    g, w = _flat(got), _flat(want)
    assert sorted(g) == sorted(w)
    for k in w:
        assert_bitwise_equal(g[k], w[k], k)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A 1-rank save: model (resharder: metadata.pkl), optimizer, int and float items."""
    path = tmp_path_factory.mktemp("tc") / "step_1234"
    state = _training_state()
    mgr = _manager()
    try:
        assert mgr.save(str(path), state) is None
    finally:
        mgr.close()
    assert sorted(os.listdir(path)) == [
        "lr_0.pt",
        "metadata.pkl",
        "model_0.pt",
        "optimizer_0.pt",
        "step_0.pt",
    ]
    return path, state


def _own_load(path: Path, state: dict[str, Any]) -> Any:
    """torch-checkpointing's own loader, into zeroed templates of ``state``."""
    mgr = _manager()
    try:
        into = {k: _zeros_like(v) for k, v in state.items()}
        return mgr.load(str(path), into=into)
    finally:
        mgr.close()


# --- one rank -------------------------------------------------------------------------------------


def test_detected_and_read_like_its_own_loader(one_rank: tuple[Path, dict[str, Any]]) -> None:
    path, state = one_rank
    own = _own_load(path, state)
    got = asyncload.read_state_dict(path)
    assert sorted(got) == ["lr", "model", "optimizer", "step"]
    # scalar items: the value itself, of its type
    assert type(got["step"]) is int and got["step"] == own["step"] == 1234
    assert type(got["lr"]) is float and got["lr"] == own["lr"] == 0.25
    # the model: same structure (dict of dicts), every tensor bit for bit
    assert_bitwise_equal(got["model"], own["model"], "model")
    assert_bitwise_equal(got["model"], state["model"], "model")
    # the optimizer: every leaf (tensors, hyper-parameters, param ids) equal
    _assert_same_leaves(got["optimizer"], own["optimizer"])
    _assert_same_leaves(got["optimizer"], state["optimizer"])


def test_load_into_destination_and_iter_tensors(one_rank: tuple[Path, dict[str, Any]]) -> None:
    path, state = one_rank
    dest = {"model": _zeros_like(state["model"]), "step": 0}
    stats = asyncload.load(dest, path)
    assert dest["step"] == 1234
    assert_bitwise_equal(dest["model"], state["model"], "model")
    assert stats.bytes_assembled == sum(
        t.numel() * t.element_size() for t in _flat(state["model"]).values()
    )
    for face in ("aload", "start_load", "dcp"):
        dest = {"model": _zeros_like(state["model"]), "step": 0}
        if face == "aload":
            asyncio.run(asyncload.aload(dest, path))
        elif face == "start_load":
            asyncload.start_load(dest, path).result(timeout=60)
        else:
            dcp.load(dest, storage_reader=asyncload.PipelinedReader(path))
        assert dest["step"] == 1234, face
        assert_bitwise_equal(dest["model"], state["model"], face)
    seen = dict(asyncload.iter_tensors(path, keys=["model"]))
    assert sorted(seen) == sorted(f"model.{k}" for k in _flat(state["model"]))
    for k, t in _flat(state["model"]).items():
        assert_bitwise_equal(seen[f"model.{k}"], t, k)


def test_remote_s3_same_as_local(
    one_rank: tuple[Path, dict[str, Any]], s3_server: Any, bucket_name: str
) -> None:
    path, state = one_rank
    url = s3_server.upload_dir(path, bucket_name, "tc1")
    got = asyncload.read_state_dict(url, storage_options=s3_server.storage_options())
    assert_bitwise_equal(got["model"], state["model"], "model")
    _assert_same_leaves(got["optimizer"], state["optimizer"])
    assert got["step"] == 1234 and got["lr"] == 0.25


# --- two gloo ranks: DTensors ---------------------------------------------------------------------


def _full(big: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    n = 100 if big else 1
    return {
        "emb": torch.randn(7 * n, 6 * n, generator=g),  # rows split unevenly over 2 ranks (4 + 3)
        "proj": torch.randn(4 * n, 9 * n, generator=g).to(
            torch.bfloat16
        ),  # split by columns (5 + 4)
        "norm": torch.randn(6, generator=g),  # replicated
        "ids": torch.arange(10, dtype=torch.int64),  # a plain tensor on every rank
    }


_SPEC = {"emb": "S0", "proj": "S1", "norm": "R"}


def _placements(spec: str) -> list[Any]:
    """``"S0"`` -> ``[Shard(0)]``, ``"S1,R"`` -> ``[Shard(1), Replicate()]`` (one per mesh dim)."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def _dtensors(
    full: dict[str, torch.Tensor], mesh: Any, spec: dict[str, str], *, zeros: bool
) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, Any] = {}
    for k, v in full.items():
        if k not in spec:
            out[k] = torch.zeros_like(v) if zeros else v.clone()
            continue
        pl = _placements(spec[k])
        shape, off = compute_local_shape_and_global_offset(v.shape, mesh, pl)
        local = v[tuple(slice(o, o + n) for o, n in zip(off, shape))].clone()
        out[k] = DTensor.from_local(
            torch.zeros_like(local) if zeros else local,
            mesh,
            pl,
            run_check=False,
            shape=v.shape,
            stride=v.stride(),
        )
    return out


def _gloo_metadata_manager(rank_info: Any) -> Any:
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    class GlooMetadataManager(DefaultMetadataManager):
        """Its gather through the gloo group (``all_gather_object``) instead of CUDA tensors."""

        def _all_gather_pickled_data(self, data: Any, process_group: Any = None) -> dict[int, Any]:
            out: list[Any] = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(out, data, group=process_group)
            return dict(enumerate(out))

    return GlooMetadataManager(rank_info)


class _Payload:
    """A ``CheckpointBase`` over a dict of items (the model item with a resharder)."""

    def __new__(cls, values: dict[str, Any]) -> Any:
        from torch_checkpointing import CheckpointBase, CheckpointItem
        from torch_checkpointing.default_resharder import DefaultResharder

        class Payload(CheckpointBase):
            def __init__(self) -> None:
                self.items = {
                    k: CheckpointItem(
                        value=v, resharder=DefaultResharder() if k == "model" else None
                    )
                    for k, v in values.items()
                }
                self.result: Any = None

            def get_items(self) -> dict[str, Any]:
                return self.items

            def load_state_dict(self, state_dict: Any) -> None:
                self.result = state_dict

        return Payload()


def w_save(
    rank: int,
    world: int,
    path: str,
    mesh_shape: tuple[int, ...] | None = None,
    spec: dict[str, str] | None = None,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch_checkpointing import RankInfo, make_sync_checkpoint_saver
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    mesh = init_device_mesh("cpu", mesh_shape or (world,))
    info = RankInfo(
        global_rank=rank, global_world_size=world, role_rank=rank, role_world_size=world
    )
    saver = make_sync_checkpoint_saver(
        config=SyncCheckpointSaverConfig(),
        rank_info=info,
        storage_config=_storage(),
        checkpoint_metadata_manager=_gloo_metadata_manager(info),
    )
    try:
        saver.save(
            path,
            _Payload(
                {"model": _dtensors(_full(), mesh, spec or _SPEC, zeros=False), "step": 40 + rank}
            ),
        )
    finally:
        saver.close()


def w_own_load(rank: int, world: int, path: str, spec: dict[str, str]) -> dict[str, torch.Tensor]:
    """torch-checkpointing's own loader into DTensors laid out as ``spec``; the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch_checkpointing import CheckpointLoader, CheckpointReader, RankInfo

    mesh = init_device_mesh("cpu", (world,))
    info = RankInfo(
        global_rank=rank, global_world_size=world, role_rank=rank, role_world_size=world
    )
    loader = CheckpointLoader(
        reader=CheckpointReader(rank_info=info, storage_config=_storage()),
        metadata_manager=_gloo_metadata_manager(info),
    )
    ck = _Payload({"model": _dtensors(_full(), mesh, spec, zeros=True)})
    loader.load(path, ck)
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, v in ck.result["model"].items()
    }


def w_asyncload(
    rank: int, world: int, path: str, spec: dict[str, str], big: bool = False
) -> dict[str, Any]:
    """asyncload.load into zeroed DTensors laid out as ``spec``: which keys came back wrong."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = _full(big)
    want = _dtensors(full, mesh, spec, zeros=False)
    dest = {"model": _dtensors(full, mesh, spec, zeros=True), "step": -1}
    stats = asyncload.load(dest, path)

    def local(t: Any) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    bad = [
        k
        for k in full
        if not (
            local(dest["model"][k]).dtype == local(want[k]).dtype
            and torch.equal(
                local(dest["model"][k]).view(torch.uint8), local(want[k]).view(torch.uint8)
            )
        )
    ]
    return {"bad": bad, "step": dest["step"], "bytes_read": stats.bytes_read}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tc2") / "step_40"
    all_ok(run_ranks(w_save, 2, str(path), timeout=90))
    assert sorted(os.listdir(path)) == [
        "metadata.pkl",
        "model_0.pt",
        "model_1.pt",
        "step_0.pt",
        "step_1.pt",
    ]
    return path


def test_two_rank_save_read_by_one(two_ranks: Path) -> None:
    """One process reads what two ranks saved: each DTensor assembled from both ranks' shards,
    bit for bit equal to the saved full tensors and to torch-checkpointing's own 2 -> 1 reshard."""
    full = _full()
    got = asyncload.read_state_dict(two_ranks)
    assert got["step"] == 40  # rank 0's value of a non-tensor item
    assert_bitwise_equal(got["model"], full, "model")
    own = all_ok(
        run_ranks(
            w_own_load, 1, str(two_ranks), {"emb": "R", "proj": "R", "norm": "R"}, timeout=90
        )
    )[0]
    assert_bitwise_equal(got["model"], own, "model")
    dest = {"model": _zeros_like(full)}  # plain tensors: 1 rank reading a 2-rank save
    asyncload.load(dest, two_ranks)
    assert_bitwise_equal(dest["model"], full, "model")
    streamed = dict(asyncload.iter_tensors(two_ranks))
    assert_bitwise_equal(streamed, {f"model.{k}": v for k, v in full.items()}, "iter_tensors")


def test_two_dimensional_mesh(tmp_path: Path) -> None:
    """A 2 x 1 mesh: shards over one mesh dim, replicas over the other (only one copy is read)."""
    path = tmp_path / "mesh2d"
    spec = {"emb": "S0,R", "proj": "R,S1", "norm": "R,S0"}
    all_ok(run_ranks(w_save, 2, str(path), (2, 1), spec, timeout=90))
    got = asyncload.read_state_dict(path)
    assert_bitwise_equal(got["model"], _full(), "model")
    values = all_ok(run_ranks(w_asyncload, 2, str(path), _SPEC, timeout=90))
    assert [v["bad"] for v in values] == [[], []]


def test_two_rank_save_resharded_for_two(two_ranks: Path) -> None:
    """Two ranks load the 2-rank save split the other way round (rows <-> columns)."""
    spec = {"emb": "S1", "proj": "S0", "norm": "S0"}
    values = all_ok(run_ranks(w_asyncload, 2, str(two_ranks), spec, timeout=90))
    assert [v["bad"] for v in values] == [[], []]
    assert [v["step"] for v in values] == [40, 40]


def test_one_rank_save_loaded_sharded_by_two(tmp_path: Path) -> None:
    """Two ranks load a 1-rank save of plain tensors into DTensors: each gets exactly its shard
    and reads little more than its share of the model."""
    path = tmp_path / "one"
    mgr = _manager()
    try:
        mgr.save(str(path), {"model": _full(big=True), "step": 40})
    finally:
        mgr.close()
    values = all_ok(run_ranks(w_asyncload, 2, str(path), _SPEC, True, timeout=90))
    assert [v["bad"] for v in values] == [[], []]
    full = _full(big=True)
    total = sum(t.numel() * t.element_size() for t in full.values())
    # emb's rows and proj's columns are split: each rank reads its part of them, not all
    print("bytes read by each rank", [v["bytes_read"] for v in values], "of", total)
    assert all(v["bytes_read"] < 0.7 * total for v in values), (
        [v["bytes_read"] for v in values],
        total,
    )


@pytest.mark.parametrize("backend", ["s3", "gcs", "http"])
def test_two_rank_save_remote(
    two_ranks: Path, request: pytest.FixtureRequest, backend: str, bucket_name: str
) -> None:
    """From each store: found by listing the directory (HTTP: its index page), read bit for bit."""
    server = request.getfixturevalue(f"{backend}_server")
    url = server.upload_dir(two_ranks, bucket_name, "tc2")
    got = asyncload.read_state_dict(url, storage_options=server.storage_options())
    assert_bitwise_equal(got["model"], _full(), "model")
    assert got["step"] == 40
    dest = {"model": _zeros_like(_full()), "step": 0}
    asyncload.load(dest, url, storage_options=server.storage_options())
    assert_bitwise_equal(dest["model"], _full(), "model")


# --- forged and half-written ----------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _metadata(path: Path) -> dict[str, Any]:
    return pickle.loads(
        (path / "metadata.pkl").read_bytes()
    )  # the test's own file, written by torch-checkpointing


def _write_metadata(path: Path, md: Any) -> None:
    (path / "metadata.pkl").write_bytes(pickle.dumps(md))


class _RunsCode:
    def __reduce__(self) -> Any:
        return (os.system, ("touch PWNED",))


def test_forged_metadata_global_refused(two_ranks: Path, tmp_path: Path) -> None:
    path = _copy(two_ranks, tmp_path / "ck")
    md = _metadata(path)
    md["metadata"]["model"]["extra"] = _RunsCode()
    _write_metadata(path, md)
    dest = {"model": _zeros_like(_full())}
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"metadata\.pkl: asks to import posix\.system, which is not on asyncload.s allow-list",
    ):
        asyncload.load(dest, path)
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()
    assert all(not t.any() for t in dest["model"].values())  # destination untouched


@pytest.mark.parametrize(
    ("forge", "error", "match"),
    [
        (  # placements that disagree with the shard the file holds
            lambda md: md["metadata"]["model"]["nested_path_to_metadata"]['["emb"]'][0][
                "sharding_metadata"
            ]["data"].__setitem__("placements", [{"type": "Shard", "dim": 1}]),
            CheckpointFormatError,
            r"model_0\.pt.*metadata\.pkl says size \[7, 6\], placements \(\('shard', 1, 0\),\)",
        ),
        (  # a global shape the files do not have (its shards would point outside the tensor)
            lambda md: md["metadata"]["model"]["nested_path_to_metadata"]['["emb"]'][0][
                "sharding_metadata"
            ]["data"].__setitem__("global_shape", [70, 6]),
            CheckpointFormatError,
            r"DTensor 'model\.emb' of .*model_0\.pt.*metadata\.pkl says size \[70, 6\]",
        ),
        (  # a third rank whose file was never written
            lambda md: (
                md.__setitem__("world_size", 3),
                md["metadata"]["model"]["rank_to_layout_info"].__setitem__(2, None),
            ),
            CheckpointNotFoundError,
            r"model_2\.pt \(named by .*metadata\.pkl\) does not exist.*did not finish",
        ),
        (  # a file outside the checkpoint
            lambda md: md["metadata"]["model"]["rank_to_layout_info"].__setitem__(
                1,
                {
                    "file_path": "../model_1.pt",
                    "serialization_format": {"type": "TorchSerialization"},
                },
            ),
            CheckpointFormatError,
            r"metadata\.pkl.*\.\./model_1\.pt",
        ),
        (  # both ranks' shards said to be in rank 0's file
            lambda md: md["metadata"]["model"]["rank_to_layout_info"].__setitem__(
                1,
                {
                    "file_path": "model_0.pt",
                    "serialization_format": {"type": "TorchSerialization"},
                },
            ),
            CheckpointFormatError,
            r"model_0\.pt.*metadata\.pkl says .* coordinate \(1,\) for rank 1; the file holds .* coordinate \(0,\)",
        ),
        (  # a sharding type asyncload does not read
            lambda md: md["metadata"]["model"]["nested_path_to_metadata"]['["emb"]'][0][
                "sharding_metadata"
            ].__setitem__("type", "default_tensor_v1"),
            CheckpointFormatError,
            r"metadata\.pkl: key 'model\.emb' has sharding metadata of type 'default_tensor_v1'",
        ),
        (  # an item saved as JSON
            lambda md: md["metadata"]["model"]["rank_to_layout_info"].__setitem__(
                0,
                {
                    "file_path": "model_0.pt",
                    "serialization_format": {"type": "JsonSerialization", "cls": None},
                },
            ),
            CheckpointFormatError,
            r"item 'model' of rank 0 is saved with 'JsonSerialization'; asyncload reads only TorchSerialization",
        ),
        (  # a key no file holds
            lambda md: md["metadata"]["model"]["nested_path_to_metadata"].__setitem__(
                '["ghost"]', md["metadata"]["model"]["nested_path_to_metadata"]['["emb"]']
            ),
            CheckpointFormatError,
            r"metadata\.pkl describes key 'model\.ghost', which no file of the checkpoint holds",
        ),
        (  # a huge world: refused from the table's own size, no table of 10**7 ranks is built
            lambda md: md.__setitem__("world_size", 10**7),
            CheckpointFormatError,
            r"metadata\.pkl: item 'model' does not give the file of every rank 0\.\.9999999",
        ),
        (
            lambda md: md.__setitem__("version", "9.0"),
            CheckpointFormatError,
            r"metadata\.pkl: has metadata version '9\.0'",
        ),
    ],
    ids=[
        "placements",
        "global-shape",
        "missing-rank",
        "traversal",
        "same-file",
        "default-tensor",
        "json",
        "ghost",
        "huge-world",
        "version",
    ],
)
def test_forged_metadata(
    two_ranks: Path, tmp_path: Path, forge: Any, error: type[Exception], match: str
) -> None:
    path = _copy(two_ranks, tmp_path / "ck")
    md = _metadata(path)
    forge(md)
    _write_metadata(path, md)
    dest = {"model": _zeros_like(_full()), "step": -1}
    with pytest.raises(error, match=match):
        asyncload.load(dest, path)
    assert all(not t.any() for t in dest["model"].values()) and dest["step"] == -1  # untouched
    with pytest.raises(error, match=match):
        asyncload.read_state_dict(path)


def test_overlapping_and_missing_shards(two_ranks: Path, tmp_path: Path) -> None:
    """Without metadata.pkl the files alone say where each shard lies: rank 1's file replaced
    by rank 0's makes two shards overlap; rank 1's files gone leaves part of each tensor unsaved."""
    path = _copy(two_ranks, tmp_path / "overlap")
    (path / "metadata.pkl").unlink()
    shutil.copyfile(path / "model_0.pt", path / "model_1.pt")
    with pytest.raises(
        CheckpointFormatError, match=r"DTensor 'model\.emb': chunks 0 .* and 1 .* overlap"
    ):
        asyncload.read_state_dict(path)
    path = _copy(two_ranks, tmp_path / "missing")
    for name in ("metadata.pkl", "model_1.pt", "step_1.pt"):
        (path / name).unlink()
    with pytest.raises(
        CheckpointFormatError, match=r"DTensor 'model\.emb': the chunks hold 24 of the tensor's 42"
    ):
        asyncload.read_state_dict(path)


def test_half_written(two_ranks: Path, tmp_path: Path) -> None:
    path = _copy(two_ranks, tmp_path / "half")
    (path / "model_1.pt").unlink()
    with pytest.raises(
        CheckpointNotFoundError, match=r"model_1\.pt \(named by .*metadata\.pkl\) does not exist"
    ):
        asyncload.read_state_dict(path)
    path = _copy(two_ranks, tmp_path / "cut")
    data = (path / "model_1.pt").read_bytes()
    (path / "model_1.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match=r"model_1\.pt"):
        asyncload.read_state_dict(path)
    path = _copy(two_ranks, tmp_path / "gap")
    (path / "metadata.pkl").unlink()
    (path / "step_0.pt").unlink()
    shutil.copyfile(path / "step_1.pt", path / "step_2.pt")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"step_0\.pt does not exist although rank 2 wrote step_2\.pt",
    ):
        asyncload.read_state_dict(path)


def test_metadata_over_the_bound_is_not_read(two_ranks: Path, tmp_path: Path) -> None:
    path = _copy(two_ranks, tmp_path / "big")
    size = (path / "metadata.pkl").stat().st_size
    with pytest.raises(
        CheckpointFormatError,
        match=rf"metadata\.pkl is {size} bytes, more than .*max_metadata_size",
    ):
        asyncload.read_state_dict(path, options=LoadOptions(max_metadata_size=size - 1))


# --- asyncload as torch-checkpointing's storage backend --------------------------------------------


def _reader_on(storage: Any) -> Any:
    """torch-checkpointing's own loader (rank 0 of 1, model resharded) reading through ``storage``."""
    from torch_checkpointing import CheckpointLoader, CheckpointReader, RankInfo
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    info = RankInfo(global_rank=0, global_world_size=1, role_rank=0, role_world_size=1)
    # CheckpointReader takes a config even when it is given the storage itself (then unused)
    reader = CheckpointReader(rank_info=info, storage_config=_storage(), storage=storage)
    return CheckpointLoader(reader=reader, metadata_manager=DefaultMetadataManager(info))


def _own_load_through(storage: Any, checkpoint_id: str, state: dict[str, Any]) -> dict[str, Any]:
    ck = _Payload({k: _zeros_like(v) for k, v in state.items()})
    _reader_on(storage).load(checkpoint_id, ck)
    return dict(ck.result)


def test_storage_backend_reads_s3_through_the_engine(
    one_rank: tuple[Path, dict[str, Any]], s3_server: Any, bucket_name: str, fault_proxy: Any
) -> None:
    """torch-checkpointing's loader with AsyncloadStorage over S3 (behind a proxy that fails
    the first two data reads with 503): the same values as its own local load, the failures
    retried by asyncload's policy and counted."""
    from asyncload.integrations.torch_checkpointing import AsyncloadStorageConfig
    from asyncload.testing.faults import status

    path, state = one_rank
    s3_server.upload_dir(path, bucket_name, "run/step_1234")
    proxy = fault_proxy(s3_server)
    rule = proxy.add_rule(status(503), data_only=True, times=2)
    config = AsyncloadStorageConfig(
        root=f"s3://{bucket_name}/run",
        storage_options=s3_server.storage_options(proxy.endpoint_url),
    )
    storage = config.create_storage()
    try:
        got = _own_load_through(storage, "step_1234", state)
        stats = storage.stats()
    finally:
        storage.close()
    own = _own_load(path, state)
    assert_bitwise_equal(got["model"], own["model"], "model")
    _assert_same_leaves(got["optimizer"], own["optimizer"])
    assert got["step"] == 1234 and got["lr"] == 0.25
    assert rule.fired == 2 and stats.retries >= 2, (rule.fired, stats.retries)
    assert stats.bytes_read >= sum(p.stat().st_size for p in path.iterdir())


def test_storage_backend_paths_and_refusals(
    one_rank: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from asyncload.integrations.torch_checkpointing import AsyncloadStorageConfig

    path, state = one_rank
    storage = AsyncloadStorageConfig(root=str(path.parent)).create_storage()
    try:
        # a checkpoint id relative to the root, or a path under it, reads the same
        for ckpt_id in ("step_1234", str(path)):
            got = _own_load_through(storage, ckpt_id, {"model": state["model"]})
            assert_bitwise_equal(got["model"], state["model"], "model")
        assert sorted(storage.ls(Path("step_1234"))) == sorted(os.listdir(path))
        assert (
            storage.getsize(Path("step_1234/model_0.pt")) == (path / "model_0.pt").stat().st_size
        )
        assert storage.exists(Path("step_1234")) and not storage.exists(Path("step_9"))
        with pytest.raises(FileNotFoundError, match="does not exist"):
            _own_load_through(storage, "step_9", {"model": state["model"]})
        with pytest.raises(ValueError, match=r"is not under this storage's root"):
            storage.getsize(tmp_path / "elsewhere.pt")
        with pytest.raises(NotImplementedError, match="AsyncloadStorage only reads"):
            storage.write(Path("step_1234/x.pt"), b"x")
    finally:
        storage.close()
    with pytest.raises(TypeError, match="storage_options must be a mapping"):
        AsyncloadStorageConfig(root="s3://b/run", storage_options=["x"])  # type: ignore[arg-type]


def test_only_metadata_left(two_ranks: Path, tmp_path: Path) -> None:
    path = tmp_path / "bare"
    path.mkdir()
    shutil.copyfile(two_ranks / "metadata.pkl", path / "metadata.pkl")
    with pytest.raises(
        CheckpointNotFoundError, match=r"model_0\.pt \(named by .*metadata\.pkl\) does not exist"
    ):
        asyncload.read_state_dict(path)


def test_forged_item_file_refused(two_ranks: Path, tmp_path: Path) -> None:
    """A rank's item file whose pickle runs code: refused by the allow-list, naming that file."""
    path = _copy(two_ranks, tmp_path / "ck")
    torch.save(_RunsCode(), path / "step_1.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"step_1\.pt \(data\.pkl\): asks to import posix\.system"
    ):
        asyncload.read_state_dict(path)
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def w_save_stages(rank: int, world: int, path: str) -> None:
    """Pipeline stages: each rank saves only its own layers (no resharder, no metadata.pkl)."""
    from torch_checkpointing import RankInfo, make_sync_checkpoint_saver
    from torch_checkpointing.config import SyncCheckpointSaverConfig

    info = RankInfo(
        global_rank=rank, global_world_size=world, role_rank=rank, role_world_size=world
    )
    saver = make_sync_checkpoint_saver(
        config=SyncCheckpointSaverConfig(), rank_info=info, storage_config=_storage()
    )
    full = _full()
    mine = {
        "layers": {str(rank): {"w": full["emb"] + rank, "b": full["norm"] * rank}},
        "stage": rank,
    }
    try:
        saver.save(path, _Payload({"pipe": mine}))
    finally:
        saver.close()


def test_pipeline_stages_each_rank_its_layers(tmp_path: Path) -> None:
    path = tmp_path / "pp"
    all_ok(run_ranks(w_save_stages, 2, str(path), timeout=90))
    assert sorted(os.listdir(path)) == ["pipe_0.pt", "pipe_1.pt"]
    full = _full()
    got = asyncload.read_state_dict(path)
    want = {
        "layers": {str(r): {"w": full["emb"] + r, "b": full["norm"] * r} for r in (0, 1)},
        "stage": 0,
    }
    assert_bitwise_equal(got["pipe"], want, "pipe")


def test_one_item_file_alone_says_load_the_directory(two_ranks: Path) -> None:
    """Before: "holds a int" (a scalar item) or an allow-list refusal (a DTensor shard), with no
    word of what the file is; now the same error says to load the directory."""
    with pytest.raises(
        CheckpointFormatError,
        match=r"step_0\.pt is named like one item file of a torch-checkpointing",
    ):
        asyncload.read_state_dict(two_ranks / "step_0.pt")
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"model_1\.pt is named like one item file .* load the checkpoint's directory",
    ):
        asyncload.read_state_dict(two_ranks / "model_1.pt")


def test_storage_backend_large_reads_go_through_the_engines_read_loop(
    s3_server: Any, bucket_name: str, fault_proxy: Any, tmp_path: Path
) -> None:
    """A stream read larger than ``chunk_size`` is read by the engine's read loop (one request
    per ``chunk_size`` piece, at most ``max_in_flight`` at once): the bytes exact; a piece that
    fails (403, not retried) is raised as that one read's typed error, never a group."""
    from torch_checkpointing.storage.base_storage import ReadArgs

    from asyncload.integrations.torch_checkpointing import AsyncloadStorageConfig
    from asyncload.testing.faults import status

    data = os.urandom(3 << 20)
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob.bin").write_bytes(data)
    s3_server.upload_dir(src, bucket_name, "run")
    proxy = fault_proxy(s3_server)
    opts = LoadOptions(chunk_size=256 << 10, min_chunk_size=64 << 10, concurrency=3)
    config = AsyncloadStorageConfig(
        root=f"s3://{bucket_name}/run",
        storage_options=s3_server.storage_options(proxy.endpoint_url),
        options=opts,
    )
    storage = config.create_storage()
    stream_args = ReadArgs(pre_read_full_file=False)
    try:
        with storage.stream_read(Path("blob.bin"), stream_args) as f:
            f.seek(1000)
            got = f.read((2 << 20) + 12345)
        assert got == data[1000 : 1000 + (2 << 20) + 12345]
        stats = storage.stats()
        assert 1 <= stats.peak_concurrency <= 3
        assert 0 < stats.peak_buffered_bytes <= opts.memory_budget
        rule = proxy.add_rule(status(403), data_only=True, times=None)
        f = storage.stream_read(Path("blob.bin"), stream_args)
        with f, pytest.raises(asyncload.AsyncLoadError) as ei:
            f.read(2 << 20)
        assert not isinstance(ei.value, BaseExceptionGroup)
        assert "blob.bin" in str(ei.value) and rule.fired >= 1
    finally:
        storage.close()
