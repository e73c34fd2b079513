"""The subcommands: ``inspect``, ``load``, ``verify`` and ``convert`` (each returns the
exit status; see :data:`~asyncload.cli._args.EXIT_CODES`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from asyncload.cli._args import EXIT_DAMAGED, EXIT_LOAD_ERROR, EXIT_OK, UsageError
from asyncload.cli._output import (
    _bar,
    _fmt_bytes,
    _note,
    _one_line,
    _open_stream,
    _options,
    _print,
    _run,
    _table,
    describe,
    read_metadata,
)
from asyncload.cli._torch import load_timed, load_with_torch, same_bits, warm_local_files
from asyncload.common.errors import redact_url
from asyncload.common.stats import _plural
from asyncload.storage import is_local


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
        _print(
            f"format       {info['format']} (no DCP metadata: asyncload reads the files directly)"
        )
    _print(
        f"tensors      {_plural(info['tensors'], 'key')}, {_fmt_bytes(info['tensor_bytes'])}"
        + (f" ({dtypes})" if dtypes else "")
    )
    _print(f"objects      {_plural(info['objects'], 'key')}")
    data_files = _plural(len(info["files"]), "data file")
    _print(
        f"files        {info['file_count']}"
        + (f" (.metadata and {data_files})" if info["file_count"] > len(info["files"]) else "")
        + f", {_fmt_bytes(info['stored_bytes'])} stored"
    )
    _print()
    rows = [["KEY", "DTYPE", "SHAPE", "SHARDS", "BYTES"]]
    for k in info["keys"]:
        if k["kind"] == "tensor":
            rows.append(
                [k["key"], k["dtype"], str(k["shape"]), str(k["shards"]), _fmt_bytes(k["nbytes"])]
            )
        else:
            rows.append([k["key"], "object", "", "1", _fmt_bytes(k["stored_bytes"])])
    _print(_table(rows, right={3, 4}))
    _print()
    rows = [["FILE", "RECORDS", "BYTES"]] + [
        [f["name"], str(f["records"]), _fmt_bytes(f["bytes"])] for f in info["files"]
    ]
    _print(_table(rows, right={1, 2}))
    return EXIT_OK


def _cmd_load(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    options = _options(args, verify=bool(args.verify))
    stream, md = _open_stream(args, storage_options, options)
    try:  # outside the clocks: the metadata read and checked against the files, destinations made
        info = describe(md, args.url)
        if args.compare_torch and info["format"] != "dcp":
            raise UsageError(
                f"--compare-torch compares with torch's DCP readers, and {redact_url(args.url)} is "
                f"a {info['format']} "
                "checkpoint, not a DCP one"
            )
        _note(
            f"asyncload: loading {_fmt_bytes(info['tensor_bytes'])} ({_plural(info['tensors'], 'tensor')}, "
            f"{_plural(info['objects'], 'object')}) from {redact_url(args.url)}"
        )
        _run(stream, stream.acheck())  # before anything is allocated
        stream.touch = True  # zeros: both loads write into memory that is already touched
        dest = stream.allocate(stream.tensors + stream.objects)
        torch_dest = (
            stream.allocate(stream.tensors + stream.objects) if args.compare_torch else None
        )
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
        "both timed from the call to the end of the load (the .metadata read included), into "
        "destinations "
        "allocated before either clock"
        + (
            ", on a page cache warmed by reading the files once before"
            if is_local(args.url)
            else ""
        )
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
                    [
                        f"torch {name}",
                        f"{theirs:.3f}",
                        f"{gib / theirs:.2f}" if theirs else "-",
                        "1.00x",
                    ],
                    [
                        "asyncload",
                        f"{ours:.3f}",
                        f"{gib / ours:.2f}" if ours else "-",
                        f"{ratio:.2f}x",
                    ],
                ],
                right={1, 2, 3},
            )
        )
        _print(
            f"asyncload took {ours:.3f} s, torch's {name} {theirs:.3f} s: {ratio:.2f}x ({how})."
            + (" Both results are identical bit for bit." if not differ else "")
        )
    if differ:
        _note(
            f"asyncload: error: the two loads differ in {_plural(len(differ), 'key')}: {differ[:5]}"
        )
        return EXIT_LOAD_ERROR
    return EXIT_OK


def _damage_classes() -> tuple[type[BaseException], ...]:
    from asyncload.common.errors import (
        CheckpointFormatError,
        CheckpointNotFoundError,
        UnsafeCheckpointError,
    )

    return (CheckpointFormatError, UnsafeCheckpointError, CheckpointNotFoundError)


def _exactly(key: str) -> Callable[[str], bool]:
    return lambda name: name == key


def _cmd_verify(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    from asyncload.faces.allocating import read_stream
    from asyncload.faces.streaming import CheckpointStream, sync_iter

    options = _options(args, verify=True)
    decoded: dict[
        Any, Any
    ] = {}  # .metadata decoded once a run, also when each key is loaded on its own
    stream, md = _open_stream(args, storage_options, options, metadata_cache=decoded)
    info = describe(md, args.url)
    tensor_records = sum(
        1
        for idx in (md.storage_data or {})
        if getattr(idx, "fqn", None) in {k["key"] for k in info["keys"] if k["kind"] == "tensor"}
    )
    _note(
        f"asyncload: verifying {_fmt_bytes(info['stored_bytes'])} in {_plural(len(info['files']), 'file')} of "
        f"{redact_url(args.url)}"
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
            _print(f"{max(1, len(damaged))} of {_plural(len(keys), 'key')} damaged.")
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
            f"OK: {stats.verified_records} of {_plural(tensor_records, 'tensor record')} "
            f"{'matches its' if tensor_records == 1 else 'match their'} stored CRC-32"
            + (
                f" ({unchecked} {'carries' if unchecked == 1 else 'carry'} no checksum and "
                f"{'was' if unchecked == 1 else 'were'} only parsed)"
                if unchecked
                else ""
            )
            + f"; {_plural(info['objects'], 'object')} decoded; {_fmt_bytes(stats.bytes_read)} read in "
            f"{stats.seconds:.2f} s."
        )
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    from pathlib import Path

    from asyncload.faces.convert import check_destination, convert

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
            f"asyncload: note: skipped {_plural(len(result.skipped_objects), 'object')} (safetensors holds "
            f"tensors only): "
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
            f"wrote {_plural(result.tensors, 'tensor')} ({_fmt_bytes(result.total_size)}) into "
            f"{_plural(len(result.files), 'file')} in "
            f"{args.dst}: {', '.join(result.files[:4])}{' ...' if len(result.files) > 4 else ''}"
        )
        _print(str(result.stats))
    return EXIT_OK
