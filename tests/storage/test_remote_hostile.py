"""Hostile stores, round three (issue 25): a redirect to another origin (refused before a
request goes there: the other origin's server receives nothing), an answer for another byte
range than the one asked for (refused before its bytes are used), an over-long 206 body
(refused after about the requested bytes, not buffered whole), and credentials in the URL
(never in a message or a log record; sent as Basic auth on both transports).

Every checkpoint is written by ``dcp.save`` and served by a real loopback server behind the
FaultProxy; the destination is checked to be untouched (still zeros) where a load fails.
"""

from __future__ import annotations

import http.server
import logging
import threading
from typing import Any

import pytest
import torch
from _ckpt import assert_bitwise_equal, iter_tensors, zeros_like_tree
from _remote import make_remote, small_state_dict

import asyncload
from asyncload import LoadOptions, StorageReadError
from asyncload.testing import faults

pytestmark = pytest.mark.timeout(120)

OPTS = LoadOptions(retries=2, backoff=0.0, max_backoff=0.0, timeout=20.0, hedge=False)


def _untouched(dst: Any) -> None:
    for key, t in iter_tensors(dst):
        assert not torch.count_nonzero(t), f"{key} was written by a load that failed"


class _Recorder:
    """An HTTP server on another host of the loopback network (127.0.0.2) that records every
    request it gets (method, path, headers) and answers 200 with bytes of its own."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                recorder.requests.append((self.command, self.path, dict(self.headers)))
                body = b"\x5a" * 4096
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.endpoint_url = f"http://127.0.0.2:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def other_host():
    recorder = _Recorder()
    yield recorder
    recorder.close()


def _load_redirected(
    r: Any, transport: str, other_url: str, code: int
) -> tuple[StorageReadError, Any]:
    # every data GET (.metadata included) is redirected to the other origin; the caller's
    # headers (an API key) and an S3 session token would go along with a followed redirect
    r.proxy.add_rule(
        faults.status(code, body=b"", headers={"Location": f"{other_url}/elsewhere/.metadata"}),
        data_only=True,
        times=None,
    )
    opts = dict(r.storage_options)
    if r.backend == "http":
        opts["headers"] = {"X-Api-Key": "secret-api-key"}
    elif r.backend == "s3":
        opts["token"] = "secret-session-token"
    dst = zeros_like_tree(small_state_dict(), object_placeholder=None)
    with pytest.raises(StorageReadError) as info:
        asyncload.load(dst, r.url, options=OPTS.replace(transport=transport), storage_options=opts)
    _untouched(dst)
    return info.value, dst


@pytest.mark.parametrize("backend", ["http", "s3", "gcs"])
def test_a_redirect_to_another_host_is_refused_and_nothing_is_sent_there(
    request, backend, ckpt, bucket_name, fault_proxy, transport, other_host
):
    r = make_remote(request, backend, ckpt[0], bucket_name, fault_proxy)
    code = 302 if backend == "http" else 307
    err, _ = _load_redirected(r, transport, other_host.endpoint_url, code)
    msg = str(err)
    assert f"a redirect to another origin, {other_host.endpoint_url} " in msg, msg
    assert f"(the checkpoint's origin is {r.proxy.endpoint_url})" in msg, msg
    assert "secret" not in msg
    assert err.attempts == 1, msg
    assert other_host.requests == []


@pytest.mark.parametrize("via", ["fsspec", "wire"])
@pytest.mark.parametrize("backend", ["http", "s3", "gcs"])
def test_a_redirect_to_another_port_is_refused_on_fsspec_and_wire(
    request, backend, ckpt, bucket_name, fault_proxy, via
):
    """fsspec and wire refuse a redirect to another origin whatever differs (the port too)."""
    r = make_remote(request, backend, ckpt[0], bucket_name, fault_proxy)
    other = fault_proxy(
        request.getfixturevalue(f"{backend}_server")
    )  # the same server, another port
    code = 302 if backend == "http" else 307
    err, _ = _load_redirected(r, via, other.endpoint_url, code)
    msg = str(err)
    assert (
        f"answered HTTP {code} with a redirect to another origin, {other.endpoint_url} " in msg
    ), msg
    assert f"(the checkpoint's origin is {r.proxy.endpoint_url})" in msg, msg
    assert err.attempts == 1 and err.status == code, msg
    assert other.requests_seen == 0, other.log


def test_a_redirect_within_the_origin_is_followed(
    request, ckpt, bucket_name, fault_proxy, transport
):
    path, sd = ckpt
    r = make_remote(request, "http", path, bucket_name, fault_proxy)
    target = r.url.removeprefix(r.proxy.endpoint_url)
    r.proxy.add_rule(
        faults.status(302, body=b"", headers={"Location": f"{target}/.metadata"}), path=".metadata"
    )
    dst = zeros_like_tree(sd, object_placeholder=None)
    asyncload.load(
        dst, r.url, options=OPTS.replace(transport=transport), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)


@pytest.mark.parametrize("backend", ["http", "s3", "gcs"])
def test_an_answer_for_another_range_is_refused_before_its_bytes_are_used(
    request, backend, ckpt, bucket_name, fault_proxy, transport
):
    path, sd = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    # the data files' ranged GETs are answered (truly) for a range 4 KiB further on
    rule = r.proxy.add_rule(faults.shift_range(4096), path=".distcp", range_only=True, times=None)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(StorageReadError) as info:
        asyncload.load(
            dst,
            r.url,
            options=OPTS.replace(transport=transport),
            storage_options=r.storage_options,
        )
    msg = str(info.value)
    assert rule.fired >= 1
    assert ".distcp bytes [0, " in msg and "failed HTTP 206 after 1 attempt" in msg, msg
    assert "the answer was not the byte range asked for, so none of its bytes were used" in msg, (
        msg
    )
    assert info.value.attempts == 1, msg
    _untouched(dst)


@pytest.mark.parametrize("backend", ["http", "s3", "gcs"])
def test_an_over_long_ranged_body_is_refused_after_about_the_bytes_asked_for(
    request, backend, ckpt, bucket_name, fault_proxy, transport
):
    path, sd = ckpt
    r = make_remote(request, backend, path, bucket_name, fault_proxy)
    extra = 256 << 20
    r.proxy.add_rule(faults.overlong(extra), path=".distcp", range_only=True, times=None)
    dst = zeros_like_tree(sd, object_placeholder=None)
    with pytest.raises(StorageReadError) as info:
        asyncload.load(
            dst,
            r.url,
            options=OPTS.replace(transport=transport, concurrency=1),
            storage_options=r.storage_options,
        )
    msg = str(info.value)
    assert ".distcp bytes [0, " in msg and "failed HTTP 206 after 1 attempt" in msg, msg
    assert (
        "got HTTP 206 with a body longer than that range: the answer does not match the request"
        in msg
    ), msg
    # the client took at most a few MiB of the 256 MiB (socket buffers included), not all of it
    assert r.proxy.extra_bytes_sent < 32 << 20, r.proxy.extra_bytes_sent
    _untouched(dst)


def test_credentials_in_the_url_are_sent_and_never_shown(
    request, ckpt, bucket_name, fault_proxy, transport, caplog
):
    path, sd = ckpt
    r = make_remote(request, "http", path, bucket_name, fault_proxy)
    url = r.url.replace("http://", "http://alice:s3cr%40t@", 1)
    # the server asks for them (401 without), and a 503 is retried (a log line naming the URL)
    r.proxy.add_rule(faults.status(503), path=".distcp", data_only=True, times=1)
    r.proxy.add_rule(faults.status(401), data_only=True, times=None)
    r.proxy.rules[-1].matches = _without_basic_auth(r.proxy.rules[-1].matches, "alice", "s3cr@t")  # type: ignore[method-assign]
    dst = zeros_like_tree(sd, object_placeholder=None)
    caplog.set_level(logging.DEBUG, logger="asyncload")
    stats = asyncload.load(
        dst, url, options=OPTS.replace(transport=transport), storage_options=r.storage_options
    )
    assert_bitwise_equal(dst, sd)
    assert stats.retries == 1 and "alice:***@" in caplog.text, caplog.text
    # a missing file: the message, its path, its repr and the log name the URL without the password
    with pytest.raises(asyncload.CheckpointNotFoundError) as info:
        asyncload.load({}, url + "-missing", options=OPTS.replace(transport=transport))
    assert "alice:***@" in str(info.value), str(info.value)
    for text in (str(info.value), info.value.path, repr(info.value), caplog.text):
        assert "s3cr" not in text, text


def _without_basic_auth(matches: Any, user: str, password: str) -> Any:
    """A rule matcher that also requires the request to lack ``user:password`` Basic auth."""
    import base64

    expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def without(req: Any, flavor: Any) -> bool:
        return bool(matches(req, flavor)) and req.header("authorization") != expected

    return without


def test_redaction_rule():
    from asyncload.common.errors import redact_text, redact_url

    assert redact_url("http://u:pw@h:1/p?a=1") == "http://u:***@h:1/p?a=1"
    assert redact_url(
        "https://h/p?X-Amz-Signature=abc&X-Amz-Credential=k%2F1&n=2&X-Amz-Security-Token=t"
    ) == ("https://h/p?X-Amz-Signature=***&X-Amz-Credential=***&n=2&X-Amz-Security-Token=***")
    assert redact_url(
        "https://h/o?X-Goog-Signature=ff&sig=1&token=2&access_token=3&key=4&x=5"
    ) == ("https://h/o?X-Goog-Signature=***&sig=***&token=***&access_token=***&key=***&x=5")
    assert redact_url("/local/path?token=1") == "/local/path?token=1"
    assert redact_text("GET http://a:b@h/x failed (URL('http://a:b@h/x'))") == (
        "GET http://a:***@h/x failed (URL('http://a:***@h/x'))"
    )
    err = StorageReadError("reading http://u:pw@h/x failed", path="http://u:pw@h/x")
    assert "pw" not in str(err) + err.path + repr(err)


class _ListingServer:
    """An HTTP server on 127.0.0.1 whose "directory" ``/ckpt/`` is an HTML page of ``size``
    bytes (filler, with a link to ``model.safetensors`` at its start and one at its end); a
    ranged GET of it (a probe for a file named ``ckpt``) and every other path are 404.
    ``sent`` counts the page's bytes written before the client left."""

    def __init__(self, size: int, *, links: bool = False) -> None:
        self.sent = 0
        server = self
        head = b'<html><body><a href="model.safetensors">model</a>\n'
        tail = b'<a href="/ckpt/late.safetensors">late</a></body></html>\n'
        filler = b"<p>" + b"x" * 1020 + b"</p>\n"

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path.rstrip("/") != "/ckpt" or self.headers.get("Range"):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                left = size - len(head) - len(tail)
                try:
                    self.wfile.write(head)
                    piece, i = filler * 64, 0
                    while left > 0:
                        if links:  # distinct names: what a directory of millions of files lists
                            piece = b"".join(
                                b'<a href="n%09d">x</a>\n' % (i + k) for k in range(2048)
                            )
                            i += 2048
                        n = min(len(piece), left)
                        self.wfile.write(piece[:n])
                        left -= n
                        server.sent += n
                    self.wfile.write(tail)
                except OSError:
                    pass

            def do_HEAD(self) -> None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ckpt/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_a_listing_larger_than_max_metadata_size_is_refused_after_that_many_bytes(transport):
    listing = _ListingServer(64 << 20)
    try:
        with pytest.raises(asyncload.CheckpointFormatError) as info:
            asyncload.load(
                {},
                listing.url,
                options=OPTS.replace(transport=transport, max_metadata_size=1 << 20),
            )
    finally:
        listing.close()
    msg = str(info.value)
    assert (
        f"the listing of {listing.url} is more than 1048576 bytes (its page and the names" in msg
    ), msg
    assert "LoadOptions.max_metadata_size" in msg, msg
    assert listing.sent < 16 << 20, listing.sent  # not the 64 MiB page


_LISTING_CHILD = """
import json, sys
import asyncload
url = sys.argv[1]
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
opts = asyncload.LoadOptions(retries=0, timeout=60.0, max_metadata_size=int(sys.argv[2]))
try:  # warm-up: imports, threads, sessions
    asyncload.load({}, url + "-missing", options=opts)
except asyncload.AsyncLoadError:
    pass
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
try:
    asyncload.load({}, url, options=opts)
    error = None
except asyncload.AsyncLoadError as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"above": status("VmHWM:") - base, "error": error}))
"""


@pytest.mark.parametrize(
    ("links", "limit", "expect"),
    [
        (
            False,
            1 << 30,
            "late.safetensors",
        ),  # under the default limit: read whole, parsed as a stream
        (
            True,
            64 << 20,
            "its page and the names it lists",
        ),  # 5.6 million names: refused at the limit
    ],
    ids=["filler-under-the-limit", "millions-of-links"],
)
def test_a_huge_listing_page_costs_at_most_max_metadata_size(links, limit, expect):
    """A 128 MiB index page (the default transport; the listing is the same code on both):
    parsed piece by piece (it was read and parsed whole: 499 MiB of RSS for 128 MiB of links),
    and the names it lists count against max_metadata_size too."""
    import json
    import subprocess
    import sys

    listing = _ListingServer(128 << 20, links=links)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _LISTING_CHILD, listing.url, str(limit)],
            capture_output=True,
            text=True,
            timeout=110,
            check=True,
        )
    finally:
        listing.close()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and expect in result["error"], result
    if not links:
        assert (
            listing.sent >= (128 << 20) - 4096
        )  # the whole page was read, the link at its end found
        assert result["above"] < 64 << 20, result  # peak RSS above the baseline
    else:
        assert listing.sent < 72 << 20, listing.sent
        assert result["above"] < limit + (32 << 20), result


def test_the_cli_never_prints_a_password_of_the_url(
    request, ckpt, bucket_name, fault_proxy, capsys
):
    from asyncload.cli import main

    r = make_remote(request, "http", ckpt[0], bucket_name, fault_proxy)
    url = r.url.replace("http://", "http://alice:s3cr%40t@", 1)
    assert main(["inspect", url]) == 0
    assert main(["verify", url, "--no-progress"]) == 0
    assert main(["inspect", url + "-missing"]) != 0
    out = capsys.readouterr()
    assert f"checkpoint   {url.replace('s3cr%40t', '***')}" in out.out, out.out
    assert "alice:***@" in out.err, out.err
    assert "s3cr" not in out.out + out.err


def test_the_content_range_rule():
    from asyncload.storage import RangeMismatchError, VersionPins

    v = VersionPins("http://h/c")
    v._check_range("f", 0, 10, 206, "bytes 0-9/100")
    v._check_range("f", 90, 100, 206, "bytes 90-99/100")
    v._check_range(
        "f", 95, 110, 206, "bytes 95-99/100"
    )  # the file ends there: a short read, told apart later
    v._check_range("f", 0, 10, 206, "bytes 0-9/*")
    for bad in (
        None,
        "",
        "bytes 1-10/100",
        "bytes 0-8/100",
        "bytes 0-10/100",
        "bytes 0-9/99",
        "bytes 0-9",
        "items 0-9/100",
    ):
        with pytest.raises(
            RangeMismatchError,
            match=r"asked for bytes \[0, 10\) of http://h/c/f, got HTTP 206 with",
        ):
            v._check_range("f", 0, 10, 206, bad)
