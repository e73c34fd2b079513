"""Tests that need torchtitan: run in .venv-titan (scripts/setup_titan.sh) by scripts/test.sh.

The main suite does not collect this folder (``norecursedirs`` in pyproject.toml); asked for
explicitly (``pytest tests/titan``) without torchtitan installed, the import below fails the
run: a broken titan environment never passes as skipped tests.

``titan_pg`` (session, autouse): a one-rank gloo process group, as torchtitan's trainer has
(its checkpoint manager asks ``dist.get_rank()``; DCP saves and loads run collectives on it).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch.distributed as dist

with warnings.catch_warnings():
    # torchtitan's attention module compiles FlexAttention at import, which imports torch's
    # inductor, which defines TorchScript modules: torch's own deprecation, once per process
    warnings.filterwarnings(
        "ignore", r"`torch.jit.script_method` is deprecated", DeprecationWarning
    )
    # fails the titan run when torchtitan is missing
    import torchtitan.models.llama3  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def titan_pg() -> Iterator[None]:
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
