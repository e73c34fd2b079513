#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), then the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k remote`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1
python -m pytest -q -p no:cacheprovider "$@"
