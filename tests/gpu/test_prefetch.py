"""Prefetch into a GPU cache (hps/server/prefetch.py → GpuCaches.prefetch): keys
prefetched into a cold dynamic cache are all hits on their next lookup, by the cache's
own hit counters; and the hot-key sketch of a table with a GPU cache sees its lookups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS

pytestmark = pytest.mark.gpu

MODEL = "m"
DIM = 32
KEYS = 4000


def _config(folder: Path, keys: np.ndarray, rows: np.ndarray) -> dict[str, Any]:
    write_sparse_model(folder / "t0", keys, rows)
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [str(folder / "t0")],
            "embedding_vecsize_per_table": [DIM],
            "maxnum_catfeature_query_per_table_per_sample": [1 << 16],
            "default_value_for_each_table": [0.0], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": True, "gpucacheper": 1.0,
            "hit_rate_threshold": 1.0, "init_ec": False,  # a cold cache
            "hot_key_sampling": 1,
        }],
        "volatile_db": {"type": "hash_map", "initial_cache_rate": 0.0},
        "persistent_db": {"type": "rocks_db", "path": str(folder / "rocks")},
    }


def _counts(hps: HPS) -> dict[str, int]:
    stats = hps.server.model(MODEL).tables[0].gpu[0].stats()
    return {"hits": int(stats["hits"]), "misses": int(stats["misses"])}


def test_prefetched_keys_are_all_hits(tmp_path: Path, rng: np.random.Generator,
                                      cp: Any) -> None:
    keys = rng.choice(2**40, KEYS, replace=False).astype(np.int64)
    rows = rng.standard_normal((KEYS, DIM)).astype(np.float32)
    with HPS(_config(tmp_path, keys, rows)) as hps:
        wanted = keys[:500]
        job = hps.prefetch(MODEL, 0, wanted)
        assert job.wait(60) and job.status == "done", job.as_dict()
        assert job.gpu_inserted == 500 and job.volatile_filled == 500
        before = _counts(hps)
        out = cp.empty((500, DIM), cp.float32)
        hps.lookup_fromdlpack(cp.asarray(wanted), out, MODEL, 0)
        cp.cuda.get_current_stream().synchronize()
        after = _counts(hps)
        assert after["hits"] - before["hits"] == 500
        assert after["misses"] == before["misses"]
        assert np.array_equal(cp.asnumpy(out), rows[:500])


def test_the_hot_sketch_of_a_gpu_table_sees_its_lookups(tmp_path: Path,
                                                        rng: np.random.Generator,
                                                        cp: Any) -> None:
    keys = rng.choice(2**40, KEYS, replace=False).astype(np.int64)
    rows = rng.standard_normal((KEYS, DIM)).astype(np.float32)
    with HPS(_config(tmp_path, keys, rows)) as hps:
        out = cp.empty((8, DIM), cp.float32)
        hps.lookup_fromdlpack(cp.asarray(keys[:8]), out, MODEL, 0)  # cold: all misses
        cp.cuda.get_current_stream().synchronize()
        top = hps.server.top_keys(MODEL, 0, "hot", 100)
        assert top["source"] == "gpu_lookups"
        assert sorted(top["keys"].tolist()) == sorted(keys[:8].tolist())
