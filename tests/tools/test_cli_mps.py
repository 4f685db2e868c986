"""`hps mps start|status|stop`, run as a user runs it, against a stand-in for NVIDIA's
`nvidia-cuda-mps-control` (this machine has no GPU): a real program on PATH that, like the
real one, daemonizes with -d and opens a Unix socket `control` in $CUDA_MPS_PIPE_DIRECTORY,
and reads `quit` on its standard input without -d (or hangs on it, as the real one was
seen to)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = f"""#!{sys.executable}
import os, signal, socket, sys, time
pipes = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
pidfile = os.path.join(pipes, "nvidia-cuda-mps-control.pid")
if sys.argv[1:] == ["-d"]:
    if os.fork():
        time.sleep(0.2)
        sys.exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # as a daemon does
        os.dup2(devnull, fd)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.path.join(pipes, "control"))
    open(pidfile, "w").write(str(os.getpid()))
    def end(*_):
        os.unlink(os.path.join(pipes, "control"))
        sys.exit(0)
    signal.signal(signal.SIGTERM, end)
    while True:
        time.sleep(1)
command = sys.stdin.readline().strip()
if command == "quit":
    if os.environ.get("STAND_IN_HANGS"):
        time.sleep(600)
    os.kill(int(open(pidfile).read()), signal.SIGTERM)
"""


@pytest.fixture()
def control(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "nvidia-cuda-mps-control"
    program.write_text(STAND_IN)
    program.chmod(0o755)
    return bin_dir


def hps(*args: str, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", "mps", *args], capture_output=True, text=True,
        timeout=120, env={"PATH": path, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
                          "HOME": "/tmp", **env})


def test_start_status_stop(control: Path, tmp_path: Path) -> None:
    pipes, logs = tmp_path / "pipes", tmp_path / "logs"
    path = f"{control}:/usr/bin:/bin"
    assert hps("status", "--pipe-dir", str(pipes), path=path).returncode == 1
    started = hps("start", "--pipe-dir", str(pipes), "--log-dir", str(logs), path=path)
    assert started.returncode == 0, started.stderr
    assert f"export CUDA_MPS_PIPE_DIRECTORY={pipes}" in started.stdout
    assert logs.is_dir() and (pipes / "control").is_socket()
    status = hps("status", path=path, CUDA_MPS_PIPE_DIRECTORY=str(pipes))
    assert status.returncode == 0 and "running" in status.stdout
    again = hps("start", "--pipe-dir", str(pipes), path=path)
    assert again.returncode == 2 and "already runs" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    stopped = hps("stop", "--pipe-dir", str(pipes), path=path)
    assert stopped.returncode == 0, stopped.stderr
    assert not (pipes / "control").exists()
    assert hps("stop", "--pipe-dir", str(pipes), path=path).returncode == 1


def test_a_quit_that_hangs_is_bounded(control: Path, tmp_path: Path) -> None:
    pipes = tmp_path / "pipes"
    path = f"{control}:/usr/bin:/bin"
    assert hps("start", "--pipe-dir", str(pipes), path=path).returncode == 0
    pid = int((pipes / "nvidia-cuda-mps-control.pid").read_text())
    try:
        begun = time.monotonic()
        stopped = hps("stop", "--pipe-dir", str(pipes), "--timeout", "1", path=path,
                      STAND_IN_HANGS="1")
        assert time.monotonic() - begun < 30
        assert stopped.returncode == 2
        assert f"kill {pid}" in stopped.stderr and "did not quit within 1 s" in stopped.stderr
    finally:
        os.kill(pid, signal.SIGTERM)


def test_a_pid_file_that_is_a_fifo_does_not_hang_stop(control: Path, tmp_path: Path) -> None:
    """The pid file is read only when it is a regular file, a few bytes of it: a FIFO in
    its place (which a plain read waits on for a writer, forever) is named, not read."""
    pipes = tmp_path / "pipes"
    path = f"{control}:/usr/bin:/bin"
    assert hps("start", "--pipe-dir", str(pipes), path=path).returncode == 0
    pidfile = pipes / "nvidia-cuda-mps-control.pid"
    pid = int(pidfile.read_text())
    pidfile.unlink()
    os.mkfifo(pidfile)
    try:
        stopped = hps("stop", "--pipe-dir", str(pipes), "--timeout", "2", path=path,
                      STAND_IN_HANGS="1")  # returns: before, the call's 120 s ran out
        assert stopped.returncode == 2
        assert stopped.stderr.strip().splitlines() == [
            f"error: the MPS control daemon in {pipes} did not quit within 2 s; end it by "
            f"hand: its pid file {pidfile} names no PID (absent, not a regular file, or no "
            "number)"]
    finally:
        os.kill(pid, signal.SIGTERM)


def test_status_prints_a_start_that_runs_as_printed(control: Path, tmp_path: Path) -> None:
    pipes = tmp_path / "pipes"
    path = f"{control}:/usr/bin:/bin"
    status = hps("status", "--pipe-dir", str(pipes), path=path)
    assert status.returncode == 1
    hint = re.search(r"`(hps mps start[^`]*)` starts it", status.stdout)
    assert hint is not None, status.stdout
    started = hps(*shlex.split(hint.group(1))[2:], path=path)
    try:
        assert started.returncode == 0, started.stderr
        assert hps("status", "--pipe-dir", str(pipes), path=path).returncode == 0
    finally:
        assert hps("stop", "--pipe-dir", str(pipes), path=path).returncode == 0


def test_status_without_the_program_says_what_to_install(tmp_path: Path) -> None:
    """Where the control program is missing, `hps mps start` cannot help: the status
    says so, and what brings the program, instead of pointing at it."""
    status = hps("status", "--pipe-dir", str(tmp_path / "p"), path="/usr/bin:/bin")
    assert status.returncode == 1
    assert "starts it" not in status.stdout
    assert "nvidia-cuda-mps-control is not on PATH" in status.stdout
    assert "nvidia-compute-utils" in status.stdout
    assert "NVIDIA_DRIVER_CAPABILITIES" in status.stdout


def test_without_the_program_one_line(tmp_path: Path) -> None:
    done = hps("start", "--pipe-dir", str(tmp_path / "p"), path="/usr/bin:/bin")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: nvidia-cuda-mps-control is not on PATH: MPS comes with NVIDIA's driver on a "
        "GPU host (or its container image)"]
