"""The conformance matrix (issue 41 item 10): every layout a user saves (DCP one file and one
file per item, a safetensors file, a safetensors directory with its index, a torch.save
file), loaded by each transport (``wire``, ``fsspec``) from the real servers users run, which
the tests start themselves (installed by scripts/setup.sh and scripts/setup_servers.sh):

* ``nginx-http`` / ``nginx-https``: Debian's nginx, ``gzip on``, ``autoindex off``; https with a
  CA this module makes with ``openssl`` (given as ``storage_options`` ``ca_bundle=``);
* ``moto-signing``: moto's S3 server checking every signature (an IAM user's key);
* ``s3rver``: Node.js's s3rver (npm, into .s3rver/);
* ``gcs``: fake-gcs-server (the PyPI wrapper);
* ``proxy``: nginx reached only through a real forwarding proxy (``HTTP_PROXY``);
* ``faults``: moto behind the project's fault server, which answers 503, resets a connection
  and cuts a body short once each (retried).

The ``dcp-many-records`` layout: 48 records of 256 KiB to 1 MiB in one
``.distcp`` file, loaded with 4 read slots and requests of up to 4 MiB (:data:`JOINING`):
more large records than slots, each record's request smaller than the joined size, so
neighbouring guessed records share requests (``engine/streamed.py``, ``_Joiner``); each
cell also checks that the load made fewer requests than there are records.
:func:`test_a_damaged_record_inside_a_joined_request` damages one record's headers in the
middle of the file: the load fails with the typed error naming the file and the record's
byte range, the damaged bytes having come in a request shared with another record.

Each cell: bit for bit against torch's own read of the same bytes (a local copy: ``dcp.load``,
``safetensors.torch.load_file``, ``torch.load``), or, where :data:`EXPECTED` says so, a typed
error whose message names the fix. ``docs/remote.md`` shows the matrix as a table, kept equal to
:data:`EXPECTED` by :func:`test_docs_show_the_matrix`. One server per module; checkpoints of a
few KiB. A server that is not installed fails its rows (never skips): the message says how to
install it.

Also here, item 8: an S3 load with no credentials anywhere fails at once with an error that
says so and lists where it looked, the instance metadata service asked once.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, make_checkpoint, zeros_like_tree
from safetensors.torch import load_file, save_file
from test_wire_proxy import ForwardingProxy
from test_wire_tls import _make_ca

import asyncload
from asyncload import CheckpointFormatError, LoadOptions, StorageReadError
from asyncload.engine import streamed
from asyncload.testing import (
    FaultProxy,
    GCSServer,
    NginxServer,
    S3rverServer,
    ServerNotAvailableError,
    SigningS3Server,
    reset,
    status,
    truncate,
)

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ["wire", "fsspec"]
LAYOUTS = [
    "dcp-one-file",
    "dcp-file-per-item",
    "safetensors-file",
    "safetensors-index",
    "torch-save",
    "dcp-many-records",
]
MANY = "dcp-many-records"
SERVERS = [
    "nginx-http",
    "nginx-https",
    "moto-signing",
    "s3rver",
    "gcs",
    "proxy",
    "faults",
    "nginx-https-no-ca",
    "moto-wrong-secret",
]

#: The rows whose every cell is a typed error, ``(error type, words its message holds)``:
#: the words name the cause and the fix.
ERROR_ROWS: dict[str, tuple[type[Exception], tuple[str, ...]]] = {
    "nginx-https-no-ca": (StorageReadError, ("certificate", "ca_bundle=")),
    "moto-wrong-secret": (StorageReadError, ("SignatureDoesNotMatch", "secret")),
}

#: What a cell gives: "exact" (bit for bit), else ``(error type, words its message holds)``.
EXPECTED: dict[tuple[str, str, str], Any] = {
    (server, transport, layout): ERROR_ROWS.get(server, "exact")
    for server in SERVERS
    for transport in TRANSPORTS
    for layout in LAYOUTS
}

#: What each server row is, for the docs table.
SERVER_DOC = {
    "nginx-http": "nginx 1.22 (Debian), http, `gzip on`, `autoindex off`",
    "nginx-https": "nginx 1.22, https, a test CA given as `ca_bundle=`",
    "moto-signing": "moto's S3 server checking signatures (an IAM user's key)",
    "s3rver": "s3rver 3.7.1 (Node.js)",
    "gcs": "fake-gcs-server",
    "proxy": "nginx through a forwarding proxy (`HTTP_PROXY`)",
    "faults": "moto behind the fault server (a 503, a reset, a cut body; retried)",
    "nginx-https-no-ca": "nginx 1.22, https, no CA given",
    "moto-wrong-secret": "moto checking signatures, a wrong secret",
}

OPTS = LoadOptions(
    chunk_size=16 << 10, min_chunk_size=4 << 10, timeout=10, retries=3, backoff=0.01
)
#: The ``dcp-many-records`` layout's options: 4 read slots for its 48 records, requests of up
#: to 4 MiB, larger than any record: neighbouring records' requests are joined
#: (``streamed.join_limit`` > 0 and each record's request below it: ``_Joiner.fits``).
JOINING = OPTS.replace(chunk_size=4 << 20, concurrency=4)


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(41)
    return {
        "emb.weight": torch.randn(64, 96, generator=g),  # 24 KiB: several chunks
        "layer.0.w": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(32, generator=g).to(torch.float16),
        "layer.1.w": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


@functools.cache
def _many_records() -> dict[str, torch.Tensor]:
    """48 tensors of 256 KiB to 1 MiB, eight dtypes (each one record of the ``.distcp`` file:
    all large, none read whole). Made once; read only."""
    g = torch.Generator().manual_seed(46)
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.uint8,
        torch.float64,
        torch.int32,
        torch.bool,
    ]
    out: dict[str, torch.Tensor] = {}
    for i in range(48):
        dtype = dtypes[i % len(dtypes)]
        n = [256, 384, 512, 768, 1024][i % 5] * 1024 // dtype.itemsize
        if dtype.is_floating_point:
            t = torch.randn(n, generator=g).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, (n,), generator=g).bool()
        else:
            t = torch.randint(-100, 100, (n,), generator=g).to(dtype)
        out[f"layers.{i}.weight"] = t.reshape(-1, 64)
    return out


def _records(path: Path) -> list[Any]:
    """The records of a DCP checkpoint's data files (``offset``, ``length``,
    ``relative_path``), in file order."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return sorted(md.storage_data.values(), key=lambda r: (r.relative_path, r.offset))


def _reference(layout: str, path: Path, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """torch's own read of the local copy."""
    if layout.startswith("dcp"):
        dst = zeros_like_tree(want)
        dcp.load(dst, checkpoint_id=path, no_dist=True)
        return dst
    if layout == "safetensors-file":
        return load_file(str(path))
    if layout == "safetensors-index":
        out: dict[str, Any] = {}
        for shard in sorted(path.glob("*.safetensors")):
            out.update(load_file(str(shard)))
        return out
    return torch.load(path, weights_only=True)


def _write_layouts(root: Path, want: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each layout under ``root``; returns layout -> its path relative to ``root``."""
    from torch.distributed.checkpoint import FileSystemWriter

    make_checkpoint(root / "dcp-one-file", want)
    make_checkpoint(
        root / "dcp-file-per-item",
        want,
        storage_writer=FileSystemWriter(root / "dcp-file-per-item", single_file_per_rank=False),
    )
    (root / "st").mkdir()
    save_file(want, str(root / "st" / "model.safetensors"))
    d = root / "st-index"
    d.mkdir()
    keys = sorted(want)
    shards = {
        "model-00001-of-00002.safetensors": keys[:3],
        "model-00002-of-00002.safetensors": keys[3:],
    }
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: want[k] for k in ks}, str(d / name))
        weight_map.update(dict.fromkeys(ks, name))
    total = sum(want[k].numel() * want[k].element_size() for k in keys)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (root / "pt").mkdir()
    torch.save(want, root / "pt" / "model.pt")
    make_checkpoint(root / MANY, _many_records())
    assert len(list((root / MANY).glob("*.distcp"))) == 1
    return {
        "dcp-one-file": "dcp-one-file",
        "dcp-file-per-item": "dcp-file-per-item",
        "safetensors-file": "st/model.safetensors",
        "safetensors-index": "st-index",
        "torch-save": "pt/model.pt",
        MANY: MANY,
    }


def _started(server: Any) -> Any:
    """``server`` started; a missing program fails (never skips) with how to install it."""
    try:
        return server.start()
    except ServerNotAvailableError as exc:
        pytest.fail(f"{exc} (bash scripts/setup_servers.sh installs the matrix's servers)")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict]:
    root = tmp_path_factory.mktemp("conformance")
    want = _state_dict()
    return root, _write_layouts(root, want), want


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def nginx(layouts, tls) -> Iterator[NginxServer]:
    root, _, _ = layouts
    server = NginxServer(root, tls=(tls[1], tls[2]))
    _started(server)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moto(layouts) -> Iterator[SigningS3Server]:
    server = _started(SigningS3Server())
    server.upload_dir(layouts[0], "conformance", "")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3rver(layouts) -> Iterator[S3rverServer]:
    server = _started(S3rverServer())
    server.upload_dir(layouts[0], "conformance", "")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gcs(layouts) -> Iterator[GCSServer]:
    server = _started(GCSServer())
    server.upload_dir(layouts[0], "conformance", "")
    yield server
    server.stop()


@pytest.fixture
def where(request, layouts, tls, monkeypatch) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """``(url, storage_options, check after the load)`` for this cell's server and layout."""
    server, layout = request.getfixturevalue("server"), request.getfixturevalue("layout")
    rel = layouts[1][layout]
    if server in ("nginx-http", "nginx-https", "proxy", "nginx-https-no-ca"):
        nginx = request.getfixturevalue("nginx")
        url = nginx.url("", rel, https=server.startswith("nginx-https"))
        options = {"ca_bundle": str(tls[0])} if server == "nginx-https" else {}
        if server != "proxy":
            yield url, options, None
            return
        proxy = ForwardingProxy()
        for name in (
            "NO_PROXY",
            "no_proxy",
            "HTTPS_PROXY",
            "https_proxy",
            "ALL_PROXY",
            "all_proxy",
        ):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url())
        try:
            yield url, options, lambda: proxy.seen
        finally:
            proxy.close()
        return
    if server in ("moto-signing", "s3rver", "gcs", "moto-wrong-secret"):
        fixture = {"s3rver": "s3rver", "gcs": "gcs"}.get(server, "moto")
        store = request.getfixturevalue(fixture)
        options = store.storage_options()
        if server == "moto-wrong-secret":
            options["secret"] = "not-" + options["secret"]
        yield store.url("conformance", rel), options, None
        return
    assert server == "faults"
    store = request.getfixturevalue("moto")
    proxy = FaultProxy(store).start()
    proxy.add_rule(status(503), data_only=True, times=1)
    proxy.add_rule(reset(after_bytes=100), data_only=True, skip=1, times=1)
    proxy.add_rule(truncate(100), data_only=True, skip=2, times=1)
    try:
        yield (
            store.url("conformance", rel),
            store.storage_options(endpoint_url=proxy.endpoint_url),
            lambda: [r.fired for r in proxy.rules],
        )
    finally:
        proxy.stop()


def _cells() -> Iterator[Any]:
    for server in SERVERS:
        for transport in TRANSPORTS:
            for layout in LAYOUTS:
                yield pytest.param(server, transport, layout, id=f"{server}-{transport}-{layout}")


@pytest.fixture
def first_headers_waited(monkeypatch) -> None:
    """The first record's headers waited for however long they take (a loaded machine may
    answer after the engine's bound, and then probes more records: right, but records
    probed are not joined, which the request counts here pin)."""
    monkeypatch.setattr(streamed, "guess_wait", lambda storage: 60.0)


@pytest.mark.parametrize(("server", "transport", "layout"), list(_cells()))
def test_matrix(request, server, transport, layout, layouts, where) -> None:
    root, rels, want = layouts
    url, storage_options, check = where
    if layout == MANY:
        want = _many_records()
        request.getfixturevalue("first_headers_waited")
    reference = _reference(layout, root / rels[layout], want)
    assert_bitwise_equal(reference, want)  # torch's read of the local copy: what was saved
    dst = zeros_like_tree(reference)
    expected = EXPECTED[server, transport, layout]
    options = (JOINING if layout == MANY else OPTS).replace(transport=transport)
    if expected != "exact":
        kind, words = expected
        with pytest.raises(kind) as info:
            asyncload.load(dst, url, options=options, storage_options=storage_options)
        for word in words:
            assert word in str(info.value)
        return
    stats = asyncload.load(dst, url, options=options, storage_options=storage_options)
    assert_bitwise_equal(dst, reference)
    assert stats.transport.startswith(transport), stats.transport
    if server == "proxy":
        assert check(), "nothing went through the proxy"
        assert all(line.split(" ")[1].startswith("http://127.0.0.1:") for line in check())
    if server == "faults":
        assert check() == [1, 1, 1]
        assert stats.retries >= 2  # the first read of a small file may serve every tensor
    if layout == MANY:
        # joined: more records than read slots, each record's request below the joined size
        records = _records(root / rels[layout])
        limit = streamed.join_limit(records, options.chunk_size, options.max_in_flight)
        assert len(records) == 48 > options.max_in_flight
        assert max(r.length for r in records) < limit, limit
        # so the load went out in fewer requests than there are records
        assert stats.chunks < len(records), stats


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_damaged_record_inside_a_joined_request(
    transport, layouts, tmp_path, first_headers_waited
) -> None:
    """One record's zip header in the middle of the many-records file flipped: the load
    fails with the typed error naming the file and the record's byte range (as a guessed
    record's damaged headers do, tests/storage/test_guessed_records.py), never loads; the
    record's bytes came in a request shared with another record. nginx over http."""
    root, rels, _ = layouts
    copy = tmp_path / "served" / "damaged"
    shutil.copytree(root / rels[MANY], copy)
    records = _records(copy)
    bad = records[30]  # well after the first record and the speculated ones
    data = copy / bad.relative_path
    raw = bytearray(data.read_bytes())
    assert raw[bad.offset : bad.offset + 4] == b"PK\x03\x04"  # a zip local header
    for i in range(bad.offset, bad.offset + 4):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    server = _started(NginxServer(tmp_path / "served"))
    try:
        dst = zeros_like_tree(_many_records())
        with pytest.raises(CheckpointFormatError) as info:
            asyncload.load(
                dst, server.url("", "damaged"), options=JOINING.replace(transport=transport)
            )
        served = server.requests()
    finally:
        server.stop()
    msg = str(info.value)
    lo, hi = bad.offset, bad.offset + bad.length
    assert data.name in msg and f"[{lo}, {hi})" in msg, msg
    ranges = []
    for r in served:
        if r["path"].endswith(".distcp") and r["range"]:
            a, b = r["range"].split("=", 1)[1].split("-")
            ranges.append((int(a), int(b) + 1))
    touching = [x for x in ranges if x[0] < hi and lo < x[1]]
    others = [r for r in records if r is not bad]
    assert any(
        any(x[0] < r.offset + r.length and r.offset < x[1] for r in others) for x in touching
    ), (touching, (lo, hi))


def test_nginx_is_configured_as_users_run_it(nginx, layouts) -> None:
    """The nginx rows test what they claim: a client asking for gzip gets a compressed 200
    with a weak ETag and Range ignored (what the transports must never ask for), a directory
    is not listed (403), and a load (each transport) asks for the bytes as stored."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", nginx.port, timeout=10)
    try:
        path = "/" + layouts[1]["safetensors-file"]
        conn.request("GET", path, headers={"Range": "bytes=0-7", "Accept-Encoding": "gzip"})
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 200
        assert answer.getheader("Content-Encoding") == "gzip"
        assert answer.getheader("ETag", "").startswith('W/"')
        conn.request("GET", "/st-index/")
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 403
    finally:
        conn.close()
    before = len(nginx.requests())
    _, rels, want = layouts
    for transport in TRANSPORTS:
        dst = zeros_like_tree(want)
        asyncload.load(
            dst,
            nginx.url("", rels["safetensors-index"]),
            options=OPTS.replace(transport=transport),
        )
        assert_bitwise_equal(dst, want)
    served = [r for r in nginx.requests()[before:] if r["range"]]
    # every ranged read of the loads: a 206 (or the 404 of a probe for .metadata in a
    # safetensors directory), never a compressed 200
    ours = [r for r in served if "gzip" not in (r["accept_encoding"] or "")]
    assert ours and {r["status"] for r in ours} <= {206, 404}, ours


# ---------------------------------------------------------------------------
# the table in docs/remote.md
# ---------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "remote.md"
BEGIN, END = "<!-- conformance matrix: begin -->", "<!-- conformance matrix: end -->"


def matrix_table() -> str:
    """The matrix as docs/remote.md shows it, made from :data:`EXPECTED`."""

    def cell(value: Any) -> str:
        if value == "exact":
            return "bit for bit"
        kind, words = value
        return f"`{kind.__name__}` ({', '.join(f'`{w}`' for w in words)})"

    head = ["server", "what it is", "transport", *LAYOUTS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for server in SERVERS:
        for t in TRANSPORTS:
            row = [f"`{server}`", SERVER_DOC[server], f"`{t}`"]
            row += [cell(EXPECTED[server, t, layout]) for layout in LAYOUTS]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def test_docs_show_the_matrix() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"docs/remote.md lacks {BEGIN} ... {END}"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == matrix_table(), (
        "docs/remote.md's matrix differs from EXPECTED: paste the output of "
        '`python -c \'import sys; sys.path[:0] = ["tests", "tests/storage"]; '
        "import test_conformance as t; print(t.matrix_table())'`"
    )


# ---------------------------------------------------------------------------
# item 8: no credentials anywhere
# ---------------------------------------------------------------------------
class _Metadata:
    """A loopback port standing in for the instance metadata service: ``"stall"`` accepts
    and never answers, ``"refuse"`` is closed. ``accepted``: connections made to it."""

    def __init__(self, mode: str) -> None:
        self.accepted = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        if mode == "refuse":
            self._sock.close()
        else:
            threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                if self._closed:  # accepted from the backlog after close(): drop it
                    conn.close()
                else:
                    self._held.append(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._sock.fileno() >= 0:  # count what waits in the backlog, unaccepted yet
                self._sock.setblocking(False)
                while True:
                    try:
                        conn, _ = self._sock.accept()
                    except OSError:
                        break
                    self.accepted += 1
                    conn.close()
            self._sock.close()
            for conn in self._held:
                conn.close()


@pytest.fixture
def no_credentials(tmp_path, monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["stall", "refuse"])
def test_no_credentials_anywhere(no_credentials, moto, monkeypatch, mode, transport) -> None:
    metadata = _Metadata(mode)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{metadata.port}")
    dst = {"emb.weight": torch.zeros(64, 96)}
    url = moto.url("conformance", "st/model.safetensors")
    try:
        with pytest.raises(StorageReadError) as info:
            asyncload.load(
                dst,
                url,
                options=OPTS.replace(transport=transport),
                storage_options={"endpoint_url": moto.endpoint_url},
            )
    finally:
        metadata.close()
    msg = str(info.value)
    assert "no AWS credentials were found" in msg
    for where in (
        "AWS_ACCESS_KEY_ID",
        "profile 'default'",
        "SSO",
        "web identity",
        "container",
        f"instance metadata at http://127.0.0.1:{metadata.port}",
        "asked once",
        "anon=True",
    ):
        assert where in msg, (where, msg)
    assert metadata.accepted == (1 if mode == "stall" else 0)  # asked once, not twice
    assert info.value.attempts == 1  # not retried
    assert not dst["emb.weight"].any()


def test_anonymous_still_allowed_without_credentials(no_credentials, monkeypatch) -> None:
    """``anon=True`` reads unsigned and never asks any source (plain moto serves it)."""
    from asyncload.testing import S3Server

    metadata = _Metadata("stall")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{metadata.port}")
    want = _state_dict()
    with S3Server() as s3:
        s3.create_bucket("anon")
        s3.client().put_object(
            Bucket="anon",
            Key="model.safetensors",
            Body=_safetensors_bytes(want),
            ACL="public-read",
        )
        dst = zeros_like_tree(want)
        for transport in TRANSPORTS:
            asyncload.load(
                dst,
                "s3://anon/model.safetensors",
                options=OPTS.replace(transport=transport),
                storage_options={"endpoint_url": s3.endpoint_url, "anon": True},
            )
            assert_bitwise_equal(dst, want)
            dst = zeros_like_tree(want)
    metadata.close()
    assert metadata.accepted == 0


def _safetensors_bytes(want: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(want)
