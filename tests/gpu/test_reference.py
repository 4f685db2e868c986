"""The NumPy model of the cache (hps/gpu/cache_model.py) against a naive per-key model.

Runs without a GPU: it checks the vectorized model itself, which the GPU tests then hold
the CUDA cache to.
"""

from __future__ import annotations

import numpy as np

from hps.gpu.cache_model import ReferenceCache, murmur3_fmix64, set_of
from hps.gpu.dynamic_cache import EMPTY_KEY, RANK_BITS, SET_SIZE, set_codes


class NaiveCache:
    """One key at a time, dicts and lists: the semantics written out plainly."""

    def __init__(self, num_sets: int) -> None:
        self.num_sets = num_sets
        self.sets: list[list[list[object]]] = [
            [[EMPTY_KEY, 0, None] for _ in range(SET_SIZE)] for _ in range(num_sets)
        ]
        self.special: object = None
        self.tick = 0

    def _set(self, key: int) -> list[list[object]]:
        return self.sets[int(set_of(np.array([key]), self.num_sets)[0])]

    def query(self, keys: np.ndarray) -> list[object]:
        if keys.size == 0:
            return []
        self.tick += 1
        out: list[object] = []
        for key in keys.tolist():
            if key == EMPTY_KEY:
                out.append(self.special)
                continue
            hit = None
            for slot in self._set(key):
                if slot[0] == key:
                    slot[1] = self.tick << RANK_BITS
                    hit = slot[2]
            out.append(hit)
        return out

    def insert(self, keys: np.ndarray, rows: list[object]) -> None:
        if keys.size == 0:
            return
        self.tick += 1
        rank: dict[int, int] = {}  # keys of this batch seen per set so far
        for key, row in zip(keys.tolist(), rows, strict=True):
            s = int(set_of(np.array([key]), self.num_sets)[0])
            r = rank.get(s, 0)
            rank[s] = r + 1
            if key == EMPTY_KEY:
                self.special = row
                continue
            ways = self._set(key)
            target = next((s for s in ways if s[0] == key), None)
            if target is None:
                target = next((s for s in ways if s[0] == EMPTY_KEY), None)
            if target is None:
                target = min(ways, key=lambda s: s[1])  # first of the smallest stamps
            target[:] = [key, self.tick << RANK_BITS | r, row]

    def remove(self, keys: np.ndarray) -> None:
        for key in keys.tolist():
            if key == EMPTY_KEY:
                self.special = None
            for slot in self._set(key):
                if slot[0] == key:
                    slot[:] = [EMPTY_KEY, 0, None]


def test_murmur3_fmix64_matches_the_published_finalizer() -> None:
    def fmix64(k: int) -> int:
        m = 2**64 - 1
        k ^= k >> 33
        k = (k * 0xFF51AFD7ED558CCD) & m
        k ^= k >> 33
        k = (k * 0xC4CEB9FE1A85EC53) & m
        return k ^ (k >> 33)

    keys = np.array([0, 1, -1, 2**63 - 1, -(2**63), 123456789012345], dtype=np.int64)
    assert murmur3_fmix64(keys).tolist() == [fmix64(int(k) & (2**64 - 1)) for k in keys]
    sets = set_of(keys, 1000)
    assert ((sets >= 0) & (sets < 1000)).all()


def test_model_matches_naive_model(rng: np.random.Generator) -> None:
    num_sets, dim = 6, 1
    model, naive = ReferenceCache(num_sets * SET_SIZE, dim), NaiveCache(num_sets)
    universe = np.r_[rng.integers(-(2**62), 2**62, 150), EMPTY_KEY].astype(np.int64)
    next_row = 0.0
    for _ in range(300):
        op = rng.integers(0, 3)
        keys = rng.choice(universe, size=int(rng.integers(0, 40)))
        if op == 0:
            rows = np.arange(next_row, next_row + keys.size, dtype=np.float32)
            next_row += keys.size
            model.insert(keys, rows.reshape(-1, 1))
            naive.insert(keys, rows.tolist())
        elif op == 1:
            out, missed = model.query(keys)
            expected = naive.query(keys)
            assert missed.tolist() == [e is None for e in expected]
            assert [float(r[0]) for r, m in zip(out, missed, strict=True) if not m] == \
                [e for e in expected if e is not None]
        else:
            keys = keys[: int(rng.integers(0, 5))]
            model.remove(keys)
            naive.remove(keys)
        assert model.tick == naive.tick
        for s in range(num_sets):
            assert model.keys[s].tolist() == [slot[0] for slot in naive.sets[s]]
            assert model.stamps[s].tolist() == [slot[1] for slot in naive.sets[s]]
    assert model.size() == sum(
        slot[0] != EMPTY_KEY for ways in naive.sets for slot in ways
    ) + (naive.special is not None)


def test_insert_batch_larger_than_a_set_keeps_the_last(rng: np.random.Generator) -> None:
    model = ReferenceCache(SET_SIZE, 2)  # one set
    keys = np.arange(SET_SIZE + 3, dtype=np.int64)
    model.insert(keys, rng.standard_normal((keys.size, 2)))
    held = model.dump(0, 1)
    assert held.size == SET_SIZE
    # the batch's first keys were evicted by its later ones (equal stamps, lowest way first)
    assert set(held.tolist()) == set(keys[3:].tolist())


def test_set_codes_order_keys_by_set_then_position(rng: np.random.Generator) -> None:
    keys = rng.integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64)
    codes = set_codes(keys, 37)
    sets, positions = (codes >> np.uint64(32)).astype(np.int64), (codes & np.uint64(2**32 - 1))
    assert sorted(positions.tolist()) == list(range(1000))
    np.testing.assert_array_equal(sets, set_of(keys[positions.astype(np.int64)], 37))
    assert (np.diff(codes) > 0).all()
