#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh, scripts/setup_servers.sh: nginx, openssl and
# s3rver for the conformance matrix, scripts/setup_titan.sh, scripts/setup_vllm.sh),
# then the whole test suite in .venv, then tests/titan (needs torchtitan, whose pins clash
# with .venv) in .venv-titan, then tests/vllm (needs vLLM's CPU build) in .venv-vllm. All
# always run; exits with the first failed run's status (main, titan, vllm), else 0. Extra
# arguments go to the main suite's pytest, e.g.
# `bash scripts/test.sh -k remote`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_servers.sh
bash scripts/setup_titan.sh
bash scripts/setup_vllm.sh
export PYTHONUNBUFFERED=1
main=0
(. .venv/bin/activate && python -m pytest -q -p no:cacheprovider "$@") || main=$?
titan=0
(. .venv-titan/bin/activate && python -m pytest -q -p no:cacheprovider tests/titan) || titan=$?
vllm=0
(. .venv-vllm/bin/activate && python -m pytest -q -p no:cacheprovider tests/vllm) || vllm=$?
if [ "$main" -ne 0 ]; then
  exit "$main"
fi
if [ "$titan" -ne 0 ]; then
  exit "$titan"
fi
exit "$vllm"
