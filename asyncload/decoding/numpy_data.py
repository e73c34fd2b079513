"""numpy data in torch.save records: arrays, dtypes and scalars of plain dtypes, each
checked field by field before numpy sees it (:func:`numpy_globals`; the calls and BUILD
rules are registered with :func:`~asyncload.decoding.tables.allow_call` and
:func:`~asyncload.decoding.tables.allow_build` when this module is imported).

Raised: :class:`UnsafeCheckpointError` for object or structured dtypes;
:class:`CheckpointFormatError` for a shape, dtype state or byte length that does not agree.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from asyncload.common.errors import UnsafeCheckpointError
from asyncload.decoding.tables import _is_int, allow_build, allow_call
from asyncload.decoding.vm import PickleVM, short_repr

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
_NP_TYPECODE = re.compile(
    r"(?:b1|[iu][1248]|f(?:2|4|8|12|16)|c(?:8|16|24|32)|[SUV][1-9][0-9]{0,8}|[Mm]8)\Z"
)
_NP_UNITS = frozenset(
    ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as", "generic")
)
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
        f"holds a numpy {what} of Python objects (dtype 'O'), whose decoding would run code from "
        f"the "
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
        raise vm.bad(
            f"numpy dtype {inst.str!r} with a state numpy does not write: {short_repr(state)}"
        )
    vm.charge(4)
    inst.__setstate__(state)
    vm.seal(inst)


def _args_np_reconstruct(vm: PickleVM, args: tuple[Any, ...], what: str) -> int:
    if (
        len(args) != 3
        or args[0] is not np.ndarray
        or args[1] != (0,)
        or type(args[1]) is not tuple
    ):
        raise vm.bad(f"numpy _reconstruct called with malformed arguments {short_repr(args)}")
    if args[2] not in (b"b", "b"):
        raise vm.bad(f"numpy _reconstruct called with malformed arguments {short_repr(args)}")
    return 2


def _build_np_array(vm: PickleVM, inst: Any, state: Any) -> None:
    if (
        type(inst) is not np.ndarray
        or type(state) is not tuple
        or len(state) != 5
        or state[0] != 1
    ):
        raise vm.bad(f"numpy array with malformed state {short_repr(state)[:120]}")
    _, shape, dtype, fortran, raw = state
    if (
        type(shape) is not tuple
        or len(shape) > _NP_MAX_DIMS
        or not all(_is_int(n) and n >= 0 for n in shape)
        or type(fortran) is not bool
    ):
        raise vm.bad(
            f"numpy array with malformed shape {short_repr(shape)} or order {short_repr(fortran)}"
        )
    if type(raw) is list:
        raise _np_refuse_objects(vm, "array")
    _np_plain_dtype(vm, dtype, "numpy array")
    if type(raw) not in (bytes, bytearray):
        raise vm.bad(f"numpy array data is a {type(raw).__name__}, not bytes")
    need = math.prod(shape) * dtype.itemsize  # Python ints: no overflow, nothing allocated
    if need != len(raw):
        raise vm.bad(
            f"numpy array of shape {list(shape)[:8]} and dtype {dtype.str!r} needs {need} bytes, "
            f"its data holds {len(raw)}"
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
    out: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        out[(module, "_reconstruct")] = multiarray._reconstruct
        out[(module, "scalar")] = multiarray.scalar
    return out


allow_call(np.dtype, _args_np_dtype, fresh_result=True)
allow_call(_np_multiarray()._reconstruct, _args_np_reconstruct, fresh_result=True)
allow_call(_np_multiarray().scalar, _args_np_scalar)
allow_build(np.dtype, _build_np_dtype)
allow_build(np.ndarray, _build_np_array)
