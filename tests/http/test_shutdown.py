"""`hps serve` stopped by SIGTERM or SIGINT: it drains (a request sent on a kept-alive
connection meanwhile is answered with `Connection: close`, not reset), closes every tier
(RocksDB shut down cleanly) and exits 0 (uvicorn's re-raised signal made it 143)."""

from __future__ import annotations

import copy
import json
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.http.conftest import ModelFiles
from tests.http.test_serve import Process, cli_env  # noqa: F401 - a fixture
from tests.support.redis_servers import free_port


def _get(sock: socket.socket, port: int) -> tuple[int, dict[str, str]]:
    """GET /healthz on `sock`; (status, headers) of the answer."""
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"reset or closed without an answer: {data!r}"
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:])}
    return int(head[0].split()[1]), headers


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_closes_the_tiers_and_exits_0(
        tmp_path: Path, model_files: ModelFiles, cli_env: dict[str, str],  # noqa: F811
        signum: int) -> None:
    config = copy.deepcopy(model_files.config)
    config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    port = free_port()
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(path), "--port",
                    str(port)], cli_env)
    try:
        proc.wait_for("every model is loaded")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as kept:
            assert _get(kept, port) == (200, _get(kept, port)[1])  # kept alive: two answers
            proc.proc.send_signal(signum)
            deadline = time.monotonic() + 10
            while not _refused(port):  # the listener closes first: the drain has begun
                assert time.monotonic() < deadline, "still accepting after the signal"
                time.sleep(0.02)
            status, headers = _get(kept, port)
            assert status == 200
            assert headers.get("connection") == "close"
        assert proc.proc.wait(timeout=30) == 0, "".join(proc.seen)
        proc.wait_for("every tier closed", timeout=5)
        # RocksDB flushed and closed: its write-ahead logs hold nothing to replay
        wal = list((tmp_path / "rocks").rglob("*.log"))
        assert wal and all(p.stat().st_size == 0 for p in wal), [
            (p.name, p.stat().st_size) for p in wal]
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
        if proc.proc.stdout is not None:
            proc.proc.stdout.close()
