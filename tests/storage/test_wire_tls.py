"""TLS per store (issue 41 item 5): a CA the test makes signs the certificate of a TLS front on
127.0.0.1 (in front of the HTTP Range server and moto); the CA is given per store
(``storage_options`` ``ca_bundle=``, ``verify=PATH``, S3's ``client_kwargs={"verify": PATH}``)
or by the scheme's variable (``REQUESTS_CA_BUNDLE`` for https://, ``AWS_CA_BUNDLE`` for s3://);
``verify=False`` turns checking off with one warning; without a CA the error names the knobs of
its own scheme. Every transport, bit for bit."""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import asyncload
from asyncload import LoadOptions, StorageReadError

pytestmark = pytest.mark.timeout(120)

WANT = {"x": torch.arange(1000.0), "y": torch.ones(8, 8)}


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in WANT.items()}


def _ok(dst: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(dst[k], WANT[k]) for k in WANT)


def _make_ca(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a leaf for 127.0.0.1 / localhost that it signs: (ca.pem, leaf.pem, leaf.key)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=asyncload test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "leaf.key",
        "-out",
        "leaf.csr",
    )
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "1", "-extfile", "ext.cnf", "-out", "leaf.pem")  # fmt: skip
    return d / "ca.pem", d / "leaf.pem", d / "leaf.key"


class _TLSFront:
    """TLS on 127.0.0.1 in front of ``upstream_port`` (plain HTTP), in a thread of its own."""

    def __init__(self, upstream_port: int, cert: Path, key: Path) -> None:
        self.port = 0
        ready = threading.Event()
        self._stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(1 << 16):
                    b.write(data)
                    await b.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                b.close()

        async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
            await asyncio.gather(pipe(reader, uw), pipe(ur, writer), return_exceptions=True)

        async def main() -> None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(cert, key)
            server = await asyncio.start_server(front, "127.0.0.1", 0, ssl=ctx)
            self.port = server.sockets[0].getsockname()[1]
            stop = asyncio.Event()
            self._stop = (asyncio.get_running_loop(), stop)
            ready.set()
            await stop.wait()
            server.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def close(self) -> None:
        assert self._stop is not None
        loop, stop = self._stop
        loop.call_soon_threadsafe(stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def https_url(http_server, ca, bucket_name, tmp_path) -> Iterator[str]:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(WANT, str(d / "model.safetensors"))
    http_server.upload_dir(d, bucket_name, "ckpt")
    front = _TLSFront(http_server.port, ca[1], ca[2])
    try:
        yield f"https://127.0.0.1:{front.port}/{bucket_name}/ckpt/model.safetensors"
    finally:
        front.close()


@pytest.fixture
def s3_tls(s3_server, ca, bucket_name, tmp_path) -> Iterator[tuple[str, dict[str, Any]]]:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(WANT, str(d / "model.safetensors"))
    url = s3_server.upload_dir(d, bucket_name, "ckpt") + "/model.safetensors"
    front = _TLSFront(s3_server.port, ca[1], ca[2])
    try:
        yield url, s3_server.storage_options(endpoint_url=f"https://127.0.0.1:{front.port}")
    finally:
        front.close()


@pytest.mark.parametrize("transport", ["wire", "fsspec"])
def test_https_ca_per_store(https_url, ca, tls_env, transport, caplog):
    opts = LoadOptions(transport=transport, retries=0)
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(_zeros(), https_url, options=opts)
    msg = str(ei.value)
    assert "ca_bundle=" in msg and "REQUESTS_CA_BUNDLE" in msg and "AWS_CA_BUNDLE" not in msg, msg
    assert ei.value.attempts == 1, msg
    for so in ({"ca_bundle": str(ca[0])}, {"verify": str(ca[0])}):
        dst = _zeros()
        asyncload.load(dst, https_url, options=opts, storage_options=so)
        _ok(dst)
    tls_env.setenv("REQUESTS_CA_BUNDLE", str(ca[0]))
    dst = _zeros()
    asyncload.load(dst, https_url, options=opts)
    _ok(dst)
    tls_env.delenv("REQUESTS_CA_BUNDLE")
    dst = _zeros()
    with caplog.at_level(logging.WARNING, logger="asyncload.storage"):
        asyncload.load(dst, https_url, options=opts, storage_options={"verify": False})
    _ok(dst)
    if transport == "wire":
        warned = [r for r in caplog.records if "verification is off" in r.getMessage()]
        assert len(warned) == 1, warned


@pytest.mark.parametrize("transport", ["wire", "fsspec"])
def test_s3_ca_per_store(s3_tls, ca, tls_env, transport):
    url, so = s3_tls
    opts = LoadOptions(transport=transport, retries=0)
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(_zeros(), url, options=opts, storage_options=so)
    msg = str(ei.value)
    assert "AWS_CA_BUNDLE" in msg and "client_kwargs={'verify'" in msg, msg
    assert "REQUESTS_CA_BUNDLE" not in msg, msg
    for extra in ({"ca_bundle": str(ca[0])}, {"client_kwargs": {"verify": str(ca[0])}}):
        dst = _zeros()
        asyncload.load(dst, url, options=opts, storage_options={**so, **extra})
        _ok(dst)
    tls_env.setenv("AWS_CA_BUNDLE", str(ca[0]))
    dst = _zeros()
    asyncload.load(dst, url, options=opts, storage_options=so)
    _ok(dst)
