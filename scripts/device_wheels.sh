#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels the GPU machine lacks, at the versions in
# constraints.txt, for Python 3.12 on x86-64 Linux; scripts/gpu_check.sh installs them
# there. Also unpacks Debian's redis-server into .redis/ for the GPU tests that need a
# real Redis (the GPU machine has no network and no redis-server). Run here, then carry
# .whl and .redis:  bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(pydantic pydantic_core annotated-types typing-inspection typing_extensions rocksdict
          redis hiredis fastapi starlette uvicorn h11 anyio confluent-kafka prometheus_client
          opentelemetry-api httpx httpcore certifi idna httptools uvloop
          typer click rich shellingham markdown-it-py mdurl Pygments)
pins=()
for p in "${packages[@]}"; do
  pin="$(grep -iE "^${p//[-_]/[-_]}==" constraints.txt || true)"
  [ -n "$pin" ] || { echo "device_wheels: $p is not pinned in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 -d .whl "${pins[@]}"
if [ ! -x .redis/usr/bin/redis-server ]; then
  tmp="$(mktemp -d)"
  (cd "$tmp" && apt-get download redis-server redis-tools liblzf1 libjemalloc2 >/dev/null)
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" .redis; done
  rm -rf "$tmp"
fi
du -sh .whl .redis
