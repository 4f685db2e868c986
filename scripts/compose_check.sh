#!/usr/bin/env bash
# The compose deployment, run for real with Podman (takes minutes; not part of the test
# command). From the repository root:  bash scripts/compose_check.sh
#
# 1. Set-up (scripts/podman_setup.sh): Podman from Debian's packages and a local Debian
#    base image; a virtual environment (HPS_COMPOSE_VENV, default .compose-venv) with
#    podman-compose and NumPy, within constraints.txt.
# 2. Builds the images once each (Podman's layer cache makes later runs quick): hps:cpu on
#    the base image given as the BASE_IMAGE build argument (HPS_BASE_IMAGE, default the
#    local Debian base), and Redis, HAProxy and Prometheus from Debian's packages and moto's
#    S3 server in place of the official images and MinIO (deploy/compose.check.yml swaps
#    them in). Reports each image's size, hps:cpu's against the 400 MB target (and on
#    python:3.11-slim too when that image can be pulled), and checks the hps image's
#    hygiene: non-root user, a health check on /readyz, no compiler, no pip, numba's cache
#    filled for its user, and its own smoke check (deploy/smoke_check.py) passing as that
#    user.
# 3. Through docker-compose.yml with podman-compose, waiting for each service's own health
#    check, looking keys up through the published ports (a token set) and comparing every
#    vector with the model's files bit for bit (scripts/compose_probe.py). After each hps
#    service's first lookups (right after it turned healthy): none compiled after ready
#    (hps_compiles_total{phase="after_ready"} 0), and the container wrote no numba cache
#    file: its first start read what it ran from the image's cache.
#    - monitoring profile: Prometheus first (Grafana cannot be had here), so it sees it all;
#    - demo profile: model-init, hps;
#    - s3 profile: the demo model uploaded to the S3 server (s3-upload), hps-s3 reading it
#      from there;
#    - Redis profile: kills the Redis container while lookups run and sees them keep
#      answering from RocksDB, starts it again and sees the Redis tier serve again;
#    - replicas profile: a 3-master Redis Cluster, two hps replicas, HAProxy; lookups
#      through the balancer reach both; new vectors for every key are published as
#      online updates (hps publish, Redis Streams) and both replicas serve them exactly;
#      then each replica reloads the same version from files, and both still do;
#    - Prometheus scrapes every hps service; the dashboard's panels are drawn from its
#      query_range API (scripts/plot_metrics.py → HPS_METRICS_PNG, docs/metrics.png).
# 4. Tears everything down: no container, volume, network or image of its own is left
#    (Podman's build cache stays, unless HPS_CHECK_PRUNE=1), and says so.
#
# Environment: HPS_BASE_IMAGE, HPS_COMPOSE_VENV, DEMO_SCALE (default 0.1: 100,000 keys),
# HPS_METRICS_PNG, HPS_KEEP_IMAGES=1 keeps the built images. Exit status 0 when every
# step passed.
set -euo pipefail
cd "$(dirname "$0")/.."

project=hps-check
base="${HPS_BASE_IMAGE:-localhost/debian:bookworm-slim}"
venv="${HPS_COMPOSE_VENV:-.compose-venv}"
export DEMO_SCALE="${DEMO_SCALE:-0.1}"
work=$(mktemp -d)
started=$SECONDS

step() { printf '\n== [%4ds] %s\n' "$((SECONDS - started))" "$*"; }
say() { printf '   %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# -- 1. set-up ----------------------------------------------------------------------------
step "set-up: podman, base image $base, $venv"
HPS_BASE_IMAGE="$base" bash scripts/podman_setup.sh | sed 's/^/   /'
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -c constraints.txt \
  podman-compose numpy matplotlib >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
py="$venv/bin/python"
say "$("$venv/bin/podman-compose" version 2>/dev/null | tail -1)"

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
HPS_PORT=$(free_port); HPS_REDIS_PORT=$(free_port); HPS_LB_PORT=$(free_port)
HPS_REPLICA1_PORT=$(free_port); HPS_REPLICA2_PORT=$(free_port); PROMETHEUS_PORT=$(free_port)
HPS_S3_PORT=$(free_port); MINIO_PORT=$(free_port); MINIO_CONSOLE_PORT=$(free_port)
export HPS_PORT HPS_REDIS_PORT HPS_LB_PORT HPS_REPLICA1_PORT HPS_REPLICA2_PORT PROMETHEUS_PORT \
  HPS_S3_PORT MINIO_PORT MINIO_CONSOLE_PORT
HPS_TOKEN=$("$py" -c 'import secrets; print(secrets.token_urlsafe(24))')
export HPS_TOKEN HPS_TOKEN_FILE="$work/token"
printf '%s' "$HPS_TOKEN" >"$HPS_TOKEN_FILE"
chmod 644 "$HPS_TOKEN_FILE"  # Prometheus reads it as its own user
png="${HPS_METRICS_PNG:-docs/metrics.png}"

profiles=(--profile redis --profile s3 --profile replicas --profile monitoring)
compose() {
  "$venv/bin/podman-compose" --in-pod false -p "$project" \
    -f deploy/docker-compose.yml -f deploy/compose.check.yml \
    "${profiles[@]}" "$@" >>"$work/compose.log" 2>&1 \
    || { tail -40 "$work/compose.log" >&2; fail "podman-compose $*"; }
}
container() {  # the container of a compose service
  podman ps -a --filter "label=io.podman.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1
}
images=(localhost/hps:cpu localhost/hps-redis:debian localhost/hps-haproxy:debian
        localhost/hps-prometheus:debian localhost/hps-moto:debian)

teardown() {
  status=$?
  trap - EXIT
  step "tear-down"
  for svc in hps hps-s3 minio hps-redis hps-replica-1 hps-replica-2 lb prometheus; do
    name=$(container "$svc")
    if [ "$status" -ne 0 ] && [ -n "$name" ]; then
      echo "-- last lines of $svc" >&2; podman logs --tail 30 "$name" >&2 || true
    fi
  done
  "$venv/bin/podman-compose" --in-pod false -p "$project" -f deploy/docker-compose.yml \
    -f deploy/compose.check.yml "${profiles[@]}" down -v >>"$work/compose.log" 2>&1 || true
  if [ "${HPS_KEEP_IMAGES:-0}" != 1 ]; then
    podman rmi -f "${images[@]}" >/dev/null 2>&1 || true
  fi
  [ "${HPS_CHECK_PRUNE:-0}" = 1 ] && podman image prune -f >/dev/null
  left_c=$(podman ps -a --filter "label=io.podman.compose.project=$project" -q | wc -l)
  left_v=$(podman volume ls --filter "label=io.podman.compose.project=$project" -q | wc -l)
  left_n=$(podman network ls --format '{{.Name}}' | grep -c "^${project}_" || true)
  left_i=0
  for image in "${images[@]}"; do podman image exists "$image" && left_i=$((left_i + 1)); done
  cache=$(podman images -a --format '{{.Repository}}' | grep -c '<none>' || true)
  say "left behind: $left_c containers, $left_v volumes, $left_n networks, $left_i images" \
      "(build cache: $cache untagged layers)"
  rm -rf "$work"
  if [ "$status" -eq 0 ] && [ $((left_c + left_v + left_n)) -ne 0 ]; then
    echo "FAIL: the tear-down left containers, volumes or networks" >&2
    status=1
  fi
  [ "$status" -eq 0 ] && step "compose check passed" || step "compose check FAILED"
  exit "$status"
}
trap teardown EXIT

# -- 2. images ----------------------------------------------------------------------------
mb() { echo $(( ($(podman image inspect "$1" --format '{{.Size}}') + 500000) / 1000000 )); }
build() {  # build IMAGE DOCKERFILE [BASE]: one build, in docker format (keeps HEALTHCHECK)
  local t0=$SECONDS from="${3:-$base}"
  # the host's CA bundle: pip and apt inside the build trust what the host trusts
  podman build --format docker --layers -v /etc/ssl/certs:/etc/ssl/certs:ro \
    --build-arg BASE_IMAGE="$from" -f "$2" -t "$1" . >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >&2; fail "building $1"; }
  say "$1: $(mb "$1") MB ($(( SECONDS - t0 )) s to build, base $from: $(mb "$from") MB)"
}
target_mb=400
report_size() {  # report_size IMAGE BASE: the hps image against the target
  local size verdict
  size=$(mb "$1")
  if [ "$size" -le "$target_mb" ]; then verdict="within the ${target_mb} MB target"
  else verdict="over the ${target_mb} MB target by $((size - target_mb)) MB"; fi
  # the image is one layer of the slimmed base and the environment (deploy/Dockerfile.cpu)
  say "$1 on $2: $size MB (the base alone: $(mb "$2") MB), $verdict"
}
step "images"
build localhost/hps:cpu deploy/Dockerfile.cpu
# what the slimming freed (deploy/slim_venv.py, deploy/slim_base.py; absent when cached)
{ grep -A4 '^tests and build-time files' "$work/build.log" || true
  grep -A2 '^standard library parts' "$work/build.log" || true; } | sed 's/^/     /'
report_size localhost/hps:cpu "$base"
# the base users build on, where it can be pulled (no registry here: said so)
slim_python=docker.io/library/python:3.11-slim
if podman image exists "$slim_python" || podman pull -q "$slim_python" >/dev/null 2>&1; then
  build localhost/hps:cpu-python-slim deploy/Dockerfile.cpu "$slim_python"
  report_size localhost/hps:cpu-python-slim "$slim_python"
  podman rmi -f localhost/hps:cpu-python-slim >/dev/null
else
  say "$slim_python cannot be pulled here (no image registry): hps:cpu not measured on it"
fi
build localhost/hps-redis:debian deploy/Dockerfile.redis
build localhost/hps-haproxy:debian deploy/Dockerfile.haproxy
build localhost/hps-prometheus:debian deploy/Dockerfile.prometheus
build localhost/hps-moto:debian deploy/Dockerfile.moto

step "image hygiene (hps:cpu)"
user=$(podman run --rm --no-healthcheck --entrypoint id localhost/hps:cpu -u)
[ "$user" != 0 ] || fail "hps:cpu runs as root"
say "runs as uid $user ($(podman image inspect localhost/hps:cpu --format '{{.Config.User}}'))"
health=$(podman image inspect localhost/hps:cpu --format '{{json .Config.Healthcheck.Test}}')
case "$health" in *"/readyz"*) say "health check: $health" ;; *) fail "no /readyz health check: $health" ;; esac
tools=$(podman run --rm --no-healthcheck --entrypoint sh localhost/hps:cpu -c \
  'for t in gcc cc c++ g++ make ld as strip pip pip3; do command -v $t; done;
   python -m pip --version 2>/dev/null
   ls -d /usr/include/python3* /usr/local/include/python3* 2>/dev/null; true')
[ -z "$tools" ] || fail "build tools in the final image: $tools"
say "no compiler, linker, make, strip, pip or Python headers in the image"
cached=$(podman run --rm --no-healthcheck --entrypoint sh localhost/hps:cpu -c \
  'find ~/.cache/numba -name "*.nbc" | wc -l')
[ "$cached" -gt 0 ] || fail "no numba cache in the image (~/.cache/numba of its user)"
say "numba's cache in the image: $cached compiled signatures (its build's warm-up)"
# every feature the image serves, in the final image as its own user
podman run --rm --no-healthcheck --entrypoint python localhost/hps:cpu \
  /app/deploy/smoke_check.py >"$work/smoke.log" 2>&1 || { cat "$work/smoke.log" >&2; fail "smoke check"; }
sed 's/^/   /' "$work/smoke.log"

# -- 3. demo and Redis profiles -----------------------------------------------------------
wait_exited() {  # the one-shot service ran to completion with status 0
  local name code
  name=$(container "$1")
  code=$(podman wait "$name")
  [ "$code" = 0 ] || { podman logs --tail 30 "$name" >&2; fail "$1 exited with $code"; }
  say "$1 completed"
}
wait_healthy() {  # the service's own health check passes (podman runs it on demand here)
  local name started_ms t0=$SECONDS
  name=$(container "$1")
  until podman healthcheck run "$name" >/dev/null 2>&1; do
    [ "$(podman inspect "$name" --format '{{.State.Running}}')" = true ] \
      || { podman logs --tail 30 "$name" >&2; fail "$1 stopped"; }
    [ $((SECONDS - t0)) -lt 300 ] || fail "$1 not healthy after 300 s"
    sleep 0.5
  done
  started_ms=$(podman inspect "$name" --format '{{.State.StartedAt.UnixMilli}}')
  say "$1 healthy $("$py" -c "print(f'{($(date +%s%3N) - $started_ms) / 1000:.1f}')") s" \
    "after its container started"
}
# After an hps service's first lookups (they came right after healthy, and were exact):
# nothing compiled once it said ready (hps_compiles_total), and its first start read the
# compiled functions it ran from the image's numba cache (deploy/Dockerfile.cpu fills it):
# the container wrote no cache file of its own (podman diff: what it added or changed).
first_start() {  # first_start SERVICE URL
  local name written
  name=$(container "$1")
  probe compiles "$2" -
  written=$(podman diff "$name" | awk '$2 ~ "^/home/hps/\\.cache/numba/.*\\.nb[ic]$"')
  [ -z "$written" ] || fail "$1 wrote numba cache files at its first start (the image's" \
    "cache lacks them): $(echo "$written" | tr '\n' ' ')"
  say "$1 wrote no numba cache file: the image's cache held all it ran"
}
probe() { "$py" scripts/compose_probe.py "$@" | sed 's/^/   /'; return "${PIPESTATUS[0]}"; }

step "monitoring profile: prometheus (scrapes every hps service that comes up)"
compose up -d --no-deps prometheus
monitored=$(date +%s)
prometheus="http://127.0.0.1:$PROMETHEUS_PORT"
until "$py" -c "import urllib.request as u; u.urlopen('$prometheus/-/ready', timeout=2)" \
    2>/dev/null; do sleep 1; done
say "prometheus ready"

step "demo profile: model-init, hps (DEMO_SCALE=$DEMO_SCALE)"
compose up -d model-init
wait_exited model-init
models=$(podman volume inspect "${project}_models" --format '{{.Mountpoint}}')/demo
compose up -d --no-deps hps
wait_healthy hps
probe exact "http://127.0.0.1:$HPS_PORT" "$models" --tier volatile
first_start hps "http://127.0.0.1:$HPS_PORT"
probe scrapes "$prometheus" - --targets hps --within 90

step "s3 profile: the demo model on an S3 server (moto in MinIO's place), hps-s3"
compose up -d --no-deps minio
wait_healthy minio
compose up -d --no-deps s3-upload
wait_exited s3-upload
compose up -d --no-deps hps-s3
wait_healthy hps-s3
probe exact "http://127.0.0.1:$HPS_S3_PORT" "$models" --tier volatile
first_start hps-s3 "http://127.0.0.1:$HPS_S3_PORT"
probe scrapes "$prometheus" - --targets hps,hps-s3 --within 90

step "redis profile: redis, hps-redis"
compose up -d --no-deps redis
wait_healthy redis
compose up -d --no-deps hps-redis
wait_healthy hps-redis
url="http://127.0.0.1:$HPS_REDIS_PORT"
probe exact "$url" "$models" --tier volatile
first_start hps-redis "$url"
# Prometheus scrapes it before the outage, so the outage shows in the metrics
probe scrapes "$prometheus" - --targets hps,hps-s3,hps-redis --within 90

step "Redis killed while lookups run"
redis=$(container redis)
probe steady "$url" "$models" --seconds 12 &
steady=$!
sleep 3
podman kill "$redis" >/dev/null
marks=(--mark "Redis killed=$(date +%s)")
say "killed $redis"
wait "$steady" || fail "lookups failed while Redis was killed"
probe exact "$url" "$models" --tier persistent

step "Redis started again"
podman start "$redis" >>"$work/compose.log" 2>&1
marks+=(--mark "Redis started=$(date +%s)")
wait_healthy redis
probe recover "$url" "$models" --within 90

step "replicas profile: 3-master Redis Cluster, two hps replicas, HAProxy"
compose up -d --no-deps redis-1 redis-2 redis-3
for node in redis-1 redis-2 redis-3; do wait_healthy "$node"; done
compose up -d --no-deps redis-cluster-init
wait_exited redis-cluster-init
compose up -d --no-deps hps-replica-1 hps-replica-2
wait_healthy hps-replica-1
wait_healthy hps-replica-2
compose up -d --no-deps lb
marks+=(--mark "replicas up=$(date +%s)")
lb="http://127.0.0.1:$HPS_LB_PORT"
probe replicas "$lb" "$models" --replicas hps-replica-1,hps-replica-2 --within 60
first_start hps-replica-1 "http://127.0.0.1:$HPS_REPLICA1_PORT"
first_start hps-replica-2 "http://127.0.0.1:$HPS_REPLICA2_PORT"
probe scrapes "$prometheus" - --targets hps,hps-s3,hps-redis,hps-replica-1,hps-replica-2 --within 90
probe steady "$lb" "$models" --seconds 20

step "online updates: new vectors published to Redis Streams, applied by both replicas"
probe publish "$models" "$models-v2"
marks+=(--mark "update published=$(date +%s)")
for table in user_item item_category; do
  compose run --rm --no-deps model-init publish /configs/replicas.json demo \
    "/models/demo-v2/$table" --table "$table"
  say "published /models/demo-v2/$table as update messages (hps publish)"
done
probe replicas "$lb" "$models-v2" --replicas hps-replica-1,hps-replica-2 --within 60 --converge

step "the same version reloaded by each replica (a new version without the update source)"
probe reload "http://127.0.0.1:$HPS_REPLICA1_PORT" "$models-v2" --as /models/demo-v2
probe reload "http://127.0.0.1:$HPS_REPLICA2_PORT" "$models-v2" --as /models/demo-v2
marks+=(--mark "reloaded=$(date +%s)")
probe replicas "$lb" "$models-v2" --replicas hps-replica-1,hps-replica-2 --within 60
probe steady "$lb" "$models-v2" --seconds 30

step "prometheus scrapes every hps service; the dashboard's panels from query_range"
probe scrapes "$prometheus" - --targets hps,hps-s3,hps-redis,hps-replica-1,hps-replica-2
sleep 10  # one more scrape after the last lookups
"$py" scripts/plot_metrics.py "$prometheus" --since "$monitored" "${marks[@]}" --out "$png" | sed 's/^/   /'
