"""Proxies (issue 41 item 2) on the wire transport, as botocore, requests and curl honour them:
``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``ALL_PROXY`` (either case), ``NO_PROXY``, s3fs'
``config_kwargs={"proxies": {...}}`` and aiohttp's ``proxy=``; plain http through the proxy
with an absolute URI, https through ``CONNECT`` with TLS to the origin inside the tunnel; a
proxy's ``user:pass@`` sent as ``Proxy-Authorization`` and never shown. A real forwarding proxy
on loopback (threads and sockets, below) counts what passes through it: a client that ignored
the proxy would connect around it."""

from __future__ import annotations

import base64
import logging
import socket
import threading
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import save_file
from test_wire_tls import _make_ca, _TLSFront

import asyncload
from asyncload import LoadOptions, StorageReadError

pytestmark = pytest.mark.timeout(120)

WANT = {"x": torch.arange(2048.0), "y": torch.ones(16, 4)}


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in WANT.items()}


def _ok(dst: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(dst[k], WANT[k]) for k in WANT)


class ForwardingProxy:
    """An HTTP forwarding proxy on 127.0.0.1: ``CONNECT host:port`` opens a tunnel; a request
    with an absolute URI is sent on to its origin (the request line in origin form), and the
    connection is then piped both ways. ``auth`` (``user:pass``): every first request and
    ``CONNECT`` must carry it as ``Proxy-Authorization: Basic``, else 407. ``seen``: the
    first request line of each connection, as received."""

    def __init__(self, auth: str | None = None) -> None:
        self.auth = "Basic " + base64.b64encode(auth.encode()).decode() if auth else None
        self.seen: list[str] = []
        self.refused = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            raw, _, rest = head.partition(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ", 2)
            headers = [line for line in lines[1:] if line]
            given = next(
                (h.split(":", 1)[1].strip() for h in headers
                 if h.lower().startswith("proxy-authorization:")), None,
            )  # fmt: skip
            self.seen.append(f"{method} {target}")
            if self.auth is not None and given != self.auth:
                self.refused += 1
                client.sendall(
                    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                    b'Proxy-Authenticate: Basic realm="t"\r\nContent-Length: 0\r\n'
                    b"Connection: close\r\n\r\n"
                )
                return
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                upstream = socket.create_connection((host.strip("[]"), int(port)))
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                assert target.startswith("http://"), target
                hostport, _, path = target[len("http://") :].partition("/")
                host, _, port = hostport.partition(":")
                upstream = socket.create_connection((host, int(port or 80)))
                kept = [h for h in headers if not h.lower().startswith("proxy-authorization:")]
                first = "\r\n".join([f"{method} /{path} {version}", *kept]) + "\r\n\r\n"
                upstream.sendall(first.encode("latin-1") + rest)
            self._pipe(client, upstream)
        except OSError:
            pass
        finally:
            client.close()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        def one(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        t = threading.Thread(target=one, args=(b, a), daemon=True)
        t.start()
        one(a, b)
        t.join(30)
        b.close()


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.fixture
def proxy() -> Iterator[ForwardingProxy]:
    p = ForwardingProxy()
    yield p
    p.close()


@pytest.fixture
def ckpt_http(http_server, bucket_name, tmp_path) -> str:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(WANT, str(d / "model.safetensors"))
    http_server.upload_dir(d, bucket_name, "ckpt")
    return http_server.url(bucket_name, "ckpt/model.safetensors")


OPTS = LoadOptions(transport="wire", retries=0)


@pytest.mark.parametrize("var", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_http_through_the_proxy_of_the_environment(ckpt_http, proxy, proxy_env, var):
    proxy_env.setenv(var, proxy.url())
    dst = _zeros()
    stats = asyncload.load(dst, ckpt_http, options=OPTS)
    _ok(dst)
    assert stats.transport == "wire"
    assert proxy.seen and all(s.startswith("GET http://127.0.0.1:") for s in proxy.seen), (
        proxy.seen
    )
    proxy.seen.clear()
    proxy_env.setenv("NO_PROXY", "localhost,127.0.0.1")
    dst = _zeros()
    asyncload.load(dst, ckpt_http, options=OPTS)
    _ok(dst)
    assert proxy.seen == []  # NO_PROXY: straight to the server


def test_https_through_connect_with_credentials_never_shown(
    http_server, ckpt_http, proxy_env, tmp_path, caplog
):
    ca, leaf, key = _make_ca(tmp_path)
    front = _TLSFront(http_server.port, leaf, key)
    guarded = ForwardingProxy(auth="user:s3cr3t")
    try:
        url = ckpt_http.replace(
            f"http://127.0.0.1:{http_server.port}", f"https://127.0.0.1:{front.port}"
        )
        so = {"ca_bundle": str(ca)}
        proxy_env.setenv("HTTPS_PROXY", guarded.url("user:s3cr3t"))
        dst = _zeros()
        with caplog.at_level(logging.DEBUG, logger="asyncload"):
            asyncload.load(dst, url, options=OPTS, storage_options=so)
        _ok(dst)
        assert guarded.seen and all(s.startswith("CONNECT 127.0.0.1:") for s in guarded.seen)
        assert guarded.refused == 0
        proxy_env.setenv("HTTPS_PROXY", guarded.url("user:wrong-pass"))
        with pytest.raises(StorageReadError) as ei:
            asyncload.load(_zeros(), url, options=OPTS, storage_options=so)
        msg = str(ei.value)
        assert "407" in msg and f"the proxy http://127.0.0.1:{guarded.port}" in msg, msg
        assert guarded.refused >= 1
        shown = msg + repr(ei.value) + "".join(r.getMessage() for r in caplog.records)
        assert "s3cr3t" not in shown and "wrong-pass" not in shown
    finally:
        guarded.close()
        front.close()


def test_s3_proxies_in_config_kwargs_and_the_environment(
    s3_server, bucket_name, proxy, proxy_env, tmp_path
):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(WANT, str(d / "model.safetensors"))
    url = s3_server.upload_dir(d, bucket_name, "ckpt") + "/model.safetensors"
    so = s3_server.storage_options(config_kwargs={"proxies": {"http": proxy.url()}})
    dst = _zeros()
    asyncload.load(dst, url, options=OPTS, storage_options=so)
    _ok(dst)
    assert proxy.seen and all(f"/{bucket_name}/" in s for s in proxy.seen), proxy.seen
    n = len(proxy.seen)
    proxy_env.setenv("HTTP_PROXY", proxy.url())
    dst = _zeros()
    asyncload.load(dst, url, options=OPTS, storage_options=s3_server.storage_options())
    _ok(dst)
    assert len(proxy.seen) > n


def test_a_proxy_the_wire_transport_cannot_use_is_named(ckpt_http, proxy_env):
    proxy_env.setenv("HTTP_PROXY", "socks5://user:pw@127.0.0.1:1080")
    with pytest.raises(StorageReadError) as ei:
        asyncload.load(_zeros(), ckpt_http, options=OPTS)
    msg = str(ei.value)
    assert "HTTP_PROXY" in msg and "not an http:// proxy" in msg and ":pw@" not in msg, msg
