"""A pure NumPy model of the dynamic GPU embedding cache (dynamic_cache.py): what the GPU
cache would hold after any sequence of operations, told without a GPU.

Same sets (MurmurHash3's finalizer scaled to the set count), same associativity, same
least-recently-used eviction, same tick bookkeeping, so after any sequence of operations
applied to both, the model's slots hold exactly the keys, stamps and rows the GPU cache
holds, way for way. Two users: `hps plan` replays a key log through it to tell the hit
rate a cache size would have (hps/tools/plan/hit_rates.py), and the GPU tests compare the
CUDA cache with it on random operation sequences (tests/gpu/test_cache.py,
test_lookup.py; tests/gpu/test_reference.py holds it to a naive per-key model).

Semantics modelled (see dynamic_cache.py):
- every non-empty `query` and `insert` call takes the next tick; a hit stamps its slot
  with tick << RANK_BITS (with lru_sample_shift s > 0: only hits whose
  murmur3_fmix64(key ^ (tick << RANK_BITS)) has its low s bits zero), an insert with
  tick << RANK_BITS | (rank of the key among the batch's keys of its set);
- insert: the keys of one batch that fall in one set are inserted in batch order; a held
  key is overwritten in place; else the first free way is taken; else the way with the
  smallest stamp (the lowest way on ties) is evicted;
- update rewrites held keys' rows and leaves stamps alone; remove frees slots (stamp 0);
- the key EMPTY_KEY lives in one special slot outside the sets, never evicted.

Vectorized over keys: an insert runs in rounds, round r inserting the r-th key of every
set at once. Pure NumPy: importing it imports no CuPy. Memory: the slots' keys and stamps
(16 bytes a slot) and rows (4 × dim bytes a slot; a model that only counts hits uses
dim 1).
"""

from __future__ import annotations

import numpy as np

from hps.gpu.dynamic_cache import EMPTY_KEY, RANK_BITS, SET_SIZE, murmur3_fmix64, set_of

__all__ = ["ReferenceCache", "murmur3_fmix64", "set_of"]


class ReferenceCache:
    """The NumPy twin of EmbeddingCache(capacity_slots, dim, lru_sample_shift=...)."""

    def __init__(self, capacity_slots: int, dim: int, lru_sample_shift: int = 0) -> None:
        self.lru_sample_shift = int(lru_sample_shift)
        self.num_sets = -(-int(capacity_slots) // SET_SIZE)
        self.dim = int(dim)
        self.keys = np.full((self.num_sets, SET_SIZE), EMPTY_KEY, dtype=np.int64)
        self.stamps = np.zeros((self.num_sets, SET_SIZE), dtype=np.uint64)
        self.rows = np.zeros((self.num_sets, SET_SIZE, self.dim), dtype=np.float32)
        self.special = False
        self.special_row = np.zeros(self.dim, dtype=np.float32)
        self.tick = 0

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sets, ways, found) of keys; ways are meaningful where found."""
        sets = set_of(keys, self.num_sets)
        match = (self.keys[sets] == keys[:, None]) & (keys[:, None] != EMPTY_KEY)
        return sets, match.argmax(axis=1), match.any(axis=1)

    def query(self, keys: np.ndarray, default_value: float = 0.0
              ) -> tuple[np.ndarray, np.ndarray]:
        """(out [n, dim], missed bool [n]); hits are stamped with the next tick."""
        keys = np.asarray(keys, dtype=np.int64)
        out = np.full((keys.size, self.dim), default_value, dtype=np.float32)
        if keys.size == 0:
            return out, np.zeros(0, dtype=bool)
        self.tick += 1
        sets, ways, found = self._find(keys)
        out[found] = self.rows[sets[found], ways[found]]
        stamp = found
        if self.lru_sample_shift:
            tick = np.uint64(self.tick << RANK_BITS)
            sample = murmur3_fmix64((keys.view(np.uint64) ^ tick).view(np.int64))
            stamp = found & ((sample & np.uint64((1 << self.lru_sample_shift) - 1)) == 0)
        self.stamps[sets[stamp], ways[stamp]] = self.tick << RANK_BITS
        if self.special:
            is_special = keys == EMPTY_KEY
            out[is_special] = self.special_row
            found |= is_special
        return out, ~found

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        vectors = np.asarray(vectors, dtype=np.float32).reshape(keys.size, self.dim)
        if keys.size == 0:
            return
        self.tick += 1
        tick = self.tick << RANK_BITS
        sets = set_of(keys, self.num_sets)
        order = np.argsort(sets, kind="stable")
        sorted_sets = sets[order]
        starts = np.flatnonzero(np.r_[True, sorted_sets[1:] != sorted_sets[:-1]])
        first = np.repeat(starts, np.diff(np.r_[starts, keys.size]))
        rank = np.empty(keys.size, dtype=np.int64)
        rank[order] = np.arange(keys.size) - first
        for r in range(int(rank.max()) + 1):  # rounds: one key per set each
            idx = np.flatnonzero(rank == r)
            k, s, v = keys[idx], sets[idx], vectors[idx]
            special = k == EMPTY_KEY
            if special.any():
                self.special = True
                self.special_row = v[special][0].copy()
            k, s, v = k[~special], s[~special], v[~special]
            cand = self.keys[s]
            match = cand == k[:, None]
            empty = cand == EMPTY_KEY
            way = np.where(
                match.any(axis=1), match.argmax(axis=1),
                np.where(empty.any(axis=1), empty.argmax(axis=1),
                         self.stamps[s].argmin(axis=1)),
            )
            self.keys[s, way] = k
            self.stamps[s, way] = tick | min(r, (1 << RANK_BITS) - 1)
            self.rows[s, way] = v

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        keys = np.asarray(keys, dtype=np.int64)
        vectors = np.asarray(vectors, dtype=np.float32).reshape(keys.size, self.dim)
        sets, ways, found = self._find(keys)
        self.rows[sets[found], ways[found]] = vectors[found]
        count = int(found.sum())
        is_special = keys == EMPTY_KEY
        if self.special and is_special.any():
            self.special_row = vectors[is_special][-1].copy()
            count += int(is_special.sum())
        return count

    def remove(self, keys: np.ndarray) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        sets, ways, found = self._find(keys)
        self.keys[sets[found], ways[found]] = EMPTY_KEY
        self.stamps[sets[found], ways[found]] = 0
        if (keys == EMPTY_KEY).any():
            self.special = False

    def dump(self, start_set: int, stop_set: int) -> np.ndarray:
        """Keys held in sets [start_set, stop_set), sorted."""
        held = self.keys[start_set:stop_set].ravel()
        held = held[held != EMPTY_KEY]
        if self.special and start_set <= set_of(np.array([EMPTY_KEY]), self.num_sets)[0] < stop_set:
            held = np.r_[held, EMPTY_KEY]
        return np.sort(held)

    def size(self) -> int:
        return int((self.keys != EMPTY_KEY).sum()) + int(self.special)
