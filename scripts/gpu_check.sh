#!/usr/bin/env bash
# The GPU check, for a machine with CUDA and CuPy (the device machine): installs nothing
# from the network (wheels carried in .whl/ are installed to a temp dir if present, and
# redis-server unpacked in .redis/ is used; scripts/device_wheels.sh makes both), runs
# the GPU tests (every test marked `gpu`, wherever it lives under tests/), then the GPU
# benchmark, and prints a short table last.
#
#   bash scripts/gpu_check.sh [benchmark options, e.g. --profile public or --sweep]
#     (default: every profile of python -m hps.tools.bench.gpu: the kernels, the public calls'
#     latency, HugeCTR's profile, 1M-key misses, the torch layer, and every GPU at once where there are two)
#   GPU_CHECK_TESTS=0 bash scripts/gpu_check.sh    # benchmark only
#   GPU_CHECK_BENCH=0 bash scripts/gpu_check.sh    # tests only
#   GPU_CHECK_BENCH=0 GPU_CHECK_FILES="tests/gpu/test_sharded.py" bash scripts/gpu_check.sh
# Logs go to $OUT (or /tmp/hps-gpu-check): pytest.log, bench.log.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${OUT:-/tmp/hps-gpu-check}"
mkdir -p "$logs"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hps-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/hps-site:${PYTHONPATH:-}"
fi
if [ -x .redis/usr/bin/redis-server ] && ! command -v redis-server >/dev/null; then
  # Debian's redis-server unpacked by scripts/device_wheels.sh (the GPU machine has none)
  export PATH="$PWD/.redis/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$PWD/.redis/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
python3 - <<'PY' || exit 1
import cupy, numpy, pydantic, yaml
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"device: {props['name'].decode()}, {props['multiProcessorCount']} SMs, "
      f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
      f"NumPy {numpy.__version__}")
PY

status=0
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  # tests of several GPUs run where there are several (and must pass there)
  devices="$(python3 -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())')"
  select="gpu"
  [ "$devices" -ge 2 ] || select="gpu and not multi_gpu"
  # the GPU tests live beside their topics; only the files that hold some are collected
  # (the other tests' packages, TensorFlow, httpx, hypothesis, ..., are not carried here)
  # (GPU_CHECK_FILES="tests/gpu/test_x.py ...": only those, for a check of one change)
  if [ -n "${GPU_CHECK_FILES:-}" ]; then
    read -ra files <<<"$GPU_CHECK_FILES"
  else
    mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu\b' tests | sort)
  fi
  timeout "${GPU_CHECK_TEST_TIMEOUT:-300}" python3 -m pytest "${files[@]}" -m "$select" -q \
    -p no:cacheprovider -rs --durations=8 2>&1 | tee "$logs/pytest.log"
  status=${PIPESTATUS[0]}
  # on a GPU machine every GPU test must run: none passed, or any skipped, is a failure
  # (pytest's summary line, not the log's last: torch may warn after it at exit)
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected)\b' \
    "$logs/pytest.log" | tail -n 1)"
  if ! grep -Eq '[1-9][0-9]* passed' <<<"$summary" || grep -q 'skipped' <<<"$summary"; then
    echo "gpu_check: GPU tests did not all run ($summary)" >&2
    status=1
  fi
fi
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  if [ "$#" = 0 ]; then
    set -- --profile kernels --profile public --profile hugectr --profile misses \
      --profile torch
    [ "$(python3 -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())')" -lt 2 ] \
      || set -- "$@" --profile devices
  fi
  python3 -m hps.tools.bench.gpu "$@" 2>&1 | tee "$logs/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  echo "GPU tests: ${summary:-no summary (timed out?)}"
fi
exit "$status"
