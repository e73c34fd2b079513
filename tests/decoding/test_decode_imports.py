"""Decoding a torch.save file's pickle imports no ``torch.distributed.checkpoint`` (issue 45,
item 4, the decoding wing's part): DCP's dataclasses are looked up only when a pickle names
one, and then decode as before. Counted in a fresh process, not timed.
"""

from __future__ import annotations

import collections
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties

pytestmark = pytest.mark.timeout(120)

CHILD = r"""
import pickle, sys, zipfile
import torch
from asyncload.decoding.allowlist import record_globals, safe_loads, storage_persistent_load

def decode(data, what):
    return safe_loads(data, what=what, allowed=record_globals(),
                      persistent_load=storage_persistent_load, safe_globals=())

pt, dcp_pickle = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(pt) as z:
    data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
obj = decode(data, pt)
print("after torch.save:", "torch.distributed.checkpoint" in sys.modules)
print("model:", sorted(obj["model"]), obj["model"]._metadata[""]["version"])
print("rng:", obj["rng"][0], obj["rng"][1][:3].tolist(), "step:", obj["step"])
# refused names still refused (and still no DCP)
try:
    decode(pickle.dumps({"args": __import__("argparse").Namespace(a=1)}, protocol=2), "ns.pkl")
except Exception as e:
    print("refused:", type(e).__name__, "torch.distributed.checkpoint" in sys.modules)
# a record naming a DCP dataclass: DCP imported on demand, decoded as before
with open(dcp_pickle, "rb") as f:
    props = decode(f.read(), "props.pkl")["p"]
print("after a DCP class:", "torch.distributed.checkpoint" in sys.modules,
      type(props).__name__, props.dtype, props.requires_grad)
"""


def test_torch_save_pickle_decodes_without_dcp(tmp_path: Path) -> None:
    pt = tmp_path / "ckpt.pt"
    model = torch.nn.Linear(3, 2)
    torch.save(
        {
            "model": model.state_dict(),
            "rng": np.random.RandomState(0).get_state(),
            "step": 7,
            "order": collections.OrderedDict(a=1),
        },
        pt,
    )
    props = tmp_path / "props.pkl"
    props.write_bytes(
        pickle.dumps({"p": TensorProperties(dtype=torch.bfloat16, requires_grad=True)}, protocol=2)
    )
    with zipfile.ZipFile(pt) as z:
        assert any(n.endswith("data.pkl") for n in z.namelist())
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(pt), str(props)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert lines == [
        "after torch.save: False",
        "model: ['bias', 'weight'] 1",
        f"rng: MT19937 {np.random.RandomState(0).get_state()[1][:3].tolist()} step: 7",
        "refused: UnsafeCheckpointError False",
        "after a DCP class: True TensorProperties torch.bfloat16 True",
    ], out.stderr
