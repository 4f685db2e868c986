"""`hps serve --workers 2` as a user runs it: real processes on one port over one shared
table, several client processes, an update stream (a real redis-server) and a reload
while they read, a worker killed with SIGKILL, and the shared memory gone after a stop
and after the whole server was killed."""

from __future__ import annotations

import copy
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from hps.config import UpdateSourceConfig, load_config
from hps.errors import ConfigError
from hps.http.serve import worker_count
from hps.http.workers import check_workers
from hps.runtime.cores import usable_cores
from hps.runtime.run_dir import PREFIX
from hps.updates import codec
from hps.updates.open import open_publisher
from tests.http.conftest import (
    DIMS,
    TABLE_NAMES,
    ModelFiles,
    metric_value,
    wait_until,
    write_model,
)
from tests.http.test_confined_sources import linked_out
from tests.support.redis_servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
USERS = "hps_et.m.users"
UPDATED = 40  # keys of the users table the update stream rewrites


@dataclass
class Served:
    """`hps serve --workers 2` in a process of its own, its output read."""

    proc: subprocess.Popen[str]
    port: int
    shm: Path
    lines: queue.Queue[str]
    reader: threading.Thread
    seen: list[str] = field(default_factory=list)  # the lines wait_for has read

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self.reader.join(timeout=10)  # its last lines are in the queue
                    if self.lines.empty():
                        break
                continue
            self.seen.append(line)
            if text in line:
                return
        raise AssertionError(f"no {text!r}; output:\n{''.join(self.seen)}")

    def run_folder(self) -> Path:
        return self.shm / f"{PREFIX}{self.proc.pid}"

    def worker_pids(self) -> dict[int, int]:
        folder = self.run_folder() / "ops" / "workers"
        # (a worker's file is replaced through a hidden temporary one: not a worker)
        return {int(p.name): int(p.read_text()) for p in folder.iterdir()
                if not p.name.startswith(".")}


def _pythonpath() -> str:
    """This checkout first, then what the environment adds (the GPU machine's wheels)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def start(config: Path, shm: Path, *extra: str) -> Served:
    """`hps serve CONFIG --workers 2 EXTRA...` started (not waited for), its output read."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "HPS_SHM_DIR": str(shm)}
    env.pop("HPS_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port", str(port),
         "--workers", "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        with proc.stdout:  # closed at the end of the output: all its processes exited
            for line in proc.stdout:
                lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return Served(proc, port, shm, lines, reader)


def write_run(folder: Path, config: dict[str, Any]) -> tuple[Path, Path]:
    """`config` written to `folder`/ps.json and an empty `folder`/shm for the run
    folders: what start() and serve() take."""
    path = folder / "ps.json"
    path.write_text(json.dumps(config))
    shm = folder / "shm"
    shm.mkdir()
    return path, shm


def serve(config: Path, shm: Path, *extra: str) -> Served:
    """start(), then wait until every worker serves every model."""
    served = start(config, shm, *extra)
    served.wait_for("every model is loaded in every worker")
    return served


def stop(served: Served) -> int:
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGTERM)
    try:
        return served.proc.wait(timeout=60)
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("streams")).start()
    yield server
    server.close()


def run_with_updates(folder: Path, address: str, **model_block: Any
                     ) -> tuple[ModelFiles, Path, Path]:
    """The test model in `folder` (its first model's config keys `model_block` added),
    following the update stream of the Redis at `address`: what serve() takes."""
    model = write_model(folder / "model")
    config = copy.deepcopy(model.config)
    config["models"][0].update(model_block)
    config["update_source"] = {"type": "redis_stream", "address": address,
                               "poll_timeout_ms": 50, "failure_backoff_ms": 20}
    return model, *write_run(folder, config)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, streams: RedisServer
          ) -> tuple[ModelFiles, Path, Path]:
    return run_with_updates(tmp_path_factory.mktemp("workers"), streams.address)


def serving(setup: tuple[ModelFiles, Path, Path]) -> Iterator[Served]:
    """serve() of run_with_updates' run for a fixture: stopped when it is done."""
    _, config, shm = setup
    server = serve(config, shm)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def served(setup: tuple[ModelFiles, Path, Path]) -> Iterator[Served]:
    yield from serving(setup)


def _versions(model: ModelFiles) -> list[np.ndarray]:
    """The rows the update stream writes to the first UPDATED keys, by version."""
    rng = np.random.default_rng(9)
    return [rng.standard_normal((UPDATED, DIMS[0])).astype(np.float32) for _ in range(3)]


def _case(tmp: Path, model: ModelFiles) -> Path:
    """The keys the clients ask for and the rows each may have: the file's, or for the
    updated keys one of the versions the stream writes."""
    keys = model.keys[0]
    allowed = np.repeat(model.vectors[0][None], 4, axis=0)
    for i, rows in enumerate(_versions(model), start=1):
        allowed[i, :UPDATED] = rows
    path = tmp / "case.npz"
    np.savez(path, keys=keys, allowed=allowed)
    return path


def _clients(served: Served, case: Path, count: int, seconds: float
             ) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    return [subprocess.Popen([sys.executable, "-m", "tests.support.lookup_client",
                              str(served.port), "users", str(DIMS[0]), str(case),
                              str(seconds)], stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(count)]


def _results(clients: list[subprocess.Popen[str]]) -> list[dict[str, object]]:
    out = []
    for client in clients:
        stdout, _ = client.communicate(timeout=120)
        assert client.returncode == 0
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _lookup(served: Served, keys: np.ndarray) -> np.ndarray:
    answer = httpx.post(f"{served.url}/v1/models/m/tables/users/lookup",
                        content=keys.astype("<i8").tobytes(),
                        headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert answer.status_code == 200
    return np.frombuffer(answer.content, "<f4").reshape(-1, DIMS[0])


def load_with_updates_and_a_reload(served: Served, model: ModelFiles, address: str,
                                   tmp: Path, clients: int) -> list[dict[str, object]]:
    """`clients` client processes check every answer for 4 s while an update stream
    rewrites the first UPDATED keys and the model is reloaded: every answer 200 and
    exact. Then one more update, which every worker serves (new connections land on
    either worker). Returns the clients' results."""
    versions = _versions(model)
    keys = model.keys[0][:UPDATED]
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream", address=address))
    running = _clients(served, _case(tmp, model), count=clients, seconds=4.0)
    stop_publishing = threading.Event()

    def publish() -> None:
        i = 0
        while not stop_publishing.wait(0.05):
            publisher.publish(USERS, [codec.encode(keys, versions[i % 2])])
            i += 1

    publishing = threading.Thread(target=publish, daemon=True)
    publishing.start()
    time.sleep(1.0)
    reload = httpx.post(f"{served.url}/v1/models/m/reload", timeout=60)
    assert reload.status_code == 200, reload.text
    results = _results(running)
    stop_publishing.set()
    publishing.join()
    for result in results:
        assert set(result["statuses"]) == {"200"}, result  # no 5xx, no 503
        assert result["bad"] == 0 and result["rows"] > 0, result
        assert result["resets"] == 0, result

    # the leader applies the stream once; every worker serves what it wrote
    publisher.publish(USERS, [codec.encode(keys, versions[2])])
    wait_until(lambda: all(np.array_equal(_lookup(served, keys), versions[2])
                           for _ in range(8)), timeout=20)
    return results


def test_clients_updates_and_a_reload_every_answer_exact_no_5xx(
        served: Served, setup: tuple[ModelFiles, Path, Path], streams: RedisServer,
        tmp_path: Path) -> None:
    results = load_with_updates_and_a_reload(served, setup[0], streams.address, tmp_path,
                                             clients=3)
    answered = sum(r["statuses"]["200"] for r in results)

    def counted() -> float:  # the workers' counts, summed (a peer's within a second)
        return metric_value(httpx.get(f"{served.url}/metrics").text,
                            "hps_http_requests_total", code="200", method="POST",
                            route="/v1/models/{model}/tables/{table}/lookup")

    wait_until(lambda: counted() >= answered, timeout=10)
    # the leader's update figures, whichever worker answers (its peers' at most 1 s old)
    wait_until(lambda: all(metric_value(httpx.get(f"{served.url}/metrics").text,
                                        "hps_update_source_up", source="redis_stream") == 1
                           for _ in range(4)), timeout=10)
    ready = httpx.get(f"{served.url}/readyz")
    assert ready.status_code == 200 and ready.json()["loaded"] == ["m"]


def test_models_added_and_removed_reach_every_worker(
        served: Served, setup: tuple[ModelFiles, Path, Path]) -> None:
    model = setup[0]
    block = {**copy.deepcopy(model.config["models"][0]), "model": "m2"}
    added = httpx.post(f"{served.url}/v1/models", json=block, timeout=60)
    assert added.status_code == 201, added.text
    keys = model.keys[0][:50]
    for _ in range(8):  # new connections: each may land on either worker
        answer = httpx.post(f"{served.url}/v1/models/m2/tables/users/lookup",
                            json={"keys": keys.tolist()}, timeout=30)
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(np.asarray(answer.json()["vectors"], np.float32),
                                      model.vectors[0][:50])
        listed = httpx.get(f"{served.url}/v1/models").json()["models"]
        assert "m2" in [m["model"] for m in listed]
    assert httpx.delete(f"{served.url}/v1/models/m2", timeout=60).status_code == 200
    for _ in range(8):
        gone = httpx.post(f"{served.url}/v1/models/m2/tables/users/lookup",
                          json={"keys": [1]}, timeout=30)
        assert gone.status_code == 404, gone.text


def test_a_reload_after_a_fixed_typo_reads_the_file_in_every_worker(
        tmp_path: Path) -> None:
    """Workers hold copies of the config in the run folder; a reload without sources
    reads the file the server was started with, and its block reaches every worker."""
    model = write_model(tmp_path / "model")
    typo = copy.deepcopy(model.config)
    typo["models"][0]["sparse_files"][1] = str(model.dir / "itmes")
    config, shm = write_run(tmp_path, typo)
    served = start(config, shm)
    try:
        served.wait_for("serving on")
        deadline = time.monotonic() + 180

        def failed() -> bool:
            try:
                return "failed to load: m " in httpx.get(f"{served.url}/readyz", timeout=30).text
            except httpx.TransportError:  # a worker busy starting on a loaded machine
                return False

        while not failed():
            assert time.monotonic() < deadline, "the load never failed"
            time.sleep(0.2)
        config.write_text(json.dumps(model.config))
        answer = httpx.post(f"{served.url}/v1/models/m/reload", timeout=120)
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"{served.url}/readyz").status_code == 200
        for _ in range(8):  # new connections: each may land on either worker
            looked_up = httpx.post(f"{served.url}/v1/models/m/tables/items/lookup",
                                   json={"keys": model.keys[1][:5].tolist()}, timeout=30)
            assert looked_up.status_code == 200, looked_up.text
            np.testing.assert_array_equal(
                np.asarray(looked_up.json()["vectors"], np.float32), model.vectors[1][:5])
    finally:
        stop(served)


def test_a_removed_model_leaves_no_group_and_no_series_in_any_worker(
        served: Served, setup: tuple[ModelFiles, Path, Path], streams: RedisServer) -> None:
    """With workers too, removing a model takes the leader's consumer group off its
    streams and its series out of every worker's /metrics (each worker forgets its own:
    the one answering the DELETE, the others as they apply the op)."""
    import redis

    model = setup[0]
    block = {**copy.deepcopy(model.config["models"][0]), "model": "gone"}
    assert httpx.post(f"{served.url}/v1/models", json=block, timeout=60).status_code == 201
    client = redis.Redis(host=streams.host, port=int(streams.address.rsplit(":", 1)[1]))

    def groups() -> list[bytes]:  # the leader's consumer makes the stream in a round
        if not client.exists("hps_et.gone.users"):
            return []
        return [g["name"] for g in client.xinfo_groups("hps_et.gone.users")]

    def series() -> list[str]:  # fresh connections: either worker answers
        lines = []
        for _ in range(4):
            text = httpx.get(f"{served.url}/metrics", timeout=30).text
            lines += [line for line in text.splitlines()
                      if 'model="gone"' in line or "hps_et.gone." in line]
        return lines

    wait_until(lambda: len(groups()) == 1 and bool(series()), timeout=30)
    assert httpx.delete(f"{served.url}/v1/models/gone", timeout=60).status_code == 200
    wait_until(lambda: groups() == [] and not series(), timeout=30)
    assert client.exists("hps_et.gone.users")  # the stream stays for other replicas
    client.close()


def test_two_adds_of_one_name_at_once_one_409_in_any_worker(
        served: Served, setup: tuple[ModelFiles, Path, Path]) -> None:
    """Two concurrent `POST /v1/models` of one name, each maybe to another worker: the
    op log applies both in the leader, and the second's error (ModelExistsError, carried
    back through the log) is the 409 `model_exists` one process answers."""
    block = {**copy.deepcopy(setup[0].config["models"][0]), "model": "twice"}
    barrier = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def add() -> None:
        barrier.wait()
        answers.append(httpx.post(f"{served.url}/v1/models", json=block, timeout=60))

    threads = [threading.Thread(target=add) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(a.status_code for a in answers) == [201, 409], [a.text for a in answers]
    assert next(a for a in answers if a.status_code == 409).json()["error"]["kind"] == \
        "model_exists"
    assert httpx.delete(f"{served.url}/v1/models/twice", timeout=60).status_code == 200


def test_a_model_added_over_http_is_read_beneath_the_allowed_root(
        setup: tuple[ModelFiles, Path, Path], tmp_path: Path) -> None:
    """The worker that loads an added model opens its files beneath the request's allowed
    root, as one process does: a file linked out of its folder is refused (403), in no
    worker served."""
    model, config, shm = setup
    outside, inside = linked_out(tmp_path)
    served = serve(config, shm, "--allow-root", str(tmp_path / "models"))
    try:
        block = {**copy.deepcopy(outside.config["models"][0]), "model": "sneaky",
                 "sparse_files": [str(inside / t) for t in TABLE_NAMES]}
        added = httpx.post(f"{served.url}/v1/models", json=block, timeout=60)
        assert added.status_code == 403, added.text
        assert added.json()["error"]["kind"] == "source_access"
        for _ in range(6):  # new connections: each may land on either worker
            listed = httpx.get(f"{served.url}/v1/models").json()["models"]
            assert [m["model"] for m in listed] == [model.config["models"][0]["model"]]
    finally:
        assert stop(served) == 0


def test_a_worker_killed_is_replaced_and_the_table_survives(
        served: Served, setup: tuple[ModelFiles, Path, Path], tmp_path: Path) -> None:
    model = setup[0]
    before = served.worker_pids()
    clients = _clients(served, _case(tmp_path, model), count=2, seconds=4.0)
    time.sleep(1.0)
    os.kill(before[1], signal.SIGKILL)
    wait_until(lambda: served.worker_pids()[1] != before[1], timeout=30)
    results = _results(clients)
    for result in results:  # a connection on the killed worker may reset; no answer fails
        assert set(result["statuses"]) == {"200"}, result
        assert result["bad"] == 0, result
    later = _results(_clients(served, _case(tmp_path, model), count=2, seconds=1.5))
    for result in later:
        assert set(result["statuses"]) == {"200"} and result["resets"] == 0, result
        assert result["bad"] == 0, result
    keys = model.keys[1][:500]
    answer = httpx.post(f"{served.url}/v1/models/m/tables/items/lookup",
                        json={"keys": keys.tolist()}, timeout=30)
    np.testing.assert_array_equal(np.asarray(answer.json()["vectors"], np.float32),
                                  model.vectors[1][:500])


def test_no_shared_memory_is_left_after_a_stop_or_a_kill(
        served: Served, setup: tuple[ModelFiles, Path, Path]) -> None:
    _, config, shm = setup
    killed = served.run_folder()
    assert any((killed / "tables").iterdir())
    for pid in [*served.worker_pids().values(), served.proc.pid]:  # the whole server
        os.kill(pid, signal.SIGKILL)
    served.proc.wait(timeout=30)
    assert killed.exists()  # nothing could remove it...
    second = serve(config, shm)
    assert not killed.exists()  # ...until the next start on the host
    folder = second.run_folder()
    assert any((folder / "tables").iterdir())
    assert stop(second) == 0  # SIGTERM: every worker drains, the supervisor cleans up
    assert not folder.exists()
    assert not list(shm.iterdir())


def test_what_workers_cannot_serve_is_refused_up_front(
        setup: tuple[ModelFiles, Path, Path]) -> None:
    model = setup[0]
    base = {**copy.deepcopy(model.config), "http": {"workers": 2}}
    # Redis and RocksDB are served (tests/http/test_workers_tiers.py); a bounded hash
    # map is not: shared memory has a fixed capacity and no overflow policy
    with pytest.raises(ConfigError, match="overflow_margin"):
        check_workers(load_config(
            {**base, "volatile_db": {"type": "hash_map", "overflow_margin": 10}}), None)
    check_workers(load_config(
        {**base, "volatile_db": {"type": "redis_cluster", "overflow_margin": 10}}), None)
    check_workers(load_config(base), 9001)  # gRPC: served (tests/http/test_grpc_workers.py)
    assert worker_count("auto") == usable_cores()
    assert worker_count(3) == 3 and worker_count("2") == 2
    for bad in (0, "0", "many", -1, True, "2.5"):
        with pytest.raises(ConfigError, match="workers"):
            worker_count(bad)
    with pytest.raises(ConfigError, match="workers"):
        load_config({**base, "http": {"workers": 0}})
    assert load_config({**base, "http": {"workers": "auto"}}).http.workers == "auto"

