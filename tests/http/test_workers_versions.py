"""Every worker of `hps serve --workers N` serves the version the server says, or the
server says which does not: /readyz, the v2 readiness routes and `GET /v1/models` read
the versions the workers publish in the run folder (hps/http/workers_versions.py).

Two ways in: the version board of a run folder made here, with a second process as the
other worker, read by a real one-process server's HTTP and gRPC routes (each case of
which worker is named, and which is not); and a real `hps serve --workers 2` whose
follower is stopped (SIGSTOP) during a reload, with a short `HPS_WORKER_ACK_WAIT_S`: the
reload answers 503 naming it, /readyz names it while it is held, and once it runs again
it catches up, /readyz is 200 and every worker (each on a connection of its own) serves
the new version.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.grpc as triton

from hps.errors import ConfigError, TierError
from hps.http.workers_oplog import OpLog
from hps.http.workers_ops import ACK_WAIT, ACK_WAIT_ENV, ack_wait
from hps.http.workers_versions import VersionBoard
from tests.http.conftest import Live, ModelFiles, serving, wait_until, write_model
from tests.http.grpc_support import grpc_beside
from tests.http.test_workers import _pythonpath, serve, start, stop, write_run
from tests.http.test_workers_leader_kill import WorkerView, _expected, _files, each_worker
from tests.support.checking_clients import HUNG

#: the seconds a reload waits for every worker in the test with a stopped follower
SHORT_WAIT = 3

#: another worker of the run: worker 1, taking requests when argv[2] says so, publishing
#: the versions each line of its input gives (a JSON object) and saying so each time
_PEER = """
import json, sys
from pathlib import Path
from hps.http.workers_oplog import OpLog
from hps.http.workers_versions import VersionBoard
oplog = OpLog(Path(sys.argv[1]))
oplog.register(1)
if sys.argv[2] == "serving":
    oplog.mark_serving(1)
board = VersionBoard(oplog, 1)
print("registered", flush=True)
for line in sys.stdin:
    board.publish(json.loads(line))
    print("published", flush=True)
"""


class Peer:
    """Worker 1 of the run folder `folder`, a process of its own (see _PEER)."""

    def __init__(self, folder: Path, serving: bool = True) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PEER, str(folder), "serving" if serving else "starting"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": _pythonpath()})
        self._said("registered")

    def _said(self, word: str) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == word + "\n"

    def publish(self, versions: dict[str, int]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(versions) + "\n")
        self.proc.stdin.flush()
        self._said("published")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate()  # reaped: a dead worker, its pipes closed


@contextlib.contextmanager
def peer(folder: Path, serving: bool = True) -> Iterator[Peer]:
    worker = Peer(folder, serving)
    try:
        yield worker
    finally:
        worker.kill()


def _done(oplog: OpLog, kind: str, error: BaseException | None = None) -> int:
    """An op of model m the leader completed (failed with `error`); its number."""
    seq = oplog.append(kind, "m", {"model": "m"} if kind != "unload" else None)
    oplog.set_outcome(seq, error)
    return seq


def _said(live: Live) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """/readyz's status and body, and GET /v1/models/m's body."""
    ready = live.client.get("/readyz")
    return ready.status_code, ready.json(), live.client.get("/v1/models/m").json()


def test_readyz_names_a_worker_that_serves_another_version(
        tmp_path: Path, model_files: ModelFiles) -> None:
    """This process is worker 0, a second process worker 1; the routes of a real server
    read the board of their run folder. Named: a live worker that takes requests and
    serves another version than the last load the leader completed (or one the server
    no longer serves); not named: a dead one, and one started again that has not
    replayed the log yet."""
    oplog = OpLog(tmp_path)
    oplog.register(0)
    oplog.mark_serving(0)
    board = VersionBoard(oplog, 0)
    with serving(model_files) as live, peer(tmp_path) as other, \
            grpc_beside(live) as address:
        live.app.state.hps.versions = board
        grpc = triton.InferenceServerClient(url=address)
        first = _done(oplog, "load")
        board.publish({"m": first})
        other.publish({"m": first})
        status, body, model = _said(live)
        assert status == 200 and "versions" not in body, body
        assert model["version"] == first
        assert model["workers"] == [{"worker": 0, "version": first},
                                    {"worker": 1, "version": first}]

        reload = _done(oplog, "load")  # the leader (this process) applied it
        board.publish({"m": reload})
        status, body, model = _said(live)
        lag = {"worker": 1, "model": "m", "version": first, "server_version": reload}
        assert status == 503 and body["status"] == "mixed_versions", body
        assert body["versions"] == [lag] and body["loaded"] == ["m"]
        assert body["error"] == {"kind": "not_ready", "message": (
            f"not every worker serves the server's version: worker 1 serves version "
            f"{first} of model 'm', the server's is {reload}")}
        assert model["version"] == reload and model["ready"] is True
        assert model["workers"] == [{"worker": 0, "version": reload},
                                    {"worker": 1, "version": first}]
        assert [t["name"] for t in model["tables"]] == ["users", "items"]  # as before
        v2 = live.client.get("/v2/health/ready")
        assert v2.status_code == 400 and "worker 1 serves version" in v2.text, v2.text
        v2 = live.client.get("/v2/models/m/ready")
        assert v2.status_code == 400 and "worker 1 serves version" in v2.text, v2.text
        assert not grpc.is_server_ready() and not grpc.is_model_ready("m")

        other.publish({"m": reload})  # it caught up
        status, body, model = _said(live)
        assert status == 200 and "versions" not in body, body
        assert {w["version"] for w in model["workers"]} == {reload}
        assert live.client.get("/v2/health/ready").status_code == 200
        assert live.client.get("/v2/models/m/ready").status_code == 200
        assert grpc.is_server_ready() and grpc.is_model_ready("m")
        grpc.close()

        _done(oplog, "load", TierError("refused"))  # a failed reload changes nothing
        assert live.client.get("/readyz").status_code == 200

        removed = _done(oplog, "unload")  # worker 1 still serves what the server removed
        board.publish({})
        status, body, _ = _said(live)
        assert status == 503 and body["versions"] == [
            {"worker": 1, "model": "m", "version": reload, "server_version": None}], body
        assert "which the server no longer serves" in body["error"]["message"]
        assert removed > reload

        loaded = _done(oplog, "add")  # the model again; worker 1 has it not yet
        board.publish({"m": loaded})
        other.publish({})
        status, body, _ = _said(live)
        assert status == 503 and body["versions"] == [
            {"worker": 1, "model": "m", "version": None, "server_version": loaded}], body
        assert "worker 1 serves no version of model 'm'" in body["error"]["message"]

        other.kill()  # a dead worker is not waited for
        assert live.client.get("/readyz").status_code == 200
        with peer(tmp_path, serving=False) as again:  # started again, replaying
            assert oplog.live_workers() == [0, 1]
            assert live.client.get("/readyz").status_code == 200
            again.publish({})  # its own file, but it takes no requests yet
            assert live.client.get("/readyz").status_code == 200
            # replayed: it takes requests (the mark its process writes), on no version
            (oplog.folder / "serving" / "1").write_text(str(again.proc.pid))
            assert live.client.get("/readyz").json()["versions"][0]["worker"] == 1
            again.publish({"m": loaded})
            assert live.client.get("/readyz").status_code == 200


def test_one_process_answers_no_versions(live: Live) -> None:
    """Without workers /readyz and GET /v1/models say what they said before."""
    ready = live.client.get("/readyz")
    assert ready.status_code == 200
    assert set(ready.json()) == {"status", "loaded", "loading", "failed", "degraded"}
    assert set(live.client.get("/v1/models/m").json()) == {"model", "ready", "tables"}
    listed = live.client.get("/v1/models").json()["models"]
    assert [set(m) for m in listed] == [{"model", "ready", "tables"}]


def test_the_ack_wait_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACK_WAIT_ENV, raising=False)
    assert ack_wait() == ACK_WAIT == 120
    monkeypatch.setenv(ACK_WAIT_ENV, " 2.5 ")
    assert ack_wait() == 2.5
    for bad in ("0", "-1", "nan", "inf", "2s", "soon"):
        monkeypatch.setenv(ACK_WAIT_ENV, bad)
        with pytest.raises(ConfigError, match=ACK_WAIT_ENV):
            ack_wait()


def test_serve_refuses_an_ack_wait_that_is_no_number_of_seconds(
        tmp_path: Path, model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACK_WAIT_ENV, "soon")
    served = start(*write_run(tmp_path, model_files.config))
    code = served.proc.wait(timeout=120)
    served.reader.join(timeout=10)
    output = "".join(served.lines.queue)
    assert code == 2, output
    assert f"{ACK_WAIT_ENV}='soon'" in output and "Traceback" not in output, output


def _readyz(url: str) -> httpx.Response:
    """/readyz on a fresh connection (with the follower stopped: the leader answers)."""
    return httpx.get(url + "/readyz", timeout=HUNG)


def test_a_follower_held_in_a_reload_is_named_until_it_catches_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACK_WAIT_ENV, str(SHORT_WAIT))
    a = write_model(tmp_path / "models" / "a", seed=11)
    b = write_model(tmp_path / "models" / "b", seed=12)
    expected = _expected(a, b)[0]  # model m's users: version 0 is a's rows, 1 is b's
    served = serve(*write_run(tmp_path, a.config), "--allow-root", str(tmp_path / "models"))
    follower = None
    try:
        assert set(each_worker(served, expected).values()) == {WorkerView(200, 200, 0)}
        before = httpx.get(served.url + "/v1/models/m", timeout=HUNG).json()["version"]
        follower = served.worker_pids()[1]
        os.kill(follower, signal.SIGSTOP)
        sent = time.monotonic()
        answer = httpx.post(served.url + "/v1/models/m/reload", timeout=120,
                            json={"sparse_files": _files(b)})
        waited = time.monotonic() - sent
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["kind"] == "workers_behind", answer.text
        assert f"worker(s) 1 did not apply it within {SHORT_WAIT}s" in \
            answer.json()["error"]["message"]

        ready = _readyz(served.url)
        model = httpx.get(served.url + "/v1/models/m", timeout=HUNG).json()
        after = model["version"]
        assert after > before
        assert ready.status_code == 503 and ready.json()["status"] == "mixed_versions"
        assert ready.json()["versions"] == [{"worker": 1, "model": "m", "version": before,
                                             "server_version": after}], ready.text
        assert model["workers"] == [{"worker": 0, "version": after},
                                    {"worker": 1, "version": before}]
        for route in ("/v2/health/ready", "/v2/models/m/ready"):
            v2 = httpx.get(served.url + route, timeout=HUNG)
            assert v2.status_code == 400 and "worker 1 serves version" in v2.text, v2.text

        os.kill(follower, signal.SIGCONT)
        follower = None
        wait_until(lambda: _readyz(served.url).status_code == 200, timeout=60)
        assert set(each_worker(served, expected).values()) == {WorkerView(200, 200, 1)}
        model = httpx.get(served.url + "/v1/models/m", timeout=HUNG).json()
        assert model["workers"] == [{"worker": 0, "version": after},
                                    {"worker": 1, "version": after}]
        print(json.dumps({"ack_wait_s": SHORT_WAIT, "reload_answered_503_in_s":
                          round(waited, 2)}))
    finally:
        if follower is not None:
            os.kill(follower, signal.SIGCONT)
        code = stop(served)
    assert code == 0
