#!/usr/bin/env bash
# The device side of scripts/probe_gpu_tails.py: the environment scripts/gpu_check.sh
# sets up (carried wheels, redis-server), then the probe, then the benchmarks it informs.
#   bash scripts/probe_gpu_tails.sh [probe options]
# PROBE_BENCH="--profile public; --profile hugectr --updates 10000" adds a run of
# `python -m hps.tools.bench.gpu` with each ';'-separated set of options;
# PROBE_TESTS="tests/a.py tests/b.py" (or "all") runs those GPU tests first.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hps-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/hps-site:${PYTHONPATH:-}"
fi
if [ -x .redis/usr/bin/redis-server ] && ! command -v redis-server >/dev/null; then
  export PATH="$PWD/.redis/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$PWD/.redis/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
status=0
if [ -n "${PROBE_TESTS:-}" ]; then
  if [ "$PROBE_TESTS" = all ]; then
    mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu\b' tests | sort)
  else
    read -ra files <<<"$PROBE_TESTS"
  fi
  timeout 300 python3 -m pytest "${files[@]}" -m "gpu and not multi_gpu" -q \
    -p no:cacheprovider -rs --durations=5 2>&1 | tee "${OUT:-/tmp}/pytest.log" | tail -n 30 \
    || status=1
fi
logs="${OUT:-/tmp}"
if [ "${PROBE_SKIP:-0}" != 1 ]; then  # PROBE_SKIP=1: the tests and benchmarks alone
  python3 scripts/probe_gpu_tails.py "$@" 2>&1 | tee "$logs/probe.log" || status=1
fi
IFS=';' read -ra benches <<<"${PROBE_BENCH:-}"
for i in "${!benches[@]}"; do
  # shellcheck disable=SC2086
  python3 -m hps.tools.bench.gpu ${benches[$i]} 2>&1 | tee "$logs/bench$i.log" || status=1
done
exit "$status"
