"""NVIDIA's MPS control daemon, as the processes of one GPU see it: whether it runs, one
warning per process when it does not, and starting and stopping it for a host (`hps mps`).
Without it the GPU time-slices the processes' kernels: 8 processes with their own caches
on one H100 got 13.1 M keys/s against 450.7 under MPS, 0.17x of one process's 77.8."""

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
    return found_in(pipe_directory())


def check_for_shared_cache() -> None:
    """Called when this process maps a GPU table another process of the host allocated
    (gpu_cache_scope: host): warns once per process when no MPS daemon runs."""
    if daemon_found() or _warned.is_set():
        return
    _warned.set()
    log.warning(
        "no MPS control daemon found (%s): this process shares a GPU cache with other "
        "processes, and without MPS the GPU runs their kernels in time slices (8 processes "
        "on one H100: 0.17x of one process's keys/s). Start it with `hps mps start` (or "
        "`nvidia-cuda-mps-control -d`) before the processes (docs/gpu-cache.md)",
        pipe_directory())


# -- the control daemon: `hps mps start|status|stop` (hps/tools/cli/mps.py) ---------------

CONTROL = "nvidia-cuda-mps-control"


def log_directory(pipe_dir: Path) -> Path:
    """Where the daemon logs: $CUDA_MPS_LOG_DIRECTORY, else /var/log/nvidia-mps for root,
    else beside the pipe directory (`<pipe_dir>-log`)."""
    value = os.environ.get("CUDA_MPS_LOG_DIRECTORY")
    if value:
        return Path(value)
    if os.geteuid() == 0:
        return Path("/var/log/nvidia-mps")
    return pipe_dir.with_name(pipe_dir.name + "-log")


def found_in(pipe_dir: Path) -> bool:
    """Whether a control daemon's endpoint is in `pipe_dir` (see daemon_found)."""
    try:
        mode = (pipe_dir / "control").stat().st_mode
    except OSError:
        return False
    return stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode)


def _control() -> str:
    import shutil

    from hps.errors import DeviceError

    binary = shutil.which(CONTROL)
    if binary is None:
        raise DeviceError(f"{CONTROL} is not on PATH: MPS comes with NVIDIA's driver on a GPU "
                          "host (or its container image)")
    return binary


def _env(pipe_dir: Path, log_dir: Path) -> dict[str, str]:
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}


def start(pipe_dir: Path, log_dir: Path, wait_s: float = 10.0) -> None:
    """Starts the control daemon (`nvidia-cuda-mps-control -d`) with these directories
    (made if missing). Raises DeviceError when the program is missing, a daemon already
    answers there, or it does not come up within `wait_s`."""
    import subprocess
    import time

    from hps.errors import DeviceError

    binary = _control()
    if found_in(pipe_dir):
        raise DeviceError(f"an MPS control daemon already runs in {pipe_dir} (`hps mps stop "
                          f"--pipe-dir {pipe_dir}` stops it)")
    try:
        pipe_dir.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DeviceError(f"cannot make the MPS directories: {exc} (give --pipe-dir and "
                          "--log-dir where you may write)") from None
    import tempfile

    # its output to a file, not a pipe: a daemon that kept the pipe open would hold us
    with tempfile.TemporaryFile("w+") as said:
        try:
            done = subprocess.run([binary, "-d"], env=_env(pipe_dir, log_dir), timeout=wait_s,
                                  stdin=subprocess.DEVNULL, stdout=said, stderr=said)
        except subprocess.TimeoutExpired:
            raise DeviceError(f"{CONTROL} -d did not return within {wait_s:g} s") from None
        if done.returncode != 0:
            said.seek(0)
            raise DeviceError(f"{CONTROL} -d failed ({done.returncode}): "
                              f"{said.read().strip()[:300]}")
    deadline = time.monotonic() + wait_s
    while not found_in(pipe_dir):
        if time.monotonic() > deadline:
            raise DeviceError(f"the MPS control daemon did not open {pipe_dir / 'control'} "
                              f"within {wait_s:g} s (its log: {log_dir})")
        time.sleep(0.05)


#: the most of the pid file read: a PID is a few digits
_PID_FILE_BYTES = 64


def daemon_pid(pipe_dir: Path) -> str | None:
    """The daemon's PID from `<pipe_dir>/nvidia-cuda-mps-control.pid`; None when that is
    absent, not a regular file (a FIFO would block a plain read forever), or holds no PID.
    Opened without following a link and without blocking, read at most _PID_FILE_BYTES."""
    try:
        fd = os.open(pipe_dir / f"{CONTROL}.pid",
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, _PID_FILE_BYTES).strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text.decode() if text.isdigit() else None


def stop(pipe_dir: Path, timeout_s: float = 10.0) -> None:
    """Asks the daemon in `pipe_dir` to quit and waits at most `timeout_s` for it (its quit
    can hang: never waited for without a bound). Raises DeviceError on a timeout, naming
    the daemon's PID to kill."""
    import subprocess
    import time

    from hps.errors import DeviceError

    binary = _control()
    log_dir = log_directory(pipe_dir)
    deadline = time.monotonic() + timeout_s
    try:
        subprocess.run([binary], input="quit\n", env=_env(pipe_dir, log_dir),
                       timeout=timeout_s, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, text=True)
        while found_in(pipe_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
    except subprocess.TimeoutExpired:
        pass
    if found_in(pipe_dir):
        pid = daemon_pid(pipe_dir)
        how = (f"end it with `kill {pid}`" if pid else
               f"end it by hand: its pid file {pipe_dir / (CONTROL + '.pid')} names no PID "
               "(absent, not a regular file, or no number)")
        raise DeviceError(f"the MPS control daemon in {pipe_dir} did not quit within "
                          f"{timeout_s:g} s; {how}")
