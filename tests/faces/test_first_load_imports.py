"""A first load in a fresh process imports only what its checkpoint needs (issue 45, item 4).

A safetensors or torch.save file loaded with ``asyncload.load`` / ``aload`` / ``start_load`` /
``read_state_dict`` into plain tensors never imports ``torch.distributed.checkpoint``
(:mod:`asyncload.faces.plain_planner`, :mod:`asyncload.formats.plain`); a DCP checkpoint still
loads in the same kind of process. Each child runs the same loads twice over: in a process
that never imports DCP, and in one that imports it first (every load then planned by
``PipelinedLoadPlanner`` with DCP's types, as before); both must give the same bytes, the
same statistics and the same errors, word for word. Counted, not timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

pytestmark = pytest.mark.timeout(300)

CHILD = r"""
import asyncio, hashlib, json, sys
import torch
if sys.argv[1] == "dcp-first":
    import torch.distributed.checkpoint  # noqa: F401
folder = sys.argv[2]
import asyncload

def digest(sd):
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            raw = v.detach().contiguous().view(-1).view(torch.uint8) if v.numel() else b""
            out[k] = [str(v.dtype), list(v.shape), hashlib.sha256(bytes(raw.numpy()) if v.numel() else b"").hexdigest()]
        elif isinstance(v, dict):
            out[k] = digest(v)
        else:
            out[k] = repr(v)
    return out

def like(ref, **over):
    d = {k: torch.zeros_like(v) for k, v in ref.items()}
    d.update(over)
    return d

results = {}
def run(name, fn):
    try:
        results[name] = ["ok", fn()]
    except Exception as e:
        results[name] = ["error", type(e).__name__, str(e)]
    results[name].append("torch.distributed.checkpoint" in sys.modules)

st = f"{folder}/model.safetensors"
pt = f"{folder}/train.pt"
ref = torch.load(f"{folder}/reference.pt", weights_only=True)

def load(dest, path, **kw):
    stats = asyncload.load(dest, path, **kw)
    return [digest(dest), stats.missing_keys, stats.tied_keys, stats.unexpected_keys, stats.key_prefix]

run("safetensors", lambda: load(like(ref), st))
run("torch.save under a prefix", lambda: load(like(ref), pt))
run("missing key", lambda: load(like(ref, nope=torch.zeros(2)), st))
moved = {("model." + k if k == "steps" else k): v for k, v in like(ref).items()}
run("missing key, a close one", lambda: load(moved, st))
run("partial", lambda: load(like(ref, nope=torch.zeros(2)), st, allow_partial_load=True))
run("shape", lambda: load(like(ref, w=torch.zeros(3, 3)), st))
run("narrowing cast", lambda: load(like(ref, w=torch.zeros(33, 17, dtype=torch.float16)), st))
run("widening", lambda: load(like(ref, w=torch.zeros(33, 17, dtype=torch.float64)), st))
t = torch.zeros(4)
run("tied, one saved", lambda: load({"tie_a": t, "tie_b": t}, f"{folder}/tied.safetensors"))
run("tied, same values", lambda: load({"tie_a": t, "same": t}, f"{folder}/tied.safetensors"))
run("tied, other values", lambda: load({"tie_a": t, "other": t}, f"{folder}/tied.safetensors"))
run("object under a tensor", lambda: load({"step": torch.zeros(1)}, pt))
def aload():
    dest = like(ref)
    asyncio.run(asyncload.aload(dest, st))
    return digest(dest)
run("aload", aload)
def start():
    dest = like(ref)
    asyncload.start_load(dest, pt).result(120)
    return digest(dest)
run("start_load", start)
run("read_state_dict safetensors", lambda: digest(asyncload.read_state_dict(st)))
run("read_state_dict torch.save", lambda: digest(asyncload.read_state_dict(pt)))
run("read_state_dict keys", lambda: digest(asyncload.read_state_dict(pt, keys=["step", "model.w"])))
run("dcp", lambda: load(like(ref), f"{folder}/dcp"))
print("RESULT " + json.dumps(results))
"""

PLAIN = [
    "safetensors",
    "torch.save under a prefix",
    "missing key",
    "missing key, a close one",
    "partial",
    "shape",
    "narrowing cast",
    "widening",
    "tied, one saved",
    "tied, same values",
    "tied, other values",
    "object under a tensor",
    "aload",
    "start_load",
    "read_state_dict safetensors",
    "read_state_dict torch.save",
    "read_state_dict keys",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state dict (float32, bfloat16, int64, a 0-dim and an empty tensor) as safetensors,
    as a training torch.save file (under ``model``, with objects), and as DCP; a reference."""
    out = tmp_path_factory.mktemp("first_load")
    g = torch.Generator().manual_seed(45)
    sd: dict[str, Any] = {
        "w": torch.randn(33, 17, generator=g),
        "b": torch.randn(17, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "scale": torch.tensor(0.25),
        "empty": torch.zeros(0, 3),
    }
    torch.save(sd, out / "reference.pt")
    save_file(sd, out / "model.safetensors")
    torch.save({"model": sd, "step": 7, "note": "first"}, out / "train.pt")
    dcp.save(sd, checkpoint_id=out / "dcp")
    v = torch.arange(4, dtype=torch.float32)
    save_file({"tie_a": v, "same": v.clone(), "other": v + 1}, out / "tied.safetensors")
    return out


def _child(mode: str, folder: Path) -> dict[str, list[Any]]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(folder)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, list[Any]] = json.loads(line.removeprefix("RESULT "))
    return result


def _digest(sd: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            raw = bytes(v.contiguous().view(-1).view(torch.uint8).numpy()) if v.numel() else b""
            out[k] = [str(v.dtype), list(v.shape), hashlib.sha256(raw).hexdigest()]
        elif isinstance(v, dict):
            out[k] = _digest(v)
        else:
            out[k] = repr(v)
    return out


def test_plain_loads_import_no_dcp_and_match_dcp_planned_ones(folder: Path) -> None:
    plain = _child("plain", folder)
    planned = _child("dcp-first", folder)
    ref = _digest(torch.load(folder / "reference.pt", weights_only=True))
    # no DCP, until the DCP checkpoint (the last load) needs it
    assert [plain[name][-1] for name in PLAIN] == [False] * len(PLAIN)
    assert plain["dcp"][-1] is True
    # the same answers as the DCP-planned loads, word for word
    for name in [*PLAIN, "dcp"]:
        assert plain[name][:-1] == planned[name][:-1], name
    # and the right ones, bit for bit
    assert plain["safetensors"][:2] == ["ok", [ref, [], {}, [], ""]]
    assert plain["torch.save under a prefix"][1] == [ref, [], {}, [], "model"]
    assert plain["dcp"][1] == [ref, [], {}, [], ""]
    assert plain["aload"][1] == plain["start_load"][1] == ref
    assert plain["partial"][1][1] == ["nope"]
    assert plain["missing key"][:2] == ["error", "StateDictMismatchError"]
    assert "'nope'" in plain["missing key"][2]
    assert plain["missing key, a close one"][:2] == ["error", "StateDictMismatchError"]
    assert "'steps'" in plain["missing key, a close one"][2]
    assert plain["shape"][:2] == ["error", "StateDictMismatchError"]
    assert plain["narrowing cast"][0] == "error"
    assert plain["widening"][1][0]["w"][0] == "torch.float64"
    assert plain["tied, one saved"][1][2] == {"tie_b": "tie_a"}
    assert plain["tied, same values"][1][2] == {"tie_a": "same"}
    assert plain["tied, other values"][:2] == ["error", "StateDictMismatchError"]
    assert plain["object under a tensor"][:2] == ["error", "StateDictMismatchError"]
    assert plain["read_state_dict safetensors"][1] == ref
    saved = {"model": ref, "step": "7", "note": "'first'"}
    assert plain["read_state_dict torch.save"][1] == saved
    assert plain["read_state_dict keys"][1] == {"model": {"w": ref["w"]}, "step": "7"}


def test_a_load_into_cpu_memory_imports_no_device_path(tmp_path: Path) -> None:
    """The device path (``engine/cuda_ring``: pinned ring, side stream) is imported only where
    a load can use it (a CUDA destination, a copier given or set): a load of a safetensors
    file into CPU tensors in a fresh process imports none of it, and loads bit for bit."""
    ref = {"w": torch.randn(33, 17), "b": torch.arange(7, dtype=torch.int64)}
    save_file(ref, str(tmp_path / "model.safetensors"))
    code = (
        "import sys, torch, asyncload; "
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True); "
        "d = {k: torch.zeros_like(v) for k, v in ref.items()}; "
        f"asyncload.load(d, {str(tmp_path / 'model.safetensors')!r}); "
        "print(all(torch.equal(d[k].view(torch.uint8), ref[k].view(torch.uint8)) for k in ref), "
        "'asyncload.engine.cuda_ring' in sys.modules)"
    )
    torch.save(ref, str(tmp_path / "ref.pt"))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["True", "False"], (out.stdout, out.stderr)


ARCHIVE_CHILD = r"""
import hashlib, json, sys
import torch
import asyncload
folder = sys.argv[1]
HEAVY = ["asyncload.formats.archive", "asyncload.formats.torchsave", "asyncload.formats.dcpv2",
         "asyncload.decoding", "asyncload.engine.streamed", "torch.distributed.checkpoint"]
ref = torch.load(f"{folder}/reference.pt", weights_only=True)
seen, digests = {}, {}
def digest(v):
    raw = bytes(v.contiguous().view(-1).view(torch.uint8).numpy()) if v.numel() else b""
    return [str(v.dtype), list(v.shape), hashlib.sha256(raw).hexdigest()]
def step(name, fn):
    got = fn()
    digests[name] = {k: digest(v) for k, v in got.items() if isinstance(v, torch.Tensor)}
    seen[name] = [m for m in HEAVY if m in sys.modules]
st = f"{folder}/model.safetensors"
def load():
    dest = {k: torch.zeros_like(v) for k, v in ref.items()}
    asyncload.load(dest, st)
    return dest
step("load", load)
step("read_state_dict", lambda: asyncload.read_state_dict(st))
def opened():
    with asyncload.safe_open(st, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
step("safe_open", opened)
step("iter_tensors", lambda: dict(asyncload.iter_tensors(st)))
step("torch.save", lambda: asyncload.read_state_dict(f"{folder}/train.pt")["model"])
print("RESULT " + json.dumps([seen, digests]))
"""


def test_a_safetensors_load_imports_no_archive_parser(folder: Path) -> None:
    """A safetensors file loaded by each face in a fresh process imports neither DCP nor
    the torch.save archive parser (formats.archive/torchsave/dcpv2, the pickle decoder,
    engine.streamed): a first load's imports are its format's own. A torch.save file
    afterwards imports the parser (not DCP); every face gives the saved tensors bit for bit."""
    out = subprocess.run(
        [sys.executable, "-c", ARCHIVE_CHILD, str(folder)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    seen, digests = json.loads(line.removeprefix("RESULT "))
    for face in ("load", "read_state_dict", "safe_open", "iter_tensors"):
        assert seen[face] == [], face
    assert seen["torch.save"] == [
        "asyncload.formats.archive",
        "asyncload.formats.torchsave",
        "asyncload.decoding",
    ]
    want = _digest(torch.load(folder / "reference.pt", weights_only=True))
    for face in ("load", "read_state_dict", "safe_open", "iter_tensors", "torch.save"):
        assert digests[face] == want, face
