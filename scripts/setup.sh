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

. scripts/_venv.sh
install_torch
# the build backend inherits PYTHONWARNINGS: setuptools' "Editable installation" notice
# (a BuildBackendWarning) is advice for people, not an error
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[test,lint]"
python -c "import asyncload, s3fs, gcsfs, moto, pytest_asyncio" >/dev/null
