"""Errors that name their cause (issue 41 item 8): a server that compresses (nginx with
``gzip on``, played by the HTTP Range server's ``gzip`` mode) is read uncompressed where it
honours ``Accept-Encoding: identity`` (fsspec used to ask for gzip and took the compressed 200's
weak ETag for a changed checkpoint) and refused as compressing where it does not; an
HTTP/2-only (h2c) port is named as such, without retry advice; a storage option nobody knows is
an error naming the closest known one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import asyncload
from asyncload import LoadOptions, StorageReadError
from asyncload.testing import HTTPRangeServer

pytestmark = pytest.mark.timeout(120)

WANT = {"x": torch.arange(4096.0), "y": torch.ones(64, 3)}


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in WANT.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gz")
    (d / "ckpt").mkdir()
    save_file(WANT, str(d / "ckpt" / "model.safetensors"))
    return d


@pytest.mark.parametrize("transport", ["fsspec", "wire"])
def test_a_server_that_compresses_when_asked_serves_identity(served, transport):
    with HTTPRangeServer(served, gzip="if-asked") as server:
        url = f"{server.endpoint_url}/ckpt/model.safetensors"
        dst = _zeros()
        asyncload.load(dst, url, options=LoadOptions(transport=transport, retries=0))
        assert all(torch.equal(dst[k], WANT[k]) for k in WANT)
        asked = {r["accept_encoding"] for r in server.requests()}
    assert asked == {"identity"}, asked


@pytest.mark.parametrize("transport", ["fsspec", "wire"])
def test_a_compressed_answer_is_refused_as_such(served, transport):
    with HTTPRangeServer(served, gzip="always") as server:
        url = f"{server.endpoint_url}/ckpt/model.safetensors"
        with pytest.raises(StorageReadError) as ei:
            asyncload.load(_zeros(), url, options=LoadOptions(transport=transport, retries=3))
    err = ei.value
    msg = str(err)
    assert not isinstance(err, asyncload.CheckpointChangedError)
    assert "Content-Encoding: gzip" in msg and "serve checkpoint files uncompressed" in msg, msg
    assert err.attempts == 1, msg  # no retry changes it


@pytest.fixture
def h2c_port() -> Iterator[int]:
    """A port that speaks only HTTP/2 without TLS: it answers whatever arrives with a SETTINGS
    frame and a GOAWAY (PROTOCOL_ERROR), as an h2c-only server answers an HTTP/1.1 request."""
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    goaway = b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x01"
    ready = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1024)
            writer.write(settings + goaway)
            await writer.drain()
            writer.close()

        async def main() -> None:
            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            box["port"] = server.sockets[0].getsockname()[1]
            stop = asyncio.Event()
            box["stop"] = (asyncio.get_running_loop(), stop)
            ready.set()
            await stop.wait()
            server.close()
            await server.wait_closed()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield int(box["port"])  # type: ignore[call-overload]
    finally:
        loop, stop = box["stop"]  # type: ignore[misc]
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_an_h2c_port_is_named_without_retry_advice(h2c_port):
    url = f"http://127.0.0.1:{h2c_port}/ckpt/model.safetensors"
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(_zeros(), url, options=LoadOptions(transport="wire", retries=4))
    msg = str(ei.value)
    assert "HTTP/2 (h2c" in msg and "not HTTP/1.1" in msg, msg
    assert "raise LoadOptions.retries" not in msg and ei.value.attempts == 1, msg


@pytest.mark.parametrize(
    ("url", "options", "named", "closest"),
    [
        ("s3://b/ckpt", {"endpoint": "http://127.0.0.1:1"}, "'endpoint'", "'endpoint_url'"),
        ("s3://b/ckpt", {"key": "k", "secrets": "s"}, "'secrets'", "'secret'"),
        ("gs://b/ckpt", {"tokn": "anon"}, "'tokn'", "'token'"),
        ("http://127.0.0.1:1/c", {"header": {}}, "'header'", "'headers'"),
    ],
)
@pytest.mark.parametrize("transport", ["auto", "wire", "fsspec"])
def test_an_unknown_storage_option_names_the_closest_known_one(
    url, options, named, closest, transport
):
    """s3fs and gcsfs ignore a key they do not know (``endpoint`` for ``endpoint_url``: the
    load goes to AWS); asyncload refuses it before any request, naming the key it resembles."""
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(
            {"x": torch.zeros(1)},
            url,
            storage_options=options,
            options=LoadOptions(transport=transport, retries=0),
        )
    msg = str(ei.value)
    assert f"storage_options {named} (did you mean {closest}?) is not taken for" in msg, msg
    assert "attempt" not in msg, msg  # refused before any request


@pytest.fixture(scope="module")
def signing_s3() -> Iterator[Any]:
    from asyncload.testing.servers import SigningS3Server

    with SigningS3Server() as server:
        yield server


@pytest.mark.parametrize("transport", ["wire", "fsspec"])
@pytest.mark.parametrize(
    ("bad", "code"),
    [
        ({"secret": "not-the-secret"}, "SignatureDoesNotMatch"),
        ({"key": "AKIAUNKNOWNKEY000000"}, "InvalidAccessKeyId"),
        ({"token": "not-a-session-token"}, "InvalidToken"),
    ],
    ids=["wrong-secret", "unknown-key", "bad-token"],
)
def test_credential_errors_name_which(signing_s3, served, bucket_name, transport, bad, code):
    """moto checking signatures (a signing bug would show here as SignatureDoesNotMatch on
    the good key): the good key loads bit for bit; a wrong secret, an unknown key and a bad
    session token each fail at once with a message naming S3's code, on every transport
    (s3fs' HEAD carries no code: a GET of one byte asks for it)."""
    url = signing_s3.upload_dir(served / "ckpt", bucket_name, "ckpt") + "/model.safetensors"
    opts = LoadOptions(transport=transport, retries=2)
    dst = _zeros()
    asyncload.load(dst, url, storage_options=signing_s3.storage_options(), options=opts)
    assert all(torch.equal(dst[k], WANT[k]) for k in WANT)
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(
            _zeros(), url, storage_options=signing_s3.storage_options(**bad), options=opts
        )
    msg = str(ei.value)
    assert code in msg and "credentials" in msg and ei.value.attempts == 1, msg
    assert "lack permission" not in msg and "not-the-secret" not in msg, msg
