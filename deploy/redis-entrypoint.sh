#!/bin/sh
# Entry point of deploy/Dockerfile.redis: `redis-server ARGS` runs with protected mode
# off (as the official image does when no config file is given); anything else runs as is.
set -e
if [ "${1:-}" = "redis-server" ]; then
  shift
  exec redis-server "$@" --protected-mode no
fi
exec "$@"
