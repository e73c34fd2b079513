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

The folder, by job (every name is also importable from here): the allow-lists and the
checked constructors (:mod:`~asyncload.decoding.tables`: :func:`metadata_globals`,
:class:`TensorRef`/:class:`StorageRef`, :func:`allow_call`, :func:`allow_build`), numpy
data (:mod:`~asyncload.decoding.numpy_data`), the walk of a decoded value
(:mod:`~asyncload.decoding.structure`), the shape of a ``.metadata``
(:mod:`~asyncload.decoding.dcp_checks`: :func:`check_metadata`), the work budget
(:mod:`~asyncload.decoding.work`); here :func:`record_globals` (extended through
:func:`record_extensions`), the user's globals and :func:`safe_loads`.

Errors: a name, call or resource use outside the policy is
:class:`UnsafeCheckpointError`; a damaged or truncated pickle is
:class:`CheckpointFormatError`, and so is a decode past the caller's work budget
(``safe_loads(work=WorkBudget(limit=...))``). Nothing else escapes :func:`safe_loads`.
"""

from __future__ import annotations

import collections
import enum
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncload.common.errors import CheckpointFormatError, UnsafeCheckpointError
from asyncload.common.paths import check_relative_path
from asyncload.decoding.dcp_checks import check_metadata, check_planner_paths
from asyncload.decoding.numpy_data import numpy_globals
from asyncload.decoding.scan import (
    _SCANNED,
    UNREADABLE,
    Scan,
    failing_key_path,
    refusal,
    scan_pickle,
)
from asyncload.decoding.structure import _check_structure
from asyncload.decoding.structure import _children as _children  # tests walk values with it
from asyncload.decoding.structure import _flat_within as _flat_within  # and check this one
from asyncload.decoding.tables import (
    _BUILD_RULES,
    _CALLABLE_CHECKS,
    DcpTypes,
    StorageRef,
    TensorRef,
    _rebuild_parameter,
    _rebuild_tensor,
    _rebuild_tensor_v3,
    _storage_types,
    allow_build,
    allow_call,
    dcp_classes,
    dcp_types,
    metadata_globals,
    plain_globals,
    storage_persistent_load,
)
from asyncload.decoding.vm import PickleVM, short_repr
from asyncload.decoding.work import WorkBudget

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

_record_cache: _RecordNames | None = None


_DCP_PACKAGE = "torch.distributed.checkpoint."
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


class _RecordNames(dict[tuple[str, str], Any]):
    """The record allow-list. DCP's dataclasses (:func:`dcp_classes`) are looked up when a
    pickle first names one: decoding a torch.save file imports no
    ``torch.distributed.checkpoint`` (half a second of a fresh process) for names it never
    uses."""

    def __missing__(self, key: tuple[str, str]) -> Any:
        if (
            type(key) is tuple
            and len(key) == 2
            and type(key[0]) is str
            and key[0].startswith(_DCP_PACKAGE)
        ):
            found = dcp_classes()
            self.update(found)
            if key in found:
                return found[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True


def record_globals() -> Mapping[tuple[str, str], Any]:
    """The names a torch.save ``data.pkl`` may use (tensors become :class:`TensorRef`)."""
    global _record_cache
    if _record_cache is None:
        _record_cache = _RecordNames(
            {
                **plain_globals(),
                **_storage_types(),
                ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
                ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
                ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
                **record_extensions(),
            }
        )
    return _record_cache


def record_extensions() -> dict[tuple[str, str], Any]:
    """Names torch.save records may use beyond torch's tensors and DCP's types: the data that
    training loops save next to their tensors. Each source registers the calls and BUILD
    rules of its names (:func:`allow_call`, :func:`allow_build`); a new kind of data is one
    more source here."""
    return {**numpy_globals()}


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

    def names(self) -> frozenset[str]:
        """The ``"module.qualname"`` of every entry."""
        return frozenset(self._by_name)

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


class _NotAllowed(Exception):
    """A name the policy does not resolve, while :class:`_Resolves` asks."""


class _Resolves:
    """``(module, name) in`` it: whether ``policy.find_class`` resolves the name without the
    user's globals (which the scan leaves out by name) and without a refusal."""

    def __init__(self, policy: _CheckpointPolicy, vm: PickleVM) -> None:
        self._policy = policy
        self._vm = vm

    def __contains__(self, key: object) -> bool:
        if type(key) is not tuple or len(key) != 2:
            return False
        policy = self._policy
        policy._probing = True
        try:
            policy.find_class(self._vm, key[0], key[1])
        except (_NotAllowed, UnsafeCheckpointError, CheckpointFormatError):
            return False
        finally:
            policy._probing = False
        return True


def _one_value(vm: PickleVM) -> bool:
    """Whether the pickle is one value of a state dict (a DCP object record, named
    ``"object 'key' ..."`` by its reader), not a whole torch.save file."""
    return vm.what.startswith("object ")


class _CheckpointPolicy:
    """What a checkpoint's pickle may build (a :class:`~asyncload.decoding.vm.PicklePolicy`):
    the names in ``allowed``, the calls of :data:`_CALLABLE_CHECKS`, the DCP dataclasses,
    the BUILD rules of :data:`_BUILD_RULES`, the persistent ids ``persistent_load`` knows,
    and the globals the user trusts (``user``: ``LoadOptions.safe_globals``, where given)."""

    shape_type: type | None = torch.Size
    atomic_key_types: tuple[type, ...] = (
        torch.dtype,
        torch.layout,
        torch.memory_format,
        torch.device,
        enum.Enum,
    )

    def __init__(
        self,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None,
        user: UserGlobals | None = None,
    ) -> None:
        # DCP's dataclasses only once DCP is imported, or a pickle names one (find_class): a
        # torch.save file's decode does not import torch.distributed.checkpoint for them
        self._dcp: DcpTypes | None = None
        self.record_fields: Mapping[type, frozenset[str]] = {}
        self.record_classes: frozenset[type] = frozenset()
        if _DCP_METADATA in sys.modules:
            self._use_dcp()
        self._allowed = allowed
        #: True while a refusal's scan asks which names this policy resolves (:meth:`_scan`).
        self._probing = False
        self._persistent = persistent_load
        #: None: a strict decode (``.metadata``), where safe_globals do not apply.
        self._user = user
        #: The user's globals this pickle named, by id (kept alive): they may be called,
        #: created and built as torch's weights_only unpickler allows them.
        self._user_objs: dict[int, Any] = {}
        self._missing: str | None = None
        self.unsafe_advice = "Only load checkpoints you trust with torch's own reader."

    def _use_dcp(self) -> None:
        self._dcp = dcp = dcp_types()
        #: See :class:`~asyncload.decoding.vm.PicklePolicy`: the DCP dataclasses and their fields.
        self.record_fields = dcp.fields
        self.record_classes = dcp.classes

    def find_class(self, vm: PickleVM, module: Any, name: Any) -> Any:
        try:
            found = self._allowed[(module, name)]
        except (KeyError, TypeError):
            pass
        else:
            if self._dcp is None and type(module) is str and module.startswith(_DCP_PACKAGE):
                self._use_dcp()
            return found
        if self._probing:
            raise _NotAllowed
        mod = module[:100] if type(module) is str else short_repr(module)
        nm = name[:100] if type(name) is str else short_repr(name)
        if self._user is not None and type(module) is str and type(name) is str:
            if (module, name) in UNREADABLE:  # whatever the user trusts: never a stand-in
                scan = self._scan(vm)
                raise UnsafeCheckpointError(
                    f"{vm.what}: asks to import {mod}.{nm}, which rebuilds a tensor asyncload "
                    f"does not read; nothing from it was executed. {refusal(scan, value=_one_value(vm))}"
                )
            try:
                obj = self._user.find(module, name)
            except KeyError:
                pass
            except Exception as exc:  # a string the user gave that does not import
                raise vm.unsafe(
                    f"asks for {mod}.{nm}, which LoadOptions.safe_globals names but which cannot "
                    f"be "
                    f"imported here ({type(exc).__name__}: {str(exc)[:200]})"
                ) from None
            else:
                self._user_objs[id(obj)] = obj
                return obj
            scan = self._scan(vm)
            if scan.unreadable:
                raise UnsafeCheckpointError(
                    f"{vm.what}: holds tensors asyncload does not read; nothing from it was "
                    f"executed. {refusal(scan, value=_one_value(vm))}"
                )
            value = _one_value(vm)
            self.unsafe_advice = refusal(scan, value=value) + (
                " (A safe_globals entry is the class or function itself, or its "
                '"module.qualname" string.)'
                if scan.needed and (value or scan.top == "dict")
                else ""
            )
        raise vm.unsafe(
            f"asks to import {mod}.{nm}, which is not on asyncload's allow-list of checkpoint data "
            f"types"
        ) from None

    def _scan(self, vm: PickleVM) -> Scan:
        """The whole pickle, scanned with stand-ins (:func:`scan_pickle`) for the refusal; a
        name counts as allowed where this policy (a subclass's too) resolves it."""
        trusted = self._user.names() if self._user is not None else frozenset()
        return scan_pickle(vm.data, vm.what, allowed=_Resolves(self, vm), trusted=trusted)

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
            raise vm.unsafe(
                f"asks to call {short_repr(name)}, which may not be called while decoding"
            )
        if type(args) is not tuple:
            raise vm.bad(f"call arguments are a {type(args).__name__}, not a tuple")
        what = getattr(func, "__qualname__", None) or type(func).__name__
        vm.charge(entry[1](vm, args, what))
        try:
            out = func(*args)
            if entry[2]:
                vm.mark_fresh(
                    out
                )  # a new object BUILD may fill (OrderedDict._metadata, numpy data)
            return out
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            raise type(exc)(f"{vm.what}: {exc}") from None
        except Exception as exc:
            raise CheckpointFormatError(
                f"{vm.what}: {what} rejected its arguments ({type(exc).__name__})"
            ) from None

    def persistent_load(self, vm: PickleVM, pid: Any) -> Any:
        if self._persistent is None:
            raise vm.unsafe(
                f"holds a persistent reference {short_repr(pid)}, which is not allowed here"
            )
        try:
            return self._persistent(pid)
        except (CheckpointFormatError, UnsafeCheckpointError) as exc:
            raise type(exc)(f"{vm.what}: {exc}") from None

    def newobj(self, vm: PickleVM, cls: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(cls, type) and self._user_obj(cls):
            if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
                raise vm.bad(f"{cls.__name__} created with malformed arguments")
            vm.charge(4 + len(args))
            made: Any = cls.__new__(
                cls, *args, **(kwargs or {})
            )  # the user trusts it (safe_globals)
            vm.mark_fresh(made)
            return made
        if not isinstance(cls, type) or cls not in self.record_classes:
            name = cls.__qualname__ if isinstance(cls, type) else type(cls).__name__
            raise vm.unsafe(
                f"asks to create a {short_repr(name)} object, which is not a checkpoint data class"
            )
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
        dcp = self._dcp
        if dcp is None:  # only DCP's dataclasses are left, and this pickle named none
            raise vm.unsafe(f"asks to modify a {type(inst).__name__} object")
        if cls is dcp.tensor_props:
            ok = (
                type(state) is tuple
                and len(state) == 5
                and isinstance(state[0], torch.dtype)
                and isinstance(state[1], torch.layout)
                and type(state[2]) is bool
                and dcp.mem_enum is not None
                and isinstance(state[3], dcp.mem_enum)
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
        if (
            cls is collections.OrderedDict
        ):  # attributes of the dict, e.g. nn.Module.state_dict()._metadata
            if len(state) > 64 or not all(
                type(k) is str and not k.startswith("__") for k in state
            ):
                raise vm.bad(f"OrderedDict with malformed attributes {short_repr(list(state))}")
            inst.__dict__.update(state)
            return
        fields = dcp.fields[cls]
        for k in state:
            if type(k) is not str or k not in fields:
                raise vm.bad(f"{cls.__name__} has no field {short_repr(k)}")
        vm.charge(len(state))
        inst.__dict__.update(state)


# --- decoding -----------------------------------------------------------------------


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
    work: WorkBudget | None = None,
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
    ``work``: charged with the decode's units (:class:`~asyncload.decoding.work.WorkBudget`);
    its limit, when it has one, ends the decode with a CheckpointFormatError.
    """
    if max_size is not None and len(data) > max_size:
        raise CheckpointFormatError(
            f"{what} is {len(data)} bytes, more than the {max_size} allowed "
            f"(LoadOptions.max_metadata_size)"
        )
    policy = _CheckpointPolicy(
        metadata_globals() if allowed is None else allowed,
        persistent_load,
        None if safe_globals is None else user_globals(safe_globals),
    )
    vm = PickleVM(bytes(data), policy, what, work)
    try:
        obj = vm.run()
    except (UnsafeCheckpointError, CheckpointFormatError) as exc:
        # a record's refusal names the key it was building (the scan's own refusals name theirs)
        msg = str(exc)
        if safe_globals is None or vm.failed_at is None or _SCANNED in msg:
            raise
        path = failing_key_path(vm.data, vm.failed_at)
        if not path or not msg.startswith(what):
            raise
        raise type(exc)(f"{what} (key {path!r}){msg[len(what) :]}") from None
    if check_structure or (expect is not None and not isinstance(obj, expect)):
        _check_structure(obj, what, max_depth, vm.work_limit, work)
    if expect is not None and not isinstance(obj, expect):
        raise CheckpointFormatError(
            f"{what} does not hold {expect.__name__} (found {type(obj).__name__})"
        )
    return obj
