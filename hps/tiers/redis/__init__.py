"""Redis and Redis Cluster volatile tier, in HugeCTR's layout, that survives Redis failures.

    layout.py      where a table lives (hash names, partitions) and the bytes of its keys
                   and rows, HugeCTR's format; RESP request packing
    connection.py  standalone / cluster / TLS clients, node pools, topology discovery,
                   round trips, the circuit breaker and reconnect
    tier.py        `RedisTier`: fetch, insert, remove, overflow, background writes
"""

from hps.tiers.redis.layout import meta_hash, value_hash
from hps.tiers.redis.tier import RedisTier

__all__ = ["RedisTier", "meta_hash", "value_hash"]
