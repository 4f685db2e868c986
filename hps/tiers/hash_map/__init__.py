"""The in-process volatile tier (`volatile_db.type` "hash_map"): `HashMapTier`; and the
same tables in shared memory (`multi_process_hash_map`): `SharedHashMapTier`.

    tier.py      `HashMapTier`: the tier contracts over one table per name; fetches and
                 large inserts split over the cores
    table.py     one table's flat arrays (slots, keys, rows, stats), their sizing and
                 memory, their readers-writer lock; rows in and out of a storage type
    overflow.py  the overflow margin and the policy that prunes a partition past it
    bulk.py      many rows at once: an insert split by slot region, a whole table read
                 back in place (`sorted_rows`) or copied out (`export`)
    loops.py     the compiled loops over keys (numba, GIL released): probe, fetch,
                 insert, remove, rebuild
    shared.py    `SharedHashMapTier`: the tier over tables every process of a run maps
    shared_table.py  one table's arrays in a shared-memory file; its sequence counter
"""

from hps.tiers.hash_map.tier import HashMapTier

__all__ = ["HashMapTier"]
