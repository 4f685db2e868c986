"""The compiled host side of the miss path (hps/gpu/host_loops.py) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from hps.gpu.dynamic_cache import EMPTY_KEY
from hps.gpu.dynamic_cache import set_codes as numpy_set_codes
from hps.gpu.host_loops import dedupe, set_codes


@pytest.mark.parametrize("n", [0, 1, 7, 300, 5000])
def test_dedupe_keeps_first_appearances_in_order(rng: np.random.Generator, n: int) -> None:
    keys = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    if n:
        keys[rng.integers(0, n, n // 3)] = keys[rng.integers(0, n, n // 3)]  # repeats
        keys[0] = EMPTY_KEY
    unique = np.full(n, 7, np.int64)
    inverse = np.full(n, -1, np.int32)
    u = dedupe(keys, unique, inverse)
    want, first = np.unique(keys, return_index=True)
    assert u == want.size
    np.testing.assert_array_equal(unique[:u], keys[np.sort(first)])
    np.testing.assert_array_equal(unique[inverse], keys)


@pytest.mark.parametrize("num_sets", [1, 37, 2**20 + 3])
def test_set_codes_match_the_numpy_twin(rng: np.random.Generator, num_sets: int) -> None:
    keys = rng.integers(-(2**63), 2**63 - 1, 999, dtype=np.int64)
    codes = np.empty(keys.size, np.uint64)
    set_codes(keys, num_sets, codes)
    np.testing.assert_array_equal(codes, numpy_set_codes(keys, num_sets))


@pytest.mark.parametrize("n,shards", [(0, 2), (1, 2), (600, 2), (5000, 3), (40, 8)])
def test_stage_by_shard_groups_the_distinct_keys_by_their_shard(
        rng: np.random.Generator, n: int, shards: int) -> None:
    from hps.gpu.host_loops import stage_sharded
    from hps.gpu.shard_routing import shard_of

    num_sets = 101
    missed = rng.integers(-(2**40), 2**40, max(1, n // 2), dtype=np.int64)[
        rng.integers(0, max(1, n // 2), n)]  # repeats
    unique = np.full(n, 7, np.int64)
    inverse = np.full(n, -1, np.int32)
    codes = np.zeros(n, np.uint64)
    starts = np.full(shards + 1, -1, np.int64)
    u = stage_sharded(missed, shards, num_sets, unique, inverse, codes, starts)
    assert u == np.unique(missed).size and starts[0] == 0 and starts[-1] == u
    np.testing.assert_array_equal(unique[inverse], missed)
    held = unique[:u]
    for s in range(shards):
        group = held[starts[s]:starts[s + 1]]
        assert np.all(shard_of(group, shards) == s)
        np.testing.assert_array_equal(codes[starts[s]:starts[s + 1]],
                                      numpy_set_codes(group, num_sets))
