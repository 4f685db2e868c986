"""A pure-NumPy hash map: the reference the compiled tier (`hps.tiers.hash_map`) is checked
against on insert / fetch / remove sequences, for tests only.

A simpler layout than the compiled table's (`hps.tiers.hash_map.table`): int32 slots over
dense rows without tags, home slot from the top bits of rrxmrrxmsx_0, linear probing in
whole-batch rounds, tombstones on removal, the last row moved into a freed one. No
overflow policies. Only answers and the keys held are compared, never the slots.
"""

from __future__ import annotations

import numpy as np

from hps.tiers.partition import rrxmrrxmsx_0

EMPTY = -1
TOMBSTONE = -2


class NumpyHashMap:
    """One table of `dim`-wide float32 rows by int64 key, every operation a NumPy batch."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.size = 0
        self.keys = np.zeros(16, np.int64)
        self.vectors = np.zeros((16, dim), np.float32)
        self._set_slots(16)

    def _set_slots(self, capacity: int) -> None:
        self.slots = np.full(capacity, EMPTY, np.int32)
        self.mask = capacity - 1
        self.shift = np.uint64(64 - (capacity.bit_length() - 1))
        self.tombstones = 0

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `keys` (-1 where absent) and the slot each probe ended at."""
        pos = (rrxmrrxmsx_0(keys) >> self.shift).astype(np.intp)
        rows = np.full(keys.size, -1, np.intp)
        pending = np.arange(keys.size)
        while pending.size:  # one probe step for every unresolved key per round
            cand = self.slots[pos[pending]].astype(np.intp)
            match = (cand >= 0) & (self.keys[np.maximum(cand, 0)] == keys[pending])
            rows[pending[match]] = cand[match]
            still = ~match & (cand != EMPTY)
            pending = pending[still]
            pos[pending] = (pos[pending] + 1) & self.mask
        return rows, pos

    def _claim(self, keys: np.ndarray, rows: np.ndarray) -> None:
        pos = (rrxmrrxmsx_0(keys) >> self.shift).astype(np.intp)
        ids = rows.astype(np.int32)
        pending = np.arange(ids.size)
        while pending.size:
            p = pos[pending]
            free = self.slots[p] < 0
            fi, fp = pending[free], p[free]
            was_tombstone = self.slots[fp] == TOMBSTONE
            self.slots[fp] = ids[fi]  # colliding writers: one lands, the rest probe on
            won = self.slots[fp] == ids[fi]
            self.tombstones -= int(np.count_nonzero(was_tombstone & won))
            pending = np.concatenate([pending[~free], fi[~won]])
            pos[pending] = (pos[pending] + 1) & self.mask

    def _rebuild(self, extra: int) -> None:
        need = max(16, 1 << int(np.ceil((self.size + extra) / 0.375) - 1).bit_length())
        self._set_slots(need)
        self._claim(self.keys[: self.size], np.arange(self.size))

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = np.ascontiguousarray(keys, np.int64)
        rows, _ = self._find(keys)
        out = self.vectors[np.maximum(rows, 0)].copy()
        out[rows < 0] = 0.0
        return out, rows >= 0

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        keys = np.ascontiguousarray(keys, np.int64)
        vectors = np.asarray(vectors, np.float32).reshape(-1, self.dim)
        order = np.argsort(keys, kind="stable")
        last = np.ones(keys.size, bool)
        last[:-1] = keys[order][1:] != keys[order][:-1]
        keys, vectors = keys[order[last]], vectors[order[last]]
        rows, _ = self._find(keys)
        old = rows >= 0
        self.vectors[rows[old]] = vectors[old]
        new_keys, new_vectors = keys[~old], vectors[~old]
        start, stop = self.size, self.size + new_keys.size
        if stop > self.keys.size:
            grown = 2 * stop
            self.keys = np.concatenate([self.keys[:start], np.zeros(grown - start, np.int64)])
            self.vectors = np.concatenate(
                [self.vectors[:start], np.zeros((grown - start, self.dim), np.float32)])
        self.keys[start:stop] = new_keys
        self.vectors[start:stop] = new_vectors
        self.size = stop
        if stop + self.tombstones > 0.5 * self.slots.size:
            self._rebuild(0)
        else:
            self._claim(new_keys, np.arange(start, stop))

    def remove(self, keys: np.ndarray) -> int:
        keys = np.unique(np.ascontiguousarray(keys, np.int64))
        rows, slot_pos = self._find(keys)
        hit = rows >= 0
        rows, slot_pos = rows[hit], slot_pos[hit]
        self.slots[slot_pos] = TOMBSTONE
        self.tombstones += rows.size
        new_size = self.size - rows.size
        holes = np.sort(rows[rows < new_size])
        tail_free = np.ones(self.size - new_size, bool)
        tail_free[rows[rows >= new_size] - new_size] = False
        movers = np.arange(new_size, self.size)[tail_free]
        if movers.size:
            mover_keys = self.keys[movers]
            _, mover_slots = self._find(mover_keys)
            self.keys[holes] = mover_keys
            self.vectors[holes] = self.vectors[movers]
            self.slots[mover_slots] = holes.astype(np.int32)
        self.size = new_size
        return int(rows.size)
