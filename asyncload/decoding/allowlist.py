"""Allow-list unpickling: nothing from a checkpoint runs code, imports a module, or
makes the process hang, crash or run out of memory.

torch's own DCP reader decodes ``.metadata`` with ``pickle.load`` and non-tensor
objects with ``torch.load(weights_only=False)``: a hostile checkpoint runs code.
Here every pickle is decoded by asyncload's own pickle virtual machine
(:class:`~asyncload.decoding.vm.PickleVM`: all opcodes of protocols 0-5, over the bytes
in memory, with its resource guards: bounded memo, keys checked before they are hashed,
a work budget proportional to the pickle's size). This module is its policy, the only
place that decides what a checkpoint's pickle may build:

- ``GLOBAL``/``STACK_GLOBAL``/``INST`` resolve names only through an allow-list of data
  types; anything else raises :class:`UnsafeCheckpointError` before it is imported.
- ``REDUCE``/``OBJ``/``INST`` call only allow-listed constructors, each with a check of
  its arguments (types and sizes) before it runs; ``NEWOBJ`` creates only the DCP
  dataclasses, with no arguments; ``BUILD`` fills only objects this pickle just created,
  field by field (``TensorProperties.__setstate__`` gets a checked 5-tuple). Shared
  objects (dtypes, the storage-type markers) can never be modified.
- Persistent ids are accepted only where a caller passes a ``persistent_load`` that knows them.
- Decoded values nested deeper than ``max_depth``, or expanding through shared
  references beyond the work budget, are refused. Memory and time therefore grow
  linearly with the pickle.

torch.save records (``data.pkl``: DCP objects, torch.save files) may also hold numpy
arrays, dtypes and scalars of plain dtypes (checked field by field, never dtype ``O``), and
the globals the user trusts (``LoadOptions.safe_globals``: :class:`UserGlobals`, with
torch's ``weights_only`` semantics); a ``.metadata`` gets neither.

Besides: the allow-lists themselves (:func:`metadata_globals`, :func:`record_globals`,
extended through :func:`record_extensions`, :func:`allow_call`, :func:`allow_build`),
torch.save's tensor records as :class:`TensorRef`/:class:`StorageRef` (nothing is read),
and :func:`check_metadata`, the field-by-field shape check of a decoded ``.metadata``.

Errors: a name, call or resource use outside the policy is
:class:`UnsafeCheckpointError`; a damaged or truncated pickle is
:class:`CheckpointFormatError`. Nothing else escapes :func:`safe_loads`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import math
import operator
import pathlib
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncload._errors import CheckpointFormatError, UnsafeCheckpointError
from asyncload._paths import check_relative_path
from asyncload.decoding.vm import PickleVM, short_repr
from asyncload.decoding.vm import check_structure as _walk_structure

__all__ = [
    "MAX_DEPTH",
    "StorageRef",
    "TensorRef",
    "UserGlobals",
    "allow_build",
    "allow_call",
    "check_metadata",
    "check_planner_paths",
    "check_relative_path",
    "global_name",
    "metadata_globals",
    "numpy_globals",
    "record_extensions",
    "record_globals",
    "safe_loads",
    "short_repr",
    "storage_persistent_load",
    "user_globals",
]

#: Deepest nesting of containers accepted in a decoded object (Python's own pickler
#: cannot write much deeper: it recurses, up to the interpreter's recursion limit).
MAX_DEPTH = 1000

# --- the allow-lists ----------------------------------------------------------------


def _torch_dtypes() -> dict[tuple[str, str], Any]:
    # the module's own attributes (not dir() and getattr: half the time, and no module
    # __getattr__ runs); a process's first load builds this table
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)}


def _get_layout(name: str) -> torch.layout:
    # torch.serialization._get_layout, without its getattr on arbitrary strings.
    if not isinstance(name, str) or not name.startswith("torch.") or len(name) > 64:
        raise UnsafeCheckpointError(f"layout {short_repr(name)} is not a torch layout")
    value = getattr(torch, name[len("torch.") :], None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"layout {short_repr(name)} is not a torch layout")
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
    with warnings.catch_warnings():  # reading .dtype of the legacy classes warns that TypedStorage is deprecated
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
    if not isinstance(value, (tuple, list)) or len(value) > 1024 or not all(_is_int(v) for v in value):
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
        raise CheckpointFormatError(f"tensor record refers to {type(storage).__name__}, not a storage")
    if not _is_int(storage_offset) or storage_offset < 0:
        raise CheckpointFormatError(f"tensor record has a malformed storage offset: {short_repr(storage_offset)}")
    size_t, stride_t = _ints(size, "size"), _ints(stride, "stride")
    if len(size_t) != len(stride_t) or any(s < 0 for s in size_t) or any(s < 0 for s in stride_t):
        raise CheckpointFormatError(
            f"tensor record has inconsistent size {short_repr(size_t)} and stride {short_repr(stride_t)}"
        )
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(f"tensor record has a malformed requires_grad: {short_repr(requires_grad)}")
    if backward_hooks is not None and not isinstance(backward_hooks, dict):
        raise CheckpointFormatError("tensor record has malformed backward hooks")
    dt = dtype if isinstance(dtype, torch.dtype) else storage.dtype
    _check_grad(dt, requires_grad, "tensor")
    return TensorRef(storage, storage_offset, size_t, stride_t, dt, requires_grad)


def _check_grad(dtype: Any, requires_grad: bool, what: str) -> None:
    """Only floating point and complex tensors can require gradients (torch raises a
    RuntimeError building any other): a record that says otherwise was not written by torch."""
    if requires_grad and isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex):
        raise CheckpointFormatError(
            f"{what} record of dtype {dtype} has requires_grad=True: only floating point and complex tensors "
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
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype)


def _rebuild_parameter(
    data: Any, requires_grad: Any = True, backward_hooks: Any = None, state: Any = None
) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise CheckpointFormatError("parameter record does not wrap a tensor")
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(f"parameter record has a malformed requires_grad: {short_repr(requires_grad)}")
    _check_grad(data.dtype, requires_grad, "parameter")
    return TensorRef(data.storage, data.storage_offset, data.size, data.stride, data.dtype, requires_grad, True)


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
            **record_extensions(),
        }
    return _record_cache


def record_extensions() -> dict[tuple[str, str], Any]:
    """Names torch.save records may use beyond torch's tensors and DCP's types: the data that
    training loops save next to their tensors. Each source registers the calls and BUILD
    rules of its names (:func:`allow_call`, :func:`allow_build`); a new kind of data is one
    more source here."""
    return {**numpy_globals()}


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
        raise CheckpointFormatError(f"torch.save record has a malformed storage reference: {short_repr(pid)}")
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
    if len(args) > 4096 or not all(type(a) is str for a in args) or sum(len(a) for a in args) > 65536:
        raise _bad_args(what, args)
    return 1 + sum(len(a) for a in args) // 8


def _args_size(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if len(args) > 1 or (
        args and (type(args[0]) not in (list, tuple) or len(args[0]) > 1024 or not all(_is_int(v) for v in args[0]))
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
    if len(args) != 1 or type(args[0]) not in (int, str) or (type(args[0]) is str and len(args[0]) > 64):
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
_allow_call(collections.OrderedDict, _args_mapping_ctor, fresh_result=True)  # state_dict()._metadata (BUILD)


def _dcp_enum_and_classes() -> tuple[tuple[type, ...], type | None, type | None]:
    classes = _dcp_classes()
    enum_cls = classes.get(("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"))
    props = classes.get(("torch.distributed.checkpoint.metadata", "TensorProperties"))
    data_classes = tuple(c for c in classes.values() if isinstance(c, type) and dataclasses.is_dataclass(c))
    return data_classes, enum_cls, props


_DCP_DATACLASSES, _MEM_ENUM, _TENSOR_PROPS = _dcp_enum_and_classes()
if _MEM_ENUM is not None:
    _allow_call(_MEM_ENUM, _args_enum)
#: Classes NEWOBJ may create (empty, then filled by BUILD): the DCP dataclasses.
_NEWOBJ_CLASSES: frozenset[type] = frozenset(_DCP_DATACLASSES)
_DATACLASS_FIELDS: dict[type, frozenset[str]] = {
    c: frozenset(f.name for f in dataclasses.fields(c)) for c in _DCP_DATACLASSES
}


# --- numpy data: arrays, dtypes and scalars of plain dtypes -------------------------
# What training loops save next to their tensors (``np.random.get_state()``, metrics as numpy
# scalars). numpy pickles an array as ``_reconstruct(ndarray, (0,), b"b")`` then BUILD
# ``(1, shape, dtype, is_fortran, raw bytes)``, a dtype as ``dtype("u4", False, True)`` then
# BUILD ``(3, byteorder, None, None, None, elsize, alignment, flags)`` (4 and a 9th item for
# datetimes), a scalar as ``scalar(dtype, raw bytes)``. Each is checked before numpy sees it:
# the type code against the plain kinds (never ``O``: objects run code when unpickled), a
# dtype's state against the state numpy itself gives that dtype, an array's bytes against
# its shape and item size (so the array costs what its pickle holds). Structured dtypes are
# not decoded. numpy 1.x wrote ``numpy.core.multiarray``, numpy 2 writes ``numpy._core.multiarray``.

#: The type codes numpy pickles a plain dtype with (``np.dtype(x).__reduce__()[1][0]``).
_NP_TYPECODE = re.compile(r"(?:b1|[iu][1248]|f(?:2|4|8|12|16)|c(?:8|16|24|32)|[SUV][1-9][0-9]{0,8}|[Mm]8)\Z")
_NP_UNITS = frozenset(("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as", "generic"))
#: The most dimensions numpy allows.
_NP_MAX_DIMS = 64


def _np_multiarray() -> Any:
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    return multiarray


def _np_refuse_objects(vm: PickleVM, what: str) -> UnsafeCheckpointError:
    return vm.unsafe(
        f"holds a numpy {what} of Python objects (dtype 'O'), whose decoding would run code from the "
        "checkpoint; only numpy data of plain dtypes is decoded"
    )


def _args_np_dtype(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if len(args) != 3 or type(args[0]) is not str:
        raise vm.bad(f"numpy.dtype called with malformed arguments {short_repr(args)}")
    if args[0][:1] == "O":
        raise _np_refuse_objects(vm, "dtype")
    # copy=True: a new dtype object that BUILD may fill (never numpy's shared builtin one)
    if not _NP_TYPECODE.match(args[0]) or args[1] is not False or args[2] is not True:
        raise vm.bad(f"numpy.dtype called with malformed arguments {short_repr(args)}")
    return 2


def _np_plain_dtype(vm: PickleVM, dtype: Any, what: str) -> Any:
    np_dtype = np.dtype
    if not isinstance(dtype, np_dtype):
        raise vm.bad(f"{what} has a dtype of type {type(dtype).__name__}")
    if dtype.hasobject:
        raise _np_refuse_objects(vm, what)
    if dtype.names is not None or dtype.subdtype is not None or dtype.itemsize <= 0:
        raise vm.bad(f"{what} has a dtype that is not a plain numpy dtype")
    vm.seal(dtype)  # in use: a later BUILD may not change it
    return dtype


def _build_np_dtype(vm: PickleVM, inst: Any, state: Any) -> None:
    if type(state) is not tuple or len(state) not in (8, 9) or state[0] != len(state) - 5:
        raise vm.bad(f"numpy dtype with malformed state {short_repr(state)}")
    if state[2:5] != (None, None, None):
        raise vm.unsafe("holds a structured numpy dtype, which asyncload does not decode")
    byteorder = state[1]
    if byteorder not in ("<", ">", "|", "="):
        raise vm.bad(f"numpy dtype with byte order {short_repr(byteorder)}")
    expected = inst
    if len(state) == 9:  # datetime64 / timedelta64: (None, (unit, count, 1, 1))
        meta = state[8]
        if (
            inst.kind not in "Mm"
            or type(meta) is not tuple
            or len(meta) != 2
            or meta[0] is not None
            or type(meta[1]) is not tuple
            or len(meta[1]) != 4
            or type(meta[1][0]) is not bytes
            or meta[1][0].decode("ascii", "replace") not in _NP_UNITS
            or not all(type(v) is int and 1 <= v < 1 << 31 for v in meta[1][1:])
        ):
            raise vm.bad(f"numpy datetime dtype with malformed unit {short_repr(state[8])}")
        unit, count = meta[1][0].decode("ascii"), meta[1][1]
        expected = np.dtype(f"{inst.str[1:]}[{count if count != 1 else ''}{unit}]")
    if byteorder in "<>":
        expected = expected.newbyteorder(byteorder)
    if expected.__reduce__()[2] != state:  # only the state numpy itself writes for this dtype
        raise vm.bad(f"numpy dtype {inst.str!r} with a state numpy does not write: {short_repr(state)}")
    vm.charge(4)
    inst.__setstate__(state)
    vm.seal(inst)


def _args_np_reconstruct(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if len(args) != 3 or args[0] is not np.ndarray or args[1] != (0,) or type(args[1]) is not tuple:
        raise vm.bad(f"numpy _reconstruct called with malformed arguments {short_repr(args)}")
    if args[2] not in (b"b", "b"):
        raise vm.bad(f"numpy _reconstruct called with malformed arguments {short_repr(args)}")
    return 2


def _build_np_array(vm: PickleVM, inst: Any, state: Any) -> None:
    if type(inst) is not np.ndarray or type(state) is not tuple or len(state) != 5 or state[0] != 1:
        raise vm.bad(f"numpy array with malformed state {short_repr(state)[:120]}")
    _, shape, dtype, fortran, raw = state
    if (
        type(shape) is not tuple
        or len(shape) > _NP_MAX_DIMS
        or not all(_is_int(n) and n >= 0 for n in shape)
        or type(fortran) is not bool
    ):
        raise vm.bad(f"numpy array with malformed shape {short_repr(shape)} or order {short_repr(fortran)}")
    if type(raw) is list:
        raise _np_refuse_objects(vm, "array")
    _np_plain_dtype(vm, dtype, "numpy array")
    if type(raw) not in (bytes, bytearray):
        raise vm.bad(f"numpy array data is a {type(raw).__name__}, not bytes")
    need = math.prod(shape) * dtype.itemsize  # Python ints: no overflow, nothing allocated
    if need != len(raw):
        raise vm.bad(
            f"numpy array of shape {list(shape)[:8]} and dtype {dtype.str!r} needs {need} bytes, its data holds {len(raw)}"
        )
    vm.charge(1 + len(raw) // 64)
    inst.__setstate__(state)
    vm.seal(inst)


def _args_np_scalar(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if len(args) != 2:
        if len(args) == 1 and isinstance(args[0], np.dtype) and args[0].hasobject:
            raise _np_refuse_objects(vm, "scalar")
        raise vm.bad(f"numpy scalar called with malformed arguments {short_repr(args)}")
    dtype = _np_plain_dtype(vm, args[0], "numpy scalar")
    if type(args[1]) is not bytes or len(args[1]) != dtype.itemsize:
        raise vm.bad(f"numpy scalar called with malformed arguments {short_repr(args)}")
    return 2


def numpy_globals() -> dict[tuple[str, str], Any]:
    """The names numpy data is pickled with (see the section's comment)."""
    multiarray = _np_multiarray()
    out: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        out[(module, "_reconstruct")] = multiarray._reconstruct
        out[(module, "scalar")] = multiarray.scalar
    return out


allow_call(np.dtype, _args_np_dtype, fresh_result=True)
allow_call(_np_multiarray()._reconstruct, _args_np_reconstruct, fresh_result=True)
allow_call(_np_multiarray().scalar, _args_np_scalar)
allow_build(np.dtype, _build_np_dtype)
allow_build(np.ndarray, _build_np_array)


# --- globals the user trusts: LoadOptions.safe_globals --------------------------------


def global_name(entry: Any) -> str:
    """``"module.qualname"`` of a ``LoadOptions.safe_globals`` entry (a string stays itself)."""
    if isinstance(entry, str):
        return entry
    return f"{entry.__module__}.{entry.__qualname__}"


class UserGlobals:
    """The globals a user trusts (``LoadOptions.safe_globals``), as torch's
    ``add_safe_globals``: by ``"module.qualname"``; a string entry is imported only when a
    pickle names it. Calls, ``NEWOBJ`` and ``BUILD`` of these run the user's own code
    (``__setstate__`` if defined, else ``__dict__`` and slots updated), as torch's
    ``weights_only`` unpickler does."""

    def __init__(self, entries: tuple[Any, ...]) -> None:
        self.entries = entries
        self._by_name: dict[str, Any] = {global_name(e): e for e in entries}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def find(self, module: str, name: str) -> Any:
        """The object the pickle's ``module.name`` stands for, or KeyError."""
        entry = self._by_name[f"{module}.{name}"]
        if not isinstance(entry, str):
            return entry
        import importlib

        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        self._by_name[entry] = obj
        return obj


_user_globals_cache: dict[tuple[Any, ...], UserGlobals] = {}


def user_globals(entries: tuple[Any, ...]) -> UserGlobals:
    """The :class:`UserGlobals` of ``LoadOptions.safe_globals`` (one per distinct tuple)."""
    found = _user_globals_cache.get(entries)
    if found is None:
        if len(_user_globals_cache) > 64:
            _user_globals_cache.clear()
        found = _user_globals_cache[entries] = UserGlobals(entries)
    return found


# --- the policy -------------------------------------------------------------------


class _CheckpointPolicy:
    """What a checkpoint's pickle may build (a :class:`~asyncload.decoding.vm.PicklePolicy`):
    the names in ``allowed``, the calls of :data:`_CALLABLE_CHECKS`, the DCP dataclasses,
    the BUILD rules of :data:`_BUILD_RULES`, the persistent ids ``persistent_load`` knows,
    and the globals the user trusts (``user``: ``LoadOptions.safe_globals``, where given)."""

    record_fields: Mapping[type, frozenset[str]] = _DATACLASS_FIELDS
    record_classes: frozenset[type] = _NEWOBJ_CLASSES
    shape_type: type | None = torch.Size
    atomic_key_types: tuple[type, ...] = (torch.dtype, torch.layout, torch.memory_format, torch.device, enum.Enum)

    def __init__(
        self,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None,
        user: UserGlobals | None = None,
    ) -> None:
        self._allowed = allowed
        self._persistent = persistent_load
        #: None: a strict decode (``.metadata``), where safe_globals do not apply.
        self._user = user
        #: The user's globals this pickle named, by id (kept alive): they may be called,
        #: created and built as torch's weights_only unpickler allows them.
        self._user_objs: dict[int, Any] = {}
        self._missing: str | None = None
        self.unsafe_advice = "Only load checkpoints you trust with torch's own reader."

    def find_class(self, vm: PickleVM, module: Any, name: Any) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            pass
        mod = module[:100] if type(module) is str else short_repr(module)
        nm = name[:100] if type(name) is str else short_repr(name)
        if self._user is not None and type(module) is str and type(name) is str:
            try:
                obj = self._user.find(module, name)
            except KeyError:
                pass
            except Exception as exc:  # a string the user gave that does not import
                raise vm.unsafe(
                    f"asks for {mod}.{nm}, which LoadOptions.safe_globals names but which cannot be "
                    f"imported here ({type(exc).__name__}: {str(exc)[:200]})"
                ) from None
            else:
                self._user_objs[id(obj)] = obj
                return obj
            self.unsafe_advice = (
                f"If you trust the checkpoint's {mod}.{nm}, pass it in "
                f'LoadOptions(safe_globals=["{mod}.{nm}"]) '
                "(the class or function itself, or that string); otherwise load the checkpoint only "
                "with torch's own reader, and only if you trust it."
            )
        raise vm.unsafe(
            f"asks to import {mod}.{nm}, which is not on asyncload's allow-list of checkpoint data types"
        ) from None

    def _user_obj(self, obj: Any) -> bool:
        return self._user_objs.get(id(obj)) is obj

    def call(self, vm: PickleVM, func: Any, args: Any) -> Any:
        entry = _CALLABLE_CHECKS.get(id(func))
        if entry is None or entry[0] is not func:
            if self._user_obj(func):
                if type(args) is not tuple:
                    raise vm.bad(f"call arguments are a {type(args).__name__}, not a tuple")
                vm.charge(1 + len(args))
                out = func(*args)  # the user trusts it (LoadOptions.safe_globals)
                vm.mark_fresh(out)
                return out
            name = func.__qualname__ if isinstance(func, type) else type(func).__name__
            raise vm.unsafe(f"asks to call {short_repr(name)}, which may not be called while decoding")
        if type(args) is not tuple:
            raise vm.bad(f"call arguments are a {type(args).__name__}, not a tuple")
        what = getattr(func, "__qualname__", None) or type(func).__name__
        vm.charge(entry[1](vm, args, what))
        try:
            out = func(*args)
            if entry[2]:
                vm.mark_fresh(out)  # a new object BUILD may fill (OrderedDict._metadata, numpy data)
            return out
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            raise type(exc)(f"{vm.what}: {exc}") from None
        except Exception as exc:
            raise CheckpointFormatError(f"{vm.what}: {what} rejected its arguments ({type(exc).__name__})") from None

    def persistent_load(self, vm: PickleVM, pid: Any) -> Any:
        if self._persistent is None:
            raise vm.unsafe(f"holds a persistent reference {short_repr(pid)}, which is not allowed here")
        try:
            return self._persistent(pid)
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            raise type(exc)(f"{vm.what}: {exc}") from None

    def newobj(self, vm: PickleVM, cls: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(cls, type) and self._user_obj(cls):
            if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
                raise vm.bad(f"{cls.__name__} created with malformed arguments")
            vm.charge(4 + len(args))
            made: Any = cls.__new__(cls, *args, **(kwargs or {}))  # the user trusts it (safe_globals)
            vm.mark_fresh(made)
            return made
        if not isinstance(cls, type) or cls not in _NEWOBJ_CLASSES:
            name = cls.__qualname__ if isinstance(cls, type) else type(cls).__name__
            raise vm.unsafe(f"asks to create a {short_repr(name)} object, which is not a checkpoint data class")
        if args or kwargs:
            raise vm.bad(f"{cls.__name__} created with arguments")
        obj: Any = object.__new__(cls)  # the DCP dataclasses define no __new__ of their own
        vm.mark_fresh(obj)
        vm.charge(4)
        return obj

    def build(self, vm: PickleVM, inst: Any, state: Any) -> None:
        if (
            type(inst) is collections.OrderedDict
            and type(state) is dict
            and set(state) == {"_metadata"}
            and type(state["_metadata"]) in (dict, collections.OrderedDict)
        ):
            # nn.Module.state_dict() carries its per-module versions as ``_metadata`` (every
            # torch.save(model.state_dict()) file has one; torch's weights_only unpickler allows it)
            vm.charge(1)
            inst.__dict__.update(state)
            return
        cls = type(inst)
        if self._user_obj(cls):  # as torch's weights_only unpickler builds an allowed type
            vm.charge(1 + (len(state) if isinstance(state, (dict, tuple)) else 0))
            setstate = getattr(inst, "__setstate__", None)
            if setstate is not None:
                setstate(state)
                return
            slots = None
            if type(state) is tuple and len(state) == 2:
                state, slots = state
            if state:
                inst.__dict__.update(state)
            if slots:
                for k, v in slots.items():
                    setattr(inst, k, v)
            return
        if not vm.is_fresh(inst):
            raise vm.unsafe(f"asks to modify a {type(inst).__name__} object it did not create")
        for rule_cls, rule in _BUILD_RULES:
            if isinstance(inst, rule_cls):
                rule(vm, inst, state)
                return
        if cls is _TENSOR_PROPS:
            ok = (
                type(state) is tuple
                and len(state) == 5
                and isinstance(state[0], torch.dtype)
                and isinstance(state[1], torch.layout)
                and type(state[2]) is bool
                and _MEM_ENUM is not None
                and isinstance(state[3], _MEM_ENUM)
                and type(state[4]) is bool
            )
            if not ok:
                raise vm.bad(f"TensorProperties with malformed state {short_repr(state)}")
            inst.__setstate__(state)
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if state is None:
            return
        if type(state) is not dict:
            raise vm.bad(f"{cls.__name__} state is a {type(state).__name__}, not a dict")
        if cls is collections.OrderedDict:  # attributes of the dict, e.g. nn.Module.state_dict()._metadata
            if len(state) > 64 or not all(type(k) is str and not k.startswith("__") for k in state):
                raise vm.bad(f"OrderedDict with malformed attributes {short_repr(list(state))}")
            inst.__dict__.update(state)
            return
        fields = _DATACLASS_FIELDS[cls]
        for k in state:
            if type(k) is not str or k not in fields:
                raise vm.bad(f"{cls.__name__} has no field {short_repr(k)}")
        vm.charge(len(state))
        inst.__dict__.update(state)


# --- decoding -----------------------------------------------------------------------


_LEAF_TYPES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    bool,
    complex,
    type(None),
    torch.dtype,
    torch.layout,
    torch.memory_format,
    torch.device,
    enum.Enum,
    pathlib.PurePath,
    TensorRef,
    StorageRef,
)


def _children(o: Any) -> list[Any] | None:
    if isinstance(o, _LEAF_TYPES):
        return None
    if isinstance(o, dict):
        kids = [*o.keys(), *o.values()]
        if type(o) is not dict and hasattr(o, "__dict__"):
            kids.extend(vars(o).values())  # OrderedDict attributes (state_dict()._metadata)
        return kids
    if isinstance(o, (list, tuple, set, frozenset)):
        return list(o)
    if type(o) is slice:
        return [o.start, o.stop, o.step]
    if type(o) in _NEWOBJ_CLASSES:
        return list(vars(o).values())
    fields = getattr(o, "__dict__", None)
    if type(fields) is dict and not isinstance(o, type):  # an object of a class the user trusts
        return list(fields.values())
    return None


def _check_structure(obj: Any, what: str, max_depth: int, budget: int) -> None:
    """:func:`~asyncload.decoding.vm.check_structure` over checkpoint values (see :func:`_children`)."""
    if _flat_within(obj, max_depth, budget):
        return
    _walk_structure(obj, what, max_depth, budget, _children)


def _flat_within(obj: Any, max_depth: int, budget: int) -> bool:
    """Whether ``obj`` is a plain dict of strings to tuples (or lists) of strings (DCP's
    ``planner_data``: each key's path) that the walk would accept: two levels deep, and
    ``1 + len + sum(1 + len(value))`` nodes with shared values counted each time, as the walk
    counts them. Anything else (or over the budget) is left to the walk and its messages."""
    if type(obj) is not dict or max_depth < 2:
        return False
    n = 1 + len(obj)
    for k, v in obj.items():
        if type(k) is not str or type(v) not in (tuple, list):
            return False
        for x in v:
            if type(x) is not str:
                return False
        n += 1 + len(v)
    return n <= budget


def safe_loads(
    data: bytes | bytearray | memoryview,
    *,
    what: str,
    allowed: Mapping[tuple[str, str], Any] | None = None,
    persistent_load: Callable[[Any], Any] | None = None,
    max_size: int | None = None,
    max_depth: int = MAX_DEPTH,
    check_structure: bool = True,
    expect: type | None = None,
    safe_globals: tuple[Any, ...] | None = None,
) -> Any:
    """Unpickle ``data`` allowing only the globals in ``allowed`` (default: DCP metadata types).

    ``safe_globals``: the globals the user trusts (``LoadOptions.safe_globals``) for a
    decode of checkpoint objects; ``None`` (``.metadata``): none, and refusals do not
    suggest any.

    Raises :class:`UnsafeCheckpointError` for a non-allowed global, call, persistent id
    or resource use (nesting deeper than ``max_depth``, amplification), and
    :class:`CheckpointFormatError` for a pickle that is damaged or too large.
    ``what`` names the source in messages (for example ``"s3://b/ckpt/.metadata"``).
    ``check_structure=False`` skips the final depth walk, for callers that check the
    decoded object's shape themselves (``.metadata``: :func:`check_metadata`).
    ``expect``: the type the pickle must hold; anything else is a CheckpointFormatError
    (after the depth walk, so that a hostile structure is still reported as unsafe).
    """
    if max_size is not None and len(data) > max_size:
        raise CheckpointFormatError(
            f"{what} is {len(data)} bytes, more than the {max_size} allowed (LoadOptions.max_metadata_size)"
        )
    policy = _CheckpointPolicy(
        metadata_globals() if allowed is None else allowed,
        persistent_load,
        None if safe_globals is None else user_globals(safe_globals),
    )
    vm = PickleVM(bytes(data), policy, what)
    obj = vm.run()
    if check_structure or (expect is not None and not isinstance(obj, expect)):
        _check_structure(obj, what, max_depth, vm.work_limit)
    if expect is not None and not isinstance(obj, expect):
        raise CheckpointFormatError(f"{what} does not hold {expect.__name__} (found {type(obj).__name__})")
    return obj


# --- the shape of a DCP .metadata ---------------------------------------------------


def _check_size(v: Any, where: str, ndim: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, tuple) or len(v) > 1024 or not all(_is_int(x) and x >= 0 for x in v):
        raise CheckpointFormatError(f"{where} is not a shape: {short_repr(v)}")
    if ndim is not None and len(v) != ndim:
        raise CheckpointFormatError(f"{where} has {len(v)} dimensions, the tensor has {ndim}")
    return v


def _check_coverage(chunks: list[Any], size: tuple[int, ...], where: str) -> None:
    """A saved tensor's chunks are disjoint and cover every element of its ``size``.

    A load plans its reads from the chunks: a gap would leave destination elements
    unwritten (old values reported as loaded), an overlap would write some twice from
    different bytes. Cost: a volume sum, then a sweep over the chunks sorted by their
    offsets, comparing each with the chunks that can still reach it in the swept
    dimension (DCP's chunks are a grid: each meets a few neighbours).
    """
    total = math.prod(size)
    if total == 0:
        return  # an empty tensor: DCP writes one chunk of the same empty size
    boxes = []
    volume = 0
    for i, ch in enumerate(chunks):
        lens = tuple(ch.sizes)
        n = math.prod(lens)
        if n == 0:
            continue  # holds no element: neither covers nor overlaps anything
        volume += n
        boxes.append((tuple(ch.offsets), lens, i))
    if not boxes:
        raise CheckpointFormatError(
            f"{where}: the tensor of size {list(size)} lists no chunk that holds its elements: nothing of it was saved"
        )
    if len(size) == 0:  # a scalar: any non-empty chunk is the whole tensor
        if len(boxes) > 1:
            raise CheckpointFormatError(f"{where}: the scalar tensor is saved in {len(boxes)} overlapping chunks")
        return
    # sweep along the dimension the chunks are split most in (row- or column-sharded alike)
    d = max(range(len(size)), key=lambda k: len({b[0][k] for b in boxes}))
    boxes.sort(key=lambda b: (b[0][d], b[2]))
    active: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for box in boxes:
        offs, lens, i = box
        # chunks that end before this one starts in dimension d can meet no later chunk
        active = [b for b in active if b[0][d] + b[1][d] > offs[d]]
        for o2, l2, j in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(offs, lens, o2, l2)):
                raise CheckpointFormatError(
                    f"{where}: chunks {j} (at {list(o2)}, size {list(l2)}) and {i} (at {list(offs)}, "
                    f"size {list(lens)}) overlap"
                )
        active.append(box)
    if volume != total:
        raise CheckpointFormatError(
            f"{where}: the chunks hold {volume} of the tensor's {total} elements (size {list(size)}): "
            "part of the tensor was not saved"
        )


# The checks below in bulk, for the layouts DCP writes: each proves a table right or says
# it cannot (then the field-by-field checks run and name what is wrong). A .metadata of
# 1 M chunks would otherwise spend seconds in Python per field.

_offsets_of = operator.attrgetter("offsets")
_sizes_of = operator.attrgetter("sizes")
_NONE = type(None)


def _int64s(shapes: list[Any], ndim: int) -> np.ndarray[Any, Any] | None:
    """``shapes`` (torch.Size objects of ``ndim`` ints: int64 by construction) as an array
    of ``len(shapes)`` rows, or None when any is something else."""
    if shapes and (set(map(type, shapes)) != {torch.Size} or set(map(len, shapes)) != {ndim}):
        return None
    flat = np.fromiter(itertools.chain.from_iterable(shapes), dtype=np.int64, count=len(shapes) * ndim)
    return flat.reshape(len(shapes), ndim)


def _grid_covers(offs: np.ndarray[Any, Any], lens: np.ndarray[Any, Any], size: tuple[int, ...]) -> bool:
    """Whether the boxes (``offs``, ``lens``: rows inside ``size``) with elements are the
    cells of a grid, each once: per dimension their extents partition the tensor's, and
    there are as many boxes as cells. Then they are disjoint and cover every element."""
    held = (lens > 0).all(axis=1)
    offs, lens = offs[held], lens[held]
    boxes = len(offs)
    if boxes == 0:
        return False
    if boxes == 1:  # one chunk (what one process saves): a grid of one cell is the whole tensor
        return bool((offs[0] == 0).all() and (lens[0] == np.asarray(size, dtype=np.int64)).all())
    cell = np.zeros(boxes, dtype=np.int64)
    cells = 1
    for k, extent in enumerate(size):
        starts = _unique(offs[:, k])
        at = np.searchsorted(starts, offs[:, k])
        length = np.zeros(len(starts), dtype=np.int64)
        length[at] = lens[:, k]
        if (length[at] != lens[:, k]).any():  # one start, two lengths
            return False
        if starts[0] != 0 or (starts[1:] != starts[:-1] + length[:-1]).any() or starts[-1] + length[-1] != extent:
            return False
        cells *= len(starts)
        if cells > boxes:
            return False
        cell = cell * len(starts) + at
    return cells == boxes and len(_unique(cell)) == boxes


def _unique(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``np.unique(a)`` of a 1-D integer array (``np.unique`` imports ``numpy.ma`` on first
    use: 5 ms of a fresh process's first load)."""
    s = np.sort(a)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def _chunks_fine(chunks: list[Any], size: tuple[int, ...], chunk_type: type) -> bool:
    """Whether a tensor's chunks are provably what the field-by-field checks accept."""
    if type(size) is not torch.Size:
        return False
    if len(chunks) == 1:  # what one process saves: one chunk, the whole tensor (no arrays needed)
        only = chunks[0]
        if type(only) is not chunk_type:
            return False
        offs, lens = getattr(only, "offsets", None), getattr(only, "sizes", None)
        return (
            type(offs) is torch.Size
            and type(lens) is torch.Size
            and len(offs) == len(size)
            and not any(offs)
            and tuple(lens) == tuple(size)
        )
    if set(map(type, chunks)) != {chunk_type}:
        return False
    try:
        offs_list, lens_list = list(map(_offsets_of, chunks)), list(map(_sizes_of, chunks))
    except AttributeError:
        return False
    ndim = len(size)
    offs, lens = _int64s(offs_list, ndim), _int64s(lens_list, ndim)
    if offs is None or lens is None or (ndim and (offs.min() < 0 or lens.min() < 0)):
        return False
    if ndim and (offs > np.array(size, dtype=np.int64) - lens).any():  # o + n > s, without overflow
        return False
    if math.prod(size) == 0:
        return True
    if ndim == 0:
        return len(chunks) == 1
    return _grid_covers(offs, lens, size)


_I64_MAX = (1 << 63) - 1


def _storage_fine(sd: dict[Any, Any], index_type: type, info_type: type) -> bool:
    """Whether ``storage_data`` is provably what the field-by-field checks accept."""
    if not sd:
        return True
    keys, infos = list(sd), list(sd.values())
    if set(map(type, keys)) != {index_type} or set(map(type, infos)) != {info_type}:
        return False
    try:
        fqns = list(map(operator.attrgetter("fqn"), keys))
        offsets = list(map(operator.attrgetter("offset"), keys))
        hints = list(map(operator.attrgetter("index"), keys))
        paths = list(map(operator.attrgetter("relative_path"), infos))
        starts = list(map(operator.attrgetter("offset"), infos))
        lengths = list(map(operator.attrgetter("length"), infos))
    except AttributeError:
        return False
    if set(map(type, fqns)) != {str} or not set(map(type, hints)) <= {int, _NONE}:
        return False
    if {getattr(i, "transform_descriptors", None) is None for i in infos} != {True}:
        return False
    shapes = [o for o in offsets if o is not None]
    if not set(map(type, shapes)) <= {torch.Size} or (shapes and max(map(len, shapes)) > 1024):
        return False
    if min(itertools.chain.from_iterable(shapes), default=0) < 0:
        return False
    ints = [h for h in hints if h is not None]
    if ints and (min(ints) < 0 or max(ints) > _I64_MAX):
        return False
    if set(map(type, starts)) != {int} or set(map(type, lengths)) != {int} or set(map(type, paths)) != {str}:
        return False
    if min(starts) < 0 or min(lengths) < 0 or max(starts) > _I64_MAX or max(lengths) > _I64_MAX:
        return False
    try:
        for path in set(paths):
            check_relative_path(path, "")
    except CheckpointFormatError:
        return False
    return True


def check_metadata(md: Any, what: str) -> None:
    """Check that a decoded ``.metadata`` has the shape DCP writes, field by field.

    Raises CheckpointFormatError naming the first field that does not: keys that are
    not strings, chunks that do not fit their tensor, storage entries with a negative
    offset or a path outside the checkpoint, and so on. After this, every value the
    planner and reader use has the type they expect.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{what} does not hold DCP Metadata (found {type(md).__name__})")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise CheckpointFormatError(f"{what}: state_dict_metadata is a {type(sdm).__name__}, not a dict")
    for fqn, smd in sdm.items():
        if type(fqn) is not str:
            raise CheckpointFormatError(f"{what}: key {short_repr(fqn)} is not a string")
        where = f"{what}: key {fqn!r:.200}"
        if isinstance(smd, TensorStorageMetadata):
            props = getattr(smd, "properties", None)
            if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
                raise CheckpointFormatError(f"{where} has malformed tensor properties")
            size = _check_size(getattr(smd, "size", None), f"{where} size")
            chunks = getattr(smd, "chunks", None)
            if not isinstance(chunks, list):
                raise CheckpointFormatError(f"{where}: chunks is a {type(chunks).__name__}, not a list")
            if _chunks_fine(chunks, size, ChunkStorageMetadata):
                continue
            for i, ch in enumerate(chunks):
                if not isinstance(ch, ChunkStorageMetadata):
                    raise CheckpointFormatError(f"{where}: chunk {i} is a {type(ch).__name__}")
                offs = _check_size(getattr(ch, "offsets", None), f"{where} chunk {i} offsets", len(size))
                lens = _check_size(getattr(ch, "sizes", None), f"{where} chunk {i} sizes", len(size))
                if any(o + n > s for o, n, s in zip(offs, lens, size)):
                    raise CheckpointFormatError(
                        f"{where}: chunk {i} at {list(offs)} of size {list(lens)} "
                        f"lies outside the tensor of size {list(size)}"
                    )
            _check_coverage(chunks, size, where)
        elif not isinstance(smd, BytesStorageMetadata):
            raise CheckpointFormatError(f"{where} is described by a {type(smd).__name__}")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        raise CheckpointFormatError(f"{what}: storage_data is a {type(sd).__name__}, not a dict")
    for idx, info in () if _storage_fine(sd, MetadataIndex, _StorageInfo) else sd.items():
        if not isinstance(idx, MetadataIndex) or type(getattr(idx, "fqn", None)) is not str:
            raise CheckpointFormatError(f"{what}: storage_data key {short_repr(idx)} is not a MetadataIndex")
        off = getattr(idx, "offset", None)
        if off is not None:
            _check_size(off, f"{what}: storage_data key {idx.fqn!r:.200} offset")
        hint = getattr(idx, "index", None)
        if hint is not None and not (_is_int(hint) and hint >= 0):
            raise CheckpointFormatError(f"{what}: storage_data key {idx.fqn!r:.200} has index {short_repr(hint)}")
        where = f"{what}: storage entry of {idx.fqn!r:.200}"
        check_relative_path(getattr(info, "relative_path", None), where)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_is_int(offset) and offset >= 0 and _is_int(length) and length >= 0):  # type: ignore[operator]
            raise CheckpointFormatError(f"{where} has offset {short_repr(offset)} and length {short_repr(length)}")
        td = getattr(info, "transform_descriptors", None)
        if td is not None and (not isinstance(td, (list, tuple)) or not all(type(t) is str for t in td)):
            raise CheckpointFormatError(f"{where} has malformed transform descriptors")
    version = getattr(md, "version", None)
    if version is not None and (type(version) is not str or len(version) > 64):
        raise CheckpointFormatError(f"{what}: version {short_repr(version)} is not a version string")
    meta = getattr(md, "storage_meta", None)
    if meta is not None and not isinstance(meta, StorageMeta):
        raise CheckpointFormatError(f"{what}: storage_meta is a {type(meta).__name__}")
    planner_data = getattr(md, "planner_data", None)
    _check_structure(planner_data, f"{what} (planner_data)", 64, 1 << 24)
    _check_structure(meta, f"{what} (storage_meta)", 16, 1 << 20)
    check_planner_paths(sdm, planner_data, what)


def check_planner_paths(sdm: Mapping[str, Any], planner_data: Any, what: str) -> None:
    """Check that the paths ``planner_data`` gives the keys of ``sdm`` nest them into one tree
    without a clash, before anything is allocated or nested. A key's path is its entry (a
    non-empty tuple or list), else ``(fqn,)``, as :func:`asyncload._read.nest` takes it.

    Each step is a ``str`` (a dict key) or an ``int`` (a list index, ``0 <= i < len(sdm)``: a
    list of ``n`` saved elements holds at least ``n`` keys), the first a ``str``; the steps
    under one container are all of one kind; no path is another's, nor runs through another
    key's value (a tensor, an object). Raises :class:`CheckpointFormatError` naming the key,
    its path and the rule, so that a forged ``.metadata`` can neither write into a tensor's
    elements, nor grow a list without bound, nor end in a raw ``IndexError``/``TypeError``.
    Time and memory: linear in the paths' total length.
    """
    mapping = planner_data if isinstance(planner_data, dict) else {}
    n = len(sdm)
    # a trie of the paths: inner nodes are dicts, a key's place holds its name (a str)
    root: dict[Any, Any] = {}
    for fqn in sdm:
        path = mapping.get(fqn)
        if not isinstance(path, (tuple, list)) or not path:
            path = (fqn,)
        node: Any = root
        last = len(path) - 1
        for i, step in enumerate(path):
            kind = type(step)
            if kind is int:
                if not 0 <= step < n:
                    _bad_path(what, fqn, path, f"indexes a list at {step}, outside the {n} keys of the checkpoint")
            elif kind is not str:
                _bad_path(what, fqn, path, f"has a step of type {kind.__name__}, neither a string nor an int")
            child = node.get(step)
            if child is None:
                if node:
                    first = next(iter(node))
                    if type(first) is not kind:
                        where = f"{'a list' if type(first) is int else 'a dict'} that holds {short_repr(first)}"
                        _bad_path(what, fqn, path, f"steps into {where} with {short_repr(step)}")
                elif node is root and kind is not str:
                    _bad_path(what, fqn, path, "does not start with a string (the top level is a dict)")
                child = node[step] = fqn if i == last else {}
            elif type(child) is str:
                rule = "is the path of key" if i == last else "runs through the value of key"
                _bad_path(what, fqn, path, f"{rule} {child!r:.200} too" if i == last else f"{rule} {child!r:.200}")
            elif i == last:
                _bad_path(what, fqn, path, "is a container of other keys' values")
            node = child


def _bad_path(what: str, fqn: str, path: Any, rule: str) -> None:
    raise CheckpointFormatError(
        f"{what}: planner_data nests key {fqn!r:.200} at {short_repr(path)}, which {rule}: "
        "the metadata is damaged or forged"
    )
