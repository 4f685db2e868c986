"""The RocksDB persistent tier, in HugeCTR's layout (`persistent_db.type` "rocks_db").

    tier.py   `RocksDBTier`: tables as column families; fetch, insert, remove, bulk
              loads by table-file ingestion, load records
    store.py  opening a store: its options, read-write or read-only, stale load folders
    bulk.py   rows → sorted table files: in order, or spilled by key range and sorted
    sst.py    one table file (SST) encoded from sorted arrays, compiled
"""

from hps.tiers.rocksdb.tier import RocksDBTier

__all__ = ["RocksDBTier"]
