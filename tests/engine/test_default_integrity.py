"""What each format's damage ends in, by default and with ``verify=True`` (issue 44 item 7).

The table of docs/integrity.md ("What is caught, and when") and README's promise say exactly
this, format by format:

- a file cut short: caught by default, in every format (a ``CheckpointFormatError`` naming
  the file): sizes, offsets and headers are checked on every load;
- one flipped byte inside a tensor's data: caught only with ``verify=True``, and only where the
  format stores a checksum: the CRC-32 of each torch.save record (DCP's default
  ``.distcp`` files, ``torch.save`` files). safetensors files (and DCP saved with
  ``SerializationFormat.SAFETENSORS``) store none: the byte loads, with ``verify`` too;
- a DCP checkpoint or ``torch.save`` file written under
  ``torch.serialization.set_crc32_options(False)`` (every CRC-32 field 0) stores none either:
  it loads with ``verify=True``, ``verified_records`` 0;
- a DCP record saved through torch's ``ZStandard`` stream transform: its decoded archive's
  CRC-32 is always checked, so a flipped byte is caught by default.

Without ``verify`` a flipped data byte loads as it is in the file: the test asserts that the
destination differs from the saved tensor in exactly that byte (nothing else is lost), which
is the documented outcome, not an accident. Checksums stay opt-in because checking them costs
more than 5% of a local load at the page-cache bound (docs/performance.md).

Checkpoints are written by torch's own ``dcp.save``/``torch.save`` and safetensors' own
``save_file``; where a tensor's bytes are is found with the standard library (``zipfile``,
``json``), independently of asyncload's parsers.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import make_checkpoint
from _corrupt import flip_byte, read_metadata, record_of
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import SerializationFormat

import asyncload
from asyncload import CheckpointFormatError, LoadOptions

pytestmark = pytest.mark.timeout(60)

KEY = "w"
#: Small chunks: the 256 KiB tensor is read in pieces, out of order, its CRC combined.
PIECES = LoadOptions(chunk_size=32 << 10, min_chunk_size=8 << 10, concurrency=4, retries=0)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(44)
    return {
        KEY: torch.randn(256, 256, generator=g),  # 256 KiB
        "b": torch.arange(300, dtype=torch.int16),  # a small record, read whole
    }


def _zip_storage_range(path: Path, nbytes: int) -> tuple[int, int, int]:
    """``(start, end, crc32)`` of the one ``data/N`` entry of ``nbytes`` bytes of the
    torch.save archive at ``path`` (absolute offsets in the file)."""
    with zipfile.ZipFile(path) as zf:
        (zi,) = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size == nbytes]
    with open(path, "rb") as f:
        f.seek(zi.header_offset)
        lh = f.read(30)
    start = zi.header_offset + 30 + int.from_bytes(lh[26:28], "little")
    start += int.from_bytes(lh[28:30], "little")
    return start, start + zi.file_size, zi.CRC


def _safetensors_range(path: Path, key: str) -> tuple[int, int]:
    """Absolute ``[start, end)`` of ``key``'s bytes in the safetensors file at ``path``."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    lo, hi = header[key]["data_offsets"]
    return 8 + n + lo, 8 + n + hi


@dataclass(frozen=True)
class Saved:
    """One format's checkpoint: where to load it from, the file holding ``KEY``'s bytes and
    their range, and the CRC-32 the format stores of them (``None``: none)."""

    load_path: Path
    file: Path
    start: int
    end: int
    crc: int | None


def _dcp(tmp: Path, sd: dict[str, torch.Tensor]) -> Saved:
    path = make_checkpoint(tmp / "dcp", sd)
    rec = record_of(path, KEY)
    assert rec.data_start is not None and rec.data_end is not None
    return Saved(path, path / rec.file, rec.data_start, rec.data_end, rec.crc32)


def _dcp_without_crc(tmp: Path, sd: dict[str, torch.Tensor]) -> Saved:
    torch.serialization.set_crc32_options(False)
    try:
        saved = _dcp(tmp, sd)
    finally:
        torch.serialization.set_crc32_options(True)
    assert saved.crc == 0  # torch wrote no checksum
    return Saved(saved.load_path, saved.file, saved.start, saved.end, None)


def _dcp_safetensors(tmp: Path, sd: dict[str, torch.Tensor]) -> Saved:
    path = tmp / "dcp-st"
    writer = dcp.FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)
    make_checkpoint(path, sd, storage_writer=writer)
    (file,) = sorted(path.glob("*.distcp"))
    start, end = _safetensors_range(file, KEY)
    return Saved(path, file, start, end, None)


def _torch_save(tmp: Path, sd: dict[str, torch.Tensor]) -> Saved:
    file = tmp / "model.pt"
    torch.save(sd, file)
    start, end, crc = _zip_storage_range(file, sd[KEY].nbytes)
    return Saved(file, file, start, end, crc)


def _torch_save_without_crc(tmp: Path, sd: dict[str, torch.Tensor]) -> Saved:
    file = tmp / "nocrc.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(sd, file)
    finally:
        torch.serialization.set_crc32_options(True)
    start, end, crc = _zip_storage_range(file, sd[KEY].nbytes)
    assert crc == 0
    with zipfile.ZipFile(file) as zf:
        assert {i.CRC for i in zf.infolist()} == {0}  # torch wrote no checksum at all
    return Saved(file, file, start, end, None)


def _safetensors(tmp: Path, sd: dict[str, torch.Tensor]) -> Saved:
    file = tmp / "model.safetensors"
    save_file(sd, str(file))
    start, end = _safetensors_range(file, KEY)
    return Saved(file, file, start, end, None)


FORMATS: dict[str, Callable[[Path, dict[str, torch.Tensor]], Saved]] = {
    "dcp": _dcp,
    "dcp-no-crc": _dcp_without_crc,
    "dcp-safetensors": _dcp_safetensors,
    "torch.save": _torch_save,
    "torch.save-no-crc": _torch_save_without_crc,
    "safetensors": _safetensors,
}
#: The documented outcome of one flipped data byte with verify=True: caught where the
#: format stores a CRC-32 of the record.
CAUGHT_WITH_VERIFY = {"dcp": True, "torch.save": True}


def _load(saved: Saved, options: LoadOptions) -> tuple[dict[str, torch.Tensor], int]:
    dest = {k: torch.zeros_like(v) for k, v in _state().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = asyncload.load(dest, saved.load_path, options=options)
    return dest, stats.verified_records


def _changed_bytes(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    a = got.reshape(-1).view(torch.uint8)
    b = want.reshape(-1).view(torch.uint8)
    return (a != b).nonzero().reshape(-1).tolist()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_intact_checkpoint_loads_bit_exact_with_and_without_verify(
    tmp_path: Path, fmt: str
) -> None:
    sd = _state()
    saved = FORMATS[fmt](tmp_path, sd)
    for options in (LoadOptions(), PIECES.replace(verify=True)):
        dest, verified = _load(saved, options)
        for k, v in sd.items():
            assert torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8)), (fmt, k)
        # both tensors' records are checked where the format stores checksums, none elsewhere
        assert verified == (2 if options.verify and CAUGHT_WITH_VERIFY.get(fmt) else 0)


@pytest.mark.parametrize("options", [LoadOptions(), PIECES], ids=["whole", "pieces"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_flipped_data_byte_is_caught_only_with_verify_where_the_format_has_a_crc(
    tmp_path: Path, fmt: str, options: LoadOptions
) -> None:
    sd = _state()
    saved = FORMATS[fmt](tmp_path, sd)
    pos = saved.start + (saved.end - saved.start) // 3
    flip_byte(saved.file, pos, 0x10)

    # by default: never caught, in any format; the byte loads as it is in the file, and
    # nothing else differs
    dest, verified = _load(saved, options)
    assert verified == 0
    assert _changed_bytes(dest[KEY], sd[KEY]) == [pos - saved.start]
    assert torch.equal(dest["b"], sd["b"])
    if fmt == "torch.save":  # torch.load does not check the CRC-32s either (docs say so)
        theirs = torch.load(saved.file, weights_only=True)
        assert _changed_bytes(theirs[KEY], sd[KEY]) == [pos - saved.start]

    # with verify=True: caught where the format stores a CRC-32, naming file, key, range
    if CAUGHT_WITH_VERIFY.get(fmt):
        assert saved.crc is not None
        with pytest.raises(CheckpointFormatError) as err:
            _load(saved, options.replace(verify=True))
        msg = str(err.value)
        assert "checksum mismatch" in msg
        assert saved.file.name in msg
        assert f"key {KEY!r}" in msg
        assert f"tensor bytes [{saved.start}, {saved.end})" in msg
        assert f"the record says {saved.crc:#010x}" in msg
    else:  # no checksum stored: verify has nothing to check the byte against
        dest, verified = _load(saved, options.replace(verify=True))
        assert verified == 0
        assert _changed_bytes(dest[KEY], sd[KEY]) == [pos - saved.start]


@pytest.mark.parametrize("verify", [False, True], ids=["default", "verify"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_truncated_file_is_caught_by_default_in_every_format(
    tmp_path: Path, fmt: str, verify: bool
) -> None:
    sd = _state()
    saved = FORMATS[fmt](tmp_path, sd)
    os.truncate(saved.file, os.path.getsize(saved.file) - 1)
    with pytest.raises(CheckpointFormatError) as err:
        _load(saved, LoadOptions(verify=verify))
    assert saved.file.name in str(err.value)


@pytest.mark.parametrize("fmt", ["safetensors", "dcp-safetensors"])
def test_a_safetensors_header_pointing_past_the_file_is_caught_by_default(
    tmp_path: Path, fmt: str
) -> None:
    sd = _state()
    saved = FORMATS[fmt](tmp_path, sd)
    raw = saved.file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    lo, hi = header[KEY]["data_offsets"]
    far = len(raw) + 4096
    header[KEY]["data_offsets"] = [lo + far, hi + far]  # same length, out of the file
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    saved.file.write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(CheckpointFormatError) as err:
        _load(saved, LoadOptions())
    assert saved.file.name in str(err.value)


def test_a_flipped_byte_in_a_compressed_dcp_record_is_caught_by_default(tmp_path: Path) -> None:
    """Records DCP saved through a stream transform (torch's ``ZStandard``) are decoded whole
    and their CRC-32 is always checked: zstd frames carry no checksum of their own, so a
    flipped byte may decode to other bytes without an error."""
    from torch.distributed.checkpoint._extension import ZStandard

    assert ZStandard.is_available()  # zstandard is in the test extra
    sd = _state()
    path = tmp_path / "dcp-zstd"
    make_checkpoint(path, sd, storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]))
    md = read_metadata(path)
    info = next(v for i, v in md.storage_data.items() if i.fqn == KEY)
    flip_byte(path / info.relative_path, info.offset + info.length // 2, 0x10)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(CheckpointFormatError) as err:
        asyncload.load(dest, path)  # verify left at its default, False
    assert info.relative_path in str(err.value)
    assert repr(KEY) in str(err.value)
    assert not dest[KEY].view(torch.uint8).any()  # nothing of the damaged record landed


def test_a_compressed_dcp_record_saved_without_crcs_loads(tmp_path: Path) -> None:
    """The same record written under ``set_crc32_options(False)``: no checksum stored, so
    none is checked (it used to fail every load with "the record says 0x00000000")."""
    from torch.distributed.checkpoint._extension import ZStandard

    sd = _state()
    path = tmp_path / "dcp-zstd-no-crc"
    torch.serialization.set_crc32_options(False)
    try:
        writer = dcp.FileSystemWriter(path, _extensions=[ZStandard()])
        make_checkpoint(path, sd, storage_writer=writer)
    finally:
        torch.serialization.set_crc32_options(True)
    for verify in (False, True):
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        stats = asyncload.load(dest, path, options=LoadOptions(verify=verify))
        for k, v in sd.items():
            assert torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8)), k
        assert stats.verified_records == 0
