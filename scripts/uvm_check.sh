#!/usr/bin/env bash
# The uvm table's check on the device machine: its GPU tests (tests/gpu/test_uvm_*.py),
# then `python3 -m hps.tools.bench.gpu --profile uvm` (uvm beside dynamic at equal GPU
# memory on every workload; hps/tools/bench/gpu_uvm.py). Environment as
# scripts/gpu_check.sh sets it up; logs in $OUT (or /tmp/hps-gpu-check).
#
#   bash scripts/uvm_check.sh [benchmark options of python -m hps.tools.bench.gpu_uvm]
#   UVM_CHECK_TESTS=0 bash scripts/uvm_check.sh    # benchmark only
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
if [ "${UVM_CHECK_TESTS:-1}" != 0 ]; then
  GPU_CHECK_BENCH=0 GPU_CHECK_FILES="$(echo tests/gpu/test_uvm_*.py)" \
    bash scripts/gpu_check.sh || status=1
fi
export PYTHONPATH="/tmp/hps-site:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
if [ -x .redis/usr/bin/redis-server ] && ! command -v redis-server >/dev/null; then
  export PATH="$PWD/.redis/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$PWD/.redis/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
if [ "${UVM_CHECK_TESTS:-1}" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hps-site .whl/*.whl || exit 1
fi
python3 -m hps.tools.bench.gpu_uvm "$@" 2>&1 | tee "${OUT:-/tmp/hps-gpu-check}/uvm_bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit "$status"
