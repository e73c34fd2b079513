"""Tests that need vLLM: run in .venv-vllm (scripts/setup_vllm.sh) by scripts/test.sh.

The main suite does not collect this folder (``norecursedirs`` in pyproject.toml); asked for
explicitly (``pytest tests/vllm``) without vLLM installed, the import below fails the run: a
broken vLLM environment never passes as skipped tests.

vLLM itself runs in child processes (``_child.py``: a fresh interpreter per group of runs, as
a server starts); the tests here compare what they print. ``VLLM_ENV`` is their environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncload.testing import TEST_ENV

with warnings.catch_warnings():
    # vLLM's model loader compiles ops at import, which imports torch's inductor, which defines
    # TorchScript modules: torch's own deprecation, once per process (and torch's FutureWarnings)
    warnings.filterwarnings(
        "ignore", r"`torch.jit.script_method` is deprecated", DeprecationWarning
    )
    warnings.filterwarnings("ignore", category=FutureWarning)
    # fails the vLLM run when vLLM is missing
    import vllm.config.load
    import vllm.model_executor.model_loader
    import vllm.model_executor.model_loader.weight_utils
    import vllm.plugins  # noqa: F401

HERE = Path(__file__).resolve().parent

#: The environment of every vLLM process of these tests (../shared/TESTBED.md): loopback only,
#: no telemetry, no hub, a 1 GiB KV cache; the test S3 credentials; parameters returned by
#: ``LLM.apply_model`` from the engine core process (pickled functions).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    **TEST_ENV,
}


@pytest.fixture(scope="session", autouse=True)
def vllm_env() -> Iterator[None]:
    """``VLLM_ENV`` in this process too (the loader tests build vLLM objects here)."""
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_vllm(specs: list[dict[str, Any]], *, multiprocess: bool = False) -> list[dict[str, Any]]:
    """Run ``specs`` (see ``_child.py``) in one fresh process; their results, in order.
    ``multiprocess``: vLLM's default mode (engine core and worker in their own processes,
    the loader found through the entry point there); else everything in the child."""
    env = {**os.environ, **VLLM_ENV}
    env.pop("VLLM_PLUGINS", None)
    if multiprocess:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_child.py"), json.dumps(specs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    results = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    if proc.returncode != 0 or len(results) != len(specs):
        raise AssertionError(
            f"vLLM child exited {proc.returncode} with {len(results)}/{len(specs)} results:\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    for result in results:
        result["log"] = proc.stdout + proc.stderr
    return results


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, one ``model.safetensors``."""
    from asyncload.testing.tiny_llama import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "single")


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights in shards of at most 3 MB with ``model.safetensors.index.json``."""
    from asyncload.testing.tiny_llama import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "sharded", max_shard_size="3MB")
