"""The ``asyncload`` command (also ``python -m asyncload``): inspect, load and verify checkpoints.

::

    asyncload inspect URL [--json]
    asyncload load URL [--concurrency N|auto] [--chunk-size 16MiB] [--min-chunk-size 1MiB]
                       [--timeout S] [--budget 512MiB] [--retries N] [--verify] [--compare-torch] [--json]
    asyncload verify URL
    asyncload convert URL DST [--max-shard-size 5GB] [--keys KEY ...] [--force]

Every command takes ``--storage-option key=value`` (repeatable; values parsed as JSON
when they can be, ``a.b=v`` nests) for remote URLs, ``-v``/``-vv`` for the library's
log, and ``--debug`` for tracebacks. Sizes accept ``4096``, ``16MiB``, ``1GiB``,
``1.5G`` (binary units; ``KB``/``MB``/``GB`` are decimal). Progress bars go to stderr
and only when it is a terminal; results go to stdout.

Exit status (see :data:`EXIT_CODES`): 0 success, 1 the load failed (storage, timeout,
mismatch, anything else), 2 usage error (bad option or value), 3 the checkpoint is
damaged or unsafe, 4 the checkpoint (or one of its files) does not exist, 130 interrupted.

``load`` and ``verify`` read through :class:`asyncload._stream.CheckpointStream`, the core of
``read_state_dict`` and ``iter_tensors``: what the metadata claims is checked against the
files' sizes before any tensor is allocated, and ``verify`` allocates batch by batch
(within ``--budget``); ``convert`` streams through it too. ``--compare-torch`` uses torch's
own readers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from asyncload._errors import redact_url
from asyncload.storage import is_local, local_root

__all__ = ["EXIT_CODES", "main", "parse_size", "parse_storage_options"]

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
            if raw.lstrip().startswith(("{", "[", '"')):  # meant as JSON: say so rather than pass a string on
                raise ValueError(f"--storage-option {item!r}: the value of {key!r} is not valid JSON ({exc})") from None
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


# --- argument parsing -------------------------------------------------------------------


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
        raise argparse.ArgumentTypeError(f"{text!r} is not a ratio (e.g. 1.15) or 'none'") from None
    if not v >= 1 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"{text!r}: the ratio of bytes read to bytes needed is at least 1")
    return v


def _timeout_arg(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds or 'none'") from None
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


def _parser() -> argparse.ArgumentParser:
    from asyncload import __version__

    common = _Parser(add_help=False)
    common.add_argument(
        "url",
        metavar="URL",
        help="checkpoint directory: a local path, file:// URL or fsspec URL (s3://bucket/prefix, gs://..., http://...)",
    )
    common.add_argument(
        "--storage-option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the fsspec filesystem of a remote URL (repeatable; values parsed as JSON "
        "when possible, dotted keys nest: client_kwargs.region_name=eu-west-1)",
    )
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log the library's INFO lines (-vv: DEBUG, one line per read request) to stderr",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors (implies -vv)")

    knobs = _Parser(add_help=False, argument_default=argparse.SUPPRESS)
    g = knobs.add_argument_group("load options (defaults: asyncload.LoadOptions)")
    g.add_argument("--concurrency", "-c", type=_concurrency_arg, metavar="N|auto", help="reads in flight")
    g.add_argument("--chunk-size", type=_size_arg, metavar="SIZE", help="largest single read, e.g. 16MiB")
    g.add_argument(
        "--min-chunk-size",
        type=_size_arg,
        metavar="SIZE",
        help="neighbouring reads smaller than this are coalesced, e.g. 1MiB",
    )
    g.add_argument("--timeout", type=_timeout_arg, metavar="S", help="seconds for one attempt at one read, or none")
    g.add_argument(
        "--budget",
        type=_size_arg,
        metavar="SIZE",
        help="memory budget: most bytes read but not yet assembled, e.g. 512MiB",
    )
    g.add_argument("--retries", type=_count_arg, metavar="N", help="extra attempts after a failed read")
    g.add_argument(
        "--max-over-read-ratio",
        type=_ratio_arg,
        metavar="R|none",
        help="most bytes read per byte needed by narrow reads, e.g. 1.15, or none (read through gaps)",
    )
    g.add_argument(
        "--transport",
        choices=("auto", "obstore", "fsspec"),
        help="client for s3://, gs://, http(s):// (auto: obstore where the options map, else fsspec)",
    )
    g.add_argument("--no-progress", action="store_true", default=False, help="no progress bar even on a terminal")

    epilog = "exit status:\n" + "\n".join(f"  {code:<4} {text}" for code, text in EXIT_CODES.items())
    parser = _Parser(
        prog="asyncload",
        description="Inspect, load and verify PyTorch distributed checkpoints "
        "(what torch.distributed.checkpoint.save writes).",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"asyncload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="what the checkpoint holds: keys, dtypes, shapes, files",
        description="Print the checkpoint's keys (dtype, shape, shards, bytes), its files and "
        "DCP version. Reads only the .metadata file.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "load",
        parents=[common, knobs],
        help="load into fresh tensors, with a progress bar and stats",
        description="Load every key into freshly allocated tensors (zeros of the saved shapes and "
        "dtypes; objects decoded with the allow-list), then print the load's statistics.",
    )
    p.add_argument("--verify", action="store_true", help="check each tensor record's stored CRC-32")
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="also load with torch's own reader (FileSystemReader, or FsspecReader for URLs) into a "
        "second set of fresh tensors, check both results are identical and print the ratio "
        "(needs twice the checkpoint's size in memory)",
    )
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=_cmd_load)

    p = sub.add_parser(
        "verify",
        parents=[common, knobs],
        help="read everything and check the stored checksums",
        description="Read every record with checksum verification (LoadOptions.verify=True). On "
        "damage, check each key on its own and list every damaged one; exit status 3.",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "convert",
        parents=[common, knobs],
        help="write the checkpoint as Hugging Face-style safetensors shards",
        description="Write checkpoint URL (DCP, safetensors or torch.save) into directory DST as "
        "safetensors: model.safetensors, or model-00001-of-0000N.safetensors shards plus "
        "model.safetensors.index.json. Tensors are streamed (memory stays within --budget); "
        "objects (non-tensor entries) are skipped with a note.",
    )
    p.add_argument("dst", metavar="DST", help="the directory to write (must not exist, or be empty)")
    p.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default=5 * 1000**3,
        metavar="SIZE",
        help="largest shard, e.g. 5GB (the default, as Hugging Face's) or 2GiB; a larger tensor gets a shard alone",
    )
    p.add_argument(
        "--keys",
        action="extend",
        nargs="+",
        metavar="KEY",
        help="convert only these keys: names (a name selects what is saved under it) or glob patterns",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_convert)
    return parser


# --- helpers ----------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    from asyncload._stats import _fmt_bytes as fmt

    return fmt(n)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _options(args: argparse.Namespace, **extra: Any) -> Any:
    from asyncload import LoadOptions

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
    if "chunk_size" in changes and "min_chunk_size" not in changes and base.min_chunk_size > changes["chunk_size"]:
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
            text = text.replace(f"LoadOptions.{field}=", f"{flag} ").replace(f"{field}=", f"{flag} ")
        raise UsageError(text) from None


def read_metadata(url: str, storage_options: dict[str, Any], options: Any = None) -> Any:
    """The checkpoint's DCP ``Metadata``, decoded with asyncload's allow-list."""
    from asyncload import PipelinedReader

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
                    "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in smd.chunks],
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
        "files": [{"name": name, "records": f["records"], "bytes": f["bytes"]} for name, f in sorted(files.items())],
    }


def _table(rows: list[list[str]], right: set[int]) -> str:
    rows = [[_one_line(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


#: Characters a terminal acts on rather than shows (C0 and C1 controls: ESC starts a
#: sequence that can retitle the window or move the cursor, CR and LF forge lines), line and
#: paragraph separators, bidirectional overrides, and lone surrogates (which stdout cannot encode).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


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
    """A :class:`CheckpointStream` over ``args.url`` with its metadata read (claims not checked yet)."""
    from asyncload._stream import CheckpointStream

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
    from asyncload import AsyncLoadError

    try:
        yield
    except (TypeError, ValueError) as exc:
        if isinstance(exc, AsyncLoadError) or not storage_options:
            raise
        given = ", ".join(storage_options)  # the names only: a value may be a secret
        raise UsageError(
            f"the storage client refused a --storage-option value (given: {given}): {type(exc).__name__}: {exc}"
        ) from exc


def _run(stream: Any, coro: Any) -> Any:
    """``coro`` of ``stream`` on the library's loop thread (Ctrl-C cancels it and waits for its cleanup)."""
    from asyncload._loop import loop_thread, run_sync

    return run_sync(coro, loop_thread(stream.options.use_uvloop))


def _bar(args: argparse.Namespace, label: str, total: int, unit: str = "bytes") -> Any:
    from asyncload._progress import ByteProgress

    return ByteProgress(label, total=total, unit=unit, enabled=False if args.no_progress else None)


# --- commands ---------------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    md = read_metadata(args.url, storage_options)
    info = describe(md, args.url)
    if args.json:
        _print(json.dumps(info, indent=2))
        return EXIT_OK
    dtypes = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in info["tensor_bytes_by_dtype"].items())
    _print(f"checkpoint   {_one_line(info['checkpoint'])}")
    if info["format"] == "dcp":
        _print(f"DCP version  {info['dcp_version'] or 'unversioned (torch < 2.4)'}")
    else:
        _print(f"format       {info['format']} (no DCP metadata: asyncload reads the files directly)")
    _print(
        f"tensors      {info['tensors']} keys, {_fmt_bytes(info['tensor_bytes'])}" + (f" ({dtypes})" if dtypes else "")
    )
    _print(f"objects      {info['objects']} keys")
    data_files = f"{len(info['files'])} data file{'' if len(info['files']) == 1 else 's'}"
    _print(
        f"files        {info['file_count']}"
        + (f" (.metadata and {data_files})" if info["file_count"] > len(info["files"]) else "")
        + f", {_fmt_bytes(info['stored_bytes'])} stored"
    )
    _print()
    rows = [["KEY", "DTYPE", "SHAPE", "SHARDS", "BYTES"]]
    for k in info["keys"]:
        if k["kind"] == "tensor":
            rows.append([k["key"], k["dtype"], str(k["shape"]), str(k["shards"]), _fmt_bytes(k["nbytes"])])
        else:
            rows.append([k["key"], "object", "", "1", _fmt_bytes(k["stored_bytes"])])
    _print(_table(rows, right={3, 4}))
    _print()
    rows = [["FILE", "RECORDS", "BYTES"]] + [
        [f["name"], str(f["records"]), _fmt_bytes(f["bytes"])] for f in info["files"]
    ]
    _print(_table(rows, right={1, 2}))
    return EXIT_OK


class _TorchProgressPlanner:
    """torch's DefaultLoadPlanner that reports committed bytes (for a bar over torch's load)."""

    def __new__(cls, on_bytes: Callable[[int], None]) -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class Planner(DefaultLoadPlanner):
            def commit_tensor(self, read_item: Any, tensor: Any) -> None:
                super().commit_tensor(read_item, tensor)
                on_bytes(tensor.numel() * tensor.element_size())

        return Planner()


def torch_reader(url: str, storage_options: dict[str, Any]) -> Any:
    """torch's own reader for ``url``: FileSystemReader for local paths, FsspecReader otherwise."""
    if is_local(url):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(local_root(url))
    try:
        from torch.distributed.checkpoint import FsspecReader  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    return FsspecReader(url, **storage_options)


def load_with_torch(
    url: str, dest: dict[str, Any], storage_options: dict[str, Any], on_bytes: Callable[[int], None] | None = None
) -> float:
    """``dcp.load`` with torch's own reader into ``dest``; returns the wall seconds (from the
    call to its end: ``.metadata`` read, planning and the data, as :func:`load_timed` times
    asyncload). torch's warning that it loads without a process group is not shown: one
    process is what this command means."""
    import warnings

    import torch.distributed.checkpoint as dcp

    planner = _TorchProgressPlanner(on_bytes) if on_bytes is not None else None
    reader = torch_reader(url, storage_options)
    with warnings.catch_warnings():  # this call's warning only, on this (the only) thread
        warnings.filterwarnings("ignore", message=_TORCH_SINGLE_PROCESS, category=UserWarning)
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)
        return time.perf_counter() - t0


#: The start of the warning torch gives for every load without a process group.
_TORCH_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def load_timed(
    url: str, dest: dict[str, Any], options: Any, storage_options: dict[str, Any], progress: Any = None
) -> tuple[Any, float]:
    """``asyncload.load`` into ``dest`` (allocated before); its stats and the wall seconds,
    timed as :func:`load_with_torch` times torch."""
    from asyncload import load

    t0 = time.perf_counter()
    stats = load(dest, url, options=options, storage_options=storage_options, progress=progress)
    return stats, time.perf_counter() - t0


def warm_local_files(url: str, names: list[str]) -> None:
    """Read the files ``names`` of the local checkpoint ``url`` once, outside every clock, so
    that the loads compared start from the same (warm) page cache."""
    if not is_local(url):
        return
    root = local_root(url)
    buf = bytearray(8 << 20)
    for name in names:
        try:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        except OSError:  # the loads will say what is wrong with it
            pass


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (tensors compared bit for bit, objects with ``==``)."""
    import torch

    bad = []
    for k, va in a.items():
        vb = b.get(k)
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            if (
                va.dtype != vb.dtype
                or va.shape != vb.shape
                or not torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8))
            ):
                bad.append(k)
        elif va != vb:
            bad.append(k)
    return bad


def _cmd_load(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    options = _options(args, verify=bool(args.verify))
    stream, md = _open_stream(args, storage_options, options)
    try:  # outside the clocks: the metadata read and checked against the files, destinations made
        info = describe(md, args.url)
        if args.compare_torch and info["format"] != "dcp":
            raise UsageError(
                f"--compare-torch compares with torch's DCP readers, and {redact_url(args.url)} is a {info['format']} "
                "checkpoint, not a DCP one"
            )
        _note(
            f"asyncload: loading {_fmt_bytes(info['tensor_bytes'])} ({info['tensors']} tensors, "
            f"{info['objects']} objects) from {redact_url(args.url)}"
        )
        _run(stream, stream.acheck())  # before anything is allocated
        stream.touch = True  # zeros: both loads write into memory that is already touched
        dest = stream.allocate(stream.tensors + stream.objects)
        torch_dest = stream.allocate(stream.tensors + stream.objects) if args.compare_torch else None
    finally:
        _run(stream, stream.aclose())
    if torch_dest is not None:
        warm_local_files(args.url, [f["name"] for f in info["files"]] + [".metadata"])
    # timed as torch's dcp.load is below: from the call (which reads .metadata) to the end
    with _bar(args, "asyncload", info["tensor_bytes"]) as bar:
        stats, ours = load_timed(args.url, dest, options, storage_options, progress=bar)
    if args.json and torch_dest is None:
        _print(json.dumps(stats.to_dict(), indent=2))
        return EXIT_OK
    if not args.json:
        _print(str(stats))
    if torch_dest is None:
        return EXIT_OK

    name = "FileSystemReader" if is_local(args.url) else "FsspecReader"
    with _bar(args, f"torch {name}", info["tensor_bytes"]) as bar:
        done = [0]

        def on_bytes(n: int) -> None:
            done[0] += n
            bar.update(done[0], info["tensor_bytes"])

        theirs = load_with_torch(args.url, torch_dest, storage_options, on_bytes)
    differ = same_bits(dest, torch_dest)
    ratio = theirs / ours if ours > 0 else float("inf")
    gib = info["tensor_bytes"] / (1 << 30)
    how = (
        "both timed from the call to the end of the load (the .metadata read included), into destinations "
        "allocated before either clock"
        + (", on a page cache warmed by reading the files once before" if is_local(args.url) else "")
    )
    if args.json:
        _print(
            json.dumps(
                {
                    "asyncload": stats.to_dict(),
                    "asyncload_seconds": ours,
                    "torch_seconds": theirs,
                    "torch_reader": name,
                    "ratio": ratio,
                    "identical": not differ,
                    "differing_keys": differ,
                    "timing": how,
                },
                indent=2,
            )
        )
    else:
        _print(
            _table(
                [
                    ["reader", "seconds", "GiB/s", "speed-up"],
                    [f"torch {name}", f"{theirs:.3f}", f"{gib / theirs:.2f}" if theirs else "-", "1.00x"],
                    ["asyncload", f"{ours:.3f}", f"{gib / ours:.2f}" if ours else "-", f"{ratio:.2f}x"],
                ],
                right={1, 2, 3},
            )
        )
        _print(
            f"asyncload took {ours:.3f} s, torch's {name} {theirs:.3f} s: {ratio:.2f}x ({how})."
            + (" Both results are identical bit for bit." if not differ else "")
        )
    if differ:
        _note(f"asyncload: error: the two loads differ in {len(differ)} keys: {differ[:5]}")
        return EXIT_LOAD_ERROR
    return EXIT_OK


def _damage_classes() -> tuple[type[BaseException], ...]:
    from asyncload import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError

    return (CheckpointFormatError, UnsafeCheckpointError, CheckpointNotFoundError)


def _exactly(key: str) -> Callable[[str], bool]:
    return lambda name: name == key


def _cmd_verify(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    from asyncload._read import read_stream
    from asyncload._stream import CheckpointStream, sync_iter

    options = _options(args, verify=True)
    decoded: dict[Any, Any] = {}  # .metadata decoded once a run, also when each key is loaded on its own
    stream, md = _open_stream(args, storage_options, options, metadata_cache=decoded)
    info = describe(md, args.url)
    tensor_records = sum(
        1
        for idx in (md.storage_data or {})
        if getattr(idx, "fqn", None) in {k["key"] for k in info["keys"] if k["kind"] == "tensor"}
    )
    _note(
        f"asyncload: verifying {_fmt_bytes(info['stored_bytes'])} in {len(info['files'])} files of {redact_url(args.url)}"
    )
    try:
        try:  # claims checked before anything is allocated, then batch by batch within the budget
            _run(stream, stream.acheck())
            _run(stream, stream.aload(stream.objects))  # objects decoded
            with _bar(args, "verify", info["tensor_bytes"]) as bar:
                stream.progress = bar
                for _ in sync_iter(stream.abatches(), stream.options):
                    pass
            stats = stream.finish()
        finally:
            _run(stream, stream.aclose())
    except _damage_classes() as first:
        _note(f"asyncload: damage found ({_one_line(str(first))}); checking each key on its own")
        damaged: list[tuple[str, str]] = []
        keys = list(md.state_dict_metadata)
        with _bar(args, "keys", len(keys), unit="key") as bar:
            for i, key in enumerate(keys):
                one = CheckpointStream(
                    args.url,
                    keys=_exactly(key),
                    options=options,
                    storage_options=storage_options,
                    metadata_cache=decoded,
                )
                try:
                    read_stream(one)
                except _damage_classes() as exc:
                    damaged.append((key, str(exc)))
                bar.update(i + 1, len(keys))
        if args.json:
            _print(
                json.dumps(
                    {
                        "checkpoint": redact_url(args.url),
                        "ok": False,
                        "damaged": [{"key": k, "error": e} for k, e in damaged],
                    },
                    indent=2,
                )
            )
        else:
            for key, err in damaged:
                _print(f"DAMAGED  {_one_line(key)}: {_one_line(err)}")
            if not damaged:  # the damage is outside every single key's records (or transient)
                _print(f"DAMAGED  {_one_line(redact_url(args.url))}: {_one_line(str(first))}")
            _print(f"{max(1, len(damaged))} of {len(keys)} keys damaged.")
        return EXIT_DAMAGED
    unchecked = max(0, tensor_records - stats.verified_records)
    if args.json:
        _print(
            json.dumps(
                {
                    "checkpoint": redact_url(args.url),
                    "ok": True,
                    "tensor_records": tensor_records,
                    "verified_records": stats.verified_records,
                    "unchecked_records": unchecked,
                    "objects": info["objects"],
                    "stats": stats.to_dict(),
                },
                indent=2,
            )
        )
    else:
        _print(
            f"OK: {stats.verified_records} of {tensor_records} tensor records match their stored CRC-32"
            + (f" ({unchecked} carry no checksum and were only parsed)" if unchecked else "")
            + f"; {info['objects']} objects decoded; {_fmt_bytes(stats.bytes_read)} read in {stats.seconds:.2f} s."
        )
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    from pathlib import Path

    from asyncload._convert import check_destination, convert

    options = _options(args)
    try:
        check_destination(args.url, Path(args.dst), args.force)
    except (FileExistsError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    with _bar(args, "convert", 0) as bar:
        result = convert(
            args.url,
            args.dst,
            max_shard_size=args.max_shard_size,
            keys=args.keys,
            force=args.force,
            options=options,
            storage_options=storage_options,
            progress=bar,
        )
    if result.skipped_objects:
        _note(
            f"asyncload: note: skipped {len(result.skipped_objects)} objects (safetensors holds tensors only): "
            f"{result.skipped_objects[:10]}{' ...' if len(result.skipped_objects) > 10 else ''}"
        )
    if args.json:
        _print(
            json.dumps(
                {
                    "checkpoint": redact_url(args.url),
                    "destination": args.dst,
                    "files": result.files,
                    "tensors": result.tensors,
                    "total_size": result.total_size,
                    "skipped_objects": result.skipped_objects,
                    "stats": result.stats.to_dict(),
                },
                indent=2,
            )
        )
    else:
        _print(
            f"wrote {result.tensors} tensors ({_fmt_bytes(result.total_size)}) into {len(result.files)} files in "
            f"{args.dst}: {', '.join(result.files[:4])}{' ...' if len(result.files) > 4 else ''}"
        )
        _print(str(result.stats))
    return EXIT_OK


# --- entry point ------------------------------------------------------------------------


def _exit_code(exc: BaseException) -> int:
    from asyncload import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError

    if isinstance(exc, (CheckpointNotFoundError, FileNotFoundError)):
        return EXIT_NOT_FOUND
    if isinstance(exc, (CheckpointFormatError, UnsafeCheckpointError)):
        return EXIT_DAMAGED
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    return EXIT_LOAD_ERROR


def _one_sentence(exc: BaseException) -> str:
    from asyncload import AsyncLoadError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (AsyncLoadError, UsageError)):
        return text
    return f"{type(exc).__name__}: {text}"


def _setup_logging(verbosity: int) -> Callable[[], None]:
    """Send the library's log to stderr (-v INFO, -vv DEBUG); returns the undo."""
    if verbosity <= 0:
        return lambda: None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("asyncload")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)

    return undo


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see :data:`EXIT_CODES`)."""
    import signal

    parser = _parser()
    args = parser.parse_args(argv)
    undo_logging = _setup_logging(2 if args.debug else args.verbose)
    # torch's dcp.load logs failures with tracebacks on the root logger; with no logging
    # configured Python would print them: the CLI says what failed in one sentence instead
    root = logging.getLogger()
    quiet_root = logging.NullHandler() if not root.handlers else None
    if quiet_root is not None:
        root.addHandler(quiet_root)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass
    try:
        try:
            storage_options = parse_storage_options(args.storage_option)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if storage_options and is_local(args.url):
            _note("asyncload: note: --storage-option is ignored for a local path")
        return int(args.func(args, storage_options))
    except KeyboardInterrupt:
        _note("asyncload: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `asyncload inspect URL | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        code = _exit_code(exc)
        _note(
            f"asyncload: error: {_one_sentence(exc)}"
            + ("" if args.debug or code == EXIT_USAGE else " (--debug shows the traceback)")
        )
        return code
    finally:
        undo_logging()
        if quiet_root is not None:
            root.removeHandler(quiet_root)
        if previous is not None:
            try:
                signal.signal(signal.SIGTERM, previous)
            except ValueError:
                pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
