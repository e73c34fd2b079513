"""Credentials that come from another host, on the default transport (issue 25, item 1): web
identity through STS, an instance role through the instance metadata service, a container
credentials endpoint that hands out credentials about to expire, and GCS OAuth from a service
account key. Each load goes through the wire transport, with real servers on loopback: moto
(S3 and STS), fake-gcs-server, and small HTTP servers written here for the metadata service,
the container endpoint and the OAuth token endpoint. A recording server in front of the store
shows what each request carried; a redirect to another port of 127.0.0.1 is refused with the
credentials of every source, and the other server receives nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import http.client
import http.server
import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from _ckpt import assert_bitwise_equal, iter_tensors, zeros_like_tree

import asyncload
from asyncload import LoadOptions, StorageReadError
from asyncload.storage import WireStorage, open_storage

pytestmark = pytest.mark.timeout(120)

OPTS = LoadOptions(retries=2, backoff=0.0, max_backoff=0.0, timeout=20.0, hedge=False)

Answer = tuple[int, dict[str, str], bytes]


class _Server:
    """An HTTP/1.1 server on 127.0.0.1 that records every request (method, path, headers with
    lowercase names, body) and answers with ``answer(method, path, headers, body)`` (the
    bodies of its answers to POSTs kept too)."""

    def __init__(self, answer: Callable[[str, str, dict[str, str], bytes], Answer]) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.post_answers: list[bytes] = []
        self.answer = answer
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                server.requests.append((self.command, self.path, headers, body))
                status, out, data = server.answer(self.command, self.path, headers, body)
                if self.command == "POST":
                    server.post_answers.append(data)
                self.send_response(status)
                out = {k.lower(): v for k, v in out.items()}
                out.setdefault("content-length", str(len(data)))
                for k, v in out.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = _handle

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


def _forward(upstream: str) -> Callable[[str, str, dict[str, str], bytes], Answer]:
    """Answers by asking ``upstream`` (``http://127.0.0.1:P``) the same request."""
    p = urlsplit(upstream)

    def answer(method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
        conn = http.client.HTTPConnection(p.hostname or "", p.port, timeout=30)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out = {k.lower(): v for k, v in resp.getheaders() if k.lower() not in _HOP}
            length = resp.getheader("content-length")
            out["content-length"] = length if method == "HEAD" and length else str(len(data))
            return resp.status, out, data
        finally:
            conn.close()

    return answer


@pytest.fixture
def servers() -> Iterator[Callable[..., _Server]]:
    """Factory of :class:`_Server`, every one closed when the test ends."""
    made: list[_Server] = []

    def make(answer: Callable[[str, str, dict[str, str], bytes], Answer]) -> _Server:
        made.append(_Server(answer))
        return made[-1]

    yield make
    for s in reversed(made):
        s.close()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> pytest.MonkeyPatch:
    """No static AWS credentials and no credential source configured (each test adds one);
    no shared files."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL_STS",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return monkeypatch


def _expiry(seconds: float) -> str:
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


class _Imds:
    """The instance metadata service (IMDSv2) of an instance with role ``role``: counts the
    credential fetches; ``fail`` answers every request 500."""

    def __init__(self, make: Callable[..., _Server], *, fail: bool = False) -> None:
        self.fetches = 0
        self.fail = fail
        self.secret = "imds-secret-key-0123456789abcdefghijklmnopqrstuv"
        self.server = make(self._answer)

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
        if self.fail:
            return 500, {}, b"metadata service is broken"
        if method == "PUT" and path == "/latest/api/token":
            return 200, {}, b"imds-session-token"
        if headers.get("x-aws-ec2-metadata-token") != "imds-session-token":
            return 401, {}, b""
        if path == "/latest/meta-data/iam/security-credentials/":
            return 200, {}, b"ckpt-reader"
        if path == "/latest/meta-data/iam/security-credentials/ckpt-reader":
            self.fetches += 1
            doc = {
                "Code": "Success",
                "Type": "AWS-HMAC",
                "AccessKeyId": f"ASIAIMDS{self.fetches:012d}",
                "SecretAccessKey": self.secret,
                "Token": f"imds-session-token-for-s3-{self.fetches}",
                "Expiration": _expiry(6 * 3600),
            }
            return 200, {"content-type": "application/json"}, json.dumps(doc).encode()
        return 404, {}, b""


def _s3_tokens(recorder: _Server) -> list[str | None]:
    """The session token of every S3 request the recorder saw (STS calls left out)."""
    return [h.get("x-amz-security-token") for m, _, h, _ in recorder.requests if m != "POST"]


def _sts_token(recorder: _Server) -> str:
    """The session token STS issued (read from its answer, through the recorder)."""
    m = re.search(rb"<SessionToken>([^<]+)</SessionToken>", b"".join(recorder.post_answers))
    assert m, "STS issued no session token"
    return m.group(1).decode()


def _assert_wire(url: str, opts: dict[str, Any]) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        storage = open_storage(url, opts, executor)
        assert type(storage) is WireStorage, storage
        assert storage.spec.auth is not None and storage.spec.signer is None


def _load(url: str, opts: dict[str, Any], sd: dict[str, Any]) -> Any:
    dst = zeros_like_tree(sd, object_placeholder=None)
    asyncload.load(dst, url, options=OPTS, storage_options=opts)
    return dst


def _untouched(dst: Any) -> None:
    for key, t in iter_tensors(dst):
        assert not torch.count_nonzero(t), f"{key} was written by a load that failed"


# ---------------------------------------------------------------------------------------------
# S3: web identity (STS), an instance role (IMDS), a container endpoint (refresh)
# ---------------------------------------------------------------------------------------------
def _web_identity(env: pytest.MonkeyPatch, tmp_path, sts_url: str) -> str:
    token = "eyJhbGciOiJSUzI1NiJ9.web-identity-token-that-must-stay-secret.c2lnbmF0dXJl"
    (tmp_path / "web-identity").write_text(token)
    env.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/ckpt-reader")
    env.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "web-identity"))
    env.setenv("AWS_ENDPOINT_URL_STS", sts_url)
    return token


def test_web_identity_credentials_are_fetched_from_sts_and_sign_every_request(
    s3_server, bucket_name, ckpt, servers, aws_env, tmp_path, caplog
):
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ckpt")
    proxy = servers(_forward(s3_server.endpoint_url))  # S3 and STS, recorded
    _web_identity(aws_env, tmp_path, proxy.endpoint_url)
    opts = {"endpoint_url": proxy.endpoint_url}
    _assert_wire(url, opts)
    with caplog.at_level(logging.DEBUG, logger="asyncload.storage"):
        dst = _load(url, opts, sd)
    assert_bitwise_equal(dst, sd)
    assert not any("not wire" in r.getMessage() for r in caplog.records)
    posts = [b for m, _, _, b in proxy.requests if m == "POST"]
    assert len(posts) == 1 and b"Action=AssumeRoleWithWebIdentity" in posts[0]
    issued = _sts_token(proxy)
    tokens = _s3_tokens(proxy)
    assert tokens and set(tokens) == {issued}


def test_instance_role_credentials_come_from_the_metadata_service(
    s3_server, bucket_name, ckpt, servers, aws_env
):
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ckpt")
    imds = _Imds(servers)
    aws_env.delenv("AWS_EC2_METADATA_DISABLED")
    aws_env.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.server.endpoint_url)
    recorder = servers(_forward(s3_server.endpoint_url))
    opts = {"endpoint_url": recorder.endpoint_url}
    _assert_wire(url, opts)
    assert_bitwise_equal(_load(url, opts, sd), sd)
    assert imds.fetches == 1  # once per store (frozen until near its expiry)
    tokens = _s3_tokens(recorder)
    assert tokens and set(tokens) == {"imds-session-token-for-s3-1"}
    auths = {h["authorization"] for _, _, h, _ in recorder.requests}
    assert all("Credential=ASIAIMDS000000000001/" in a for a in auths), auths

    async def signed_read() -> list[str]:  # what a store with fetched credentials shows
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            storage = open_storage(url, opts, executor)
            try:
                await storage.read_prefix(".metadata", 16)
                return [repr(storage), repr(storage.spec), repr(storage.spec.auth)]
            finally:
                await storage.aclose()

    shown = asyncio.run(signed_read())
    assert imds.fetches == 2 and "the instance metadata service" in shown[2], shown
    assert not any(imds.secret in r or "imds-session-token" in r for r in shown), shown


def test_credentials_about_to_expire_are_refreshed_during_the_load(
    s3_server, bucket_name, ckpt, servers, aws_env
):
    """A container credentials endpoint hands out credentials that expire in 5 minutes
    (inside botocore's mandatory refresh window): they are refreshed (in the executor, one
    refresh at a time) and the requests after it carry the new token."""
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ckpt")
    issued: list[str] = []

    def creds(method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
        issued.append(f"container-token-{len(issued) + 1}")
        doc = {
            "AccessKeyId": "ASIACONTAINER0000001",
            "SecretAccessKey": "container-secret-0123456789abcdefghijklmnop",
            "Token": issued[-1],
            "Expiration": _expiry(300),
        }
        return 200, {"content-type": "application/json"}, json.dumps(doc).encode()

    endpoint = servers(creds)
    aws_env.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{endpoint.endpoint_url}/creds")
    recorder = servers(_forward(s3_server.endpoint_url))
    opts = {"endpoint_url": recorder.endpoint_url}
    _assert_wire(url, opts)
    assert_bitwise_equal(_load(url, opts, sd), sd)
    tokens = _s3_tokens(recorder)
    assert len(issued) >= 2, issued  # refreshed
    assert set(tokens) <= set(issued) and len(set(tokens)) >= 2, (tokens, issued)
    assert tokens[-1] == issued[-1]


# ---------------------------------------------------------------------------------------------
# GCS: OAuth from a service account key
# ---------------------------------------------------------------------------------------------
def _service_account(token_uri: str) -> dict[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return {
        "type": "service_account",
        "project_id": "test",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "reader@test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }


class _TokenEndpoint:
    """An OAuth token endpoint: each JWT grant gets a new access token."""

    def __init__(self, make: Callable[..., _Server], *, fail: bool = False) -> None:
        self.issued: list[str] = []
        self.fail = fail
        self.server = make(self._answer)

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
        if self.fail or b"grant_type=urn" not in body:
            doc = {"error": "invalid_grant", "error_description": "account disabled"}
            return 400, {"content-type": "application/json"}, json.dumps(doc).encode()
        self.issued.append(f"ya29.access-token-{len(self.issued) + 1}")
        doc = {"access_token": self.issued[-1], "expires_in": 3600, "token_type": "Bearer"}
        return 200, {"content-type": "application/json"}, json.dumps(doc).encode()


@pytest.fixture
def gcs_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("form", ["path", "dict", "credentials"])
def test_gcs_oauth_bearer_from_a_service_account_reaches_the_store(
    gcs_server, bucket_name, ckpt, servers, gcs_env, tmp_path, form
):
    path, sd = ckpt
    url = gcs_server.upload_dir(path, bucket_name, "ckpt")
    tokens = _TokenEndpoint(servers)
    info = _service_account(f"{tokens.server.endpoint_url}/token")
    (tmp_path / "sa.json").write_text(json.dumps(info))
    recorder = servers(_forward(gcs_server.endpoint_url))
    token: Any = str(tmp_path / "sa.json") if form == "path" else info
    if form == "credentials":  # gcsfs' token=<google.auth credentials>
        from google.oauth2 import service_account

        token = service_account.Credentials.from_service_account_info(
            info, scopes=["https://www.googleapis.com/auth/devstorage.read_only"]
        )
    opts = {"endpoint_url": recorder.endpoint_url, "token": token, "project": "test"}
    _assert_wire(url, opts)
    assert_bitwise_equal(_load(url, opts, sd), sd)
    assert tokens.issued == ["ya29.access-token-1"]
    bearers = {h.get("authorization") for _, _, h, _ in recorder.requests}
    assert bearers == {"Bearer ya29.access-token-1"}, bearers


# ---------------------------------------------------------------------------------------------
# A redirect to another port of the same host, with each source's credentials
# ---------------------------------------------------------------------------------------------
def _redirecting(make: Callable[..., _Server], upstream: str, other: str) -> _Server:
    """Forwards STS calls (POST) to ``upstream``; answers every read 307 to ``other``."""
    forward = _forward(upstream)

    def answer(method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
        if method == "POST":
            return forward(method, path, headers, body)
        return 307, {"location": f"{other}{path}"}, b""

    return make(answer)


@pytest.mark.parametrize("source", ["web_identity", "instance_role", "gcs_oauth"])
def test_a_redirect_to_another_port_is_refused_and_no_credential_crosses(
    request, source, bucket_name, ckpt, servers, aws_env, gcs_env, tmp_path
):
    path, sd = ckpt
    other = servers(lambda m, p, h, b: (200, {}, b"\x5a" * 4096))  # 127.0.0.1, another port
    if source == "gcs_oauth":
        gcs = request.getfixturevalue("gcs_server")
        url = gcs.upload_dir(path, bucket_name, "ckpt")
        tokens = _TokenEndpoint(servers)
        info = _service_account(f"{tokens.server.endpoint_url}/token")
        origin = _redirecting(servers, gcs.endpoint_url, other.endpoint_url)
        opts: dict[str, Any] = {"endpoint_url": origin.endpoint_url, "token": info}
    else:
        s3 = request.getfixturevalue("s3_server")
        url = s3.upload_dir(path, bucket_name, "ckpt")
        origin = _redirecting(servers, s3.endpoint_url, other.endpoint_url)
        if source == "web_identity":
            _web_identity(aws_env, tmp_path, origin.endpoint_url)
        else:
            imds = _Imds(servers)
            aws_env.delenv("AWS_EC2_METADATA_DISABLED")
            aws_env.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.server.endpoint_url)
        opts = {"endpoint_url": origin.endpoint_url}
    _assert_wire(url, opts)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(StorageReadError) as info_:
        asyncload.load(dst, url, options=OPTS, storage_options=opts)
    msg = str(info_.value)
    assert f"answered HTTP 307 with a redirect to another origin, {other.endpoint_url} " in msg
    assert f"(the checkpoint's origin is {origin.endpoint_url})" in msg, msg
    assert info_.value.attempts == 1, msg
    assert other.requests == []
    # the origin got the credentials (it is the store); nothing else did
    reads = [h for m, _, h, _ in origin.requests if m != "POST"]
    assert reads and all("authorization" in h for h in reads)
    _untouched(dst)


# ---------------------------------------------------------------------------------------------
# A source that fails
# ---------------------------------------------------------------------------------------------
def test_a_metadata_service_that_fails_is_a_credentials_error_naming_it(
    s3_server, bucket_name, ckpt, servers, aws_env
):
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ckpt")
    imds = _Imds(servers, fail=True)
    aws_env.delenv("AWS_EC2_METADATA_DISABLED")
    aws_env.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.server.endpoint_url)
    recorder = servers(_forward(s3_server.endpoint_url))
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(StorageReadError) as info:
        asyncload.load(
            dst, url, options=OPTS, storage_options={"endpoint_url": recorder.endpoint_url}
        )
    msg = str(info.value)
    # item 8: the message says none were found and lists each source (test_conformance.py)
    assert "no AWS credentials were found" in msg, msg
    assert f"instance metadata at {imds.server.endpoint_url} (HTTP " in msg, msg
    assert "the store rejected or did not get credentials" in msg, msg
    assert info.value.attempts == 1, msg
    assert imds.server.requests  # it was asked
    assert recorder.requests == []  # nothing unsigned went to the store
    _untouched(dst)


def test_sts_refusing_is_a_credentials_error_without_the_token(
    s3_server, bucket_name, ckpt, servers, aws_env, tmp_path
):
    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ckpt")
    refusal = (
        b'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error>'
        b"<Type>Sender</Type><Code>AccessDenied</Code><Message>Not authorized to perform "
        b"sts:AssumeRoleWithWebIdentity</Message></Error><RequestId>1</RequestId>"
        b"</ErrorResponse>"
    )
    sts = servers(lambda m, p, h, b: (403, {"content-type": "text/xml"}, refusal))
    token = _web_identity(aws_env, tmp_path, sts.endpoint_url)
    recorder = servers(_forward(s3_server.endpoint_url))
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(StorageReadError) as info:
        asyncload.load(
            dst, url, options=OPTS, storage_options={"endpoint_url": recorder.endpoint_url}
        )
    msg = str(info.value)
    assert "no credentials from web identity" in msg and "AccessDenied" in msg, msg
    assert token not in msg and "must-stay-secret" not in msg, msg
    assert sts.requests and recorder.requests == []
    _untouched(dst)


def test_a_token_endpoint_that_refuses_is_a_credentials_error_naming_the_key(
    gcs_server, bucket_name, ckpt, servers, gcs_env, tmp_path
):
    path, sd = ckpt
    url = gcs_server.upload_dir(path, bucket_name, "ckpt")
    tokens = _TokenEndpoint(servers, fail=True)
    info = _service_account(f"{tokens.server.endpoint_url}/token")
    (tmp_path / "sa.json").write_text(json.dumps(info))
    recorder = servers(_forward(gcs_server.endpoint_url))
    opts = {"endpoint_url": recorder.endpoint_url, "token": str(tmp_path / "sa.json")}
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(StorageReadError) as err:
        asyncload.load(dst, url, options=OPTS, storage_options=opts)
    msg = str(err.value)
    assert f"no credentials from the key file '{tmp_path / 'sa.json'}'" in msg, msg
    assert "invalid_grant" in msg and "PRIVATE KEY" not in msg, msg
    assert recorder.requests == []
    _untouched(dst)


# ---------------------------------------------------------------------------------------------
# What "auto" picks
# ---------------------------------------------------------------------------------------------
def test_auto_uses_wire_for_every_credential_source_and_fsspec_without_the_clients(
    aws_env, gcs_env, caplog, tmp_path
):
    """A profile, web identity, an instance role, GCS OAuth: "auto" reads through wire. Only
    where botocore (google-auth) is not installed does it fall back to fsspec, saying why; a
    key pair and an anonymous GCS read never need them."""
    from asyncload.storage import FsspecStorage

    (tmp_path / "config").write_text("[profile dev]\nregion = us-east-1\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    (tmp_path / "sa.json").write_text(json.dumps({"type": "service_account"}))
    s3 = {"endpoint_url": "http://127.0.0.1:1"}
    gcs = {"endpoint_url": "http://127.0.0.1:1", "token": str(tmp_path / "sa.json")}
    cases = [
        ("s3://b/ckpt", {**s3, "profile": "dev"}, "the AWS profile 'dev'"),
        ("s3://b/ckpt", {**s3, "requester_pays": True}, "botocore's credential chain"),
        ("gs://b/ckpt", gcs, f"the key file '{tmp_path / 'sa.json'}'"),
        ("gs://b/ckpt", {**gcs, "token": "google_default"}, "application default credentials"),
    ]
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        for url, opts, source in cases:
            storage = open_storage(url, opts, executor)
            assert type(storage) is WireStorage, (url, opts)
            assert source in repr(storage.spec.auth), repr(storage.spec.auth)
        keyed = open_storage("s3://b/ckpt", {**s3, "key": "k", "secret": "s"}, executor)
        assert type(keyed) is WireStorage and keyed.spec.signer is not None
        aws_env.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
        aws_env.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/r")
        assert type(open_storage("s3://b/ckpt", s3, executor)) is WireStorage
        # without the clients that fetch them (the s3 and gcs extras), fsspec is asked; s3fs
        # and gcsfs themselves imported first, as a process that has the fsspec backends would
        # (hiding botocore before their first import makes them unimportable: the test would
        # then depend on an earlier test having imported them)
        import gcsfs  # noqa: F401
        import s3fs  # noqa: F401

        aws_env.setitem(sys.modules, "botocore.session", None)
        aws_env.setitem(sys.modules, "google.auth.transport.requests", None)
        for url, opts in (("s3://b/ckpt", s3), ("gs://b/ckpt", gcs)):
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="asyncload.storage"):
                storage = open_storage(url, opts, executor)
            assert type(storage) is FsspecStorage, url
            assert storage.transport.startswith("fsspec (wire cannot honour: "), storage.transport
            why = [r.getMessage() for r in caplog.records if "not wire" in r.getMessage()]
            assert why and ("botocore" in why[0] or "google-auth" in why[0]), why
        assert type(keyed) is WireStorage
        anon = open_storage("gs://b/ckpt", {**gcs, "token": "anon"}, executor)
        assert type(anon) is WireStorage and anon.spec.auth is None


def test_requester_pays_is_signed_as_botocore_signs_it():
    """s3fs' ``requester_pays=True``: ``x-amz-request-payer: requester``, signed (botocore's
    signature of the same request, with its ``RequestPayer`` header, is ours)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from asyncload.storage.sigv4 import SigV4

    for token in (None, "session/token+="):
        req = AWSRequest(
            method="GET",
            url="http://127.0.0.1:9000/bkt/ckpt/.metadata",
            headers={"x-amz-request-payer": "requester"},
        )
        S3SigV4Auth(Credentials("AKID", "SECRET/KEY", token), "s3", "us-east-1").add_auth(req)
        when = datetime.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
        ours = SigV4("AKID", "SECRET/KEY", "us-east-1", token, request_payer=True).sign(
            "GET", "127.0.0.1:9000", "/bkt/ckpt/.metadata", now=when.replace(tzinfo=datetime.UTC)
        )
        assert ours["x-amz-request-payer"] == "requester"
        assert ours["authorization"] == req.headers["Authorization"]


def test_a_profile_with_a_credential_process_signs_the_requests(
    s3_server, bucket_name, ckpt, servers, aws_env, tmp_path
):
    """s3fs' ``profile=``: botocore runs the profile's ``credential_process`` (as for SSO or
    an assumed role, the profile says where credentials come from); its session token signs
    every request."""
    import shlex

    path, sd = ckpt
    url = s3_server.upload_dir(path, bucket_name, "ckpt")
    doc = {
        "Version": 1,
        "AccessKeyId": "ASIAPROCESS000000001",
        "SecretAccessKey": "process-secret-0123456789abcdefghijklmno",
        "SessionToken": "process-session-token",
        "Expiration": _expiry(3600),
    }
    (tmp_path / "process.py").write_text(f"print({json.dumps(doc)!r})\n")
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / 'process.py'))}"
    (tmp_path / "config").write_text(f"[profile dev]\ncredential_process = {command}\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    recorder = servers(_forward(s3_server.endpoint_url))
    opts = {"endpoint_url": recorder.endpoint_url, "profile": "dev"}
    _assert_wire(url, opts)
    assert_bitwise_equal(_load(url, opts, sd), sd)
    tokens = _s3_tokens(recorder)
    assert tokens and set(tokens) == {"process-session-token"}
