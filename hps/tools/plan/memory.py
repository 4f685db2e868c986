"""The bytes each tier needs for one table, in every storage type (`hps plan`, `hps inspect`).

`table_memory(shape)` → one `TierBytes` per tier, each with its bytes by
embedding_storage_dtype (float32, float16, bfloat16, int8). The numbers come from the
tiers' own sizing functions, the ones they allocate by, never re-derived here:

    GPU, dynamic cache         hps/gpu/open.py cache_memory_bytes (its extra slots included;
                               at gpucacheper 1 the open-addressing table it becomes)
    GPU, static table          StaticEmbeddingTable.memory_required
    GPU, uvm table             UvmEmbeddingTable.device_bytes_required (index + hot rows:
                               gpu_memory_budget_mb, else gpucacheper × keys) and
                               host_bytes_required (the pinned rows)
    in-process hash map        HashMapTier.memory_required (the keys the volatile tier holds)
    Redis, RocksDB             estimates.py (their own allocators; float32 rows whatever the
                               storage type)

plus one lookup thread's query buffers on a GPU table (per table and device, for the
table's largest lookup): what hps/gpu/workspace.py (miss positions on the device, missed
keys in mapped pinned memory) and hps/gpu/staging.py (keys, set codes, inverse and float32
rows of the misses, pinned and on the device) allocate, from the same rules (a workspace
holds at least 1024 keys; a staging buffer a power of two of them, at least 256, each
array 256-byte aligned, 64 KiB at least). GPU figures are per device: a table deployed on
several devices takes them on each.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hps.rows.storage_types import STORAGE_NAMES
from hps.tools.plan.estimates import redis_bytes, rocksdb_bytes
from hps.tools.plan.tables import TableShape

# hps/gpu/workspace.py and staging.py: their allocation rules (see the module docstring)
_WORKSPACE_MIN_KEYS = 1024
_STAGING_MIN_KEYS = 256
_STAGING_ALIGN = 256
_STAGING_MIN_BYTES = 1 << 16

PER_DEVICE = "per GPU the table is deployed on"
PER_THREAD = "per lookup thread and GPU, for the table's largest lookup"
FLOAT32_ROWS = "rows stored as float32 whatever the storage type"


@dataclass(frozen=True)
class TierBytes:
    """One tier's bytes for a table: `by_storage` maps each storage type to bytes
    (the same number for all where the tier stores float32 whatever the type)."""

    tier: str  # e.g. "GPU dynamic cache, 20%"
    where: str  # "device" (per GPU), "host" (process memory) or "disk"
    by_storage: dict[str, int] = field(default_factory=dict)
    note: str = ""
    #: what the row sizes, for the config that uses it (hps/tools/plan/uses.py): a GPU
    #: layout (dynamic, static, uvm, uvm_rows), the GPU query buffers (query,
    #: query_host), a volatile tier (hash_map, redis) or the persistent one (rocksdb)
    part: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _each_storage(nbytes: Any) -> dict[str, int]:
    return {name: int(nbytes(name)) for name in STORAGE_NAMES}


def _same(nbytes: int) -> dict[str, int]:
    return dict.fromkeys(STORAGE_NAMES, int(nbytes))


def dynamic_cache_bytes(num_keys: int, dim: int, gpucacheper: float) -> dict[str, int]:
    """A dynamic cache's device bytes by storage type (hps/gpu/open.py's sizing)."""
    from hps.gpu.open import cache_memory_bytes

    return _each_storage(lambda s: cache_memory_bytes(num_keys, dim, gpucacheper, s))


def static_table_bytes(num_keys: int, dim: int) -> dict[str, int]:
    """A static table's device bytes by storage type."""
    from hps.gpu.static_table import StaticEmbeddingTable

    return _each_storage(
        lambda s: StaticEmbeddingTable.memory_required(max(num_keys, 1), dim, storage=s))


def hot_bytes(shape: TableShape) -> dict[str, int]:
    """A device's bytes of a sharded static table's hot copies (hps/gpu/hot_rows.py), by
    storage type: none on one device, or where the copies do not apply."""
    from hps.gpu.hot_rows import hot_copy_applies, hot_copy_bytes
    from hps.gpu.static_table import StaticEmbeddingTable
    from hps.rows.storage_types import storage_type

    devices = min(shape.devices, shape.shards)

    def copies(s: str) -> int:
        applies = devices > 1 and hot_copy_applies(StaticEmbeddingTable._kind,
                                                   storage_type(s), shape.hot_rows)
        return hot_copy_bytes(shape.hot_rows, shape.dim, s, devices) if applies else 0

    return _each_storage(copies)


def hash_map_bytes(num_keys: int, dim: int, num_partitions: int = 16) -> dict[str, int]:
    """The in-process hash map's bytes for `num_keys` rows, by storage type."""
    from hps.tiers.hash_map import HashMapTier

    return _each_storage(lambda s: HashMapTier.memory_required(
        num_keys, dim, s, num_partitions=num_partitions))


def uvm_gpu_rows(shape: TableShape, storage: str) -> int:
    """Hot rows a uvm table keeps on the GPU: from gpu_memory_budget_mb (index included;
    at least 1) when set, else gpucacheper × keys (hps/gpu/open.py uvm_gpu_rows, without
    its check of the device's memory)."""
    from hps.gpu.uvm_table import UvmEmbeddingTable

    if shape.gpu_memory_budget_mb is None:
        return max(1, math.ceil(shape.gpucacheper * shape.num_keys))
    budget = int(shape.gpu_memory_budget_mb * 2**20)
    spare = budget - UvmEmbeddingTable.index_bytes(shape.num_keys)
    return max(1, spare // UvmEmbeddingTable.gpu_row_bytes(shape.dim, storage))


def query_buffer_bytes(lookup_keys: int, dim: int) -> tuple[int, int]:
    """(device, pinned host) bytes of one lookup thread's buffers on one GPU table for
    lookups of up to `lookup_keys` keys, all of them missing (see the module docstring)."""
    keys = max(int(lookup_keys), _WORKSPACE_MIN_KEYS)
    workspace_device = 4 * keys + 8  # miss positions (int32), counters
    workspace_host = 8 * keys + 8  # missed keys (int64), the miss count
    slots = max(_STAGING_MIN_KEYS, 1 << (max(int(lookup_keys), 1) - 1).bit_length())

    def aligned(n: int) -> int:
        return -(-n // _STAGING_ALIGN) * _STAGING_ALIGN

    staging = max(aligned(slots * 8) * 2 + aligned(slots * 4) + slots * dim * 4,
                  _STAGING_MIN_BYTES)
    return workspace_device + staging, workspace_host + staging


def table_memory(shape: TableShape) -> list[TierBytes]:
    """Every tier's bytes for the table `shape` (see the module docstring)."""
    from hps.gpu.uvm_table import UvmEmbeddingTable

    n, dim = shape.num_keys, shape.dim
    held = shape.held_by_volatile
    device, pinned = query_buffer_bytes(shape.lookup_keys, dim)
    held_note = "" if held == n else f"{held:,} of the keys (initial_cache_rate, " \
        "overflow_margin)"
    dynamic = dynamic_cache_bytes(n, dim, shape.gpucacheper)
    static = static_table_bytes(n, dim)
    per_gpu = static_note = PER_DEVICE
    if shape.shards > 1:  # row-wise sharded: a device holds its shards, each of a share
        from hps.gpu.open import WHOLE_TABLE
        from hps.gpu.shard_routing import shard_keys

        share, on_one = shard_keys(n, shape.shards), shape.shards_per_device
        dynamic = {k: on_one * v for k, v in
                   dynamic_cache_bytes(share, dim, shape.gpucacheper).items()}
        static = {k: on_one * v for k, v in static_table_bytes(share, dim).items()}
        # each device's hot copy of its peers' rows and its peers' copies' indexes
        hot = hot_bytes(shape)
        static = {k: v + hot[k] for k, v in static.items()}
        per_gpu = static_note = (f"per GPU: {on_one} of {shape.shards} shards of "
                                 f"{share:,} keys (gpu_sharding row_wise)")
        if any(hot.values()):
            static_note += f", a hot copy of {shape.hot_rows:,} keys"
        if shape.gpucacheper >= WHOLE_TABLE:  # the dynamic cache is a static table then
            dynamic = {k: v + hot[k] for k, v in dynamic.items()}
            per_gpu = static_note
    return [
        TierBytes(f"GPU dynamic cache, {100 * shape.gpucacheper:g}%", "device", dynamic,
                  per_gpu, "dynamic"),
        TierBytes("GPU static table", "device", static, static_note, "static"),
        TierBytes("GPU uvm index + hot rows", "device", _each_storage(
            lambda s: UvmEmbeddingTable.device_bytes_required(
                n, dim, uvm_gpu_rows(shape, s), storage=s)), PER_DEVICE, "uvm"),
        TierBytes("host uvm rows (pinned)", "host", _each_storage(
            lambda s: UvmEmbeddingTable.host_bytes_required(n, dim, storage=s)), PER_DEVICE,
                  "uvm_rows"),
        TierBytes(f"GPU query buffers, {shape.lookup_keys:,} keys", "device", _same(device),
                  PER_THREAD, "query"),
        TierBytes("host query buffers (pinned)", "host", _same(pinned), PER_THREAD,
                  "query_host"),
        TierBytes("host in-process hash map", "host",
                  hash_map_bytes(held, dim, shape.num_partitions), held_note, "hash_map"),
        TierBytes("Redis used_memory (est.)", "host", _same(redis_bytes(
            held, dim, shape.num_partitions, shape.overflow_policy)),
            FLOAT32_ROWS + (f"; {held_note}" if held_note else ""), "redis"),
        TierBytes("RocksDB files (est.)", "disk", _same(rocksdb_bytes(n, dim)), FLOAT32_ROWS,
                  "rocksdb"),
    ]
