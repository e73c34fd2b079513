"""What a refused pickle would need, found in one pass and without running anything.

When a checkpoint's pickle names something outside the allow-list, the refusal tells
everything at once (:func:`scan_pickle`, :func:`refusal`): every global the pickle names
that the allow-list lacks (and the user does not already trust), which of them are
data-only, where each is used (key paths), whether the file would be a state dict at all,
and the one fix that works for what it holds:

- a pickled ``nn.Module`` (``torch.save(model)``): save ``model.state_dict()``;
- an object that holds no tensors (transformers' ``training_args.bin``): nothing to load
  into a model;
- tensors that ``torch.load(weights_only=True)`` reads and asyncload does not (sparse,
  quantized, nested, tensor subclasses, ``quantize_dynamic``'s packed weights): refused
  as such, whatever ``LoadOptions.safe_globals`` trusts (trusting their rebuild functions
  would hand them asyncload's stand-ins, an internal error);
- plain data (enums, dataclasses, ``argparse.Namespace``, objects rebuilt from their
  fields): the ``LoadOptions(safe_globals=[...])`` that names all of them.

The scan decodes the pickle with the same machine (:class:`~asyncload.decoding.vm.PickleVM`,
its resource guards included) under a policy that imports nothing and calls nothing: a
global is a :class:`_Global` stand-in, a call or ``NEWOBJ`` a :class:`_Made` one holding
its arguments and ``BUILD`` state. Whether a named class is an enum or a dataclass is
looked up only in modules this process already imported (``vars()``, no module
``__getattr__``); otherwise the pickle's own evidence decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncload.common.errors import CheckpointFormatError, UnsafeCheckpointError
from asyncload.decoding.vm import PickleVM, short_repr

__all__ = ["Needed", "Scan", "Unreadable", "failing_key_path", "refusal", "scan_pickle"]

#: Most key paths shown per name.
_SHOWN_PATHS = 3
#: Most names listed in one message (the rest are counted).
_SHOWN_NAMES = 40
#: How a refusal's scan starts its sentences.
_SCANNED = "Scanned whole, nothing run:"
#: Longest key path kept (deeper ones end in "...").
_MAX_PATH = 200


class _Sym:
    """A stand-in of the scan (hashable by identity: it may be a dict key)."""

    __slots__ = ()


class _Global(_Sym):
    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


class _Made(dict[Any, Any]):  # a dict subclass: SETITEMS may fill it
    """What a call or ``NEWOBJ`` of ``func`` would make; ``state`` is its BUILD state."""

    __slots__ = ("args", "func", "newobj", "state")
    __hash__ = object.__hash__  # type: ignore[assignment]  # a stand-in: hashed by identity

    def __init__(self, func: Any, args: Any, newobj: bool) -> None:
        super().__init__()
        self.func = func
        self.args = args
        self.newobj = newobj
        self.state: Any = None

    def __eq__(self, other: object) -> bool:
        return self is other


class _Persistent(_Sym):
    __slots__ = ()


_PERSISTENT = _Persistent()


class _ScanPolicy:
    """A :class:`~asyncload.decoding.vm.PicklePolicy` that builds stand-ins and runs nothing."""

    record_classes: frozenset[type] = frozenset()
    shape_type: type | None = None
    atomic_key_types: tuple[type, ...] = (_Sym, _Made)
    unsafe_advice = ""

    def __init__(self) -> None:
        self.record_fields: Mapping[type, frozenset[str]] = {}
        self.globals: dict[tuple[str, str], _Global] = {}
        #: Every stand-in a call or NEWOBJ made, in the pickle's order.
        self.made: list[_Made] = []

    def find_class(self, vm: PickleVM, module: Any, name: Any) -> Any:
        if type(module) is not str or type(name) is not str:
            raise vm.bad("a global whose name is not a string")
        vm.charge(1)
        key = (module[:200], name[:200])
        found = self.globals.get(key)
        if found is None:
            found = self.globals[key] = _Global(*key)
        return found

    def call(self, vm: PickleVM, func: Any, args: Any) -> Any:
        vm.charge(1 + (len(args) if type(args) is tuple else 0))
        made = _Made(func, args, newobj=False)
        self.made.append(made)
        return made

    def newobj(self, vm: PickleVM, cls: Any, args: Any, kwargs: Any) -> Any:
        vm.charge(1 + (len(args) if type(args) is tuple else 0))
        made = _Made(cls, args, newobj=True)
        self.made.append(made)
        return made

    def build(self, vm: PickleVM, inst: Any, state: Any) -> None:
        vm.charge(1)
        if isinstance(inst, _Made):
            inst.state = state

    def persistent_load(self, vm: PickleVM, pid: Any) -> Any:
        vm.charge(1)
        return _PERSISTENT


# --- what asyncload reads, and what it does not ---------------------------------------------

#: torch's tensor rebuild functions that asyncload reads (tensors, parameters).
_TENSORS = frozenset(
    {
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
    }
)

_TORCH_LOAD = "read the file with torch.load(path, weights_only=True)"

#: Tensors asyncload does not read (``torch.load(weights_only=True)`` reads them): name ->
#: (what it is, the one-line fix).
UNREADABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("torch._utils", "_rebuild_sparse_tensor"): (
        "a sparse tensor",
        f"save it dense (t.to_dense()), or {_TORCH_LOAD}",
    ),
    ("torch._utils", "_rebuild_qtensor"): (
        "a quantized tensor",
        f"save it dequantized (t.dequantize()), or {_TORCH_LOAD}",
    ),
    ("torch._utils", "_rebuild_nested_tensor"): (
        "a nested tensor",
        f"save its components (t.unbind()), or {_TORCH_LOAD}",
    ),
    ("torch._utils", "_rebuild_wrapper_subclass"): (
        "a tensor subclass without storage of its own",
        f"save plain tensors, or {_TORCH_LOAD}",
    ),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): (
        "a meta tensor (no data)",
        "save tensors that hold data (a meta tensor has nothing to load)",
    ),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): (
        "a tensor of a device without storage access (XLA, MTIA)",
        f"save it on the CPU (t.cpu()), or {_TORCH_LOAD}",
    ),
    ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): (
        "a tensor of a device without storage access (XLA, MTIA)",
        f"save it on the CPU (t.cpu()), or {_TORCH_LOAD}",
    ),
    ("torch._tensor", "_rebuild_from_type_v2"): (
        "a tensor subclass or a tensor with Python attributes",
        f"save plain tensors (t.as_subclass(torch.Tensor)), or {_TORCH_LOAD} (a subclass "
        "also needs torch.serialization.add_safe_globals)",
    ),
}

_PACKED = (
    "the packed weights of a quantized module (quantize_dynamic, torch.ao convert)",
    f"save the float model's state_dict() and quantize again after loading, or {_TORCH_LOAD}",
)

#: Names only ever used inside a quantized tensor's record (its quantization scheme).
_QSCHEMES = frozenset(
    ("torch", n)
    for n in (
        "per_tensor_affine",
        "per_tensor_symmetric",
        "per_channel_affine",
        "per_channel_symmetric",
        "per_channel_affine_float_qparams",
    )
)

#: Classes that are plain data whatever their module (no import needed to know).
_PLAIN_CLASSES = frozenset(
    {
        ("argparse", "Namespace"),
        ("types", "SimpleNamespace"),
        ("collections", "Counter"),
        ("datetime", "datetime"),
        ("datetime", "date"),
        ("datetime", "time"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("decimal", "Decimal"),
        ("fractions", "Fraction"),
        ("uuid", "UUID"),
    }
)

_CONSTANTS = (str, bytes, int, float, bool, complex, type(None))


@dataclass(frozen=True)
class Needed:
    """A global the pickle names that the allow-list lacks."""

    dotted: str
    #: ``"data"`` (rebuilt from plain values), ``"module"`` (an ``nn.Module``), ``"code"``
    #: (a call that runs the named function or constructor), ``"unknown"``.
    kind: str
    #: What it is, in words ("an enum", "rebuilt from its fields", ...).
    detail: str
    #: Key paths where it is used (``""``: the file's whole object), at most a few.
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Unreadable:
    """A tensor ``torch.load(weights_only=True)`` reads and asyncload does not."""

    path: str
    what: str
    fix: str


@dataclass(frozen=True)
class Scan:
    """What :func:`scan_pickle` found."""

    #: Globals outside the allow-list (and not trusted), in the pickle's order.
    needed: tuple[Needed, ...]
    unreadable: tuple[Unreadable, ...]
    #: ``"dict"``, ``"module"`` (a pickled nn.Module), ``"object"``, or a type name.
    top: str
    #: The top object's class name (``"module"``/``"object"``), else ``""``.
    top_class: str
    #: Tensor records in the pickle.
    tensors: int
    #: False where the scan stopped early (a damaged pickle): what it lists is what it saw.
    complete: bool


def scan_pickle(
    data: bytes,
    what: str,
    *,
    allowed: Any = (),
    trusted: Any = (),
) -> Scan:
    """Decode ``data`` with stand-ins (nothing imported, nothing called) and describe what it
    needs. ``allowed``: ``(module, name)`` pairs the allow-list has; ``trusted``: dotted names
    the user trusts (``LoadOptions.safe_globals``); neither is listed as needed."""
    policy = _ScanPolicy()
    vm = PickleVM(data, policy, what)
    complete = True
    top: Any = None
    try:
        top = vm.run()
    except (UnsafeCheckpointError, CheckpointFormatError):
        complete = False
    uses, unreadable, tensors, _ = _walk(top, allowed)
    needed: list[Needed] = []
    for key, g in policy.globals.items():
        if key in _TENSORS or key in _QSCHEMES or key in UNREADABLE or key in allowed:
            continue
        if g.dotted in trusted:
            continue
        kind, detail = _classify(g, uses.get(g, []))
        paths = tuple(dict.fromkeys(p for p, _ in uses.get(g, [])))[:_SHOWN_PATHS]
        needed.append(Needed(g.dotted, kind, detail, paths))
    kind, cls = _top_kind(top)
    return Scan(tuple(needed), tuple(unreadable), kind, cls, tensors, complete)


def _func(made: _Made) -> tuple[str, str] | None:
    f = made.func
    return (f.module, f.name) if isinstance(f, _Global) else None


def _is_module_state(state: Any) -> bool:
    """A BUILD state that is an ``nn.Module``'s ``__dict__``."""
    return isinstance(state, dict) and "_modules" in state and "_parameters" in state


_Uses = dict[_Global, list[tuple[str, _Made]]]


def _walk(top: Any, allowed: Any) -> tuple[_Uses, list[Unreadable], int, dict[int, str]]:
    """Where each global is made (key path, the stand-in), the unreadable tensors (those
    whose rebuild function the policy does not resolve itself), the number of tensor
    records, and each stand-in's key path (by id): an iterative walk, each object once. A
    stand-in's arguments and tuple state keep its path (they are how it is made, not keys)."""
    uses: _Uses = {}
    unreadable: list[Unreadable] = []
    made_paths: dict[int, str] = {}
    tensors = 0
    seen: set[int] = set()
    stack: list[tuple[Any, str, bool]] = [(top, "", False)]  # (object, path, inside a stand-in)
    while stack:
        obj, path, inside = stack.pop()
        if isinstance(obj, _CONSTANTS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _Made):
            made_paths[id(obj)] = path
            key = _func(obj)
            if key in _TENSORS:
                tensors += 1
                continue
            if key in UNREADABLE and key not in allowed:
                tensors += 1
                what, fix = UNREADABLE[key]
                if key == ("torch._utils", "_rebuild_qtensor") and "_packed_params" in path:
                    what, fix = _PACKED
                elif key == ("torch._utils", "_rebuild_sparse_tensor"):
                    layout = _layout(obj.args)
                    what = f"{what} ({layout})" if layout else what
                unreadable.append(Unreadable(path, what, fix))
                continue
            if isinstance(obj.func, _Global):
                uses.setdefault(obj.func, []).append((path, obj))
            kids: list[tuple[Any, str, bool]] = [
                (v, _join(path, k), False) for k, v in obj.items()
            ]
            state = obj.state
            if isinstance(state, dict):
                kids += [(v, _join(path, k), False) for k, v in state.items()]
            elif type(state) in (tuple, list):  # (__dict__, slots), or a state of values
                kids += [(x, path, True) for x in state]
            elif state is not None:
                kids.append((state, path, True))
            if type(obj.args) is tuple:
                kids += [(a, path, True) for a in obj.args]
            stack.extend(reversed(kids))
        elif isinstance(obj, dict):
            stack.extend(reversed([(v, _join(path, k), False) for k, v in obj.items()]))
        elif isinstance(obj, (list, tuple)):
            stack.extend(
                reversed(
                    [(v, path if inside else _join(path, i), inside) for i, v in enumerate(obj)]
                )
            )
        elif isinstance(obj, (set, frozenset)):
            stack.extend((v, path, inside) for v in obj)
    return uses, unreadable, tensors, made_paths


_CALLS = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})


def failing_key_path(data: bytes, failed_at: int) -> str | None:
    """The key path of the value a decode of ``data`` was making when it was refused just
    before offset ``failed_at`` (:attr:`PickleVM.failed_at`), or ``None`` where that cannot be
    told. The pickle is scanned twice with stand-ins: up to the refused opcode, to count the
    objects made before it, then whole, to find where the object that opcode makes (a call)
    or fills (the last one made before it) ends up."""
    import pickletools

    start: int | None = None
    name = ""
    try:
        for op, _, pos in pickletools.genops(data):
            if pos is None or pos >= failed_at:
                break
            start, name = pos, op.name
    except Exception:  # a damaged pickle past the refused opcode: what was read is enough
        pass
    if start is None:
        return None
    before = _ScanPolicy()
    with contextlib.suppress(UnsafeCheckpointError, CheckpointFormatError):
        PickleVM(data[:start] + b".", before, "").run()
    whole = _ScanPolicy()
    try:
        top = PickleVM(data, whole, "").run()
    except (UnsafeCheckpointError, CheckpointFormatError):
        return None
    index = len(before.made) if name in _CALLS else len(before.made) - 1
    if not 0 <= index < len(whole.made):
        return None
    _, _, _, paths = _walk(top, ())
    found = paths.get(id(whole.made[index]))
    return found or None


def _join(path: str, key: Any) -> str:
    """``path.key``, bounded: a deeply nested pickle cannot make its paths grow without end."""
    if len(path) >= _MAX_PATH:
        return path if path.endswith("...") else f"{path}..."
    part = (
        key[:64]
        if type(key) is str
        else short_repr(key)[:64]
        if isinstance(key, _CONSTANTS)
        else "?"
    )
    return f"{path}.{part}" if path else part


def _layout(args: Any) -> str:
    """``torch.sparse_coo`` (etc.) from ``_rebuild_sparse_tensor(layout, data)``'s arguments."""
    if type(args) is tuple and args and isinstance(args[0], _Made):
        inner = args[0].args
        if type(inner) is tuple and inner and type(inner[0]) is str:
            return inner[0][:64]
    return ""


def _loaded(g: _Global) -> Any:
    """The named object, only from a module this process already imported (no import, no
    module ``__getattr__``); ``None`` if it is not there."""
    obj: Any = sys.modules.get(g.module)
    for part in g.name.split("."):
        if obj is None:
            return None
        try:
            obj = vars(obj).get(part)
        except TypeError:
            return None
    return obj


def _classify(g: _Global, uses: list[tuple[str, _Made]]) -> tuple[str, str]:
    if any(_is_module_state(m.state) for _, m in uses):
        return "module", "an nn.Module"
    obj = _loaded(g)
    if isinstance(obj, type):
        try:
            import torch

            if issubclass(obj, torch.nn.Module):
                return "module", "an nn.Module"
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        if issubclass(obj, enum.Enum):
            return "data", "an enum"
        if dataclasses.is_dataclass(obj):
            return "data", "a dataclass, rebuilt from its fields"
    if (g.module, g.name) in _PLAIN_CLASSES:
        return "data", "plain data"
    if uses and all(m.newobj for _, m in uses):
        return "data", "an object rebuilt from its fields"
    if not uses:
        return "unknown", "named, not called"
    if all(
        type(m.args) is tuple and len(m.args) == 1 and isinstance(m.args[0], _CONSTANTS)
        for _, m in uses
    ):
        if obj is None:
            return (
                "unknown",
                "called with one plain value (an enum, if it is one: not imported here)",
            )
        return "code", "a function or constructor called with a value"
    return "code", "a function or constructor called with arguments"


def _top_kind(top: Any) -> tuple[str, str]:
    if isinstance(top, _Made):
        f = top.func
        cls = f.name.rsplit(".", 1)[-1] if isinstance(f, _Global) else "object"
        if _is_module_state(top.state):
            return "module", cls
        if isinstance(f, _Global) and (f.module, f.name) == ("collections", "OrderedDict"):
            return "dict", ""
        obj = _loaded(f) if isinstance(f, _Global) else None
        if isinstance(obj, type):
            try:
                import torch

                if issubclass(obj, torch.nn.Module):
                    return "module", cls
            except ImportError:  # pragma: no cover
                pass
        if len(top):  # a dict subclass with items
            return "dict", ""
        return "object", cls
    if isinstance(top, dict):
        return "dict", ""
    return type(top).__name__, ""


# --- the message ---------------------------------------------------------------------------


def _where(paths: tuple[str, ...]) -> str:
    if not paths:
        return ""
    shown = ", ".join("the whole file" if p == "" else repr(p) for p in paths)
    return f", at {shown}"


def refusal(scan: Scan, *, value: bool = False) -> str:
    """The sentences a refusal adds after naming the first refused global: what the file
    holds, every global it needs (data-only or not, and where), and the fix. ``value``: the
    pickle is one value of a state dict (a DCP object record), not a whole file."""
    parts: list[str] = [_SCANNED]
    if value:
        if scan.top == "module":
            parts.append(
                f"the value is a pickled nn.Module ({scan.top_class}): save its `state_dict()` "
                "instead."
            )
    elif scan.top == "module":
        parts.append(
            f"it holds a pickled nn.Module ({scan.top_class}: torch.save(model)), not a state "
            "dict: save `model.state_dict()` instead (torch.save(model.state_dict(), path)) "
            "and load that."
        )
    elif scan.top == "object":
        if scan.tensors:
            parts.append(
                f"it holds a `{scan.top_class}` object, not a dict of tensors: asyncload "
                "loads state dicts; save the tensors in a dict."
            )
        else:
            parts.append(
                f"it holds a `{scan.top_class}` object, not tensors: nothing to load into a "
                "model (read it with the tool that wrote it, or torch.load(path, "
                "weights_only=False), and only if you trust it)."
            )
    elif scan.top == "dict":
        modules = [n for n in scan.needed if n.kind == "module"]
        if modules:
            where = _where(modules[0].paths)
            parts.append(
                f"it holds a pickled nn.Module{where}: save that model's `state_dict()` instead."
            )
        else:
            parts.append(
                "it holds a dict (a state dict once what it needs is there)."
                if not scan.unreadable
                else "it holds a dict."
            )
    elif scan.top:
        parts.append(f"it holds a {scan.top}, not a dict: asyncload loads state dicts.")
    kinds: dict[tuple[str, str], list[str]] = {}
    for u in scan.unreadable:
        kinds.setdefault((u.what, u.fix), []).append(u.path)
    for (what, fix), paths in kinds.items():
        if paths == [""]:
            at = "The value" if value else "The whole file"
        else:
            shown = ", ".join(repr(p) for p in paths[:_SHOWN_PATHS])
            more = f" and {len(paths) - _SHOWN_PATHS} more" if len(paths) > _SHOWN_PATHS else ""
            at = f"{'Key' if len(paths) == 1 else 'Keys'} {shown}{more}"
        parts.append(
            f"{at} {'hold' if len(paths) > 1 else 'holds'} {what}, which asyncload does not "
            f"read: {fix}."
        )
    if scan.needed:
        data = [n for n in scan.needed if n.kind == "data"]
        other = [n for n in scan.needed if n.kind != "data"]
        listed = scan.needed[:_SHOWN_NAMES]
        items = "; ".join(
            f"{n.dotted} ({'data-only: ' if n.kind == 'data' else ''}{n.detail}{_where(n.paths)})"
            for n in listed
        )
        more = (
            f"; and {len(scan.needed) - len(listed)} more"
            if len(scan.needed) > len(listed)
            else ""
        )
        parts.append(
            f"It names {len(scan.needed)} global{'s' if len(scan.needed) != 1 else ''} outside "
            f"the allow-list ({len(data)} data-only): {items}{more}."
        )
        if (
            (value or scan.top == "dict")
            and not scan.unreadable
            and not any(n.kind == "module" for n in scan.needed)
        ):
            names = ", ".join(f'"{n.dotted}"' for n in scan.needed)
            runs = (
                f" ({', '.join(n.dotted for n in other)} then run{'s' if len(other) == 1 else ''}"
                " their own code)"
                if other
                else ""
            )
            parts.append(
                (
                    "If you trust them, pass them all at once"
                    if len(scan.needed) > 1
                    else "If you trust it, pass it"
                )
                + f": LoadOptions(safe_globals=[{names}])"
                f"{runs}; otherwise load the file only with torch's own reader, and only if you "
                "trust it."
            )
    if not scan.complete:
        parts.append("(The scan stopped early: the pickle is damaged past this point.)")
    return " ".join(parts)
