"""Allow-list unpickling: nothing from a checkpoint runs code or imports a module.

torch's own DCP reader decodes ``.metadata`` with ``pickle.load`` and non-tensor
objects with ``torch.load(weights_only=False)``: a hostile checkpoint runs code.
Here every global a pickle names must be on an allow-list of data classes; any
other name raises :class:`UnsafeCheckpointError` before it is imported or called.
Persistent ids (torch.save storages) are only accepted where a caller passes a
``persistent_load`` that knows them.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ._errors import CheckpointFormatError, UnsafeCheckpointError

__all__ = ["safe_loads", "metadata_globals", "record_globals", "TensorRef", "StorageRef"]


def _torch_dtypes() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            out[("torch", name)] = value
    return out


def _get_layout(name: str) -> torch.layout:
    # torch.serialization._get_layout, without its getattr on arbitrary strings.
    if not isinstance(name, str) or not name.startswith("torch."):
        raise UnsafeCheckpointError(f"layout {name!r} is not a torch layout")
    value = getattr(torch, name[len("torch.") :], None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"layout {name!r} is not a torch layout")
    return value


def _dcp_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    out: dict[tuple[str, str], Any] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(metadata, name):
            out[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for name in ("_StorageInfo", "_StoragePrefix"):
        if hasattr(filesystem, name):
            out[("torch.distributed.checkpoint.filesystem", name)] = getattr(filesystem, name)
    return out


_PLAIN_DATA: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("__builtin__", "set"): set,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch.serialization", "_get_layout"): _get_layout,
}

_metadata_cache: dict[tuple[str, str], Any] | None = None


def metadata_globals() -> Mapping[tuple[str, str], Any]:
    """The names a DCP ``.metadata`` pickle may use."""
    global _metadata_cache
    if _metadata_cache is None:
        _metadata_cache = {**_PLAIN_DATA, **_torch_dtypes(), **_dcp_classes()}
    return _metadata_cache


# --- torch.save records -------------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """A storage of a torch.save archive, as its pickle names it (nothing is read yet)."""

    key: str
    dtype: torch.dtype
    #: Size in bytes of the storage record ``data/<key>``.
    nbytes: int
    location: str


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a torch.save archive: where its elements live in a storage."""

    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    is_parameter: bool = False


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


def _storage_types() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {("torch.storage", "UntypedStorage"): _StorageType(None)}
    with warnings.catch_warnings():  # reading .dtype of the legacy classes warns that TypedStorage is deprecated
        warnings.simplefilter("ignore")
        for name in dir(torch):
            if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                cls = getattr(torch, name, None)
                dtype = getattr(cls, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[("torch", name)] = _StorageType(dtype)
    return out


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CheckpointFormatError(f"tensor record has a malformed {what}: {value!r}")
    return tuple(int(v) for v in value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    backward_hooks: Any = None, dtype: Any = None, metadata: Any = None) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CheckpointFormatError(f"tensor record refers to {type(storage).__name__}, not a storage")
    if not isinstance(storage_offset, int) or storage_offset < 0:
        raise CheckpointFormatError(f"tensor record has a malformed storage offset: {storage_offset!r}")
    size_t, stride_t = _ints(size, "size"), _ints(stride, "stride")
    if len(size_t) != len(stride_t) or any(s < 0 for s in size_t) or any(s < 0 for s in stride_t):
        raise CheckpointFormatError(f"tensor record has inconsistent size {size_t} and stride {stride_t}")
    dt = dtype if isinstance(dtype, torch.dtype) else storage.dtype
    return TensorRef(storage, storage_offset, size_t, stride_t, dt, bool(requires_grad))


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"tensor record has a malformed dtype: {dtype!r}")
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype)


def _rebuild_parameter(data: Any, requires_grad: Any = True, backward_hooks: Any = None, state: Any = None) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise CheckpointFormatError("parameter record does not wrap a tensor")
    return TensorRef(data.storage, data.storage_offset, data.size, data.stride, data.dtype, bool(requires_grad), True)


_record_cache: dict[tuple[str, str], Any] | None = None


def record_globals() -> Mapping[tuple[str, str], Any]:
    """The names a torch.save ``data.pkl`` may use (tensors become :class:`TensorRef`)."""
    global _record_cache
    if _record_cache is None:
        _record_cache = {
            **metadata_globals(),
            **_storage_types(),
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        }
    return _record_cache


def storage_persistent_load(pid: Any) -> StorageRef:
    """``persistent_load`` for torch.save archives: ``('storage', type, key, location, numel)``."""
    if (
        not isinstance(pid, tuple)
        or len(pid) != 5
        or pid[0] != "storage"
        or not isinstance(pid[1], _StorageType)
        or not isinstance(pid[2], str)
        or not isinstance(pid[4], int)
        or pid[4] < 0
    ):
        raise CheckpointFormatError(f"torch.save record has a malformed storage reference: {pid!r:.200}")
    stype: _StorageType = pid[1]
    if stype.dtype is None:  # UntypedStorage: numel counts bytes; the tensor names the dtype
        return StorageRef(pid[2], torch.uint8, pid[4], str(pid[3]))
    itemsize = torch.empty((), dtype=stype.dtype).element_size()
    return StorageRef(pid[2], stype.dtype, pid[4] * itemsize, str(pid[3]))


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, allowed: Mapping[tuple[str, str], Any], what: str,
                 persistent_load: Callable[[Any], Any] | None) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._what = what
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeCheckpointError(
                f"{self._what} asks to import {module}.{name}, which is not on asyncload's allow-list of "
                "checkpoint data types; nothing from it was executed. Only load checkpoints you trust "
                "with torch's own reader."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeCheckpointError(f"{self._what} holds a persistent reference {pid!r:.100}, which is not allowed here")
        return self._persistent(pid)


def safe_loads(data: bytes | bytearray | memoryview, *, what: str,
               allowed: Mapping[tuple[str, str], Any] | None = None,
               persistent_load: Callable[[Any], Any] | None = None,
               max_size: int | None = None) -> Any:
    """Unpickle ``data`` allowing only the globals in ``allowed`` (default: DCP metadata types).

    Raises :class:`UnsafeCheckpointError` for a non-allowed global or persistent id and
    :class:`CheckpointFormatError` for a pickle that is damaged or too large.
    ``what`` names the source in messages (for example ``"s3://b/ckpt/.metadata"``).
    """
    if max_size is not None and len(data) > max_size:
        raise CheckpointFormatError(f"{what} is {len(data)} bytes, more than the {max_size} allowed (LoadOptions.max_metadata_size)")
    unpickler = _RestrictedUnpickler(io.BytesIO(bytes(data)), metadata_globals() if allowed is None else allowed, what, persistent_load)
    try:
        return unpickler.load()
    except UnsafeCheckpointError:
        raise
    except CheckpointFormatError:
        raise
    except RecursionError as exc:
        raise CheckpointFormatError(f"{what} is nested too deeply to decode") from exc
    except MemoryError as exc:
        raise CheckpointFormatError(f"{what} asks for more memory than it can hold") from exc
    except Exception as exc:  # pickle.UnpicklingError, EOFError, ValueError, TypeError from a damaged stream
        raise CheckpointFormatError(f"{what} is not a valid pickle: {type(exc).__name__}: {exc}"[:500]) from exc
