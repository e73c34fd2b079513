"""S3 listings parsed without DTDs or entity expansion (:func:`asyncload.storage.wire._s3_page`):
a ListObjectsV2 answer that declares an entity (a "billion laughs" within
``max_metadata_size``) is refused with ``CheckpointFormatError`` before anything is expanded, on
moto behind the fault proxy (which answers the listing), and parsing it costs a small multiple
of its own size."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import asyncload
from asyncload import LoadOptions
from asyncload.storage.wire import _s3_page
from asyncload.testing import faults

pytestmark = pytest.mark.timeout(120)


def _laughs(size: int) -> bytes:
    """A ListObjectsV2 page of about ``size`` bytes whose keys reference an entity that
    expands 64 KiB each time (expat's amplification guard lets 100x through: ~100 MiB here)."""
    head = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n'
        b'<!DOCTYPE ListBucketResult [<!ENTITY a "' + b"lol" * 21845 + b'">]>\n'
        b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<IsTruncated>false</IsTruncated>"
    )
    item = b"<Contents><Key>ckpt/&a;&a;&a;&a;</Key><Size>1</Size></Contents>"
    n = max(1, (size - len(head)) // len(item))
    return head + item * n + b"</ListBucketResult>"


def test_a_listing_with_a_dtd_is_refused_unexpanded():
    body = _laughs(900 << 10)
    tracemalloc.start()
    try:
        with pytest.raises(asyncload.CheckpointFormatError, match="declares a DTD or an entity"):
            _s3_page(body, "ckpt/", "s3://b/ckpt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(body), peak
    # a DOCTYPE without entities is refused too: S3 never sends one
    with pytest.raises(asyncload.CheckpointFormatError):
        _s3_page(b"<!DOCTYPE x><ListBucketResult/>", "", "s3://b/")
    # a plain listing still parses
    plain = (
        b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<IsTruncated>false</IsTruncated><Contents><Key>ckpt/a.bin</Key><Size>3</Size>"
        b"<ETag>&quot;e1&quot;</ETag></Contents></ListBucketResult>"
    )
    assert _s3_page(plain, "ckpt/", "s3://b/ckpt") == ([("a.bin", 3, "etag e1")], None)


def test_a_load_whose_listing_declares_entities_fails_as_a_format_error(
    s3_server, fault_proxy, bucket_name, tmp_path: Path
):
    """A safetensors directory without an index is found by listing it: the listing is the
    forged one, and the load fails with ``CheckpointFormatError``, never parses it."""
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"x": torch.arange(64.0)}, str(d / "model.safetensors"))
    url = s3_server.upload_dir(d, bucket_name, "ckpt")
    proxy = fault_proxy(s3_server)
    rule = proxy.add_rule(
        faults.status(200, body=_laughs(512 << 10)), path="list-type=2", times=None
    )
    opts = LoadOptions(transport="wire", retries=0, max_metadata_size=1 << 20)
    with pytest.raises(asyncload.CheckpointFormatError, match="declares a DTD or an entity"):
        asyncload.load(
            {"x": torch.zeros(64)},
            url,
            options=opts,
            storage_options=s3_server.storage_options(endpoint_url=proxy.endpoint_url),
        )
    assert rule.fired >= 1
