"""The allow-lists of a checkpoint's pickles, as data: the names a ``.metadata`` may use
(:func:`metadata_globals`: plain data, torch's dtypes, DCP's dataclasses), torch.save's tensor
records as :class:`TensorRef`/:class:`StorageRef` (nothing is read), and the constructors a
pickle may call, each with a check of its arguments (:func:`allow_call`, :func:`allow_build`
register them; the policy of :mod:`asyncload.decoding.allowlist` consults the registry).

Raised: :class:`UnsafeCheckpointError` for a layout or name that is not torch's;
:class:`CheckpointFormatError` for a constructor's malformed arguments.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncload.common.errors import CheckpointFormatError, UnsafeCheckpointError
from asyncload.decoding.vm import PickleVM, short_repr

# --- the allow-lists ----------------------------------------------------------------


def _torch_dtypes() -> dict[tuple[str, str], Any]:
    # the module's own attributes (not dir() and getattr: half the time, and no module
    # __getattr__ runs); a process's first load builds this table
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {
        ("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)
    }


def _get_layout(name: str) -> torch.layout:
    # torch.serialization._get_layout, without its getattr on arbitrary strings.
    if not isinstance(name, str) or not name.startswith("torch.") or len(name) > 64:
        raise UnsafeCheckpointError(f"layout {short_repr(name)} is not a torch layout")
    value = getattr(torch, name[len("torch.") :], None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"layout {short_repr(name)} is not a torch layout")
    return value


def dcp_classes() -> dict[tuple[str, str], Any]:
    """DCP's metadata dataclasses by pickle name (imports ``torch.distributed.checkpoint``)."""
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


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # protocol 2 pickles bytes as _codecs.encode(latin-1 text, "latin1")
    return text.encode(encoding)


_PLAIN_DATA: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("_codecs", "encode"): _codecs_encode,
}
for _mod in ("builtins", "__builtin__"):  # protocol 2 (torch.save) writes the Python 2 name
    _PLAIN_DATA.update(
        {
            (_mod, "set"): set,
            (_mod, "frozenset"): frozenset,
            (_mod, "complex"): complex,
            (_mod, "slice"): slice,
            (_mod, "bytearray"): bytearray,
            (_mod, "bytes"): bytes,
        }
    )

_metadata_cache: dict[tuple[str, str], Any] | None = None
_plain_cache: dict[tuple[str, str], Any] | None = None


def plain_globals() -> Mapping[tuple[str, str], Any]:
    """Plain data and torch's dtypes, layouts and memory formats: the names every checkpoint
    pickle may use (no DCP class: nothing here imports ``torch.distributed.checkpoint``)."""
    global _plain_cache
    if _plain_cache is None:
        _plain_cache = {**_PLAIN_DATA, **_torch_dtypes()}
    return _plain_cache


def metadata_globals() -> Mapping[tuple[str, str], Any]:
    """The names a DCP ``.metadata`` pickle may use."""
    global _metadata_cache
    if _metadata_cache is None:
        _metadata_cache = {**plain_globals(), **dcp_classes()}
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


@dataclass(frozen=True)
class _StorageType:
    """What ``torch.FloatStorage`` (etc.) resolves to: a marker with the element dtype.
    Frozen: a pickle cannot change it for later loads."""

    dtype: torch.dtype | None


def _storage_types() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {
        ("torch.storage", "UntypedStorage"): _StorageType(None),
        ("torch", "UntypedStorage"): _StorageType(None),
    }
    with (
        warnings.catch_warnings()
    ):  # reading .dtype of the legacy classes warns that TypedStorage is deprecated
        warnings.simplefilter("ignore")
        for name, cls in list(vars(torch).items()):
            if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                dtype = getattr(cls, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[("torch", name)] = _StorageType(dtype)
    return out


_I64 = 1 << 63


def _is_int(v: Any) -> bool:
    return type(v) is int and -_I64 <= v < _I64


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) > 1024
        or not all(_is_int(v) for v in value)
    ):
        raise CheckpointFormatError(f"tensor record has a malformed {what}: {short_repr(value)}")
    return tuple(value)


def _rebuild_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    dtype: Any = None,
    metadata: Any = None,
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CheckpointFormatError(
            f"tensor record refers to {type(storage).__name__}, not a storage"
        )
    if not _is_int(storage_offset) or storage_offset < 0:
        raise CheckpointFormatError(
            f"tensor record has a malformed storage offset: {short_repr(storage_offset)}"
        )
    size_t, stride_t = _ints(size, "size"), _ints(stride, "stride")
    if len(size_t) != len(stride_t) or any(s < 0 for s in size_t) or any(s < 0 for s in stride_t):
        raise CheckpointFormatError(
            f"tensor record has inconsistent size {short_repr(size_t)} and stride "
            f"{short_repr(stride_t)}"
        )
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(
            f"tensor record has a malformed requires_grad: {short_repr(requires_grad)}"
        )
    if backward_hooks is not None and not isinstance(backward_hooks, dict):
        raise CheckpointFormatError("tensor record has malformed backward hooks")
    dt = dtype if isinstance(dtype, torch.dtype) else storage.dtype
    _check_grad(dt, requires_grad, "tensor")
    return TensorRef(storage, storage_offset, size_t, stride_t, dt, requires_grad)


def _check_grad(dtype: Any, requires_grad: bool, what: str) -> None:
    """Only floating point and complex tensors can require gradients (torch raises a
    RuntimeError building any other): a record that says otherwise was not written by torch."""
    if (
        requires_grad
        and isinstance(dtype, torch.dtype)
        and not (dtype.is_floating_point or dtype.is_complex)
    ):
        raise CheckpointFormatError(
            f"{what} record of dtype {dtype} has requires_grad=True: only floating point and "
            f"complex tensors "
            "can require gradients"
        )


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef:
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"tensor record has a malformed dtype: {short_repr(dtype)}")
    return _rebuild_tensor(
        storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype
    )


def _rebuild_parameter(
    data: Any, requires_grad: Any = True, backward_hooks: Any = None, state: Any = None
) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise CheckpointFormatError("parameter record does not wrap a tensor")
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(
            f"parameter record has a malformed requires_grad: {short_repr(requires_grad)}"
        )
    _check_grad(data.dtype, requires_grad, "parameter")
    return TensorRef(
        data.storage, data.storage_offset, data.size, data.stride, data.dtype, requires_grad, True
    )


def storage_persistent_load(pid: Any) -> StorageRef:
    """``persistent_load`` for torch.save archives: ``('storage', type, key, location, numel)``."""
    if (
        type(pid) is not tuple
        or len(pid) != 5
        or pid[0] != "storage"
        or not isinstance(pid[1], _StorageType)
        or type(pid[2]) is not str
        or len(pid[2]) > 256
        or type(pid[3]) is not str
        or len(pid[3]) > 256
        or not _is_int(pid[4])
        or pid[4] < 0
    ):
        raise CheckpointFormatError(
            f"torch.save record has a malformed storage reference: {short_repr(pid)}"
        )
    stype: _StorageType = pid[1]
    if stype.dtype is None:  # UntypedStorage: numel counts bytes; the tensor names the dtype
        return StorageRef(pid[2], torch.uint8, pid[4], pid[3])
    return StorageRef(pid[2], stype.dtype, pid[4] * stype.dtype.itemsize, pid[3])


# --- argument checks of the constructors a pickle may call -------------------------
# Each takes (vm, args, what) and returns the work units the call costs; it raises
# before the constructor runs when the arguments are not what a real checkpoint holds.


def _bad_args(what: str, args: Any) -> CheckpointFormatError:
    return CheckpointFormatError(f"{what} called with malformed arguments {short_repr(args)}")


def _args_mapping_ctor(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if not args:
        return 1
    if len(args) != 1 or type(args[0]) not in (list, tuple):
        raise _bad_args(what, args)
    items = args[0]
    for pair in items:
        if type(pair) is not tuple or len(pair) != 2:
            raise _bad_args(what, args)
    vm.check_keys([p[0] for p in items], what)
    return 1 + 2 * len(items)


def _args_set_ctor(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if not args:
        return 1
    if len(args) != 1 or type(args[0]) not in (list, tuple, set, frozenset):
        raise _bad_args(what, args)
    vm.check_keys(list(args[0]), what)
    return 1 + 4 * len(args[0])


def _num(v: Any) -> bool:
    return type(v) in (int, float) and (type(v) is float or -_I64 <= v < _I64)


def _args_complex(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if not (1 <= len(args) <= 2) or not all(_num(a) for a in args):
        raise _bad_args(what, args)
    return 1


def _args_slice(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if not (1 <= len(args) <= 3) or not all(a is None or _is_int(a) for a in args):
        raise _bad_args(what, args)
    return 1


def _args_path(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if (
        len(args) > 4096
        or not all(type(a) is str for a in args)
        or sum(len(a) for a in args) > 65536
    ):
        raise _bad_args(what, args)
    return 1 + sum(len(a) for a in args) // 8


def _args_size(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if len(args) > 1 or (
        args
        and (
            type(args[0]) not in (list, tuple)
            or len(args[0]) > 1024
            or not all(_is_int(v) for v in args[0])
        )
    ):
        raise _bad_args(what, args)
    return 1 + (len(args[0]) if args else 0)


def _args_device(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if (
        not (1 <= len(args) <= 2)
        or type(args[0]) not in (str, int)
        or (type(args[0]) is str and len(args[0]) > 64)
        or (len(args) == 2 and not (type(args[1]) is int and -1 <= args[1] < 1 << 16))
    ):
        raise _bad_args(what, args)
    return 1


def _args_layout(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if len(args) != 1 or type(args[0]) is not str or len(args[0]) > 64:
        raise _bad_args(what, args)
    return 1


def _args_encode(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if (
        not (1 <= len(args) <= 2)
        or type(args[0]) is not str
        or (len(args) == 2 and args[1] not in ("latin1", "latin-1", "utf-8", "utf8", "ascii"))
    ):
        raise _bad_args(what, args)
    return 1 + len(args[0]) // 8


def _args_bytes(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if (
        len(args) > 2
        or (args and type(args[0]) not in (bytes, str))
        or (len(args) == 2 and args[1] not in ("latin1", "latin-1", "utf-8", "utf8", "ascii"))
        or (len(args) == 1 and type(args[0]) is str)
    ):
        raise _bad_args(what, args)
    return 1 + (len(args[0]) // 8 if args else 0)


def _args_enum(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if (
        len(args) != 1
        or type(args[0]) not in (int, str)
        or (type(args[0]) is str and len(args[0]) > 64)
    ):
        raise _bad_args(what, args)
    return 1


def _args_rebuild(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if not (2 <= len(args) <= 8):
        raise _bad_args(what, args)
    return 1 + sum(len(a) for a in args if type(a) in (tuple, list))


#: An argument check: ``(vm, args, what)`` -> the work units the call costs; raises before
#: the call runs when the arguments are not what a real checkpoint holds.
ArgCheck = Callable[[PickleVM, tuple[Any, ...], str], int]
#: A BUILD rule: ``(vm, inst, state)``; sets ``inst`` from a checked ``state`` or raises.
BuildRule = Callable[[PickleVM, Any, Any], None]

#: Objects a pickle may call (REDUCE, OBJ, INST), by identity, with their argument check
#: and whether the call's result may then be BUILT (it is a new object of this pickle's).
_CALLABLE_CHECKS: dict[int, tuple[Any, ArgCheck, bool]] = {}
#: BUILD rules for objects of these types (``isinstance``) that this pickle created.
_BUILD_RULES: list[tuple[type, BuildRule]] = []


def allow_call(obj: Any, check: ArgCheck, *, fresh_result: bool = False) -> None:
    """Let checkpoint pickles call ``obj`` (once a name on an allow-list resolves to it),
    after ``check`` accepted the arguments; ``fresh_result``: its result may be BUILT."""
    _CALLABLE_CHECKS[id(obj)] = (obj, check, fresh_result)


def allow_build(cls: type, rule: BuildRule) -> None:
    """Let checkpoint pickles BUILD objects of ``cls`` they created, through ``rule``."""
    _BUILD_RULES.append((cls, rule))


_allow_call = allow_call


for _obj, _check in (
    (collections.OrderedDict, _args_mapping_ctor),
    (set, _args_set_ctor),
    (frozenset, _args_set_ctor),
    (complex, _args_complex),
    (slice, _args_slice),
    (bytearray, _args_bytes),
    (bytes, _args_bytes),
    (pathlib.PurePosixPath, _args_path),
    (pathlib.PureWindowsPath, _args_path),
    (torch.Size, _args_size),
    (torch.device, _args_device),
    (_get_layout, _args_layout),
    (_codecs_encode, _args_encode),
    (_rebuild_tensor, _args_rebuild),
    (_rebuild_tensor_v3, _args_rebuild),
    (_rebuild_parameter, _args_rebuild),
):
    _allow_call(_obj, _check)
_allow_call(
    collections.OrderedDict, _args_mapping_ctor, fresh_result=True
)  # state_dict()._metadata (BUILD)


@dataclass(frozen=True)
class DcpTypes:
    """DCP's metadata types as the policy uses them (:func:`dcp_types`)."""

    #: Classes NEWOBJ may create (empty, then filled by BUILD): the DCP dataclasses.
    classes: frozenset[type]
    #: Their fields, the only ones BUILD may set.
    fields: dict[type, frozenset[str]]
    #: ``_MEM_FORMAT_ENCODING`` (an enum a TensorProperties state holds), if torch has it.
    mem_enum: type | None
    #: ``TensorProperties`` (BUILD gets a checked 5-tuple), if torch has it.
    tensor_props: type | None


_dcp_types: DcpTypes | None = None


def loaded_dcp_types() -> DcpTypes | None:
    """:func:`dcp_types` if a decode has needed them already, else ``None`` (then no decoded
    value can hold a DCP dataclass: only a decode that named one made one)."""
    return _dcp_types


def dcp_types() -> DcpTypes:
    """DCP's metadata types, looked up on first use (importing ``torch.distributed.checkpoint``
    then, not when this module is imported); registers the enum's checked constructor."""
    global _dcp_types
    if _dcp_types is None:
        classes = dcp_classes()
        enum_cls = classes.get(("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"))
        props = classes.get(("torch.distributed.checkpoint.metadata", "TensorProperties"))
        data = tuple(
            c for c in classes.values() if isinstance(c, type) and dataclasses.is_dataclass(c)
        )
        if enum_cls is not None:
            _allow_call(enum_cls, _args_enum)
        _dcp_types = DcpTypes(
            frozenset(data),
            {c: frozenset(f.name for f in dataclasses.fields(c)) for c in data},
            enum_cls,
            props,
        )
    return _dcp_types
