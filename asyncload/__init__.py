"""asyncload: load PyTorch distributed checkpoints fast, from local disk or object storage.

Public names live here, and in ``asyncload.distributed`` for the types only a load on several
ranks meets (``DistributedLoadError``, ``RankProgress``...); everything else is private: the
``asyncload._*`` modules and the wings' modules (``engine/``, ``storage/``, ``distributed/``,
``formats/``, ``decoding/``), whose layout docs/pipeline.md draws.
"""

import typing

from asyncload._version import __version__
from asyncload.common.errors import (
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
from asyncload.common.lazy import lazy_names
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats

if typing.TYPE_CHECKING:
    from asyncload.faces.allocating import aread_state_dict, read_state_dict
    from asyncload.faces.api import LoadHandle, aload, load, start_load
    from asyncload.faces.dcp_reader import PipelinedLoadPlanner, PipelinedReader
    from asyncload.faces.safe_open import safe_open
    from asyncload.faces.sharded_planner import ShardedLoadPlanner, wait_for_background_sends
    from asyncload.faces.streaming import aiter_tensors, iter_tensors

#: The faces, imported on first use (PEP 562): ``import asyncload`` stays cheap (no
#: ``torch.distributed.checkpoint``, no engine), and the first ``asyncload.load`` (or
#: ``from asyncload import load``) imports what a load needs.
_LAZY = {
    "LoadHandle": "asyncload.faces.api",
    "aload": "asyncload.faces.api",
    "load": "asyncload.faces.api",
    "start_load": "asyncload.faces.api",
    "PipelinedLoadPlanner": "asyncload.faces.dcp_reader",
    "PipelinedReader": "asyncload.faces.dcp_reader",
    "aread_state_dict": "asyncload.faces.allocating",
    "read_state_dict": "asyncload.faces.allocating",
    "safe_open": "asyncload.faces.safe_open",
    "ShardedLoadPlanner": "asyncload.faces.sharded_planner",
    "wait_for_background_sends": "asyncload.faces.sharded_planner",
    "aiter_tensors": "asyncload.faces.streaming",
    "iter_tensors": "asyncload.faces.streaming",
}

#: Names that moved to :mod:`asyncload.distributed` (types a load on one rank never needs):
#: still reachable here, with a ``DeprecationWarning`` naming their new place.
_MOVED = {
    "BackgroundSends": "asyncload.distributed",
    "DistributedLoadError": "asyncload.distributed",
    "InFlightRequest": "asyncload.distributed",
    "RankProgress": "asyncload.distributed",
}


def _moved(name: str) -> object:
    """A name that moved (:data:`_MOVED`), from its new place, with a ``DeprecationWarning``
    each time (not cached); else ``NotImplemented``."""
    moved = _MOVED.get(name)
    if moved is None:
        return NotImplemented
    import importlib
    import warnings

    warnings.warn(
        f"asyncload.{name} moved to {moved}.{name}: import it from there "
        f"(from {moved} import {name}); the old name is deprecated",
        DeprecationWarning,
        stacklevel=3,  # the caller's line (this function's and __getattr__'s frames skipped)
    )
    return getattr(importlib.import_module(moved), name)


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

__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__, fallback=_moved)
del lazy_names  # (not a name of the package)
