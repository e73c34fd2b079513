"""Helpers for the integrity, hostile-input, fuzz and robustness tests: where a saved
tensor's bytes are (found with the standard library's ``zipfile``, independently of
asyncload's own parser), rewriting ``.metadata``, destinations filled with a sentinel.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "SENTINEL",
    "RecordInfo",
    "flip_byte",
    "is_sentinel",
    "mutate_metadata",
    "read_metadata",
    "record_of",
    "records",
    "sentinel_like",
    "write_metadata",
]

#: Every byte of a sentinel destination: loads must overwrite it, failed loads must not.
SENTINEL = 0xA5


@dataclass(frozen=True)
class RecordInfo:
    """One saved item of a DCP checkpoint (a torch.save archive inside a .distcp file)."""

    fqn: str
    file: str
    #: The record's byte range in ``file`` (from .metadata).
    offset: int
    length: int
    #: For tensor records: the storage's bytes in ``file`` (absolute, half-open), and its
    #: CRC-32 from the record's central directory.
    data_start: int | None = None
    data_end: int | None = None
    crc32: int | None = None


def read_metadata(ckpt: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's .metadata, with plain ``pickle`` (the tests wrote it: trusted)."""
    with open(Path(ckpt) / ".metadata", "rb") as f:
        return pickle.load(f)


def write_metadata(ckpt: str | os.PathLike[str], md: Any, *, raw: bytes | None = None) -> None:
    """Replace the checkpoint's .metadata with ``md`` pickled (or with ``raw`` bytes)."""
    data = raw if raw is not None else pickle.dumps(md)
    (Path(ckpt) / ".metadata").write_bytes(data)


def records(ckpt: str | os.PathLike[str]) -> dict[str, RecordInfo]:
    """Every record of the checkpoint by key (the first chunk's record for chunked keys)."""
    md = read_metadata(ckpt)
    out: dict[str, RecordInfo] = {}
    for idx, info in md.storage_data.items():
        path = Path(ckpt) / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        zf = zipfile.ZipFile(io.BytesIO(blob))
        data_entries = [i for i in zf.infolist() if "/data/" in i.filename]
        if len(data_entries) == 1:
            zi = data_entries[0]
            # the local header: 30 bytes + name + extra, then the data
            lh = blob[zi.header_offset : zi.header_offset + 30]
            nl = int.from_bytes(lh[26:28], "little")
            el = int.from_bytes(lh[28:30], "little")
            start = info.offset + zi.header_offset + 30 + nl + el
            rec = RecordInfo(
                idx.fqn,
                info.relative_path,
                info.offset,
                info.length,
                start,
                start + zi.file_size,
                zi.CRC,
            )
        else:
            rec = RecordInfo(idx.fqn, info.relative_path, info.offset, info.length)
        out.setdefault(idx.fqn, rec)
    return out


def record_of(ckpt: str | os.PathLike[str], fqn: str) -> RecordInfo:
    return records(ckpt)[fqn]


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0x01) -> None:
    """XOR one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def sentinel_like(obj: Any, *, keep_objects: bool = True) -> Any:
    """``obj``'s tree with every tensor replaced by a fresh one filled with ``SENTINEL`` bytes."""
    if isinstance(obj, torch.Tensor):
        t = torch.empty(obj.shape, dtype=obj.dtype)
        if t.numel():
            t.reshape(-1).view(torch.uint8).fill_(SENTINEL)
        return t
    if isinstance(obj, dict):
        return {k: sentinel_like(v, keep_objects=keep_objects) for k, v in obj.items()}
    return obj if keep_objects else None


def is_sentinel(obj: Any) -> bool:
    """Whether every tensor in ``obj`` still holds only ``SENTINEL`` bytes (untouched)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() == 0 or bool(
            (obj.contiguous().reshape(-1).view(torch.uint8) == SENTINEL).all()
        )
    if isinstance(obj, dict):
        return all(is_sentinel(v) for v in obj.values())
    return True


def mutate_metadata(ckpt: str | os.PathLike[str], fn: Callable[[Metadata], None]) -> None:
    md = read_metadata(ckpt)
    fn(md)
    write_metadata(ckpt, md)
