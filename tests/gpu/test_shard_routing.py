"""Row-wise GPU sharding without a GPU: the key → shard hash (the kernel's twin), the
split of a batch by shard, shard sizing, and the config's rules (hps/gpu/sharded.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hps.config import ModelConfig
from hps.errors import ConfigError
from hps.gpu.dynamic_cache import set_of
from hps.gpu.shard_routing import shard_keys, shard_of, split_by_shard


def test_shards_are_even_and_independent_of_the_caches_sets(rng: np.random.Generator) -> None:
    keys = rng.integers(-2**62, 2**62, 200_000, dtype=np.int64)
    for shards in (2, 3, 4, 7):
        owned = shard_of(keys, shards)
        counts = np.bincount(owned, minlength=shards)
        assert owned.min() >= 0 and owned.max() < shards
        assert counts.max() <= shard_keys(keys.size, shards)
        assert counts.min() > 0.95 * keys.size / shards
        # within one shard the keys still spread over every set of a cache
        sets = np.bincount(set_of(keys[owned == 0], 64), minlength=64)
        assert sets.min() > 0.7 * sets.mean()


def test_sequential_keys_spread_too() -> None:
    keys = np.arange(100_000, dtype=np.int64)
    counts = np.bincount(shard_of(keys, 4), minlength=4)
    assert counts.min() > 0.95 * 25_000


def test_split_by_shard_keeps_each_shards_order(rng: np.random.Generator) -> None:
    keys = rng.integers(0, 2**40, 5000, dtype=np.int64)
    parts = split_by_shard(keys, 3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(keys.size))
    owned = shard_of(keys, 3)
    for s, where in enumerate(parts):
        assert np.all(owned[where] == s)
        assert np.all(np.diff(where) > 0)  # positions in batch order


def _model(**extra: object) -> dict[str, object]:
    return {"model": "m", "sparse_files": ["/m/t0"], "embedding_vecsize_per_table": [8],
            "maxnum_catfeature_query_per_table_per_sample": [4],
            "deployed_device_list": [0, 1], **extra}


def test_config_takes_row_wise_sharding() -> None:
    model = ModelConfig(**_model(gpu_sharding="row_wise", gpu_shards=4))
    assert model.gpu_sharding == "row_wise" and model.gpu_shards == 4
    assert ModelConfig(**_model()).gpu_sharding == "replicated"


@pytest.mark.parametrize("extra,words", [
    ({"gpu_sharding": "row_wise", "embedding_cache_type": "uvm"}, "uvm"),
    ({"gpu_sharding": "row_wise", "gpu_shards": 1}, "at least the number of deployed"),
    ({"gpu_sharding": "column_wise"}, "gpu_sharding"),
])
def test_config_refuses_what_sharding_cannot_do(extra: dict[str, object], words: str) -> None:
    from hps.config import parse_config

    with pytest.raises(ConfigError, match=words):
        parse_config({"models": [_model(**extra)]})
