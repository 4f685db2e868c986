"""`open_tiers`: the tiers a config asks for, and what `Tiers` reads from them (sizes,
stats), over real tiers: the hash map, RocksDB on a temp dir, a real redis-server."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import PSConfig
from hps.errors import TierSetupError
from hps.tiers import Tiers, open_tiers
from hps.tiers.contract import Tier
from tests.conftest import model_config
from tests.support.redis_servers import RedisServer, eventually

TABLE = "hps_et.m.t"
DIM = 4


def ps_config(volatile: dict[str, Any], persistent: dict[str, Any]) -> PSConfig:
    """A config of these tiers (its model is never loaded: only the tiers are opened)."""
    return PSConfig.model_validate({"models": [model_config(["unread"], [DIM])],
                                    "volatile_db": volatile, "persistent_db": persistent})


def rows(keys: np.ndarray) -> np.ndarray:
    return np.repeat(keys.astype(np.float32)[:, None], DIM, axis=1)


def fill(tier: Tier, keys: np.ndarray) -> None:
    tier.create_table(TABLE, DIM)
    tier.insert(TABLE, keys, rows(keys))


def assert_contract_stats(stats: dict[str, Any]) -> None:
    assert isinstance(stats["available"], bool)
    for counts in (stats["failures"], stats["dropped"]):
        assert all(isinstance(k, str) and isinstance(v, int) for k, v in counts.items())


def test_hash_map_over_rocksdb(tmp_path: Path) -> None:
    config = ps_config({"type": "hash_map"},
                       {"type": "rocks_db", "path": str(tmp_path / "rocks")})
    tiers = open_tiers(config)
    try:
        assert [t.name for t in tiers] == ["hash_map", "rocksdb"]  # lookup order
        assert tiers.volatile is not None and tiers.persistent is not None
        keys = np.arange(100, dtype=np.int64)
        fill(tiers.volatile, keys[:30])
        fill(tiers.persistent, keys)
        assert tiers.sizes(TABLE) == {"hash_map": 30, "rocksdb": 100}
        got, found = tiers.persistent.fetch(TABLE, keys)  # the tiers work as opened
        assert found.all() and np.array_equal(got, rows(keys))

        stats = tiers.stats()
        for tier_stats in stats.values():
            assert_contract_stats(tier_stats)
            assert tier_stats["available"] is True
            assert tier_stats["failures"] == {} and tier_stats["tables"] == 1
        assert stats["hash_map"]["keys"] == 30
        assert stats["hash_map"]["memory_bytes"] == tiers.volatile.memory_bytes(TABLE)
        tiers.persistent.remove(TABLE, keys[:10])
        tiers.persistent.drop_table(TABLE)
        assert tiers.stats()["rocksdb"]["tables"] == 0
    finally:
        tiers.close()


def test_rocksdb_estimates_the_keys_of_a_bulk_load(tmp_path: Path) -> None:
    config = ps_config({"type": "disabled"},
                       {"type": "rocks_db", "path": str(tmp_path / "rocks")})
    tiers = open_tiers(config)
    try:
        assert tiers.volatile is None and tiers.persistent is not None
        keys = np.arange(5000, dtype=np.int64)
        tiers.persistent.create_table(TABLE, DIM)
        tiers.persistent.load(TABLE, [(keys, rows(keys))])
        # the estimate comes from the ingested file's metadata: exact after one bulk load
        assert tiers.stats()["rocksdb"]["estimated_keys"] == 5000
    finally:
        tiers.close()


def test_disabled_tiers() -> None:
    tiers = open_tiers(ps_config({"type": "disabled"}, {"type": "disabled"}))
    assert tiers == Tiers(None, None)
    assert list(tiers) == [] and tiers.stats() == {} and tiers.sizes(TABLE) == {}
    tiers.close()


def test_redis_volatile_tier_reports_its_outage(redis_server: RedisServer) -> None:
    config = ps_config({"type": "redis", "address": redis_server.address,
                        "reconnect_backoff": 0.05, "reconnect_backoff_max": 0.2},
                       {"type": "disabled"})
    tiers = open_tiers(config)
    try:
        assert [t.name for t in tiers] == ["redis"] and tiers.persistent is None
        assert tiers.volatile is not None
        keys = np.arange(50, dtype=np.int64)
        fill(tiers.volatile, keys)
        assert tiers.sizes(TABLE) == {"redis": 50}
        assert tiers.stats()["redis"]["available"] is True

        redis_server.kill()
        assert tiers.sizes(TABLE) == {"redis": None}  # unavailable, not an error
        stats = tiers.stats()["redis"]
        assert_contract_stats(stats)
        assert stats["available"] is False
        assert stats["failures"]["connection"] >= 1

        redis_server.start()
        eventually(lambda: tiers.stats()["redis"]["available"] or 1 / 0, 10,
                   "the tier did not report it is back")
    finally:
        tiers.close()


def test_a_tier_that_cannot_open_closes_the_one_opened_before(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    def connections() -> int:
        with redis_server.client() as client:
            return int(client.info("clients")["connected_clients"])  # this one included

    alone = connections()
    missing = tmp_path / "no-such-store"
    config = ps_config({"type": "redis", "address": redis_server.address},
                       {"type": "rocks_db", "path": str(missing), "read_only": True})
    # the collector would close a forgotten tier's sockets sooner or later: with it off,
    # only open_tiers closing the Redis tier it had opened brings the count back
    gc.disable()
    try:
        with pytest.raises(TierSetupError, match="no-such-store"):
            open_tiers(config)
        eventually(lambda: connections() == alone or 1 / 0, 5, "Redis connections left open")
    finally:
        gc.enable()
