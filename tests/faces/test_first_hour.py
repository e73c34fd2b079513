"""What a new user meets first (issue 26): errors that point at the fix, the CLI's fair
``--compare-torch``, ``convert``'s permissions, and the small edges of the API
(``LoadHandle.progress`` and ``repr``, the file count, ``load`` on a running loop).

CLI behaviour is checked by running the real command in a subprocess, as tests/faces/test_cli.py does."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _ckpt import make_checkpoint

import asyncload
from asyncload import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    LoadCancelledError,
    LoadOptions,
    StorageReadError,
)
from asyncload.testing import TEST_ENV, free_port, stall

# the same console entry point as the `asyncload` script, in a fresh interpreter
CLI = [sys.executable, "-c", "import sys; from asyncload.cli import main; sys.exit(main())"]


def _cli(*argv: str, umask: int = -1, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(TEST_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [*CLI, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        umask=umask,
        check=False,
    )


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("first-hour") / "ck"
    g = torch.Generator().manual_seed(26)
    sd = {"w": torch.randn(64, 32, generator=g), "b": torch.arange(32, dtype=torch.int64)}
    make_checkpoint(root, sd)
    return root, sd


# --- a store nobody answers at: "could not connect", fast -------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["fsspec", "wire"])
def test_a_closed_endpoint_says_could_not_connect_after_two_attempts(transport: str) -> None:
    port = free_port()  # nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.raises(StorageReadError) as info:
        asyncload.load(
            {"w": torch.zeros(4)},
            "s3://bucket/ck",
            options=LoadOptions(transport=transport, retries=4),
            storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"},
        )
    err = info.value
    msg = str(err)
    assert type(err) is StorageReadError
    assert err.attempts == 2  # one retry, whatever LoadOptions.retries says
    assert msg.startswith(f"could not connect to {endpoint} (connection refused")
    assert "to read s3://bucket/ck/.metadata after 2 attempts" in msg
    assert (
        "storage_options endpoint_url" in msg
        and "asyncload docs: Errors > StorageReadError" in msg
    )
    assert "Debug source" not in msg and "raise LoadOptions.retries" not in msg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["fsspec", "wire"])
def test_cli_closed_endpoint_one_sentence(transport: str) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    res = _cli(
        "load", "s3://bucket/ck", "--transport", transport, "-o", f"endpoint_url={endpoint}", "-o", "key=k",
        "-o", "secret=s", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[-1].startswith(
        f"asyncload: error: could not connect to {endpoint} (connection refused"
    )
    assert "endpoint_url" in lines[-1] and "after 2 attempts" in lines[-1]
    assert "Debug source" not in res.stderr and "raise LoadOptions" not in res.stderr
    assert "Traceback" not in res.stderr


# --- paths that are not a checkpoint ------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_missing_directory_says_so_first_in_one_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "step-1"
    with pytest.raises(CheckpointNotFoundError) as info:
        asyncload.load({"w": torch.zeros(4)}, missing)
    err = info.value
    assert (
        str(err)
        == f"the checkpoint {missing} does not exist: no such file or directory (check the path)"
    )
    assert err.__cause__ is None and err.__suppress_context__  # nothing chained below it
    with pytest.raises(CheckpointNotFoundError, match="does not exist: no such file"):
        asyncload.read_state_dict(missing)


@pytest.mark.timeout(60)
def test_a_directory_without_metadata_chains_only_the_os_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        asyncload.load({"w": torch.zeros(4)}, tmp_path)
    err = info.value
    msg = str(err)
    assert msg.startswith(
        f"{tmp_path}/.metadata does not exist: {tmp_path} is not a DCP checkpoint"
    )
    assert "(asyncload docs: Formats)" in msg and "docs/formats.md" not in msg
    assert "rank-local" in msg and "__0.metadata" in msg
    assert type(err.__cause__) is FileNotFoundError and err.__cause__.__cause__ is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_file_of_a_dcp_checkpoint_asks_for_its_directory(small_ckpt, name: str) -> None:
    root, sd = small_ckpt
    with pytest.raises(CheckpointFormatError) as info:
        asyncload.load({k: torch.zeros_like(v) for k, v in sd.items()}, root / name)
    assert str(info.value) == (
        f"{root / name} is a file of a DCP checkpoint, not the checkpoint: pass the checkpoint directory "
        f"({root}) that holds it and the .metadata"
    )


@pytest.mark.timeout(180)
def test_cli_missing_directory_and_distcp_file(small_ckpt, tmp_path: Path) -> None:
    root, _ = small_ckpt
    res = _cli("load", str(tmp_path / "nope"), "--no-progress")
    assert res.returncode == 4
    assert res.stderr == (
        f"asyncload: error: the checkpoint {tmp_path / 'nope'} does not exist: no such file or directory "
        "(check the path) (--debug shows the traceback)\n"
    )
    res = _cli("inspect", str(root / "__0_0.distcp"))
    assert res.returncode == 3
    assert f"pass the checkpoint directory ({root})" in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.timeout(180)
def test_cli_unusable_storage_option_values_name_the_option() -> None:
    res = _cli("inspect", "s3://bucket/ck", "-o", "config_kwargs={max_pool_connections: 8}")
    assert res.returncode == 2
    assert res.stderr.startswith(
        "asyncload: error: --storage-option 'config_kwargs={max_pool_connections: 8}': "
        "the value of 'config_kwargs' is not valid JSON ("
    )
    res = _cli(
        "inspect", "s3://bucket/ck", "-o", "config_kwargs=[1]", "-o", f"endpoint_url=http://127.0.0.1:{free_port()}",
        "-o", "secret=hush",
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.startswith(
        "asyncload: error: the storage client refused a --storage-option value "
        "(given: config_kwargs, endpoint_url, secret): TypeError: "
    )
    assert "hush" not in res.stderr  # names, never values


# --- load --compare-torch and the printed time ----------------------------------------------


@pytest.mark.timeout(180)
def test_cli_compare_torch_is_quiet_and_says_how_it_timed(small_ckpt) -> None:
    root, _ = small_ckpt
    res = _cli("load", str(root), "--compare-torch", "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (
        out["identical"] is True
        and out["differing_keys"] == []
        and out["torch_reader"] == "FileSystemReader"
    )
    assert out["timing"] == (
        "both timed from the call to the end of the load (the .metadata read included), into destinations "
        "allocated before either clock, on a page cache warmed by reading the files once before"
    )
    assert (
        out["asyncload"]["seconds"] <= out["asyncload_seconds"]
    )  # the load's own clock is inside the CLI's
    assert out["asyncload"]["files"] == 2
    # torch's "loading in a single process" warning is printed nowhere
    assert "torch.distributed is disabled" not in res.stderr and "Warning" not in res.stderr
    assert res.stderr == f"asyncload: loading 8.25 KiB (2 tensors, 0 objects) from {root}\n"


def test_compare_torch_filter_is_narrow(small_ckpt) -> None:
    """The warning filter covers torch's call only: afterwards the filters are as before."""
    import warnings

    from asyncload.cli import load_with_torch

    root, sd = small_ckpt
    before = list(warnings.filters)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    load_with_torch(str(root), dest, {})
    assert warnings.filters == before
    for k, v in sd.items():
        assert dest[k].dtype == v.dtype and torch.equal(dest[k], v)


# --- the file count ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_inspect_and_stats_count_the_same_files(
    small_ckpt, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncload.cli import main

    root, sd = small_ckpt
    assert main(["inspect", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    stats = asyncload.load({k: torch.zeros_like(v) for k, v in sd.items()}, root)
    assert info["file_count"] == stats.files == 2  # .metadata and one data file
    assert [f["name"] for f in info["files"]] == ["__0_0.distcp"]
    assert "files        2 (.metadata and 1 data file), " in text


# --- convert respects the umask -------------------------------------------------------------


@pytest.mark.timeout(180)
def test_convert_output_follows_the_umask(small_ckpt, tmp_path: Path) -> None:
    root, sd = small_ckpt
    dst = tmp_path / "hf"
    res = _cli("convert", str(root), str(dst), "--no-progress", umask=0o027)
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(dst.stat().st_mode) == 0o750  # not mkdtemp's 0700
    assert [(p.name, stat.S_IMODE(p.stat().st_mode)) for p in dst.iterdir()] == [
        ("model.safetensors", 0o640)
    ]
    from safetensors.torch import load_file

    back = load_file(str(dst / "model.safetensors"))
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.partial-")]


# --- LoadHandle: progress before the metadata, repr ------------------------------------------


@pytest.mark.timeout(120)
def test_handle_progress_total_is_none_until_known_and_repr(
    small_ckpt, http_server, fault_proxy, bucket_name
) -> None:
    root, sd = small_ckpt
    http_server.upload_dir(root, bucket_name, "ck")
    proxy = fault_proxy(http_server)
    proxy.add_rule(stall(), path=".metadata", times=None)  # the metadata never arrives
    url = http_server.url(bucket_name, "ck", endpoint_url=proxy.endpoint_url)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    handle = asyncload.start_load(dest, url, options=LoadOptions(timeout=None))
    assert proxy.wait_for_requests(1, timeout=60)
    assert handle.progress == (0, None)
    assert repr(handle) == f"<LoadHandle {url} running, 0 B (total not known yet)>"
    assert handle.cancel()
    assert handle.wait(30)
    with pytest.raises(LoadCancelledError):
        handle.result(0)
    assert repr(handle) == f"<LoadHandle {url} cancelled, 0 B (total not known yet)>"

    handle = asyncload.start_load(dest, root)
    stats = handle.result(60)
    total = sum(v.numel() * v.element_size() for v in sd.values())
    assert handle.progress == (total, total) == (stats.bytes_assembled, stats.bytes_assembled)
    assert repr(handle) == f"<LoadHandle {root} done, 8.25 KiB of 8.25 KiB>"
    for k, v in sd.items():
        assert torch.equal(dest[k], v)

    handle = asyncload.start_load(dest, root / "missing")
    assert isinstance(handle.exception(60), CheckpointNotFoundError)
    assert (
        repr(handle)
        == f"<LoadHandle {root / 'missing'} failed: CheckpointNotFoundError, 0 B (total not known yet)>"
    )


# --- load on a thread that runs an event loop ------------------------------------------------


@pytest.mark.timeout(60)
def test_load_on_a_running_loop_logs_one_hint(small_ckpt, caplog, monkeypatch) -> None:
    from asyncload.faces import api as _api

    monkeypatch.setattr(_api, "_hinted", threading.Event())  # as in a fresh process
    root, sd = small_ckpt
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    caplog.set_level(logging.INFO, logger="asyncload")
    asyncload.load(dest, root)  # no loop here: no hint
    assert not [r for r in caplog.records if "aload" in r.getMessage()]

    async def main() -> None:
        asyncload.load(dest, root)
        asyncload.load(dest, root)

    asyncio.run(main())
    hints = [r for r in caplog.records if "event loop" in r.getMessage()]
    assert len(hints) == 1
    assert hints[0].levelno == logging.INFO and hints[0].name == "asyncload"
    assert hints[0].getMessage() == (
        "asyncload.load was called on a thread that runs an event loop: that loop is blocked until the load "
        "returns; use 'await asyncload.aload(...)' in async code to keep it running"
    )
    for k, v in sd.items():
        assert torch.equal(dest[k], v)


# --- the figures ---------------------------------------------------------------------------


def test_the_user_level_pipeline_figure_is_what_its_generator_draws() -> None:
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "draw_pipeline", repo / "benchmarks" / "draw_pipeline.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    committed = (repo / "docs" / "img" / "pipeline_user.svg").read_text()
    assert committed == mod.svg()
    for name in (
        "asyncload.load",
        "LoadOptions",
        "chunk_size",
        "concurrency",
        "memory_budget",
        "LoadStats",
    ):
        assert name in committed
    assert (
        "_session" not in committed and "Pipeline" not in committed
    )  # no private module or class names


def test_the_examples_table_lists_every_example_and_each_says_what_it_needs() -> None:
    import re

    repo = Path(__file__).resolve().parents[2]
    index = (repo / "docs" / "index.md").read_text()
    listed = set(re.findall(r"\(\.\./examples/([a-z0-9_]+\.py)\)", index))
    scripts = {p.name for p in (repo / "examples").glob("*.py")}
    assert listed == scripts
    for name in scripts:
        doc = (repo / "examples" / name).read_text().split('"""')[1]
        assert "Needs:" in doc, name
    s3 = (repo / "examples" / "load_from_s3.py").read_text()
    assert "moto" in s3.split('"""')[1] and "os.environ[" not in s3 and "configure_env" not in s3


def test_the_readme_layout_names_every_module() -> None:
    repo = Path(__file__).resolve().parents[2]
    layout = (repo / "README.md").read_text().split("## Layout", 1)[1]
    modules = {p.stem for p in (repo / "asyncload").glob("*.py")} - {"__init__", "__main__"}
    assert sorted(m for m in modules if m not in layout) == []
    for wing in ("engine", "storage", "distributed", "decoding", "formats", "faces", "common"):
        names = {p.stem for p in (repo / "asyncload" / wing).glob("*.py")} - {"__init__"}
        assert sorted(m for m in names if m not in layout) == [], wing
    for folder in (
        "engine/",
        "storage/",
        "distributed/",
        "decoding/",
        "formats/",
        "faces/",
        "common/",
        "testing/",
        "tests/",
        "benchmarks/",
        "examples/",
        "docs/",
        "scripts/",
    ):
        assert folder in layout


def test_the_demo_installs_only_what_it_runs() -> None:
    """Issue 44: the demo built a 1.6 GB .venv with the test and lint extras it never used.
    scripts/demo.sh installs torch and this project with its ``demo`` extra only (or uses a
    .venv that has them), says what each set-up step does, and keeps a long one from being
    silent; the ``demo`` extra holds what examples/demo.py imports beyond the core."""
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    script = (repo / "scripts" / "demo.sh").read_text()
    installs = [line.strip() for line in script.splitlines() if "pip_install" in line]
    assert installs == [
        'PYTHONWARNINGS="ignore:Editable installation" still "installing asyncload[demo]" '
        'pip_install -e ".[demo]"'
    ]
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert "setup.sh" not in code and "test" not in code and "lint" not in code
    assert 'still "installing torch" install_torch' in script
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert sorted(extras["demo"]) == ["moto[server]>=5.0", "s3fs>=2024.6.0"]
    # what the demo and the servers it starts import, beyond torch and the core dependencies
    demo = (repo / "examples" / "demo.py").read_text()
    assert "import s3fs" not in demo and "FsspecReader" in demo  # s3fs, through torch's reader


def test_the_demo_shell_script_says_a_long_step_is_still_going(tmp_path: Path) -> None:
    """``still WHAT CMD`` of scripts/demo.sh, run on a 12 s step: one "... still" line after
    10 s, and the step's exit status kept."""
    repo = Path(__file__).resolve().parents[2]
    script = (repo / "scripts" / "demo.sh").read_text()
    funcs = script[script.index("step() {") : script.index("PY=${PYTHON")]
    res = subprocess.run(
        [
            "bash",
            "-c",
            f"set -euo pipefail\n{funcs}\nslow() {{ sleep 11; return 3; }}\n"
            'still "sleeping" slow || echo "status $?"',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and lines[0].endswith("] ... still sleeping"), res
    assert lines[1] == "status 3"


def _install_block(page: Path, heading: str) -> list[str]:
    """The ``pip install`` lines of the first ```bash block under ``heading``, comments removed."""
    section = page.read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [
        line.split(" #", 1)[0].strip() for line in block.splitlines() if line.startswith("pip ")
    ]


def test_first_hour_installs_what_the_readme_says() -> None:
    """Issue 44: scripts/first_hour.sh (run by .ci/run after the tests) replays the README's
    Install lines in a fresh venv; what it runs is those lines with ``-q``, and the quickstart
    gives the same two."""
    repo = Path(__file__).resolve().parents[2]
    readme = _install_block(repo / "README.md", "## Install")
    assert readme == ['pip install "torch==2.13.0"', 'pip install ".[s3,gcs,http,fast]"']
    assert _install_block(repo / "docs" / "quickstart.md", "## Install") == readme
    res = subprocess.run(
        ["bash", str(repo / "scripts" / "first_hour.sh"), "--print-install"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert res.stdout.splitlines() == [
        line.replace("pip install ", "pip install -q ", 1) for line in readme
    ]
    ci = (repo / ".ci" / "run").read_text()
    assert ci.index("bash scripts/test.sh") < ci.index("bash scripts/first_hour.sh")
