"""Which GPU table a model's table gets, and how large.

The one place that maps a model's `embedding_cache_type` to a table, as one table concept
with options (HierarchicalKV's `HashTableOptions`): the kind and its sizing come from the
model config, the rows' storage type from `embedding_storage_dtype`.

    cache_type   table                                  holds
    dynamic      EmbeddingCache (dynamic_cache.py)      gpucacheper × keys, LRU, misses
                                                        inserted (sets sized by CACHE_LOAD)
    dynamic, gpucacheper ≥ 1 (WHOLE_TABLE)
                 StaticEmbeddingTable (static_table.py) up to gpucacheper × keys, misses
                                                        inserted, nothing evicted
    static       StaticEmbeddingTable                   every key, built by the warm-up
    uvm          UvmEmbeddingTable (uvm_table.py)       every key's index; `uvm_gpu_rows`
                                                        rows on the GPU, the rest in host
                                                        memory

`open_device_table` makes it and `cache_memory_bytes` tells ahead what a dynamic cache
takes (`hps inspect`); hps/gpu/fill.py fills it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hps.errors import ConfigError
from hps.gpu import kernels
from hps.gpu.dynamic_cache import DEFAULT_LRU_SAMPLE_SHIFT, EmbeddingCache
from hps.gpu.static_table import StaticEmbeddingTable
from hps.gpu.uvm_table import UvmEmbeddingTable
from hps.rows.gpu_layout import STORAGE_CODES, table_storage
from hps.rows.storage_types import FLOAT32, StorageType

if TYPE_CHECKING:
    from hps.config import ModelConfig
    from hps.gpu.shared_cache import SharedTableRecord


def cache_mode(model: ModelConfig) -> str:
    """The model's effective embedding_cache_type: "static" (the whole table on the GPU,
    read-only, misses never inserted), "uvm" (the whole table's index on the GPU, hot rows
    in GPU memory, the others in mapped host memory; misses never inserted) or "dynamic"
    (an LRU cache)."""
    return model.cache_type


# What a cache promises: after a warm-up it holds at least 0.97 of min(table keys, its
# capacity). Sets filled slot for key cannot: keys that land in a full 8-way set are lost,
# and 8-way sets filled to 100% hold 86% of what was inserted (a Poisson overflow). So the
# sets are sized for capacity / CACHE_LOAD slots: at a load of 0.6, full warm-ups held 98%
# of their keys in the NumPy model of this policy (hps/gpu/cache_model.py; tests/gpu
# checks the promise on the GPU). The extra slots are in memory_bytes.
CACHE_LOAD = 0.6
# From gpucacheper 1.0 on the cache is asked to hold the whole table: a set-associative cache
# cannot promise that (some sets overflow at any load), so such a cache is an open-addressing
# table (the static table's layout, hps/gpu/static_table.py) that misses are inserted into:
# it evicts nothing and holds every key it takes up to its capacity.
WHOLE_TABLE = 1.0


def cache_capacity(model: ModelConfig, num_keys: int) -> int:
    """Keys a dynamic cache of the model's table promises to hold: gpucacheper × keys."""
    return max(1, math.ceil(model.gpucacheper * int(num_keys)))


def cache_slots(capacity: int) -> int:
    """Slots of a set-associative cache that promises `capacity` keys (see CACHE_LOAD)."""
    return max(1, math.ceil(capacity / CACHE_LOAD))


def holds_whole_table(model: ModelConfig) -> bool:
    """Whether the model's dynamic caches are open-addressing tables (see WHOLE_TABLE)."""
    return model.cache_type == "dynamic" and model.gpucacheper >= WHOLE_TABLE


def cache_memory_bytes(num_keys: int, dim: int, gpucacheper: float,
                       storage: str | StorageType = FLOAT32) -> int:
    """Device bytes of one dynamic cache (per deployed device) of a table of `num_keys`
    keys of width `dim` at `gpucacheper`, rows stored as `storage`: what `hps inspect`
    tells a user to plan for."""
    capacity = max(1, math.ceil(gpucacheper * int(num_keys)))
    if gpucacheper >= WHOLE_TABLE:
        return StaticEmbeddingTable.memory_required(capacity, dim, storage=storage)
    return EmbeddingCache.memory_required(cache_slots(capacity), dim, storage)


def open_device_table(model: ModelConfig, mode: str, num_keys: int, dim: int, device_id: int,
                      *, lru_sample_shift: int = DEFAULT_LRU_SAMPLE_SHIFT,
                      shared_as: tuple[str, str] | None = None
                      ) -> EmbeddingCache | StaticEmbeddingTable:
    """The device table of one model table in `mode` (see cache_mode): a static or uvm
    table sized for all `num_keys` keys (uvm: GPU rows from uvm_gpu_rows), an
    open-addressing table of gpucacheper × num_keys keys that misses are inserted into
    (gpucacheper ≥ 1: see WHOLE_TABLE), or a set-associative cache sized for
    gpucacheper × num_keys keys (see CACHE_LOAD). Rows are stored as the model's
    embedding_storage_dtype. With `gpu_cache_scope: host`, the one table of the host's
    processes (hps/gpu/shared_cache.py), met as `shared_as` (table name, model files)."""
    storage = table_storage(model.embedding_storage_dtype)
    shared = None
    if model.gpu_cache_scope == "host" and mode in ("static", "dynamic"):
        shared = _shared_record(model, mode, num_keys, dim, device_id, lru_sample_shift,
                                shared_as)
    if mode == "static":
        return StaticEmbeddingTable(max(int(num_keys), 1), dim, device_id, storage=storage,
                                    shared=shared)
    if mode == "uvm":
        rows = uvm_gpu_rows(model, num_keys, dim, device_id)
        return UvmEmbeddingTable(max(int(num_keys), 1), dim, device_id, gpu_rows=rows,
                                 storage=storage)
    if holds_whole_table(model):
        return StaticEmbeddingTable(cache_capacity(model, num_keys), dim, device_id,
                                    storage=storage, shared=shared)
    return EmbeddingCache(cache_slots(cache_capacity(model, num_keys)), dim, device_id,
                          lru_sample_shift=lru_sample_shift, storage=storage, shared=shared)


def _shared_record(model: ModelConfig, mode: str, num_keys: int, dim: int, device_id: int,
                   lru_sample_shift: int, shared_as: tuple[str, str] | None
                   ) -> SharedTableRecord:
    """The record of the host's one table for this model table and device: created here
    (this process allocates it) or found (this process maps it once it is ready)."""
    from hps.gpu.shared_cache import SharedTableRecord, table_key
    from hps.runtime.mps import check_for_shared_cache

    table, files = shared_as or (str(dim), "")
    params = {"kind": {"static": 1, "dynamic": 2 if holds_whole_table(model) else 3}[mode],
              "dim": dim, "keys": int(num_keys), "device": device_id,
              "capacity": cache_capacity(model, num_keys),
              "storage": STORAGE_CODES[table_storage(model.embedding_storage_dtype).name],
              "lru": lru_sample_shift}
    record = SharedTableRecord(table_key(model.model, table, device_id, params, files), params)
    if not record.owner:
        check_for_shared_cache()
    return record


def uvm_gpu_rows(model: ModelConfig, num_keys: int, dim: int, device_id: int) -> int:
    """GPU rows of a model's uvm table: `gpu_memory_budget_mb` (index included) when set,
    else gpucacheper × num_keys. Raises ConfigError for a budget larger than the device's
    memory or smaller than the index of all keys."""
    budget_mb = model.gpu_memory_budget_mb
    if budget_mb is None:
        return max(1, math.ceil(model.gpucacheper * int(num_keys)))
    budget = int(budget_mb * 2**20)
    index = UvmEmbeddingTable.index_bytes(num_keys)
    if budget < index:
        raise ConfigError(
            f"model {model.model}: gpu_memory_budget_mb {budget_mb:g} does not hold the "
            f"index of the table's {num_keys} keys ({index / 2**20:.1f} MiB on the GPU); "
            f"raise it or use embedding_cache_type 'dynamic'"
        )
    cp = kernels.cupy_module()
    with cp.cuda.Device(device_id):
        total = int(cp.cuda.runtime.memGetInfo()[1])
    if budget > total:
        raise ConfigError(
            f"model {model.model}: gpu_memory_budget_mb {budget_mb:g} is more than device "
            f"{device_id} has ({total / 2**20:.0f} MiB)"
        )
    return (budget - index) // UvmEmbeddingTable.gpu_row_bytes(
        dim, model.embedding_storage_dtype)
