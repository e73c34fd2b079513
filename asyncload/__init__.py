"""asyncload: load PyTorch distributed checkpoints fast, from local disk or object storage.

Public names live here; everything else is private (``asyncload._*``).
"""

from asyncload._api import LoadHandle, aload, load, start_load
from asyncload._dcp import PipelinedLoadPlanner, PipelinedReader
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
from asyncload._read import aread_state_dict, read_state_dict
from asyncload._sharded_planner import BackgroundSends, ShardedLoadPlanner, wait_for_background_sends
from asyncload._stats import LoadStats
from asyncload._stream import aiter_tensors, iter_tensors

__version__ = "0.1.0"

__all__ = [
    "AsyncLoadError",
    "BackgroundSends",
    "CheckpointChangedError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChunkTimeoutError",
    "DistributedLoadError",
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
    "start_load",
    "wait_for_background_sends",
]
