"""Bounds-checked parsing of the zip archives torch.save writes (stored, never compressed).

Only what asyncload needs: the end-of-central-directory record (zip64 too), the
central directory (name, CRC-32, sizes, local header offset) and local headers (to
find where an entry's bytes start). Every length and offset is checked against the
bytes at hand; a damaged archive raises :class:`CheckpointFormatError`, never an
exception from ``struct`` or an endless loop.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from asyncload.common.errors import CheckpointFormatError

__all__ = [
    "EOCD_SEARCH",
    "LOCAL_HEADER_SIZE",
    "ZipEntry",
    "local_data_start",
    "parse_central_directory",
]

_EOCD = struct.Struct(
    "<IHHHHIIH"
)  # sig, disk, cd disk, entries disk, entries, cd size, cd offset, comment len
_EOCD64_LOC = struct.Struct("<IIQI")  # sig, disk, eocd64 offset, disks
_EOCD64 = struct.Struct(
    "<IQHHIIQQQQ"
)  # sig, size, made, need, disk, cd disk, n disk, n, cd size, cd offset
_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")
_LFH = struct.Struct("<IHHHHHIIIHH")
LOCAL_HEADER_SIZE = _LFH.size  # 30
#: A reader that wants the directory of an archive reads at least this many bytes at its end.
EOCD_SEARCH = 4096

_SIG_EOCD = struct.pack("<I", 0x06054B50)  # b"PK\x05\x06", searched for in the tail
_SIG_EOCD64 = 0x06064B50
_SIG_EOCD64_LOC = 0x07064B50
_SIG_CDH = 0x02014B50
_SIG_LFH = 0x04034B50


class ZipEntry(NamedTuple):
    """One central directory entry (a tuple: parsed for every record of a load)."""

    name: str
    #: Offset of the entry's local header from the start of the archive.
    header_offset: int
    compressed_size: int
    size: int
    crc32: int
    method: int


@dataclass(frozen=True)
class CentralDirectory:
    entries: dict[str, ZipEntry]
    #: Where the central directory starts, relative to the start of the archive.
    cd_offset: int
    cd_size: int


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise CheckpointFormatError(f"{where}: {what}")


def locate_central_directory(
    tail: bytes | memoryview, archive_size: int, where: str
) -> tuple[int, int, int]:
    """From the last bytes of an archive, return ``(cd_offset, cd_size, entries)``.

    ``tail`` holds the final ``len(tail)`` bytes of an archive of ``archive_size`` bytes.
    """
    tail = bytes(tail)
    base = archive_size - len(tail)
    pos = tail.rfind(_SIG_EOCD)
    # a comment could contain the signature: walk back until the record fits exactly
    while pos >= 0:
        if pos + _EOCD.size <= len(tail):
            fields = _EOCD.unpack_from(tail, pos)
            if pos + _EOCD.size + fields[7] == len(tail):
                break
        pos = tail.rfind(_SIG_EOCD, 0, pos)
    _need(
        pos >= 0,
        where,
        "no zip end-of-central-directory record: the record is truncated or not a torch.save "
        "archive",
    )
    _, _, _, _, n, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    if n == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc = pos - _EOCD64_LOC.size
        _need(loc >= 0, where, "zip64 locator missing before the end record")
        sig, _, eocd64_off, _ = _EOCD64_LOC.unpack_from(tail, loc)
        _need(sig == _SIG_EOCD64_LOC, where, "bad zip64 locator signature")
        rel = eocd64_off - base
        _need(
            0 <= rel <= len(tail) - _EOCD64.size,
            where,
            f"zip64 end record at {eocd64_off} lies outside the archive tail",
        )
        f = _EOCD64.unpack_from(tail, rel)
        _need(f[0] == _SIG_EOCD64, where, "bad zip64 end record signature")
        n, cd_size, cd_offset = f[7], f[8], f[9]
    _need(
        cd_offset >= 0 and cd_offset + cd_size <= base + pos,
        where,
        f"central directory [{cd_offset}, {cd_offset + cd_size}) does not fit an archive of "
        f"{archive_size} bytes",
    )
    return cd_offset, cd_size, n


def parse_central_directory(
    cd: bytes | memoryview, n_entries: int, archive_size: int, where: str
) -> CentralDirectory:
    """Parse ``n_entries`` central directory headers from ``cd`` (exactly the directory's bytes)."""
    cd = memoryview(
        cd
    )  # no copy: the directory may be large (up to LoadOptions.max_metadata_size)
    entries: dict[str, ZipEntry] = {}
    pos = 0
    total = len(cd)
    _need(
        n_entries <= total // _CDH.size,
        where,
        f"central directory claims {n_entries} entries in {total} bytes",
    )
    unpack, head = _CDH.unpack_from, _CDH.size
    # the checks below build their messages only when one fails: this loop runs per record
    for _ in range(n_entries):
        if pos + head > total:
            raise CheckpointFormatError(f"{where}: central directory is truncated")
        f = unpack(cd, pos)
        if f[0] != _SIG_CDH:
            raise CheckpointFormatError(f"{where}: bad central directory signature at +{pos}")
        method, crc, csize, usize, nl, el, cl, lho = (
            f[4],
            f[7],
            f[8],
            f[9],
            f[10],
            f[11],
            f[12],
            f[16],
        )
        end = pos + head + nl + el + cl
        if end > total:
            raise CheckpointFormatError(
                f"{where}: central directory entry runs past the directory"
            )
        name = bytes(cd[pos + head : pos + head + nl]).decode("utf-8", "replace")
        if 0xFFFFFFFF in (csize, usize, lho):
            extra = bytes(cd[pos + head + nl : pos + head + nl + el])
            usize, csize, lho = _zip64_extra(extra, usize, csize, lho, where)
        if lho + LOCAL_HEADER_SIZE + csize > archive_size:
            raise CheckpointFormatError(
                f"{where}: entry {name[:200]!r} of {csize} bytes at {lho} runs past the end of the "
                f"{archive_size}-byte archive"
            )
        if method == 0 and csize != usize:
            raise CheckpointFormatError(
                f"{where}: stored entry {name[:200]!r} claims {csize} bytes stored but {usize} "
                f"bytes of data"
            )
        if name in entries:
            raise CheckpointFormatError(
                f"{where}: entry {name[:200]!r} appears twice in the central directory"
            )
        entries[name] = ZipEntry(name, lho, csize, usize, crc, method)
        pos = end
    return CentralDirectory(entries, 0, len(cd))


def _zip64_extra(
    extra: bytes, usize: int, csize: int, lho: int, where: str
) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 0x0001:
            vals = [v[0] for v in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            out = []
            for v in (usize, csize, lho):
                if v == 0xFFFFFFFF:
                    _need(bool(vals), where, "zip64 extra field is too short")
                    out.append(vals.pop(0))
                else:
                    out.append(v)
            return out[0], out[1], out[2]
        pos += 4 + size
    raise CheckpointFormatError(f"{where}: zip64 sizes announced but no zip64 extra field")


def local_data_start(
    head: bytes | memoryview, header_offset: int, expected_name: str, where: str
) -> int | None:
    """Where an entry's bytes start, from its local header.

    ``head`` holds the archive's bytes from ``header_offset`` on (at least the local header).
    Returns ``None`` when ``head`` is too short to tell; raises on a damaged header.
    """
    if len(head) < LOCAL_HEADER_SIZE:
        return None
    f = _LFH.unpack_from(head, 0)
    if f[0] != _SIG_LFH:
        raise CheckpointFormatError(
            f"{where}: no local header for {expected_name!r} at archive offset {header_offset}"
        )
    if f[3] != 0:
        raise CheckpointFormatError(
            f"{where}: entry {expected_name[:200]!r} is compressed (method {f[3]}); torch.save "
            f"stores entries "
            "uncompressed"
        )
    nl, el = f[9], f[10]
    if len(head) < LOCAL_HEADER_SIZE + nl:
        return None
    name = bytes(head[LOCAL_HEADER_SIZE : LOCAL_HEADER_SIZE + nl]).decode("utf-8", "replace")
    if name != expected_name:
        raise CheckpointFormatError(
            f"{where}: local header at {header_offset} names {name[:200]!r}, the directory says "
            f"{expected_name[:200]!r}"
        )
    return header_offset + LOCAL_HEADER_SIZE + nl + el
