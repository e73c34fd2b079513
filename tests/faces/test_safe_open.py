"""``asyncload.safe_open`` against safetensors' own ``safe_open(..., framework="pt")``, bit for
bit: files written by safetensors' ``save_file`` (every dtype it holds, odd shapes, 0-d and
empty tensors, metadata), read locally and from loopback servers (HTTP through a fault
proxy that logs each request, S3 on moto); keys, metadata, whole tensors, and slices (rows,
columns, ints, negative indices, steps, mixed, advanced). Slices read only their bytes
(plus the header, read once); hostile and truncated files are errors, never tensors; the
storage is closed when the ``with`` block ends."""

from __future__ import annotations

import os
import struct
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt import SAVEABLE_DTYPES, asyncload_threads, live_threads, random_tensor
from _remote import wait_closed
from _st_blob import GOOD, st_blob
from safetensors import safe_open as st_safe_open
from safetensors.torch import save as st_save
from safetensors.torch import save_file

import asyncload
from asyncload import (
    AsyncLoadError,
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadOptions,
    StateDictMismatchError,
)
from asyncload.testing import status


def _safetensors_dtypes() -> list[torch.dtype]:
    """The dtypes safetensors itself writes and reads back into torch (its version's)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for dt in SAVEABLE_DTYPES:
            path = os.path.join(tmp, "probe.safetensors")
            t = random_tensor((3,), dt, 0)
            try:
                save_file({"t": t}, path)
                with st_safe_open(path, framework="pt") as f:
                    back = f.get_tensor("t")
            except Exception:
                continue
            if back.dtype == dt:
                out.append(dt)
    return out


ST_DTYPES = _safetensors_dtypes()
METADATA = {"format": "pt", "note": "unicode: \u00fc \u2713", "empty": ""}

#: Indices of a (9, 7) matrix and a (3, 4, 5) cube alike.
INDICES: list[Any] = [
    (),
    0,
    -1,
    2,
    slice(1, 4),
    slice(-3, None),
    slice(None, None, 2),
    (slice(None), slice(2, 5)),
    (slice(None), 3),
    (slice(None), -1),
    (-2, slice(1, None)),
    (Ellipsis, 1),
    (Ellipsis, slice(1, 3)),
    (1, slice(None)),
    (slice(2, 7), slice(1, 6)),
    (slice(1, 3), 2),
    (slice(5, 2),),
    (slice(10, 20),),
    (None, slice(1, 3)),
    (slice(None), slice(None, None, 3)),
    (slice(0, 9, 4), slice(1, 7, 2)),
    (slice(-100, 100), slice(0, 0)),
    [0, 2],
    torch.tensor(1),
    (slice(None), torch.tensor([0, 2])),
    (Ellipsis, 1, Ellipsis),
]
#: Indices torch refuses (safetensors' pt slices are torch's indexing): the same error type.
BAD_INDICES: list[Any] = [99, (1, 2, 3, 4), slice(None, None, -1), 2.0, (-5, 0)]


def file_state(seed: int = 0, dtypes: list[torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(dtypes or ST_DTYPES):
        name = str(dt).removeprefix("torch.")
        sd[f"{name}.mat"] = random_tensor((9, 7), dt, seed + i)
        sd[f"{name}.cube"] = random_tensor((3, 4, 5), dt, seed + 100 + i)
        sd[f"{name}.scalar"] = random_tensor((), dt, seed + 200 + i)
        sd[f"{name}.empty"] = torch.empty(0, 3, dtype=dt)
    sd["odd.vector"] = random_tensor((13,), torch.float32, seed + 300)
    sd["odd.wide"] = random_tensor((2, 1, 257), torch.bfloat16, seed + 301)
    return sd


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def same(ours: torch.Tensor, theirs: torch.Tensor, where: str) -> None:
    assert ours.dtype == theirs.dtype, f"{where}: {ours.dtype} != {theirs.dtype}"
    assert tuple(ours.shape) == tuple(theirs.shape), f"{where}: {ours.shape} != {theirs.shape}"
    assert bits(ours) == bits(theirs), f"{where}: the bytes differ"


def compare(ours: Any, path: Path, *, indices: list[Any] = INDICES) -> int:
    """Everything ``ours`` (an open asyncload.safe_open) says against safetensors' reading
    of the local copy at ``path``; returns how many results were compared."""
    n = 0
    with st_safe_open(str(path), framework="pt") as theirs:
        assert ours.keys() == theirs.keys()
        assert ours.metadata() == theirs.metadata()
        assert set(ours.offset_keys()) == set(theirs.offset_keys())
        names = theirs.keys()  # (safetensors' safe_open is not iterable)
        for key in names:
            same(ours.get_tensor(key), theirs.get_tensor(key), key)
            mine, st = ours.get_slice(key), theirs.get_slice(key)
            assert mine.get_shape() == st.get_shape(), key
            assert mine.get_dtype() == st.get_dtype(), key
            n += 1
            if not key.endswith((".mat", ".cube")):
                continue
            for ix in indices:
                same(mine[ix], st[ix], f"{key}[{ix!r}]")
                n += 1
    return n


# --- local files ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_local_file_matches_safetensors_bit_for_bit(tmp_path: Path) -> None:
    assert {torch.float32, torch.bfloat16, torch.bool, torch.int64} <= set(ST_DTYPES)
    sd = file_state()
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path), metadata=METADATA)
    with asyncload.safe_open(path) as f:
        assert compare(f, path) > len(sd)
        assert f.stats.bytes_read <= path.stat().st_size * 40  # no runaway reads
    # a str path and a file:// URL name the same file
    for url in (str(path), path.as_uri()):
        with asyncload.safe_open(url, "pt", "cpu") as f:
            same(f.get_tensor("float32.mat"), sd["float32.mat"], url)


@pytest.mark.timeout(60)
def test_metadata_none_empty_and_no_tensors(tmp_path: Path) -> None:
    for md in (None, {}):
        path = tmp_path / f"m{md is None}.safetensors"
        save_file({"b": torch.zeros(2)}, str(path), metadata=md)
        with asyncload.safe_open(path) as f, st_safe_open(str(path), "pt") as g:
            assert f.metadata() == g.metadata()
    path = tmp_path / "nothing.safetensors"
    save_file({}, str(path))
    with asyncload.safe_open(path) as f:
        assert f.keys() == [] and f.metadata() is None


@pytest.mark.timeout(60)
def test_bad_indices_raise_what_safetensors_raises(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": random_tensor((4, 6), torch.float32, 1)}, str(path))
    with asyncload.safe_open(path) as f, st_safe_open(str(path), "pt") as g:
        for ix in BAD_INDICES:
            before = f.stats.bytes_read
            with pytest.raises(Exception) as theirs:
                g.get_slice("w")[ix]
            with pytest.raises(type(theirs.value)):
                f.get_slice("w")[ix]
            if not isinstance(ix, float):  # a basic index is refused before any read
                assert f.stats.bytes_read == before, ix


@pytest.mark.timeout(60)
def test_row_block_is_one_read_and_columns_stay_under_the_bound(tmp_path: Path) -> None:
    w = random_tensor((256, 256), torch.float32, 2)
    sd = {"a": random_tensor((1000,), torch.float32, 3), "w": w, "z": torch.ones(64)}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    with asyncload.safe_open(path) as f:
        s = f.get_slice("w")
        before = f.stats
        same(s[10:74], w[10:74], "rows")
        after = f.stats
        assert after.bytes_read - before.bytes_read == 64 * 256 * 4
        assert after.chunks - before.chunks == 1
        before = after
        same(s[:, 32:48], w[:, 32:48], "columns")
        after = f.stats
        need = 256 * 16 * 4
        assert need <= after.bytes_read - before.bytes_read <= 1.15 * need + 1
        assert after.chunks - before.chunks < 256  # neighbours joined within the bound


@pytest.mark.timeout(60)
def test_big_tensor_in_chunks_within_the_budget(tmp_path: Path) -> None:
    w = random_tensor((512, 512), torch.bfloat16, 4)
    path = tmp_path / "model.safetensors"
    save_file({"w": w}, str(path))
    opts = LoadOptions(chunk_size=8192, min_chunk_size=1024, memory_budget=64 << 10, concurrency=4)
    with asyncload.safe_open(path, options=opts) as f:
        same(f.get_tensor("w"), w, "w")
        same(f.get_slice("w")[100:300, 7], w[100:300, 7], "column")
        stats = f.stats
        assert stats.chunks >= w.numel() * 2 // 8192
        assert 0 < stats.peak_buffered_bytes <= 64 << 10
        assert 0 < stats.peak_concurrency <= 4


@pytest.mark.timeout(60)
def test_unknown_key_is_a_key_error_naming_the_closest(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"layers.0.weight": torch.zeros(2), "layers.0.bias": torch.zeros(2)}, str(path))
    with asyncload.safe_open(path) as f:
        for call in (f.get_tensor, f.get_slice):
            with pytest.raises(KeyError) as info:
                call("layers.0.weigth")
            assert isinstance(info.value, StateDictMismatchError)
            msg = str(info.value)
            assert "'layers.0.weigth'" in msg and "'layers.0.weight'" in msg, msg
        with pytest.raises(KeyError, match="e.g."):
            f.get_tensor("zzz")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "blob, match",
    [
        (b"\x01\x02", "too small"),
        (st_blob(GOOD, bytes(16), length=1 << 40), "exceeds"),
        (st_blob(GOOD, bytes(16), length=10_000), "runs past the end"),
        (st_blob(None, bytes(16), raw_header=b"[1, 2]"), "not start with"),
        (
            st_blob(
                None,
                bytes(32),
                raw_header=b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, '
                b'"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}}',
            ),
            "duplicate key",
        ),
        (st_blob(GOOD, bytes(8)), "outside"),
        (
            st_blob({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(16)),
            "needs",
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
    ],
)
def test_hostile_header_is_a_format_error(tmp_path: Path, blob: bytes, match: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    before = live_threads()
    with pytest.raises(CheckpointFormatError, match=match):
        asyncload.safe_open(path)
    assert asyncload_threads(ignore=before) == []  # closed on the way out


@pytest.mark.timeout(60)
def test_truncated_file_is_an_error_never_garbage(tmp_path: Path) -> None:
    sd = {
        "a": random_tensor((64, 64), torch.float32, 5),
        "b": random_tensor((64,), torch.int64, 6),
    }
    raw = st_save(sd)
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointFormatError):
        asyncload.safe_open(path)
    # cut while open: the bytes that are gone are an error, and so are those still there
    path.write_bytes(raw)
    with st_safe_open(str(path), framework="pt") as g:
        first, last = g.offset_keys()[0], g.offset_keys()[-1]
    with asyncload.safe_open(path) as f:
        same(f.get_tensor(last), sd[last], last)
        os.truncate(path, len(raw) - 10)
        with pytest.raises(AsyncLoadError):
            f.get_tensor(last)
        with pytest.raises(CheckpointChangedError):
            f.get_slice(first)[:2]


@pytest.mark.timeout(60)
def test_missing_file_and_refused_arguments(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        asyncload.safe_open(tmp_path / "none.safetensors")
    with pytest.raises(FileNotFoundError):
        asyncload.safe_open(tmp_path / "none.safetensors")
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    for framework in ("np", "tf", "flax"):
        with pytest.raises(ValueError, match="framework"):
            asyncload.safe_open(path, framework)
    for device in ("meta", "mps", "cpu:x", object()):
        with pytest.raises(ValueError, match="device"):
            asyncload.safe_open(path, "pt", device)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            asyncload.safe_open(path, "pt", "cuda")
    with pytest.raises(TypeError):
        asyncload.safe_open(path, options={"chunk_size": 1})  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_closed_on_exit(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6.0)}, str(path))
    before = live_threads()
    with asyncload.safe_open(path) as f:
        s = f.get_slice("w")
        same(s[1:3], torch.arange(6.0)[1:3], "w")
    assert asyncload_threads(ignore=before) == []
    for use in (f.keys, f.metadata, lambda: f.get_tensor("w"), lambda: s[0]):
        with pytest.raises(ValueError, match="closed"):
            use()
    f.close()  # again: nothing
    g = asyncload.safe_open(path)  # without ``with``: close() does it
    same(g.get_tensor("w"), torch.arange(6.0), "w")
    g.close()
    assert asyncload_threads(ignore=before) == []


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_device(tmp_path: Path) -> None:
    w = random_tensor((32, 16), torch.bfloat16, 7)
    path = tmp_path / "model.safetensors"
    save_file({"w": w}, str(path))
    with asyncload.safe_open(path, device="cuda:0") as f:
        t = f.get_slice("w")[4:8]
        assert t.device.type == "cuda"
        same(t, w[4:8], "w")


# --- remote files -----------------------------------------------------------------------------

REMOTE_DTYPES = [
    d
    for d in (torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.uint8)
    if d in ST_DTYPES
] + [d for d in ST_DTYPES if d.itemsize == 1 and d.is_floating_point][:1]


def _data_ranges(log: list[Any], name: str) -> list[tuple[int, int]]:
    out = []
    for e in log:
        if e.range and urllib.parse.unquote(e.path).endswith(name):
            lo, _, hi = e.range.split("=", 1)[1].partition("-")
            out.append((int(lo), int(hi) + 1))
    return out


@pytest.mark.timeout(180)
def test_http_matches_safetensors_and_reads_only_the_slice(
    tmp_path: Path, http_server: Any, bucket_name: str, fault_proxy: Any
) -> None:
    sd = file_state(1, REMOTE_DTYPES)
    w = random_tensor((256, 128), torch.float32, 8)
    sd["w"] = w
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path), metadata=METADATA)
    http_server.put_object(bucket_name, "m/model.safetensors", path.read_bytes())
    proxy = fault_proxy(http_server)
    url = http_server.url(bucket_name, "m/model.safetensors", endpoint_url=proxy.endpoint_url)
    header_end = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    with asyncload.safe_open(url) as f:
        opened = len(_data_ranges(proxy.log, "model.safetensors"))
        assert opened in (1, 2)  # the header (and the size), once
        s = f.get_slice("w")
        before = f.stats.bytes_read
        same(s[40:72], w[40:72], "rows")
        ranges = _data_ranges(proxy.log, "model.safetensors")[opened:]
        loc_start = ranges[0][0]
        assert len(ranges) == 1 and ranges[0][1] - ranges[0][0] == 32 * 128 * 4
        assert f.stats.bytes_read - before == 32 * 128 * 4
        before = f.stats.bytes_read
        same(s[:, 8:24], w[:, 8:24], "columns")
        assert 256 * 16 * 4 <= f.stats.bytes_read - before <= 1.15 * 256 * 16 * 4 + 1
        assert loc_start > header_end
        compare(f, path)
        later = _data_ranges(proxy.log, "model.safetensors")[opened:]
        assert all(lo >= header_end for lo, _ in later)  # the header was read once
    assert wait_closed(proxy.port) == []  # the storage is closed on exit


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["fsspec", "wire"])
def test_s3_matches_safetensors(
    tmp_path: Path, s3_server: Any, bucket_name: str, transport: str
) -> None:
    sd = file_state(2, REMOTE_DTYPES[:3])
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path), metadata=METADATA)
    s3_server.put_object(bucket_name, "x/model.safetensors", path.read_bytes())
    url = f"s3://{bucket_name}/x/model.safetensors"
    with asyncload.safe_open(
        url, storage_options=s3_server.storage_options(), options=LoadOptions(transport=transport)
    ) as f:
        compare(f, path, indices=INDICES[::3])
    with pytest.raises(CheckpointNotFoundError):
        asyncload.safe_open(
            f"s3://{bucket_name}/x/none.safetensors", storage_options=s3_server.storage_options()
        )


@pytest.mark.timeout(120)
def test_remote_reads_retry_and_stay_on_the_version_first_seen(
    tmp_path: Path, http_server: Any, bucket_name: str, fault_proxy: Any
) -> None:
    """The storage boundary of a load: a 503 is retried (counted), and an object replaced
    after the header was read is a CheckpointChangedError, not a mix of two files."""
    w = random_tensor((64, 32), torch.float32, 9)
    blob = st_save({"w": w})
    http_server.put_object(bucket_name, "v/model.safetensors", blob)
    proxy = fault_proxy(http_server)
    url = http_server.url(bucket_name, "v/model.safetensors", endpoint_url=proxy.endpoint_url)
    opts = LoadOptions(backoff=0.01, max_backoff=0.05, transport="wire")
    with asyncload.safe_open(url, options=opts) as f:
        rule = proxy.add_rule(status(503), range_only=True, times=2)
        same(f.get_slice("w")[8:16], w[8:16], "rows")
        assert rule.fired == 2 and f.stats.retries == 2
        http_server.put_object(bucket_name, "v/model.safetensors", st_save({"w": w + 1}))
        with pytest.raises(CheckpointChangedError):
            f.get_tensor("w")
    assert wait_closed(proxy.port) == []


@pytest.mark.timeout(60)
def test_threads_share_one_open_file(tmp_path: Path) -> None:
    """Loader threads (a tensor-parallel loader's) read slices of one open file at once."""
    from concurrent.futures import ThreadPoolExecutor

    w = random_tensor((64, 48), torch.float16, 10)
    path = tmp_path / "model.safetensors"
    save_file({"w": w, "b": torch.arange(48)}, str(path))
    with asyncload.safe_open(path) as f, ThreadPoolExecutor(4) as pool:
        s = f.get_slice("w")
        parts = list(pool.map(lambda r: s[r * 8 : (r + 1) * 8, r : r + 16], range(8)))
        tensors = list(pool.map(f.get_tensor, ["b"] * 8))
    for r, part in enumerate(parts):
        same(part, w[r * 8 : (r + 1) * 8, r : r + 16], f"rank {r}")
    for t in tensors:
        same(t, torch.arange(48), "b")


@pytest.mark.timeout(120)
def test_safe_open_imports_only_what_it_needs(tmp_path: Path) -> None:
    """In a fresh process, ``asyncload.safe_open`` (open, a slice, a whole tensor, a missing
    key) imports neither ``torch.distributed.checkpoint`` nor a load's planning, nor the
    formats it does not read (its first call paid 0.76 s for them)."""
    import subprocess
    import sys

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(path))
    code = f"""
import sys, torch, asyncload
with asyncload.safe_open({str(path)!r}) as f:
    assert torch.equal(f.get_slice("w")[1:], torch.arange(4.0, 12.0).reshape(2, 4))
    assert torch.equal(f.get_tensor("w"), torch.arange(12.0).reshape(3, 4))
    try:
        f.get_tensor("v")
    except KeyError:
        pass
banned = ("torch.distributed.checkpoint", "asyncload.engine.session", "asyncload.engine.records",
          "asyncload.formats.entries", "asyncload.formats.torchsave", "asyncload.decoding")
print(sorted(m for m in sys.modules if m.startswith(banned)))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=100
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.timeout(120)
def test_backend_keyword_as_safetensors_takes_it(tmp_path: Path) -> None:
    """``backend=`` (safetensors 0.8, keyword-only): ``"mmap"`` and ``"pread"`` give what
    safetensors gives; another value is refused as safetensors refuses it."""
    path = tmp_path / "model.safetensors"
    state = file_state(3)
    save_file(state, str(path))
    for backend in ("mmap", "pread"):
        with (
            asyncload.safe_open(path, framework="pt", device="cpu", backend=backend) as f,
            st_safe_open(str(path), framework="pt", device="cpu", backend=backend) as g,
        ):
            names = list(g.keys())
            assert list(f.keys()) == names
            for name in names:
                same(f.get_tensor(name), g.get_tensor(name), name)
    with pytest.raises(ValueError, match="backend='xx' is invalid"):
        asyncload.safe_open(path, framework="pt", backend="xx")
    with pytest.raises(Exception, match="backend"):
        st_safe_open(str(path), framework="pt", backend="xx")


@pytest.mark.timeout(240)
def test_transformers_from_pretrained_through_asyncload_safe_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' ``from_pretrained`` calls ``safe_open(file, framework="pt",
    device="cpu", backend="mmap")`` (its ``modeling_utils`` imports the name): with
    asyncload's in its place, every call goes through asyncload and the model's logits equal
    those of safetensors' own, bit for bit (a sharded checkpoint with tied embeddings)."""
    import transformers
    import transformers.modeling_utils as mu

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    src = transformers.LlamaForCausalLM(config)
    src.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))

    want_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m")
    calls: list[dict[str, Any]] = []

    def ours(file: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(dict(kwargs))
        return asyncload.safe_open(file, *args, **kwargs)

    monkeypatch.setattr(mu, "safe_open", ours)
    got_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m")
    monkeypatch.undo()
    assert calls and any(c.get("backend") == "mmap" for c in calls), calls
    with torch.no_grad():
        want = want_model(ids).logits
        got = got_model(ids).logits
    same(got, want, "logits")
    for (name, a), (_, b) in zip(got_model.state_dict().items(), want_model.state_dict().items()):
        same(a, b, name)
