#!/usr/bin/env bash
# Makes a machine without Docker run the compose file: Podman from Debian's packages, and
# a Debian bookworm base image built locally with debootstrap, for machines that reach
# Debian's package mirror but no image registry. Used by scripts/compose_check.sh; safe to
# run again (each step is skipped when already done). Needs root (apt-get, /etc).
#
# Why each setting:
# - runc as the runtime: crun refuses hosts whose cgroups are in the hybrid layout.
# - cgroupfs as cgroup manager: no systemd session inside a sandbox.
# - default_ulimits = []: Podman's defaults ask for more open files and processes than
#   a sandbox may grant, and then no container starts.
# - the base image localhost/debian:bookworm-slim (debootstrap minbase + python3, venv and
#   CA certificates; no pip, no compilers): the Dockerfiles take it as their BASE_IMAGE
#   build argument. Slim as Debian's own debian:bookworm-slim (the base of python:3.11-slim)
#   is: no documentation but the copyright files, no manual pages, no translations, and
#   a dpkg configuration that keeps packages installed later on it from adding them
#   (171 MB → 130 MB).
# Set HPS_BASE_IMAGE to use another local base instead (nothing is built then).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
base="${HPS_BASE_IMAGE:-localhost/debian:bookworm-slim}"

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

need=()
for tool in podman runc debootstrap slirp4netns fuse-overlayfs newuidmap; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing podman, runc, debootstrap (apt-get; missing: ${need[*]})"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq podman runc debootstrap slirp4netns fuse-overlayfs uidmap \
    >/dev/null
fi

conf=/etc/containers/containers.conf
if ! grep -qs '^runtime *= *"runc"' "$conf"; then
  if [ -s "$conf" ]; then
    echo "$conf exists without runtime = \"runc\": add it, cgroup_manager = \"cgroupfs\"" \
      "and default_ulimits = [] by hand" >&2
    exit 1
  fi
  echo "== writing $conf (runc, cgroupfs, no default ulimits)"
  $sudo mkdir -p /etc/containers
  printf '%s\n' '[containers]' 'default_ulimits = []' '[engine]' 'runtime = "runc"' \
    'cgroup_manager = "cgroupfs"' | $sudo tee "$conf" >/dev/null
fi

if ! podman image exists "$base"; then
  if [ "$base" != "localhost/debian:bookworm-slim" ]; then
    echo "base image $base not found" >&2
    exit 1
  fi
  echo "== building $base with debootstrap (a few minutes)"
  root=$(mktemp -d)
  trap '$sudo rm -rf "$root"' EXIT
  $sudo debootstrap --variant=minbase \
    --include=python3,python3-venv,ca-certificates bookworm "$root" >/dev/null
  # the downloaded packages and index files are ~100 MB that no image needs
  $sudo rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  # what debian:bookworm-slim leaves out, for packages installed now and later
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/groff/*' \
    'path-exclude /usr/share/info/*' 'path-exclude /usr/share/lintian/*' \
    'path-exclude /usr/share/linda/*' 'path-exclude /usr/share/locale/*' \
    | $sudo tee "$root/etc/dpkg/dpkg.cfg.d/slim" >/dev/null
  $sudo find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  $sudo find "$root/usr/share/doc" -mindepth 1 -depth -type d -empty -delete
  $sudo rm -rf "$root"/usr/share/man/* "$root"/usr/share/groff/* "$root"/usr/share/info/* \
    "$root"/usr/share/lintian/* "$root"/usr/share/linda/* "$root"/usr/share/locale/*
  $sudo tar -C "$root" -c . | podman import - "$base" >/dev/null
fi
podman run --rm "$base" python3 -c 'import sys; print("podman runs", sys.version.split()[0])'
