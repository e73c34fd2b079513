"""The command line's vocabulary: exit statuses (:data:`EXIT_CODES`), sizes and storage
options as typed on it (:func:`parse_size`, :func:`parse_storage_options`), the argument
types of each option, and :class:`UsageError` (exit status 2).

Raised: :class:`UsageError` (a ``ValueError``) for a value the command line cannot take.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from typing import Any

EXIT_OK = 0


EXIT_LOAD_ERROR = 1


EXIT_USAGE = 2


EXIT_DAMAGED = 3


EXIT_NOT_FOUND = 4


EXIT_INTERRUPTED = 130


#: Exit status -> meaning (printed by ``asyncload --help``, documented in docs/cli.md).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success (for verify: every record checked out)",
    EXIT_LOAD_ERROR: "the load failed: storage error, timeout, mismatch or an unexpected error",
    EXIT_USAGE: "usage error: unknown option or invalid value",
    EXIT_DAMAGED: "the checkpoint is damaged (bad checksum, truncated, corrupt) or unsafe",
    EXIT_NOT_FOUND: "the checkpoint or one of its files does not exist",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM)",
}


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


class UsageError(ValueError):
    """Raised by the argument parsers when a value cannot be used (exit status 2)."""


def parse_size(text: str) -> int:
    """``"16MiB"`` -> 16777216. Accepts a plain byte count, binary units (``K``, ``KiB``,
    ``M``, ``MiB``, ``G``, ``GiB``, ``T``, ``TiB``) and decimal ones (``KB``, ``MB``, ``GB``, ``TB``),
    case-insensitive, with an optional fraction (``1.5GiB``). Raised: ValueError when the
    text is not a size or is not a positive whole number of bytes."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 512KiB, 16MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != math.floor(value) or value <= 0:
        raise ValueError(f"{text!r} is not a positive whole number of bytes")
    return int(value)


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``["endpoint_url=http://h:9000", "anon=true", "config_kwargs.max_pool_connections=64"]``
    -> ``{"endpoint_url": "http://h:9000", "anon": True, "config_kwargs": {"max_pool_connections": 64}}``.

    Values are parsed as JSON when they can be (numbers, true/false/null, objects,
    lists), else kept as strings; dots in a key nest dictionaries. Raised: ValueError
    when an item has no ``=`` or an empty key."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"--storage-option {item!r} is not key=value")
        try:
            value: Any = json.loads(raw)
        except ValueError as exc:
            if raw.lstrip().startswith(
                ("{", "[", '"')
            ):  # meant as JSON: say so rather than pass a string on
                raise ValueError(
                    f"--storage-option {item!r}: the value of {key!r} is not valid JSON ({exc})"
                ) from None
            value = raw
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--storage-option {item!r}: {part!r} was already given a value")
            node = child
        node[parts[-1]] = value
    return out


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _concurrency_arg(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of reads or 'auto'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 read must be in flight")
    return n


def _ratio_arg(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a ratio (e.g. 1.15) or 'none'"
        ) from None
    if not v >= 1 or math.isinf(v):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the ratio of bytes read to bytes needed is at least 1"
        )
    return v


def _timeout_arg(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds or 'none'"
        ) from None
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return v


def _count_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return n


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit status 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
