#!/usr/bin/env bash
# The main job: set-up (scripts/setup.sh), then the demo: makes a ~1 GiB transformer-like
# checkpoint with dcp.save, loads it with torch's readers and with asyncload, locally and
# from an S3-protocol server on loopback, and prints the comparison. Cleans up after itself.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1
python examples/demo.py "$@"
