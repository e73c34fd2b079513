"""``asyncload convert``: any checkpoint asyncload reads, written as Hugging Face-style safetensors.

The output is what ``transformers``' ``save_pretrained`` writes: one ``model.safetensors``
when every tensor fits in one shard, else ``model-00001-of-0000N.safetensors`` shards of at
most ``max_shard_size`` bytes (a tensor larger than that gets a shard of its own) and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {...}}``).

The shards are planned from the checkpoint's metadata (names, shapes, dtypes), so each
shard's header is written first and each tensor's bytes as
:class:`~asyncload.faces.streaming.CheckpointStream`
hands them over: memory stays within the stream's ``memory_budget``, never a shard's size.
Everything is written into a temporary directory beside the destination, which takes the
destination's name only once complete. Objects (non-tensor entries) have no place in
safetensors: they are skipped and reported.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncload.common.loop import loop_thread, run_sync
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats
from asyncload.faces.streaming import CheckpointStream, KeySelection, sync_iter
from asyncload.formats import HF_INDEX, HF_SINGLE, SAFETENSORS_DTYPES
from asyncload.storage import is_local, local_root

__all__ = [
    "SAFETENSORS_MAX_HEADER",
    "ConvertResult",
    "check_destination",
    "convert",
    "plan_shards",
]

#: torch dtype -> safetensors' name for it
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
#: The largest header safetensors reads (its ``MAX_HEADER_SIZE``: the JSON, without the 8-byte
#: length).
SAFETENSORS_MAX_HEADER = 100_000_000
#: The header entry safetensors keeps for the file's own metadata (not a tensor).
_RESERVED = "__metadata__"


@dataclass
class _Shard:
    name: str
    #: (key, dtype name, shape, start, end) in data order
    tensors: list[tuple[str, str, list[int], int, int]] = field(default_factory=list)
    size: int = 0

    def header(self) -> bytes:
        """The shard's safetensors header: 8-byte length, then JSON padded to 8 bytes."""
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for key, dtype, shape, start, end in self.tensors:
            entries[key] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw


@dataclass
class ConvertResult:
    """What :func:`convert` wrote: the files, tensors, bytes, skipped objects and the read's
    stats."""

    files: list[str]
    tensors: int
    total_size: int
    skipped_objects: list[str]
    stats: LoadStats


def plan_shards(
    tensors: list[tuple[str, torch.dtype, list[int]]], max_shard_size: int
) -> list[_Shard]:
    """Tensors in order into shards of at most ``max_shard_size`` data bytes (a larger
    tensor alone), named as Hugging Face names them."""
    shards: list[_Shard] = []
    for key, dtype, shape in tensors:
        _check_name(key)
        name = _NAMES.get(dtype)
        if name is None:
            raise ValueError(f"key {key!r} is a {dtype} tensor, which safetensors cannot hold")
        n = torch.Size(shape).numel() * dtype.itemsize
        if not shards or (shards[-1].size + n > max_shard_size and shards[-1].tensors):
            shards.append(_Shard(""))
        shard = shards[-1]
        shard.tensors.append((key, name, list(shape), shard.size, shard.size + n))
        shard.size += n
    if len(shards) <= 1:
        shards = shards or [_Shard("")]
        shards[0].name = HF_SINGLE
    else:
        for i, s in enumerate(shards, 1):
            s.name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
    for s in shards:
        size = len(s.header()) - 8
        if size > SAFETENSORS_MAX_HEADER:
            raise ValueError(
                f"{s.name}'s header would be {size} bytes ({len(s.tensors)} tensors, the first "
                f"{s.tensors[0][0]!r:.200}), "
                f"over the {SAFETENSORS_MAX_HEADER} bytes safetensors reads: lower max_shard_size "
                "(--max-shard-size) to spread the keys over more shards, or convert fewer keys"
            )
    return shards


def _check_name(key: str) -> None:
    """Raise unless safetensors can read ``key`` back as a tensor's name."""
    if key == _RESERVED:
        raise ValueError(
            f"key {key!r} is the name safetensors reserves for a file's metadata, not a tensor: "
            "leave it out (keys=...) or rename it"
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"key {key!r:.200} holds {key[exc.start]!r} at {exc.start}, a lone surrogate, which is "
            f"not UTF-8: "
            "safetensors' header is UTF-8 JSON; leave the key out (keys=...) or rename it"
        ) from None


def check_destination(src: str | os.PathLike[str], dst: Path, force: bool) -> None:
    """Raise unless ``dst`` may be written: it does not exist or is an empty directory (or
    ``force``), and it is not the checkpoint being converted, nor a directory above it. A
    symbolic link (dangling, or to an empty directory) exists: it is replaced only with ``force``."""
    if dst.is_symlink() and not force:
        raise FileExistsError(
            f"{dst} exists (a symbolic link to {os.readlink(dst)}): pass --force (force=True) to "
            f"replace it"
        )
    if dst.exists() and not force and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists: pass --force (force=True) to replace it")
    if not is_local(src):
        return
    source = Path(local_root(src)).resolve()
    target = dst.resolve()
    if target == source or target in source.parents:
        raise ValueError(
            f"{dst} holds the checkpoint being converted ({src}): choose another destination"
        )


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int = 5 * 1000**3,
    keys: KeySelection = None,
    force: bool = False,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Write checkpoint ``src`` (any format asyncload reads) as safetensors into directory
    ``dst`` (see the module docstring). ``progress(bytes_written, total_size)``."""
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size} must be positive")
    dst = Path(dst)
    check_destination(src, dst, force)
    stream = CheckpointStream(src, keys=keys, options=options, storage_options=storage_options)
    loop = loop_thread(stream.options.use_uvloop)
    try:
        run_sync(stream.aopen(), loop)
        saved = [(k, stream.tensor_metadata(k)) for k in stream.tensors]
        planned = [(k, stream.dtype_of(smd), list(smd.size)) for k, smd in saved]
        shards = plan_shards(planned, max_shard_size)
        total = sum(s.size for s in shards)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = _partial_dir(dst)
        try:
            _write_shards(
                tmp, shards, sync_iter(stream.abatches(), stream.options), total, progress
            )
            if len(shards) > 1:
                index = {
                    "metadata": {"total_size": total},
                    "weight_map": {k: s.name for s in shards for k, *_ in s.tensors},
                }
                (tmp / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            stats = stream.finish()
            _replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        run_sync(stream.aclose(), loop)
    files = [s.name for s in shards] + ([HF_INDEX] if len(shards) > 1 else [])
    return ConvertResult(files, len(planned), total, list(stream.objects), stats)


def _write_shards(
    tmp: Path,
    shards: list[_Shard],
    tensors: Any,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Headers first, then each tensor's bytes at its place as the stream hands it over."""
    where = {
        key: (i, start, end) for i, s in enumerate(shards) for key, _, _, start, end in s.tensors
    }
    left = [len(s.tensors) for s in shards]
    files: dict[int, Any] = {}
    bases: dict[int, int] = {}
    written = 0
    try:
        for key, tensor in tensors:
            i, start, end = where[key]
            f = files.get(i)
            if f is None:
                f = files[i] = open(tmp / shards[i].name, "wb")  # noqa: SIM115 - closed below
                head = shards[i].header()
                f.write(head)
                bases[i] = len(head)
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            if (
                data.nbytes != end - start
            ):  # pragma: no cover - the stream allocates from the same metadata
                raise ValueError(
                    f"key {key!r}: {data.nbytes} bytes, the header says {end - start}"
                )
            f.seek(bases[i] + start)
            f.write(memoryview(data))
            del data, tensor
            written += end - start
            left[i] -= 1
            if left[i] == 0:
                files.pop(i).close()
            if progress is not None:
                progress(written, total)
        for s in shards:
            if not s.tensors:  # nothing selected but objects: an empty model.safetensors
                with open(tmp / s.name, "wb") as f:
                    f.write(s.header())
        unwritten = [k for s, n in zip(shards, left) if n for k, *_ in s.tensors]
        if unwritten:  # pragma: no cover - the stream yields every planned tensor
            raise ValueError(f"the checkpoint gave no bytes for {unwritten[:5]}")
    finally:
        for f in files.values():
            f.close()


def _partial_dir(dst: Path) -> Path:
    """A new, empty directory beside ``dst`` to write into, with the permissions the umask
    gives (``tempfile.mkdtemp`` makes 0700: a converted model others could not read)."""
    for _ in range(100):
        tmp = dst.with_name(f".{dst.name}.partial-{secrets.token_hex(4)}")
        try:
            tmp.mkdir(0o777)  # the umask applies, as to the files written into it
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"could not make a new directory beside {dst} to write into")


def _replace(tmp: Path, dst: Path) -> None:
    """``tmp`` takes ``dst``'s name; what was there (``--force``) is removed after."""
    old: Path | None = None
    if dst.exists() or dst.is_symlink():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
