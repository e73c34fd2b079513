"""What the commands share: options from the command line (:func:`_options`), the
checkpoint's metadata and its description (:func:`read_metadata`, :func:`describe`), the
stream the commands read through, and output to a terminal with every control character
of a checkpoint's text escaped (:func:`_print`, :func:`_note`, :func:`_table`).

Raised: :class:`~asyncload.cli._args.UsageError` for options the library refuses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
from collections.abc import Iterator
from typing import Any

from asyncload.cli._args import UsageError
from asyncload.common.errors import redact_url


def _fmt_bytes(n: float) -> str:
    from asyncload.common.stats import _fmt_bytes as fmt

    return fmt(n)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _options(args: argparse.Namespace, **extra: Any) -> Any:
    from asyncload.common.options import LoadOptions

    changes: dict[str, Any] = {}
    for arg, field in (
        ("concurrency", "concurrency"),
        ("chunk_size", "chunk_size"),
        ("timeout", "timeout"),
        ("min_chunk_size", "min_chunk_size"),
        ("budget", "memory_budget"),
        ("retries", "retries"),
        ("max_over_read_ratio", "max_over_read_ratio"),
        ("transport", "transport"),
    ):
        if hasattr(args, arg):  # given on the command line (the knobs default to "absent")
            changes[field] = getattr(args, arg)
    changes.update(extra)
    base = LoadOptions()
    # a chunk size below the default min_chunk_size lowers it too, as the planner does
    if (
        "chunk_size" in changes
        and "min_chunk_size" not in changes
        and base.min_chunk_size > changes["chunk_size"]
    ):
        changes["min_chunk_size"] = changes["chunk_size"]
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as exc:
        text = str(exc)
        for field, flag in (
            ("memory_budget", "--budget"),
            ("min_chunk_size", "--min-chunk-size"),
            ("chunk_size", "--chunk-size"),
            ("concurrency", "--concurrency"),
            ("timeout", "--timeout"),
            ("retries", "--retries"),
        ):
            text = text.replace(f"LoadOptions.{field}=", f"{flag} ").replace(
                f"{field}=", f"{flag} "
            )
        raise UsageError(text) from None


def read_metadata(url: str, storage_options: dict[str, Any], options: Any = None) -> Any:
    """The checkpoint's DCP ``Metadata``, decoded with asyncload's allow-list."""
    from asyncload.faces.dcp_reader import PipelinedReader

    reader = PipelinedReader(url, options=options, storage_options=storage_options)
    try:
        with _naming_storage_options(storage_options):
            return reader.read_metadata()
    finally:
        reader.close()


def describe(metadata: Any, url: str) -> dict[str, Any]:
    """What ``inspect --json`` prints: keys, dtypes, shapes, shards, files, bytes, DCP version."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored_by_key: dict[str, int] = {}
    files: dict[str, dict[str, int]] = {}
    for index, info in (metadata.storage_data or {}).items():
        fqn = getattr(index, "fqn", str(index))
        stored_by_key[fqn] = stored_by_key.get(fqn, 0) + int(info.length)
        f = files.setdefault(str(info.relative_path), {"records": 0, "bytes": 0, "end": 0})
        f["records"] += 1
        f["bytes"] += int(info.length)
        f["end"] = max(f["end"], int(info.offset) + int(info.length))
    keys: list[dict[str, Any]] = []
    tensor_bytes = 0
    by_dtype: dict[str, int] = {}
    for fqn, smd in metadata.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            dtype = smd.properties.dtype
            nbytes = math.prod(smd.size) * dtype.itemsize
            tensor_bytes += nbytes
            by_dtype[_dtype_name(dtype)] = by_dtype.get(_dtype_name(dtype), 0) + nbytes
            keys.append(
                {
                    "key": fqn,
                    "kind": "tensor",
                    "dtype": _dtype_name(dtype),
                    "shape": list(smd.size),
                    "shards": len(smd.chunks),
                    "nbytes": nbytes,
                    "stored_bytes": stored_by_key.get(fqn, 0),
                    "chunks": [
                        {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in smd.chunks
                    ],
                }
            )
        else:
            keys.append({"key": fqn, "kind": "object", "stored_bytes": stored_by_key.get(fqn, 0)})
    return {
        "checkpoint": redact_url(url),
        "format": getattr(metadata, "format", "dcp"),
        "dcp_version": getattr(metadata, "version", None),
        "tensors": sum(1 for k in keys if k["kind"] == "tensor"),
        "objects": sum(1 for k in keys if k["kind"] == "object"),
        "tensor_bytes": tensor_bytes,
        "tensor_bytes_by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        "stored_bytes": sum(f["bytes"] for f in files.values()),
        # the files a load reads, as LoadStats.files counts them: the data files and a DCP .metadata
        "file_count": len(files) + (1 if getattr(metadata, "format", "dcp") == "dcp" else 0),
        "keys": keys,
        "files": [
            {"name": name, "records": f["records"], "bytes": f["bytes"]}
            for name, f in sorted(files.items())
        ],
    }


def _table(rows: list[list[str]], right: set[int]) -> str:
    rows = [[_one_line(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


#: Characters a terminal acts on rather than shows (C0 and C1 controls: ESC starts a
#: sequence that can retitle the window or move the cursor, CR and LF forge lines), line and
#: paragraph separators, bidirectional overrides, and lone surrogates (which stdout cannot encode).
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _one_line(text: str) -> str:
    """``text`` (a key, a file name, a message: what a checkpoint says) for one line of a
    terminal: every control character escaped (ESC as ``\\x1b``, LF as ``\\x0a``, ``\\u202e``)."""
    return _CONTROL.sub(_escape_char, text)


def _shown(text: str) -> str:
    return "\n".join(_one_line(line) for line in text.split("\n"))


def _print(text: str = "") -> None:
    """One or more lines to stdout, control characters escaped (the line breaks the CLI
    writes itself are kept; checkpoint text inside a line goes through :func:`_one_line`
    first). JSON output is unchanged: ``json.dumps`` leaves no control character raw."""
    sys.stdout.write(_shown(text) + "\n")
    sys.stdout.flush()


def _note(text: str) -> None:
    sys.stderr.write(_shown(text) + "\n")
    sys.stderr.flush()


def _open_stream(
    args: argparse.Namespace,
    storage_options: dict[str, Any],
    options: Any,
    metadata_cache: dict[Any, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """A :class:`CheckpointStream` over ``args.url`` with its metadata read (claims not checked
    yet)."""
    from asyncload.faces.streaming import CheckpointStream

    stream = CheckpointStream(
        args.url,
        options=options,
        storage_options=storage_options,
        metadata_cache=metadata_cache,
        **kwargs,
    )
    try:
        with _naming_storage_options(storage_options):
            md = _run(stream, stream.aopen(check=False))
    except BaseException:
        _run(stream, stream.aclose())
        raise
    return stream, md


@contextlib.contextmanager
def _naming_storage_options(storage_options: dict[str, Any]) -> Iterator[None]:
    """A ``TypeError``/``ValueError`` of the client that the storage options were given to
    (a value of the wrong type: ``-o config_kwargs=[1]``) becomes a usage error naming them."""
    from asyncload.common.errors import AsyncLoadError

    try:
        yield
    except (TypeError, ValueError) as exc:
        if isinstance(exc, AsyncLoadError) or not storage_options:
            raise
        given = ", ".join(storage_options)  # the names only: a value may be a secret
        raise UsageError(
            f"the storage client refused a --storage-option value (given: {given}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _run(stream: Any, coro: Any) -> Any:
    """``coro`` of ``stream`` on the library's loop thread (Ctrl-C cancels it and waits for its
    cleanup)."""
    from asyncload.common.loop import loop_thread, run_sync

    return run_sync(coro, loop_thread(stream.options.use_uvloop))


def _bar(args: argparse.Namespace, label: str, total: int, unit: str = "bytes") -> Any:
    from asyncload.faces.progress import ByteProgress

    return ByteProgress(label, total=total, unit=unit, enabled=False if args.no_progress else None)
