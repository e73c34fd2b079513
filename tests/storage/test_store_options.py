"""The remote transports (``LoadOptions.transport``): which ``storage_options`` map onto the
wire transport (:mod:`asyncload.storage.store_options`) and which read through fsspec, the
choice ``open_storage`` makes (``"auto"`` says when it falls back; ``"obstore"`` is deprecated
and reads as ``"auto"``), S3 addressing as botocore's (no request reaches another bucket),
reads of exactly their bytes, versions pinned and compared, no retries but asyncload's, and a
cancelled or timed-out read that leaves no connection or task behind. Real servers on
loopback. (These were obstore's tests; obstore is retired.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import pytest_asyncio
from _remote import BACKENDS, wait_closed

import asyncload
from asyncload import ChunkTimeoutError, LoadOptions, StorageReadError
from asyncload.common.stats import StatsRecorder
from asyncload.storage import (
    FsspecStorage,
    LocalStorage,
    ObjectChangedError,
    RangeIgnoredError,
    RetryingStorage,
    ShortReadError,
    Unmappable,
    plan_store,
)
from asyncload.storage import open_storage as open_storage_
from asyncload.storage.wire import WireStorage
from asyncload.testing import HTTPRangeServer, delay, reset, stall, status

pytestmark = pytest.mark.timeout(60)

DATA = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-transport")
    yield pool
    pool.shutdown(wait=True)


def _remote(
    request: pytest.FixtureRequest, backend: str, bucket: str, fault_proxy: Any, data: bytes = DATA
):
    """``(url, storage_options, proxy, server)`` of ``bucket/ckpt/f.bin`` holding ``data``, through a proxy."""
    server = request.getfixturevalue(f"{backend}_server")
    server.put_object(bucket, "ckpt/f.bin", data)
    proxy = fault_proxy(server)
    if backend == "http":
        return (
            server.url(bucket, "ckpt", endpoint_url=proxy.endpoint_url),
            server.storage_options(),
            proxy,
            server,
        )
    return (
        f"{server.protocol}://{bucket}/ckpt",
        server.storage_options(endpoint_url=proxy.endpoint_url),
        proxy,
        server,
    )


def _boundary(raw: Any, executor: Any, **opts: Any) -> tuple[RetryingStorage, StatsRecorder]:
    stats = StatsRecorder()
    options = LoadOptions(
        **{"retries": 3, "backoff": 0, "max_backoff": 0, "timeout": 30.0, "hedge": False, **opts}
    )
    return RetryingStorage.for_options(raw, options, stats, executor), stats


# -- option mapping ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "url,options,kind,config,client",
    [
        (
            "s3://b/ckpt/step-1",
            {
                "endpoint_url": "http://127.0.0.1:9000",
                "key": "k",
                "secret": "s",
                "skip_instance_cache": True,
            },
            "s3",
            {"endpoint": "http://127.0.0.1:9000", "access_key_id": "k", "secret_access_key": "s"},
            {},
        ),
        (
            "s3://b/ckpt",
            {
                "anon": True,
                "client_kwargs": {
                    "endpoint_url": "https://minio:9000",
                    "region_name": "eu-west-1",
                },
            },
            "s3",
            {"skip_signature": True, "endpoint": "https://minio:9000", "region": "eu-west-1"},
            {},
        ),
        (
            "s3://b/ckpt",
            {
                "key": "k",
                "secret": "s",
                "token": "t",
                "requester_pays": True,
                "config_kwargs": {
                    "max_pool_connections": 64,
                    "retries": {"total_max_attempts": 3},
                    "connect_timeout": 2,
                    "s3": {"addressing_style": "virtual"},
                },
            },
            "s3",
            {"session_token": "t", "request_payer": True, "virtual_hosted_style_request": True},
            {},
        ),
        (
            "gs://b/ckpt",
            {"endpoint_url": "http://127.0.0.1:4443", "token": "anon", "project": "test"},
            "gcs",
            {"base_url": "http://127.0.0.1:4443", "skip_signature": True},
            {},
        ),
        (
            "http://127.0.0.1:8000/ckpt/",
            {
                "headers": {"Authorization": "Bearer x"},
                "client_kwargs": {"headers": {"X-A": 1}},
                "simple_links": True,
            },
            "http",
            {},
            {"default_headers": {"X-A": "1", "Authorization": "Bearer x"}},
        ),
    ],
    ids=["s3-endpoint-key-secret", "s3-anon-client-kwargs", "s3-token-config-kwargs", "gcs-anon",
         "http"],
)  # fmt: skip
def test_storage_options_map_onto_the_wire_transport(
    monkeypatch, url, options, kind, config, client
) -> None:
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    spec = plan_store(url, options)
    assert spec.kind == kind
    assert config.items() <= spec.config.items(), spec.config
    assert client.items() <= spec.client_options.items(), spec.client_options
    if kind == "s3":
        assert (spec.bucket, spec.config["region"]) == ("b", config.get("region", "us-east-1"))
    if kind == "http":
        assert spec.url == url.rstrip("/")
    else:
        assert spec.prefix == url.split("://", 1)[1].split("/", 1)[1]
    assert "secret_access_key" not in repr(spec) and "Bearer" not in repr(spec)  # never shown


def test_a_ca_bundle_becomes_root_certificates(monkeypatch, tmp_path) -> None:
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    (tmp_path / "ca.pem").write_text(pem)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    spec = plan_store("s3://b/c", {"key": "k", "secret": "s", "endpoint_url": "https://h"})
    assert spec.client_options["root_certificate"] == pem
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with pytest.raises(Unmappable, match="missing.pem"):
        plan_store("s3://b/c", {"key": "k", "secret": "s", "endpoint_url": "https://h"})


@pytest.mark.parametrize(
    "url,options,named",
    [
        ("s3://b/c", {"session": object()}, "'session'"),
        (
            "s3://b/c",
            {
                "key": "k",
                "secret": "s",
                "client_kwargs": {"endpoint_url": "http://h", "proxies": {}},
            },
            "proxies",
        ),
        (
            "s3://b/c",
            {
                "key": "k",
                "secret": "s",
                "endpoint_url": "http://h",
                "config_kwargs": {"tcp_keepalive": True},
            },
            "tcp_keepalive",
        ),
        ("s3://b/c", {"key": "k", "endpoint_url": "http://h"}, "without its secret"),
        (
            "s3://b/c",
            {"key": "k", "secret": "s", "endpoint_url": "http://h", "version_aware": True},
            "version_aware",
        ),
        ("s3://b/c", {"key": "k", "secret": "s"}, "no region"),
        ("s3://b/c?versionId=1", {}, "query"),
        ("gs://b/c", {"token": object()}, "token of type object"),
        ("gs://b/c", {"token": "anon", "requester_pays": True}, "requester_pays"),
        ("gs://b/c", {"token": "/no/such/key.json"}, "key file"),
        ("gs://b/c", {"token": "anon", "session_kwargs": {}}, "session_kwargs"),
        ("http://h/c", {"client_kwargs": {"timeout": 5}}, "timeout"),
        ("http://h/c", {"encoded": True}, "encoded"),
        ("memory://c", {}, "memory://"),
    ],
    ids=lambda v: v if isinstance(v, str) and "://" not in v and len(v) < 20 else None,
)
def test_options_wire_cannot_honour_are_named(monkeypatch, url, options, named) -> None:
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    with pytest.raises(Unmappable) as ei:
        plan_store(url, options)
    assert named in str(ei.value) and "obstore" not in str(ei.value)


@pytest.mark.parametrize("var", ["HTTPS_PROXY", "https_proxy", "ALL_PROXY"])
def test_the_proxy_of_the_environment_is_the_stores(monkeypatch, var) -> None:
    """A proxy variable that applies to the store's scheme and host is the wire transport's
    proxy (the reads go through it: tests/storage/test_wire_proxy.py); ``NO_PROXY`` naming the
    host lifts it; never shown with its password."""
    from asyncload.storage.wire import plan_wire

    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY",
                 "http_proxy", "NO_PROXY", "no_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, "http://user:secret@proxy.example:3128")
    opts = {"key": "k", "secret": "s", "endpoint_url": "https://minio.example"}
    for url, so in (("s3://b/c", opts), ("https://h.example/c", {})):
        spec = plan_wire(url, so)
        assert spec.proxy == "http://user:secret@proxy.example:3128"
        assert spec.proxy_source == var and "secret" not in repr(spec)
    monkeypatch.setenv("NO_PROXY", "minio.example,.h.example")
    assert plan_wire("s3://b/c", opts).proxy is None
    assert plan_wire("https://h.example/c", {}).proxy is None
    monkeypatch.delenv("NO_PROXY")
    # an https proxy variable does not apply to a plain-http store
    assert (plan_wire("http://h.example/c", {}).proxy is None) == (var != "ALL_PROXY")
    # s3fs' form wins over the environment
    so = {**opts, "config_kwargs": {"proxies": {"https": "http://other:3128"}}}
    assert plan_wire("s3://b/c", so).proxy == "http://other:3128"


# -- the choice ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_picks_wire_for_the_servers_options_and_fsspec_on_request(
    request, backend, executor
) -> None:
    from asyncload.storage.wire import WireStorage

    server = request.getfixturevalue(f"{backend}_server")
    url = server.url("bucket", "ckpt") if backend == "http" else f"{server.protocol}://bucket/ckpt"
    opts = server.storage_options()
    assert type(open_storage_(url, opts, executor)) is WireStorage
    assert type(open_storage_(url, opts, executor, transport="fsspec")) is FsspecStorage
    with pytest.warns(DeprecationWarning, match='transport="obstore" is deprecated'):
        assert type(open_storage_(url, opts, executor, transport="obstore")) is WireStorage


def test_auto_falls_back_to_fsspec_and_says_why(caplog, executor, tmp_path) -> None:
    opts = {
        "endpoint_url": "http://127.0.0.1:1",
        "key": "k",
        "secret": "s",
        "config_kwargs": {"tcp_keepalive": True},
    }
    with caplog.at_level(logging.INFO, logger="asyncload.storage"):
        storage = open_storage_("s3://b/ckpt", opts, executor)
    assert type(storage) is FsspecStorage
    assert storage.transport.startswith("fsspec (wire cannot honour: ") and "tcp_keepalive" in (
        storage.transport
    )
    assert any(
        "not wire" in r.getMessage() and "tcp_keepalive" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(StorageReadError) as ei:
        open_storage_("s3://b/ckpt", opts, executor, transport="wire")
    assert (
        "tcp_keepalive" in str(ei.value)
        and "transport='fsspec'" in str(ei.value)
        and ei.value.path == "s3://b/ckpt"
    )
    with pytest.warns(DeprecationWarning):  # "obstore" reads as "auto" does
        assert type(open_storage_("s3://b/ckpt", opts, executor, transport="obstore")) is (
            FsspecStorage
        )
    # not an object store: fsspec (or local) whatever the transport
    assert type(open_storage_("memory://x", {}, executor, transport="wire")) is FsspecStorage
    assert type(open_storage_(tmp_path, None, executor, transport="wire")) is LocalStorage


def test_load_stats_name_the_transport_and_why(http_server, tmp_path, monkeypatch) -> None:
    """``LoadStats.transport``: the client that read, and where "auto" fell back, why."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "src"
    d.mkdir()
    save_file({"x": torch.arange(8.0)}, str(d / "model.safetensors"))
    http_server.upload_dir(d, "stats-transport", "ckpt")
    url = http_server.url("stats-transport", "ckpt/model.safetensors")
    dst = {"x": torch.zeros(8)}
    assert asyncload.load(dst, url).transport == "wire"
    assert asyncload.load(dst, url, options=LoadOptions(transport="fsspec")).transport == "fsspec"
    stats = asyncload.load(dst, url, storage_options={"encoded": True})
    assert stats.transport.startswith("fsspec (wire cannot honour: ") and "encoded" in (
        stats.transport
    )
    assert torch.equal(dst["x"], torch.arange(8.0))
    assert asyncload.load(dst, d / "model.safetensors").transport == "local"


def test_transport_is_validated() -> None:
    assert LoadOptions().transport == "auto"
    with pytest.raises(ValueError, match=r"LoadOptions.transport='s3fs' is invalid"):
        LoadOptions(transport="s3fs")  # type: ignore[arg-type]


# -- reads --------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_read_returns_exactly_its_bytes_read_only(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    url, opts, _proxy, _ = _remote(request, backend, bucket_name, fault_proxy)
    raw = open_storage_(url, opts, executor, transport="wire")
    rs, stats = _boundary(raw, executor)
    try:
        direct = await raw.read("f.bin", 100, 5000)
        through = await rs.read("f.bin", 5000, 16384)
    finally:
        await rs.aclose()
    for mv, lo, hi in ((direct, 100, 5000), (through, 5000, 16384)):
        assert isinstance(mv, memoryview) and mv.format == "B" and bytes(mv) == DATA[lo:hi]
    assert stats.snapshot().bytes_read == 16384 - 5000


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_read_past_the_end_is_a_short_read(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    url, opts, _, _ = _remote(request, backend, bucket_name, fault_proxy)
    raw = open_storage_(url, opts, executor, transport="wire")
    try:
        with pytest.raises(ShortReadError) as ei:
            await raw.read("f.bin", len(DATA) - 10, len(DATA) + 10)
    finally:
        await raw.aclose()
    assert (ei.value.got, ei.value.start, ei.value.end) == (10, len(DATA) - 10, len(DATA) + 10)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_versions_pinned_and_every_answer_compared(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    url, opts, _, server = _remote(request, backend, bucket_name, fault_proxy)
    raw = open_storage_(url, opts, executor, transport="wire")
    assert isinstance(raw, WireStorage)
    try:
        assert await raw.size("f.bin") == len(DATA)
        seen = raw.pinned("f.bin")
        assert seen is not None and seen.split(" ", 1)[0] == (
            "generation" if backend == "gcs" else "etag"
        )
        assert bytes(await raw.read("f.bin", 0, 10)) == DATA[:10]
        if backend == "http":  # the Range server's ETag is mtime and size: change both
            await asyncio.sleep(0.01)
        server.put_object(bucket_name, "ckpt/f.bin", DATA[::-1] + b"x")
        with pytest.raises(ObjectChangedError) as ei:
            await raw.read("f.bin", 0, 10)
        with pytest.raises(ObjectChangedError):
            await raw.size("f.bin")
    finally:
        await raw.aclose()
    err = ei.value
    assert err.seen == seen and err.byte_range == (0, 10) and err.url.endswith("/ckpt/f.bin")
    # S3 and HTTP refuse the read (If-Match: 412); fake-gcs ignores it and the generation differs
    assert (err.now is None) == (backend != "gcs"), err


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["s3", "gcs"])
async def test_sizes_in_one_listing_pin_versions(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    server = request.getfixturevalue(f"{backend}_server")
    names = [f"__{i}_0.distcp" for i in range(5)]
    for i, n in enumerate(names):
        server.put_object(bucket_name, f"ckpt/{n}", bytes(i + 1))
    server.put_object(bucket_name, "ckpt/sub/deeper.bin", b"x")
    proxy = fault_proxy(server)
    raw = open_storage_(
        f"{server.protocol}://{bucket_name}/ckpt",
        server.storage_options(proxy.endpoint_url),
        executor,
        transport="wire",
    )
    try:
        assert await raw.sizes([*names, "missing"]) == {n: i + 1 for i, n in enumerate(names)}
        assert await raw.listdir() == sorted(names)
    finally:
        await raw.aclose()
    assert (
        sum(1 for e in proxy.log if e.method == "GET") == 2
    )  # one listing each, no HEAD per file
    assert all(raw.pinned(n) is not None for n in names)  # ETags; GCS JSON: generations


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["s3", "gcs"])
async def test_a_size_asked_while_the_listing_is_out_takes_the_first_answer(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    """The format probe asks whether a Hugging Face directory has an index while the listing
    that went out beside the ``.metadata`` GET is still on its way: the listing answers (its
    HEAD is held back here), so a name it lacks is missing without a round trip of its own;
    asked again, the store is asked; a name it has is its size, version pinned."""
    server = request.getfixturevalue(f"{backend}_server")
    server.put_object(bucket_name, "ckpt/model.safetensors", DATA)
    proxy = fault_proxy(server)
    held = proxy.add_rule(delay(0.3), method="HEAD", times=None)
    raw = open_storage_(
        f"{server.protocol}://{bucket_name}/ckpt",
        server.storage_options(proxy.endpoint_url),
        executor,
        transport="wire",
    )
    assert isinstance(raw, WireStorage)
    try:
        raw.prefetch_sizes()
        with pytest.raises(FileNotFoundError, match="is not in the listing of"):
            await raw.size("model.safetensors.index.json")
        assert await raw.size("model.safetensors") == len(DATA)
        assert (
            raw.pinned("model.safetensors") is not None or backend == "gcs"
        )  # GCS lists no generation
        with pytest.raises(FileNotFoundError) as again:  # once: now the store answers (a 404)
            await raw.size("model.safetensors.index.json")
    finally:
        await raw.aclose()
    assert "not in the listing" not in str(again.value)
    assert sum(1 for e in proxy.log if e.method == "GET") == 1  # the listing
    assert held.matched >= 1  # the HEAD that raced the listing went out, and lost


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["s3", "gcs"])
async def test_a_size_asked_while_the_listing_is_stalled_is_the_heads_answer(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    """The same question when the listing is the slow one: the HEAD answers, the listing is
    not waited for."""
    server = request.getfixturevalue(f"{backend}_server")
    server.put_object(bucket_name, "ckpt/model.safetensors", DATA)
    proxy = fault_proxy(server)
    proxy.add_rule(
        stall(None), method="GET", path=re.compile(r"list-type=2|delimiter="), times=None
    )
    raw = open_storage_(
        f"{server.protocol}://{bucket_name}/ckpt",
        server.storage_options(proxy.endpoint_url),
        executor,
        transport="wire",
    )
    try:
        raw.prefetch_sizes()
        assert await asyncio.wait_for(raw.size("model.safetensors"), 20) == len(DATA)
        with pytest.raises(FileNotFoundError) as ei:
            await asyncio.wait_for(raw.size("model.safetensors.index.json"), 20)
    finally:
        await raw.aclose()
    assert "not in the listing" not in str(ei.value)
    assert sum(1 for e in proxy.log if e.method == "HEAD") == 2


BIG = 64 << 20


@pytest_asyncio.fixture
async def range_ignoring(tmp_path, executor):
    """A loopback HTTP server that answers every ranged GET with the whole file (``big.bin``,
    64 MiB), and the wire transport's storage of it behind the error boundary: ``(storage, stats, server)``."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "big.bin").write_bytes(bytes(range(256)) * (BIG // 256))
    server = HTTPRangeServer(tmp_path, ignore_range=True)
    server.start()
    try:
        rs, stats = _boundary(
            open_storage_(f"{server.endpoint_url}/ckpt", {}, executor, transport="wire"),
            executor,
        )
        try:
            yield rs, stats, server
        finally:
            await rs.aclose()
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_a_server_that_ignores_range_is_refused_without_reading_the_body(
    range_ignoring,
) -> None:
    rs, stats, server = range_ignoring
    try:
        with pytest.raises(StorageReadError) as ei:
            await rs.read("big.bin", 1024, 5120)
    finally:
        await rs.aclose()
    assert type(ei.value.__cause__) is RangeIgnoredError and ei.value.status == 200
    assert "the server ignores Range requests" in str(ei.value) and ei.value.attempts == 1
    assert stats.snapshot().retries == 0
    logged: list[dict[str, Any]] = []
    for _ in range(600):  # the server logs a request when its handler ends
        logged = [r for r in server.requests() if r["path"].endswith("/big.bin")]
        if logged:
            break
        await asyncio.sleep(0.05)
    assert len(logged) == 1 and logged[0]["sent"] < BIG // 4, logged


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_files_first_bytes_and_size_come_in_one_get(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    """``read_prefix``: one ranged GET, no HEAD; the version pinned from its answer, as a
    HEAD would; a file shorter than asked, all of it; an empty file (no range fits it: a
    416), its size asked; a missing one, FileNotFoundError."""
    url, opts, proxy, server = _remote(request, backend, bucket_name, fault_proxy)
    server.put_object(bucket_name, "ckpt/small.bin", b"abc")
    server.put_object(bucket_name, "ckpt/empty.bin", b"")
    raw = open_storage_(url, opts, executor, transport="wire")
    rs, stats = _boundary(raw, executor)
    try:
        data, size = await rs.read_prefix("f.bin", 4096)
        assert isinstance(data, memoryview) and (bytes(data), size) == (DATA[:4096], len(DATA))
        assert raw.pinned("f.bin") is not None
        data, size = await raw.read_prefix("small.bin", 1 << 16)
        assert (bytes(data), size) == (b"abc", 3)
        assert [e.method for e in proxy.log] == ["GET", "GET"]
        data, size = await raw.read_prefix("empty.bin", 1 << 16)
        assert (bytes(data), size) == (b"", 0)
        assert [e.method for e in proxy.log][2:] == ["GET", "HEAD"]
        with pytest.raises(FileNotFoundError):
            await raw.read_prefix("missing.bin", 10)
        assert (
            bytes(await rs.read("f.bin", 4096, 8192)) == DATA[4096:8192]
        )  # the pinned version holds
        if backend == "http":  # the Range server's ETag is mtime and size: change both
            await asyncio.sleep(0.01)
        server.put_object(bucket_name, "ckpt/f.bin", DATA[::-1] + b"x")
        with pytest.raises(
            ObjectChangedError
        ):  # compared with the version the prefix's answer gave
            await raw.read("f.bin", 8192, 9000)
    finally:
        await rs.aclose()
    assert stats.snapshot().bytes_read == 8192


@pytest.mark.asyncio
async def test_a_prefix_from_a_server_that_ignores_range_is_refused(range_ignoring) -> None:
    rs, _, _ = range_ignoring
    with pytest.raises(StorageReadError) as ei:
        await rs.read_prefix("big.bin", 1 << 16)
    assert type(ei.value.__cause__) is RangeIgnoredError and ei.value.status == 200
    assert ei.value.byte_range == (0, 1 << 16) and ei.value.attempts == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_no_retries_but_asyncloads(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    url, opts, proxy, _ = _remote(request, backend, bucket_name, fault_proxy)
    raw = open_storage_(url, opts, executor, transport="wire")
    rule = proxy.add_rule(status(503), times=None, data_only=True)
    try:
        with pytest.raises(Exception, match="503"):
            await raw.read("f.bin", 0, 100)
    finally:
        await raw.aclose()
    assert rule.fired == 1  # one request: the client did not try again by itself
    rs, stats = _boundary(
        open_storage_(url, opts, executor, transport="wire"), executor, retries=2
    )
    try:
        with pytest.raises(StorageReadError) as ei:
            await rs.read("f.bin", 0, 100)
    finally:
        await rs.aclose()
    assert rule.fired == 1 + 3 and ei.value.status == 503 and ei.value.attempts == 3
    assert stats.snapshot().retries_by_cause == {"status_503": 2}


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_reset_is_retried_and_counted(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    url, opts, proxy, _ = _remote(request, backend, bucket_name, fault_proxy)
    rs, stats = _boundary(open_storage_(url, opts, executor, transport="wire"), executor)
    try:
        assert bytes(await rs.read("f.bin", 0, 100)) == DATA[:100]  # a pooled connection
        proxy.add_rule(reset(), times=1, data_only=True)
        assert bytes(await rs.read("f.bin", 100, 4000)) == DATA[100:4000]
    finally:
        await rs.aclose()
    assert proxy.faults_applied == 1
    assert stats.snapshot().retries_by_cause == {"connection": 1}


def _threads() -> int:
    return psutil.Process().num_threads()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_timed_out_and_cancelled_reads_leave_nothing(
    request, backend, bucket_name, fault_proxy, executor
) -> None:
    """A stalled read cancelled by asyncload's timeout (``asyncio.wait``) or by the caller:
    its connection closes at once, before the store is dropped; no task is left, and no
    thread is started per read."""
    url, opts, proxy, _ = _remote(request, backend, bucket_name, fault_proxy)
    raw = open_storage_(url, opts, executor, transport="wire")
    rs, stats = _boundary(raw, executor, timeout=0.3, retries=1)
    try:
        assert bytes(await rs.read("f.bin", 0, 10)) == DATA[:10]
        await asyncio.to_thread(lambda: None)  # the loop's default executor, for wait_closed below
        threads = _threads()
        rule = proxy.add_rule(stall(None), times=None, data_only=True)
        with pytest.raises(ChunkTimeoutError) as ei:
            await rs.read("f.bin", 0, 1000)
        assert ei.value.attempts == 2 and rule.fired == 2
        assert await asyncio.to_thread(wait_closed, proxy.port) == []  # the store is still open
        task = asyncio.ensure_future(raw.read("f.bin", 0, 1000))
        while rule.fired < 3:  # noqa: ASYNC110 - the proxy counts in its own thread
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(wait_closed, proxy.port) == []
        assert _threads() == threads
    finally:
        await rs.aclose()
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    snap = stats.snapshot()
    assert snap.timeouts == 2 and snap.retries_by_cause == {"timeout": 1}


# -- S3 addressing ------------------------------------------------------------------------


_ENDPOINTS = ["http://127.0.0.1:9000", "http://localhost:9000", "https://minio.example.com",
              "http://[::1]:9000", None]  # fmt: skip


@pytest.mark.parametrize("endpoint", _ENDPOINTS)
@pytest.mark.parametrize("style", ["virtual", "path", "auto", None])
@pytest.mark.parametrize("bucket", ["ckpt-bucket", "my.dotted.bucket"])
def test_addressing_is_botocores(monkeypatch, endpoint, style, bucket) -> None:
    """The URL of an object is the one botocore sends its GET to, for every addressing style,
    with and without ``endpoint_url`` (both ``config_kwargs={"s3": {...}}`` forms are the same
    dict), except one botocore quirk: a dotted bucket on an IP endpoint with
    ``addressing_style="virtual"`` (botocore makes ``my.dotted.bucket.127.0.0.1``, a host that
    names no server) stays in the path here."""
    import botocore.session
    from botocore.config import Config

    from asyncload.storage.wire import plan_wire

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    so: dict[str, Any] = {"key": "k", "secret": "s"}
    if style is not None:
        so["config_kwargs"] = {"s3": {"addressing_style": style}}
    if endpoint is not None:
        so["endpoint_url"] = endpoint
    ours = plan_wire(f"s3://{bucket}/run", so).object_url("model.safetensors")

    sent: list[str] = []

    class Sent(Exception):
        pass

    def record(request: Any, **_: Any) -> None:
        sent.append(request.url)
        raise Sent

    client = botocore.session.get_session().create_client(
        "s3",
        region_name="us-east-1",
        endpoint_url=endpoint,
        aws_access_key_id="k",
        aws_secret_access_key="s",
        config=Config(s3={"addressing_style": style} if style else {}),
    )
    client.meta.events.register("before-send", record)
    with pytest.raises(Sent):
        client.get_object(Bucket=bucket, Key="run/model.safetensors")
    theirs = sent[0]
    if endpoint is None:  # botocore's global endpoint for us-east-1; wire names the region
        theirs = theirs.replace("s3.amazonaws.com", "s3.us-east-1.amazonaws.com")
    quirk = (
        style == "virtual"
        and "." in bucket
        and endpoint is not None
        and ("127.0.0.1" in endpoint or "::1" in endpoint)
    )
    if quirk:
        assert (
            theirs.startswith(f"http://{bucket}.")
            and ours == f"{endpoint}/{bucket}/run/model.safetensors"
        )
    else:
        assert ours == theirs


def test_virtual_addressing_never_reads_another_bucket(
    s3_server, fault_proxy, bucket_name, tmp_path
) -> None:
    """``s3://BUCKET/PREFIX/model.safetensors`` with ``addressing_style="virtual"`` and an
    ``endpoint_url``: a bucket named like the prefix holds a decoy file of zeros. The load
    reads BUCKET's file, every request goes to BUCKET (path style on an IP endpoint, as
    botocore); on a named endpoint the bucket is in the host, and a host that does not resolve
    is an error naming it, with no request sent anywhere else."""
    import torch
    from safetensors.torch import save_file

    prefix = f"{bucket_name[:40].rstrip('-')}-run"
    want = {"x": torch.arange(64.0)}
    d, decoy = tmp_path / "real", tmp_path / "decoy"
    d.mkdir()
    decoy.mkdir()
    save_file(want, str(d / "model.safetensors"))
    save_file({"x": torch.zeros(64)}, str(decoy / "model.safetensors"))
    s3_server.upload_dir(d, bucket_name, prefix)
    s3_server.upload_dir(decoy, prefix, "")
    proxy = fault_proxy(s3_server)
    url = f"s3://{bucket_name}/{prefix}/model.safetensors"
    for style in ({"s3": {"addressing_style": "virtual"}}, {"s3": {"addressing_style": "path"}}):
        so = {**s3_server.storage_options(endpoint_url=proxy.endpoint_url), "config_kwargs": style}
        dst = {"x": torch.full((64,), -1.0)}
        stats = asyncload.load(dst, url, storage_options=so, options=LoadOptions(transport="wire"))
        assert stats.transport == "wire" and torch.equal(dst["x"], want["x"])
    assert proxy.log and all(e.path.startswith(f"/{bucket_name}/") for e in proxy.log), [
        e.path for e in proxy.log
    ]
    seen = proxy.requests_seen
    named = proxy.endpoint_url.replace("127.0.0.1", "localhost")
    so = {**s3_server.storage_options(endpoint_url=named),
          "config_kwargs": {"s3": {"addressing_style": "virtual"}}}  # fmt: skip
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(
            {"x": torch.zeros(64)}, url, storage_options=so,
            options=LoadOptions(transport="wire", retries=0),
        )  # fmt: skip
    assert f"{bucket_name}.localhost" in str(ei.value), str(ei.value)
    assert proxy.requests_seen == seen
