"""HierarchicalParameterServer: the models, their tables, and the lookup path.

Lookup path (DESIGN.md): keys → GPU cache (when there is one) → volatile tier →
persistent tier → the table's default value. Vectors of keys found only in the
persistent tier are copied into the volatile tier when `cache_missed_embeddings` is set.

A model becomes visible to lookups only once every one of its tables is loaded: the
registry maps names to fully built `LoadedModel` objects and is swapped in one
assignment, so no lookup ever sees a half-loaded model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hps.config import ModelConfig, PSConfig, load_config
from hps.db.base import Tier, table_name
from hps.errors import (
    BatchTooLargeError,
    LookupInputError,
    TierUnavailableError,
    UnknownModelError,
    UnknownTableError,
)
from hps.io.sparse_model import DEFAULT_CHUNK_BYTES
from hps.keys import as_key_array, as_output_array, is_device_array
from hps.loader import LoadProgress, TableSource, load_table, open_readers

log = logging.getLogger("hps")

#: storage-name suffix of the version being loaded beside a served one
STAGING_SUFFIX = "~next"


@dataclass
class TableStats:
    """Counters of one table's lookups, read by metrics and `GET /v1/models`."""

    lookups: int = 0
    keys: int = 0
    volatile_hits: int = 0
    persistent_hits: int = 0
    defaults: int = 0
    tier_failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, keys: int, volatile: int, persistent: int, defaults: int) -> None:
        with self.lock:
            self.lookups += 1
            self.keys += keys
            self.volatile_hits += volatile
            self.persistent_hits += persistent
            self.defaults += defaults

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {k: v for k, v in self.__dict__.items() if k != "lock"}


@dataclass
class LoadedTable:
    """One table of a loaded model, as the lookup path needs it."""

    index: int
    name: str  # as in the config, e.g. "sparse_embedding0"
    storage_name: str  # hps_et.<model>.<table>
    dim: int
    default_value: float
    max_keys: int
    source: TableSource
    stats: TableStats = field(default_factory=TableStats)
    gpu: dict[int, Any] = field(default_factory=dict)  # device id → GpuEmbeddingTable


@dataclass
class LoadedModel:
    config: ModelConfig
    tables: list[LoadedTable]

    def table(self, table: int | str) -> LoadedTable:
        """A table by index or by name."""
        if isinstance(table, (int, np.integer)) and not isinstance(table, bool):
            if 0 <= table < len(self.tables):
                return self.tables[int(table)]
        elif isinstance(table, str):
            for t in self.tables:
                if t.name == table:
                    return t
            if table.isdigit() and int(table) < len(self.tables):
                return self.tables[int(table)]
        names = ", ".join(f"{t.index}={t.name}" for t in self.tables)
        raise UnknownTableError(
            f"model {self.config.model!r} has no table {table!r} (tables: {names})"
        )


def _make_volatile(config: PSConfig) -> Tier | None:
    db = config.volatile_db
    if not db.enabled:
        return None
    if db.is_redis:
        from hps.db.redis import RedisTier

        return RedisTier(db)
    from hps.db.hash_map import HashMapTier

    return HashMapTier(db)


def _make_persistent(config: PSConfig, chunk_bytes: int) -> Tier | None:
    if not config.persistent_db.enabled:
        return None
    from hps.db.rocksdb import RocksDBTier

    # a bulk-load run of four chunks keeps a load's memory at a few chunks
    return RocksDBTier(config.persistent_db, load_run_bytes=4 * chunk_bytes)


class HierarchicalParameterServer:
    """Holds the tiers and the loaded models, and serves lookups.

    Thread-safe: lookups may run from many threads, also while a model loads.
    """

    def __init__(
        self,
        config: PSConfig | dict[str, Any] | str,
        *,
        load: bool = True,
        progress: LoadProgress | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        drop_grace_seconds: float = 2.0,
    ) -> None:
        self.config = load_config(config)
        self.chunk_bytes = chunk_bytes
        # a replaced version's tables outlive the swap by this long, for lookups in flight
        self.drop_grace_seconds = drop_grace_seconds
        self._pending_drops: list[threading.Timer] = []
        self.volatile = _make_volatile(self.config)
        self.persistent = _make_persistent(self.config, chunk_bytes)

        self._models: dict[str, LoadedModel] = {}
        self._load_lock = threading.Lock()
        self._gpu_ok = self._check_gpu()
        if load:
            for model in self.config.models:
                self.load_model(model, progress=progress)

    # -- models ---------------------------------------------------------------------------

    def _check_gpu(self) -> bool:
        wants = [m.model for m in self.config.models if m.gpucache]
        if not wants:
            return False
        try:
            from hps.gpu.lookup import cuda_available
        except ImportError:  # a build without the GPU tier
            return False
        if cuda_available():
            return True
        log.warning(
            "no CUDA device or CuPy: models %s ask for a GPU cache (gpucache: true) but are "
            "served from the database tiers", ", ".join(wants)
        )
        return False

    @property
    def models(self) -> dict[str, LoadedModel]:
        """Loaded models by name (a snapshot)."""
        return dict(self._models)

    def model(self, name: str) -> LoadedModel:
        try:
            return self._models[name]
        except KeyError:
            loaded = ", ".join(sorted(self._models)) or "none"
            raise UnknownModelError(
                f"no model named {name!r} is loaded (loaded: {loaded})"
            ) from None

    def load_model(self, model: ModelConfig, progress: LoadProgress | None = None) -> LoadedModel:
        """Load (or reload) `model`; it becomes visible to lookups only when complete.

        A reload of a served model writes the new version beside the old one (staging
        storage names) and swaps it in with one assignment; a load that fails leaves the
        old version serving and removes what it wrote.
        """
        progress = progress or LoadProgress()
        with self._load_lock:
            readers = open_readers(self.config, model, self.chunk_bytes)  # validates first
            old = self._models.get(model.model)
            names = [self._storage_name(model, i, old) for i in range(model.num_tables)]
            if old is None:  # a staging version left behind by an earlier process
                self._drop_tables([n + STAGING_SUFFIX for n in names
                                   if self.persistent and n + STAGING_SUFFIX in
                                   self.persistent.tables()])
            written: list[str] = []
            try:
                tables = []
                for i, reader in enumerate(readers):
                    written.append(names[i])
                    source = load_table(
                        names[i], reader, self.volatile, self.persistent,
                        self.config.volatile_db.initial_cache_rate, progress,
                    )
                    tables.append(LoadedTable(
                        index=i,
                        name=model.embedding_table_names[i],
                        storage_name=names[i],
                        dim=reader.vec_size,
                        default_value=float(model.default_value_for_each_table[i]),
                        max_keys=model.max_keys_per_lookup(i),
                        source=source,
                    ))
                loaded = LoadedModel(model, tables)
                if self._gpu_ok and model.gpucache:
                    self._attach_gpu(loaded, readers)
            except BaseException:
                if old is not None:  # the staging tables of a failed reload go away
                    self._drop_tables(written)
                raise
            self._models = {**self._models, model.model: loaded}
            if old is not None:
                self._retire(old, keep=set(names))
            return loaded

    def reload_model(self, name: str, sparse_files: Sequence[str] | None = None,
                     progress: LoadProgress | None = None) -> LoadedModel:
        """Re-read a served model, optionally from new files (a new version)."""
        current = self.model(name).config
        update = {"sparse_files": list(sparse_files)} if sparse_files is not None else {}
        if sparse_files is not None and len(sparse_files) != current.num_tables:
            raise LookupInputError(
                f"model {name!r} has {current.num_tables} tables but "
                f"{len(sparse_files)} sparse files were given"
            )
        return self.load_model(current.model_copy(update=update), progress=progress)

    @staticmethod
    def _storage_name(model: ModelConfig, index: int, old: LoadedModel | None) -> str:
        """HugeCTR's name for a first load; a reload alternates with a staging name."""
        base = table_name(model.model, model.embedding_table_names[index])
        if old is None:
            return base
        current = next((t.storage_name for t in old.tables
                        if t.name == model.embedding_table_names[index]), None)
        return f"{base}{STAGING_SUFFIX}" if current == base else base

    def _retire(self, old: LoadedModel, keep: set[str]) -> None:
        """Drop a replaced version's tables once lookups in flight have finished."""
        names = [t.storage_name for t in old.tables if t.storage_name not in keep]
        timer = threading.Timer(self.drop_grace_seconds, self._close_and_drop, (old, names))
        timer.daemon = True
        self._pending_drops.append(timer)
        timer.start()

    def _close_and_drop(self, old: LoadedModel, names: list[str]) -> None:
        with self._load_lock:
            self._close_gpu(old)
            self._drop_tables(names)

    def _drop_tables(self, names: Sequence[str]) -> None:
        for tier in (self.volatile, self.persistent):
            if tier is None or tier.read_only:
                continue
            for name in names:
                try:
                    tier.drop_table(name)
                except TierUnavailableError:
                    log.warning("could not drop %s from the %s tier", name, tier.name)

    def _attach_gpu(self, loaded: LoadedModel, readers: Sequence[Any]) -> None:
        from hps.gpu.lookup import GpuEmbeddingTable

        cfg = loaded.config
        for table, reader in zip(loaded.tables, readers, strict=True):
            for device in cfg.deployed_device_list:
                gpu = GpuEmbeddingTable(
                    cfg, table.index, reader.num_keys, device,
                    fetch_host=lambda keys, t=table: self._fetch_host(t, keys),
                )
                pct = cfg.cache_refresh_percentage_per_iteration
                if cfg.init_ec and (pct > 0 or cfg.cache_type == "static"):
                    gpu.warm_up(reader.chunks(chunk_keys=self._warm_chunk(gpu, pct, reader)))
                table.gpu[device] = gpu

    @staticmethod
    def _warm_chunk(gpu: Any, pct: float, reader: Any) -> int:
        capacity = int(gpu.stats().get("capacity", reader.num_keys))
        return max(1, int(min(pct, 1.0) * capacity)) if pct > 0 else reader.num_keys

    @staticmethod
    def _close_gpu(model: LoadedModel) -> None:
        for table in model.tables:
            for gpu in table.gpu.values():
                gpu.close()

    # -- lookups --------------------------------------------------------------------------

    def _checked_keys(self, table: LoadedTable, keys: Any) -> Any:
        array = as_key_array(keys)
        if array.size > table.max_keys:
            raise BatchTooLargeError(
                f"{array.size} keys exceed the limit of {table.max_keys} for table "
                f"{table.name!r} (max_batch_size × maxnum_catfeature_query_per_table_per_sample)"
            )
        return array

    def _check_device(self, model: LoadedModel, device_id: int) -> None:
        if device_id not in model.config.deployed_device_list:
            raise LookupInputError(
                f"device_id {device_id} is not in deployed_device_list "
                f"{model.config.deployed_device_list} of model {model.config.model!r}"
            )

    def lookup(self, model: str, table: int | str, keys: Any, device_id: int | None = None
               ) -> np.ndarray:
        """Vectors of `keys` as a new float32 [n, dim] host array."""
        loaded = self.model(model)
        t = loaded.table(table)
        array = self._checked_keys(t, keys)
        if device_id is not None:
            self._check_device(loaded, device_id)
        if is_device_array(array):
            array = array.get()
        device = device_id if device_id is not None else loaded.config.deployed_device_list[0]
        gpu = t.gpu.get(device)
        if gpu is not None:
            out = np.empty((array.size, t.dim), np.float32)
            gpu.lookup(array, out)
            return out
        return self._fetch_host(t, array)

    def lookup_into(self, model: str, table: int | str, keys: Any, out: Any,
                    device_id: int = 0) -> int:
        """Write the vectors of `keys` into `out` in place; returns the number of keys.

        `keys` and `out` may be host or CUDA arrays, DLPack capsules or `__dlpack__`
        objects. Raises an HPSError subclass, writing nothing, for bad input.
        """
        loaded = self.model(model)
        t = loaded.table(table)
        self._check_device(loaded, device_id)
        array = self._checked_keys(t, keys)
        target = as_output_array(out, array.size, t.dim)
        if array.size == 0:
            return 0
        gpu = t.gpu.get(device_id)
        if gpu is not None:
            gpu.lookup(array, target)
            return int(array.size)
        host_keys = array.get() if is_device_array(array) else array
        vectors = self._fetch_host(t, host_keys)
        if is_device_array(target):
            target.set(vectors)
        else:
            np.copyto(target, vectors)
        return int(array.size)

    def _fetch_host(self, t: LoadedTable, keys: np.ndarray) -> np.ndarray:
        """volatile → persistent → default, on host arrays. Never fails on a tier outage."""
        n = keys.size
        name = t.storage_name
        vectors: np.ndarray | None = None
        found = np.zeros(n, dtype=bool)
        if self.volatile is not None and n:
            try:
                vectors, found = self.volatile.fetch(name, keys)
            except TierUnavailableError:
                with t.stats.lock:
                    t.stats.tier_failures += 1
        if vectors is None:
            vectors = np.zeros((n, t.dim), dtype=np.float32)
        volatile_hits = int(np.count_nonzero(found))
        persistent_hits = 0
        if volatile_hits < n and self.persistent is not None:
            missing = np.flatnonzero(~found)
            unique, inverse = np.unique(keys[missing], return_inverse=True)
            rows, present = self.persistent.fetch(name, unique)
            vectors[missing] = rows[inverse]
            found[missing] = present[inverse]
            persistent_hits = int(np.count_nonzero(present[inverse]))
            if self.config.volatile_db.cache_missed_embeddings and self.volatile is not None:
                self._cache_missed(name, unique[present], rows[present])
        defaults = n - volatile_hits - persistent_hits
        if defaults:
            vectors[~found] = t.default_value
        t.stats.add(n, volatile_hits, persistent_hits, defaults)
        return vectors

    def _cache_missed(self, name: str, keys: np.ndarray, rows: np.ndarray) -> None:
        if not keys.size:
            return
        try:
            self.volatile.insert_async(name, keys, rows)  # type: ignore[union-attr]
        except TierUnavailableError:
            pass  # the next lookup of these keys reaches the persistent tier again

    # -- maintenance ----------------------------------------------------------------------

    def refresh(self, model: str | None = None) -> int:
        """Re-read the GPU-cached vectors of one or all models from the databases."""
        total = 0
        for loaded in ([self.model(model)] if model else list(self._models.values())):
            for t in loaded.tables:
                for gpu in t.gpu.values():
                    total += int(gpu.refresh())
        return total

    def describe(self) -> list[dict[str, Any]]:
        """Models, tables, widths, sources, tier sizes and counters (for CLI and HTTP)."""
        out = []
        for name, loaded in sorted(self._models.items()):
            tables = []
            for t in loaded.tables:
                info: dict[str, Any] = {
                    "index": t.index, "name": t.name, "storage_name": t.storage_name,
                    "dim": t.dim, "default_value": t.default_value, "max_keys": t.max_keys,
                    "source": t.source.as_dict(), "stats": t.stats.as_dict(), "tiers": {},
                }
                for tier in (self.volatile, self.persistent):
                    if tier is not None:
                        try:
                            info["tiers"][tier.name] = {"keys": tier.size(t.storage_name)}
                        except TierUnavailableError:
                            info["tiers"][tier.name] = {"keys": None, "error": "unavailable"}
                if t.gpu:
                    info["gpu"] = {str(d): g.stats() for d, g in t.gpu.items()}
                tables.append(info)
            out.append({"model": name, "tables": tables})
        return out

    def close(self) -> None:
        """Stop background work and close every tier."""
        for timer in self._pending_drops:
            timer.cancel()
            if not timer.finished.is_set():
                timer.function(*timer.args)
        self._pending_drops = []
        for loaded in self._models.values():
            self._close_gpu(loaded)
        self._models = {}
        for tier in (self.volatile, self.persistent):
            if tier is not None:
                tier.close()

    def __enter__(self) -> HierarchicalParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

