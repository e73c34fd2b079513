"""Names the caller gives (issue 41 items 4 and 9): a checkpoint's own path may hold any
character its store allows (``:``, ``%``, spaces, unicode), locally, on S3 and over HTTP(S),
through every transport; the path of an ``http(s)://`` URL given raw is percent-encoded as
UTF-8 (RFC 3986) as curl and requests send it, an encoded one is sent as given. Names read from
inside a checkpoint keep their checks (an index naming ``a:b.safetensors`` is refused).
Bit for bit against what was saved, on the HTTP Range server and moto."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import asyncload
from asyncload import CheckpointFormatError, LoadOptions
from asyncload.storage.wire import requote_path, requote_url

pytestmark = pytest.mark.timeout(120)

#: file names a user's checkpoint may have (a timestamp, an escape-looking name, unicode)
NAMES = [
    "ckpt-2026-12-07T09:50:00.safetensors",
    "a%20b.safetensors",
    "100%.safetensors",
    "sp ace ✓ü.safetensors",
]
WANT = {"x": torch.arange(64.0), "y": torch.arange(12, dtype=torch.int32).reshape(3, 4)}


def _check(dst: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(dst[k], WANT[k]) for k in WANT), dst


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in WANT.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("names") / "dir: ✓"
    d.mkdir()
    for n in NAMES:
        save_file(WANT, str(d / n))
    return d


def test_requoting_is_rfc_3986():
    assert requote_path("sp ace ✓ü") == "sp%20ace%20%E2%9C%93%C3%BC"
    assert requote_path("a%20b") == "a%20b"  # encoded: as given
    assert requote_path("a%2fb") == "a%2Fb"  # an escape is kept (its hex case normalised)
    assert requote_path("100%") == "100%25"  # a % that starts no escape
    assert requote_path("T09:50:00+1=2~x!@$&'()*,;") == "T09:50:00+1=2~x!@$&'()*,;"
    assert (
        requote_url("https://u:p@h:8443/d ✓/f?q=a b")
        == "https://u:p@h:8443/d%20%E2%9C%93/f?q=a%20b"
    )


@pytest.mark.parametrize("name", NAMES)
def test_local_paths_hold_any_character(files, name):
    dst = _zeros()
    asyncload.load(dst, files / name)
    _check(dst)
    dst = _zeros()
    asyncload.load(dst, f"file://{urllib.parse.quote(str(files / name))}")
    _check(dst)
    with asyncload.safe_open(str(files / name)) as f:
        assert torch.equal(f.get_tensor("x"), WANT["x"])


@pytest.mark.parametrize("transport", ["wire", "fsspec"])
@pytest.mark.parametrize("encoded", [True, False], ids=["encoded", "raw"])
@pytest.mark.parametrize("name", NAMES)
def test_http_urls_raw_or_encoded(http_server, files, name, encoded, transport):
    """``http://host/dir: ✓/sp ace ✓ü.safetensors`` as typed (raw) and as ``quote`` writes it
    (encoded): the same file. A raw name that looks like an escape (``a%20b``) is the escape
    (as curl and requests read it): only its encoded form names that file."""
    http_server.upload_dir(files.parent, "names", "")
    base = http_server.endpoint_url
    path = f"/names/{files.name}/{name}"
    url = base + (urllib.parse.quote(path) if encoded else path)
    opts = LoadOptions(transport=transport, retries=0)
    dst = _zeros()
    if not encoded and "%20" in name:  # "a%20b" raw is "a b", which is not there
        with pytest.raises(asyncload.CheckpointNotFoundError):
            asyncload.load(dst, url, options=opts)
        return
    stats = asyncload.load(dst, url, options=opts)
    _check(dst)
    assert stats.transport == transport
    with asyncload.safe_open(url, options=opts) as f:
        assert torch.equal(f.get_tensor("y"), WANT["y"])


@pytest.mark.parametrize("transport", ["wire", "fsspec"])
def test_s3_keys_hold_any_character(s3_server, files, bucket_name, transport):
    s3_server.upload_dir(files.parent, bucket_name, "p re:fix%")
    for name in NAMES:
        url = f"s3://{bucket_name}/p re:fix%/{files.name}/{name}"
        dst = _zeros()
        asyncload.load(
            dst,
            url,
            storage_options=s3_server.storage_options(),
            options=LoadOptions(transport=transport, retries=0),
        )
        _check(dst)


def test_names_from_inside_a_checkpoint_keep_their_checks(tmp_path):
    """The caller's directory may be named ``hf-2026:01``; the index's own names may not hold
    a scheme-like ``:`` or an escape."""
    d = tmp_path / "hf-2026:01 %41"
    d.mkdir()
    save_file({"x": WANT["x"]}, str(d / "m-1.safetensors"))
    save_file({"y": WANT["y"]}, str(d / "m-2.safetensors"))
    index = {"weight_map": {"x": "m-1.safetensors", "y": "m-2.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = _zeros()
    asyncload.load(dst, d)
    _check(dst)
    for bad in ("c:m-1.safetensors", "m%2F1.safetensors"):
        index["weight_map"]["x"] = bad
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointFormatError, match="is not a plain path inside"):
            asyncload.load(_zeros(), d)
