"""The compiled loops of the in-process hash map (`hps.tiers.hash_map`): probe, fetch,
insert, remove, rebuild. numba, GIL released; compiled (or loaded from numba's cache) when
this module is imported, for the exact argument types below, never inside a lookup.

A table is flat arrays (see `hps.tiers.hash_map.table`): `slots` int32[capacity] (a tagged
row, or EMPTY / TOMBSTONE), `row_keys` int64[row capacity], `vectors` [row capacity, width]
in the table's storage type (float32; uint16 bits of float16 or bfloat16; uint8 int8 rows:
see hps/rows/storage_types.py; insert and remove move rows as they are, fetch decodes),
`stats` uint32[row capacity] (or empty when no overflow policy needs them),
`partition_sizes` int64[num_partitions], and `state` int64[2] = (rows in use, tombstones).
Rows [0, size) are live and dense.

A key's home slot is `rrxmrrxmsx_0(key) % capacity` (the capacity need not be a power of
two, so a table can be sized to its load); collisions probe linearly, wrapping. The
callers keep at least one slot EMPTY, which ends every probe.

A used slot holds `row | tag << row_bits`, still a non-negative int32: `row_bits` (the
callers' `row_bits(capacity)`) is enough bits for any row the slots can index, and the
tag is that many fewer high bits of the key's hash (`_tag`). A probe compares tags first
and reads a row's key only where the tag matches: a key's row is known from the slot
array alone, bar a false match of one in 2**tag_bits (9 bits at 2.6M slots, 6 at 26M),
which the key comparison after it catches. That is what lets the fetch prefetch the
right row of a key whose home slot another key took (about a fifth of the keys at a load
of 0.38) instead of stalling on the row it meets first.
"""

from __future__ import annotations

import numpy as np

from hps.rows.decode_loops import PAIRS, copy_row, zero_row
from hps.runtime.compiled import array, holding_gil, inlined, kernel, prefetch, types

EMPTY = -1
TOMBSTONE = -2

_M1 = np.uint64(0xA24BAED4963EE407)
_M2 = np.uint64(0x9FB21C651E98DF25)
_U64 = np.uint64

# argument types: tables are writable; keys and vectors handed in may be read-only views
_SLOTS = array(np.int32)
_ROW_KEYS = array(np.int64)
#: the element types rows are stored in (float32, float16/bfloat16 bits, int8 rows)
_STORED = (np.float32, np.uint16, np.uint8)
_FLOATS = array(np.float32, 2)
_STATS = array(np.uint32)
_COUNTS = array(np.int64)
_KEYS_IN = array(np.int64, readonly=True)
_ROWS = array(np.int64)
_FOUND = array(np.bool_)
_I64 = types.int64
#: keys between a prefetch and its use (insert's slots)
_AHEAD = 8
#: new keys between the prefetch of their slot and its write (a split insert's rows)
_PLACE_AHEAD = 16
#: fetch's passes: keys per block, and how far ahead each pass prefetches
_BLOCK = 1024
_SLOT_AHEAD = 32
_ROW_AHEAD = 8
#: slots and rows are int32: a row and its tag share 31 bits
_SLOT_BITS = 31
#: a tag is the hash's bits from this one up (the home slot is the hash modulo the capacity)
_TAG_SHIFT = _U64(33)
_LINE_BYTES = 64
A = np.ndarray  # annotations only: numba compiles for the signatures given


@inlined
def _ror(x: np.uint64, r: int) -> np.uint64:
    return (x >> _U64(r)) | (x << _U64(64 - r))


@inlined
def mix(key: int) -> np.uint64:
    """rrxmrrxmsx_0 of `key` read as uint64 (as `hps.tiers.partition.rrxmrrxmsx_0`)."""
    x = _U64(key)
    x ^= _ror(x, 25) ^ _ror(x, 50)
    x *= _M1
    x ^= _ror(x, 24) ^ _ror(x, 49)
    x *= _M2
    return x ^ (x >> _U64(28))


@inlined
def _partition(h: np.uint64, num_partitions: int) -> int:
    # as hps.tiers.partition.partition_of_mixed: a mask for powers of two, else the remainder
    if num_partitions & (num_partitions - 1) == 0:
        return int(np.int64(h & _U64(num_partitions - 1)))
    return int(np.int64(h % _U64(num_partitions)))


@inlined
def _home(key: int, capacity: int) -> int:
    return int(np.int64(mix(key) % _U64(capacity)))


def row_bits(capacity: int) -> int:
    """Bits of a slot that hold its row, for a slot array of `capacity` slots: enough for
    every row (the callers keep rows below the capacity), at most 31."""
    return min(_SLOT_BITS, max(1, int(capacity - 1).bit_length()))


@inlined
def _tag(h: np.uint64, bits: int) -> int:
    """The tag of a key whose hash is `h`, for slots of `bits` row bits (0 at 31)."""
    return int(np.int64(h >> _TAG_SHIFT)) & ((1 << (_SLOT_BITS - bits)) - 1)


@inlined
def _tagged(row: int, h: np.uint64, bits: int) -> np.int32:
    """The slot value of `row`, whose key's hash is `h`."""
    return np.int32(row | (_tag(h, bits) << bits))


@inlined
def _tag_probe(slots: A, h: np.uint64, bits: int) -> int:
    """The row of the first slot from the home of hash `h` on whose tag is the key's,
    -1 when the probe ends first (the key is absent). Reads slots only: the row may
    belong to another key of the same tag, which the caller's key comparison finds."""
    capacity = slots.size
    tag = _tag(h, bits)
    mask = (1 << bits) - 1
    p = int(np.int64(h % _U64(capacity)))
    while True:
        s = slots[p]
        if s == EMPTY:
            return -1
        if s >= 0 and (s >> bits) == tag:
            return int(s & mask)
        p += 1
        if p == capacity:
            p = 0


@inlined
def _find(slots: A, row_keys: A, key: int, h: np.uint64, bits: int) -> tuple[int, int]:
    """(row of `key` or -1, the slot holding it or the EMPTY slot that ended the probe)."""
    capacity = slots.size
    tag = _tag(h, bits)
    mask = (1 << bits) - 1
    p = int(np.int64(h % _U64(capacity)))
    while True:
        s = slots[p]
        if s == EMPTY:
            return -1, p
        if s >= 0 and (s >> bits) == tag and row_keys[s & mask] == key:
            return int(s & mask), p
        p += 1
        if p == capacity:
            p = 0


_FETCH = [types.int64(_SLOTS, _ROW_KEYS, array(held, 2), _FLOATS, _I64, _KEYS_IN,
                     array(wanted, 2), _FOUND, _ROWS) for held, wanted in PAIRS]


@kernel(_FETCH)
def fetch(slots: A, row_keys: A, vectors: A, floats: A, bits: int, keys: A, out: A,
          found: A, rows: A) -> int:
    """out[i] = the row of keys[i] (zeros when absent), found[i], and rows[i] (the row or
    -1) when `rows` is not empty. Returns the number of keys found. `bits`: the slots'
    row bits (`row_bits(slots.size)`).

    Stored rows are decoded into `out` as the array types say (hps.rows.decode_loops:
    `floats` is an int8 table's `vectors` viewed as float32, else ignored).

    Two passes over each block of BLOCK keys, each with its loads prefetched ahead: the
    first probes the slot array by tag (slot lines SLOT_AHEAD keys ahead) and notes the
    row each key's tag leads to; the second compares that row's key with the key and
    copies the row (key and vector lines ROW_AHEAD keys ahead). No load waits on another
    random load that was not prefetched, even for a key whose home slot another key took.
    Absent keys mostly end in the first pass, without reading a row.
    """
    width = vectors.shape[1]
    line = _LINE_BYTES // vectors.itemsize
    flat = vectors.reshape(-1)
    capacity = slots.size
    n = keys.size
    hashes = np.empty(_BLOCK, np.uint64)
    guesses = np.empty(_BLOCK, np.int64)
    track = rows.size != 0
    hits = 0
    for start in range(0, n, _BLOCK):
        m = min(_BLOCK, n - start)
        for j in range(m):
            hashes[j] = mix(keys[start + j])
        for j in range(-_SLOT_AHEAD, m):
            ahead = j + _SLOT_AHEAD
            if ahead < m:
                prefetch(slots, int(np.int64(hashes[ahead] % _U64(capacity))))
            if j >= 0:
                guesses[j] = _tag_probe(slots, hashes[j], bits)
        for j in range(-_ROW_AHEAD, m):
            ahead = j + _ROW_AHEAD
            if ahead < m:
                g = guesses[ahead]
                if g >= 0:
                    prefetch(row_keys, g)
                    for c in range(0, width, line):
                        prefetch(flat, g * width + c)
                    if width % line:  # rows not a whole number of lines may end in one more
                        prefetch(flat, g * width + width - 1)
            if j < 0:
                continue
            i = start + j
            key = keys[i]
            r = guesses[j]
            if r >= 0 and row_keys[r] != key:  # another key's tag: the whole probe
                r, _ = _find(slots, row_keys, key, hashes[j], bits)
            if r >= 0:
                copy_row(vectors, r, floats, out, i)
                found[i] = True
                hits += 1
            else:
                zero_row(out, i)
                found[i] = False
            if track:
                rows[i] = r
    return hits


@holding_gil(_FETCH)
def fetch_held(slots: A, row_keys: A, vectors: A, floats: A, bits: int, keys: A, out: A,
               found: A, rows: A) -> int:
    """`fetch` keeping the GIL: for small batches (hps/runtime/compiled.py HOLD_GIL_BYTES)."""
    return fetch(slots, row_keys, vectors, floats, bits, keys, out, found, rows)


@inlined
def _probe_insert(slots: A, row_keys: A, key: int, h: np.uint64, bits: int, p: int,
                  stop: int, keys: A, marks: A) -> tuple[int, int, int, int]:
    """The probe of an insert of `key` (hash `h`, slots of `bits` row bits) from slot
    `p`: (its row or -1, its mark or -1, the slot the probe ended at, the first tombstone
    it met or -1). It ends at the key, at an EMPTY slot, or at slot `stop` (-1: none, the
    probe wraps around). A slot below TOMBSTONE is the mark -3 - q of a new key of a split
    insert, `keys[marks[q]]`."""
    capacity = slots.size
    tag = _tag(h, bits)
    mask = (1 << bits) - 1
    free = -1
    while True:
        s = slots[p]
        if s == EMPTY:
            return -1, -1, p, free
        if s == TOMBSTONE:
            if free < 0:
                free = p
        elif s >= 0:
            if (s >> bits) == tag and row_keys[s & mask] == key:
                return int(s & mask), -1, p, free
        elif keys[marks[-3 - s]] == key:
            return -1, -3 - int(s), p, free
        p += 1
        if p == stop:
            return -1, -1, p, free
        if p == capacity:
            p = 0


_INSERT = [types.int64(_SLOTS, _ROW_KEYS, array(held, 2), _STATS, _COUNTS, _COUNTS, _I64,
                      _KEYS_IN, array(held, 2, readonly=True), _I64, _I64, _I64, _I64)
           for held in _STORED]


@kernel(_INSERT)
def insert(slots: A, row_keys: A, vectors: A, stats: A, partition_sizes: A, state: A,
           bits: int, keys: A, new_vectors: A, start: int, max_used: int, new_stat: int,
           overwrite_stat: int) -> int:
    """Insert or overwrite keys[start:] in order (a repeated key: the last one wins);
    `new_vectors` are rows in the table's stored form (hps.rows.storage_types.encode).

    A new key takes the first tombstone or the EMPTY slot its probe meets and row `size`;
    its stat is `new_stat`; an overwritten row's stat becomes `overwrite_stat` unless that
    is negative. Stops before a key that would need a row beyond the row arrays or take
    rows + tombstones past `max_used` (the caller grows the table and calls again).
    Returns the index of the first key not inserted (keys.size when all were).
    """
    size = state[0]
    tombstones = state[1]
    num_partitions = partition_sizes.size
    has_stats = stats.size != 0
    width = vectors.shape[1]
    capacity = slots.size
    no_marks = np.empty(0, np.int64)  # a split insert's marks are gone before this runs
    i = start
    while i < keys.size:
        if i + _AHEAD < keys.size:
            prefetch(slots, _home(keys[i + _AHEAD], capacity))
        key = keys[i]
        h = mix(key)
        row, _, p, free = _probe_insert(slots, row_keys, key, h, bits,
                                        int(np.int64(h % _U64(capacity))), -1, keys, no_marks)
        if row >= 0:
            if has_stats and overwrite_stat >= 0:
                stats[row] = overwrite_stat
        else:
            if size >= row_keys.size or (free < 0 and size + tombstones >= max_used):
                break
            if free >= 0:
                p = free
                tombstones -= 1
            row = size
            slots[p] = _tagged(row, h, bits)
            row_keys[row] = key
            if has_stats:
                stats[row] = new_stat
            partition_sizes[_partition(h, num_partitions)] += 1
            size += 1
        for j in range(width):
            vectors[row, j] = new_vectors[i, j]
        i += 1
    state[0] = size
    state[1] = tombstones
    return i


@holding_gil(_INSERT)
def insert_held(slots: A, row_keys: A, vectors: A, stats: A, partition_sizes: A, state: A,
                bits: int, keys: A, new_vectors: A, start: int, max_used: int, new_stat: int,
                overwrite_stat: int) -> int:
    """`insert` keeping the GIL: for small batches (hps/runtime/compiled.py HOLD_GIL_BYTES).
    An online update's small insert then takes and gives back the table's lock without
    letting a lookup's fetch in to wait on it."""
    return insert(slots, row_keys, vectors, stats, partition_sizes, state, bits, keys,
                  new_vectors, start, max_used, new_stat, overwrite_stat)


@kernel([types.int64(_SLOTS, _ROW_KEYS, array(held, 2), _STATS, _COUNTS, _COUNTS, _I64,
                     _KEYS_IN) for held in _STORED])
def remove(slots: A, row_keys: A, vectors: A, stats: A, partition_sizes: A, state: A,
           bits: int, keys: A) -> int:
    """Delete keys (repeats and absent keys are skipped); returns how many were deleted.

    The key's slot becomes a tombstone and the last live row moves into its row, so rows
    stay dense.
    """
    size = state[0]
    tombstones = state[1]
    num_partitions = partition_sizes.size
    has_stats = stats.size != 0
    width = vectors.shape[1]
    removed = 0
    for i in range(keys.size):
        key = keys[i]
        h = mix(key)
        row, p = _find(slots, row_keys, key, h, bits)
        if row < 0:
            continue
        slots[p] = TOMBSTONE
        tombstones += 1
        partition_sizes[_partition(h, num_partitions)] -= 1
        last = size - 1
        if row != last:
            moved = row_keys[last]
            moved_hash = mix(moved)
            _, q = _find(slots, row_keys, moved, moved_hash, bits)
            slots[q] = _tagged(row, moved_hash, bits)
            row_keys[row] = moved
            for j in range(width):
                vectors[row, j] = vectors[last, j]
            if has_stats:
                stats[row] = stats[last]
        size -= 1
        removed += 1
    state[0] = size
    state[1] = tombstones
    return removed


@kernel([types.int64(_SLOTS, _ROW_KEYS, _I64, _KEYS_IN, _FOUND)])
def mark_absent(slots: A, row_keys: A, bits: int, keys: A, absent: A) -> int:
    """Mark in `absent` each of `keys` the table does not hold; returns how many (a key
    repeated in `keys` counts each time: an upper bound of the rows an insert of them
    adds)."""
    count = 0
    for i in range(keys.size):
        key = keys[i]
        row, _ = _find(slots, row_keys, key, mix(key), bits)
        absent[i] = row < 0
        if row < 0:
            count += 1
    return count


@kernel([types.void(_SLOTS, _ROW_KEYS, _I64, _I64)])
def place_rows(slots: A, row_keys: A, size: int, bits: int) -> None:
    """Give rows [0, size) a slot each in an all-EMPTY `slots` (their keys are distinct),
    tagged for `bits` row bits."""
    capacity = slots.size
    for r in range(size):
        h = mix(row_keys[r])
        p = int(np.int64(h % _U64(capacity)))
        while slots[p] != EMPTY:
            p += 1
            if p == capacity:
                p = 0
        slots[p] = _tagged(r, h, bits)


@kernel([types.void(_ROW_KEYS, _I64, _I64, _COUNTS)])
def partitions(row_keys: A, size: int, num_partitions: int, out: A) -> None:
    """out[r] = the partition of row r's key, for rows [0, size)."""
    for r in range(size):
        out[r] = _partition(mix(row_keys[r]), num_partitions)


@kernel([types.void(_STATS, _ROWS)])
def count_hits(stats: A, rows: A) -> None:
    """stats[r] += 1 for each row r >= 0 in `rows` (a repeated row counts each time)."""
    for r in rows:
        if r >= 0:
            stats[r] += np.uint32(1)


@kernel([types.void(_STATS, _ROWS, types.uint32)])
def stamp_rows(stats: A, rows: A, stamp: np.uint32) -> None:
    """stats[r] = stamp for each row r >= 0 in `rows`."""
    for r in rows:
        if r >= 0:
            stats[r] = stamp


# -- a large insert split over the cores ---------------------------------------------------
#
# The slot array is cut into one region per thread; each key goes to the thread of the
# region of its home slot, so no two threads write one slot. A thread probes only inside
# its region: a probe that reaches the region's end is deferred (a few keys at the seams,
# inserted afterwards by `insert` on one thread). A new key's slot first holds a
# provisional mark (-3 - its index among the thread's new keys: negative, unlike a used
# slot); once every thread knows how many new keys it has, each gives its keys rows of a
# block of its own and copies their rows in (`place_new`), so rows stay dense.


@kernel([types.void(_KEYS_IN, _I64, _I64, _I64, _I64, _ROWS, _COUNTS)])
def homes_by_region(keys: A, lo: int, hi: int, capacity: int, region: int, homes: A,
                    counts: A) -> None:
    """homes[i] = the home slot of keys[i] for i in [lo, hi); counts[r] += the keys whose
    home is in region r (slots [r·region, (r + 1)·region))."""
    for i in range(lo, hi):
        h = _home(keys[i], capacity)
        homes[i] = h
        counts[h // region] += 1


@kernel([types.void(_ROWS, _I64, _I64, _I64, _COUNTS, _ROWS)])
def group_by_region(homes: A, lo: int, hi: int, region: int, cursors: A, members: A) -> None:
    """members[cursors[r]++] = i for i in [lo, hi), r the region of homes[i]: each
    region's keys, in batch order when the slices are taken in order."""
    for i in range(lo, hi):
        r = homes[i] // region
        members[cursors[r]] = i
        cursors[r] += 1


@kernel([types.void(_SLOTS, _ROW_KEYS, array(held, 2), _I64, _KEYS_IN,
                    array(held, 2, readonly=True), _ROWS, _ROWS, _I64, _ROWS, _ROWS, _ROWS,
                    _COUNTS)
         for held in _STORED])
def insert_region(slots: A, row_keys: A, vectors: A, bits: int, keys: A, new_vectors: A,
                  homes: A, members: A, hi: int, new_slots: A, new_index: A, deferred: A,
                  counters: A) -> None:
    """Insert keys[members[j]] (in order; their homes in a region of slots ending at
    `hi`) probing inside the region only. An existing key's row is overwritten at once; a
    new key's slot gets a provisional mark q (new_slots[q] = the slot, new_index[q] = the
    key's index: a repeat later in the batch moves it there, the last wins); a probe
    reaching `hi` puts the index in `deferred`. counters = (new keys, deferred keys,
    tombstones reused)."""
    width = vectors.shape[1]
    capacity = slots.size
    fresh = 0
    waiting = 0
    reused = 0
    for j in range(members.size):
        if j + _AHEAD < members.size:
            prefetch(slots, homes[members[j + _AHEAD]])
        i = members[j]
        key = keys[i]
        h = mix(key)
        row, mark, p, free = _probe_insert(slots, row_keys, key, h, bits,
                                           int(np.int64(h % _U64(capacity))), hi, keys,
                                           new_index)
        if row >= 0:
            for c in range(width):
                vectors[row, c] = new_vectors[i, c]
        elif mark >= 0:
            new_index[mark] = i
        elif p == hi:
            deferred[waiting] = i
            waiting += 1
        else:
            if free >= 0:
                p = free
                reused += 1
            slots[p] = np.int32(-3 - fresh)
            new_slots[fresh] = p
            new_index[fresh] = i
            fresh += 1
    counters[0] = fresh
    counters[1] = waiting
    counters[2] = reused


@kernel([types.void(_SLOTS, _ROW_KEYS, array(held, 2), _I64, _KEYS_IN,
                    array(held, 2, readonly=True), _ROWS, _ROWS, _I64, _I64, _COUNTS)
         for held in _STORED])
def place_new(slots: A, row_keys: A, vectors: A, bits: int, keys: A, new_vectors: A,
              new_slots: A, new_index: A, count: int, first_row: int, partition_sizes: A
              ) -> None:
    """Give a thread's `count` new keys rows first_row, first_row + 1, …: the tagged
    slot, the key and its row; partition_sizes (the thread's own) counts them."""
    width = vectors.shape[1]
    num_partitions = partition_sizes.size
    for q in range(count):
        if q + _PLACE_AHEAD < count:  # the slot was read by the probe, long since evicted
            prefetch(slots, new_slots[q + _PLACE_AHEAD])
        row = first_row + q
        i = new_index[q]
        key = keys[i]
        h = mix(key)
        slots[new_slots[q]] = _tagged(row, h, bits)
        row_keys[row] = key
        for c in range(width):
            vectors[row, c] = new_vectors[i, c]
        partition_sizes[_partition(h, num_partitions)] += 1
