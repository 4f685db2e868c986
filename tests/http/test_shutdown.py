"""`hps serve` stopped by SIGTERM or SIGINT: it drains (a request sent on a kept-alive
connection meanwhile is answered with `Connection: close`, not reset), closes every tier
(RocksDB shut down cleanly) and exits 0 (uvicorn's re-raised signal made it 143); with
`--workers 2` too."""

from __future__ import annotations

import copy
import http.client
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.http.conftest import ModelFiles
from tests.http.test_serve import Process, cli_env  # noqa: F401 - a fixture
from tests.http.test_workers import serve, stop, write_run
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


class KeptAliveClient:
    """Looks up keys over one kept-alive http.client connection in a loop, opening a new
    one when the server closes it, until a connection is refused (the server is gone)
    or `stop` is set; notes what each connection's end looked like."""

    def __init__(self, port: int, keys: np.ndarray, stop: threading.Event) -> None:
        self.port, self.body, self.stop = port, np.asarray(keys, "<i8").tobytes(), stop
        self.answers = 0
        self.closed_by_answer = 0  # connections the server closed after `Connection: close`
        self.resets: list[str] = []  # connections that broke without such an answer
        self.refused = False
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop.is_set():
            try:
                conn.request("POST", "/v1/models/m/tables/0/lookup", body=self.body,
                             headers={"Content-Type": "application/octet-stream"})
                answer = conn.getresponse()
                answer.read()
            except ConnectionRefusedError:
                self.refused = True
                return
            except (OSError, http.client.HTTPException) as exc:
                self.resets.append(f"{type(exc).__name__}: {exc}")
                conn.close()
                continue
            assert answer.status == 200, answer.status
            self.answers += 1
            self.started.set()
            if answer.getheader("connection", "").lower() == "close":
                self.closed_by_answer += 1
                conn.close()  # the next request opens a new connection


def test_workers_drain_on_sigterm_like_one_process(
        tmp_path: Path, model_files: ModelFiles) -> None:
    """`hps serve --workers 2` stopped by SIGTERM under 4 kept-alive clients: every
    client got a connection reset ~0.4 s in (one process resets none). Each connection
    now ends with an answer that says `Connection: close`, and a new one is refused
    once the server is gone, as with one process."""
    config, shm = write_run(tmp_path, model_files.config)
    served = serve(config, shm)
    stop_clients = threading.Event()
    clients: list[KeptAliveClient] = []
    try:
        keys = model_files.keys[0][:64]
        clients = [KeptAliveClient(served.port, keys, stop_clients) for _ in range(4)]
        for client in clients:
            assert client.started.wait(30), "a client got no answer"
        time.sleep(0.3)
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=60) == 0, "".join(served.seen)
        for client in clients:
            client.thread.join(timeout=30)
        assert all(c.refused for c in clients), [(c.answers, c.resets) for c in clients]
        assert [c.resets for c in clients] == [[]] * 4, [c.resets for c in clients]
        assert all(c.closed_by_answer >= 1 for c in clients), [
            c.closed_by_answer for c in clients]
    finally:
        stop_clients.set()
        stop(served)
