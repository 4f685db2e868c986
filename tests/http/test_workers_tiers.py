"""`hps serve --workers 2` over the tiers every worker reads: Redis as the volatile tier
(a real redis-server; one pool per worker, the leader writes) and RocksDB as the
persistent tier (the leader writes, the other worker reads a secondary instance). Client
processes check every answer while an update stream (Redis Streams) rewrites rows and the
model is reloaded; a worker killed with SIGKILL is replaced and reads the tiers again."""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps.config import UpdateSourceConfig, load_config
from hps.http.workers import check_workers
from hps.updates import codec
from hps.updates.open import open_publisher
from tests.http.conftest import DEFAULT_VALUE, ModelFiles, metric_value, wait_until, write_model
from tests.http.test_workers import (
    Served,
    _case,
    _clients,
    _lookup,
    _results,
    load_with_updates_and_a_reload,
    serve,
    stop,
    write_run,
)
from tests.support.redis_servers import RedisServer

#: the tiers of each served config: the volatile tier's, then the persistent tier's
TIERS = {
    "redis": ({"type": "redis_cluster", "num_partitions": 4}, None),
    "rocksdb": ({"type": "disabled"}, {"type": "rocks_db"}),
    "redis+rocksdb": ({"type": "redis_cluster", "num_partitions": 4}, {"type": "rocks_db"}),
}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.close()


@pytest.fixture(scope="module", params=sorted(TIERS))
def tiers_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               redis_server: RedisServer) -> Iterator[tuple[ModelFiles, Served]]:
    folder = tmp_path_factory.mktemp(request.param.replace("+", "_"))
    model = write_model(folder / "model")
    volatile, persistent = TIERS[request.param]
    config = copy.deepcopy(model.config)
    config["volatile_db"] = {**volatile}
    if "redis" in request.param:
        config["volatile_db"]["address"] = redis_server.address
    if persistent is not None:
        config["persistent_db"] = {**persistent, "path": str(folder / "rocks")}
    # each case has its stream and its Redis tables (the model name is the same)
    redis_server.client().flushall()
    config["update_source"] = {"type": "redis_stream", "address": redis_server.address,
                               "poll_timeout_ms": 50, "failure_backoff_ms": 20}
    path, shm = write_run(folder, config)
    served = serve(path, shm)
    yield model, served
    assert stop(served) == 0
    assert not list(shm.iterdir())


def test_updates_and_a_reload_during_lookups_every_answer_exact(
        tiers_case: tuple[ModelFiles, Served], redis_server: RedisServer,
        tmp_path: Path) -> None:
    model, served = tiers_case
    # two clients: a worker has two lookup threads for tiers off the process, so none
    # of their lookups ever waits in its queue, and none is shed (503) however slow
    # this machine is meanwhile
    load_with_updates_and_a_reload(served, model, redis_server.address, tmp_path,
                                   clients=2)
    # the other table, never updated, whole through the reload
    items = model.keys[1][:300]
    for _ in range(4):
        answer = httpx.post(f"{served.url}/v1/models/m/tables/items/lookup",
                            json={"keys": items.tolist()}, timeout=30)
        np.testing.assert_array_equal(np.asarray(answer.json()["vectors"], np.float32),
                                      model.vectors[1][:300])


def test_a_worker_killed_is_replaced_and_reads_the_tiers(
        tiers_case: tuple[ModelFiles, Served], tmp_path: Path) -> None:
    model, served = tiers_case
    before = served.worker_pids()
    clients = _clients(served, _case(tmp_path, model), count=2, seconds=3.0)
    time.sleep(1.0)
    # its RocksDB secondary instance's folder (with a persistent tier): named after it
    kept = list((served.run_folder() / "rocksdb").glob(f"*-1-{before[1]}"))
    os.kill(before[1], signal.SIGKILL)
    wait_until(lambda: served.worker_pids()[1] != before[1], timeout=30)
    assert not any(folder.exists() for folder in kept)  # removed when it was started again
    for result in _results(clients):  # a connection on the killed worker may reset
        assert set(result["statuses"]) == {"200"}, result
        assert result["bad"] == 0, result
    wait_until(lambda: httpx.get(f"{served.url}/readyz").status_code == 200, timeout=60)
    for result in _results(_clients(served, _case(tmp_path, model), count=2, seconds=1.5)):
        assert set(result["statuses"]) == {"200"} and result["resets"] == 0, result
        assert result["bad"] == 0, result


def test_the_tiers_are_served_by_workers(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model")
    base = {**copy.deepcopy(model.config), "http": {"workers": 2}}
    for volatile, persistent in TIERS.values():
        config = {**base, "volatile_db": volatile}
        if persistent is not None:
            config["persistent_db"] = {**persistent, "path": str(tmp_path / "rocks")}
        check_workers(load_config(config), None)  # no ConfigError


#: update messages a second, and seconds, of the run folder's watch
SHM_RATE, SHM_SECONDS = 10, 30


def _served_with_a_stream(tmp_path: Path, redis: RedisServer, rocksdb: bool = True,
                          volatile: dict[str, object] | None = None
                          ) -> tuple[ModelFiles, Served]:
    """The model served by `--workers 2` with `redis` carrying its update stream, over
    RocksDB (`rocksdb`), `volatile` added to its volatile_db."""
    model = write_model(tmp_path / "model")
    config = copy.deepcopy(model.config)
    config["volatile_db"].update(volatile or {})
    if rocksdb:
        config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    config["update_source"] = {"type": "redis_stream", "address": redis.address,
                               "poll_timeout_ms": 50, "failure_backoff_ms": 20}
    return model, serve(*write_run(tmp_path, config))


def _run_folder_use(run: Path) -> tuple[int, int]:
    """(bytes the run folder's files take, RocksDB secondary instance folders in it)."""
    used = sum(p.stat().st_blocks * 512 for p in run.rglob("*") if p.is_file())
    instances = sum(1 for p in (run / "rocksdb").glob("*/*") if p.is_dir())
    return used, instances


def test_the_run_folder_stays_flat_under_updates(tmp_path: Path) -> None:
    """`--workers 2`, RocksDB and a Redis stream of SHM_RATE update messages a second for
    SHM_SECONDS: the follower keeps one secondary instance (a folder of its info log), and
    the run folder's size stays flat."""
    redis = RedisServer(tmp_path / "redis").start()
    model, served = _served_with_a_stream(tmp_path, redis)
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream", address=redis.address))
    keys = model.keys[0][:40]
    rng = np.random.default_rng(3)
    samples = []
    try:
        run = served.run_folder()
        for second in range(SHM_SECONDS):  # a loop over seconds
            for _ in range(SHM_RATE):  # a loop over messages
                rows = rng.standard_normal((keys.size, 8)).astype(np.float32)
                publisher.publish("hps_et.m.users", [codec.encode(keys, rows)])
                time.sleep(1 / SHM_RATE)
            samples.append((second, *_run_folder_use(run)))
        # the follower served the updates all along (the last one)
        wait_until(lambda: all(np.array_equal(_lookup(served, keys), rows)
                               for _ in range(6)), timeout=20)
    finally:
        assert stop(served) == 0
        redis.close()
    print("run folder (second, bytes, instance folders):", samples[::5], samples[-1])
    assert max(s[2] for s in samples) <= 2, samples  # one, and its successor while it swaps
    settled = samples[SHM_SECONDS // 3][1]
    assert max(s[1] for s in samples[SHM_SECONDS // 3:]) <= settled + (1 << 20), samples


@pytest.mark.parametrize("rocksdb", [True, False], ids=["rocksdb", "no persistent tier"])
def test_an_update_past_a_full_shared_table_still_rewrites_the_keys_it_holds(
        tmp_path: Path, rocksdb: bool) -> None:
    """`--workers 2`, the shared hash map with no headroom: one update message of 40 keys
    the table holds and 4,000 it lacks. Every worker serves the 40 keys' new rows (the
    insert was refused whole before, leaving them their old rows while RocksDB had the
    new); the new keys are served from RocksDB, or without it get the default, and
    /metrics counts them by where they are kept."""
    redis = RedisServer(tmp_path / "redis").start()
    model, served = _served_with_a_stream(tmp_path, redis, rocksdb=rocksdb,
                                          volatile={"shared_headroom": 0.0})
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream", address=redis.address))
    held = model.keys[0][:40]
    new = np.setdiff1d(np.arange(1, 4_001, dtype=np.int64) << 20, model.keys[0])[:4_000]
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((held.size + new.size, 8)).astype(np.float32)
    new_rows = rows[held.size:] if rocksdb else np.full((new.size, 8), DEFAULT_VALUE, np.float32)
    try:
        publisher.publish("hps_et.m.users", [codec.encode(np.concatenate([held, new]), rows)])
        wait_until(lambda: all(np.array_equal(_lookup(served, held), rows[:held.size])
                               for _ in range(6)), timeout=20)
        for _ in range(6):  # either worker
            np.testing.assert_array_equal(_lookup(served, new[:500]), new_rows[:500])
        kept = "persistent" if rocksdb else "none"
        wait_until(lambda: all(metric_value(httpx.get(f"{served.url}/metrics").text,
                                            "hps_update_rows_left_out_total",
                                            table="hps_et.m.users", kept=kept) == new.size
                               for _ in range(4)), timeout=10)
    finally:
        publisher.close()
        assert stop(served) == 0
        redis.close()


def test_redis_emptied_after_a_model_change_is_refilled_and_every_worker_serves(
        tmp_path: Path) -> None:
    # Once a model change began, the leader holds its drops of the tables the workers
    # served (workers_drops.py). A refill of a Redis that came back empty started by
    # dropping the served table's stale rows: that drop was held, made later, and the
    # leader's Redis tier forgot the table: every lookup there answered 404.
    redis = RedisServer(tmp_path / "redis").start()
    try:
        model = write_model(tmp_path / "model")
        config = copy.deepcopy(model.config)
        config["volatile_db"] = {"type": "redis_cluster", "num_partitions": 4,
                                 "address": redis.address}
        config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
        served = serve(*write_run(tmp_path, config))
        try:
            block = {**copy.deepcopy(model.config["models"][0]), "model": "m2"}
            added = httpx.post(f"{served.url}/v1/models", json=block, timeout=60)
            assert added.status_code == 201, added.text  # a model change: an op
            redis.client().flushall()
            served.wait_for("refilling")
            wait_until(lambda: httpx.get(f"{served.url}/readyz").status_code == 200,
                       timeout=60)
            keys = model.keys[0][:50]
            deadline = time.monotonic() + 3.0  # past the op log's polls
            while time.monotonic() < deadline:
                for _ in range(4):  # new connections: each may land on either worker
                    answer = httpx.post(f"{served.url}/v1/models/m/tables/users/lookup",
                                        json={"keys": keys.tolist()}, timeout=30)
                    assert answer.status_code == 200, answer.text
                    np.testing.assert_array_equal(
                        np.asarray(answer.json()["vectors"], np.float32),
                        model.vectors[0][:50])
            assert redis.client().dbsize() > 0  # refilled
        finally:
            assert stop(served) == 0
    finally:
        redis.close()
