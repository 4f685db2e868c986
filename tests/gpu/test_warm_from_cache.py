"""A peer's export carries the keys its GPU cache holds (hps/server/warm_up.py hot_set):
the cache lists them most recently used first (EmbeddingCache.held_keys), and a replica
warmed from the export (`warm_from`) starts with the peer's whole working set in its
cache, not only the few thousand keys of the hot sketch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.gpu.dynamic_cache import EmbeddingCache
from tests.conftest import model_config

pytestmark = pytest.mark.gpu

MODEL = "m"
DIM = 16
KEYS = 8000


def test_held_keys_come_most_recently_used_first(rng: np.random.Generator, cp: Any) -> None:
    cache = EmbeddingCache(4096, DIM, 0)
    try:
        older, newer = rng.choice(2**40, (2, 300), replace=False).astype(np.int64)
        rows = rng.standard_normal((300, DIM)).astype(np.float32)
        cache.insert(older, rows)
        cache.insert(newer, rows)
        assert sorted(cache.held_keys(300).tolist()) == sorted(newer.tolist())
        both = cache.held_keys(10_000)
        assert both.size == 600
        assert sorted(both[:300].tolist()) == sorted(newer.tolist())
        assert sorted(both[300:].tolist()) == sorted(older.tolist())
        assert cache.held_keys(0).size == 0
    finally:
        cache.close()


def _config(folder: Path, name: str, **extra: Any) -> dict[str, Any]:
    model = model_config([str(folder / "t0")], [DIM], MODEL, gpucache=True, gpucacheper=0.5,
                         hit_rate_threshold=1.0, init_ec=False,  # cold caches
                         hot_key_sampling=1, **extra)
    return {
        "supportlonglong": True, "models": [model],
        "volatile_db": {"type": "hash_map", "initial_cache_rate": 1.0},
        "persistent_db": {"type": "rocks_db", "path": str(folder / f"rocks-{name}")},
    }


def _hits(hps: HPS) -> int:
    return int(hps.server.model(MODEL).tables[0].gpu[0].stats()["hits"])


def test_a_replica_warmed_from_the_export_holds_the_peers_cache(
        tmp_path: Path, rng: np.random.Generator, cp: Any) -> None:
    keys = rng.choice(2**40, KEYS, replace=False).astype(np.int64)
    rows = rng.standard_normal((KEYS, DIM)).astype(np.float32)
    write_sparse_model(tmp_path / "t0", keys, rows)
    seen = keys[rng.permutation(KEYS)[:3000]]
    with HPS(_config(tmp_path, "peer")) as peer:
        for batch in np.array_split(seen, 6):
            out = cp.empty((batch.size, DIM), cp.float32)
            peer.lookup_fromdlpack(cp.asarray(batch), out, MODEL, 0)
        cp.cuda.get_current_stream().synchronize()
        gpu = peer.server.model(MODEL).tables[0].gpu[0]
        held = gpu.held_keys(1 << 20)
        export = peer.server.hot_set(MODEL, 0)
        hot = peer.server.top_keys(MODEL, 0, "hot", 1 << 20)["keys"]
        alone = peer.server.hot_set(MODEL, 0, cached=0)
    assert held.size > 2000 and set(held.tolist()) <= set(seen.tolist())
    assert np.array_equal(alone, hot)
    assert sorted(export[:hot.size].tolist()) == sorted(hot.tolist())  # the sketch's lead
    assert np.unique(export).size == export.size
    assert set(held.tolist()) <= set(export.tolist())
    path = tmp_path / "peer.hot-set"
    export.astype("<i8").tofile(path)
    with HPS(_config(tmp_path, "replica", warm_from=str(path), warm_timeout=60)) as replica:
        warmed = replica.server.model(MODEL).tables[0].gpu[0].held_keys(1 << 20)
        assert set(held.tolist()) <= set(warmed.tolist())
        before = _hits(replica)
        out = cp.empty((held.size, DIM), cp.float32)
        replica.lookup_fromdlpack(cp.asarray(held), out, MODEL, 0)
        cp.cuda.get_current_stream().synchronize()
        assert _hits(replica) - before == held.size  # the peer's working set: all hits
        at = np.searchsorted(keys, held, sorter=np.argsort(keys))
        assert np.array_equal(cp.asnumpy(out), rows[np.argsort(keys)[at]])
