"""NVIDIA's MPS control daemon, as the processes of one GPU see it: whether it runs, and
one warning per process when it does not (without it, the GPU time-slices the processes'
kernels: 8 processes with their own caches on one H100 got 13.1 M keys/s against 450.7
under MPS, 0.17x of one process's 77.8)."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

log = logging.getLogger("hps")
_warned = threading.Event()


def pipe_directory() -> Path:
    """Where the MPS control daemon keeps its pipes: $CUDA_MPS_PIPE_DIRECTORY, else
    /tmp/nvidia-mps (the daemon's default)."""
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def daemon_found() -> bool:
    """Whether an MPS control daemon's control endpoint is in its pipe directory (the CUDA
    driver of each process connects to it when it starts): a Unix socket (seen on an H200
    with driver 580: `control`, `control_privileged`) or, from older daemons, a FIFO."""
    try:
        mode = (pipe_directory() / "control").stat().st_mode
    except OSError:
        return False
    return stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode)


def check_for_shared_cache() -> None:
    """Called when this process maps a GPU table another process of the host allocated
    (gpu_cache_scope: host): warns once per process when no MPS daemon runs."""
    if daemon_found() or _warned.is_set():
        return
    _warned.set()
    log.warning(
        "no MPS control daemon found (%s): this process shares a GPU cache with other "
        "processes, and without MPS the GPU runs their kernels in time slices (8 processes "
        "on one H100: 0.17x of one process's keys/s). Start it with `nvidia-cuda-mps-control "
        "-d` before the processes (docs/gpu-cache.md)", pipe_directory())
