"""asyncload: load PyTorch distributed checkpoints fast, from local disk or object storage.

Public names live here; everything else is private: the ``asyncload._*`` modules and the
wings (``engine/``, ``storage/``, ``distributed/``, ``formats/``, ``decoding/``), whose layout
docs/pipeline.md draws.
"""

import typing

from asyncload._errors import (
    AsyncLoadError,
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChunkTimeoutError,
    DistributedLoadError,
    LoadCancelledError,
    LoadReentryError,
    StateDictMismatchError,
    StorageReadError,
    UnsafeCheckpointError,
)
from asyncload._options import LoadOptions
from asyncload._stats import LoadStats
from asyncload._version import __version__

if typing.TYPE_CHECKING:
    from asyncload._api import LoadHandle, aload, load, start_load
    from asyncload._dcp import PipelinedLoadPlanner, PipelinedReader
    from asyncload._read import aread_state_dict, read_state_dict
    from asyncload._safe_open import safe_open
    from asyncload._sharded_planner import (
        BackgroundSends,
        ShardedLoadPlanner,
        wait_for_background_sends,
    )
    from asyncload._stream import aiter_tensors, iter_tensors
    from asyncload.distributed.lateness import RankProgress
    from asyncload.storage.in_flight import InFlightRequest

#: The faces, imported on first use (PEP 562): ``import asyncload`` stays cheap (no
#: ``torch.distributed.checkpoint``, no engine), and the first ``asyncload.load`` (or
#: ``from asyncload import load``) imports what a load needs.
_LAZY = {
    "LoadHandle": "asyncload._api",
    "aload": "asyncload._api",
    "load": "asyncload._api",
    "start_load": "asyncload._api",
    "PipelinedLoadPlanner": "asyncload._dcp",
    "PipelinedReader": "asyncload._dcp",
    "aread_state_dict": "asyncload._read",
    "read_state_dict": "asyncload._read",
    "safe_open": "asyncload._safe_open",
    "BackgroundSends": "asyncload._sharded_planner",
    "ShardedLoadPlanner": "asyncload._sharded_planner",
    "wait_for_background_sends": "asyncload._sharded_planner",
    "aiter_tensors": "asyncload._stream",
    "iter_tensors": "asyncload._stream",
    "RankProgress": "asyncload.distributed.lateness",
    "InFlightRequest": "asyncload.storage.in_flight",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AsyncLoadError",
    "BackgroundSends",
    "CheckpointChangedError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChunkTimeoutError",
    "DistributedLoadError",
    "InFlightRequest",
    "LoadCancelledError",
    "LoadHandle",
    "LoadOptions",
    "LoadReentryError",
    "LoadStats",
    "PipelinedLoadPlanner",
    "PipelinedReader",
    "RankProgress",
    "ShardedLoadPlanner",
    "StateDictMismatchError",
    "StorageReadError",
    "UnsafeCheckpointError",
    "__version__",
    "aiter_tensors",
    "aload",
    "aread_state_dict",
    "iter_tensors",
    "load",
    "read_state_dict",
    "safe_open",
    "start_load",
    "wait_for_background_sends",
]
