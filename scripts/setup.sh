#!/usr/bin/env bash
# Set-up on a fresh machine: a virtual environment in .venv with torch (CPU build, pinned
# first so pip never pulls a CUDA build), then this project with its test extras.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
python -c "import torch" >/dev/null
python -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
python -c "import asyncload, s3fs, gcsfs, moto, pytest_asyncio" >/dev/null
