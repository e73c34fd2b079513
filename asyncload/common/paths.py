"""File names a checkpoint gives (DCP ``relative_path``, a safetensors index's
``weight_map``): the one rule for what a checkpoint may name, for every store; and
:func:`short_repr`, the one way a message shows a value that came from a checkpoint."""

from __future__ import annotations

import re
import reprlib
from typing import Any

from asyncload.common.errors import CheckpointFormatError

__all__ = ["check_relative_path", "short_repr"]

_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = 80
        self.maxother = 60
        self.maxlong = 40

    def repr_instance(self, x: Any, level: int) -> str:  # never call a hostile object's __repr__
        return f"<{type(x).__name__}>"


_short = _ShortRepr()


def short_repr(obj: Any) -> str:
    """A bounded ``repr`` of a value from a checkpoint, safe on hostile objects
    (deep, huge, self-referencing or sharing-heavy): at most a few hundred characters."""
    try:
        text = _short.repr(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text[:300]


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
            f"{what}: file name {short_repr(name)} is not a plain path inside the checkpoint; "
            f"refusing to read it"
        )
    return name
