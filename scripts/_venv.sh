# Sourced by scripts/setup.sh, setup_titan.sh and setup_vllm.sh, inside the virtual environment
# they made and activated: what they all run.

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

# The separate environments (.venv-titan, .venv-vllm) record what they were built from in
# DIR/.built-from: a hash of pyproject.toml, their set-up script and this file.
# `venv_current DIR SCRIPT IMPORTS`: DIR was built from the same files and IMPORTS still import
# (then a set-up run has nothing to do). `venv_stamp DIR SCRIPT`: record it after a build.
venv_fingerprint() {
  cat pyproject.toml "$1" scripts/_venv.sh | sha256sum | cut -d' ' -f1
}
venv_current() {
  [ "$(cat "$1/.built-from" 2>/dev/null)" = "$(venv_fingerprint "$2")" ] \
    && python -c "$3" >/dev/null 2>&1
}
venv_stamp() {
  venv_fingerprint "$2" >"$1/.built-from"
}
