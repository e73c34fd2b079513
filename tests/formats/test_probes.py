"""The remote load's critical path before the data: ``.metadata`` in one GET where the
store's answer gives its size and version (wire), and each record's data read as soon
as its own header probes land instead of after every record's (a remote load of plain DCP
records, each needed whole). Loopback servers behind the FaultProxy; no timing decides a test."""

from __future__ import annotations

import logging
import shutil
import urllib.parse

import pytest
import torch
from _ckpt import assert_bitwise_equal, make_checkpoint, random_tensor, zeros_like_tree
from _corrupt import flip_byte, record_of
from _remote import BACKENDS, make_remote, no_unclosed_session_warnings, wait_closed
from torch.distributed.checkpoint import FileSystemWriter

import asyncload
from asyncload import CheckpointFormatError, LoadOptions

pytestmark = pytest.mark.timeout(90)

#: 24 records of 64 KiB and more (probed, not read whole: above min_chunk_size + probes), and
#: small ones (read whole with the probes)
OPTS = LoadOptions(
    chunk_size=64 << 10, min_chunk_size=8 << 10, concurrency=2, timeout=10.0, retries=2
)


def _state_dict() -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for i in range(24):
        sd[f"w{i}"] = random_tensor((64 + 8 * i, 256), torch.float32, 500 + i)
        sd[f"n{i}"] = random_tensor((256,), torch.bfloat16, 900 + i)
    return sd


@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    """dcp.save's one file per rank: every record in one .distcp."""
    sd = _state_dict()
    path = tmp_path_factory.mktemp("probes") / "ckpt"
    make_checkpoint(
        path, sd, storage_writer=FileSystemWriter(str(path), single_file_per_rank=True)
    )
    return path, sd


def _streamed(caplog) -> bool:
    return any(
        "streamed" in r.getMessage() for r in caplog.records if r.name == "asyncload.session"
    )


def _unquoted(path: str) -> str:
    return urllib.parse.unquote(path)  # a GCS client may escape every non-alphanumeric byte


def _large(entry) -> bool:
    lo, hi = (int(x) for x in entry.range.removeprefix("bytes=").split("-"))
    return hi + 1 - lo >= 32 << 10


@pytest.mark.parametrize("transport", ["fsspec", "wire"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_data_is_read_while_later_records_are_still_probed(
    request, backend, transport, one_file, bucket_name, fault_proxy, caplog
):
    path, sd = one_file
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd)
    caplog.set_level(logging.DEBUG, logger="asyncload.session")
    with no_unclosed_session_warnings():
        stats = asyncload.load(
            dst,
            r.url,
            options=OPTS.replace(transport=transport),
            storage_options=r.storage_options,
        )
    assert_bitwise_equal(dst, sd)
    assert _streamed(caplog)
    ranged = [
        e for e in r.proxy.log if e.range is not None and _unquoted(e.path).endswith(".distcp")
    ]
    probes = [i for i, e in enumerate(ranged) if not _large(e)]
    data = [i for i, e in enumerate(ranged) if _large(e)]
    assert probes and data
    # with 2 reads in flight, the first records' data goes out before the last probes
    assert data[0] < probes[-1], [e.range for e in ranged]
    assert stats.bytes_assembled == sum(t.numel() * t.element_size() for t in sd.values())
    assert wait_closed(r.proxy.port) == []


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_streamed_load_verifies_every_record(
    request, backend, one_file, bucket_name, fault_proxy, caplog
):
    path, sd = one_file
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd)
    caplog.set_level(logging.DEBUG, logger="asyncload.session")
    stats = asyncload.load(
        dst, r.url, options=OPTS.replace(verify=True), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)
    assert _streamed(caplog)
    assert stats.verified_records == len(sd)


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_streamed_load_names_a_damaged_record(
    request, backend, one_file, bucket_name, fault_proxy, tmp_path
):
    """A record whose header is damaged fails the load with the record named, though other
    records' data was being read (the planning error stops the pipeline)."""
    src, sd = one_file
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    victim = record_of(path, "w7")
    flip_byte(path / victim.file, victim.offset)  # the signature of its first local header
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd)
    with no_unclosed_session_warnings(), pytest.raises(CheckpointFormatError) as ei:
        asyncload.load(dst, r.url, options=OPTS, storage_options=r.storage_options)
    assert "'w7'" in str(ei.value)
    assert wait_closed(r.proxy.port) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_is_one_get_under_wire(request, backend, one_file, bucket_name, fault_proxy):
    path, sd = one_file
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd)
    asyncload.load(
        dst, r.url, options=OPTS.replace(transport="wire"), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)
    md = [e for e in r.proxy.log if _unquoted(e.path).endswith(".metadata")]
    assert [e.method for e in md] == ["GET"], md


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_larger_than_the_first_get_takes_one_more(
    request, backend, one_file, bucket_name, fault_proxy, monkeypatch
):
    """A ``.metadata`` longer than OBJECT_PREFIX: the first GET's bytes, then one more GET of
    the rest (conditional on the version the first pinned); bit-exact."""
    from asyncload.storage import wire as _wire

    path, sd = one_file
    size = (path / ".metadata").stat().st_size
    monkeypatch.setattr(_wire, "OBJECT_PREFIX", 1000)
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd)
    asyncload.load(
        dst, r.url, options=OPTS.replace(transport="wire"), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)
    md = [e for e in r.proxy.log if _unquoted(e.path).endswith(".metadata")]
    assert [(e.method, e.range) for e in md] == [
        ("GET", "bytes=0-999"),
        ("GET", f"bytes=1000-{size - 1}"),
    ]


@pytest.mark.parametrize("backend", ["s3", "http"])
def test_metadata_larger_than_the_limit_is_refused_before_its_body(
    request, backend, one_file, bucket_name, fault_proxy
):
    path, sd = one_file
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    size = (path / ".metadata").stat().st_size
    opts = OPTS.replace(transport="wire", max_metadata_size=size - 1)
    with pytest.raises(CheckpointFormatError, match="max_metadata_size"):
        asyncload.load(zeros_like_tree(sd), r.url, options=opts, storage_options=r.storage_options)
    # one GET of at most OBJECT_PREFIX bytes of .metadata, and no data read tried
    md = [e for e in r.proxy.log if _unquoted(e.path).endswith(".metadata")]
    assert [(e.method, e.range) for e in md] == [("GET", f"bytes=0-{size - 2}")]
    assert not any(e.range is not None for e in r.proxy.log if e not in md)
    # the refused answer's connection closes when the store goes: its bounded body is read to
    # its end (a body dropped unread kept its connection open for good about once in 30 runs
    # on a busy machine)
    assert wait_closed(r.proxy.port) == []


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_size_seen_once_is_not_asked_for_again(
    request, backend, bucket_name, fault_proxy, tmp_path
):
    """A safetensors directory: the file's size from the HEAD that found it (or from the
    listing started beside the ``.metadata`` GET) serves the size check before the reads
    (no second HEAD)."""
    from safetensors.torch import save_file

    sd = {f"t{i}": random_tensor((64, 64), torch.float32, 40 + i) for i in range(4)}
    path = tmp_path / "st"
    path.mkdir()
    save_file(sd, str(path / "model.safetensors"))
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    dst = zeros_like_tree(sd)
    asyncload.load(
        dst, r.url, options=OPTS.replace(transport="wire"), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)
    heads = [
        e
        for e in r.proxy.log
        if _unquoted(e.path).endswith("model.safetensors") and e.range is None
    ]
    assert len(heads) <= 1, heads
