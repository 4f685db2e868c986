#!/usr/bin/env bash
# The figures of issue 39 (many callers) on the device machine, in one call, each step
# logged to $OUT: the threads profile (a stream switch per call, then streams set once),
# HugeCTR's profile without and with 10,000 update rows/s, `HPS.lookup` with NumPy keys,
# and the two-callers probe with the launch releasing the GIL. Environment as
# scripts/gpu_check.sh sets it up (run that first in the same call, or set
# ISSUE39_INSTALL=1 to install the carried wheels here).
#
#   bash scripts/issue39_figures.sh [threads|hugectr|public|probe ...]   (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${OUT:-/tmp/hps-gpu-check}"
mkdir -p "$logs"
if [ "${ISSUE39_INSTALL:-0}" = 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hps-site .whl/*.whl || exit 1
fi
export PYTHONPATH="/tmp/hps-site:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
if [ -x .redis/usr/bin/redis-server ] && ! command -v redis-server >/dev/null; then
  export PATH="$PWD/.redis/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$PWD/.redis/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(threads hugectr public probe)
status=0
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  timeout "${ISSUE39_STEP_TIMEOUT:-240}" "$@" > "$logs/$name.log" 2>&1 || status=1
  tail -n "${ISSUE39_TAIL:-25}" "$logs/$name.log"
}
for step in "${steps[@]}"; do
  case "$step" in
    threads)
      run threads python3 -m hps.tools.bench.gpu_threads --seconds 1
      run threads_stream_once python3 -m hps.tools.bench.gpu_threads --seconds 1 \
        --stream-per-thread ;;
    hugectr)
      run hugectr python3 -m hps.tools.bench.gpu --profile hugectr
      run hugectr_updates python3 -m hps.tools.bench.gpu --profile hugectr --updates 10000 ;;
    public) run public python3 -m hps.tools.bench.gpu --profile public ;;
    probe) run probe_nogil python3 scripts/probe_two_callers.py --nogil-launch \
      --threads 1,2 --seconds 0.5 ;;
    *) echo "unknown step $step" >&2; status=1 ;;
  esac
done
exit "$status"
