#!/usr/bin/env bash
# The main job: set-up, then the demo: makes a ~1 GiB transformer-like checkpoint with
# dcp.save, loads it with torch's readers and with asyncload, locally and from an S3-protocol
# server on loopback, and prints the comparison. Cleans up after itself.
#
# Set-up installs only what the demo runs: a .venv with torch (the CPU build) and numpy, then
# this project with its `demo` extra (s3fs for torch's FsspecReader, moto's S3 server), not
# the test and lint extras (scripts/setup.sh adds those to the same .venv). A .venv that
# already has them is used as it is. Every step says what it does, and a step that runs long
# says so every 10 seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '[demo %3d s] %s\n' "$SECONDS" "$*"; }

# `still WHAT CMD...`: run CMD, saying every 10 s that WHAT is still going; CMD's status.
still() {
  local what=$1 pid rc=0 n=0
  shift
  "$@" &
  pid=$!
  trap 'kill "$pid" 2>/dev/null; exit 130' INT TERM
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ $((n % 10)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then
      step "... still $what"
    fi
  done
  wait "$pid" || rc=$?
  trap - INT TERM
  return "$rc"
}

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && .venv/bin/python -c "import asyncload, s3fs, moto" >/dev/null 2>&1; then
  step "set-up: .venv already has torch, asyncload, s3fs and moto"
  . .venv/bin/activate
else
  if [ ! -x .venv/bin/python ]; then
    step "set-up: creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
  fi
  . .venv/bin/activate
  . scripts/_venv.sh
  step "set-up: installing torch 2.13.0 (CPU build) and numpy into .venv"
  still "installing torch" install_torch
  step "set-up: installing asyncload with its demo extra (s3fs, moto's S3 server)"
  # the build backend inherits PYTHONWARNINGS: setuptools' "Editable installation" notice
  # (a BuildBackendWarning) is advice for people, not an error
  PYTHONWARNINGS="ignore:Editable installation" still "installing asyncload[demo]" pip_install -e ".[demo]"
  python -c "import asyncload, s3fs, moto" >/dev/null
  step "set-up: done"
fi
export PYTHONUNBUFFERED=1
step "running examples/demo.py $*"
python examples/demo.py "$@"
