#!/usr/bin/env bash
# Installs what the test suite needs and runs it: Python packages (the package itself with
# its 'test' extra, PyTorch's CPU build for the DLPack tests) and redis-server (apt-get)
# where it is missing. The Redis, S3 (moto) and HTTP (uvicorn) servers the tests talk to
# are started by the tests' fixtures on loopback ports. GPU tests (tests/gpu) need CUDA
# and run on a GPU machine through scripts/gpu_check.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  echo "== installing redis-server (apt-get)"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
  # the package's own service is not needed: the tests start their own servers
  $sudo service redis-server stop >/dev/null 2>&1 || true
fi

echo "== installing Python packages"
log=$(mktemp)
if ! python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
python3 -c "import hps, rocksdict, redis, torch, moto, fastapi" \
  || { echo "missing test dependencies after install" >&2; exit 1; }

echo "== running tests"
exec python3 -m pytest tests --ignore=tests/gpu "$@"
