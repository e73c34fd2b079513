"""asyncload: load PyTorch distributed checkpoints fast, from local disk or object storage.

Public names live here, and in ``asyncload.distributed`` for the types only a load on several
ranks meets (``DistributedLoadError``, ``RankProgress``...); everything else is private: the
``asyncload._*`` modules and the wings' modules (``engine/``, ``storage/``, ``distributed/``,
``formats/``, ``decoding/``), whose layout docs/pipeline.md draws.
"""

import typing

from asyncload._errors import (
    AsyncLoadError,
    CheckpointChangedError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChunkTimeoutError,
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
    from asyncload._sharded_planner import ShardedLoadPlanner, wait_for_background_sends
    from asyncload._stream import aiter_tensors, iter_tensors

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
    "ShardedLoadPlanner": "asyncload._sharded_planner",
    "wait_for_background_sends": "asyncload._sharded_planner",
    "aiter_tensors": "asyncload._stream",
    "iter_tensors": "asyncload._stream",
}

#: Names that moved to :mod:`asyncload.distributed` (types a load on one rank never needs):
#: still reachable here, with a ``DeprecationWarning`` naming their new place.
_MOVED = {
    "BackgroundSends": "asyncload.distributed",
    "DistributedLoadError": "asyncload.distributed",
    "InFlightRequest": "asyncload.distributed",
    "RankProgress": "asyncload.distributed",
}


def __getattr__(name: str) -> object:
    import importlib

    moved = _MOVED.get(name)
    if moved is not None:
        import warnings

        warnings.warn(
            f"asyncload.{name} moved to {moved}.{name}: import it from there "
            f"(from {moved} import {name}); the old name is deprecated",
            DeprecationWarning,
            stacklevel=2,  # the caller's line (importlib's frames are skipped)
        )
        return getattr(importlib.import_module(moved), name)  # not cached: warns each time
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AsyncLoadError",
    "CheckpointChangedError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChunkTimeoutError",
    "LoadCancelledError",
    "LoadHandle",
    "LoadOptions",
    "LoadReentryError",
    "LoadStats",
    "PipelinedLoadPlanner",
    "PipelinedReader",
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
