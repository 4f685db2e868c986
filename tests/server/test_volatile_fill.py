"""A volatile tier that cannot take a load (Redis down, full or read-only at start): the
model loads into RocksDB, serves exactly from there, says the tier is degraded, and the
tables are filled into Redis in the background once it takes them. Real redis-server
processes, RocksDB on temp dirs."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import VolatileDBConfig
from hps.modelfiles.confined import confined, current_roots
from hps.runtime.backoff import Backoff
from hps.server import HierarchicalParameterServer
from hps.server.models import LoadedModel
from hps.server.volatile_fill import VolatileFiller
from hps.tiers.hash_map import HashMapTier
from hps.tiers.redis import RedisTier
from tests.support.redis_servers import RedisServer, eventually, free_port

NAMES = ["hps_et.m.sparse_embedding0", "hps_et.m.sparse_embedding1"]


def redis_config(two_tables: dict[str, Any], address: str, **volatile: Any) -> dict[str, Any]:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"] = {"type": "redis_cluster", "address": address, "num_partitions": 4,
                             "reconnect_backoff": 0.05, "reconnect_backoff_max": 0.2,
                             "socket_timeout": 2.0, **volatile}
    return config


def assert_exact(server: HierarchicalParameterServer, two_tables: dict[str, Any]) -> None:
    for i, (keys, vectors) in enumerate(two_tables["tables"]):
        np.testing.assert_array_equal(server.lookup("m", i, keys), vectors)


def assert_filled(server: HierarchicalParameterServer, two_tables: dict[str, Any]) -> None:
    """Every table in Redis, lookups exact and served by Redis."""
    eventually(lambda: _check(server.degraded() == {}), 30, "the tables are filled")
    hits = [server.model("m").table(i).stats.volatile_hits for i in (0, 1)]
    assert_exact(server, two_tables)
    for i, (keys, _) in enumerate(two_tables["tables"]):
        assert server.volatile.size(NAMES[i]) == keys.size
        assert server.model("m").table(i).stats.volatile_hits == hits[i] + keys.size


def _check(ok: bool) -> None:
    if not ok:
        raise AssertionError("not yet")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    made: list[RedisServer] = []

    def make(*extra: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(made)}", extra=list(extra))
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def test_redis_down_at_start(two_tables: dict[str, Any],
                             own_redis: Callable[..., RedisServer]) -> None:
    redis = own_redis()  # not started: nothing listens on its port
    with HierarchicalParameterServer(redis_config(two_tables, redis.address)) as server:
        assert_exact(server, two_tables)  # served from RocksDB
        degraded = server.degraded()
        assert degraded == {"redis": {"available": False, "tables_pending": NAMES}}
        assert all(not t.volatile_ready for t in server.model("m").tables)
        redis.start()
        assert_filled(server, two_tables)


def test_redis_full_at_start(two_tables: dict[str, Any],
                             own_redis: Callable[..., RedisServer]) -> None:
    redis = own_redis().start()
    with redis.client() as client:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write is refused with OOM
    with HierarchicalParameterServer(redis_config(two_tables, redis.address)) as server:
        assert_exact(server, two_tables)
        assert server.degraded() == {"redis": {"available": True, "tables_pending": NAMES}}
        assert server.volatile.stats()["failures"]["full"] >= 2
        with redis.client() as client:
            client.config_set("maxmemory", 0)
        assert_filled(server, two_tables)


def test_redis_read_only_at_start(two_tables: dict[str, Any],
                                  own_redis: Callable[..., RedisServer]) -> None:
    redis = own_redis().start()
    with redis.client() as client:  # a replica of a master that is not there
        client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
    with HierarchicalParameterServer(redis_config(two_tables, redis.address)) as server:
        assert_exact(server, two_tables)
        assert server.degraded()["redis"]["tables_pending"] == NAMES
        with redis.client() as client:
            client.execute_command("REPLICAOF", "NO", "ONE")
        assert_filled(server, two_tables)


def test_stale_rows_are_never_served(two_tables: dict[str, Any],
                                     own_redis: Callable[..., RedisServer]) -> None:
    """Redis holds other rows under the table's name (an earlier version whose drop
    failed) and is full when the model loads: lookups do not read Redis for the table
    until the fill has replaced those rows."""
    redis = own_redis().start()
    config = redis_config(two_tables, redis.address)
    keys, vectors = two_tables["tables"][0]
    stale = RedisTier(VolatileDBConfig.model_validate(config["volatile_db"]))
    try:
        stale.create_table(NAMES[0], vectors.shape[1])
        stale.insert(NAMES[0], keys, vectors + 100)
    finally:
        stale.close()
    with redis.client() as client:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
    with HierarchicalParameterServer(config) as server:
        assert_exact(server, two_tables)
        assert server.model("m").table(0).stats.volatile_hits == 0
        with redis.client() as client:
            client.config_set("maxmemory", 0)
        assert_filled(server, two_tables)


def test_redis_full_does_not_flood_the_log(two_tables: dict[str, Any],
                                           own_redis: Callable[..., RedisServer],
                                           caplog: pytest.LogCaptureFixture) -> None:
    """cache_missed_embeddings with Redis full: the background inserts fail on every
    lookup; they are counted (failures 'full', dropped 'insert') and logged once a
    minute, without a traceback."""
    redis = own_redis().start()
    config = redis_config(two_tables, redis.address, initial_cache_rate=0.5,
                          cache_missed_embeddings=True)
    with HierarchicalParameterServer(config) as server:
        with redis.client() as client:
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)
        caplog.set_level(logging.WARNING, logger="hps")
        keys, vectors = two_tables["tables"][1]
        for _ in range(20):
            np.testing.assert_array_equal(server.lookup("m", 1, keys), vectors)
            server.volatile.wait_idle(10)
        stats = server.volatile.stats()
        assert stats["failures"]["full"] >= 20 and stats["dropped"]["insert"] >= 20 * 1000
    flood = [r for r in caplog.records if r.name.startswith("hps")]
    assert 1 <= len(flood) <= 2 and all(r.exc_info is None for r in flood)


def test_a_confined_load_fills_confined(tmp_path: Path) -> None:
    """A table of a version read beneath allowed roots (a request named its files) is
    reopened for its fill beneath the same roots, on the fill's own thread, whoever holds
    it: the load (inside `confined`) or the watcher of lost tables (outside it)."""
    filler = VolatileFiller(HashMapTier(VolatileDBConfig()), 1.0, Backoff(initial=0.01,
                                                                          cap=0.01))
    try:
        roots = [str(tmp_path)]
        named = LoadedModel(None, [], roots=tuple(roots))  # type: ignore[arg-type]
        held = confined(roots, filler.hold, named, None, current_roots)
        refilled = filler.hold(named, None, current_roots)  # type: ignore[arg-type]
        trusted = filler.hold(LoadedModel(None, []), None,  # type: ignore[arg-type]
                              current_roots)
        assert current_roots() is None
        assert held.open_reader() == tuple(roots)
        assert refilled.open_reader() == tuple(roots)
        assert trusted.open_reader() is None
        for fill in (held, refilled, trusted):
            filler.release(fill)
    finally:
        filler.close()
