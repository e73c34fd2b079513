"""Allow-list unpickling: nothing from a checkpoint runs code, imports a module, or
makes the process hang, crash or run out of memory.

torch's own DCP reader decodes ``.metadata`` with ``pickle.load`` and non-tensor
objects with ``torch.load(weights_only=False)``: a hostile checkpoint runs code.
Here every pickle is decoded by :class:`_Decoder`, a pickle virtual machine of
asyncload's own (all opcodes of protocols 0-5, over the bytes in memory), in which
every opcode that could reach code, allocate or hash is checked first:

- ``GLOBAL``/``STACK_GLOBAL``/``INST`` resolve names only through an allow-list of data
  types; anything else raises :class:`UnsafeCheckpointError` before it is imported.
- ``REDUCE``/``OBJ``/``INST`` call only allow-listed constructors, each with a check of
  its arguments (types and sizes) before it runs; ``NEWOBJ`` creates only the DCP
  dataclasses, with no arguments; ``BUILD`` fills only objects this pickle just created,
  field by field (``TensorProperties.__setstate__`` gets a checked 5-tuple). Shared
  objects (dtypes, the storage-type markers) can never be modified.
- Persistent ids are accepted only where a caller passes a ``persistent_load`` that knows them.
- Resource guards: memo indices are bounded by the pickle's length (CPython's C
  unpickler allocates and zeroes ``16 x index`` bytes for one 9-byte ``LONG_BINPUT``,
  its pure-Python one ``n`` bytes for one ``BYTEARRAY8``), dict and set keys are checked
  before they are hashed (deeply nested tuple keys crash CPython's hash with a C stack
  overflow; huge keys hashed again and again, or keys crafted to share one hash, make
  decoding quadratic), and the copies allowed constructors make are charged to a work
  budget proportional to the pickle's size. Decoded values nested deeper than
  ``max_depth`` are refused. Memory and time therefore grow linearly with the pickle.

Errors: a name, call or resource use outside the policy is
:class:`UnsafeCheckpointError`; a damaged or truncated pickle is
:class:`CheckpointFormatError`. Nothing else escapes :func:`safe_loads`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import pathlib
import reprlib
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import CheckpointFormatError, UnsafeCheckpointError

__all__ = [
    "MAX_DEPTH",
    "StorageRef",
    "TensorRef",
    "check_metadata",
    "check_relative_path",
    "metadata_globals",
    "record_globals",
    "safe_loads",
    "short_repr",
    "storage_persistent_load",
]

#: Deepest nesting of containers accepted in a decoded object (Python's own pickler
#: cannot write much deeper: it recurses, up to the interpreter's recursion limit).
MAX_DEPTH = 1000
#: Deepest nesting of a dict/set key (tuples in tuples).
_MAX_KEY_DEPTH = 32
#: Distinct keys of one dict or set allowed to share one hash value.
_MAX_SAME_HASH = 8
#: Largest int accepted as a dict/set key (its hash costs time in its digits).
_MAX_INT_KEY = 1 << 64
#: Ints below this hash to themselves (no two collide).
_SMALL_INT = 1 << 60
#: Work budget: units (roughly: Python objects touched) per byte of pickle, plus a floor.
_WORK_PER_BYTE = 8
_WORK_FLOOR = 1 << 20


# --- messages -----------------------------------------------------------------------


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = 80
        self.maxother = 60
        self.maxlong = 40

    def repr_instance(self, x: Any, level: int) -> str:  # never call a hostile object's __repr__
        return f"<{type(x).__name__}>"


_short = _ShortRepr()


def short_repr(obj: Any) -> str:
    """A bounded ``repr`` of a value from a checkpoint, safe on hostile objects
    (deep, huge, self-referencing or sharing-heavy): at most a few hundred characters."""
    try:
        text = _short.repr(obj)
    except Exception:  # noqa: BLE001 - describing a value must never fail
        text = f"<{type(obj).__name__}>"
    return text[:300]


# --- the allow-lists ----------------------------------------------------------------


def _torch_dtypes() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            out[("torch", name)] = value
    return out


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
    return text.encode(encoding)  # type: ignore[no-any-return]


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
    _PLAIN_DATA.update({
        (_mod, "set"): set,
        (_mod, "frozenset"): frozenset,
        (_mod, "complex"): complex,
        (_mod, "slice"): slice,
        (_mod, "bytearray"): bytearray,
        (_mod, "bytes"): bytes,
    })

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
    out: dict[tuple[str, str], Any] = {("torch.storage", "UntypedStorage"): _StorageType(None),
                                       ("torch", "UntypedStorage"): _StorageType(None)}
    with warnings.catch_warnings():  # reading .dtype of the legacy classes warns that TypedStorage is deprecated
        warnings.simplefilter("ignore")
        for name in dir(torch):
            if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                cls = getattr(torch, name, None)
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


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    backward_hooks: Any = None, dtype: Any = None, metadata: Any = None) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CheckpointFormatError(f"tensor record refers to {type(storage).__name__}, not a storage")
    if not _is_int(storage_offset) or storage_offset < 0:
        raise CheckpointFormatError(f"tensor record has a malformed storage offset: {short_repr(storage_offset)}")
    size_t, stride_t = _ints(size, "size"), _ints(stride, "stride")
    if len(size_t) != len(stride_t) or any(s < 0 for s in size_t) or any(s < 0 for s in stride_t):
        raise CheckpointFormatError(f"tensor record has inconsistent size {short_repr(size_t)} "
                                    f"and stride {short_repr(stride_t)}")
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(f"tensor record has a malformed requires_grad: {short_repr(requires_grad)}")
    if backward_hooks is not None and not isinstance(backward_hooks, dict):
        raise CheckpointFormatError("tensor record has malformed backward hooks")
    dt = dtype if isinstance(dtype, torch.dtype) else storage.dtype
    return TensorRef(storage, storage_offset, size_t, stride_t, dt, requires_grad)


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"tensor record has a malformed dtype: {short_repr(dtype)}")
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype)


def _rebuild_parameter(data: Any, requires_grad: Any = True, backward_hooks: Any = None, state: Any = None) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise CheckpointFormatError("parameter record does not wrap a tensor")
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(f"parameter record has a malformed requires_grad: {short_repr(requires_grad)}")
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
        }
    return _record_cache


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
    itemsize = _ITEMSIZE.get(stype.dtype)
    if itemsize is None:
        itemsize = _ITEMSIZE[stype.dtype] = torch.empty((), dtype=stype.dtype).element_size()
    return StorageRef(pid[2], stype.dtype, pid[4] * itemsize, pid[3])


_ITEMSIZE: dict[torch.dtype, int] = {}


# --- argument checks of the constructors a pickle may call -------------------------
# Each takes (unpickler, args) and returns the work units the call costs; it raises
# before the constructor runs when the arguments are not what a real checkpoint holds.


def _bad_args(what: str, args: Any) -> CheckpointFormatError:
    return CheckpointFormatError(f"{what} called with malformed arguments {short_repr(args)}")


def _args_none(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if args:
        raise _bad_args(what, args)
    return 1


def _args_mapping_ctor(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not args:
        return 1
    if len(args) != 1 or type(args[0]) not in (list, tuple):
        raise _bad_args(what, args)
    items = args[0]
    for pair in items:
        if type(pair) is not tuple or len(pair) != 2:
            raise _bad_args(what, args)
    u._check_keys([p[0] for p in items], what)
    return 1 + 2 * len(items)


def _args_set_ctor(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not args:
        return 1
    if len(args) != 1 or type(args[0]) not in (list, tuple, set, frozenset):
        raise _bad_args(what, args)
    u._check_keys(list(args[0]), what)
    return 1 + 4 * len(args[0])


def _num(v: Any) -> bool:
    return type(v) in (int, float) and (type(v) is float or -_I64 <= v < _I64)


def _args_complex(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not (1 <= len(args) <= 2) or not all(_num(a) for a in args):
        raise _bad_args(what, args)
    return 1


def _args_slice(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not (1 <= len(args) <= 3) or not all(a is None or _is_int(a) for a in args):
        raise _bad_args(what, args)
    return 1


def _args_path(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if len(args) > 4096 or not all(type(a) is str for a in args) or sum(len(a) for a in args) > 65536:
        raise _bad_args(what, args)
    return 1 + sum(len(a) for a in args) // 8


def _args_size(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if len(args) > 1 or (args and (type(args[0]) not in (list, tuple) or len(args[0]) > 1024
                                   or not all(_is_int(v) for v in args[0]))):
        raise _bad_args(what, args)
    return 1 + (len(args[0]) if args else 0)


def _args_device(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not (1 <= len(args) <= 2) or type(args[0]) not in (str, int) or \
            (type(args[0]) is str and len(args[0]) > 64) or \
            (len(args) == 2 and not (type(args[1]) is int and -1 <= args[1] < 1 << 16)):
        raise _bad_args(what, args)
    return 1


def _args_layout(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if len(args) != 1 or type(args[0]) is not str or len(args[0]) > 64:
        raise _bad_args(what, args)
    return 1


def _args_encode(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not (1 <= len(args) <= 2) or type(args[0]) is not str or \
            (len(args) == 2 and args[1] not in ("latin1", "latin-1", "utf-8", "utf8", "ascii")):
        raise _bad_args(what, args)
    return 1 + len(args[0]) // 8


def _args_bytes(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if len(args) > 2 or (args and type(args[0]) not in (bytes, str)) or \
            (len(args) == 2 and args[1] not in ("latin1", "latin-1", "utf-8", "utf8", "ascii")) or \
            (len(args) == 1 and type(args[0]) is str):
        raise _bad_args(what, args)
    return 1 + (len(args[0]) // 8 if args else 0)


def _args_enum(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if len(args) != 1 or type(args[0]) not in (int, str) or (type(args[0]) is str and len(args[0]) > 64):
        raise _bad_args(what, args)
    return 1


def _args_rebuild(u: _Decoder, args: tuple[Any, ...], what: str) -> int:
    if not (2 <= len(args) <= 8):
        raise _bad_args(what, args)
    return 1 + sum(len(a) for a in args if type(a) in (tuple, list))


#: Objects a pickle may call (REDUCE, OBJ, INST), by identity, with their argument check.
_CALLABLE_CHECKS: dict[int, tuple[Any, Callable[[_Decoder, tuple[Any, ...], str], int]]] = {}


def _allow_call(obj: Any, check: Callable[[_Decoder, tuple[Any, ...], str], int]) -> None:
    _CALLABLE_CHECKS[id(obj)] = (obj, check)


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
_NO_FIELDS: frozenset[str] = frozenset()
_DATACLASS_FIELDS: dict[type, frozenset[str]] = {
    c: frozenset(f.name for f in dataclasses.fields(c)) for c in _DCP_DATACLASSES
}


# --- the decoder --------------------------------------------------------------------
# A pickle virtual machine of its own (protocols 0-5, the opcodes of pickletools), over
# the bytes in memory: faster than pickle's pure-Python unpickler, and every opcode that
# could allocate, hash or call is checked before it does.

_U2 = struct.Struct("<H").unpack_from
_U4 = struct.Struct("<I").unpack_from
_I4 = struct.Struct("<i").unpack_from
_U8 = struct.Struct("<Q").unpack_from
_F8 = struct.Struct(">d").unpack_from


class _Decoder:
    """Decodes one pickle under the policy; see the module docstring."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], what: str,
                 persistent_load: Callable[[Any], Any] | None) -> None:
        self._data = data
        self._allowed = allowed
        self._what = what
        self._persistent = persistent_load
        self._size = len(data)
        self._work = 0
        self._work_limit = _WORK_FLOOR + _WORK_PER_BYTE * len(data)
        #: ids of objects NEWOBJ created here (only those may be BUILT), kept alive
        self._fresh: dict[int, Any] = {}
        #: ids of container keys already checked -> (key, cost); keeps the keys alive
        self._key_ok: dict[int, tuple[Any, int]] = {}
        #: (id(container), hash) -> number of keys inserted with that hash
        self._hash_counts: dict[tuple[int, int], int] = {}

    # -- policy helpers --

    def _unsafe(self, msg: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(f"{self._what}: {msg}; nothing from it was executed. Only load "
                                     "checkpoints you trust with torch's own reader.")

    def _bad(self, msg: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self._what} is not a valid pickle: {msg}")

    def _charge(self, units: int) -> None:
        self._work += units
        if self._work > self._work_limit:
            raise self._unsafe(f"decoding it needs more than {self._work_limit} units of work for "
                               f"{self._size} bytes of pickle (shared references expanded, or large keys "
                               "hashed again and again)")

    def _key_cost(self, key: Any) -> int:
        """Check that hashing ``key`` is cheap and safe; return its cost (cached per object)."""
        t = type(key)
        if t is str or key is None or t is bool or t is float or t is bytes or t is complex:
            return 1
        if t is int:
            if not -_MAX_INT_KEY < key < _MAX_INT_KEY:
                raise self._bad(f"an int dict/set key of {key.bit_length()} bits")
            return 1
        if isinstance(key, (torch.dtype, torch.layout, torch.memory_format, torch.device, enum.Enum)):
            return 1
        cached = self._key_ok.get(id(key))
        if cached is not None and cached[0] is key:
            return cached[1]
        cost = 1
        if t is frozenset:
            pass  # its items were checked when it was built; Python caches its hash
        elif t is tuple or t is torch.Size:
            stack: list[tuple[Any, int]] = [(key, 1)]
            while stack:  # iterative: nested tuples, bounded depth
                obj, depth = stack.pop()
                if depth > _MAX_KEY_DEPTH:
                    raise self._unsafe(f"a dict/set key is nested more than {_MAX_KEY_DEPTH} levels deep")
                for item in obj:
                    it = type(item)
                    if it is tuple or it is torch.Size:
                        c = self._key_ok.get(id(item))
                        if c is not None and c[0] is item:
                            cost += c[1]
                        else:
                            cost += 1
                            stack.append((item, depth + 1))
                    else:
                        cost += self._key_cost(item)
                if cost > 1 << 16:
                    raise self._bad("a dict/set key of more than 65536 items")
        elif t in _NEWOBJ_CLASSES and t.__hash__ is not None:
            for name in _DATACLASS_FIELDS[t]:
                value = key.__dict__.get(name)
                if value is not None:
                    cost += self._key_cost(value)
        else:
            raise self._bad(f"a dict/set key of type {t.__name__}")
        self._key_ok[id(key)] = (key, cost)
        return cost

    def _check_key(self, container: Any, key: Any) -> None:
        self._charge(self._key_cost(key))
        slot = (id(container), hash(key))
        n = self._hash_counts.get(slot, 0) + 1
        if n > _MAX_SAME_HASH:
            raise self._unsafe(f"more than {_MAX_SAME_HASH} keys of one dict or set share a hash value "
                               "(hash flooding)")
        self._hash_counts[slot] = n

    def _check_keys(self, keys: list[Any], what: str) -> None:
        local: dict[int, int] = {}
        for k in keys:
            self._charge(self._key_cost(k))
            h = hash(k)
            local[h] = local.get(h, 0) + 1
            if local[h] > _MAX_SAME_HASH:
                raise self._unsafe(f"more than {_MAX_SAME_HASH} items given to {what} share a hash value "
                                   "(hash flooding)")

    def _call(self, func: Any, args: Any) -> Any:
        entry = _CALLABLE_CHECKS.get(id(func))
        if entry is None or entry[0] is not func:
            name = func.__qualname__ if isinstance(func, type) else type(func).__name__
            raise self._unsafe(f"asks to call {short_repr(name)}, which may not be called while decoding")
        if type(args) is not tuple:
            raise self._bad(f"call arguments are a {type(args).__name__}, not a tuple")
        what = getattr(func, "__qualname__", None) or type(func).__name__
        self._charge(entry[1](self, args, what))
        try:
            out = func(*args)
            if func is collections.OrderedDict:
                self._fresh[id(out)] = out  # a module's state_dict() carries a _metadata attribute (BUILD)
            return out
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            raise type(exc)(f"{self._what}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the arguments were checked; a value error is a damaged file
            raise CheckpointFormatError(f"{self._what}: {what} rejected its arguments "
                                        f"({type(exc).__name__})") from None

    def find_class(self, module: Any, name: Any) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            mod = module[:100] if type(module) is str else short_repr(module)
            nm = name[:100] if type(name) is str else short_repr(name)
            raise self._unsafe(f"asks to import {mod}.{nm}, which is not on asyncload's allow-list of "
                               "checkpoint data types") from None

    def _persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self._unsafe(f"holds a persistent reference {short_repr(pid)}, which is not allowed here")
        try:
            return self._persistent(pid)
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            raise type(exc)(f"{self._what}: {exc}") from None

    def _newobj(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if not isinstance(cls, type) or cls not in _NEWOBJ_CLASSES:
            name = cls.__qualname__ if isinstance(cls, type) else type(cls).__name__
            raise self._unsafe(f"asks to create a {short_repr(name)} object, which is not a checkpoint data class")
        if args or kwargs:
            raise self._bad(f"{cls.__name__} created with arguments")
        obj: Any = object.__new__(cls)  # the DCP dataclasses define no __new__ of their own
        self._fresh[id(obj)] = obj
        self._charge(4)
        return obj

    def _build(self, inst: Any, state: Any) -> None:
        if type(inst) is collections.OrderedDict and type(state) is dict and set(state) == {"_metadata"} and \
                type(state["_metadata"]) in (dict, collections.OrderedDict):
            # nn.Module.state_dict() carries its per-module versions as ``_metadata`` (every
            # torch.save(model.state_dict()) file has one; torch's weights_only unpickler allows it)
            self._charge(1)
            inst.__dict__.update(state)
            return
        if self._fresh.get(id(inst)) is not inst:
            raise self._unsafe(f"asks to modify a {type(inst).__name__} object it did not create")
        cls = type(inst)
        if cls is _TENSOR_PROPS:
            ok = (type(state) is tuple and len(state) == 5 and isinstance(state[0], torch.dtype)
                  and isinstance(state[1], torch.layout) and type(state[2]) is bool
                  and _MEM_ENUM is not None and isinstance(state[3], _MEM_ENUM) and type(state[4]) is bool)
            if not ok:
                raise self._bad(f"TensorProperties with malformed state {short_repr(state)}")
            inst.__setstate__(state)  # type: ignore[union-attr]
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if state is None:
            return
        if type(state) is not dict:
            raise self._bad(f"{cls.__name__} state is a {type(state).__name__}, not a dict")
        if cls is collections.OrderedDict:  # attributes of the dict, e.g. nn.Module.state_dict()._metadata
            if len(state) > 64 or not all(type(k) is str and not k.startswith("__") for k in state):
                raise self._bad(f"OrderedDict with malformed attributes {short_repr(list(state))}")
            inst.__dict__.update(state)
            return
        fields = _DATACLASS_FIELDS[cls]
        for k in state:
            if type(k) is not str or k not in fields:
                raise self._bad(f"{cls.__name__} has no field {short_repr(k)}")
        self._charge(len(state))
        inst.__dict__.update(state)

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if not isinstance(target, dict) or len(items) % 2:
            raise self._bad(f"SETITEMS on a {type(target).__name__}")
        check = self._check_key
        for i in range(0, len(items), 2):
            k = items[i]
            t = type(k)
            # str hashes are salted per process and small ints hash to themselves: neither
            # can be made to collide, so they only cost one unit
            if t is str or (t is int and -_SMALL_INT < k < _SMALL_INT):
                self._work += 1
            else:
                check(target, k)
            target[k] = items[i + 1]
        if self._work > self._work_limit:
            self._charge(0)

    def _truncated(self, pos: int, n: int) -> CheckpointFormatError:
        return self._bad(f"truncated: {n} bytes at offset {pos} run past the end ({self._size})")

    def _line(self, pos: int) -> tuple[bytes, int]:
        e = self._data.find(b"\n", pos, pos + 65536)
        if e < 0:
            raise self._bad(f"no end of line within 64 KiB after offset {pos}")
        return self._data[pos:e], e + 1

    def _memo_index(self, i: int) -> int:
        if i < 0 or i > self._size:
            raise self._bad(f"memo index {i} is out of range for a pickle of {self._size} bytes")
        return i

    # -- the machine --

    def load(self) -> Any:
        data = self._data
        end = len(data)
        pos = 0
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        append = stack.append
        fresh = self._fresh
        newobj_classes = _NEWOBJ_CLASSES
        fields_of = _DATACLASS_FIELDS
        torch_size = torch.Size

        while True:
            if pos >= end:
                raise self._bad("truncated: no STOP opcode")
            op = data[pos]
            pos += 1
            # opcodes ordered by how often DCP metadata and torch.save records use them
            if op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x68:  # BINGET
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                append(memo[data[pos]])
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                append(memo[_U4(data, pos)[0]])
                pos += 4
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
                append = stack.append
            elif op == 0x4B:  # BININT1
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                append(data[pos])
                pos += 1
            elif op == 0x29:  # EMPTY_TUPLE
                append(())
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack.pop()
                if cls in newobj_classes and args == () and type(args) is tuple:
                    obj = cls.__new__(cls)
                    fresh[id(obj)] = obj
                    append(obj)
                else:
                    append(self._newobj(cls, args, None))
            elif op == 0x62:  # BUILD
                state = stack.pop()
                inst = stack[-1]
                if type(state) is dict and fresh.get(id(inst)) is inst and \
                        state.keys() <= fields_of.get(type(inst), _NO_FIELDS):
                    inst.__dict__.update(state)
                else:
                    self._build(inst, state)
            elif op == 0x7D:  # EMPTY_DICT
                append({})
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = metastack.pop()
                append = stack.append
                self._set_items(stack[-1], items)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                func = stack[-1]
                if func is torch_size and type(args) is tuple and len(args) == 1 and \
                        type(args[0]) in (tuple, list) and len(args[0]) <= 1024 and all(type(v) is int for v in args[0]):
                    stack[-1] = torch_size(args[0])  # the one frequent call: shapes in .metadata
                else:
                    stack[-1] = self._call(func, args)
            elif op == 0x4D:  # BININT2
                if pos + 2 > end:
                    raise self._truncated(pos, 2)
                append(_U2(data, pos)[0])
                pos += 2
            elif op == 0x86:  # TUPLE2
                b = stack.pop()
                stack[-1] = (stack[-1], b)
            elif op == 0x89:  # NEWFALSE
                append(False)
            elif op == 0x4A:  # BININT
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                append(_I4(data, pos)[0])
                pos += 4
            elif op == 0x8C:  # SHORT_BINUNICODE
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                n = data[pos]
                if pos + 1 + n > end:
                    raise self._truncated(pos, 1 + n)
                append(str(data[pos + 1 : pos + 1 + n], "utf-8", "surrogatepass"))
                pos += 1 + n
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                if type(name) is not str or type(module) is not str:
                    raise self._bad("STACK_GLOBAL requires str")
                append(self.find_class(module, name))
            elif op == 0x74:  # TUPLE
                items = stack
                stack = metastack.pop()
                append = stack.append
                append(tuple(items))
            elif op == 0x5D:  # EMPTY_LIST
                append([])
            elif op == 0x61:  # APPEND
                value = stack.pop()
                target = stack[-1]
                if type(target) is list or type(target) is bytearray:
                    target.append(value)
                else:
                    raise self._bad(f"APPEND on a {type(target).__name__}")
            elif op == 0x71:  # BINPUT
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                memo[data[pos]] = stack[-1]
                pos += 1
            elif op == 0x72:  # LONG_BINPUT
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                memo[self._memo_index(_U4(data, pos)[0])] = stack[-1]
                pos += 4
            elif op == 0x4E:  # NONE
                append(None)
            elif op == 0x88:  # NEWTRUE
                append(True)
            elif op == 0x87:  # TUPLE3
                c = stack.pop()
                b = stack.pop()
                stack[-1] = (stack[-1], b, c)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = metastack.pop()
                append = stack.append
                target = stack[-1]
                if type(target) is list or type(target) is bytearray:
                    target.extend(items)
                else:
                    raise self._bad(f"APPENDS on a {type(target).__name__}")
                self._charge(len(items) // 8)
            elif op == 0x2E:  # STOP
                if not stack:
                    raise self._bad("STOP with an empty stack")
                return stack.pop()
            elif op == 0x95:  # FRAME: informational only
                if pos + 8 > end:
                    raise self._truncated(pos, 8)
                pos += 8
            elif op == 0x80:  # PROTO
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                if data[pos] > 5:
                    raise self._bad(f"unsupported pickle protocol {data[pos]}")
                pos += 1
            elif op == 0x51:  # BINPERSID
                stack[-1] = self._persistent_load(stack[-1])
            elif op == 0x58:  # BINUNICODE
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                n = _U4(data, pos)[0]
                if pos + 4 + n > end:
                    raise self._truncated(pos, 4 + n)
                append(str(data[pos + 4 : pos + 4 + n], "utf-8", "surrogatepass"))
                pos += 4 + n
            elif op == 0x6C:  # LIST
                items = stack
                stack = metastack.pop()
                append = stack.append
                append(items)
            elif op == 0x64:  # DICT
                items = stack
                stack = metastack.pop()
                append = stack.append
                d: dict[Any, Any] = {}
                self._set_items(d, items)
                append(d)
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                self._set_items(stack[-1], [key, value])
            elif op == 0x8D:  # BINUNICODE8
                if pos + 8 > end:
                    raise self._truncated(pos, 8)
                n = _U8(data, pos)[0]
                if pos + 8 + n > end:
                    raise self._truncated(pos, 8 + n)
                append(str(data[pos + 8 : pos + 8 + n], "utf-8", "surrogatepass"))
                pos += 8 + n
            elif op == 0x43:  # SHORT_BINBYTES
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                n = data[pos]
                if pos + 1 + n > end:
                    raise self._truncated(pos, 1 + n)
                append(data[pos + 1 : pos + 1 + n])
                pos += 1 + n
            elif op == 0x42:  # BINBYTES
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                n = _U4(data, pos)[0]
                if pos + 4 + n > end:
                    raise self._truncated(pos, 4 + n)
                append(data[pos + 4 : pos + 4 + n])
                pos += 4 + n
            elif op == 0x8E:  # BINBYTES8
                if pos + 8 > end:
                    raise self._truncated(pos, 8)
                n = _U8(data, pos)[0]
                if pos + 8 + n > end:
                    raise self._truncated(pos, 8 + n)
                append(data[pos + 8 : pos + 8 + n])
                pos += 8 + n
            elif op == 0x96:  # BYTEARRAY8
                if pos + 8 > end:
                    raise self._truncated(pos, 8)
                n = _U8(data, pos)[0]
                if pos + 8 + n > end:
                    raise self._truncated(pos, 8 + n)
                append(bytearray(data[pos + 8 : pos + 8 + n]))
                pos += 8 + n
            elif op == 0x55:  # SHORT_BINSTRING (Python 2 str)
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                n = data[pos]
                if pos + 1 + n > end:
                    raise self._truncated(pos, 1 + n)
                append(str(data[pos + 1 : pos + 1 + n], "ascii"))
                pos += 1 + n
            elif op == 0x54:  # BINSTRING (Python 2 str)
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                n = _I4(data, pos)[0]
                if pos + 4 + n > end:
                    raise self._truncated(pos, 4 + n)
                append(str(data[pos + 4 : pos + 4 + n], "ascii"))
                pos += 4 + n
            elif op == 0x8A:  # LONG1
                if pos + 1 > end:
                    raise self._truncated(pos, 1)
                n = data[pos]
                if pos + 1 + n > end:
                    raise self._truncated(pos, 1 + n)
                append(int.from_bytes(data[pos + 1 : pos + 1 + n], "little", signed=True))
                pos += 1 + n
            elif op == 0x8B:  # LONG4
                if pos + 4 > end:
                    raise self._truncated(pos, 4)
                n = _I4(data, pos)[0]
                if pos + 4 + n > end:
                    raise self._truncated(pos, 4 + n)
                if n > 4096:
                    raise self._bad(f"an integer of {n} bytes")
                append(int.from_bytes(data[pos + 4 : pos + 4 + n], "little", signed=True))
                pos += 4 + n
            elif op == 0x47:  # BINFLOAT
                if pos + 8 > end:
                    raise self._truncated(pos, 8)
                append(_F8(data, pos)[0])
                pos += 8
            elif op == 0x46:  # FLOAT
                s, pos = self._line(pos)
                append(float(s))
            elif op == 0x49:  # INT
                s, pos = self._line(pos)
                if len(s) > 64:
                    raise self._bad("an INT of more than 64 digits")
                append(False if s == b"00" else True if s == b"01" else int(s))
            elif op == 0x4C:  # LONG
                s, pos = self._line(pos)
                if len(s) > 4096:
                    raise self._bad("a LONG of more than 4096 digits")
                append(int(s[:-1] if s.endswith(b"L") else s))
            elif op == 0x56:  # UNICODE
                s, pos = self._line(pos)
                append(str(s, "raw-unicode-escape"))
            elif op == 0x53:  # STRING
                raise self._bad("the Python 2 STRING opcode, which no checkpoint writer emits")
            elif op == 0x67:  # GET
                s, pos = self._line(pos)
                if len(s) > 20:
                    raise self._bad("malformed GET")
                append(memo[int(s)])
            elif op == 0x70:  # PUT
                s, pos = self._line(pos)
                if len(s) > 20:
                    raise self._bad("malformed PUT")
                memo[self._memo_index(int(s))] = stack[-1]
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = metastack.pop()
                    append = stack.append
            elif op == 0x31:  # POP_MARK
                stack = metastack.pop()
                append = stack.append
            elif op == 0x32:  # DUP
                append(stack[-1])
            elif op == 0x63:  # GLOBAL
                s, pos = self._line(pos)
                module = str(s, "utf-8")
                s, pos = self._line(pos)
                name = str(s, "utf-8")
                append(self.find_class(module, name))
            elif op == 0x69:  # INST
                s, pos = self._line(pos)
                module = str(s, "ascii")
                s, pos = self._line(pos)
                name = str(s, "ascii")
                func = self.find_class(module, name)
                args = tuple(stack)
                stack = metastack.pop()
                append = stack.append
                append(self._call(func, args))
            elif op == 0x6F:  # OBJ
                items = stack
                stack = metastack.pop()
                append = stack.append
                if not items:
                    raise self._bad("OBJ without a class")
                append(self._call(items[0], tuple(items[1:])))
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = stack.pop()
                args = stack.pop()
                cls = stack.pop()
                append(self._newobj(cls, args, kwargs))
            elif op == 0x8F:  # EMPTY_SET: 216 bytes of memory for one byte of pickle
                self._work += 28
                if self._work > self._work_limit:
                    self._charge(0)
                append(set())
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = metastack.pop()
                append = stack.append
                target = stack[-1]
                if type(target) is not set:
                    raise self._bad(f"ADDITEMS on a {type(target).__name__}")
                for item in items:
                    self._check_key(target, item)
                    target.add(item)
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = metastack.pop()
                append = stack.append
                self._check_keys(items, "frozenset")
                append(frozenset(items))
            elif op == 0x50:  # PERSID
                s, pos = self._line(pos)
                append(self._persistent_load(str(s, "ascii")))
            elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4
                raise self._unsafe("uses the copyreg extension registry")
            elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                raise self._bad("refers to out-of-band buffers")
            else:
                raise self._bad(f"unknown opcode {op:#04x} at offset {pos - 1}")


# --- decoding -----------------------------------------------------------------------


_LEAF_TYPES = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.dtype, torch.layout,
               torch.memory_format, torch.device, enum.Enum, pathlib.PurePath, TensorRef, StorageRef)


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
    return None


def _check_structure(obj: Any, what: str, max_depth: int, budget: int) -> None:
    """Raise UnsafeCheckpointError if ``obj`` is nested deeper than ``max_depth``, holds
    more than ``budget`` containers, or expands to more than ``budget`` nodes when shared
    references are followed (a "billion laughs" DAG: tiny in memory, but any recursive
    walk of it, ``repr`` or ``copy.deepcopy`` included, would run forever).

    Iterative post-order walk; shared objects are visited once; a reference back to an
    object still being walked (a cycle) counts as a leaf.
    """
    height: dict[int, int] = {}
    size: dict[int, int] = {}
    keep: list[Any] = []  # keeps walked objects alive while their ids are keys
    deep = UnsafeCheckpointError(f"{what} is nested more than {max_depth} levels deep; nothing from it was executed")
    stack: list[tuple[Any, int]] = [(obj, 1)]  # (object, depth on the way down; 0: on the way up)
    while stack:
        o, depth = stack.pop()
        oid = id(o)
        if depth:
            if oid in height:
                continue
            kids = _children(o)
            if kids is None:
                continue
            if depth > max_depth:  # fails fast on a plain chain; heights below catch shared paths
                raise deep
            height[oid], size[oid] = 0, 1  # in progress
            keep.append(o)
            if len(keep) > budget:
                raise UnsafeCheckpointError(f"{what} holds more than {budget} containers; nothing from it was executed")
            stack.append((o, 0))
            stack.extend((k, depth + 1) for k in kids)
            continue
        h, n = 1, 1
        for k in _children(o) or ():
            kid = id(k)
            if kid in height:
                h = max(h, height[kid] + 1)
                n += size[kid]
            else:
                n += 1
        if h > max_depth:
            raise deep
        if n > budget:
            raise UnsafeCheckpointError(f"{what} expands to more than {budget} objects through shared "
                                        "references; nothing from it was executed")
        height[oid], size[oid] = h, n


def safe_loads(data: bytes | bytearray | memoryview, *, what: str,
               allowed: Mapping[tuple[str, str], Any] | None = None,
               persistent_load: Callable[[Any], Any] | None = None,
               max_size: int | None = None, max_depth: int = MAX_DEPTH,
               check_structure: bool = True, expect: type | None = None) -> Any:
    """Unpickle ``data`` allowing only the globals in ``allowed`` (default: DCP metadata types).

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
        raise CheckpointFormatError(f"{what} is {len(data)} bytes, more than the {max_size} allowed "
                                    "(LoadOptions.max_metadata_size)")
    raw = bytes(data)
    unpickler = _Decoder(raw, metadata_globals() if allowed is None else allowed, what, persistent_load)
    try:
        obj = unpickler.load()
    except (UnsafeCheckpointError, CheckpointFormatError):
        raise
    except RecursionError as exc:  # pragma: no cover - the decoder is iterative
        raise CheckpointFormatError(f"{what} is nested too deeply to decode") from exc
    except MemoryError:
        raise CheckpointFormatError(f"{what} asks for more memory than it can hold") from None
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, ValueError, struct.error... of a damaged stream
        raise CheckpointFormatError(f"{what} is not a valid pickle ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})") from None
    finally:
        unpickler._fresh.clear()
        unpickler._key_ok.clear()
    if check_structure or (expect is not None and not isinstance(obj, expect)):
        _check_structure(obj, what, max_depth, unpickler._work_limit)
    if expect is not None and not isinstance(obj, expect):
        raise CheckpointFormatError(f"{what} does not hold {expect.__name__} (found {type(obj).__name__})")
    return obj


# --- the shape of a DCP .metadata ---------------------------------------------------


def check_relative_path(name: Any, what: str) -> str:
    """``name`` as a file of the checkpoint: relative, inside the checkpoint, no tricks.

    Raises CheckpointFormatError for an absolute path, a ``..`` component, a backslash,
    a NUL or control character, or an empty name (a hostile ``.metadata`` could
    otherwise point a load at any file the process can read)."""
    if type(name) is not str or not name or len(name) > 4096:
        raise CheckpointFormatError(f"{what}: file name {short_repr(name)} is not a relative path")
    bad = (name.startswith(("/", "~")) or "\\" in name or ":" in name.split("/", 1)[0]
           or any(ord(c) < 32 for c in name)
           or any(part in ("", ".", "..") for part in name.split("/")))
    if bad:
        raise CheckpointFormatError(f"{what}: file name {short_repr(name)} is not a plain path inside the "
                                    "checkpoint")
    return name


def _check_size(v: Any, where: str, ndim: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, tuple) or len(v) > 1024 or not all(_is_int(x) and x >= 0 for x in v):
        raise CheckpointFormatError(f"{where} is not a shape: {short_repr(v)}")
    if ndim is not None and len(v) != ndim:
        raise CheckpointFormatError(f"{where} has {len(v)} dimensions, the tensor has {ndim}")
    return v


def check_metadata(md: Any, what: str) -> None:
    """Check that a decoded ``.metadata`` has the shape DCP writes, field by field.

    Raises CheckpointFormatError naming the first field that does not: keys that are
    not strings, chunks that do not fit their tensor, storage entries with a negative
    offset or a path outside the checkpoint, and so on. After this, every value the
    planner and reader use has the type they expect.
    """
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
            for i, ch in enumerate(chunks):
                if not isinstance(ch, ChunkStorageMetadata):
                    raise CheckpointFormatError(f"{where}: chunk {i} is a {type(ch).__name__}")
                offs = _check_size(getattr(ch, "offsets", None), f"{where} chunk {i} offsets", len(size))
                lens = _check_size(getattr(ch, "sizes", None), f"{where} chunk {i} sizes", len(size))
                if any(o + n > s for o, n, s in zip(offs, lens, size)):
                    raise CheckpointFormatError(f"{where}: chunk {i} at {list(offs)} of size {list(lens)} "
                                                f"lies outside the tensor of size {list(size)}")
        elif not isinstance(smd, BytesStorageMetadata):
            raise CheckpointFormatError(f"{where} is described by a {type(smd).__name__}")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        raise CheckpointFormatError(f"{what}: storage_data is a {type(sd).__name__}, not a dict")
    for idx, info in sd.items():
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

