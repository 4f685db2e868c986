#!/usr/bin/env bash
# Installs what the test suite needs and runs it. Everything Python goes into a virtual
# environment of the project's own (HPS_VENV, default .venv), never into the machine's
# site-packages: the package with its 'test' extra, PyTorch's CPU build for the DLPack
# tests, all within constraints.txt (versions known to work together). redis-server comes
# from apt-get where it is missing. The Redis, S3 (moto), Kafka (librdkafka's mock
# cluster) and HTTP (uvicorn) servers the tests talk to are started by the tests' own
# fixtures on loopback ports. GPU tests (marked `gpu`) need CUDA and run on a GPU machine
# through scripts/gpu_check.sh instead. Arguments are passed to pytest; -h or --help prints
# this script's usage before installing anything (pytest's own help: -- -h).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/test.sh [PYTEST ARGS...]

Installs what the test suite needs, then runs it:
  - redis-server (apt-get, with sudo when not root) where redis-server or redis-cli is missing;
  - a virtual environment at $HPS_VENV (default .venv) when there is none;
  - into it, within constraints.txt: this checkout with its 'test' extra (editable) and
    PyTorch's CPU build.
Then runs `python -m pytest tests -m "not gpu" PYTEST ARGS...`: every argument goes to
pytest as it is (-k EXPR, -x, a test's path; `-- -h` for pytest's own help).
GPU tests (marked gpu) run on a GPU machine through scripts/gpu_check.sh.

  -h, --help   this text; nothing is installed or run
EOF
}
# before anything is installed: a first -h is this script's; after `--`, pytest's
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --) shift ;;
esac
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

venv="${HPS_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "== creating the virtual environment $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"

echo "== installing Python packages into $venv (constraints.txt)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$py" -m pip install -q --disable-pip-version-check -c constraints.txt \
    "torch==2.13.0" -e ".[test]" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
"$py" -c "import hps, rocksdict, redis, torch, moto, fastapi, tensorflow" \
  || { echo "missing test dependencies after install" >&2; exit 1; }

echo "== running tests"
"$py" -m pytest tests -m "not gpu" "$@"
