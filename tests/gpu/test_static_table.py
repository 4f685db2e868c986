"""StaticEmbeddingTable (hps/gpu/static_table.py): build, lookups, refresh, limits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hps.gpu.dynamic_cache import EMPTY_KEY
from hps.gpu.static_table import SMALL_BATCH, StaticEmbeddingTable, TableFullError

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dim,load_factor", [(16, 0.8), (3, 0.95), (128, 0.5)])
def test_holds_every_key_built(cp: Any, rng: np.random.Generator, seed: int, dim: int,
                               load_factor: float) -> None:
    n = 5000
    keys = np.r_[rng.choice(2**62, n - 2, replace=False) - 2**61, EMPTY_KEY, -1].astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    with StaticEmbeddingTable(n, dim, load_factor=load_factor) as table:
        for start in range(0, n, 1700):  # chunk by chunk, as warm-up does
            table.build(keys[start:start + 1700], rows[start:start + 1700])
        assert table.size() == n
        absent = rng.choice(2**62, 500) + 2**62  # disjoint from the built keys
        query = np.r_[keys, absent, keys[:100]].astype(np.int64)
        rng.shuffle(query)
        out = cp.empty((query.size, dim), dtype=np.float32)
        positions, count = table.query(cp.asarray(query), out, default_value=7.0)
        expected = dict(zip(keys.tolist(), rows, strict=True))
        got = out.get()
        missed = np.zeros(query.size, dtype=bool)
        missed[positions.get()] = True
        assert count == 500, f"seed={seed}"
        assert (query[missed] >= 2**62).all()
        assert (got[missed] == 7.0).all()
        np.testing.assert_array_equal(
            got[~missed], np.stack([expected[k] for k in query[~missed].tolist()]))
        np.testing.assert_array_equal(np.sort(table.dump(0, table.num_sets).get()),
                                      np.sort(keys))


def test_large_batches_take_the_throughput_kernel(cp: Any, rng: np.random.Generator) -> None:
    n, dim = SMALL_BATCH + 5000, 4
    keys = rng.choice(2**50, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    with StaticEmbeddingTable(n, dim) as table:
        table.build(keys, rows)
        query = np.r_[keys, 2**55 + np.arange(7)].astype(np.int64)
        out = cp.empty((query.size, dim), dtype=np.float32)
        positions, count = table.query(cp.asarray(query), out, default_value=-1.0)
        assert count == 7 and sorted(positions.get().tolist()) == list(range(n, n + 7))
        np.testing.assert_array_equal(out.get()[:n], rows)


def test_update_rewrites_rows_in_place(cp: Any, rng: np.random.Generator) -> None:
    dim, n = 8, 1000
    keys = np.arange(n, dtype=np.int64) * 104729
    with StaticEmbeddingTable(n, dim) as table:
        table.build(keys, np.zeros((n, dim), dtype=np.float32))
        new = rng.standard_normal((n, dim)).astype(np.float32)
        assert table.update(np.r_[keys[:400], [12345678901]], np.r_[new[:400],
                            np.ones((1, dim), np.float32)]) == 400
        out = cp.empty((n, dim), dtype=np.float32)
        table.query(cp.asarray(keys), out)
        got = out.get()
        np.testing.assert_array_equal(got[:400], new[:400])
        assert (got[400:] == 0).all()
        assert table.size() == n


def test_too_many_keys_is_an_error(cp: Any) -> None:
    with StaticEmbeddingTable(100, 4) as table:
        keys = np.arange(1000, dtype=np.int64)
        with pytest.raises(TableFullError, match="sized for 100 keys"):
            table.build(keys, np.zeros((1000, 4), dtype=np.float32))
        assert table.size() == table.num_slots  # every slot taken, the rest refused


def test_memory_required(cp: Any) -> None:
    need = StaticEmbeddingTable.memory_required(10_000, 64)
    with StaticEmbeddingTable(10_000, 64) as table:
        assert table.memory_bytes() == need
        assert table.num_slots >= 10_000 / 0.8
