"""The hot keys of a table with a GPU cache, sampled on the device (hps/gpu/key_sample.py):
a skewed stream through `lookup_fromdlpack` finds its true top 10 among the sketch's top
20, each path of the GPU lookup (the contiguous shortcut, narrow and strided keys, host
keys) counts exactly what the host path would, and the cache's misses feed the hot
sketch no more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from tests.conftest import model_config

pytestmark = pytest.mark.gpu

MODEL = "m"
DIM = 16
KEYS = 100_000


def _config(folder: Path, keys: np.ndarray, rows: np.ndarray, **model: Any
            ) -> dict[str, Any]:
    write_sparse_model(folder / "t0", keys, rows)
    return {
        "supportlonglong": True,
        "models": [model_config(
            [str(folder / "t0")], [DIM], MODEL,
            maxnum_catfeature_query_per_table_per_sample=[4096],
            default_value_for_each_table=[0.0], max_batch_size=1, gpucache=True,
            gpucacheper=0.5, embedding_cache_type="dynamic", hit_rate_threshold=1.0,
            init_ec=False, **model)],
        "volatile_db": {"type": "hash_map"},
    }


def _table(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    keys = rng.choice(2**40, KEYS, replace=False).astype(np.int64)
    return keys, rng.standard_normal((KEYS, DIM)).astype(np.float32)


def test_a_skewed_stream_finds_the_true_top_10_among_its_top_20(
        tmp_path: Path, rng: np.random.Generator, cp: Any) -> None:
    import torch

    keys, rows = _table(rng)
    batches, n = 1000, 2000
    ranks = (rng.zipf(1.1, batches * n) - 1) % KEYS
    stream = keys[rng.permutation(KEYS)[ranks]].reshape(batches, n)
    with HPS(_config(tmp_path, keys, rows)) as hps:  # a GPU table's default: 1 in 32
        dev = torch.device("cuda", 0)
        on_device = torch.as_tensor(stream, device=dev)
        out = torch.empty((n, DIM), dtype=torch.float32, device=dev)
        for i in range(batches):
            hps.lookup_fromdlpack(on_device[i], out, MODEL, 0)
        torch.cuda.synchronize(dev)
        top = hps.server.top_keys(MODEL, 0, "hot", 20)
    found, counts = np.unique(stream, return_counts=True)
    true10 = found[np.argsort(-counts, kind="stable")[:10]]
    assert set(true10.tolist()) <= set(top["keys"].tolist())
    assert top["source"] == "gpu_lookups"
    assert top["sampling"].startswith("1 in 32 GPU lookups")
    # the lookups' keys, weighted, and not the misses again: about the stream's size
    assert 0.5 * stream.size < top["total"] < 1.5 * stream.size


def _paths(torch: Any, cp: Any, key: int, n: int) -> list[tuple[str, Any, Any]]:
    """(name, keys, output) of n keys all `key`, one per way into the GPU lookup."""
    dev = torch.device("cuda", 0)
    return [
        ("torch int64 (the shortcut)", torch.full((n,), key, dtype=torch.int64, device=dev),
         torch.empty((n, DIM), dtype=torch.float32, device=dev)),
        ("torch int32", torch.full((n,), key, dtype=torch.int32, device=dev),
         torch.empty((n, DIM), dtype=torch.float32, device=dev)),
        ("torch strided", torch.full((2 * n,), key, dtype=torch.int64, device=dev)[::2],
         torch.empty((n, DIM), dtype=torch.float32, device=dev)),
        ("cupy uint64", cp.full((n,), key, dtype=cp.uint64),
         cp.empty((n, DIM), dtype=cp.float32)),
        ("numpy", np.full(n, key, np.int64), None),
    ]


def test_every_path_counts_exactly_as_the_host_path(tmp_path: Path, rng: np.random.Generator,
                                                     cp: Any) -> None:
    import torch

    keys, rows = _table(rng)
    key = int(keys[7] % 2**31)  # fits the int32 keys too
    keys[7] = key
    n, lookups = 200, 64
    with HPS(_config(tmp_path, keys, rows, hot_key_sampling=4)) as hps:
        table = hps.server.model(MODEL).tables[0]
        for name, k, out in _paths(torch, cp, key, n):
            table.sample_hot_keys(4)  # a fresh sketch for each path
            assert table.hot_mask == -1 and table.hot_sample is not None
            for _ in range(lookups):
                if out is None:
                    assert np.array_equal(hps.lookup(k, MODEL, 0)[0], rows[7])
                else:
                    hps.lookup_fromdlpack(k, out, MODEL, 0)
            torch.cuda.synchronize()
            top = hps.server.top_keys(MODEL, 0, "hot", 5)
            # 16 samples of 50 keys (1 in 4 of 200), each weighted 4 (calls) × 4 (stride)
            assert top["keys"].tolist() == [key], name
            assert top["counts"].tolist() == [lookups * n] == [top["total"]], name
            assert table.hot_sample.skipped == 0 and table.hot_sample.fed == 16, name


def test_misses_do_not_feed_the_hot_sketch_and_sampling_off_feeds_nothing(
        tmp_path: Path, rng: np.random.Generator, cp: Any) -> None:
    keys, rows = _table(rng)
    with HPS(_config(tmp_path, keys, rows, hot_key_sampling=0)) as hps:
        table = hps.server.model(MODEL).tables[0]
        assert table.hot_sample is None and table.hot_mask == -1
        out = cp.empty((500, DIM), cp.float32)
        hps.lookup_fromdlpack(cp.asarray(keys[:500]), out, MODEL, 0)  # cold: all misses
        cp.cuda.get_current_stream().synchronize()
        assert np.array_equal(cp.asnumpy(out), rows[:500])
        top = hps.server.top_keys(MODEL, 0, "hot", 10)
        assert top["keys"].size == 0 and top["sampling"].startswith("off")
