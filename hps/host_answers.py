"""Whether a model's host tiers answer every key as its GPU cache does, so that a lookup
with host keys (HTTP, gRPC) may skip the cache (`http_lookup_path`; hps/server/http_path.py
decides, docs/workers.md#http-lookups-of-a-gpu-model says how).

Why they answer alike: a GPU cache is a cache over the host tiers, never a store of its
own. It is filled from the model's files, with the row the tiers serve where the files
repeat a key (server/gpu_caches.py `_warm_chunks`), and with the tiers' rows for the keys
it missed; online updates write the tiers first, then the caches (server/updates.py,
gpu_caches.py `apply_update`; another worker's caches are refetched from the tiers:
cache_journal.py). So a row a cache holds is a row the tiers hold, and a key it lacks is
answered by the same host path (volatile → persistent → default) the host lookup takes.
The one answer of a GPU path the host does not give is the default value of a miss left
to the background insert (`hit_rate_threshold`, HugeCTR's semantics): the host path
answers the row the tiers hold, which the GPU path answers too once it is inserted.

Where they would not answer alike, `host_path_differs` says why:
- rows stored compact (`embedding_storage_dtype` float16, bfloat16, int8): the GPU rows
  are rounded, Redis and RocksDB keep float32, and int8 rows a cache took from the host
  are encoded again;
- no host tier holds every row: no tier at all (the cache holds the only copy), a
  volatile tier alone that may drop rows (a bounded `overflow_margin`, an
  `initial_cache_rate` below 1, or Redis, which may come back empty), with no persistent
  tier below it.
"""

from __future__ import annotations

from typing import Any

#: the volatile tiers that hold every row of a table in this host's memory
IN_PROCESS_VOLATILE = ("hash_map", "parallel_hash_map", "multi_process_hash_map")


def host_path_differs(model: Any, volatile: Any, persistent: Any) -> str | None:
    """Why the host tiers of `model` (a ModelConfig) may answer a key otherwise than its
    GPU cache, with these `volatile` and `persistent` (VolatileDBConfig,
    PersistentDBConfig); None where they answer every key alike (see the module)."""
    if model.storage.compact:
        return (f"its rows are stored as {model.embedding_storage_dtype}: the GPU rows are "
                "rounded where the host tiers' may not be")
    if persistent.enabled:
        return None  # the persistent tier holds every row
    if not volatile.enabled:
        return "no host tier holds its rows: the GPU cache holds the only copy"
    if volatile.type not in IN_PROCESS_VOLATILE:
        return ("Redis, with no persistent tier below it, may lose rows (a restart without "
                "persistence) that the GPU cache still holds")
    if volatile.initial_cache_rate < 1.0 or volatile.overflow_margin < 2**63 - 1:
        return ("the volatile tier may not hold every row (initial_cache_rate below 1 or a "
                "bounded overflow_margin) and no persistent tier is below it")
    return None


def refuse_host_path(model: Any, volatile: Any, persistent: Any) -> None:
    """ValueError (a ConfigError in the caller's words) where `model` asks for
    `http_lookup_path` "host" but its host tiers may answer otherwise than its GPU cache."""
    if getattr(model, "http_lookup_path", "auto") != "host" or not model.gpucache:
        return
    why = host_path_differs(model, volatile, persistent)
    if why is not None:
        raise ValueError(f"model {model.model!r}: http_lookup_path 'host' would answer "
                         f"otherwise than its GPU cache: {why}; use 'auto' or 'gpu'")
