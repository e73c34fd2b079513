#!/usr/bin/env bash
# Set-up on a fresh machine: a virtual environment in .venv with torch (CPU build, pinned
# first so pip never pulls a CUDA build) and numpy, then this project with its test and
# lint extras. Quiet: prints nothing but errors (and exits non-zero on them).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate

# `pip install -q ARGS...`, keeping pip's exit status and its errors, without the notes
# pip prints when a configured local index folder does not exist on this machine.
pip_install() {
  local out rc=0
  out=$(python -m pip install -q "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "is ignored: it is neither a file nor a directory" -e '^$' >&2 || true
  return "$rc"
}

python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# numpy in the same call: torch warns "Failed to initialize NumPy" when imported without it
pip_install "torch==2.13.0" numpy
python -c "import torch" >/dev/null
# the build backend inherits PYTHONWARNINGS: setuptools' "Editable installation" notice
# (a BuildBackendWarning) is advice for people, not an error
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[test,lint]"
python -c "import asyncload, s3fs, gcsfs, moto, pytest_asyncio" >/dev/null
