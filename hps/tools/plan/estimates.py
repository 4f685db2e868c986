"""What a table takes in the two tiers whose memory is not ours to allocate: Redis's
`used_memory` and RocksDB's table files on disk, told from their layouts.

Both store the rows as float32 whatever embedding_storage_dtype says (HugeCTR's layout:
stores stay readable by HugeCTR), 8-byte keys.

Redis (hps/tiers/redis/layout.py): a table is one hash per partition (`…}v`: key → row)
and, with evict_least_used / evict_oldest, a second one (`…}t`: key → access count or
time). Redis 7 keeps a hash of more than 128 fields, or with values over 64 bytes, as a
hash table: a field costs its dictEntry (24 bytes), its name and its value as sds strings,
each rounded up to jemalloc's size classes, and its share of a power-of-two bucket array
(8 bytes a bucket). A hash's buckets double when its fields reach their count, and the old
array is moved over one bucket per write to that hash (about two per field written): a
load that ends before the move is done leaves both arrays held. Smaller hashes (tables of
a few thousand keys at most) are listpacks, smaller than this estimate says. Measured
against redis-server 7.0 (INFO used_memory before and after a load; widths 8 to 128, 20k
to 100k keys, the three eviction policies): within 5%; tests/tools/test_plan.py holds the
estimate to a real server.

RocksDB (hps/tiers/rocksdb/sst.py writes the files): a key is one block entry of three
varints, the 16-byte internal key (no prefix shared by random keys) and the row; a restart
offset every RESTART_INTERVAL entries; per data block of about BLOCK_BYTES, a trailer, the
restart count and an index entry. Measured: within 1% of the SST files a load writes, at
widths 8 to 128. RocksDB's memory is its block cache (256 MiB by default), not the table.
"""

from __future__ import annotations

import math

from hps.tiers.redis.layout import KEY_BYTES
from hps.tiers.rocksdb.sst import BLOCK_BYTES, INTERNAL_KEY_BYTES, RESTART_INTERVAL

_ROW_BYTES_PER_VALUE = 4  # float32
# Redis 7.0 (src/dict.h, src/sds.h, redis.conf)
_DICT_ENTRY = 24
_BUCKET = 8
_REHASH_STEPS_PER_FIELD = 2  # buckets moved per field written (a find and an add)
#: a hash's own cost: its name (an sds), its robj, its keyspace entry, its dict struct
_HASH_OVERHEAD = 192
# what the `t` hash holds per key: an access count (ASCII, a few digits) or a time_t
_META_VALUE = {"evict_least_used": 4, "evict_oldest": 8}
# RocksDB block-based table (sst.py): per block, a 5-byte trailer and the restart count;
# an index entry: 3 varints, the internal key, a block handle (two varints) and its
# restart offset
_BLOCK_OVERHEAD = 5 + 4
_INDEX_ENTRY = 3 + INTERNAL_KEY_BYTES + 8 + 4
#: a store's own files beside a table's (MANIFEST, OPTIONS, the table file's properties)
_STORE_FILES = 64 << 10


def jemalloc_size(n: int) -> int:
    """The bytes jemalloc 5 hands out for a request of `n` (its size classes: multiples of
    16 up to 128, then four classes per doubling)."""
    if n <= 8:
        return 8
    if n <= 128:
        return -(-n // 16) * 16
    step = 1 << (int(n - 1).bit_length() - 3)
    return -(-n // step) * step


def _sds_size(length: int) -> int:
    """Allocated bytes of an sds string of `length` bytes (header, bytes, NUL)."""
    header = 3 if length < 256 else 5 if length < 65536 else 9
    return jemalloc_size(header + length + 1)


def _hash_bytes(fields: int, partitions: int, value_bytes: int) -> int:
    """used_memory of `partitions` hashes holding `fields` fields in all, of 8-byte
    names and `value_bytes`-byte values."""
    if fields == 0:
        return 0
    per_hash = math.ceil(fields / partitions)
    field = jemalloc_size(_DICT_ENTRY) + _sds_size(KEY_BYTES) + _sds_size(value_bytes)
    buckets = 1 << max(2, (per_hash - 1).bit_length())
    previous = buckets // 2
    if previous >= 4 and _REHASH_STEPS_PER_FIELD * (per_hash - previous) < previous:
        buckets += previous  # the move to the doubled array is not done yet
    return fields * field + partitions * (_HASH_OVERHEAD + buckets * _BUCKET)


def redis_bytes(num_keys: int, dim: int, num_partitions: int = 16,
                overflow_policy: str = "evict_random") -> int:
    """Redis used_memory of a table of `num_keys` rows of width `dim`, in
    `num_partitions` partitions, with the eviction metadata of `overflow_policy`."""
    partitions = max(1, min(num_partitions, max(num_keys, 1)))
    total = _hash_bytes(num_keys, partitions, _ROW_BYTES_PER_VALUE * dim)
    meta = _META_VALUE.get(overflow_policy)
    if meta is not None:
        total += _hash_bytes(num_keys, partitions, meta)
    return total


def _varint_bytes(value: int) -> int:
    return max(1, math.ceil(int(value).bit_length() / 7))


def rocksdb_bytes(num_keys: int, dim: int) -> int:
    """Disk bytes of the table files RocksDB keeps for a table of `num_keys` rows of
    width `dim` (a bulk load's SST files, no compression, no filter)."""
    value = _ROW_BYTES_PER_VALUE * dim
    entry = 2 + _varint_bytes(value) + INTERNAL_KEY_BYTES + value + 4 / RESTART_INTERVAL
    blocks = math.ceil(num_keys * entry / BLOCK_BYTES)
    return math.ceil(num_keys * entry) + blocks * (_BLOCK_OVERHEAD + _INDEX_ENTRY) + \
        _STORE_FILES
