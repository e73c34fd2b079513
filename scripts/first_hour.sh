#!/usr/bin/env bash
# A new user's first hour (issue 44), replayed from a clean clone of the committed tree
# (HEAD: uncommitted changes of a local working tree are not in it) in a fresh virtual
# environment, by .ci/run after the tests:
#   1. install: the README's Install lines, exactly as the README gives them (read from its
#      "## Install" block, so the two cannot drift), with -q, into a fresh venv;
#   2. use: `import asyncload`, save a small DCP checkpoint with torch, load it, bit for bit;
#   3. demo: `bash scripts/demo.sh` in the clone, building its own fresh .venv as a new user's
#      first run does, at full size, timed; fails past 300 s;
#   4. a summary: each step's seconds, the machine's cores and load average.
# pip's cache is used as a user's would be (nothing here turns it off or points it elsewhere).
# Prints step lines and errors only (a failed step shows its captured output). The temporary
# directory is removed on every exit. `--print-install` prints the install commands and exits
# (tests/faces/test_first_hour.py checks them against the README).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=${PYTHON:-python3}

# The README's Install block: the `pip install ...` lines of the first ```bash block after
# "## Install", their comments removed, with -q added after `pip install`.
install_lines() {
  awk '
    /^## Install/ { sec = 1; next }
    sec && /^## / { exit }
    sec && /^```bash/ { blk = 1; next }
    blk && /^```/ { exit }
    blk && /^pip install / { sub(/[ \t]+#.*$/, ""); sub(/^pip install /, "pip install -q "); print }
  ' "$repo/README.md"
}
if [ "${1:-}" = "--print-install" ]; then
  install_lines
  exit 0
fi

start=$SECONDS
step() { printf '[first-hour %3d s] %s\n' "$((SECONDS - start))" "$*"; }
fail() {
  printf '[first-hour %3d s] FAILED: %s\n' "$((SECONDS - start))" "$*" >&2
  printf '[first-hour %3d s] free disk where it ran: %s\n' "$((SECONDS - start))" \
    "$(df -Ph "${tmp:-${TMPDIR:-/tmp}}" 2>/dev/null | awk 'NR == 2 { print $4 " of " $2 }')" >&2
  exit 1
}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/first-hour.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

# `quiet LOG CMD...`: run CMD with its output in LOG; on failure show LOG's end, keep status.
quiet() {
  local log=$1 rc=0
  shift
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "---- the last 40 lines of its output ----" >&2
    tail -n 40 "$log" >&2
    echo "----" >&2
  fi
  return "$rc"
}

# a user's shell: no virtual environment of this checkout on PATH
if [ -n "${VIRTUAL_ENV:-}" ]; then
  PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$VIRTUAL_ENV/bin" | paste -sd: -)
  unset VIRTUAL_ENV PYTHONHOME
fi
export PATH

mapfile -t lines < <(install_lines)
[ "${#lines[@]}" -eq 2 ] || fail "README.md's Install block should give 2 pip install lines, found ${#lines[@]}"

head=$(git -C "$repo" rev-parse --short HEAD)
if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]; then
  step "replaying the committed tree (HEAD $head); this working tree's uncommitted changes are not in it"
else
  step "replaying the committed tree (HEAD $head)"
fi
git clone --quiet --no-hardlinks "$repo" "$tmp/asyncload"
cd "$tmp/asyncload"
if [ -n "${PIP_NO_CACHE_DIR:-}" ]; then
  step "note: PIP_NO_CACHE_DIR is set in this environment; pip runs without its cache"
fi

# 1. install
t0=$SECONDS
step "1. install: fresh venv with $("$PY" --version 2>&1), then the README's Install lines"
"$PY" -m venv "$tmp/venv"
(
  . "$tmp/venv/bin/activate"
  step "   pip cache: $(pip cache dir 2>/dev/null || echo 'none')"
  for line in "${lines[@]}"; do
    step "   $line"
    quiet "$tmp/install.log" eval "$line" || fail "$line"
  done
) || exit 1
install_s=$((SECONDS - t0))

# 2. use
t0=$SECONDS
step "2. use: import asyncload, save a small DCP checkpoint with torch, load it, compare bit for bit"
cat >"$tmp/use.py" <<'EOF'
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

import asyncload

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
ck = sys.argv[1]
g = torch.Generator().manual_seed(44)
saved = {
    "w": torch.randn(256, 128, generator=g),
    "b": torch.randn(128, generator=g).to(torch.bfloat16),
    "ids": torch.arange(1000, dtype=torch.int64),
}
dcp.save(saved, checkpoint_id=ck, no_dist=True)
dest = {k: torch.zeros_like(v) for k, v in saved.items()}
stats = asyncload.load(dest, ck)
for k, v in saved.items():
    a, b = v.contiguous().view(torch.uint8), dest[k].contiguous().view(torch.uint8)
    if dest[k].dtype != v.dtype or dest[k].shape != v.shape or not torch.equal(a, b):
        sys.exit(f"{k}: loaded bytes differ from the saved ones")
print(f"asyncload {asyncload.__version__}: {str(stats).split(': ', 1)[0]}, bit for bit")
EOF
quiet "$tmp/use.log" "$tmp/venv/bin/python" "$tmp/use.py" "$tmp/ck" \
  || fail "the tiny load in the fresh venv"
step "   $(tail -n 1 "$tmp/use.log")"
use_s=$((SECONDS - t0))
# the demo builds its own venv: this one's ~1.7 GB are not needed past here (CI's disk is shared)
rm -rf "$tmp/venv" "$tmp/ck"

# 3. demo. Issue 44 requires a first run on a fresh machine within 300 s, so this one step
# fails on a time: a deliberate exception to "timing never decides a test". Full size, as a
# user runs it (no smaller checkpoint for CI). `timeout` only keeps a hang from stalling CI.
limit=300
t0=$SECONDS
step "3. demo: bash scripts/demo.sh in the clone (its own fresh .venv), full size, limit ${limit} s"
demo_rc=0
quiet "$tmp/demo.log" timeout --signal=INT --kill-after=30 $((limit * 3)) bash scripts/demo.sh \
  || demo_rc=$?
demo_s=$((SECONDS - t0))
# the demo's own step lines, then its table (what follows its last step line)
grep -E '^\[demo +[0-9]+ s\]' "$tmp/demo.log" | sed 's/^/   /' || true
[ "$demo_rc" -eq 0 ] || fail "bash scripts/demo.sh exited with status $demo_rc after ${demo_s} s"
last=$(grep -nE '^\[demo +[0-9]+ s\]' "$tmp/demo.log" | tail -n 1 | cut -d: -f1)
tail -n +"$((${last:-0} + 1))" "$tmp/demo.log" | sed 's/^/   | /'

# 4. summary
cores=$(nproc)
load=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime | sed 's/.*load average: //')
step "summary: install ${install_s} s, use ${use_s} s, demo ${demo_s} s (limit ${limit} s), all $((SECONDS - start)) s; ${cores} cores, load average ${load} (1, 5, 15 min)"
if [ "$demo_s" -gt "$limit" ]; then
  fail "the demo's first run took ${demo_s} s, over issue 44's ${limit} s"
fi
