"""transformers' checkpoints loaded by a fresh process that never imports DCP (issue 45, item 4).

A safetensors or torch.save load into plain tensors is planned by
:class:`~asyncload.faces.plain_planner.PlainLoadPlanner` without importing
``torch.distributed.checkpoint`` (tests/faces/test_first_load_imports.py counts the imports);
the other real-tool tests run in pytest processes that imported DCP long ago, so they never
took that path. Here a child process (the venv's python) loads, with ``asyncload.load`` and
``read_state_dict``, the tiny tied Llama of tests/engine/test_tied_partial.py (its
``CONFIG``) as transformers' ``save_pretrained`` writes it: one ``model.safetensors``,
sharded with ``max_shard_size`` and an index, and a ``pytorch_model.bin`` (torch.save).

transformers 5.23 imports ``torch.distributed.checkpoint`` when its model classes are
imported (``transformers.distributed.checkpoint``), and its ``save_pretrained`` no longer
takes ``safe_serialization`` (it always writes safetensors). So the child loads first, with
neither imported, into the model's own state dict as ``torch.save`` keeps it (its keys in
order, shapes, dtypes, the tied embeddings sharing one storage; every byte NaN before the
load), and says whether DCP was imported; then it imports transformers, runs a model on
the very tensors asyncload filled (``load_state_dict(assign=True)``) and compares them,
and the logits, with ``LlamaForCausalLM.from_pretrained``'s, bit for bit. The
``pytorch_model.bin`` is written as transformers 4's ``save_pretrained(safe_serialization=
False)`` wrote it: ``torch.save`` of the state dict without the tied key. Counted, not timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tied_partial import CONFIG, THROUGH, TIED, llama

pytestmark = pytest.mark.timeout(300)

CHILD = r"""
import json, sys
import torch
import asyncload

root, config = sys.argv[1], json.loads(sys.argv[2])
TIED, THROUGH = "lm_head.weight", "model.embed_tokens.weight"
CASES = {
    "safetensors": (f"{root}/single", f"{root}/single"),
    "safetensors-sharded": (f"{root}/sharded", f"{root}/sharded"),
    "torch.save": (f"{root}/bin/pytorch_model.bin", f"{root}/bin"),
}

# phase 1: the loads, transformers and DCP not imported
loaded = {}
for name, (path, _) in CASES.items():
    dest = torch.load(f"{root}/dest.pt", weights_only=True)
    for v in dest.values():
        v.fill_(float("nan"))  # every byte must come from the load
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    stats = asyncload.load(dest, path)
    loaded[name] = (dest, ptrs, stats, asyncload.read_state_dict(path))
verdict = {
    "dcp after the loads": "torch.distributed.checkpoint" in sys.modules,
    "asyncload's DCP reader after the loads": "asyncload.faces.dcp_reader" in sys.modules,
    "transformers during the loads": "transformers" in sys.modules,
}

# phase 2: transformers' own loader, and a model run on what asyncload loaded
from transformers import LlamaConfig, LlamaForCausalLM

verdict["dcp after importing transformers"] = "torch.distributed.checkpoint" in sys.modules
ids = torch.arange(12).reshape(2, 6) * 7 % config["vocab_size"]

def logits(model):
    with torch.no_grad():
        return model(input_ids=ids).logits

def raw(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)

def differing(got, want):
    return sorted(
        k for k in want
        if k not in got or got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
        or not torch.equal(raw(got[k]), raw(want[k]))
    )

def run_on(sd):
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.eval()
    model.load_state_dict(sd, assign=True)  # the model's parameters are these tensors
    return model

cases = {}
for name, (_, folder) in CASES.items():
    ref = LlamaForCausalLM.from_pretrained(folder)
    ref.eval()
    want = ref.state_dict()
    want_logits = logits(ref)
    dest, ptrs, stats, read = loaded[name]
    model = run_on(dest)
    got = model.state_dict()
    full = dict(read)
    full[TIED] = read[THROUGH]  # the file holds the tied weight once, as transformers saves it
    read_model = run_on(full)
    cases[name] = {
        "load": {
            "keys in order": list(dest) == list(want),
            "differing": differing(dest, want),
            "model runs on the loaded memory": {k: v.data_ptr() for k, v in got.items()} == ptrs,
            "still tied": dest[TIED].data_ptr() == dest[THROUGH].data_ptr(),
            "logits equal": torch.equal(raw(logits(model)), raw(want_logits)),
            "tied_keys": stats.tied_keys,
            "missing_keys": stats.missing_keys,
            "unexpected_keys": stats.unexpected_keys,
        },
        "read_state_dict": {
            "keys": sorted(read),
            "differing": differing(read, {k: want[k] for k in read}),
            "logits equal": torch.equal(raw(logits(read_model)), raw(want_logits)),
        },
    }
verdict["cases"] = cases
print("VERDICT " + json.dumps(verdict))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The tied Llama (seed 0) as ``save_pretrained`` writes it, one file and sharded; as a
    ``pytorch_model.bin``; and ``dest.pt``: another one's state dict (seed 5), the
    destination's layout. Returns the folder and the model's keys."""
    root = tmp_path_factory.mktemp("hf_first_load")
    model = llama(0)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 1
    model.save_pretrained(root / "bin")
    (root / "bin" / "model.safetensors").unlink()
    sd = model.state_dict()
    torch.save({k: v for k, v in sd.items() if k != TIED}, root / "bin" / "pytorch_model.bin")
    torch.save(llama(5).state_dict(), root / "dest.pt")
    return root, list(sd)


def test_transformers_checkpoints_load_without_dcp_bit_for_bit(
    saved: tuple[Path, list[str]],
) -> None:
    root, keys = saved
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps(CONFIG)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("VERDICT "))
    verdict: dict[str, Any] = json.loads(line.removeprefix("VERDICT "))
    # the loads took the plain path: neither DCP nor asyncload's DCP reader was imported
    assert verdict["dcp after the loads"] is False
    assert verdict["asyncload's DCP reader after the loads"] is False
    assert verdict["transformers during the loads"] is False
    # why the loads come first: transformers' model classes import DCP themselves
    assert verdict["dcp after importing transformers"] is True
    saved_keys = sorted(k for k in keys if k != TIED)
    loaded = {
        "keys in order": True,
        "differing": [],
        "model runs on the loaded memory": True,
        "still tied": True,
        "logits equal": True,
        "tied_keys": {TIED: THROUGH},
        "missing_keys": [],
        "unexpected_keys": [],
    }
    read = {"keys": saved_keys, "differing": [], "logits equal": True}
    assert verdict["cases"] == {
        name: {"load": loaded, "read_state_dict": read}
        for name in ("safetensors", "safetensors-sharded", "torch.save")
    }
