"""Hugging Face safetensors headers: parsed with bounds checks, each tensor a
:class:`~asyncload.formats.location.TensorLocation` (the part of :mod:`.safetensors` that
needs neither ``torch.distributed.checkpoint`` nor the other formats: ``asyncload.safe_open``
imports only this).

A safetensors blob is ``u64 little-endian N`` + ``N`` bytes of UTF-8 JSON + the data
region. The JSON maps each key to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data region) and may hold ``"__metadata__"`` (str -> str).
Everything a hostile or damaged header could get wrong is checked before a byte of
tensor data is read: the header length against the blob and ``max_header_size``, the
JSON (duplicate keys too), known dtypes, non-negative integer shapes, offsets inside
the data region, ``shape x itemsize == end - begin``, and tensors that do not overlap.
Any failure is :class:`~asyncload.CheckpointFormatError`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncload.common.errors import CheckpointFormatError
from asyncload.formats.location import TensorLocation

__all__ = [
    "DCP_SHARDING_INFO_KEY",
    "HEADER_PROBE",
    "MAX_HEADER_SIZE",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "aread_header",
    "header_length",
    "looks_like_safetensors",
    "parse_header",
]

#: The safetensors dtype names torch can hold (the ``safetensors`` package's own table,
#: plus the newer 8-bit exponent type where torch has it).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

#: The safetensors package refuses headers above 100 MB; so do we (unless
#: ``LoadOptions.max_metadata_size`` is smaller).
MAX_HEADER_SIZE = 100_000_000
#: Bytes read at a blob's start in the first request; most headers fit.
HEADER_PROBE = 64 * 1024
#: ``__metadata__`` key torch's DCP safetensors writers use for each tensor's chunk offsets.
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
#: Dimensions accepted in a shape (hostile-input guard; torch allows 64).
_MAX_DIMS = 64


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: where each tensor's bytes are in file ``name``."""

    #: File name relative to the checkpoint root.
    name: str
    #: Absolute offset of the blob (its 8-byte length prefix) in the file.
    base: int
    #: ``N``, the JSON header's length in bytes.
    header_size: int
    #: Absolute offset of the data region: ``base + 8 + N``.
    data_start: int
    #: Bytes of the data region.
    data_size: int
    #: Key -> location, in header order.
    tensors: dict[str, TensorLocation] = field(default_factory=dict)
    #: ``__metadata__`` (str -> str).
    metadata: dict[str, str] = field(default_factory=dict)
    #: For messages, e.g. ``"s3://b/model.safetensors"``.
    where: str = ""
    #: Whether the header has a ``__metadata__`` entry at all (``safe_open(...).metadata()``
    #: is ``None`` without one, ``{}`` for an empty one).
    has_metadata: bool = False

    def sharding_offsets(self) -> dict[str, tuple[int, ...]]:
        """Chunk offsets torch's DCP safetensors writers record (``DCP_SHARDING_INFO``), by key.

        Empty when the file has none. Raised: CheckpointFormatError when it is malformed.
        """
        raw = self.metadata.get(DCP_SHARDING_INFO_KEY)
        if raw is None:
            return {}
        try:
            info = json.loads(raw, object_pairs_hook=_no_duplicates)
        except (ValueError, RecursionError) as exc:
            raise CheckpointFormatError(
                f"{self.where}: {DCP_SHARDING_INFO_KEY} is not valid JSON: {exc}"[:500]
            ) from exc
        if not isinstance(info, dict):
            raise CheckpointFormatError(
                f"{self.where}: {DCP_SHARDING_INFO_KEY} is not a JSON object"
            )
        out: dict[str, tuple[int, ...]] = {}
        for key, entry in info.items():
            loc = self.tensors.get(key)
            if loc is None:
                continue  # describes a tensor this blob does not hold: nothing to place
            offs = entry.get("saved_offsets") if isinstance(entry, dict) else None
            if (
                not isinstance(offs, list)
                or len(offs) != len(loc.size)
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            ):
                raise CheckpointFormatError(
                    f"{self.where}: {DCP_SHARDING_INFO_KEY} gives tensor {key!r} of "
                    f"shape {list(loc.size)} the malformed offsets {offs!r:.100}"
                )
            out[key] = tuple(offs)
        return out


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r:.200}")
        out[k] = v
    return out


def _bad(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where}: {what}")


def looks_like_safetensors(head: bytes | memoryview, blob_size: int) -> bool:
    """Whether a blob's first bytes could be a safetensors header (for format sniffing)."""
    head = bytes(head[:9])
    if len(head) < 9:
        return False
    (n,) = struct.unpack_from("<Q", head)
    return 2 <= n <= blob_size - 8 and head[8:9] == b"{"


def header_length(
    first8: bytes | memoryview,
    *,
    blob_size: int,
    where: str,
    max_header_size: int = MAX_HEADER_SIZE,
) -> int:
    """``N`` from a blob's first 8 bytes, checked against the blob's size and the limit.

    Raised: CheckpointFormatError when the blob is too small, or ``N`` is 0, above
    ``max_header_size`` or runs past the blob.
    """
    if blob_size < 8 or len(first8) < 8:
        raise _bad(
            where,
            f"{blob_size} bytes is too small to be a safetensors file (no 8-byte header length)",
        )
    (n,) = struct.unpack_from("<Q", bytes(first8[:8]))
    limit = min(max_header_size, MAX_HEADER_SIZE)
    if n < 2:
        raise _bad(where, f"safetensors header length {n} is too small to hold a JSON object")
    if n > limit:
        raise _bad(
            where,
            f"safetensors header of {n} bytes exceeds the {limit} allowed "
            "(LoadOptions.max_metadata_size): the file is damaged or not safetensors",
        )
    if 8 + n > blob_size:
        raise _bad(
            where,
            f"safetensors header of {n} bytes runs past the end of the {blob_size}-byte file: "
            "the file is truncated or not safetensors",
        )
    return n


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(
    raw: bytes | memoryview, *, name: str, base: int, blob_size: int, where: str = ""
) -> SafetensorsHeader:
    """Parse ``N`` header bytes (``raw``) of a blob of ``blob_size`` bytes starting at ``base`` of
    file ``name``.

    Raised: CheckpointFormatError for anything malformed (see the module docstring).
    """
    where = where or name
    n = len(raw)
    data_start = base + 8 + n
    data_size = blob_size - 8 - n
    if data_size < 0:
        raise _bad(where, "safetensors header runs past the end of the file")
    raw_b = bytes(raw)
    if not raw_b.startswith(b"{"):
        raise _bad(where, "safetensors header does not start with '{': not a safetensors file")
    try:
        text = raw_b.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError as exc:
        raise _bad(where, "safetensors header is nested too deeply") from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _bad(where, f"safetensors header is not valid UTF-8 JSON: {exc}"[:500]) from exc
    if not isinstance(header, dict):
        raise _bad(where, f"safetensors header is a JSON {type(header).__name__}, not an object")
    metadata: dict[str, str] = {}
    md = header.pop("__metadata__", None)
    if md is not None:
        if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
            raise _bad(where, "safetensors __metadata__ must map strings to strings")
        metadata = dict(md)
    tensors: dict[str, TensorLocation] = {}
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if not isinstance(info, dict):
            raise _bad(where, f"safetensors entry {key!r:.200} is not an object")
        dtype_name = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
            raise _bad(
                where,
                f"tensor {key!r:.200} has dtype {dtype_name!r:.50}, which asyncload cannot hold "
                f"(known: {', '.join(sorted(SAFETENSORS_DTYPES))})",
            )
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(_int(s) and s >= 0 for s in shape)
        ):
            raise _bad(where, f"tensor {key!r:.200} has a malformed shape {shape!r:.100}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_int(o) for o in offs):
            raise _bad(where, f"tensor {key!r:.200} has malformed data_offsets {offs!r:.100}")
        begin, end = offs
        if not 0 <= begin <= end <= data_size:
            raise _bad(
                where,
                f"tensor {key!r:.200} has data_offsets [{begin}, {end}) outside the "
                f"{data_size}-byte data region",
            )
        dtype = SAFETENSORS_DTYPES[dtype_name]
        itemsize = dtype.itemsize
        if math.prod(shape) * itemsize != end - begin:
            raise _bad(
                where,
                f"tensor {key!r:.200} of shape {shape} and dtype {dtype_name} needs "
                f"{math.prod(shape) * itemsize} bytes, its data_offsets span {end - begin}",
            )
        stride: list[int] = []
        acc = 1
        for s in reversed(shape):
            stride.append(acc)
            acc *= max(1, s)
        loc = TensorLocation(
            name=name,
            data_start=data_start + begin,
            storage_nbytes=end - begin,
            dtype=dtype,
            size=tuple(shape),
            stride=tuple(reversed(stride)),
            storage_offset=0,
            crc32=None,
            where=f"tensor {key!r} at [{data_start + begin}, {data_start + end}) of {where}",
        )
        tensors[key] = loc
        spans.append((begin, end, key))
    # ordered and non-overlapping (empty tensors hold no bytes and may sit anywhere)
    spans.sort()
    prev_end, prev_key = 0, ""
    for begin, end, key in spans:
        if end == begin:
            continue
        if begin < prev_end:
            raise _bad(
                where, f"tensors {prev_key!r:.200} and {key!r:.200} overlap in the data region"
            )
        prev_end, prev_key = end, key
    return SafetensorsHeader(
        name=name,
        base=base,
        header_size=n,
        data_start=data_start,
        data_size=data_size,
        tensors=tensors,
        metadata=metadata,
        where=where,
        has_metadata=md is not None,
    )


Fetch = Callable[[int, int], Awaitable[bytes | bytearray | memoryview]]


async def aread_header(
    fetch: Fetch,
    *,
    name: str,
    base: int,
    blob_size: int,
    where: str = "",
    max_header_size: int = MAX_HEADER_SIZE,
    head: bytes | memoryview | None = None,
) -> SafetensorsHeader:
    """Read and parse the header of the blob at ``[base, base + blob_size)`` of file ``name``.

    ``fetch(start, end)`` reads absolute file bytes. One request when the header fits
    in :data:`HEADER_PROBE` bytes (or in ``head``, bytes already read from ``base``), two otherwise.
    """
    where = where or name
    first = bytes(head) if head is not None else b""
    if len(first) < 8:
        first = bytes(await fetch(base, base + min(blob_size, HEADER_PROBE)))
    n = header_length(first, blob_size=blob_size, where=where, max_header_size=max_header_size)
    if len(first) < 8 + n:
        rest = await fetch(base + len(first), base + 8 + n)
        first = first + bytes(rest)
    return parse_header(
        memoryview(first)[8 : 8 + n], name=name, base=base, blob_size=blob_size, where=where
    )
