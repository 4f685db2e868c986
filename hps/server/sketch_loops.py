"""The compiled loops of the frequent-keys sketch (`hps.server.key_sketch`): numba, GIL
released, compiled (or loaded from numba's cache) at their first call.

A sketch is one int64 array `state` of `2 * slots + META` entries, so a call unboxes one
array besides the keys: `state[:slots]` the keys, `state[slots:2 * slots]` their counts
(0: an empty slot), and the META entries after them (`ACTIVE` keys held, `OFFSET` the
error bound, `TOTAL` the weight fed, `TURN` the call counter that rotates a strided
subset's start). `slots` is a power of two; a key's home slot is the high bits of its
Fibonacci hash, and collisions probe linearly.

The algorithm is the frequent-items sketch of Apache DataSketches (a Misra-Gries summary
with a reverse purge): a key is counted in its slot; a new key when `3/4 * slots` are held
first purges the table, taking the median count off every key and dropping those left at
zero or below; the sum of the medians taken is `OFFSET`. A held key's true weight lies in
[count, count + OFFSET]; a key not held has at most OFFSET. A purge is one pass over the
table (amortized O(1) per new key: it frees about half of it).
"""

from __future__ import annotations

import numpy as np

from hps.runtime.compiled import array, inlined, kernel, types

#: the entries after the slots' keys and counts
ACTIVE, OFFSET, TOTAL, TURN = 0, 1, 2, 3
META = 4

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STATE = array(np.int64)
_KEYS_IN = array(np.int64, readonly=True)
_I64 = types.int64

A = np.ndarray


def new_state(slots: int) -> np.ndarray:
    """An empty sketch of `slots` slots (a power of two, at least 16)."""
    if slots < 16 or slots & (slots - 1):
        raise ValueError(f"a sketch's slots must be a power of two >= 16, got {slots}")
    return np.zeros(2 * slots + META, np.int64)


def slots_of(state: np.ndarray) -> int:
    """The number of slots of `state`."""
    return (state.size - META) // 2


@inlined
def _home(key: int, shift: int) -> int:
    return np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(shift))


@inlined
def _shift(slots: int) -> int:
    bits = 0
    while (1 << bits) < slots:
        bits += 1
    return 64 - bits


@inlined
def _place(state: A, slots: int, shift: int, key: int, weight: int) -> bool:
    """Add `weight` to `key`'s count; False when it is new and the table is full."""
    mask = slots - 1
    i = _home(key, shift)
    while True:
        count = state[slots + i]
        if count == 0:
            break
        if state[i] == key:
            state[slots + i] = count + weight
            return True
        i = (i + 1) & mask
    meta = 2 * slots
    if state[meta + ACTIVE] >= (slots * 3) // 4:
        return False
    state[i] = key
    state[slots + i] = weight
    state[meta + ACTIVE] += 1
    return True


@inlined
def _median(values: A) -> int:
    """`int(np.median(values))` of positive int64 counts, by quickselect on a copy.

    numba's np.median took about 1.9 s of a first run's compile on a 2-core machine (the
    most of `feed`'s); this compiles in a fraction of it. For an even size the two middle
    values' mean, rounded down, as `int` of np.median's float is for positive counts.
    """
    work = values.copy()
    n = work.size
    k = n // 2
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi) // 2
        a, b, c = work[lo], work[mid], work[hi]
        pivot = max(min(a, b), min(max(a, b), c))  # median of three: no sorted-input trap
        i, j = lo, hi
        while i <= j:
            while work[i] < pivot:
                i += 1
            while work[j] > pivot:
                j -= 1
            if i <= j:
                work[i], work[j] = work[j], work[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:  # between the two sides: equal to the pivot
            break
    upper = work[k]
    if n % 2:
        return int(upper)
    lower = work[0]  # the largest of the k below position k
    for i in range(1, k):
        lower = max(lower, work[i])
    return int((lower + upper) // 2)


@inlined
def _purge(state: A, slots: int, shift: int) -> None:
    """Take the median count off every key, drop those at zero or below, rehash the rest."""
    meta = 2 * slots
    held = state[meta + ACTIVE]
    counts = np.empty(held, np.int64)
    keys = np.empty(held, np.int64)
    j = 0
    for i in range(slots):
        if state[slots + i] > 0:
            counts[j] = state[slots + i]
            keys[j] = state[i]
            j += 1
    median = _median(counts)
    if median < 1:
        median = 1
    state[:2 * slots] = 0
    state[meta + ACTIVE] = 0
    state[meta + OFFSET] += median
    for j in range(held):
        left = counts[j] - median
        if left > 0:
            _place(state, slots, shift, keys[j], left)


@kernel([types.void(_STATE, _KEYS_IN, _I64, _I64)])
def feed(state: A, keys: A, most: int, weight: int) -> None:
    """Count at most `most` of `keys`, each with `weight` times the stride it was taken at:
    all of them when they are few, else every stride-th from a start that rotates from
    call to call (so a batch's fixed positions are not always the ones skipped)."""
    slots = (state.size - META) // 2
    shift = _shift(slots)
    meta = 2 * slots
    n = keys.size
    stride = 1
    if n > most:
        stride = (n + most - 1) // most
    start = state[meta + TURN] % stride
    state[meta + TURN] += 1
    w = weight * stride
    for i in range(start, n, stride):
        key = keys[i]
        if not _place(state, slots, shift, key, w):
            _purge(state, slots, shift)
            _place(state, slots, shift, key, w)
        state[meta + TOTAL] += w
