"""Loads without a prebuilt state dict: :func:`read_state_dict` and :func:`aread_state_dict`.

The destinations are allocated from the checkpoint's metadata (after its claims were
checked against the files) and loaded in one pass through
:class:`~asyncload.faces.streaming.CheckpointStream`; the result is nested again the way it was saved.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from asyncload.common.loop import loop_thread, run_sync
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats
from asyncload.faces.arguments import check_source_arguments
from asyncload.faces.streaming import CheckpointStream, KeySelection, ProgressCallback

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["aread_state_dict", "nest", "read_state_dict"]


def nest(flat: dict[str, Any], metadata: Metadata) -> dict[Any, Any]:
    """``flat`` (the checkpoint's flattened names) nested as the checkpoint's own reader gives it.

    torch.save files: as ``torch.load`` gives the file (its decoded pickle is the template:
    int and tuple keys, key order, OrderedDict, tuples, lists and shared storages as saved;
    :func:`asyncload.formats.torchsave.nest_saved`). DCP checkpoints: as torch's own reader
    rebuilds a state dict from the metadata (``_EmptyStateDictLoadPlanner``): each key placed
    along its ``planner_data`` path in the metadata's order (DCP saved the keys as strings;
    int path elements are list indices). Formats that carry no nesting (safetensors) keep
    their flat names."""
    templates = getattr(metadata, "templates", None)  # (FormatMetadata, of either kind)
    if isinstance(templates, list) and templates:  # a torch.save file's
        from asyncload.formats import nest_saved

        return nest_saved(flat, templates)
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out: dict[str, Any] = {}
    for key in [k for k in metadata.state_dict_metadata if k in flat] + [
        k for k in flat if k not in metadata.state_dict_metadata
    ]:
        value = flat[key]
        path = mapping.get(key)
        if not isinstance(path, (tuple, list)) or not path:
            path = (key,)
        if len(path) == 1 and type(path[0]) is str:  # a flat name: DCP's set_element's answer
            out[path[0]] = value
            continue
        from torch.distributed.checkpoint._traverse import set_element

        set_element(out, tuple(path), value)
    return out


async def aread_stream(stream: CheckpointStream) -> tuple[dict[str, Any], LoadStats]:
    """Open, load everything selected, close: the flat state dict and the stream's stats."""
    try:
        await stream.aopen()
        flat = await stream.aload_all()
        stats = stream.finish()
    finally:
        await stream.aclose()
    return flat, stats


def read_stream(stream: CheckpointStream) -> tuple[dict[str, Any], LoadStats]:
    """:func:`aread_stream` from a blocking caller, on the library's loop thread."""
    return run_sync(aread_stream(stream), loop_thread(stream.options.use_uvloop))


def read_state_dict(
    checkpoint: str | os.PathLike[str],
    *,
    keys: KeySelection = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Load ``checkpoint`` into a new state dict allocated from its metadata and return it.

    Works for DCP checkpoints, safetensors (one file or indexed shards) and zip-format
    ``torch.save`` files, local or remote (``storage_options`` go to fsspec). The result is
    what the format's own reader gives, objects included (decoded with the allow-list and
    ``options.safe_globals``): a torch.save file exactly as ``torch.load(weights_only=True)``
    gives it (int and tuple keys, key order, OrderedDict, tuples, tensors sharing storages as
    saved); a DCP checkpoint as torch's reader rebuilds it (the flattened keys nested again
    through its planner data, in the metadata's order); safetensors names flat. With ``keys``,
    the same structure restricted to the selected entries.

    ``keys``: names (a name selects everything saved under it), glob patterns, or a callable
    over the flattened names; only the selected keys' bytes are read. ``device``: ``"cpu"``,
    ``"cuda"``/``"cuda:N"`` (through the pinned staging path) or ``"meta"`` (shapes and dtypes
    only, no data read, objects left out). ``dtype``: floating tensors (float64/32/16,
    bfloat16, float8) are converted to it on load; other tensors keep their dtype.
    ``progress(bytes_done, bytes_total)`` is called as data lands (from a library thread).

    What the metadata claims is checked against the files' sizes before anything is
    allocated: a forged ``.metadata`` is a :class:`CheckpointFormatError`, not an allocation.
    """
    check_source_arguments(checkpoint, options, storage_options, face="asyncload.read_state_dict")
    coro = aread_state_dict(
        checkpoint,
        keys=keys,
        device=device,
        dtype=dtype,
        options=options,
        storage_options=storage_options,
        progress=progress,
    )
    return run_sync(coro, loop_thread((options or LoadOptions()).use_uvloop))


async def aread_state_dict(
    checkpoint: str | os.PathLike[str],
    *,
    keys: KeySelection = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    options: LoadOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """:func:`read_state_dict` as a coroutine, on the caller's event loop (planning on a
    worker thread). Cancelling it stops the reads and returns once nothing is left running."""
    check_source_arguments(checkpoint, options, storage_options, face="asyncload.aread_state_dict")
    stream = CheckpointStream(
        checkpoint,
        keys=keys,
        device=device,
        dtype=dtype,
        options=options,
        storage_options=storage_options,
        progress=progress,
    )
    # a safetensors or torch.save file's metadata of asyncload.formats.plain's types: no DCP
    stream.session.plain_metadata = True
    flat, _ = await aread_stream(stream)
    assert stream.metadata is not None
    return nest(flat, stream.metadata)
