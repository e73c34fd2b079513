"""A corpus of hostile pickles, built here (never downloaded), and helpers that put one
into a real checkpoint: as ``.metadata``, as the ``data.pkl`` of an object record, as the
``data.pkl`` of a tensor record.

Every payload that would run code only creates a marker file (``marker``): if a decoder
ever executed one, the test sees the file. Nothing here is destructive.

``corpus(marker_dir)`` returns ``Hostile`` items: name, kind (for the docs table), the
bytes, and the error class asyncload must raise (``"unsafe"`` or ``"format"``).
"""

from __future__ import annotations

import builtins
import functools
import io
import os
import pickle
import struct
import subprocess
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Hostile", "colliding_int_pairs", "corpus", "record_pickle", "replace_record_pickle"]


@dataclass(frozen=True)
class Hostile:
    name: str
    kind: str
    data: bytes
    #: "unsafe" (UnsafeCheckpointError) or "format" (CheckpointFormatError)
    expect: str
    #: the same, when the pickle is a record's data.pkl (where persistent ids are storages)
    record_expect: str = ""

    @property
    def heavy(self) -> bool:
        """Megabytes of opcodes: slow to decode, so some tests run these once only."""
        return len(self.data) > 200_000

    def expected(self, placement: str) -> str:
        return (
            self.record_expect if placement != "metadata" and self.record_expect else self.expect
        )


class _Call:
    """Pickles as ``func(*args)``: the classic ``__reduce__`` payload."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _dumps(obj: Any, protocol: int = 2) -> bytes:
    return pickle.dumps(obj, protocol=protocol)


def _g(module: str, name: str) -> bytes:
    """GLOBAL opcode (works in every protocol)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def colliding_int_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` distinct 2-tuples of small ints that all have the same ``hash`` (CPython's
    xxHash-based tuple hash is invertible in its last lane)."""
    m = (1 << 64) - 1
    p1, p2, p5 = 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rotl(x: int) -> int:
        return ((x << 31) | (x >> 33)) & m

    def rotr(x: int) -> int:
        return ((x >> 31) | (x << 33)) & m

    inv_p1, inv_p2 = pow(p1, -1, 1 << 64), pow(p2, -1, 1 << 64)
    target = (rotl((p5 + 7 * p2) & m) * p1) & m  # acc after lane a=7
    target = (
        rotl((target + 11 * p2) & m) * p1
    ) & m  # ... and b=11: the hash of (7, 11) before the length
    out: list[tuple[int, int]] = []
    a = 1
    while len(out) < n:
        acc1 = (rotl((p5 + a * p2) & m) * p1) & m
        want = rotr((target * inv_p1) & m)
        b = ((want - acc1) * inv_p2) & m
        if b < (1 << 61) - 1:
            out.append((a, b))
        a += 1
    h = hash(out[0])
    assert all(hash(t) == h for t in out), "tuple hash changed: update colliding_int_pairs"
    return out


def corpus(marker_dir: str | os.PathLike[str]) -> list[Hostile]:
    """The hostile pickles. Payloads that run code would create files in ``marker_dir``."""
    d = Path(marker_dir)
    m = str(d / "executed")
    evil_pt = d / "evil.pt"  # a torch.save file whose pickle writes the marker
    evil_npy = d / "evil.npy"
    inner = _dumps(_Call(builtins.open, m + "-inner", "w"))
    if not evil_pt.exists():
        torch.save(_Call(builtins.open, m + "-torchload", "w"), evil_pt)
        np.save(
            evil_npy,
            np.array([_Call(builtins.open, m + "-npload", "w")], dtype=object),
            allow_pickle=True,
        )
    items: list[Hostile] = []

    def add(
        name: str, kind: str, data: bytes, expect: str = "unsafe", record_expect: str = ""
    ) -> None:
        items.append(Hostile(name, kind, data, expect, record_expect))

    # --- code execution through globals (every protocol for the classic one) ---
    for proto in range(6):
        add(
            f"os.system/p{proto}", "code: os.system", _dumps(_Call(os.system, f"touch {m}"), proto)
        )
    add(
        "builtins.eval",
        "code: eval/exec",
        _dumps(_Call(builtins.eval, f"open({m!r}, 'w').close()")),
    )
    add(
        "builtins.exec",
        "code: eval/exec",
        _dumps(_Call(builtins.exec, f"open({m!r}, 'w').close()")),
    )
    add("builtins.open", "code: builtins", _dumps(_Call(builtins.open, m, "w")))
    add("builtins.__import__", "code: builtins", _dumps(_Call(builtins.__import__, "os")))
    add(
        "builtins.getattr",
        "code: builtins",
        _g("builtins", "getattr")
        + b"("
        + _g("builtins", "__import__")
        + b"("
        + _u("os")
        + b"tR"
        + _u("system")
        + b"tR("
        + _u(f"touch {m}")
        + b"tR.",
    )
    add(
        "builtins.setattr",
        "code: builtins",
        _g("builtins", "setattr")
        + b"("
        + _g("torch", "float32")
        + _u("is_floating_point")
        + b"NtR.",
    )
    add("builtins.type", "code: builtins", _g("builtins", "type") + b"(" + _u("X") + b")}tR.")
    add(
        "subprocess.check_call",
        "code: subprocess",
        _dumps(_Call(subprocess.check_call, ["touch", m])),
    )
    add("subprocess.Popen", "code: subprocess", _dumps(_Call(subprocess.Popen, ["touch", m])))
    add(
        "functools.partial",
        "code: __reduce__ tricks",
        _dumps(_Call(functools.partial(builtins.open, m, "w"))),
    )
    add(
        "operator.methodcaller",
        "code: __reduce__ tricks",
        _g("operator", "methodcaller")
        + b"("
        + _u("system")
        + _u(f"touch {m}")
        + b"tR("
        + _g("builtins", "__import__")
        + b"("
        + _u("os")
        + b"tRtR.",
    )
    add("pickle.loads (nested)", "code: __reduce__ tricks", _dumps(_Call(pickle.loads, inner)))
    add(
        "copyreg._reconstructor",
        "code: __reduce__ tricks",
        _g("copyreg", "_reconstructor")
        + b"("
        + _g("builtins", "object")
        + _g("builtins", "object")
        + b"NtR.",
    )
    add(
        "importlib.import_module",
        "code: __reduce__ tricks",
        _g("importlib", "import_module") + b"(" + _u("os") + b"tR.",
    )
    add("sys.modules", "code: __reduce__ tricks", _g("sys", "modules") + b".")
    add("torch.load", "torch/numpy non-data globals", _dumps(_Call(torch.load, str(evil_pt))))
    add(
        "torch.storage._load_from_bytes",
        "torch/numpy non-data globals",
        _g("torch.storage", "_load_from_bytes") + b"(" + b"C\x03abc" + b"tR.",
    )
    add(
        "torch._C._set_grad_enabled",
        "torch/numpy non-data globals",
        _g("torch._C", "_set_grad_enabled") + b"(\x89tR.",
    )
    add("torch.nn.Module", "torch/numpy non-data globals", _g("torch.nn", "Module") + b")\x81.")
    add("torch.Tensor", "torch/numpy non-data globals", _g("torch", "Tensor") + b")\x81.")
    add(
        "torch._tensor._rebuild_from_type_v2",
        "torch/numpy non-data globals",
        _g("torch._tensor", "_rebuild_from_type_v2") + b"(NNNNtR.",
    )
    add(
        "torch.jit.load",
        "torch/numpy non-data globals",
        _g("torch.jit", "load") + b"(" + _u(str(evil_pt)) + b"tR.",
    )
    add(
        "numpy.load",
        "torch/numpy non-data globals",
        _dumps(_Call(np.load, str(evil_npy), None, True)),
    )
    # numpy data is decoded in records (DCP objects, torch.save files): there these names are
    # allowed and the malformed calls are damage; .metadata allows no numpy name at all
    add(
        "numpy._reconstruct",
        "torch/numpy non-data globals",
        _g("numpy.core.multiarray", "_reconstruct") + b"(NNNtR.",
        record_expect="format",
    )
    add(
        "numpy.dtype",
        "torch/numpy non-data globals",
        _g("numpy", "dtype") + b"(" + _u("f8") + b"tR.",
        record_expect="format",
    )
    add(
        "numpy object array",
        "torch/numpy non-data globals",
        _dumps(np.array([_Call(builtins.open, m + "-objarray", "w")], dtype=object)),
    )
    add(
        "numpy structured dtype",
        "torch/numpy non-data globals",
        _dumps(np.dtype([("a", "i4"), ("b", "O")])),
    )

    # --- allowed names used the wrong way ---
    add("REDUCE on torch.float32", "misused allowed names", _g("torch", "float32") + b")R.")
    add(
        "BUILD on torch.float32 (shared)",
        "misused allowed names",
        _g("torch", "float32") + b"}" + _u("x") + b"K\x01sb.",
    )
    add(
        "BUILD on a storage-type marker (shared)",
        "misused allowed names",
        b"\x80\x02"
        + _g("torch", "FloatStorage")
        + b"}"
        + _u("dtype")
        + _g("torch", "int8")
        + b"sb.",
    )
    add(
        "BUILD on the TensorProperties class",
        "misused allowed names",
        b"\x80\x02"
        + _g("torch.distributed.checkpoint.metadata", "TensorProperties")
        + b"N}"
        + _u("__setstate__")
        + _g("torch", "Size")
        + b"s\x86b.",
    )
    add(
        "NEWOBJ of torch.Size",
        "misused allowed names",
        b"\x80\x02" + _g("torch", "Size") + b")\x81.",
    )
    add(
        "_get_layout('torch.load')",
        "misused allowed names",
        _g("torch.serialization", "_get_layout") + b"(" + _u("torch.load") + b"tR.",
    )
    add(
        "persistent id (not a storage)",
        "misused allowed names",
        b"\x80\x02" + _u("x") + b"Q.",
        "unsafe",
        "format",
    )
    add("copyreg extension code", "misused allowed names", b"\x80\x02\x82\x01.")
    # TensorProperties.__setstate__ formats a bad encoding into its error message: a
    # billion-laughs value would make that str() run forever
    laughs = b"]q\x00" + b"".join(
        b"0(h" + bytes([i]) + b"h" + bytes([i]) + b"lq" + bytes([i + 1]) for i in range(60)
    )
    add(
        "TensorProperties state with a 2^60 DAG",
        "misused allowed names",
        b"\x80\x02"
        + _g("torch.distributed.checkpoint.metadata", "TensorProperties")
        + b")\x81"
        + b"("
        + _g("torch", "float32")
        + _g("torch.serialization", "_get_layout")
        + b"("
        + _u("torch.strided")
        + b"tR\x89"
        + laughs
        + b"\x89tb.",
        "format",
    )

    # --- resource abuse: memory ---
    add(
        "LONG_BINPUT 2^31 (memo abuse)",
        "memory: memo / declared lengths",
        b"\x80\x02]r\xff\xff\xff\x7f.",
        "format",
    )
    add(
        "PUT 10^15 (memo abuse)",
        "memory: memo / declared lengths",
        b"(lp1000000000000000\n.",
        "format",
    )
    add(
        "BYTEARRAY8 of 2^40 bytes",
        "memory: memo / declared lengths",
        b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b".",
        "format",
    )
    add(
        "BINUNICODE8 of 2^62 bytes",
        "memory: memo / declared lengths",
        b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"x.",
        "format",
    )
    add(
        "FRAME of 2^62 bytes, truncated",
        "memory: memo / declared lengths",
        b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"N",
        "format",
    )
    add(
        "LONG4 of 1 MiB",
        "memory: memo / declared lengths",
        b"\x80\x02\x8b" + struct.pack("<i", 1 << 20) + b"\x01" * (1 << 20) + b".",
        "format",
    )
    add("1M empty sets", "memory: huge structures", b"\x80\x04(" + b"\x8f" * 1_000_000 + b"l.")
    add("billion laughs: 2^60 list DAG", "memory: huge structures", b"\x80\x02" + laughs + b".")
    add(
        "100k nested lists",
        "depth: deep nesting",
        b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".",
    )
    add("100k nested tuples", "depth: deep nesting", b"\x80\x02)" + b"\x85" * 100_000 + b".")
    add(
        "100k nested dicts",
        "depth: deep nesting",
        b"\x80\x02"
        + b"}" * 100_000
        + b"".join(b"K" + bytes([i % 256]) + b"\x94" for i in range(0))
        + b"."
        if False
        else b"\x80\x02}" + b"K\x00}" * 99_999 + b"s" * 99_999 + b".",
    )
    # hashing a 1M-deep tuple overflows CPython's C stack (a segfault, with any unpickler)
    add(
        "1M nested tuples as a dict key",
        "hash: keys",
        b"\x80\x02})" + b"\x85" * 1_000_000 + b"Ns.",
    )
    add(
        "frozenset of a 1M nested tuple",
        "hash: keys",
        b"\x80\x04()" + b"\x85" * 1_000_000 + b"\x91.",
    )
    pairs = colliding_int_pairs(50_000)
    flood = (
        b"\x80\x02}("
        + b"".join(
            b"J" + struct.pack("<i", a) + b"\x8a\x08" + struct.pack("<q", b) + b"\x86N"
            for a, b in pairs
        )
        + b"u."
    )
    add("50k dict keys with one hash (hash flooding)", "hash: keys", flood)
    big_key = b"(" + b"K\x01" * 60_000 + b"tq\x00"
    add(
        "a 60k-item tuple key hashed 20k times",
        "hash: keys",
        b"\x80\x02" + big_key + b"}(" + b"h\x00N" * 20_000 + b"u.",
    )
    return items


# --- putting a pickle into a checkpoint ---------------------------------------------


def record_pickle(record: bytes) -> bytes:
    """The data.pkl of a torch.save record."""
    zf = zipfile.ZipFile(io.BytesIO(record))
    (name,) = [n for n in zf.namelist() if n.endswith("data.pkl")]
    return zf.read(name)


def _rebuild_record(record: bytes, pkl: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(record))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pkl if info.filename.endswith("data.pkl") else src.read(info.filename)
            dst.writestr(info.filename, data)
    return out.getvalue()


def replace_record_pickle(ckpt: str | os.PathLike[str], fqn: str, pkl: bytes) -> None:
    """Replace the data.pkl of key ``fqn``'s record with ``pkl``: the record is rebuilt (a
    valid zip), spliced into its .distcp file, and .metadata's offsets updated."""
    ckpt = Path(ckpt)
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    target = next(info for idx, info in md.storage_data.items() if idx.fqn == fqn)
    path = ckpt / target.relative_path
    blob = path.read_bytes()
    old = blob[target.offset : target.offset + target.length]
    new = _rebuild_record(old, pkl)
    delta = len(new) - len(old)
    path.write_bytes(blob[: target.offset] + new + blob[target.offset + target.length :])
    old_offset = target.offset
    for info in md.storage_data.values():
        if info.relative_path == target.relative_path and info.offset > old_offset:
            info.offset += delta
    target.length = len(new)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
