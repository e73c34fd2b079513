"""File names a checkpoint gives (DCP ``relative_path``, a safetensors index's
``weight_map``): the one rule for what a checkpoint may name, for every store."""

from __future__ import annotations

import re
from typing import Any

from asyncload._errors import CheckpointFormatError
from asyncload.decoding.vm import short_repr

__all__ = ["check_relative_path"]

_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def check_relative_path(name: Any, what: str) -> str:
    """``name`` as a file of the checkpoint: relative, inside the checkpoint, no tricks.

    Raises CheckpointFormatError for anything but a plain relative path: an absolute path,
    a ``~``, a scheme or drive (``:`` in the first segment), an empty, ``.`` or ``..``
    segment, a backslash, a NUL or control character, or a ``%``-escape that a URL client
    would decode into another path (a hostile ``.metadata`` or index could otherwise point
    a load at any file the process can read)."""
    if type(name) is not str or not name or len(name) > 4096:
        raise CheckpointFormatError(f"{what}: file name {short_repr(name)} is not a relative path")
    bad = (
        name.startswith(("/", "~"))
        or "\\" in name
        or ":" in name.split("/", 1)[0]
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or any(part in ("", ".", "..") for part in name.split("/"))
        or _ESCAPE.search(name) is not None
    )
    if bad:
        raise CheckpointFormatError(
            f"{what}: file name {short_repr(name)} is not a plain path inside the checkpoint; refusing to read it"
        )
    return name
