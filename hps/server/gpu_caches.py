"""GPU embedding caches of the loaded tables: attached when a model loads, warmed up from
its files, refreshed from the tiers, updated in place by online updates, closed when its
version retires."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np

from hps.config import PSConfig
from hps.loader import served_chunks
from hps.server.host_lookup import HostLookup
from hps.server.models import LoadedModel, LoadedTable

log = logging.getLogger("hps")


class GpuCaches:
    """Puts a GPU cache on every deployed device of the models that ask for one
    (`gpucache: true`); its misses take the host lookup path of `host`.

    `enabled` is False when no model asks for a GPU cache or there is no CUDA device or
    CuPy (then models asking for one are served from the tiers, with one warning).
    """

    def __init__(self, config: PSConfig, host: HostLookup) -> None:
        self.host = host
        self.enabled = _gpu_wanted_and_present(config)
        self.insert_updates = config.update_source.gpu_cache_insert

    def attach(self, loaded: LoadedModel, readers: Sequence[Any]) -> None:
        """Give each table of `loaded` its caches, one per deployed device, warmed up from
        `readers` (one model reader per table) where the config asks for it."""
        if not (self.enabled and loaded.config.gpucache):
            return
        from hps.gpu.lookup import GpuEmbeddingTable

        cfg = loaded.config
        for table, reader in zip(loaded.tables, readers, strict=True):
            for device in cfg.deployed_device_list:
                fetch = self.host.for_table(table)
                gpu = GpuEmbeddingTable(cfg, table.index, reader.num_keys, device,
                                        fetch_host=fetch, fetch_into=fetch.into)
                pct = cfg.cache_refresh_percentage_per_iteration
                if cfg.init_ec and (pct > 0 or cfg.cache_type in ("static", "uvm")):
                    gpu.warm_up(self._warm_chunks(table, reader, gpu, pct))
                table.gpu[device] = gpu

    def _warm_chunks(self, table: LoadedTable, reader: Any, gpu: Any, pct: float
                     ) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        """The file's chunks a cache warms up from; where the files repeat keys, with the
        rows the tiers serve (a key's last row), so the cache agrees with them."""
        chunks: Iterable[tuple[np.ndarray, np.ndarray]] = reader.chunks(
            chunk_keys=_warm_chunk(gpu, pct, reader))
        whole = self.host.tiers.persistent or self.host.tiers.volatile
        if table.source.duplicate_keys and whole is not None:
            return served_chunks(table.storage_name, chunks, whole)
        return chunks

    @staticmethod
    def refresh(models: Iterable[LoadedModel]) -> int:
        """Re-read the cached vectors of `models` from the tiers; returns keys refreshed."""
        total = 0
        for loaded in models:
            for table in loaded.tables:
                for gpu in table.gpu.values():
                    total += int(gpu.refresh())
        return total

    def writer(self, table: LoadedTable) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """How online updates reach the caches of `table` (None when it has none)."""
        return partial(self.apply_update, table) if table.gpu else None

    def apply_update(self, table: LoadedTable, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Overwrite the rows of `keys` (unique, host int64 [n]) in every cache of `table`
        that holds them, in place; with `update_source.gpu_cache_insert` the keys a cache
        lacks are inserted too. Called once the tiers hold the new rows."""
        for gpu in table.gpu.values():
            if self.insert_updates:
                gpu.insert(keys, vectors)
            else:
                gpu.update(keys, vectors)

    @staticmethod
    def close(model: LoadedModel) -> None:
        """Stop the caches of `model` and free their device memory."""
        for table in model.tables:
            for gpu in table.gpu.values():
                gpu.close()


def _gpu_wanted_and_present(config: PSConfig) -> bool:
    wants = [m.model for m in config.models if m.gpucache]
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


def _warm_chunk(gpu: Any, pct: float, reader: Any) -> int:
    """Keys per warm-up chunk: `pct` of the cache's capacity, or the whole table."""
    capacity = int(gpu.stats().get("capacity", reader.num_keys))
    return max(1, int(min(pct, 1.0) * capacity)) if pct > 0 else reader.num_keys
