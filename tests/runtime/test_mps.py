"""hps/runtime/mps.py: the MPS control daemon found by its endpoint (a Unix socket, as the
GPU machine's daemon makes it, or a FIFO), and one warning per process without it."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from hps.runtime import mps


@pytest.fixture()
def pipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(mps, "_warned", type(mps._warned)())
    return tmp_path


def test_no_endpoint_no_daemon(pipes: Path) -> None:
    assert mps.pipe_directory() == pipes
    assert not mps.daemon_found()
    (pipes / "control").write_text("")  # a plain file is no daemon's
    assert not mps.daemon_found()


def test_a_control_socket_is_a_daemon(pipes: Path) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(pipes / "control"))
    try:
        assert mps.daemon_found()
    finally:
        server.close()


def test_a_control_fifo_is_a_daemon(pipes: Path) -> None:
    os.mkfifo(pipes / "control")
    assert mps.daemon_found()


def test_a_process_mapping_a_shared_cache_is_warned_once(
        pipes: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hps"):
        mps.check_for_shared_cache()
        mps.check_for_shared_cache()
    warnings = [r.getMessage() for r in caplog.records if "MPS" in r.getMessage()]
    assert len(warnings) == 1
    assert str(pipes) in warnings[0] and "0.17x" in warnings[0]
    assert "nvidia-cuda-mps-control -d" in warnings[0]
