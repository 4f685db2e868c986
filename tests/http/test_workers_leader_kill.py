"""The leader of `hps serve --workers 2` killed with SIGKILL at points spread over a
reload, an add and a remove, while checking clients read: no lookup waits on what the
dead leader was doing.

One server serves the whole test: the supervisor starts the leader again after each kill
(it replays the op log, then applies the op it died in again). For each kill point the
test asserts that every lookup was answered (or refused with a 503) within MAX_WAIT
seconds, that no answer held a row of neither version, that `/readyz` said ready, and
only while a lookup on the same connection was answered right, and that serving was whole
again (the leader back, the op log finished, every worker ready and right) within
RESTORED seconds of the kill. The points are spread by a schedule of delays over the
time one such op takes on this machine (measured first), a little past its end.

The storms over RocksDB and a Redis stream of updates (a second server) check more: after
each kill, a reload with no kill, then every worker, each reached on a connection of its
own (found by the kernel's socket table), answers the version the reload reported, says
ready and knows the model; no worker dies of a signal (faulthandler on).
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hps.errors import TierUnavailableError
from hps.http.errors import status_of
from hps.http.workers import _Supervisor
from hps.http.workers_oplog import OpLog
from hps.runtime.run_dir import pid_alive
from tests.http.conftest import TABLE_NAMES, ModelFiles, write_model
from tests.http.test_workers import Served, _pythonpath, serve, stop, write_run
from tests.support.checking_clients import HUNG, CheckingClients, Expected

#: the longest a lookup may wait for its answer (or its 503)
MAX_WAIT = 5.0
#: seconds from a kill until serving is whole again
RESTORED = 10.0
#: kill points over a reload, an add and a remove
RELOAD_POINTS, ADD_POINTS, REMOVE_POINTS = 20, 3, 3
#: rows of the two tables: enough that a load takes a while to kill it in
SIZES = (100_000, 20_000)


@dataclass(frozen=True)
class Point:
    """One kill: what was killed in, when, and how long serving took to be whole."""

    op: str
    delay: float
    restored: float
    answer: int | None  # the op's own answer (None: its connection died with the leader)


def _keys(a: ModelFiles, b: ModelFiles, table: int) -> np.ndarray:
    """Keys of both versions, and a few neither has (their default)."""
    return np.concatenate([a.keys[table][:1500], b.keys[table][:1500],
                           np.array([-1, -2, 2**62], np.int64)]).astype(np.int64)


def _expected(a: ModelFiles, b: ModelFiles) -> list[Expected]:
    out = []
    for index, table in enumerate(TABLE_NAMES):
        keys = _keys(a, b, index)
        out.append(Expected("m", table, keys, (a.expected(index, keys),
                                               b.expected(index, keys))))
    keys = _keys(a, b, 0)  # m2 is version a's files; absent (404) before its add
    out.append(Expected("m2", "users", keys, (a.expected(0, keys),),
                        frozenset({404, 503})))
    return out


class ReadinessProbe:
    """A thread asking /readyz on a fresh connection, then (when it says ready) a lookup
    on the same one, so the same worker answers both: /readyz is truthful when every
    ready is followed by a right answer within MAX_WAIT."""

    def __init__(self, port: int, expected: Expected) -> None:
        self.port = port
        self.expected = expected
        self.untruthful: list[str] = []
        self.not_ready: list[str] = []
        self.slow: list[float] = []
        self.probes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ReadinessProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3 * HUNG)

    def _run(self) -> None:
        rng = np.random.default_rng(99)
        while not self._stop.wait(0.05):
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HUNG)
            try:
                sent = time.monotonic()
                conn.request("GET", "/readyz")
                ready = conn.getresponse()
                said = ready.read()
                if time.monotonic() - sent > MAX_WAIT:
                    self.slow.append(time.monotonic() - sent)
                if ready.status != 200:
                    self.not_ready.append(said.decode())
                    continue
                pick = rng.integers(0, self.expected.keys.size, 64)
                sent = time.monotonic()
                conn.request("POST", self.expected.path,
                             self.expected.keys[pick].astype("<i8").tobytes(),
                             {"Content-Type": "application/octet-stream"})
                answer = conn.getresponse()
                payload = answer.read()
                waited = time.monotonic() - sent
                self.probes += 1
                if answer.status != 200 or not self.expected.whole(pick, payload) or \
                        waited > MAX_WAIT:
                    self.untruthful.append(f"ready, then {answer.status} in {waited:.2f}s")
            except (OSError, http.client.HTTPException):
                pass  # the worker was killed under the probe: nothing said ready
            finally:
                conn.close()


def _files(version: ModelFiles) -> list[str]:
    return [str(version.dir / t) for t in TABLE_NAMES]


def _call(send: Callable[[], httpx.Response], out: dict[str, Any]) -> None:
    try:
        out["answer"] = send()
    except httpx.TransportError:  # sent to the leader, killed under it
        out["answer"] = None


def _op_log_finished(served: Served) -> bool:
    """Every op has the leader's outcome and both workers acked the last one."""
    ops = served.run_folder() / "ops"
    count = (ops / "log.jsonl").read_bytes().count(b"\n")
    if not all((ops / "outcomes" / str(seq)).exists() for seq in range(1, count + 1)):
        return False
    return all((ops / "acks" / str(i)).read_text() == str(count) for i in (0, 1))


def _whole(served: Served, expected: list[Expected]) -> bool:
    """Every worker, each on a connection of its own, finds /readyz ready and model m
    right."""
    m = expected[0]
    pick = np.arange(0, m.keys.size, 7)
    conns = _each_connection(served)
    if conns is None:
        return False
    try:
        for conn in conns.values():  # a loop over workers
            if _ask(conn, "GET", "/readyz")[0] != 200:
                return False
            status, payload = _ask(conn, "POST", m.path, m.keys[pick].astype("<i8").tobytes())
            if status != 200 or not m.whole(pick, payload):
                return False
    finally:
        for conn in conns.values():
            conn.close()
    return True


def _wait_restored(served: Served, leader: int, expected: list[Expected], killed: float
                   ) -> float:
    """Seconds from `killed` until the leader is back, the op log finished and serving
    whole; fails past 3 × RESTORED (the assertion on RESTORED comes later, with the
    others)."""
    while True:
        pid = served.worker_pids().get(0)
        if pid is not None and pid != leader and pid_alive(pid) and \
                _op_log_finished(served) and _whole(served, expected):
            return time.monotonic() - killed
        assert time.monotonic() - killed < 3 * RESTORED, "serving not whole again"
        time.sleep(0.05)


def _served_version(served: Served, expected: Expected) -> int:
    """The version of model m every worker serves (each on a connection of its own)."""
    pick = np.arange(expected.keys.size)
    conns = _each_connection(served, REACH_SECONDS)
    assert conns is not None, "not every worker answered"
    found = set()
    try:
        for conn in conns.values():  # a loop over workers
            status, payload = _ask(conn, "POST", expected.path,
                                   expected.keys[pick].astype("<i8").tobytes())
            assert status == 200, payload
            got = np.frombuffer(payload, "<f4").reshape(pick.size, -1)
            found.add(next(i for i, rows in enumerate(expected.versions)
                           if np.array_equal(rows, got)))
    finally:
        for conn in conns.values():
            conn.close()
    assert len(found) == 1, f"the workers serve different versions: {found}"
    return found.pop()


def _m2_served(served: Served, expected: Expected) -> bool:
    """Whether every worker serves m2 (each on a connection of its own; all agree, else
    it fails)."""
    conns = _each_connection(served, REACH_SECONDS)
    assert conns is not None, "not every worker answered"
    try:
        statuses = {_ask(conn, "POST", expected.path, b"\x01" + b"\x00" * 7)[0]
                    for conn in conns.values()}
    finally:
        for conn in conns.values():
            conn.close()
    assert statuses in ({200}, {404}), f"the workers disagree on m2: {statuses}"
    return statuses == {200}


class KillRun:
    """The server, its clients, and the kills (see the module)."""

    def __init__(self, served: Served, a: ModelFiles, b: ModelFiles) -> None:
        self.served = served
        self.versions = (a, b)
        self.expected = _expected(a, b)
        self.m2_block = {**copy.deepcopy(a.config["models"][0]), "model": "m2"}
        self.points: list[Point] = []

    def reload(self, version: int) -> Callable[[], httpx.Response]:
        body = {"sparse_files": _files(self.versions[version])}
        return lambda: httpx.post(f"{self.served.url}/v1/models/m/reload", json=body,
                                  timeout=120)

    def add(self) -> httpx.Response:
        return httpx.post(f"{self.served.url}/v1/models", json=self.m2_block, timeout=120)

    def remove(self) -> httpx.Response:
        return httpx.delete(f"{self.served.url}/v1/models/m2", timeout=120)

    def timed(self, send: Callable[[], httpx.Response], ok: int) -> float:
        """Seconds `send` takes with no kill (the span its kill points spread over)."""
        started = time.monotonic()
        answer = send()
        assert answer.status_code == ok, answer.text
        return time.monotonic() - started

    def kill_during(self, name: str, send: Callable[[], httpx.Response], delay: float
                    ) -> Point:
        """Send the op, kill the leader `delay` seconds later, wait until serving is
        whole; the op's answer once it comes."""
        leader = self.served.worker_pids()[0]
        out: dict[str, Any] = {}
        thread = threading.Thread(target=_call, args=(send, out), daemon=True)
        thread.start()
        time.sleep(delay)
        os.kill(leader, signal.SIGKILL)
        killed = time.monotonic()
        restored = _wait_restored(self.served, leader, self.expected, killed)
        thread.join(timeout=3 * RESTORED)
        assert not thread.is_alive(), f"{name}: its answer never came"
        answer = out["answer"]
        point = Point(name, delay, restored, None if answer is None else answer.status_code)
        self.points.append(point)
        return point


def _schedule(span: float, points: int) -> list[float]:
    """`points` delays spread over `span` seconds and a quarter past its end."""
    return [1.25 * span * (i + 0.5) / points for i in range(points)]


def test_leader_killed_in_reloads_adds_and_removes_never_hangs_a_lookup(
        tmp_path: Path) -> None:
    a = write_model(tmp_path / "models" / "a", seed=11, sizes=SIZES)
    b = write_model(tmp_path / "models" / "b", seed=12, sizes=SIZES)
    config, shm = write_run(tmp_path, a.config)
    # lookups on the lookup threads (as with a persistent tier): the path whose tasks
    # were found waiting in run_lookup
    served = serve(config, shm, "--allow-root", str(tmp_path / "models"),
                   "--lookup-threads", "2")
    run = KillRun(served, a, b)
    clients = CheckingClients(served.port, run.expected).start()
    probe = ReadinessProbe(served.port, run.expected[0]).start()
    try:
        version = _served_version(served, run.expected[0])
        reload_span = run.timed(run.reload(1 - version), 200)
        version = 1 - version
        for delay in _schedule(reload_span, RELOAD_POINTS):
            point = run.kill_during("reload", run.reload(1 - version), delay)
            now = _served_version(served, run.expected[0])
            if point.answer == 200:  # a reload that answers 200 changed the version
                assert now == 1 - version, point
            version = now
        add_span = run.timed(run.add, 201)
        remove_span = run.timed(run.remove, 200)
        for add_delay, remove_delay in zip(_schedule(add_span, ADD_POINTS),
                                           _schedule(remove_span, REMOVE_POINTS),
                                           strict=True):
            point = run.kill_during("add", run.add, add_delay)
            if point.answer == 201:
                assert _m2_served(served, run.expected[2]), point
            if not _m2_served(served, run.expected[2]):
                run.timed(run.add, 201)  # the add died with the leader: asked again
            point = run.kill_during("remove", run.remove, remove_delay)
            if point.answer == 200:
                assert not _m2_served(served, run.expected[2]), point
            if _m2_served(served, run.expected[2]):
                run.timed(run.remove, 200)
    finally:
        clients.stop()
        probe.stop()
        code = stop(served)
    answers = clients.answers
    waits = [x.waited for x in answers]
    report = {
        "points": len(run.points),
        "worst_wait_s": round(max(waits), 3),
        "restored_s": {op: [round(p.restored, 2) for p in run.points if p.op == op]
                       for op in ("reload", "add", "remove")},
        "answers": {str(s): sum(1 for x in answers if x.status == s)
                    for s in sorted({x.status for x in answers}, key=str)},
        "refused": sorted({f"{x.status} {x.model} {x.kind}" for x in answers
                           if x.status not in (None, 200)}),
        "readiness_probes": probe.probes,
    }
    print(json.dumps(report))
    assert len(run.points) == RELOAD_POINTS + ADD_POINTS + REMOVE_POINTS
    assert max(waits) <= MAX_WAIT, report
    assert not probe.slow, probe.slow
    wrong = [x for x in answers if x.status is not None and not x.right]
    assert not wrong, wrong[:5]
    assert not probe.untruthful, probe.untruthful[:5]
    # model m was served right all along (by the worker alive while the leader was
    # down, and by a leader started again once it replayed the log): a /readyz that said
    # otherwise would not be truthful either. m2 counts once every worker serves it, and
    # a worker on a version other than the server's is named (docs/workers.md).
    said = [b for b in map(json.loads, probe.not_ready) if "m" not in b["loaded"] or (
        b["loading"] != ["m2"] and b["status"] != "mixed_versions")]
    assert not said, said[:5]
    late = [p for p in run.points if p.restored > RESTORED]
    assert not late, late
    assert sum(1 for x in answers if x.status == 200) > 100 * len(run.points), report
    assert code == 0


def test_an_op_the_leader_dies_in_twice_is_failed_for_every_worker(tmp_path: Path) -> None:
    """The supervisor's guard against an op that kills the leader: one death, and the
    leader started again applies the op again; a second, and the op gets a failed
    outcome (a 503 for its request), so the followers and the ops after it go on."""
    oplog = OpLog(tmp_path)
    seq = oplog.append("load", "m", {"model": "m"})
    with socket.socket() as sock:
        supervisor = _Supervisor(tmp_path, 2, sock, None)
        supervisor._leader_died()
        assert oplog.outcome(seq) is None and oplog.unfinished() == seq
        supervisor._leader_died()
    done, error = oplog.outcome(seq)  # type: ignore[misc]
    assert done and isinstance(error, TierUnavailableError)
    assert "died 2 times" in str(error) and status_of(error) == 503
    assert oplog.unfinished() is None
    supervisor._leader_died()  # nothing left unfinished: nothing to fail


#: a worker started again: it registers in the run folder, says so and lives on
_SUCCESSOR = ("import sys, time; from pathlib import Path; "
              "from hps.http.workers_oplog import OpLog; OpLog(Path(sys.argv[1])).register(0); "
              "print('registered', flush=True); time.sleep(60)")


def test_a_leader_started_again_between_the_reads_leaves_the_models_served(
        tmp_path: Path) -> None:
    """`lowest_serving_ack` (the floor of the models /readyz lists) reads each worker's
    PID, serving mark and ack one file after another. The leader killed and started
    again between those reads (the successor's `register` puts the ack back to 0) must
    not pair the dead leader's serving mark with its successor's 0: every model left
    /readyz of the worker that answered. The read of the leader's serving mark is held
    (a FIFO) while the leader is killed and its successor registers."""
    oplog = OpLog(tmp_path)
    for _ in range(3):
        oplog.append("load", "m", {"model": "m"})
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (oplog.folder / "workers" / "0").write_text(str(leader.pid))
    oplog.ack(0, 3)
    oplog.register(1)  # this process is worker 1, the one that answers
    oplog.ack(1, 3)
    oplog.mark_serving(1)
    mark = oplog.folder / "serving" / "0"
    os.mkfifo(mark)
    successor: list[subprocess.Popen[str]] = []

    def restart_during_the_read() -> None:
        with open(mark, "w") as held:  # opens once the reader reads the mark
            leader.kill()
            leader.wait()
            successor.append(subprocess.Popen(
                [sys.executable, "-c", _SUCCESSOR, str(tmp_path)], stdout=subprocess.PIPE,
                text=True, env={**os.environ, "PYTHONPATH": _pythonpath()}))
            assert successor[0].stdout is not None
            assert successor[0].stdout.readline() == "registered\n"
            held.write(str(leader.pid))  # the mark the dead leader left

    thread = threading.Thread(target=restart_during_the_read, daemon=True)
    thread.start()
    try:
        floor = oplog.lowest_serving_ack()
        thread.join(timeout=30)
        assert oplog.acked(0) == 0 and oplog.live_workers() == [0, 1]  # the successor's
        assert floor == 3  # worker 1's: the successor serves nobody yet
    finally:
        for proc in (leader, *successor):
            proc.kill()
            proc.communicate()  # reaped, its output pipe closed


#: storms over RocksDB and an update stream: each a reload the leader is killed in, then
#: a reload with no kill after which every worker is checked
STORMS = 4
STORM_SIZES = (20_000, 5_000)
#: update messages a second the stream carries through the storms (rows of keys that no
#: version's files hold: the checked keys keep their versions' rows)
UPDATE_RATE = 10
#: seconds of fresh connections until each worker has answered one (a worker started
#: again answers once it replayed the log)
REACH_SECONDS = 20.0


def answering_worker(conn: http.client.HTTPConnection, port: int, pids: dict[int, int]
                     ) -> int | None:
    """The worker whose process holds the server side of `conn` (a connection that was
    answered: accepted), from the kernel's socket table and the workers' descriptors."""
    assert conn.sock is not None
    want = f"0100007F:{port:04X} 0100007F:{conn.sock.getsockname()[1]:04X}"
    rows = (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
    inode = next((row[9] for row in rows if f"{row[1]} {row[2]}" == want), None)
    for index, pid in pids.items():  # a loop over workers
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:  # a loop over its descriptors
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return index
            except OSError:
                continue
    return None


def worker_connections(served: Served, seconds: float) -> dict[int, http.client.HTTPConnection]:
    """An open connection answered by each worker that answers within `seconds`: fresh
    ones, each held while the next opens (a worker accepts only while it holds no more
    connections than another: hps/http/accept_share.py, so a held one sends the next to
    the others), until every worker holds one. The caller closes them."""
    found: dict[int, http.client.HTTPConnection] = {}
    held: list[http.client.HTTPConnection] = []  # a worker's second and later
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            pids = served.worker_pids()
            if found and set(found) >= set(pids):
                break
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=HUNG)
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                time.sleep(0.02)
                continue
            index = answering_worker(conn, served.port, pids)
            if index is None or index in found:
                held.append(conn)
                if len(held) > 64:  # a worker not taking any: start over
                    for c in held:
                        c.close()
                    held.clear()
                    time.sleep(0.02)
            else:
                found[index] = conn
    finally:
        for conn in held:
            conn.close()
    return found


def _each_connection(served: Served, seconds: float = 2.0
                     ) -> dict[int, http.client.HTTPConnection] | None:
    """worker_connections, or None (all closed) where a worker was not reached."""
    conns = worker_connections(served, seconds)
    if set(conns) >= set(served.worker_pids()):
        return conns
    for conn in conns.values():
        conn.close()
    return None


def _ask(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None
         ) -> tuple[int, bytes]:
    conn.request(method, path, body,
                 {"Content-Type": "application/octet-stream"} if body is not None else {})
    answer = conn.getresponse()
    return answer.status, answer.read()


@dataclass(frozen=True)
class WorkerView:
    """What one worker answered on one connection."""

    ready: int  # /readyz's status
    model: int  # GET /v1/models/m's status
    version: int | None  # the version its rows of the probe keys are (None: neither)


def each_worker(served: Served, expected: Expected) -> dict[int, WorkerView]:
    """/readyz, GET /v1/models/m and a lookup of every probe key asked of each worker (on
    a connection of its own: worker_connections)."""
    pick = np.arange(expected.keys.size)
    conns = worker_connections(served, REACH_SECONDS)
    views: dict[int, WorkerView] = {}
    try:
        for index, conn in conns.items():  # a loop over workers
            ready, _ = _ask(conn, "GET", "/readyz")
            model, _ = _ask(conn, "GET", "/v1/models/m")
            status, payload = _ask(conn, "POST", expected.path,
                                   expected.keys.astype("<i8").tobytes())
            version = None
            if status == 200:
                got = np.frombuffer(payload, "<f4").reshape(pick.size, -1)
                version = next((i for i, rows in enumerate(expected.versions)
                                if np.array_equal(rows, got)), None)
            views[index] = WorkerView(ready, model, version)
    finally:
        for conn in conns.values():
            conn.close()
    if set(views) >= set(served.worker_pids()):
        return views
    raise AssertionError(f"not every worker answered in {REACH_SECONDS:.0f}s: {views}")


class Publisher:
    """UPDATE_RATE messages a second on the users table's stream, of keys no version
    holds, until stopped: the leader writes them to RocksDB (WAL), the follower follows."""

    def __init__(self, address: str) -> None:
        from hps.config import UpdateSourceConfig
        from hps.updates.open import open_publisher

        self.publisher = open_publisher(UpdateSourceConfig(type="redis_stream",
                                                           address=address))
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from hps.updates import codec

        keys = (2**60 + np.arange(40)).astype(np.int64)
        rng = np.random.default_rng(5)
        while not self._stop.wait(1 / UPDATE_RATE):
            rows = rng.standard_normal((keys.size, 8)).astype(np.float32)
            self.publisher.publish("hps_et.m.users", [codec.encode(keys, rows)])
            self.sent += 1


def _exits(lines: list[str]) -> list[str]:
    """The supervisor's lines on workers that exited (with their status)."""
    return [line.strip() for line in lines if "exited with status" in line]


def test_leader_killed_in_reloads_over_rocksdb_and_updates_every_worker_serves_the_version(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A storm: `--workers 2`, a RocksDB persistent tier and a Redis
    stream of updates, the leader killed with SIGKILL in reloads. After each kill, a
    reload with no kill: it answers 200 only when every worker serves the new version,
    and then each worker (reached on a connection of its own) answers that version, says
    ready and knows the model. No worker dies of a signal (faulthandler on)."""
    from tests.support.redis_servers import RedisServer

    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    a = write_model(tmp_path / "models" / "a", seed=11, sizes=STORM_SIZES)
    b = write_model(tmp_path / "models" / "b", seed=12, sizes=STORM_SIZES)
    redis = RedisServer(tmp_path / "redis").start()
    config = copy.deepcopy(a.config)
    config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    config["update_source"] = {"type": "redis_stream", "address": redis.address,
                               "poll_timeout_ms": 50, "failure_backoff_ms": 20}
    path, shm = write_run(tmp_path, config)
    served = serve(path, shm, "--allow-root", str(tmp_path / "models"),
                   "--lookup-threads", "2")
    run = KillRun(served, a, b)
    clients = CheckingClients(served.port, run.expected[:2]).start()
    publisher = Publisher(redis.address).start()
    mismatched: list[str] = []
    refused: list[str] = []
    try:
        version = _served_version(served, run.expected[0])
        span = run.timed(run.reload(1 - version), 200)
        version = 1 - version
        for storm in range(STORMS):
            run.kill_during("reload", run.reload(1 - version), span * (storm + 0.5) / STORMS)
            views = each_worker(served, run.expected[0])
            now = {v.version for v in views.values()}
            if len(now) != 1 or None in now:
                mismatched.append(f"storm {storm}, after the kill: {views}")
            version = views[0].version if views[0].version is not None else version
            answer = run.reload(1 - version)()
            if answer.status_code != 200:
                refused.append(f"storm {storm}: {answer.status_code} {answer.text}")
                continue
            version = 1 - version
            views = each_worker(served, run.expected[0])
            if any(v != WorkerView(200, 200, version) for v in views.values()):
                mismatched.append(f"storm {storm}, reload to {version} answered 200: {views}")
    finally:
        publisher.stop()
        clients.stop()
        code = stop(served)
        redis.close()
        while not served.lines.empty():
            served.seen.append(served.lines.get_nowait())
    killed = {p.op for p in run.points}
    exits = _exits(served.seen)
    by_signal = [e for e in exits if "status -" in e and "status -9" not in e]
    answers = clients.answers
    wrong = [x for x in answers if x.status is not None and not x.right]
    report = {"storms": STORMS, "kills": len(run.points), "updates_sent": publisher.sent,
              "lookups": len(answers), "wrong": len(wrong), "mismatched": len(mismatched),
              "refused_reloads": len(refused), "exits": exits,
              "not_found": sum(1 for x in answers if x.status == 404),
              "errors": [line.strip()[:300] for line in served.seen if " ERROR " in line][:8]}
    print(json.dumps(report))
    assert killed == {"reload"}
    assert not by_signal and not any("Fatal Python error" in line for line in served.seen), \
        report
    assert not wrong, wrong[:5]
    assert not mismatched, mismatched
    assert not refused, refused
    assert report["not_found"] == 0, report
    assert publisher.sent > 0 and code == 0
