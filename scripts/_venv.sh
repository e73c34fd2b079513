# Sourced by scripts/setup.sh and scripts/setup_titan.sh, inside the virtual environment they
# made and activated: what both run.

# `pip install -q ARGS...`, keeping pip's exit status and its errors, without the notes
# pip prints when a configured local index folder does not exist on this machine.
pip_install() {
  local out rc=0
  out=$(python -m pip install -q "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "is ignored: it is neither a file nor a directory" -e '^$' >&2 || true
  return "$rc"
}

# pip itself, then torch (the CPU build, pinned first so pip never pulls a CUDA build) and
# numpy in the same call: torch warns "Failed to initialize NumPy" when imported without it
install_torch() {
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  pip_install "torch==2.13.0" numpy
  python -c "import torch" >/dev/null
}
