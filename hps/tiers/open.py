"""The database tiers of one server, opened from its config: `open_tiers(config)`.

This is the one place that knows which class serves which `volatile_db.type` and
`persistent_db.type`; everything above it (the loader, the server, metrics) sees only the
tier contracts through a `Tiers` object: `Tier` (hps/tiers/contract.py) for lookups and
updates, `BulkLoadTier` (hps/tiers/bulk_load.py), which every tier opened here keeps, for
model loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hps.config import PersistentDBConfig, PSConfig, VolatileDBConfig
from hps.errors import TierUnavailableError
from hps.modelfiles.formats import DEFAULT_CHUNK_BYTES
from hps.tiers.bulk_load import BulkLoadTier


@dataclass(frozen=True)
class Tiers:
    """The volatile tier over the persistent tier; either may be None (disabled).

    Iterating yields the tiers present, volatile first: the order a lookup falls
    through them.
    """

    volatile: BulkLoadTier | None = None
    persistent: BulkLoadTier | None = None

    def __iter__(self) -> Iterator[BulkLoadTier]:
        return iter([t for t in (self.volatile, self.persistent) if t is not None])

    def sizes(self, table: str) -> dict[str, int | None]:
        """Keys `table` holds in each tier, by tier name; None where the tier cannot
        answer now (Redis down)."""
        out: dict[str, int | None] = {}
        for tier in self:
            try:
                out[tier.name] = tier.size(table)
            except TierUnavailableError:
                out[tier.name] = None
        return out

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each tier's `Tier.stats()` (health and counters), by tier name."""
        return {tier.name: tier.stats() for tier in self}

    def close(self) -> None:
        """Close every tier (background writes finish first, see each tier's close)."""
        for tier in self:
            tier.close()


def open_tiers(config: PSConfig, *, load_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Tiers:
    """Open the tiers `config.volatile_db` and `config.persistent_db` ask for.

    `load_chunk_bytes` is the chunk size model loads read with; the persistent tier sorts
    a few such chunks at a time when it bulk-loads. Raises TierSetupError (or
    MissingExtraError for a tier whose extra is not installed) when a tier cannot be
    opened; a tier opened before the failing one is closed again.
    """
    volatile = _open_volatile(config.volatile_db)
    try:
        persistent = _open_persistent(config.persistent_db, load_chunk_bytes)
    except BaseException:
        if volatile is not None:
            volatile.close()
        raise
    return Tiers(volatile, persistent)


def _open_volatile(db: VolatileDBConfig) -> BulkLoadTier | None:
    if not db.enabled:
        return None
    if db.is_redis:
        from hps.tiers.redis import RedisTier

        return RedisTier(db)
    if db.type == "multi_process_hash_map":
        from hps.tiers.hash_map.shared import SharedHashMapTier

        return SharedHashMapTier(db)
    from hps.tiers.hash_map import HashMapTier

    return HashMapTier(db)


def _open_persistent(db: PersistentDBConfig, load_chunk_bytes: int) -> BulkLoadTier | None:
    if not db.enabled:
        return None
    from hps.tiers.rocksdb import RocksDBTier

    # a bulk-load run of four chunks keeps a load's memory at a few chunks
    return RocksDBTier(db, load_run_bytes=4 * load_chunk_bytes)
