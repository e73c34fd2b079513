#!/usr/bin/env bash
# Set-up of the torchtitan test environment: a virtual environment in .venv-titan (beside
# scripts/setup.sh's .venv, git-ignored) with torch (CPU build, pinned first so pip never
# pulls a CUDA build) and numpy, then this project with its test extra and torchtitan
# 0.3.0 in one resolve. A separate environment because torchtitan's `datasets` dependency
# caps fsspec (<=2026.2.0) below what the main suite runs s3fs/gcsfs against; here pip
# picks the s3fs/gcsfs that match that fsspec. tests/titan/ runs in it (scripts/test.sh).
# Quiet: prints nothing but errors (and exits non-zero on them).
# Idempotent: a second run with the same pyproject.toml and script only checks the imports
# (a stamp in .venv-titan records what it was built from).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-titan/bin/python ]; then
  "$PY" -m venv .venv-titan
fi
. .venv-titan/bin/activate
imports="import asyncload, torchtitan.models.llama3, torch_checkpointing, moto, defusedxml, pytest_asyncio"
. scripts/_venv.sh
if venv_current .venv-titan scripts/setup_titan.sh "$imports"; then
  exit 0
fi

install_torch
# torch stays the build installed above whatever torchtitan's dependencies ask for
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"
# the build backend inherits PYTHONWARNINGS: setuptools' "Editable installation" notice
# (a BuildBackendWarning) is advice for people, not an error
# triton: torchtitan's model code imports it (torchtitan does not declare it; on this CPU
# build it is only imported, never run)
PYTHONWARNINGS="ignore:Editable installation" pip_install -c "$constraints" \
  -e ".[test]" "torchtitan==0.3.0" "torch-checkpointing==0.1.1" "triton==3.8.0"
python -c "$imports" >/dev/null
venv_stamp .venv-titan scripts/setup_titan.sh
