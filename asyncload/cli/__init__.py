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

``load`` and ``verify`` read through :class:`asyncload.faces.streaming.CheckpointStream`, the core of
``read_state_dict`` and ``iter_tensors``: what the metadata claims is checked against the
files' sizes before any tensor is allocated, and ``verify`` allocates batch by batch
(within ``--budget``); ``convert`` streams through it too. ``--compare-torch`` uses torch's
own readers.

Here: the parser and :func:`main`; beside it the command line's vocabulary (``_args``:
exit statuses, sizes, storage options), what the commands share (``_output``), the torch
comparison (``_torch``) and the commands themselves (``_commands``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from asyncload.cli._args import (
    EXIT_CODES,
    EXIT_DAMAGED,
    EXIT_INTERRUPTED,
    EXIT_LOAD_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    _concurrency_arg,
    _count_arg,
    _Parser,
    _ratio_arg,
    _size_arg,
    _timeout_arg,
    parse_size,
    parse_storage_options,
)
from asyncload.cli._commands import _cmd_convert, _cmd_inspect, _cmd_load, _cmd_verify
from asyncload.cli._output import _note
from asyncload.cli._output import _options as _options
from asyncload.cli._output import describe as describe
from asyncload.cli._output import read_metadata as read_metadata
from asyncload.cli._torch import load_with_torch as load_with_torch
from asyncload.cli._torch import same_bits as same_bits
from asyncload.cli._torch import torch_reader as torch_reader
from asyncload.storage import is_local

# Also importable from here (``name as name`` above; tests and examples use them): the exit
# statuses, the options as the command line builds them, the metadata and torch helpers.
__all__ = ["EXIT_CODES", "main", "parse_size", "parse_storage_options"]


# --- argument parsing -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from asyncload._version import __version__

    common = _Parser(add_help=False)
    common.add_argument(
        "url",
        metavar="URL",
        help="checkpoint directory: a local path, file:// URL or fsspec URL (s3://bucket/prefix, "
        "gs://..., http://...)",
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
    common.add_argument(
        "--debug", action="store_true", help="show tracebacks on errors (implies -vv)"
    )

    knobs = _Parser(add_help=False, argument_default=argparse.SUPPRESS)
    g = knobs.add_argument_group("load options (defaults: asyncload.LoadOptions)")
    g.add_argument(
        "--concurrency", "-c", type=_concurrency_arg, metavar="N|auto", help="reads in flight"
    )
    g.add_argument(
        "--chunk-size", type=_size_arg, metavar="SIZE", help="largest single read, e.g. 16MiB"
    )
    g.add_argument(
        "--min-chunk-size",
        type=_size_arg,
        metavar="SIZE",
        help="neighbouring reads smaller than this are coalesced, e.g. 1MiB",
    )
    g.add_argument(
        "--timeout",
        type=_timeout_arg,
        metavar="S",
        help="seconds for one attempt at one read, or none",
    )
    g.add_argument(
        "--budget",
        type=_size_arg,
        metavar="SIZE",
        help="memory budget: most bytes read but not yet assembled, e.g. 512MiB",
    )
    g.add_argument(
        "--retries", type=_count_arg, metavar="N", help="extra attempts after a failed read"
    )
    g.add_argument(
        "--max-over-read-ratio",
        type=_ratio_arg,
        metavar="R|none",
        help="most bytes read per byte needed by narrow reads, e.g. 1.15, or none (read through "
        "gaps)",
    )
    g.add_argument(
        "--transport",
        choices=("auto", "wire", "fsspec", "obstore"),
        help="client for s3://, gs://, http(s):// (auto: wire, asyncload's own, where the "
        "storage options map onto it, else fsspec; obstore is deprecated)",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        default=False,
        help="no progress bar even on a terminal",
    )

    epilog = "exit status:\n" + "\n".join(
        f"  {code:<4} {text}" for code, text in EXIT_CODES.items()
    )
    parser = _Parser(
        prog="asyncload",
        description="Inspect, load and verify PyTorch distributed checkpoints "
        "(what torch.distributed.checkpoint.save writes).",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"asyncload {__version__}")
    # the options for every command are taken before the command too (``asyncload -v inspect
    # URL``), under their own names: :func:`_merge_globals` adds them to the command's own
    g = parser.add_argument_group("options for every command (before or after COMMAND)")
    g.add_argument(
        "--storage-option",
        "-o",
        dest="global_storage_option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the storage client of a remote URL (repeatable)",
    )
    g.add_argument(
        "-v",
        "--verbose",
        dest="global_verbose",
        action="count",
        default=0,
        help="log the library's INFO lines (-vv: DEBUG) to stderr",
    )
    g.add_argument(
        "--debug",
        dest="global_debug",
        action="store_true",
        help="show tracebacks on errors (implies -vv)",
    )
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
    p.add_argument(
        "--verify", action="store_true", help="check each tensor record's stored CRC-32"
    )
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="also load with torch's own reader (FileSystemReader, or FsspecReader for URLs) into "
        "a "
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
    p.add_argument(
        "dst", metavar="DST", help="the directory to write (must not exist, or be empty)"
    )
    p.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default=5 * 1000**3,
        metavar="SIZE",
        help="largest shard, e.g. 5GB (the default, as Hugging Face's) or 2GiB; a larger tensor "
        "gets a shard alone",
    )
    p.add_argument(
        "--keys",
        action="extend",
        nargs="+",
        metavar="KEY",
        help="convert only these keys: names (a name selects what is saved under it) or glob "
        "patterns",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_convert)
    return parser


# --- helpers ----------------------------------------------------------------------------


# --- commands ---------------------------------------------------------------------------


# --- entry point ------------------------------------------------------------------------


def _exit_code(exc: BaseException) -> int:
    from asyncload.common.errors import (
        CheckpointFormatError,
        CheckpointNotFoundError,
        UnsafeCheckpointError,
    )

    if isinstance(exc, (CheckpointNotFoundError, FileNotFoundError)):
        return EXIT_NOT_FOUND
    if isinstance(exc, (CheckpointFormatError, UnsafeCheckpointError)):
        return EXIT_DAMAGED
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    return EXIT_LOAD_ERROR


def _one_sentence(exc: BaseException) -> str:
    from asyncload.common.errors import AsyncLoadError

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


def _merge_globals(args: argparse.Namespace) -> argparse.Namespace:
    """The options for every command given before it (``asyncload -v -o k=v load URL``)
    added to those given after it: counts summed, lists joined (before first), flags or-ed."""
    args.verbose += args.global_verbose
    args.storage_option = [*args.global_storage_option, *args.storage_option]
    args.debug = args.debug or args.global_debug
    del args.global_verbose, args.global_storage_option, args.global_debug
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see :data:`EXIT_CODES`)."""
    import signal

    parser = _parser()
    args = _merge_globals(parser.parse_args(argv))
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
