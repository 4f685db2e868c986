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
from hps.gpu.lookup import GpuEmbeddingTable
from hps.updates import codec
from hps.updates.source import open_publisher
from tests.redis_servers import RedisServer, eventually

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
    with GpuEmbeddingTable(model, 0, n, 0, store.fetch) as table:
        table.warm_up([(keys, rows)])
        size = table.stats()["size"]
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


@pytest.mark.parametrize("insert", [False, True])
def test_a_served_models_cache_takes_updates_from_redis_streams(
        cp: Any, rng: np.random.Generator, tmp_path: Path, insert: bool) -> None:
    """Published rows reach the persistent-less hash map AND the GPU cache that holds
    them, in place: the cache's size stays, its hit count covers the updated keys."""
    from hps import api

    n = 4000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    redis = RedisServer(tmp_path / "streams").start()
    config = {
        "supportlonglong": True,
        "models": [{
            "model": "m", "sparse_files": [_write_model(tmp_path / "t0", keys, rows)],
            "embedding_vecsize_per_table": [DIM],
            "maxnum_catfeature_query_per_table_per_sample": [64],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
            # a roomy cache warmed to a quarter: the inserts of the second case find
            # free slots and evict nothing
            "max_batch_size": 64, "gpucache": True, "gpucacheper": 1.0,
            "cache_refresh_percentage_per_iteration": 0.25, "hit_rate_threshold": 1.1,
        }],
        "volatile_db": {"type": "hash_map"},
        "update_source": {"type": "redis_stream", "address": redis.address,
                          "poll_timeout_ms": 50, "gpu_cache_insert": insert},
    }
    hps = api.HPS(config)
    publisher = open_publisher(UpdateSourceConfig(**config["update_source"]))
    try:
        gpu = hps.server.model("m").tables[0].gpu[0]
        held = np.sort(gpu._table.dump(0, gpu._table.num_sets).get())
        assert held.size > 0  # warmed up
        size = gpu.stats()["size"]
        chosen = rng.choice(held, 200, replace=False)
        outside = np.setdiff1d(keys, held)[:50]
        both = np.r_[chosen, outside]
        new = rng.standard_normal((both.size, DIM)).astype(np.float32)
        publisher.publish("hps_et.m.sparse_embedding0", [codec.encode(both, new)])

        def applied() -> None:
            status = hps.server.update_status()
            assert status is not None and status["tables"][
                "hps_et.m.sparse_embedding0"]["rows"] == both.size

        eventually(applied, 20.0, "the update applied")
        assert gpu.stats()["size"] == size + (50 if insert else 0)
        hits = gpu.stats()["hits"]
        out = cp.empty((200, DIM), dtype=np.float32)
        hps.lookup_fromdlpack(cp.asarray(chosen), out, "m", 0)
        np.testing.assert_array_equal(out.get(), new[:200])
        assert gpu.stats()["hits"] == hits + 200  # in place: each one a hit
        hits = gpu.stats()["hits"]
        np.testing.assert_array_equal(hps.lookup(outside, "m", 0), new[200:])
        # inserted: hits; else misses, fetched from the hash map (which has the new rows)
        assert gpu.stats()["hits"] == hits + (50 if insert else 0)
    finally:
        publisher.close()
        hps.close()
        redis.close()
