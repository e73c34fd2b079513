"""Hand-made safetensors files for the hostile-header tests (tests/formats/test_safetensors.py,
tests/faces/test_safe_open.py): a header (JSON, or raw bytes) with its length prefix, then data."""

from __future__ import annotations

import json
import struct
from typing import Any

#: One well-formed 2x2 float32 entry.
GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


def st_blob(
    header: Any, data: bytes = b"", raw_header: bytes | None = None, length: int | None = None
) -> bytes:
    """A safetensors file: ``header`` as JSON (or ``raw_header`` as given), prefixed with its
    length (or ``length``, to forge it), then ``data``."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data
