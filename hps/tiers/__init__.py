"""The database tiers, opened from a config by `open_tiers`.

    contract.py   `Tier`: what a lookup and an online update need of every tier
    bulk_load.py  `BulkLoadTier`: whole tables loaded, ordered, read back, recorded
    open.py       `open_tiers`, `Tiers`: which class serves which config
    partition.py  the key → partition mixer HugeCTR's layouts share
    hash_map/     the in-process volatile tier
    redis/        the Redis / Redis Cluster volatile tier
    rocksdb/      the RocksDB persistent tier
"""

from hps.tiers.open import Tiers, open_tiers

__all__ = ["Tiers", "open_tiers"]
