"""A table's GPU cache split row-wise into shards, beside the same table whole, through the
public call (`hps bench gpu --profile sharded`).

On one device the shards share it: what this measures is the routing's cost (the shard
hash, the sort by shard, the one host wait for the shard counts, a launch per shard, the
scatter back), the price a sharded table pays before peer reads come in. With several
devices deployed, shard s lives on device s (the figures the two-GPU target needs).
Tables: a static table of dim 64 (all hits) and a dynamic cache of 25% of the table with
power-law keys (misses fetched from the in-process tier). Batches of 2,000 and 1M torch
keys, uniform and power-law; every output checked against the model file's rows.
The floor beside each row: torch.index_select of the same rows from a dense table.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_public import MODEL, server_over_files


def _power_law(rng: np.random.Generator, size: int, n: int, alpha: float = 1.1) -> np.ndarray:
    ranks = rng.zipf(alpha, size * 2)
    ranks = ranks[ranks <= size][:n] - 1
    while ranks.size < n:  # zipf draws beyond the table are dropped; draw again
        more = rng.zipf(alpha, n)
        ranks = np.r_[ranks, more[more <= size] - 1][:n]
    return ranks


def bench_sharded(dim: int = 64, table_keys: int = 1 << 21, shards: int = 2,
                  seconds: float = 1.0, seed: int = 0) -> list[dict[str, Any]]:
    """keys/s of sharded vs whole tables (see the module docstring), with ratios."""
    import cupy as cp
    import torch

    devices = list(range(cp.cuda.runtime.getDeviceCount()))
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    dense = torch.as_tensor(rows, device="cuda:0")
    results: list[dict[str, Any]] = []
    setups = [("static", {"embedding_cache_type": "static"}),
              ("dynamic 25%", {"embedding_cache_type": "dynamic", "gpucacheper": 0.25,
                               "hit_rate_threshold": 1.1})]
    for n in (2000, 1 << 20):
        for how in ("uniform", "power-law"):
            picks = [rng.integers(0, table_keys, n) if how == "uniform"
                     else _power_law(rng, table_keys, n) for _ in range(4)]
            batches = [torch.as_tensor(keys[p], device="cuda:0") for p in picks]
            index = [torch.as_tensor(p, device="cuda:0") for p in picks]
            out = torch.empty((n, dim), device="cuda:0")
            floor = _rate(lambda i, x=index, o=out: torch.index_select(dense, 0, x[i % 4], out=o),
                          n, seconds)
            for name, model in setups:
                rates = {}
                for layout in ("whole", "sharded"):
                    extra = dict(model)
                    if layout == "sharded":
                        extra.update(gpu_sharding="row_wise",
                                     gpu_shards=max(shards, len(devices)),
                                     deployed_device_list=devices)
                    with tempfile.TemporaryDirectory() as tmp:
                        hps = server_over_files(Path(tmp), keys, rows, n, 0, **extra)
                        try:
                            for i in range(3):  # warm-up rounds: the caches fill
                                hps.lookup_fromdlpack(batches[i % 4], out, MODEL, 0)
                            rates[layout] = _rate(
                                lambda i, h=hps, b=batches, o=out:
                                    h.lookup_fromdlpack(b[i % 4], o, MODEL, 0),
                                n, seconds)
                            hps.lookup_fromdlpack(batches[0], out, MODEL, 0)
                            torch.cuda.synchronize()
                            wrong = int((out.cpu().numpy() != rows[picks[0]]).any(axis=1).sum())
                        finally:
                            hps.close()
                    results.append({"bench": "sharded", "table": name, "keys": how,
                                    "batch": n, "layout": layout,
                                    "shards": extra.get("gpu_shards", 1),
                                    "devices": len(extra.get("deployed_device_list", [0])),
                                    "M_keys_per_s": rates[layout] / 1e6,
                                    "floor_M_keys_per_s": floor / 1e6,
                                    "vs_floor": rates[layout] / floor, "wrong_rows": wrong})
                results[-1]["vs_whole"] = rates["sharded"] / rates["whole"]
    return results


def _rate(call: Any, n: int, seconds: float) -> float:
    """keys/s of `call(i)` looped for `seconds`, a sync after each call."""
    import torch

    sync = torch.cuda.current_stream().synchronize
    for i in range(3):
        call(i)
    sync()
    done, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        call(i)
        sync()
        done += n
        i += 1
    return done / (time.perf_counter() - start)


if __name__ == "__main__":
    for row in bench_sharded():
        print(row)
