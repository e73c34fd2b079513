#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh, scripts/setup_titan.sh), then the whole test
# suite in .venv, then tests/titan (needs torchtitan, whose pins clash with .venv) in
# .venv-titan. Both always run; exits with the main suite's status when it failed, else
# with the titan run's. Extra arguments go to the main suite's pytest, e.g.
# `bash scripts/test.sh -k remote`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_titan.sh
export PYTHONUNBUFFERED=1
main=0
(. .venv/bin/activate && python -m pytest -q -p no:cacheprovider "$@") || main=$?
titan=0
(. .venv-titan/bin/activate && python -m pytest -q -p no:cacheprovider tests/titan) || titan=$?
if [ "$main" -ne 0 ]; then
  exit "$main"
fi
exit "$titan"
