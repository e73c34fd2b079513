"""``load_format="asyncload"`` in vLLM: the same greedy tokens and, bit for bit, the same
parameters as vLLM's own ``load_format="safetensors"``, from local disk (one file, shards with
an index) and from an S3 server on loopback; bad configuration named at start.

All in-process runs share one child process (``runs``, one vLLM start each); one test runs
vLLM's default multiprocess mode, where the engine core finds the loader through the entry
point.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_vllm

from asyncload.testing import S3Server, free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(
    s3_server: S3Server,
    tiny_llama: Path,
    tiny_llama_sharded: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """Every in-process run, by name, made in one child process."""
    opts = s3_server.storage_options()
    sharded_url = s3_server.upload_dir(tiny_llama_sharded, "vllm-sharded", "llama")
    single_url = s3_server.upload_dir(tiny_llama, "vllm-single", "llama")
    # the sharded model with its second shard missing (the index still names it)
    broken = tmp_path_factory.mktemp("broken") / "llama"
    shutil.copytree(tiny_llama_sharded, broken)
    shards = sorted(broken.glob("model-*.safetensors"))
    assert len(shards) >= 3, shards
    shards[1].unlink()
    broken_url = s3_server.upload_dir(broken, "vllm-broken", "llama")

    single, sharded = str(tiny_llama), str(tiny_llama_sharded)
    specs: dict[str, dict[str, Any]] = {
        "reference": {"model": single, "load_format": "safetensors"},
        "local": {"model": single, "load_format": "asyncload"},
        "local_sharded": {"model": sharded, "load_format": "asyncload"},
        "s3_sharded": {
            "model": sharded,
            "load_format": "asyncload",
            "extra": {"url": sharded_url + "/", "storage_options": opts},
        },
        "s3_single": {
            "model": single,
            "load_format": "asyncload",
            "extra": {
                "url": single_url,
                "storage_options": opts,
                "options": {"concurrency": 4, "transport": "fsspec"},
            },
        },
        "unknown_key": {
            "model": single,
            "load_format": "asyncload",
            "extra": {"uri": sharded_url},
        },
        "unknown_option": {
            "model": single,
            "load_format": "asyncload",
            "extra": {"options": {"concurency": 4}},
        },
        "missing_shard": {
            "model": sharded,
            "load_format": "asyncload",
            "extra": {"url": broken_url, "storage_options": opts},
        },
        "unreachable": {
            "model": single,
            "load_format": "asyncload",
            "extra": {
                "url": f"http://127.0.0.1:{free_port()}/llama/",
                "options": {"retries": 1, "backoff": 0.01},
            },
        },
    }
    return dict(zip(specs, run_vllm(list(specs.values())), strict=True))


def _same_as_reference(got: dict[str, Any], reference: dict[str, Any]) -> None:
    assert "error" not in got, got.get("message")
    assert "error" not in reference, reference.get("message")
    assert got["tokens"] == reference["tokens"]
    assert got["params"] == reference["params"]  # SHA-256 of every parameter's bytes


def test_reference_generates(runs: dict[str, dict[str, Any]]) -> None:
    ref = runs["reference"]
    assert "error" not in ref, ref.get("message")
    assert len(ref["params"]) > 4 * 9  # every layer's weights, embeddings, head
    # greedy tokens of a random model that vary: a test that can fail
    assert all(len(set(t)) > 2 for t in ref["tokens"]), ref["tokens"]


@pytest.mark.parametrize("name", ["local", "local_sharded", "s3_sharded", "s3_single"])
def test_same_tokens_and_parameters(runs: dict[str, dict[str, Any]], name: str) -> None:
    _same_as_reference(runs[name], runs["reference"])


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("unknown_key", "ValueError", ["model_loader_extra_config['uri']", "unknown key"]),
        (
            "unknown_option",
            "ValueError",
            ["model_loader_extra_config['options']['concurency']", "LoadOptions has no field"],
        ),
        (
            "missing_shard",
            "CheckpointNotFoundError",
            ['model_loader_extra_config["url"]', "s3://vllm-broken/llama", "model-00002-of-"],
        ),
        (
            "unreachable",
            "StorageReadError",
            ['model_loader_extra_config["url"]', "http://127.0.0.1:"],
        ),
    ],
)
def test_bad_configuration_is_named(
    runs: dict[str, dict[str, Any]], name: str, error: str, words: list[str]
) -> None:
    got = runs[name]
    assert got.get("error") == error, got
    for word in words:
        assert word in got["message"], got["message"]


def test_multiprocess_mode_through_the_entry_point(
    tiny_llama_sharded: Path, runs: dict[str, dict[str, Any]]
) -> None:
    """vLLM's default mode: the engine core is another process, which knows
    ``load_format="asyncload"`` only through the ``vllm.general_plugins`` entry point."""
    (got,) = run_vllm(
        [{"model": str(tiny_llama_sharded), "load_format": "asyncload"}], multiprocess=True
    )
    _same_as_reference(got, runs["reference"])
    registered = [
        line
        for line in got["log"].splitlines()
        if "EngineCore" in line and "AsyncLoadModelLoader" in line and "Registered" in line
    ]
    assert registered, got["log"][-3000:]


def test_example_runs() -> None:
    """examples/vllm_load.py as it is: vLLM's safetensors and asyncload, the same tokens."""
    import os
    import subprocess
    import sys

    from conftest import VLLM_ENV

    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, str(repo / "examples" / "vllm_load.py")],
        cwd=repo,
        env={**os.environ, **VLLM_ENV},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = {
        line.split(":", 1)[0]: line.split(":", 1)[1].strip()
        for line in res.stdout.splitlines()
        if line.startswith(("safetensors:", "asyncload:"))
    }
    assert lines["safetensors"] == lines["asyncload"] != "", res.stdout[-3000:]
