"""Online updates reaching the GPU caches in place (GpuEmbeddingTable.update / insert, and
a served model whose cache takes updates from Redis Streams): rows held are overwritten
where they are, without a miss or a host fetch; keys not held stay out unless the config
asks (`gpu_cache_insert`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import ModelConfig, UpdateSourceConfig
from hps.gpu.table import GpuEmbeddingTable
from hps.updates import codec
from hps.updates.open import open_publisher
from tests.support.redis_servers import RedisServer, eventually

pytestmark = pytest.mark.gpu

DEFAULT = 0.25
DIM = 16


def _model(**extra: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "model": "m", "sparse_files": ["/nowhere"], "embedding_vecsize_per_table": [DIM],
        "maxnum_catfeature_query_per_table_per_sample": [64],
        "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
        "max_batch_size": 64, "hit_rate_threshold": 1.1,
    }
    fields.update(extra)
    return ModelConfig(**fields)


class _Store:
    """The host path the cache's misses take: a dict of rows, counting its calls."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self.rows = dict(zip(keys.tolist(), rows, strict=True))
        self.fetched = 0

    def fetch(self, keys: np.ndarray) -> np.ndarray:
        self.fetched += keys.size
        default = np.full(DIM, DEFAULT, np.float32)
        return np.stack([self.rows.get(k, default) for k in keys.tolist()]) if keys.size \
            else np.empty((0, DIM), np.float32)


@pytest.mark.parametrize("cache_type", ["dynamic", "static"])
def test_update_overwrites_held_rows_in_place(cp: Any, rng: np.random.Generator,
                                              cache_type: str) -> None:
    n = 4000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    store = _Store(keys, rows)
    model = _model(gpucacheper=1.0, embedding_cache_type=cache_type)
    # room for ten times the keys: warming up with all of them evicts none
    with GpuEmbeddingTable(model, 0, 10 * n, 0, store.fetch) as table:
        table.warm_up([(keys, rows)])
        size = table.stats()["size"]
        assert size == n
        held = keys[:500]
        absent = np.arange(5, dtype=np.int64) + 2**45
        new = rng.standard_normal((505, DIM)).astype(np.float32)
        assert table.update(np.r_[held, absent], new) == 500
        assert table.stats()["size"] == size  # nothing inserted, nothing evicted
        fetched = store.fetched
        out = cp.empty((500, DIM), dtype=np.float32)
        table.lookup(cp.asarray(held), out)
        np.testing.assert_array_equal(out.get(), new[:500])
        assert store.fetched == fetched  # served from the cache: no miss went to the host
        # the keys it did not hold are still not held: their lookup misses
        out = cp.empty((5, DIM), dtype=np.float32)
        table.lookup(cp.asarray(absent), out)
        assert store.fetched == fetched + 5


def test_insert_adds_the_keys_a_dynamic_cache_lacks(cp: Any, rng: np.random.Generator
                                                    ) -> None:
    n = 2000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    store = _Store(keys, rows)
    with GpuEmbeddingTable(_model(gpucacheper=1.0), 0, 10 * n, 0, store.fetch) as table:
        table.warm_up([(keys[:1000], rows[:1000])])
        fresh = np.arange(300, dtype=np.int64) + 2**44
        both = np.r_[keys[:100], fresh]
        new = rng.standard_normal((both.size, DIM)).astype(np.float32)
        table.insert(both, new)
        assert table.stats()["size"] == 1300
        out = cp.empty((both.size, DIM), dtype=np.float32)
        table.lookup(cp.asarray(both), out)
        np.testing.assert_array_equal(out.get(), new)
        assert store.fetched == 0


def _write_model(folder: Path, keys: np.ndarray, rows: np.ndarray) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    keys.astype("<i8").tofile(folder / "key")
    rows.astype("<f4").tofile(folder / "emb_vector")
    return str(folder)


def _served(tmp_path: Path, keys: np.ndarray, rows: np.ndarray, redis: RedisServer,
            *, warm: bool, insert: bool) -> dict[str, Any]:
    return {
        "supportlonglong": True,
        "models": [{
            "model": "m", "sparse_files": [_write_model(tmp_path / "t0", keys, rows)],
            "embedding_vecsize_per_table": [DIM],
            "maxnum_catfeature_query_per_table_per_sample": [64],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
            # warm: half the table fills the cache from the files at load (a cache of the
            # whole table would hold every key); else the cache starts empty
            "max_batch_size": 64, "gpucache": True, "gpucacheper": 0.5 if warm else 1.0,
            "cache_refresh_percentage_per_iteration": 0.25 if warm else 0.0,
            "hit_rate_threshold": 1.1,
        }],
        "volatile_db": {"type": "hash_map"},
        "update_source": {"type": "redis_stream", "address": redis.address,
                          "poll_timeout_ms": 50, "gpu_cache_insert": insert},
    }


def _applied(hps: Any, rows: int) -> None:
    def check() -> None:
        status = hps.server.update_status()
        assert status is not None and status["tables"][
            "hps_et.m.sparse_embedding0"]["rows"] == rows

    eventually(check, 20.0, "the update applied")


def test_a_served_models_cache_is_updated_in_place(cp: Any, rng: np.random.Generator,
                                                   tmp_path: Path) -> None:
    """Published rows reach the hash map AND the GPU cache that holds them, in place: the
    cache's size stays, each updated key is a hit with its new row; keys the cache does
    not hold stay out of it (a miss, answered from the hash map with the new row)."""
    from hps import api

    n = 4000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    redis = RedisServer(tmp_path / "streams").start()
    config = _served(tmp_path, keys, rows, redis, warm=True, insert=False)
    hps = api.HPS(config)
    publisher = open_publisher(UpdateSourceConfig(**config["update_source"]))
    try:
        gpu = hps.server.model("m").tables[0].gpu[0]
        held = np.sort(gpu._table.dump(0, gpu._table.num_sets).get())
        assert held.size > 0  # warmed up
        size = gpu.stats()["size"]
        chosen = rng.choice(held, 200, replace=False)
        outside = np.setdiff1d(keys, held)[:50]
        assert outside.size == 50
        both = np.r_[chosen, outside]
        new = rng.standard_normal((both.size, DIM)).astype(np.float32)
        publisher.publish("hps_et.m.sparse_embedding0", [codec.encode(both, new)])
        _applied(hps, both.size)
        assert gpu.stats()["size"] == size  # nothing inserted, nothing evicted
        hits = gpu.stats()["hits"]
        out = cp.empty((200, DIM), dtype=np.float32)
        hps.lookup_fromdlpack(cp.asarray(chosen), out, "m", 0)
        np.testing.assert_array_equal(out.get(), new[:200])
        assert gpu.stats()["hits"] == hits + 200  # in place: each one a hit
        hits = gpu.stats()["hits"]
        np.testing.assert_array_equal(hps.lookup(outside, "m", 0), new[200:])
        assert gpu.stats()["hits"] == hits  # not held: missed, fetched from the hash map
    finally:
        publisher.close()
        hps.close()
        redis.close()


def test_gpu_cache_insert_puts_updated_keys_into_the_cache(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    from hps import api

    n = 4000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    redis = RedisServer(tmp_path / "streams").start()
    config = _served(tmp_path, keys, rows, redis, warm=False, insert=True)
    hps = api.HPS(config)
    publisher = open_publisher(UpdateSourceConfig(**config["update_source"]))
    try:
        gpu = hps.server.model("m").tables[0].gpu[0]
        assert gpu.stats()["size"] == 0  # not warmed
        chosen = rng.choice(keys, 250, replace=False)
        new = rng.standard_normal((250, DIM)).astype(np.float32)
        publisher.publish("hps_et.m.sparse_embedding0", [codec.encode(chosen, new)])
        _applied(hps, 250)
        # 250 keys in a cache of 4,000 slots (sets of 8): none evicts another
        assert gpu.stats()["size"] == 250
        hits = gpu.stats()["hits"]
        out = cp.empty((250, DIM), dtype=np.float32)
        hps.lookup_fromdlpack(cp.asarray(chosen), out, "m", 0)
        np.testing.assert_array_equal(out.get(), new)
        assert gpu.stats()["hits"] == hits + 250
    finally:
        publisher.close()
        hps.close()
        redis.close()
