"""`hps plan`'s predictions against a real GPU cache (marked `gpu`: the GPU machine runs it).

A Zipf key log is replayed twice: through the planner's predictor (the NumPy model of the
dynamic cache) and through a real dynamic GPU cache of the same size, lookup by lookup
through `HPS.lookup`. The two hit rates (whole log and its warm second half) agree within
0.02 at every size, and the cache's device bytes are the planner's. Run with `-s` to see
the table: `pytest tests/tools/test_plan_gpu.py -m gpu -s`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.tools.plan.hit_rates import hit_rate
from hps.tools.plan.memory import dynamic_cache_bytes

pytestmark = pytest.mark.gpu

TABLE_KEYS = 1_000_000
LOG_KEYS = 2_000_000
BATCH = 4096
DIM = 16
TOLERANCE = 0.02


def _zipf_log(rng: np.random.Generator, keys: np.ndarray, n: int, a: float = 1.05
              ) -> np.ndarray:
    """n lookups of `keys`, Zipf-distributed over a random order of them."""
    order = rng.permutation(keys.size)
    return keys[order[(rng.zipf(a, n) - 1) % keys.size]]


def _measured(folder: Path, keys: np.ndarray, log: np.ndarray, share: float) -> dict[str, Any]:
    """Hit rates of a real dynamic cache at gpucacheper `share` on the log, looked up
    BATCH keys at a time through HPS.lookup: every miss inserted before the next lookup
    (hit_rate_threshold above 1), an empty cache at the start (no warm-up)."""
    hps = HPS({
        "supportlonglong": True,
        "models": [{
            "model": "plan", "sparse_files": [str(folder)],
            "embedding_vecsize_per_table": [DIM],
            "maxnum_catfeature_query_per_table_per_sample": [BATCH],
            "default_value_for_each_table": [0.0], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": True, "gpucacheper": share,
            "hit_rate_threshold": 1.01, "cache_refresh_percentage_per_iteration": 0.0,
            "embedding_cache_type": "dynamic",
        }],
        "volatile_db": {"type": "hash_map"},
    })
    try:
        gpu = hps.server.model("plan").tables[0].gpu[0]
        half = -(-log.size // BATCH) // 2
        warm_from: dict[str, Any] = {}
        for i, start in enumerate(range(0, log.size, BATCH)):
            if i == half:
                warm_from = gpu.stats()
            hps.lookup(log[start:start + BATCH], "plan", 0, 0)
        stats = gpu.stats()
    finally:
        hps.close()
    warm_hits = stats["hits"] - warm_from["hits"]
    warm_keys = stats["keys"] - warm_from["keys"]
    return {"hit_rate": stats["hits"] / stats["keys"], "warm": warm_hits / warm_keys,
            "memory_bytes": stats["memory_bytes"]}


@pytest.mark.parametrize("share", [0.01, 0.05, 0.2, 0.5, 1.0])
def test_predicted_hit_rate_is_the_gpu_cache_s(tmp_path: Path, rng: np.random.Generator,
                                               share: float) -> None:
    keys = rng.choice(2**40, TABLE_KEYS, replace=False).astype(np.int64)
    write_sparse_model(tmp_path / "t0", keys, np.ones((TABLE_KEYS, DIM), np.float32))
    log = _zipf_log(rng, keys, LOG_KEYS)
    predicted = hit_rate(log, TABLE_KEYS, share, BATCH)
    measured = _measured(tmp_path / "t0", keys, log, share)
    print(f"\ngpucacheper {share:g}: hit rate predicted {predicted.hit_rate:.4f} measured "
          f"{measured['hit_rate']:.4f}; warm predicted {predicted.warm_hit_rate:.4f} "
          f"measured {measured['warm']:.4f}")
    assert measured["memory_bytes"] == dynamic_cache_bytes(TABLE_KEYS, DIM, share)["float32"]
    assert abs(predicted.hit_rate - measured["hit_rate"]) <= TOLERANCE
    assert abs(predicted.warm_hit_rate - measured["warm"]) <= TOLERANCE
