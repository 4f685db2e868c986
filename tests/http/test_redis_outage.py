"""Redis as the volatile tier of a served model, through HTTP: down at start, killed and
restarted under lookups. Every lookup stays 200 and exact (RocksDB answers meanwhile);
/readyz and /metrics say the tier is degraded. Real redis-server and uvicorn processes."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.http.conftest import DIMS, MODEL, Live, ModelFiles, serving, wait_until, write_model
from tests.support.redis_servers import RedisServer

NAMES = ["hps_et.m.items", "hps_et.m.users"]  # sorted


def with_redis(model: ModelFiles, redis: RedisServer, db: Path) -> ModelFiles:
    config = copy.deepcopy(model.config)
    config["volatile_db"] = {"type": "redis_cluster", "address": redis.address,
                             "num_partitions": 4, "reconnect_backoff": 0.05,
                             "reconnect_backoff_max": 0.2, "socket_timeout": 2.0}
    config["persistent_db"] = {"type": "rocks_db", "path": str(db)}
    return replace(model, config=config)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.close()


def exact(live: Live, rng: np.random.Generator) -> None:
    for table in (0, 1):
        keys = live.model.sample_keys(rng, table, 200, unknown=5)
        answer = live.lookup_binary(table, keys)
        assert answer.status_code == 200, answer.text
        got = np.frombuffer(answer.content, "<f4").reshape(len(keys), DIMS[table])
        np.testing.assert_array_equal(got, live.model.expected(table, keys))


@contextmanager
def checking_clients(live: Live, count: int = 4) -> Iterator[list[str]]:
    """`count` client threads, each looking up and checking every answer (`exact`) until
    the block ends; yields the list their failures are appended to."""
    wrong: list[str] = []
    done = threading.Event()

    def client() -> None:
        local = np.random.default_rng()
        while not done.is_set():
            try:
                exact(live, local)
            except AssertionError as exc:
                wrong.append(str(exc)[:300])

    threads = [threading.Thread(target=client) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield wrong
    finally:
        done.set()
        for t in threads:
            t.join()


def test_redis_down_at_start_serves_and_reports_degraded(
    tmp_path: Path, redis: RedisServer, rng: np.random.Generator
) -> None:
    model = with_redis(write_model(tmp_path / "model"), redis, tmp_path / "db")
    with serving(model) as live:  # Redis not started: the model loads into RocksDB
        ready = live.client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["degraded"] == {
            "redis": {"available": False, "tables_pending": NAMES}}
        assert live.metric("hps_tier_tables_pending", tier="redis") == 2
        assert live.metric("hps_tier_available", tier="redis") == 0
        exact(live, rng)
        redis.start()
        wait_until(lambda: live.client.get("/readyz").json()["degraded"] == {}, timeout=30)
        assert live.metric("hps_tier_tables_pending", tier="redis") == 0
        assert live.metric("hps_tier_available", tier="redis") == 1
        exact(live, rng)
        assert live.metric("hps_tier_hits_total", model=MODEL, table="items",
                           tier="volatile") > 0


def test_redis_killed_and_restarted_under_lookups(
    tmp_path: Path, redis: RedisServer, rng: np.random.Generator
) -> None:
    redis.start()
    model = with_redis(write_model(tmp_path / "model"), redis, tmp_path / "db")
    with serving(model) as live:
        with checking_clients(live) as wrong:
            count = live.metric("hps_lookups_total", model=MODEL, table="users")
            wait_until(lambda: live.metric("hps_lookups_total", model=MODEL,
                                           table="users") > count + 20)
            redis.kill()
            wait_until(lambda: live.metric("hps_tier_available", tier="redis") == 0)
            count = live.metric("hps_lookups_total", model=MODEL, table="users")
            wait_until(lambda: live.metric("hps_lookups_total", model=MODEL,
                                           table="users") > count + 20)
            redis.start()  # empty: it kept nothing
            wait_until(lambda: live.metric("hps_tier_available", tier="redis") == 1,
                       timeout=30)
            count = live.metric("hps_lookups_total", model=MODEL, table="users")
            wait_until(lambda: live.metric("hps_lookups_total", model=MODEL,
                                           table="users") > count + 20)
        assert wrong == []
        assert live.metric("hps_tier_failures_total", model=MODEL, table="users") > 0
        assert live.client.get("/readyz").status_code == 200
