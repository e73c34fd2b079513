"""A pickle virtual machine that never runs code from the pickle, and knows no names.

:class:`PickleVM` decodes one pickle (every opcode of protocols 0-5, the opcodes of
``pickletools``) over bytes in memory, iteratively: no recursion, whatever the nesting.
Everything that could import a module, call, create or modify an object is decided by
a *policy* (:class:`PicklePolicy`), which this module does not provide: it knows nothing
of torch, of checkpoints, or of which names may be used. The VM calls the policy for

- ``GLOBAL``/``STACK_GLOBAL``/``INST`` names: :meth:`PicklePolicy.find_class`;
- ``REDUCE``/``OBJ``/``INST`` calls: :meth:`PicklePolicy.call`;
- ``NEWOBJ``/``NEWOBJ_EX``: :meth:`PicklePolicy.newobj` (except the fast path below);
- ``BUILD``: :meth:`PicklePolicy.build` (idem);
- ``PERSID``/``BINPERSID``: :meth:`PicklePolicy.persistent_load`.

The policy also declares a few types, so that the VM can take fast paths and price
hashing without knowing what they are: ``record_fields`` (classes that ``NEWOBJ`` may
create empty and ``BUILD`` may then fill with exactly those fields, when this pickle
created the object), ``shape_type`` (a tuple subclass constructed from one sequence of
ints, hashed like a tuple) and ``atomic_key_types`` (types whose instances hash cheaply).

The VM itself enforces the resource guards, whatever the policy: memo indices bounded by
the pickle's length (CPython's C unpickler allocates and zeroes ``16 x index`` bytes for
one 9-byte ``LONG_BINPUT``, its pure-Python one ``n`` bytes for one ``BYTEARRAY8``),
dict and set keys checked before they are hashed (deeply nested tuple keys crash
CPython's hash with a C stack overflow; huge keys hashed again and again, or keys
crafted to share one hash, make decoding quadratic), and a work budget proportional to
the pickle's size that the policy charges its calls to (:meth:`PickleVM.charge`).
:func:`check_structure` walks a decoded value for nesting and sharing bombs.

Errors: what the policy or a guard refuses is :class:`UnsafeCheckpointError`
(:meth:`PickleVM.unsafe`); a damaged or truncated pickle is
:class:`CheckpointFormatError` (:meth:`PickleVM.bad`). :meth:`PickleVM.run` lets
nothing else escape.
"""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from asyncload.common.errors import CheckpointFormatError, UnsafeCheckpointError
from asyncload.common.paths import short_repr
from asyncload.decoding.work import WorkBudget

__all__ = ["PicklePolicy", "PickleVM", "check_structure", "collector_paused", "short_repr"]

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

#: Keys whose check costs more units than this are remembered (cheaper ones are checked again).
_CACHE_COST = 64
#: Pickles from this size on are decoded with the cyclic garbage collector paused.
_PAUSE_GC_FROM = 1 << 20

_NO_FIELDS: frozenset[str] = frozenset()
#: Stands for "no such type" where the policy declares none (never the type of a value).
_NO_TYPE: Any = object()


# --- the policy ---------------------------------------------------------------------


class PicklePolicy(Protocol):
    """What a pickle may build: the VM asks it about every name, call and object.

    Each method gets the running :class:`PickleVM` (for :meth:`~PickleVM.charge`,
    :meth:`~PickleVM.check_keys`, :meth:`~PickleVM.mark_fresh`, :meth:`~PickleVM.is_fresh`,
    :meth:`~PickleVM.seal`
    and its error constructors) and either returns the value or raises.
    """

    #: Classes ``NEWOBJ`` may create empty, and the fields ``BUILD`` may then set on an
    #: object of them that this pickle created; also priced as dict keys (their fields).
    record_fields: Mapping[type, frozenset[str]]
    #: ``frozenset(record_fields)``.
    record_classes: frozenset[type]
    #: A tuple subclass that ``REDUCE`` may build straight from one list or tuple of at most
    #: 1024 ints (without :meth:`call`), and that is hashed like a tuple; or ``None``.
    shape_type: type | None
    #: Types whose instances are hashed at a fixed, small cost when they are dict/set keys.
    atomic_key_types: tuple[type, ...]
    #: Appended to every :meth:`PickleVM.unsafe` message (what to do instead).
    unsafe_advice: str

    def find_class(self, vm: PickleVM, module: Any, name: Any) -> Any:
        """The object a ``GLOBAL``/``STACK_GLOBAL``/``INST`` names."""

    def call(self, vm: PickleVM, func: Any, args: Any) -> Any:
        """``func(*args)`` for ``REDUCE``/``OBJ``/``INST``; charge its cost to the VM."""

    def newobj(self, vm: PickleVM, cls: Any, args: Any, kwargs: Any) -> Any:
        """``NEWOBJ``/``NEWOBJ_EX`` (``kwargs`` is ``None`` for ``NEWOBJ``) other than an
        argument-less one of a record class, which the VM does itself."""

    def build(self, vm: PickleVM, inst: Any, state: Any) -> None:
        """``BUILD`` other than a fresh record's own fields, which the VM sets itself."""

    def persistent_load(self, vm: PickleVM, pid: Any) -> Any:
        """The object a persistent id stands for."""


# --- the garbage collector ----------------------------------------------------------
# A large pickle makes millions of objects that all stay alive until the end (the memo
# holds them), and each generational collection in between walks them again: for a DCP
# .metadata of 1 M chunks that is most of what pickle.loads itself spends (13 s, 2 s with
# the collector paused). A decode makes no cyclic garbage except lists a pickle appends to
# themselves after a DUP, which the memory the pickle's size allows bounds like every other
# object; the collector frees them when it resumes.


class _CollectorPause:
    """Pauses the cyclic garbage collector while at least one decode holds it; restores
    the state it found when the last one leaves (also in a child forked meanwhile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._resume = False
        self._fork_hook = False

    def enter(self) -> None:
        with self._lock:
            if not self._fork_hook:
                os.register_at_fork(after_in_child=self._after_fork)
                self._fork_hook = True
            if self._holders == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._holders += 1

    def leave(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._resume:
                gc.enable()
                # the objects made meanwhile are all young: one collection of the young
                # generations walks them once, where the next allocations would trigger two
                # (generation 0, then generation 1) that walk them twice
                gc.collect(1)

    def _after_fork(self) -> None:  # only the forking thread lives on: no decode is running
        self._lock = threading.Lock()
        if self._holders and self._resume:
            gc.enable()
        self._holders = 0


_PAUSE = _CollectorPause()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the cyclic garbage collector paused (nestable, thread-safe)."""
    _PAUSE.enter()
    try:
        yield
    finally:
        _PAUSE.leave()


# --- the machine --------------------------------------------------------------------
# Over the bytes in memory: faster than pickle's pure-Python unpickler, and every opcode
# that could allocate, hash or call is checked before it does.

_U2 = struct.Struct("<H").unpack_from
_U4 = struct.Struct("<I").unpack_from
_I4 = struct.Struct("<i").unpack_from
_U8 = struct.Struct("<Q").unpack_from
_F8 = struct.Struct(">d").unpack_from


class PickleVM:
    """Decodes one pickle (``data``) under ``policy``; ``what`` names it in messages."""

    def __init__(
        self, data: bytes, policy: PicklePolicy, what: str, work: WorkBudget | None = None
    ) -> None:
        self._data = data
        self._policy = policy
        self.what = what
        self._size = len(data)
        self._work = 0
        #: Units of work the whole decode may take (see :meth:`charge`).
        self.work_limit = _WORK_FLOOR + _WORK_PER_BYTE * len(data)
        #: The caller's budget: charged a unit per byte now (every opcode is at least one
        #: byte) and the units of :meth:`charge` when the decode ends; when it has less room
        #: than :attr:`work_limit`, its limit is the one that stops the decode.
        self._budget = work
        self._budget_binds = False
        self._limit = self.work_limit
        if work is not None:
            work.charge(len(data), what)
            room = work.room()
            if room is not None and room < self.work_limit:
                self._limit = room
                self._budget_binds = True
        #: ids of objects created here that may be BUILT (see :meth:`mark_fresh`), kept alive
        self._fresh: dict[int, Any] = {}
        #: ids of container keys already checked -> (key, cost); keeps the keys alive
        self._key_ok: dict[int, tuple[Any, int]] = {}
        #: id(container) -> {hash: number of keys inserted with that hash}
        self._hash_counts: dict[int, dict[int, int]] = {}
        self._shape_type: Any = policy.shape_type if policy.shape_type is not None else _NO_TYPE
        #: Where the decode stopped when the policy or a guard refused it: the offset just past
        #: the opcode (and its argument) being run (a refusal may name the key it was building).
        self.failed_at: int | None = None

    # -- for the policy --

    @property
    def data(self) -> bytes:
        """The pickle being decoded (a refusal may scan it whole: :mod:`~asyncload.decoding.scan`)."""
        return self._data

    def unsafe(self, msg: str) -> UnsafeCheckpointError:
        """The error for something the pickle may not do (``msg`` says what it asked)."""
        return UnsafeCheckpointError(
            f"{self.what}: {msg}; nothing from it was executed. {self._policy.unsafe_advice}"
        )

    def bad(self, msg: str) -> CheckpointFormatError:
        """The error for a damaged pickle (``msg`` says what is wrong)."""
        return CheckpointFormatError(f"{self.what} is not a valid pickle: {msg}")

    def charge(self, units: int) -> None:
        """Spend ``units`` of the work budget; raises once it is exhausted."""
        self._work += units
        if self._work > self._limit:
            if self._budget is not None and self._budget_binds:
                budget, self._budget = self._budget, None
                budget.spent += self._work
                raise budget.exceeded(self.what)
            raise self.unsafe(
                f"decoding it needs more than {self.work_limit} units of work for "
                f"{self._size} bytes of pickle (shared references expanded, or large keys "
                "hashed again and again)"
            )

    @property
    def work_done(self) -> int:
        """Units of :meth:`charge` spent so far (the bytes read not included)."""
        return self._work

    def mark_fresh(self, obj: Any) -> None:
        """Record that this pickle created ``obj`` (only such objects may be modified)."""
        self._fresh[id(obj)] = obj

    def seal(self, obj: Any) -> None:
        """``obj`` may no longer be modified (built once, or in use by another object)."""
        self._fresh.pop(id(obj), None)

    def is_fresh(self, obj: Any) -> bool:
        """Whether this pickle created ``obj`` (:meth:`mark_fresh`, or a record class's
        ``NEWOBJ``)."""
        return self._fresh.get(id(obj)) is obj

    def check_keys(self, keys: list[Any], what: str) -> None:
        """Check ``keys`` before ``what`` (a set or mapping constructor) hashes them:
        cheap and safe to hash, and not flooding one hash value."""
        local: dict[int, int] = {}
        for k in keys:
            self.charge(self._key_cost(k))
            h = hash(k)
            local[h] = local.get(h, 0) + 1
            if local[h] > _MAX_SAME_HASH:
                raise self.unsafe(
                    f"more than {_MAX_SAME_HASH} items given to {what} share a hash value (hash "
                    f"flooding)"
                )

    # -- guards --

    def _key_cost(self, key: Any) -> int:
        """Check that hashing ``key`` is cheap and safe; return its cost (cached per object
        when walking it took more than a few steps)."""
        t = type(key)
        if t is str or key is None or t is bool or t is float or t is bytes or t is complex:
            return 1
        if t is int:
            if not -_MAX_INT_KEY < key < _MAX_INT_KEY:
                raise self.bad(f"an int dict/set key of {key.bit_length()} bits")
            return 1
        shape_type = self._shape_type
        if t is shape_type:  # only ints of at most 64 bits, never nested: hashed in len(key) steps
            return 1 + len(key)
        if isinstance(key, self._policy.atomic_key_types):
            return 1
        cached = self._key_ok.get(id(key))
        if cached is not None and cached[0] is key:
            return cached[1]
        cost = 1
        record_fields = self._policy.record_fields
        if t is frozenset:
            pass  # its items were checked when it was built; Python caches its hash
        elif t is tuple:
            stack: list[tuple[Any, int]] = [(key, 1)]
            while stack:  # iterative: nested tuples, bounded depth
                obj, depth = stack.pop()
                if depth > _MAX_KEY_DEPTH:
                    raise self.unsafe(
                        f"a dict/set key is nested more than {_MAX_KEY_DEPTH} levels deep"
                    )
                for item in obj:
                    it = type(item)
                    if it is tuple:
                        c = self._key_ok.get(id(item))
                        if c is not None and c[0] is item:
                            cost += c[1]
                        else:
                            cost += 1
                            stack.append((item, depth + 1))
                    elif it is shape_type:
                        if depth >= _MAX_KEY_DEPTH:
                            raise self.unsafe(
                                f"a dict/set key is nested more than {_MAX_KEY_DEPTH} levels deep"
                            )
                        cost += 1 + len(item)
                    else:
                        cost += self._key_cost(item)
                if cost > 1 << 16:
                    raise self.bad("a dict/set key of more than 65536 items")
        elif t in record_fields and t.__hash__ is not None:
            fields = key.__dict__
            for name in record_fields[t]:
                value = fields.get(name)
                vt = type(value)
                if vt is str or value is None:
                    cost += value is not None
                elif vt is shape_type:
                    cost += 1 + len(value)
                else:
                    cost += self._key_cost(value)
        else:
            raise self.bad(f"a dict/set key of type {t.__name__}")
        if cost > _CACHE_COST:  # cheaper keys are checked again rather than remembered
            self._key_ok[id(key)] = (key, cost)
        return cost

    def _check_key(self, container: Any, key: Any) -> None:
        self.charge(self._key_cost(key))
        counts = self._hash_counts.get(id(container))
        if counts is None:
            counts = self._hash_counts[id(container)] = {}
        h = hash(key)
        n = counts.get(h, 0) + 1
        if n > _MAX_SAME_HASH:
            raise self.unsafe(
                f"more than {_MAX_SAME_HASH} keys of one dict or set share a hash value (hash "
                f"flooding)"
            )
        counts[h] = n

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if not isinstance(target, dict) or len(items) % 2:
            raise self.bad(f"SETITEMS on a {type(target).__name__}")
        check = self._check_key
        cheap = 0
        for i in range(0, len(items), 2):
            k = items[i]
            t = type(k)
            # str hashes are salted per process and small ints hash to themselves: neither
            # can be made to collide, so they only cost one unit
            if t is str or (t is int and -_SMALL_INT < k < _SMALL_INT):
                cheap += 1
            else:
                check(target, k)
            target[k] = items[i + 1]
        self._work += cheap
        if self._work > self._limit:
            self.charge(0)

    def _line(self, pos: int) -> tuple[bytes, int]:
        e = self._data.find(b"\n", pos, pos + 65536)
        if e < 0:
            raise self.bad(f"no end of line within 64 KiB after offset {pos}")
        return self._data[pos:e], e + 1

    def _memo_put(self, memo: list[Any], sparse: dict[int, Any], i: int, value: Any) -> None:
        """``memo[i] = value`` as pickle's dict memo does it, over the list of the first
        indices and the dict of the others (whose keys are all past the list's end)."""
        if i < 0 or i > self._size:
            raise self.bad(f"memo index {i} is out of range for a pickle of {self._size} bytes")
        n = len(memo)
        if i < n:
            memo[i] = value
        elif i == n:
            memo.append(value)
            while sparse and len(memo) in sparse:
                memo.append(sparse.pop(len(memo)))
        else:
            sparse[i] = value

    def _newobj(self, cls: Any, args: Any) -> Any:
        # a type before anything hashes it: a nested tuple or a record holding one would
        # crash ``in`` with a C stack overflow
        if (
            isinstance(cls, type)
            and cls in self._policy.record_classes
            and args == ()
            and type(args) is tuple
        ):
            obj = cls.__new__(cls)  # type: ignore[call-overload]
            self._fresh[id(obj)] = obj
            return obj
        return self._policy.newobj(self, cls, args, None)

    def _build(self, inst: Any, state: Any) -> None:
        if (
            type(state) is dict
            and self._fresh.get(id(inst)) is inst
            and state.keys() <= self._policy.record_fields.get(type(inst), _NO_FIELDS)
        ):
            inst.__dict__.update(state)
        else:
            self._policy.build(self, inst, state)

    # -- the machine --

    def run(self) -> Any:
        """Decode the pickle and return its object. Raises only UnsafeCheckpointError and
        CheckpointFormatError (whatever the bytes, whatever the policy's constructors raise
        beyond those: a damaged stream). The cyclic garbage collector is paused while a
        large pickle is decoded (see :func:`collector_paused`)."""
        what = self.what
        try:
            if self._size < _PAUSE_GC_FROM:
                return self.load()
            with collector_paused():
                return self.load()
        except (UnsafeCheckpointError, CheckpointFormatError):
            raise
        except RecursionError as exc:  # pragma: no cover - the decoder is iterative
            raise CheckpointFormatError(f"{what} is nested too deeply to decode") from exc
        except MemoryError:
            raise CheckpointFormatError(f"{what} asks for more memory than it can hold") from None
        except Exception as exc:
            raise CheckpointFormatError(
                f"{what} is not a valid pickle ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        finally:
            self._fresh.clear()
            self._key_ok.clear()
            self._hash_counts.clear()
            if self._budget is not None:
                self._budget.spent += self._work
                self._budget = None

    def load(self) -> Any:
        """Decode the pickle (:meth:`run` without its translation of stray exceptions)."""
        data = self._data
        end = len(data)
        pos = 0
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        # the memo: indices 0..len(memo)-1 in a list (what picklers write), any others in
        # ``sparse`` (PUT out of order; see _memo_put)
        memo: list[Any] = []
        sparse: dict[int, Any] = {}
        remember = memo.append
        value: Any
        append = stack.append
        policy = self._policy
        shape_type = self._shape_type
        set_items, newobj, build = self._set_items, self._newobj, self._build
        # Opcodes ordered by how often DCP metadata uses them. The value an opcode pushes is
        # memoized on the spot when a MEMOIZE follows (protocol 4 memoizes nearly every
        # object), and the frequent sequences (a shape's TUPLE1 REDUCE, a record's
        # EMPTY_TUPLE NEWOBJ, EMPTY_DICT MARK and SETITEMS BUILD) run as one step, with the
        # checks they get one by one. An opcode or a fixed-size argument past the end raises
        # IndexError (data[pos]) or struct.error, caught below; variable lengths are checked.
        try:
            while True:
                op = data[pos]
                pos += 1
                if op == 0x94:  # MEMOIZE
                    if sparse:
                        self._memo_put(memo, sparse, len(memo) + len(sparse), stack[-1])
                    else:
                        remember(stack[-1])
                elif op == 0x6A:  # LONG_BINGET
                    i = _U4(data, pos)[0]
                    try:
                        append(memo[i])
                    except IndexError:
                        append(sparse[i])
                    pos += 4
                elif op == 0x68:  # BINGET
                    i = data[pos]
                    try:
                        append(memo[i])
                    except IndexError:
                        append(sparse[i])
                    pos += 1
                elif op == 0x85:  # TUPLE1
                    value = (stack[-1],)
                    if data[pos] == 0x94 and not sparse:
                        remember(value)
                        pos += 1
                    if (
                        data[pos] == 0x52 and stack[-2] is shape_type
                    ):  # REDUCE: a shape in .metadata
                        a = value[0]
                        if (
                            type(a) in (tuple, list)
                            and len(a) <= 1024
                            and all(type(v) is int for v in a)
                        ):
                            stack.pop()
                            value = shape_type(a)
                            stack[-1] = value
                            pos += 1
                            if data[pos] == 0x94 and not sparse:
                                remember(value)
                                pos += 1
                            continue
                    stack[-1] = value
                elif op == 0x4D:  # BININT2
                    append(_U2(data, pos)[0])
                    pos += 2
                elif op == 0x28:  # MARK
                    metastack.append(stack)
                    stack = []
                    append = stack.append
                elif op == 0x75:  # SETITEMS
                    items = stack
                    stack = metastack.pop()
                    append = stack.append
                    target = stack[-1]
                    set_items(target, items)
                    if data[pos] == 0x62:  # BUILD: a record's fields
                        pos += 1
                        stack.pop()
                        build(stack[-1], target)
                elif op == 0x7D:  # EMPTY_DICT
                    value = {}
                    append(value)
                    if data[pos] == 0x94 and not sparse:
                        remember(value)
                        pos += 1
                    if data[pos] == 0x28:  # MARK: its items follow
                        pos += 1
                        metastack.append(stack)
                        stack = []
                        append = stack.append
                elif op == 0x29:  # EMPTY_TUPLE
                    if data[pos] == 0x81:  # NEWOBJ without arguments: a record
                        pos += 1
                        value = stack[-1] = newobj(stack[-1], ())
                        if data[pos] == 0x94 and not sparse:
                            remember(value)
                            pos += 1
                    else:
                        append(())
                elif op == 0x4B:  # BININT1
                    append(data[pos])
                    pos += 1
                elif op == 0x86:  # TUPLE2
                    b = stack.pop()
                    value = (stack[-1], b)
                    stack[-1] = value
                    if data[pos] == 0x94 and not sparse:
                        remember(value)
                        pos += 1
                elif op == 0x8C:  # SHORT_BINUNICODE
                    n = data[pos]
                    if pos + 1 + n > end:
                        raise self._truncated(pos, 1 + n)
                    value = str(data[pos + 1 : pos + 1 + n], "utf-8", "surrogatepass")
                    append(value)
                    pos += 1 + n
                    if data[pos] == 0x94 and not sparse:
                        remember(value)
                        pos += 1
                elif op == 0x4A:  # BININT
                    append(_I4(data, pos)[0])
                    pos += 4
                elif op == 0x8A:  # LONG1
                    a, pos = self._span(pos, 1)
                    append(int.from_bytes(data[a:pos], "little", signed=True))
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    stack[-1] = newobj(stack[-1], args)
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    build(stack[-1], state)
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    func = stack[-1]
                    if (
                        func is shape_type
                        and type(args) is tuple
                        and len(args) == 1
                        and type(args[0]) in (tuple, list)
                        and len(args[0]) <= 1024
                        and all(type(v) is int for v in args[0])
                    ):
                        stack[-1] = shape_type(
                            args[0]
                        )  # the one frequent call: shapes in .metadata
                    else:
                        stack[-1] = policy.call(self, func, args)
                elif op == 0x71:  # BINPUT
                    i = data[pos]
                    if i == len(memo) and not sparse:
                        remember(stack[-1])
                    else:
                        self._memo_put(memo, sparse, i, stack[-1])
                    pos += 1
                elif op == 0x89:  # NEWFALSE
                    append(False)
                elif op == 0x93:  # STACK_GLOBAL
                    name = stack.pop()
                    module = stack.pop()
                    if type(name) is not str or type(module) is not str:
                        raise self.bad("STACK_GLOBAL requires str")
                    append(policy.find_class(self, module, name))
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
                        raise self.bad(f"APPEND on a {type(target).__name__}")
                elif op == 0x72:  # LONG_BINPUT
                    self._memo_put(memo, sparse, _U4(data, pos)[0], stack[-1])
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
                        raise self.bad(f"APPENDS on a {type(target).__name__}")
                    self.charge(len(items) // 8)
                elif op == 0x2E:  # STOP
                    if not stack:
                        raise self.bad("STOP with an empty stack")
                    return stack.pop()
                elif op == 0x95:  # FRAME: informational only
                    if pos + 8 > end:
                        raise self._truncated(pos, 8)
                    pos += 8
                elif op == 0x80:  # PROTO
                    if data[pos] > 5:
                        raise self.bad(f"unsupported pickle protocol {data[pos]}")
                    pos += 1
                elif op == 0x51:  # BINPERSID
                    stack[-1] = policy.persistent_load(self, stack[-1])
                elif op == 0x58:  # BINUNICODE
                    a, pos = self._span(pos, 4)
                    append(str(data[a:pos], "utf-8", "surrogatepass"))
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
                    set_items(d, items)
                    append(d)
                elif op == 0x73:  # SETITEM
                    value = stack.pop()
                    key = stack.pop()
                    set_items(stack[-1], [key, value])
                elif op == 0x8D:  # BINUNICODE8
                    a, pos = self._span(pos, 8)
                    append(str(data[a:pos], "utf-8", "surrogatepass"))
                elif op == 0x43:  # SHORT_BINBYTES
                    a, pos = self._span(pos, 1)
                    append(data[a:pos])
                elif op == 0x42:  # BINBYTES
                    a, pos = self._span(pos, 4)
                    append(data[a:pos])
                elif op == 0x8E:  # BINBYTES8
                    a, pos = self._span(pos, 8)
                    append(data[a:pos])
                elif op == 0x96:  # BYTEARRAY8
                    a, pos = self._span(pos, 8)
                    append(bytearray(data[a:pos]))
                elif op == 0x55:  # SHORT_BINSTRING (Python 2 str)
                    a, pos = self._span(pos, 1)
                    append(str(data[a:pos], "ascii"))
                elif op == 0x54:  # BINSTRING (Python 2 str)
                    a, pos = self._span(pos, -4)
                    append(str(data[a:pos], "ascii"))
                elif op == 0x8B:  # LONG4
                    a, pos = self._span(pos, -4)
                    if pos - a > 4096:
                        raise self.bad(f"an integer of {pos - a} bytes")
                    append(int.from_bytes(data[a:pos], "little", signed=True))
                elif op == 0x47:  # BINFLOAT
                    append(_F8(data, pos)[0])
                    pos += 8
                elif op == 0x46:  # FLOAT
                    s, pos = self._line(pos)
                    append(float(s))
                elif op == 0x49:  # INT
                    s, pos = self._line(pos)
                    if len(s) > 64:
                        raise self.bad("an INT of more than 64 digits")
                    append(False if s == b"00" else True if s == b"01" else int(s))
                elif op == 0x4C:  # LONG
                    s, pos = self._line(pos)
                    if len(s) > 4096:
                        raise self.bad("a LONG of more than 4096 digits")
                    append(int(s[:-1] if s.endswith(b"L") else s))
                elif op == 0x56:  # UNICODE
                    s, pos = self._line(pos)
                    append(str(s, "raw-unicode-escape"))
                elif op == 0x53:  # STRING
                    raise self.bad("the Python 2 STRING opcode, which no checkpoint writer emits")
                elif op == 0x67:  # GET
                    s, pos = self._line(pos)
                    if len(s) > 20:
                        raise self.bad("malformed GET")
                    i = int(s)
                    append(memo[i] if 0 <= i < len(memo) else sparse[i])
                elif op == 0x70:  # PUT
                    s, pos = self._line(pos)
                    if len(s) > 20:
                        raise self.bad("malformed PUT")
                    self._memo_put(memo, sparse, int(s), stack[-1])
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
                    append(policy.find_class(self, module, name))
                elif op == 0x69:  # INST
                    s, pos = self._line(pos)
                    module = str(s, "ascii")
                    s, pos = self._line(pos)
                    name = str(s, "ascii")
                    func = policy.find_class(self, module, name)
                    args = tuple(stack)
                    stack = metastack.pop()
                    append = stack.append
                    append(policy.call(self, func, args))
                elif op == 0x6F:  # OBJ
                    items = stack
                    stack = metastack.pop()
                    append = stack.append
                    if not items:
                        raise self.bad("OBJ without a class")
                    append(policy.call(self, items[0], tuple(items[1:])))
                elif op == 0x92:  # NEWOBJ_EX
                    kwargs = stack.pop()
                    args = stack.pop()
                    cls = stack.pop()
                    append(policy.newobj(self, cls, args, kwargs))
                elif op == 0x8F:  # EMPTY_SET: 216 bytes of memory for one byte of pickle
                    self._work += 28
                    if self._work > self._limit:
                        self.charge(0)
                    append(set())
                elif op == 0x90:  # ADDITEMS
                    items = stack
                    stack = metastack.pop()
                    append = stack.append
                    target = stack[-1]
                    if type(target) is not set:
                        raise self.bad(f"ADDITEMS on a {type(target).__name__}")
                    for item in items:
                        self._check_key(target, item)
                        target.add(item)
                elif op == 0x91:  # FROZENSET
                    items = stack
                    stack = metastack.pop()
                    append = stack.append
                    self.check_keys(items, "frozenset")
                    append(frozenset(items))
                elif op == 0x50:  # PERSID
                    s, pos = self._line(pos)
                    append(policy.persistent_load(self, str(s, "ascii")))
                elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4
                    raise self.unsafe("uses the copyreg extension registry")
                elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                    raise self.bad("refers to out-of-band buffers")
                else:
                    raise self.bad(f"unknown opcode {op:#04x} at offset {pos - 1}")
        except (UnsafeCheckpointError, CheckpointFormatError):
            self.failed_at = pos
            raise
        except (IndexError, struct.error) as exc:
            if isinstance(exc, struct.error) or pos >= end:
                raise self.bad(
                    f"truncated: an opcode or its argument runs past the end ({end} bytes)"
                ) from None
            raise

    def _span(self, pos: int, width: int) -> tuple[int, int]:
        """Where the bytes of an opcode's argument lie, after its length of ``abs(width)``
        bytes (negative: signed) at ``pos``: ``(start, end)``, checked against the pickle's end."""
        data = self._data
        n = (
            data[pos]
            if width == 1
            else (_U4 if width == 4 else _U8 if width == 8 else _I4)(data, pos)[0]
        )
        start = pos + abs(width)
        if n < 0:  # LONG4, BINSTRING: moving back would run the same opcode forever
            raise self.bad(f"a negative length {n} at offset {pos}")
        if start + n > self._size:
            raise self._truncated(pos, abs(width) + n)
        return start, start + n

    def _truncated(self, pos: int, n: int) -> CheckpointFormatError:
        return self.bad(f"truncated: {n} bytes at offset {pos} run past the end ({self._size})")


# --- the decoded value --------------------------------------------------------------


def check_structure(
    obj: Any, what: str, max_depth: int, budget: int, children: Callable[[Any], list[Any] | None]
) -> int:
    """Raise UnsafeCheckpointError if ``obj`` is nested deeper than ``max_depth``, holds
    more than ``budget`` containers, or expands to more than ``budget`` nodes when shared
    references are followed (a "billion laughs" DAG: tiny in memory, but any recursive
    walk of it, ``repr`` or ``copy.deepcopy`` included, would run forever).

    ``children(o)`` lists what ``o`` holds, or ``None`` for a leaf. Iterative post-order
    walk; shared objects are visited once; a reference back to an object still being
    walked (a cycle) counts as a leaf. Returns the work done: containers walked plus the
    references followed from them.
    """
    edges = 0
    height: dict[int, int] = {}
    size: dict[int, int] = {}
    keep: list[Any] = []  # keeps walked objects alive while their ids are keys
    deep = UnsafeCheckpointError(
        f"{what} is nested more than {max_depth} levels deep; nothing from it was executed"
    )
    stack: list[tuple[Any, int]] = [(obj, 1)]  # (object, depth on the way down; 0: on the way up)
    while stack:
        o, depth = stack.pop()
        oid = id(o)
        if depth:
            if oid in height:
                continue
            kids = children(o)
            if kids is None:
                continue
            if depth > max_depth:  # fails fast on a plain chain; heights below catch shared paths
                raise deep
            height[oid], size[oid] = 0, 1  # in progress
            keep.append(o)
            edges += len(kids)
            if len(keep) > budget:
                raise UnsafeCheckpointError(
                    f"{what} holds more than {budget} containers; nothing from it was executed"
                )
            stack.append((o, 0))
            stack.extend((k, depth + 1) for k in kids)
            continue
        h, n = 1, 1
        for k in children(o) or ():
            kid = id(k)
            if kid in height:
                h = max(h, height[kid] + 1)
                n += size[kid]
            else:
                n += 1
        if h > max_depth:
            raise deep
        if n > budget:
            raise UnsafeCheckpointError(
                f"{what} expands to more than {budget} objects through shared references; nothing "
                f"from it was executed"
            )
        height[oid], size[oid] = h, n
    return len(keep) + edges
