"""Compiled key bookkeeping of the load gate: the set of keys seen so far in a table's
stream, and the hash that picks the drift sample.

`KeySet` is an open-addressing set of int64 keys (linear probing, a power-of-two
capacity of at least 1.5× the table's rows, so its probes stay short): `first_rows`
marks, in one compiled pass over a chunk, the rows whose key no earlier row (of this
chunk or a chunk before) had, and adds their keys. It takes 12 to 24 bytes a key of the
table while the table loads, and is freed after.

`sample_rows` picks the rows whose key hashes below a threshold: the same keys for
every version of a table, so a sample of the new version's keys meets the old
version's rows for as many of them as both hold. Both kernels release the GIL (the read-ahead thread
runs them while the tiers write).
"""

from __future__ import annotations

import numpy as np

from hps.runtime.compiled import array, inlined, kernel, types

#: the slot value of an empty slot; the key of that value is kept in `state[1]`
_EMPTY = np.iinfo(np.int64).min
_KEYS = array(np.int64, readonly=True)
_SLOTS = array(np.int64)
_KEEP = array(np.bool_)
_STATE = array(np.int64)
_ROWS = array(np.int64)


@inlined
def _mix(key: int) -> int:
    """splitmix64's finalizer: every bit of the key moves every bit of the hash."""
    x = np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@kernel([types.int64(_KEYS, _SLOTS, _STATE, _KEEP)])
def _first_rows(keys: np.ndarray, slots: np.ndarray, state: np.ndarray,
                keep: np.ndarray) -> int:  # pragma: no cover - compiled
    mask = np.uint64(slots.size - 1)
    repeats = 0
    for i in range(keys.size):
        key = keys[i]
        if key == _EMPTY:  # the one key the slots cannot hold: a flag of its own
            keep[i] = state[1] == 0
            state[1] = 1
        else:
            at = _mix(key) & mask
            while True:
                held = slots[at]
                if held == _EMPTY:
                    slots[at] = key
                    state[0] += 1
                    keep[i] = True
                    break
                if held == key:
                    keep[i] = False
                    break
                at = (at + np.uint64(1)) & mask
        if not keep[i]:
            repeats += 1
    return repeats


@kernel([types.int64(_KEYS, types.uint64, _ROWS)])
def _sample_rows(keys: np.ndarray, threshold: int, out: np.ndarray) -> int:  # pragma: no cover
    n = 0
    for i in range(keys.size):
        # a second mix: the sample is independent of where the set puts a key
        if _mix(np.int64(_mix(keys[i]) ^ np.uint64(0x5851F42D4C957F2D))) <= threshold:
            out[n] = i
            n += 1
    return n


class KeySet:
    """The distinct keys of a table's stream so far (see the module docstring)."""

    def __init__(self, capacity_keys: int) -> None:
        want = max(16, int(capacity_keys * 1.5) + 1)
        self._slots = np.full(1 << (want - 1).bit_length(), _EMPTY, dtype=np.int64)
        self._state = np.zeros(2, dtype=np.int64)  # (keys in slots, INT64_MIN seen)
        self._keys_left = self._slots.size - 1  # one slot stays empty: probes end

    @property
    def size(self) -> int:
        """Distinct keys seen."""
        return int(self._state[0] + self._state[1])

    def first_rows(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """(bool[n]: rows whose key is seen for the first time, rows repeating a key).

        ValueError when more distinct keys come than the set was sized for (a reader
        that yields more rows than it said it holds)."""
        if self._state[0] + keys.size > self._keys_left:
            raise ValueError("more keys than the table said it holds")
        keep = np.empty(keys.size, dtype=np.bool_)
        repeats = _first_rows(np.ascontiguousarray(keys, dtype=np.int64), self._slots,
                              self._state, keep)
        return keep, int(repeats)


def sample_threshold(num_keys: int, sample_keys: int) -> np.uint64:
    """The hash threshold that picks about `sample_keys` of `num_keys` keys."""
    if num_keys <= sample_keys:
        return np.uint64(2**64 - 1)
    return np.uint64(int(2**64 * (sample_keys / num_keys)))


def sample_rows(keys: np.ndarray, threshold: np.uint64) -> np.ndarray:
    """Positions (int64) of the keys whose hash is at most `threshold`."""
    out = np.empty(keys.size, dtype=np.int64)
    n = _sample_rows(np.ascontiguousarray(keys, dtype=np.int64), threshold, out)
    return out[:n]
