"""asyncload.integrations: nothing imported at ``import asyncload``; without the framework,
importing its module says what to install. (The torchtitan integration's own tests are in
tests/titan/, run in .venv-titan by scripts/test.sh.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_import_asyncload_imports_no_integration() -> None:
    done = _run(
        "import sys, asyncload, asyncload.integrations\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torchtitan', 'asyncload.integrations.'))))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_torchtitan_integration_without_torchtitan_names_it() -> None:
    done = _run("import asyncload.integrations.torchtitan")
    if importlib.util.find_spec("torchtitan") is not None:  # an environment with torchtitan
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 1
    assert done.stderr.rstrip().endswith(
        "ModuleNotFoundError: asyncload.integrations.torchtitan needs torchtitan, which is not installed "
        "(tested with torchtitan 0.3.0: pip install torchtitan==0.3.0)"
    ), done.stderr
