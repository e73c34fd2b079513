"""The loader of ``load_format="asyncload"`` without starting vLLM's engine: the entry point,
configuration errors, and vLLM's expert-parallel filter turned into asyncload's ``keys=``.

Expert parallelism needs more than one rank (``ep_size = dp x pcp x tp``), which vLLM's CPU
build cannot run on this machine's two cores in test time; the filter is tested here as vLLM
applies it: the loader's ``local_expert_ids`` set by vLLM's own ``compute_local_expert_ids``,
the tensors it yields compared, bit for bit, with those of vLLM's own
``safetensors_weights_iterator(..., local_expert_ids=...)``, and the byte ranges requested from
an S3 server checked against the skipped experts' bytes.
"""

from __future__ import annotations

import importlib.metadata
import json
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

from asyncload import AsyncLoadError, LoadOptions
from asyncload.common.options import MiB
from asyncload.integrations._vllm_config import REMOTE_DEFAULTS
from asyncload.integrations.vllm import register
from asyncload.testing import S3Server

pytestmark = pytest.mark.timeout(120)

EXPERTS = 6
EP_SIZE, EP_RANK = 3, 1  # rank 1 of 3 holds experts 2 and 3
PROJECTIONS = ("w1", "w2")
#: The first bytes of a file a load reads to find a safetensors header (at most).
HEADER_PROBE = 64 * 1024


def _loader(extra: dict[str, Any] | None = None) -> Any:
    register()
    return get_model_loader(
        LoadConfig(load_format="asyncload", model_loader_extra_config=extra or {})
    )


def test_entry_point_registers_the_loader() -> None:
    (ep,) = [
        e
        for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "asyncload"
    ]
    assert ep.value == "asyncload.integrations.vllm:register"
    assert ep.load() is register
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does
    from asyncload.integrations._vllm_loader import AsyncLoadModelLoader

    loader = get_model_loader(LoadConfig(load_format="asyncload"))
    assert type(loader) is AsyncLoadModelLoader


def test_importing_the_plugin_module_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, asyncload.integrations.vllm as m; "
        "print(sorted(n for n in ('vllm', 'torch') if n in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"URL": "s3://b/m"}, ["model_loader_extra_config['URL']", "unknown key", "url"]),
        ({"enable_multithread_load": True}, ["['enable_multithread_load']", "unknown key"]),
        (
            {"options": {"chunksize": 1}},
            ["model_loader_extra_config['options']['chunksize']", "chunk_size"],
        ),
        ({"options": {"concurrency": 0}}, ["model_loader_extra_config['options']", "concurrency"]),
        ({"options": [1]}, ["model_loader_extra_config['options'] must be a dict"]),
        (
            {"storage_options": "x"},
            ["model_loader_extra_config['storage_options'] must be a dict"],
        ),
        ({"url": ""}, ["model_loader_extra_config['url'] = ''"]),
    ],
)
def test_bad_extra_config_names_the_key(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        _loader(extra)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_options_reach_load_options() -> None:
    loader = _loader({"options": {"concurrency": 3, "timeout": 7.5, "transport": "fsspec"}})
    assert (loader.extra.options.concurrency, loader.extra.options.timeout) == (3, 7.5)
    assert loader.extra.options.transport == "fsspec"


def test_remote_sources_default_to_a_small_read_ahead() -> None:
    """A remote stream takes ``REMOTE_DEFAULTS`` for the fields ``"options"`` leaves unset; a
    local one, and every field given, keep theirs; a ``LoadOptions`` is used as it is."""
    loader = _loader({"options": {"concurrency": 3}})
    local, remote = loader.extra.options_for(True), loader.extra.options_for(False)
    assert (local.memory_budget, local.chunk_size) == (512 * MiB, 16 * MiB)
    assert (remote.memory_budget, remote.chunk_size) == (128 * MiB, 4 * MiB)
    assert remote.concurrency == local.concurrency == 3
    assert {"memory_budget": 128 * MiB, "chunk_size": 4 * MiB} == REMOTE_DEFAULTS
    given = _loader({"options": {"memory_budget": 64 * MiB}}).extra.options_for(False)
    assert (given.memory_budget, given.chunk_size) == (64 * MiB, 4 * MiB)
    sized = _loader({"options": {"min_chunk_size": 8 * MiB}}).extra.options_for(False)
    assert (sized.memory_budget, sized.chunk_size, sized.min_chunk_size) == (
        128 * MiB,
        16 * MiB,
        8 * MiB,
    )
    mine = LoadOptions(concurrency=5)
    ours = _loader({"options": mine}).extra
    assert ours.options_for(False) is mine and ours.options_for(True) is mine


def test_remote_weights_read_in_requests_of_the_remote_chunk_size(
    tmp_path: Path, s3_server: S3Server, fault_proxy: Any
) -> None:
    """From S3 the weights are the file's, bit for bit, read in ranged GETs of at most
    ``REMOTE_DEFAULTS["chunk_size"]`` bytes (a 10 MiB tensor in three or more)."""
    g = torch.Generator().manual_seed(2)
    want = {
        "big.weight": torch.randn(1280, 2048, generator=g),  # 10 MiB
        "small.bias": torch.randn(300, generator=g).to(torch.bfloat16),
    }
    (tmp_path / "m").mkdir()
    save_file(want, str(tmp_path / "m" / "model.safetensors"))
    url = s3_server.upload_dir(tmp_path / "m", "vllm-chunks", "m")
    proxy = fault_proxy(s3_server)
    loader = _loader(
        {"url": url, "storage_options": s3_server.storage_options(proxy.endpoint_url)}
    )
    _same(_weights(loader, tmp_path / "m"), want)
    sizes = []
    for entry in proxy.log:
        if entry.method == "GET" and entry.path.endswith("model.safetensors"):
            assert entry.range is not None, entry
            first, last = entry.range.removeprefix("bytes=").split("-")
            sizes.append(int(last) + 1 - int(first))
    assert sizes and max(sizes) <= REMOTE_DEFAULTS["chunk_size"], sizes
    assert sum(s > HEADER_PROBE for s in sizes) >= 3, sizes
    (stats,) = loader.load_stats
    assert stats.bytes_assembled == sum(t.numel() * t.element_size() for t in want.values())


# --- the expert-parallel filter ----------------------------------------------------------


def _moe_checkpoint(directory: Path) -> Path:
    """A Mixtral-like safetensors file: embeddings, a router, 6 experts of 2 weights each (and
    a per-expert scale, which vLLM's filter never skips), a norm. Expert weights of 1 MiB and
    more, as real ones: a gap smaller than ``min_chunk_size`` (1 MiB) between two tensors a rank
    reads may be read through, as in any load."""
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(256, 128, generator=g),  # 128 KiB, first
        "model.layers.0.block_sparse_moe.gate.weight": torch.randn(EXPERTS, 128, generator=g),
        "model.norm.weight": torch.randn(128, generator=g),
    }
    for e in range(EXPERTS):
        for w in PROJECTIONS:
            name = f"model.layers.0.block_sparse_moe.experts.{e}.{w}"
            tensors[f"{name}.weight"] = torch.randn(256, 1056, generator=g)  # 1.03 MiB
            tensors[f"{name}.weight_scale"] = torch.rand(1, generator=g)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file(tensors, str(path))
    return path


def _weights(loader: Any, model_dir: Path) -> dict[str, torch.Tensor]:
    """What the loader gives a model's ``load_weights`` (vLLM's ``get_all_weights``)."""
    model_config = SimpleNamespace(model=str(model_dir), revision=None)
    return dict(loader.get_all_weights(model_config, torch.nn.Module()))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(
            got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ), name


def _skipped_ranges(path: Path, local: set[int]) -> list[tuple[int, int]]:
    """Absolute half-open byte ranges of the expert weights another rank holds."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = []
    for name, info in header.items():
        if name == "__metadata__" or not name.endswith(".weight") or ".experts." not in name:
            continue
        if int(name.split(".experts.")[1].split(".")[0]) not in local:
            b, e = info["data_offsets"]
            out.append((8 + n + b, 8 + n + e))
    return out


def test_expert_filter_local(tmp_path: Path) -> None:
    path = _moe_checkpoint(tmp_path / "moe")
    local = compute_local_expert_ids(EXPERTS, EP_SIZE, EP_RANK)
    assert local == {2, 3}
    want = dict(safetensors_weights_iterator([str(path)], False, local_expert_ids=local))
    loader = _loader()
    loader.local_expert_ids = local  # what vLLM's _init_ep_weight_filter sets under EP
    got = _weights(loader, path.parent)
    _same(got, want)
    skipped = _skipped_ranges(path, local)
    assert len(skipped) == len(PROJECTIONS) * (EXPERTS - 2)
    (stats,) = loader.load_stats
    assert stats.bytes_assembled == sum(t.numel() * t.element_size() for t in want.values())
    # nothing of the skipped experts read: the file less their bytes, and the header probe
    # (its first HEADER_PROBE bytes, read again as tensor data), at most
    unskipped = path.stat().st_size - sum(e - b for b, e in skipped)
    assert stats.bytes_read <= unskipped + HEADER_PROBE
    # every expert, without the filter
    loader.local_expert_ids = None
    assert (
        sum(".experts." in k for k in _weights(loader, path.parent))
        == EXPERTS * len(PROJECTIONS) * 2
    )


def test_expert_filter_reads_only_local_experts_from_s3(
    tmp_path: Path, s3_server: S3Server, fault_proxy: Any
) -> None:
    path = _moe_checkpoint(tmp_path / "moe")
    url = s3_server.upload_dir(path.parent, "vllm-moe", "moe")
    proxy = fault_proxy(s3_server)
    local = compute_local_expert_ids(EXPERTS, EP_SIZE, EP_RANK)
    want = dict(safetensors_weights_iterator([str(path)], False, local_expert_ids=local))
    loader = _loader(
        {"url": url, "storage_options": s3_server.storage_options(proxy.endpoint_url)}
    )
    loader.local_expert_ids = local
    _same(_weights(loader, path.parent), want)
    ranges = []
    for entry in proxy.log:
        if entry.method == "GET" and entry.path.endswith("model.safetensors"):
            assert entry.range is not None, entry  # never the whole object
            first, last = entry.range.removeprefix("bytes=").split("-")
            ranges.append((int(first), int(last) + 1))
    assert ranges
    for b, e in _skipped_ranges(path, local):
        for rb, re_ in ranges:
            assert re_ <= b or rb >= e, f"read {rb}-{re_} overlaps a skipped expert {b}-{e}"


# --- local files: views of leased mappings --------------------------------------------------


def _open_for_writing(path: Path) -> bool:
    """Whether another opener could write ``path`` now: ``False`` while a read lease on it is
    held (a non-blocking open for writing then fails with ``EWOULDBLOCK``, and asks the holder
    to let go)."""
    import errno
    import os

    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except BlockingIOError as exc:
        assert exc.errno == errno.EWOULDBLOCK
        return False
    os.close(fd)
    return True


def _sharded_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Two safetensors files with ``model.safetensors.index.json``, every dtype vLLM loads."""
    g = torch.Generator().manual_seed(1)
    first = {
        "a.weight": torch.randn(64, 32, generator=g),
        "a.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
    }
    second = {
        "b.weight": torch.randn(16, 16, generator=g).to(torch.float16),
        "b.ids": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(first, str(directory / "model-00001-of-00002.safetensors"))
    save_file(second, str(directory / "model-00002-of-00002.safetensors"))
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors")
    weight_map |= dict.fromkeys(second, "model-00002-of-00002.safetensors")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return {**first, **second}


@pytest.mark.skipif(
    __import__("asyncload.storage.mapped", fromlist=["x"]).mapped_copies_available() is not None,
    reason="no leases or cachestat here: local weights are always read",
)
def test_local_weights_are_views_of_leased_mappings(tmp_path: Path) -> None:
    import gc

    want = _sharded_checkpoint(tmp_path / "m")
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    snapshot = [f.read_bytes() for f in files]
    loader = _loader()
    got = _weights(loader, tmp_path / "m")
    _same(got, want)
    # mapped, under a lease: a writer must wait while the views are alive
    assert not any(_open_for_writing(f) for f in files)
    got["a.weight"].add_(1.0)  # a private mapping: the file is never written
    (stats,) = loader.load_stats
    assert stats.bytes_assembled == sum(t.numel() * t.element_size() for t in want.values())
    del got
    gc.collect()
    assert all(_open_for_writing(f) for f in files)  # the views are gone: so is the lease
    assert [f.read_bytes() for f in files] == snapshot


def test_local_weights_read_without_mappings(tmp_path: Path) -> None:
    """``local_mapped_copies=False``, and a file open for writing (no lease): read, same bytes,
    no lease left behind."""
    want = _sharded_checkpoint(tmp_path / "m")
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    got = _weights(_loader({"options": {"local_mapped_copies": False}}), tmp_path / "m")
    _same(got, want)
    assert all(_open_for_writing(f) for f in files)
    with open(files[1], "r+b"):  # a writer holds it: no lease is granted
        got = _weights(_loader(), tmp_path / "m")
        _same(got, want)
    assert all(_open_for_writing(f) for f in files)


def test_local_damaged_header_is_a_typed_error(tmp_path: Path) -> None:
    from asyncload import CheckpointFormatError

    _sharded_checkpoint(tmp_path / "m")
    path = tmp_path / "m" / "model-00002-of-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw[0:8] = struct.pack("<Q", len(raw) + 10)  # a header longer than the file
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError) as info:
        _weights(_loader(), tmp_path / "m")
    assert "model-00002-of-00002.safetensors" in str(info.value)
    assert "the model directory" in str(info.value)


def _header_reads(log: list[Any]) -> dict[str, int]:
    """Requests for each safetensors file's first bytes (its header), by file."""
    out: dict[str, int] = {}
    for entry in log:
        name = entry.path.rsplit("/", 1)[-1]
        first = entry.range is None or entry.range.removeprefix("bytes=").startswith("0-")
        if entry.method == "GET" and name.endswith(".safetensors") and first:
            out[name] = out.get(name, 0) + 1
    return out


def test_download_model_and_weights_read_the_headers_once(
    tmp_path: Path, s3_server: S3Server, fault_proxy: Any
) -> None:
    """From S3, ``download_model``'s early check and the weights share one read of each
    header (and of the index); without ``download_model`` the weights read them once too;
    a missing shard still fails in ``download_model``, naming the configured key."""
    want = _sharded_checkpoint(tmp_path / "m")
    url = s3_server.upload_dir(tmp_path / "m", "vllm-once", "m")
    proxy = fault_proxy(s3_server)
    extra = {"url": url, "storage_options": s3_server.storage_options(proxy.endpoint_url)}
    model_config = SimpleNamespace(model=str(tmp_path / "m"), revision=None)
    files = {"model-00001-of-00002.safetensors": 1, "model-00002-of-00002.safetensors": 1}

    loader = _loader(extra)
    loader.download_model(model_config)
    assert _header_reads(proxy.log) == files
    _same(_weights(loader, tmp_path / "m"), want)
    assert _header_reads(proxy.log) == files  # none read again
    index = [e for e in proxy.log if e.path.endswith("model.safetensors.index.json")]
    assert len([e for e in index if e.method == "GET"]) == 1
    assert loader._opened == {}

    proxy.reset_counters()
    loader = _loader(extra)
    _same(_weights(loader, tmp_path / "m"), want)
    assert _header_reads(proxy.log) == files

    broken = s3_server.upload_dir(tmp_path / "m", "vllm-once", "broken")
    s3_server.client().delete_object(
        Bucket="vllm-once", Key="broken/model-00002-of-00002.safetensors"
    )
    loader = _loader({**extra, "url": broken})
    with pytest.raises(AsyncLoadError) as info:
        loader.download_model(model_config)
    assert 'model_loader_extra_config["url"]' in str(info.value)
    assert "model-00002-of-00002.safetensors" in str(info.value)
    assert loader._opened == {}
