"""Every script in examples/ runs as it is (small sizes), and the demo cleans up after itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncload.testing import TEST_ENV

REPO = Path(__file__).resolve().parents[2]
# vllm_load.py needs vLLM: tests/vllm/test_vllm_generate.py runs it in .venv-vllm
EXAMPLES = sorted(
    p for p in (REPO / "examples").glob("*.py") if p.name not in ("demo.py", "vllm_load.py")
)


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TEST_ENV)
    env.update(
        {
            "ASYNCLOAD_EXAMPLE_SMALL": "1",
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(tmp),
            "PYTHONWARNINGS": "ignore::UserWarning",
        }
    )
    return env


def _tmpdir(tmp_path: Path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def _left_in(tmp: Path) -> list[str]:
    """What is left in TMPDIR, less torch's own compile caches (``torchinductor_<user>``)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_examples_are_there() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "resume_training.py",
        "load_from_s3.py",
        "background_load.py",
        "async_load.py",
    } <= names
    assert (REPO / "examples" / "demo.py").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path: Path) -> None:
    tmp = _tmpdir(tmp_path)
    res = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.stderr == ""  # quiet: no warnings, no tracebacks
    assert "Loaded " in res.stdout  # each prints the LoadStats of its load
    assert _left_in(tmp) == []  # temporary checkpoints removed


@pytest.mark.timeout(240)
def test_demo_small(tmp_path: Path) -> None:
    tmp = _tmpdir(tmp_path)
    res = subprocess.run(
        [sys.executable, "examples/demo.py", "--size-mib", "8", "--server", "moto"],
        cwd=REPO,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    out = res.stdout
    table = out[out.index("4. Results") :].splitlines()
    rows = [line.split() for line in table if line.startswith(("local ", "s3 "))]
    assert [r[:2] for r in rows] == [
        ["local", "torch"],
        ["local", "asyncload"],
        ["s3", "torch"],
        ["s3", "asyncload"],
    ]
    assert all(r[-3].endswith("x") for r in rows)
    assert "%|" not in res.stderr  # no progress bars when stderr is not a terminal
    assert "Warning" not in res.stderr  # quiet: no wall of warnings
    pid = int(re.search(r"S3Server \(pid (\d+)\)", out).group(1))
    assert _gone(pid)
    assert _left_in(tmp) == []


@pytest.mark.timeout(240)
def test_demo_cleans_up_on_ctrl_c(tmp_path: Path) -> None:
    tmp = _tmpdir(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "examples/demo.py",
            "--size-mib",
            "48",
            "--server",
            "moto",
            "--file-mib",
            "4",
        ],
        cwd=REPO,
        env=_env(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the server runs: the worst moment to be interrupted
            m = re.search(r"S3Server \(pid (\d+)\)", line)
            if m:
                pid = int(m.group(1))
                break
        assert pid is not None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted: cleaning up" in out
    assert "Traceback" not in err
    assert _gone(pid)
    assert _left_in(tmp) == []
