"""Ready means fast: `hps serve` as a user runs it (one process, and `--workers 2`), on an
empty numba cache, says ready only once every process that answers lookups has run each
table's lookup path, so its first lookups, of every key dtype the routes take, JSON and
binary, /v1 and KServe v2, all answer 200 with the right vectors, and nothing compiles
after ready, the first online update's writes included
(`hps_compiles_total{phase="after_ready"}` stays 0, summed over workers), a big update
round after a restart over the RocksDB store and an update past a bounded hash map's
margin included; a compile after ready is counted and its
function named in the log.
And the workers import the `hps` their supervisor imported, whatever the working folder.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from hps.config import UpdateSourceConfig
from hps.http import create_app
from hps.http.serve import ServerThread
from hps.runtime.compile_on_use import on_use
from hps.server import HierarchicalParameterServer, parameter_server
from hps.server.host_lookup import HostLookup
from hps.server.warm_paths import KEY_DTYPES as WARMED_DTYPES
from hps.updates import codec
from hps.updates.applier import BULK_ROWS
from hps.updates.open import open_publisher
from tests.http.conftest import (
    DIMS,
    MODEL,
    READY_WAIT,
    TABLE_NAMES,
    ModelFiles,
    metric_value,
    wait_until,
    write_model,
)
from tests.support.redis_servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
#: how long `hps serve` may take to say ready on an empty numba cache (loaded 2 cores)
SERVE_WAIT = 240.0
KEY_DTYPES = {"int64": "<i8", "int32": "<i4", "uint32": "<u4", "uint64": "<u8"}
V2_DTYPES = {"int64": "INT64", "int32": "INT32", "uint32": "UINT32", "uint64": "UINT64"}
Start = Callable[..., tuple[subprocess.Popen[str], str]]
#: key counts of the first lookups: one key, a few, and batches whose rows pass the
#: 64 KiB at which the fetch loops change twins (width 64: 256 keys; width 8: 2,048)
SIZES = (1, 7, 300, 3000)


def _model(folder: Path, streams: RedisServer | None = None) -> tuple[ModelFiles, Path]:
    """The HTTP tests' model (widths 8 and 64) over the hash map and RocksDB, as the
    demo serves it, its ps.json written beside it; with `streams`, its online updates
    from that Redis's streams."""
    model = write_model(folder / "model")
    config = {**model.config, "persistent_db": {"type": "rocksdb",
                                                "path": str(folder / "rocksdb")}}
    if streams is not None:
        config["update_source"] = {"type": "redis_stream", "address": streams.address,
                                   "group": folder.name, "poll_timeout_ms": 50}
    path = folder / "ps.json"
    path.write_text(json.dumps(config))
    return model, path


def _hps_command() -> list[str]:
    """`hps` as a user runs it: the console script beside this interpreter."""
    script = Path(sys.executable).with_name("hps")
    assert script.exists(), f"no hps command beside {sys.executable}: pip install -e ."
    return [str(script)]


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Start]:
    """Starts `hps serve PS.JSON --port P EXTRA...` on an empty numba cache folder from
    `cwd`; stops what it started."""
    procs: list[subprocess.Popen[str]] = []
    logs: list[Any] = []

    def start(config: Path, *extra: str, cwd: Path | None = None
              ) -> tuple[subprocess.Popen[str], str]:
        cache = tmp_path / f"numba-{len(procs)}"
        cache.mkdir()
        shm = tmp_path / f"shm-{len(procs)}"
        shm.mkdir()
        port = free_port()
        env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "HPS_SHM_DIR": str(shm),
               "PYTHONPATH": os.pathsep.join(
                   p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        env.pop("HPS_TOKEN", None)
        log = open(tmp_path / f"serve-{len(procs)}.log", "w")  # noqa: SIM115
        logs.append(log)
        proc = subprocess.Popen([*_hps_command(), "serve", str(config), "--port", str(port),
                                 *extra], stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=cwd or tmp_path)
        procs.append(proc)
        assert not any(cache.iterdir()), "the numba cache folder is not empty"
        return proc, f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()


def _wait_ready(proc: subprocess.Popen[str], url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVE_WAIT
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"hps serve exited:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not ready within {SERVE_WAIT:.0f}s:\n{log.read_text()}")


def _first_lookups(url: str, model: ModelFiles) -> list[tuple[str, int, str]]:
    """The first lookups after ready: (what, status, body if not 200) of each; every
    200's vectors checked against the model's files."""
    rng = np.random.default_rng(5)
    answers: list[tuple[str, int, str]] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for size in SIZES:
            for table, dim in enumerate(DIMS):
                keys = model.sample_keys(rng, table, size - size // 4, size // 4)
                if size == 1:
                    keys = model.keys[table][:1]
                for name, dtype in KEY_DTYPES.items():
                    sent = keys
                    if "32" in name:  # the table's keys that fit, and as many that it lacks
                        fit = keys[(keys >= 0) & (keys < 2**31)]
                        sent = np.concatenate([fit, np.arange(keys.size - fit.size) + 2**20])
                    if name == "uint64":
                        sent = sent.view(np.uint64)
                    answer = client.post(
                        f"/v1/models/{MODEL}/tables/{table}/lookup",
                        content=sent.astype(dtype).tobytes(),
                        headers={"Content-Type": "application/octet-stream",
                                 "X-HPS-Key-Dtype": name})
                    answers.append((f"binary {name} x{sent.size} table {table}",
                                    answer.status_code, answer.text[:300]
                                    if answer.status_code != 200 else ""))
                    if answer.status_code == 200:
                        got = np.frombuffer(answer.content, "<f4").reshape(-1, dim)
                        np.testing.assert_array_equal(
                            got, model.expected(table, sent.astype(np.int64)))
                answer = client.post(f"/v1/models/{MODEL}/tables/{table}/lookup",
                                     json={"keys": keys.tolist()})
                answers.append((f"json x{keys.size} table {table}", answer.status_code,
                                answer.text[:300] if answer.status_code != 200 else ""))
                if answer.status_code == 200:
                    np.testing.assert_array_equal(
                        np.asarray(answer.json()["vectors"], np.float32),
                        model.expected(table, keys))
            keys = model.keys[0][: min(size, model.keys[0].size)]
            for name, datatype in V2_DTYPES.items():
                sent = keys[(keys >= 0) & (keys < 2**31)] if "32" in name else keys
                request = {"inputs": [
                    {"name": "KEYS", "shape": [sent.size], "datatype": datatype,
                     "data": (sent.view(np.uint64) if name == "uint64" else sent).tolist()},
                    {"name": "NUMKEYS", "shape": [1], "datatype": "INT32",
                     "data": [int(sent.size)]}]}
                answer = client.post(f"/v2/models/{MODEL}/infer", json=request)
                answers.append((f"v2 {name} x{sent.size}", answer.status_code,
                                answer.text[:300] if answer.status_code != 200 else ""))
    return answers


def _after_ready_compiles(url: str) -> tuple[float, float]:
    """(compiles after ready, compiles during loads) from /metrics, summed over the
    workers once each has written its figures again (every second)."""
    time.sleep(2.5)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return (metric_value(text, "hps_compiles_total", phase="after_ready"),
            metric_value(text, "hps_compiles_total", phase="load"))


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("streams")).start()
    yield server
    server.close()


def _first_update(url: str, streams: RedisServer, rows_each: int = 3,
                  stored: ModelFiles | None = None) -> None:
    """One online update of `rows_each` new keys of each table, through the server's
    Redis stream: served by every worker (new connections) within the wait. With
    `stored`, 400 keys of each table go along with the rows its files hold (unchanged:
    later tests reading this stream still serve the files' rows)."""
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream",
                                                  address=streams.address))
    rng = np.random.default_rng(5)
    sent = []
    for index, (table, dim) in enumerate(zip(TABLE_NAMES, DIMS, strict=True)):
        keys = np.arange(rows_each, dtype=np.int64) + 10**12  # new keys: inserted
        rows = rng.standard_normal((keys.size, dim)).astype(np.float32)
        if stored is not None:
            held = np.unique(stored.keys[index])[:400]
            keys = np.concatenate([held, keys])
            rows = np.concatenate([stored.expected(index, held), rows])
        publisher.publish(f"hps_et.{MODEL}.{table}", [codec.encode(keys, rows)])
        sent.append((table, keys[-50:], rows[-50:]))
    publisher.close()

    def served() -> bool:
        for table, keys, rows in sent:
            answer = httpx.post(f"{url}/v1/models/{MODEL}/tables/{table}/lookup",
                                content=keys.astype("<i8").tobytes(), timeout=30,
                                headers={"Content-Type": "application/octet-stream"})
            if answer.status_code != 200 or not np.array_equal(
                    np.frombuffer(answer.content, "<f4").reshape(rows.shape), rows):
                return False
        return True

    wait_until(lambda: all(served() for _ in range(4)), timeout=60)


@pytest.mark.parametrize("workers", [1, 2], ids=["one_process", "two_workers"])
def test_the_first_lookups_and_update_after_ready_all_answer_and_nothing_compiles(
        tmp_path: Path, started: Start, streams: RedisServer, workers: int) -> None:
    model, config = _model(tmp_path, streams)
    proc, url = started(config, "--workers", str(workers))
    _wait_ready(proc, url, tmp_path / "serve-0.log")
    answers = _first_lookups(url, model)
    assert len(answers) >= 50
    refused = [a for a in answers if a[1] != 200]
    assert not refused, refused
    # the first online update writes a few hundred rows: the hash map's small-batch
    # insert, which no load of these tables ran, compiled at the warm-up, not now; and
    # past the room a table shared by workers has left, the count of its new keys
    _first_update(url, streams, stored=model)
    after_ready, during_loads = _after_ready_compiles(url)
    assert during_loads > 0  # the empty cache was filled by the loads' warm-ups
    assert after_ready == 0, (tmp_path / "serve-0.log").read_text()


def test_a_restart_over_its_store_compiles_nothing_for_an_update_round_after_ready(
        tmp_path: Path, started: Start, streams: RedisServer) -> None:
    """A restart that finds its tables in the RocksDB store writes no table file while it
    loads; on an empty numba cache, an online update round of BULK_ROWS rows (RocksDB's
    bulk path: sorted, encoded as a table file, ingested) compiles nothing after ready."""
    model, config = _model(tmp_path, streams)
    last_run = json.loads(config.read_text())
    del last_run["update_source"]
    HierarchicalParameterServer(last_run).close()  # the store, as a last run left it
    proc, url = started(config)
    _wait_ready(proc, url, tmp_path / "serve-0.log")
    _first_update(url, streams, rows_each=BULK_ROWS)
    after_ready, _ = _after_ready_compiles(url)
    assert after_ready == 0, (tmp_path / "serve-0.log").read_text()


@pytest.fixture
def own_streams(tmp_path: Path) -> Iterator[RedisServer]:
    """Streams no other test publishes to: the others' rounds, read first in one batch
    with a test's own, would be applied (and pruned) together with it."""
    server = RedisServer(tmp_path / "streams").start()
    yield server
    server.close()


def test_an_update_past_the_overflow_margin_compiles_nothing_after_ready(
        tmp_path: Path, own_streams: RedisServer, started: Start) -> None:
    """A bounded hash map (`overflow_margin`) prunes a table the first time an update
    takes one of its partitions past the margin: on an empty numba cache, the warm-up
    compiled the pruning, not that update, under the table's write lock after ready."""
    model, config = _model(tmp_path, own_streams)
    bounded = json.loads(config.read_text())
    # the users table's 3,000 keys fill its 16 partitions to ~190 each; 1,600 more take
    # them to ~290, past 250: each is pruned to 200, its oldest (loaded) rows first
    bounded["volatile_db"].update(num_partitions=16, overflow_margin=250,
                                  overflow_policy="evict_oldest")
    del bounded["persistent_db"]  # the hash map the only store: nothing pruned at load
    config.write_text(json.dumps(bounded))
    proc, url = started(config)
    _wait_ready(proc, url, tmp_path / "serve-0.log")
    _first_update(url, own_streams, rows_each=1_600)
    after_ready, _ = _after_ready_compiles(url)
    assert after_ready == 0, (tmp_path / "serve-0.log").read_text()


def _plus_one(x: int) -> int:  # compiled on its first use, after ready (below)
    return x + 1


def test_a_compile_after_ready_is_counted_and_its_function_named_in_the_log(
        model_files: ModelFiles, caplog: pytest.LogCaptureFixture) -> None:
    late = on_use(_plus_one, ["int64(int64)"])  # a path no warm-up runs
    server = HierarchicalParameterServer(model_files.config, load=False)
    app = create_app(server)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            wait_until(lambda: client.get("/readyz").status_code == 200, timeout=READY_WAIT)

            def after_ready() -> float:
                return metric_value(client.get("/metrics").text, "hps_compiles_total",
                                    phase="after_ready")

            before = after_ready()
            with caplog.at_level(logging.WARNING, logger="hps.http"):
                assert late(np.int64(41)) == 42
            assert after_ready() == before + 1
            said = [r.getMessage() for r in caplog.records if "after ready" in r.getMessage()]
            named = "test_ready._plus_one for (int64,) -> int64 after ready"
            assert len(said) == 1 and named in said[0], said
            assert late(np.int64(1)) == 2 and after_ready() == before + 1  # once
    finally:
        server.close()


def test_workers_import_the_supervisors_hps_from_a_checkout_folder(
        tmp_path: Path, started: Start) -> None:
    """Started from a folder holding another `hps/` (a checkout's, here one that cannot
    be imported), the workers import the package the supervisor imported."""
    model, config = _model(tmp_path)
    checkout = tmp_path / "checkout"
    (checkout / "hps").mkdir(parents=True)
    (checkout / "hps" / "__init__.py").write_text(
        'raise ImportError("the working folder\'s hps was imported")\n')
    proc, url = started(config, "--workers", "2", cwd=checkout)
    _wait_ready(proc, url, tmp_path / "serve-0.log")
    keys = model.keys[1][:10]
    answer = httpx.post(f"{url}/v1/models/{MODEL}/tables/1/lookup",
                        content=keys.astype("<i8").tobytes(),
                        headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 200
    assert "working folder's hps" not in (tmp_path / "serve-0.log").read_text()


def test_the_warm_up_takes_every_key_dtype_the_routes_take() -> None:
    from hps.http.schemas import KEY_DTYPES as ROUTE_DTYPES

    assert set(WARMED_DTYPES) == set(ROUTE_DTYPES.values())


# -- the bad path, in one process ---------------------------------------------------------

def _check_lookup(client: httpx.Client, model: ModelFiles, table: int) -> None:
    """A JSON lookup of a few of `table`'s keys answers their rows."""
    keys = model.keys[table][:5]
    answer = client.post(f"/v1/models/{MODEL}/tables/{table}/lookup",
                         json={"keys": keys.tolist()})
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(np.asarray(answer.json()["vectors"], np.float32),
                                  model.expected(table, keys))


def test_a_lookup_while_the_model_warms_is_a_503_with_retry_after(
        model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its tables loaded, its lookup paths still running (held here): the model is not
    served yet, so a lookup is answered at once, 503 with Retry-After, and every ready
    route says not ready; once the warm-up is done, it serves."""
    warming, release = threading.Event(), threading.Event()
    real = parameter_server.warm_paths

    def held(server: Any, loaded: Any, progress: Any) -> float:
        warming.set()
        assert release.wait(60)
        return real(server, loaded, progress)

    monkeypatch.setattr(parameter_server, "warm_paths", held)
    server = HierarchicalParameterServer(model_files.config, load=False)
    app = create_app(server)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            assert warming.wait(READY_WAIT)
            started = time.monotonic()
            answer = client.post(f"/v1/models/{MODEL}/tables/0/lookup", json={"keys": [1]})
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["kind"] == "model_loading"
            assert time.monotonic() - started < 5  # answered, not held
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["loading"] == [MODEL]
            assert client.get("/v2/health/ready").status_code != 200
            assert client.get(f"/v2/models/{MODEL}/ready").status_code != 200
            release.set()
            wait_until(lambda: client.get("/readyz").status_code == 200, timeout=READY_WAIT)
            _check_lookup(client, model_files, 1)
            assert client.get("/v2/health/ready").status_code == 200
            assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
    finally:
        release.set()
        server.close()


def test_a_model_whose_warm_lookup_fails_is_failed_and_the_others_serve(
        model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first lookup of model `bad` fails (its volatile tier's fetch raises here): the
    load fails, /readyz lists it as failed, GET /v1/models says why, its lookups are 503
    model_failed, and model `m` serves."""
    config = copy.deepcopy(model_files.config)
    config["models"].append({**config["models"][0], "model": "bad"})
    real = HostLookup.fetch_into

    def fetch_into(self: HostLookup, table: Any, keys: Any, out: Any) -> None:
        if table.storage_name.startswith("hps_et.bad."):
            raise RuntimeError("the fetch of a broken tier")
        real(self, table, keys, out)

    monkeypatch.setattr(HostLookup, "fetch_into", fetch_into)
    server = HierarchicalParameterServer(config, load=False)
    app = create_app(server)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            wait_until(lambda: client.get("/readyz").json()["status"] == "failed",
                       timeout=READY_WAIT)
            ready = client.get("/readyz").json()
            assert ready["failed"] == ["bad"] and ready["loaded"] == [MODEL]
            why = client.get("/v1/models").json()["failed"]["bad"]
            assert "first lookup failed" in why and "broken tier" in why, why
            answer = client.post("/v1/models/bad/tables/0/lookup", json={"keys": [1]})
            assert answer.status_code == 503
            assert answer.json()["error"]["kind"] == "model_failed"
            _check_lookup(client, model_files, 0)
            assert metric_value(client.get("/metrics").text, "hps_load_failures_total",
                                model="bad", kind="warm_up") == 1.0
    finally:
        server.close()


def test_a_worker_killed_while_it_warms_is_started_again_and_counted_once(
        tmp_path: Path, started: Start) -> None:
    """`--workers 2` on an empty numba cache: the leader is killed (SIGKILL) while its
    warm-up compiles the lookup path (the hash map's fetch loop is in the cache, the
    rest not yet). It is started again, the server says ready once, with two workers,
    and its first lookups answer 200 with nothing compiled after ready."""
    model, config = _model(tmp_path)
    proc, url = started(config, "--workers", "2")
    cache, shm, log = tmp_path / "numba-0", tmp_path / "shm-0", tmp_path / "serve-0.log"
    deadline = time.monotonic() + SERVE_WAIT
    while not any(cache.rglob("loops.fetch-*.nbi")):
        assert time.monotonic() < deadline, log.read_text()
        assert proc.poll() is None, log.read_text()
        time.sleep(0.01)
    workers = next(shm.glob("*/ops/workers"))
    leader = int((workers / "0").read_text())
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 503  # still warming
    os.kill(leader, signal.SIGKILL)
    _wait_ready(proc, url, log)
    ready = httpx.get(f"{url}/readyz", timeout=10).json()
    assert ready["loaded"] == [MODEL] and ready["failed"] == []
    assert f"worker 0 (pid {leader}) exited" in log.read_text()
    pids = {p.name: int(p.read_text()) for p in workers.iterdir() if not p.name.startswith(".")}
    assert sorted(pids) == ["0", "1"] and pids["0"] != leader
    answers = [a for a in _first_lookups(url, model) if a[1] != 200]
    assert not answers, answers
    after_ready, _ = _after_ready_compiles(url)
    assert after_ready == 0, log.read_text()
    text = log.read_text()
    assert text.count("every model is loaded in every worker") == 1, text
