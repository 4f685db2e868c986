"""The loaded models by name: versioned loads, one-assignment swaps, delayed retirement.

A model becomes visible to lookups only once every one of its tables is loaded: the
registry maps names to fully built `LoadedModel` objects and is swapped in one
assignment, so no lookup ever sees a half-loaded model. A reload writes the new version
under staging storage names beside the served one; the replaced version's tables are
dropped a grace period after the swap, once lookups in flight have finished.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from hps.config import ModelConfig, PSConfig
from hps.db import Tiers
from hps.db.base import table_name
from hps.errors import LookupInputError, TierUnavailableError, UnknownModelError
from hps.loader import LoadProgress, load_table, open_readers
from hps.server.gpu_caches import GpuCaches
from hps.server.models import LoadedModel, LoadedTable

log = logging.getLogger("hps")

#: storage-name suffix of the version being loaded beside a served one
STAGING_SUFFIX = "~next"


class ModelRegistry:
    """Loads models into `tiers` (and GPU caches) and holds the versions served.

    Thread-safe: loads are serialised; reads of `models` and `model()` never wait.
    """

    def __init__(self, config: PSConfig, tiers: Tiers, gpu: GpuCaches, *,
                 chunk_bytes: int, drop_grace_seconds: float) -> None:
        self.config = config
        self.tiers = tiers
        self.gpu = gpu
        self.chunk_bytes = chunk_bytes
        self.drop_grace_seconds = drop_grace_seconds
        self._models: dict[str, LoadedModel] = {}
        self._load_lock = threading.Lock()
        self._pending_drops: list[threading.Timer] = []

    @property
    def models(self) -> dict[str, LoadedModel]:
        """Loaded models by name (a snapshot)."""
        return dict(self._models)

    def model(self, name: str) -> LoadedModel:
        """The served version of model `name`; raises UnknownModelError if none."""
        try:
            return self._models[name]
        except KeyError:
            loaded = ", ".join(sorted(self._models)) or "none"
            raise UnknownModelError(
                f"no model named {name!r} is loaded (loaded: {loaded})"
            ) from None

    def load(self, model: ModelConfig, progress: LoadProgress | None = None) -> LoadedModel:
        """Load (or reload) `model`; it becomes visible to lookups only when complete.

        A reload of a served model writes the new version beside the old one (staging
        storage names) and swaps it in with one assignment; a load that fails leaves the
        old version serving and removes what it wrote.
        """
        progress = progress or LoadProgress()
        with self._load_lock:
            readers = open_readers(self.config, model, self.chunk_bytes)  # validates first
            old = self._models.get(model.model)
            names = [_storage_name(model, i, old) for i in range(model.num_tables)]
            if old is None:  # a staging version left behind by an earlier process
                self._drop_leftover_staging(names)
            written: list[str] = []
            try:
                tables = []
                for i, reader in enumerate(readers):
                    written.append(names[i])
                    tables.append(self._load_table(model, i, names[i], reader, progress))
                loaded = LoadedModel(model, tables)
                self.gpu.attach(loaded, readers)
            except BaseException:
                # what a failed load wrote goes away: a reload's staging tables, or the
                # tables of a first load that never became visible
                self._drop_tables(written)
                raise
            finally:
                for reader in readers:
                    reader.close()
            self._models = {**self._models, model.model: loaded}
            if old is not None:
                self._retire(old, keep=set(names))
            return loaded

    def reload(self, name: str, sparse_files: Sequence[str] | None = None,
               progress: LoadProgress | None = None) -> LoadedModel:
        """Re-read a served model, optionally from new files (a new version)."""
        current = self.model(name).config
        update = {"sparse_files": list(sparse_files)} if sparse_files is not None else {}
        if sparse_files is not None and len(sparse_files) != current.num_tables:
            raise LookupInputError(
                f"model {name!r} has {current.num_tables} tables but "
                f"{len(sparse_files)} sparse files were given"
            )
        return self.load(current.model_copy(update=update), progress=progress)

    def close(self) -> None:
        """Finish pending retirements now, close every GPU cache, forget every model."""
        for timer in self._pending_drops:
            timer.cancel()
            if not timer.finished.is_set():
                timer.function(*timer.args)
        self._pending_drops = []
        for loaded in self._models.values():
            self.gpu.close(loaded)
        self._models = {}

    def _load_table(self, model: ModelConfig, index: int, storage_name: str, reader: Any,
                    progress: LoadProgress) -> LoadedTable:
        source = load_table(
            storage_name, reader, self.tiers.volatile, self.tiers.persistent,
            self.config.volatile_db.initial_cache_rate, progress,
        )
        return LoadedTable(
            index=index,
            name=model.embedding_table_names[index],
            storage_name=storage_name,
            dim=reader.vec_size,
            default_value=float(model.default_value_for_each_table[index]),
            max_keys=model.max_keys_per_lookup(index),
            source=source,
        )

    def _drop_leftover_staging(self, names: Sequence[str]) -> None:
        persistent = self.tiers.persistent
        if persistent is None:
            return
        stored = persistent.tables()
        self._drop_tables([n + STAGING_SUFFIX for n in names if n + STAGING_SUFFIX in stored])

    def _retire(self, old: LoadedModel, keep: set[str]) -> None:
        """Drop a replaced version's tables once lookups in flight have finished."""
        names = [t.storage_name for t in old.tables if t.storage_name not in keep]
        timer = threading.Timer(self.drop_grace_seconds, self._close_and_drop, (old, names))
        timer.daemon = True
        self._pending_drops.append(timer)
        timer.start()

    def _close_and_drop(self, old: LoadedModel, names: list[str]) -> None:
        with self._load_lock:
            self.gpu.close(old)
            self._drop_tables(names)

    def _drop_tables(self, names: Sequence[str]) -> None:
        for tier in self.tiers:
            if tier.read_only:
                continue
            for name in names:
                try:
                    tier.drop_table(name)
                except TierUnavailableError:
                    log.warning("could not drop %s from the %s tier", name, tier.name)


def _storage_name(model: ModelConfig, index: int, old: LoadedModel | None) -> str:
    """HugeCTR's name for a first load; a reload alternates with a staging name."""
    base = table_name(model.model, model.embedding_table_names[index])
    if old is None:
        return base
    current = next((t.storage_name for t in old.tables
                    if t.name == model.embedding_table_names[index]), None)
    return f"{base}{STAGING_SUFFIX}" if current == base else base
