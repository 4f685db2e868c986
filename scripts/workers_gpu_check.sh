#!/usr/bin/env bash
# `hps serve --workers N` with GPU caches on the device machine: the GPU tests of the
# workers (every worker's cache serves the leader's online updates) and of what the change
# touched, then `hps bench http --gpu` with 1 worker and with N, each beside the bare
# uvicorn floor with as many workers, driven by client processes.
#
#   bash scripts/workers_gpu_check.sh [N (default 8)] [client processes (default 1,2,4,8,16)]
#   WORKERS_CHECK_TESTS=0 bash scripts/workers_gpu_check.sh    # the bench only
#   WORKERS_CHECK_RUNS="8 8mps" ...   # which benches: N workers, "mps": under the MPS daemon
#
# MPS (NVIDIA's Multi-Process Service) lets the kernels of the workers' processes run on
# the GPU at once instead of in time slices; the script starts its control daemon for an
# "mps" run (pipe and log folders of its own under /tmp) and stops it after.
set -uo pipefail
cd "$(dirname "$0")/.."
workers="${1:-8}"
clients="${2:-1,2,4,8,16}"
logs="${OUT:-/tmp/hps-gpu-check}"
mkdir -p "$logs"
if [ "${WORKERS_CHECK_TESTS:-1}" != 0 ]; then
  GPU_CHECK_BENCH=0 GPU_CHECK_FILES="tests/http/test_workers_gpu.py tests/gpu/test_sharded.py" \
    bash scripts/gpu_check.sh || exit 1
fi
[ -d /tmp/hps-site ] && export PYTHONPATH="/tmp/hps-site:${PYTHONPATH:-}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap mps_stop EXIT
for run in ${WORKERS_CHECK_RUNS:-1 $workers}; do
  n="${run%mps}"
  if [ "$run" != "$n" ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/hps-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/hps-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "no MPS daemon here"; unset CUDA_MPS_PIPE_DIRECTORY; continue; }
  fi
  echo "== hps bench http --gpu, $n worker(s) per server${CUDA_MPS_PIPE_DIRECTORY:+, under MPS} =="
  python3 -m hps.tools.bench.http_gpu --workers "$n" --client-processes "$clients" \
    --seconds 3 2>&1 | grep -v '^{' | tee "$logs/http_gpu_workers_$run.log"
  mps_stop
done
