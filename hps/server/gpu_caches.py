"""GPU embedding caches of the loaded tables: attached when a model loads, warmed up from
its files, refreshed from the tiers, updated in place by online updates, closed when its
version retires."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np

from hps.config import ModelConfig, PSConfig
from hps.errors import NoHotCopiesError
from hps.server.cache_journal import UpdateJournal
from hps.server.counted_chunks import CountedChunks
from hps.server.host_lookup import HostLookup
from hps.server.loader import LoadProgress, served_chunks
from hps.server.models import LoadedModel, LoadedTable

log = logging.getLogger("hps")


class GpuCaches:
    """Puts a GPU cache on every deployed device of the models that ask for one
    (`gpucache: true`); its misses take the host lookup path of `host`.

    `enabled` is False until a model asks for a GPU cache on a machine with a CUDA device
    and CuPy (without them models asking for one are served from the tiers, with a
    warning). Models added at runtime get their caches as the config's models do.
    """

    def __init__(self, config: PSConfig, host: HostLookup) -> None:
        self.host = host
        self._cuda: bool | None = None  # a CUDA device and CuPy: looked for when first asked
        self._warned: set[str] = set()  # models told they get no GPU cache
        wants = [m.model for m in config.models if m.gpucache]
        self.enabled = bool(wants) and self._cuda_present(wants)
        self.insert_updates = config.update_source.gpu_cache_insert
        #: with several workers, the leader's record of the keys its updates wrote, for
        #: the other workers' caches (hps/server/cache_journal.py); None in one process
        self.journal: UpdateJournal | None = None
        #: called with each version once its caches are attached, before it serves (the
        #: server's hot-key sampling and its warm-up from a peer: warm_up.py; with the
        #: load's progress, which hears the warm-up's steps)
        self.before_serving: Callable[[LoadedModel, LoadProgress], None] | None = None

    def _cuda_present(self, wants: Sequence[str]) -> bool:
        """Whether GPU caches can be made; warns, naming the models `wants`, when not."""
        if self._cuda is None:
            try:
                from hps.gpu.table import cuda_available
            except ImportError:  # a build without the GPU tier
                self._cuda = False
            else:
                self._cuda = bool(cuda_available())
        fresh = [w for w in wants if w not in self._warned]
        if not self._cuda and fresh:
            log.warning(
                "no CUDA device or CuPy: models %s ask for a GPU cache (gpucache: true) but "
                "are served from the database tiers", ", ".join(fresh))
            self._warned.update(fresh)
        return self._cuda

    def attach(self, loaded: LoadedModel, readers: Sequence[Any],
               progress: LoadProgress | None = None) -> None:
        """Give each table of `loaded` its caches, one per deployed device, warmed up from
        `readers` (one model reader per table) where the config asks for it; then
        `before_serving(loaded, progress)`. Every load calls it before the version
        serves."""
        progress = progress or LoadProgress()
        self._attach_caches(loaded, readers, progress)
        for table in loaded.tables:
            if table.gpu:  # the host path sees only what the caches miss
                table.keys_seen.source = "gpu_misses"
        if self.before_serving is not None:
            self.before_serving(loaded, progress)

    def _attach_caches(self, loaded: LoadedModel, readers: Sequence[Any],
                       progress: LoadProgress) -> None:
        if not loaded.config.gpucache:
            return
        if not (self.enabled or self._cuda_present([loaded.config.model])):
            return
        self.enabled = True
        from hps.gpu.table import GpuEmbeddingTable

        cfg = loaded.config
        for table, reader in zip(loaded.tables, readers, strict=True):
            if cfg.gpu_sharding == "row_wise":
                self._attach_sharded(cfg, table, reader, progress)
                continue
            for device in cfg.deployed_device_list:
                fetch = self.host.for_table(table)
                gpu = GpuEmbeddingTable(cfg, table.index, reader.num_keys, device,
                                        fetch_host=fetch, fetch_into=fetch.into,
                                        shared_as=(table.name,
                                                   str(cfg.sparse_files[table.index])))
                pct = cfg.cache_refresh_percentage_per_iteration
                if cfg.init_ec and not gpu.attached and (
                        pct > 0 or cfg.cache_type in ("static", "uvm")):
                    self._fill(cfg, gpu, table, reader, progress, f"on GPU {device}")
                    _release_pool(device)
                gpu.publish()  # gpu_cache_scope host: the other processes may map it now
                table.gpu[device] = gpu

    def _attach_sharded(self, cfg: ModelConfig, table: LoadedTable, reader: Any,
                        progress: LoadProgress) -> None:
        """One cache split into shards over the devices (hps/gpu/sharded.py), seen from
        each device through a view of its own."""
        from hps.gpu.sharded import ShardedTable

        fetch = self.host.for_table(table)
        sharded = ShardedTable(cfg, table.index, reader.num_keys, fetch_host=fetch,
                               fetch_into=fetch.into)
        pct = cfg.cache_refresh_percentage_per_iteration
        if cfg.init_ec and (pct > 0 or cfg.cache_type == "static"):
            devices = ", ".join(map(str, sorted(set(sharded.devices))))
            self._fill(cfg, sharded, table, reader, progress, f"over GPUs {devices}")
            for device in set(sharded.devices):
                _release_pool(device)
        for device in cfg.deployed_device_list:
            table.gpu[device] = sharded.view(device)

    def _fill(self, cfg: ModelConfig, gpu: Any, table: LoadedTable, reader: Any,
              progress: LoadProgress, where: str) -> None:
        """Fill cache `gpu` (one device's, or a sharded one) from the table's files,
        counted as a step of the load's progress."""
        filled = CountedChunks(progress, f"filling the GPU cache of {cfg.model}/"
                               f"{table.name} {where}", _fill_total(gpu, cfg, reader))
        pct = cfg.cache_refresh_percentage_per_iteration
        try:
            gpu.warm_up(filled.chunks(self._warm_chunks(table, reader, gpu, pct)))
        finally:
            filled.finish()

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
                for gpu in _distinct(table.gpu.values()):
                    total += int(gpu.refresh())
        return total

    def prefetch(self, table: LoadedTable, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Insert the rows of `keys` (distinct, host int64 [n]; float32 [n, dim]) into
        every cache of `table` through the caches' insert path (the table's own stream,
        evicting as a miss does; a static or uvm table only updates the rows it holds).
        Returns the rows written, each cache counted."""
        caches = _distinct(table.gpu.values())
        for gpu in caches:
            gpu.insert(keys, vectors)
        return int(keys.size) * len(caches)

    @staticmethod
    def hot_owners(table: LoadedTable) -> list[Any]:
        """The sharded caches of `table` that keep hot copies (hps/gpu/hot_rows.py): one,
        or none (not sharded over several GPUs here, int8, `gpu_hot_rows` 0)."""
        return [gpu for gpu in _distinct(table.gpu.values()) if getattr(gpu, "hot", None)]

    @staticmethod
    def replicate_hot(table: LoadedTable, keys: np.ndarray) -> dict[int, int]:
        """Each hot copy of `table`'s sharded cache filled with the rows of `keys` (host
        int64, heaviest first; hps/gpu/hot_rows.py): the keys each device's copy holds.
        Raises NoHotCopiesError where it has none."""
        owners = GpuCaches.hot_owners(table)
        if not owners:
            raise NoHotCopiesError(
                f"table {table.name!r} keeps no hot copies here: they are made for a static "
                "table sharded over several GPUs (gpu_sharding row_wise, not stored as "
                "int8, gpu_hot_rows above 0) on a server with GPU caches")
        held: dict[int, int] = {}
        for owner in owners:
            held.update(owner.replicate_hot(keys))
        return held

    @staticmethod
    def held_keys(table: LoadedTable, most: int, device: int | None = None) -> np.ndarray:
        """Keys the GPU caches of `table` hold (those serving `device` alone, if given),
        each cache's most recently used first (at most `most` of each; a sharded table's
        shards each give theirs)."""
        held = [np.empty(0, np.int64)]
        caches = table.gpu.values() if device is None else [table.gpu[device]]
        for owner in _distinct(caches):
            held += [gpu.held_keys(most) for gpu in getattr(owner, "shards", [owner])]
        return np.concatenate(held)

    def writer(self, model: str, table: LoadedTable
               ) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """How online updates reach the caches of `table` of `model` (None when it has
        none): written here, then, with several workers, told to the others (`journal`)."""
        if not table.gpu:
            return None
        if self.journal is None:
            return partial(self.apply_update, table)
        return partial(self._apply_and_tell, model, table)

    def _apply_and_tell(self, model: str, table: LoadedTable, keys: np.ndarray,
                        vectors: np.ndarray) -> None:
        self.apply_update(table, keys, vectors)
        self.journal.append(model, table.name, keys)  # type: ignore[union-attr]

    def apply_update(self, table: LoadedTable, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Overwrite the rows of `keys` (unique, host int64 [n]) in every cache of `table`
        that holds them, in place; with `update_source.gpu_cache_insert` the keys a cache
        lacks are inserted too. Called once the tiers hold the new rows."""
        for gpu in _distinct(table.gpu.values()):
            if self.insert_updates:
                gpu.insert(keys, vectors)
            else:
                gpu.update(keys, vectors)

    def refetch(self, table: LoadedTable, keys: np.ndarray) -> None:
        """apply_update with the rows the tiers hold for `keys` (unique, host int64):
        another worker's update, which that worker wrote to the tiers
        (hps/server/cache_journal.py)."""
        if table.gpu:
            self.apply_update(table, keys, self.host.fetch(table, keys))

    @staticmethod
    def refresh_table(table: LoadedTable) -> None:
        """Re-read every row the caches of `table` hold from the tiers."""
        for gpu in _distinct(table.gpu.values()):
            gpu.refresh()

    @staticmethod
    def close(model: LoadedModel) -> None:
        """Stop the caches of `model` and free their device memory, with what CuPy's pools
        kept cached for them (the warm-up's chunks, pinned staging): without that a
        removed model's 2M-key cache left 510 of 1,142 MiB of device memory and 577 MiB
        of RSS in use (`python -m hps.tools.bench.model_memory`)."""
        caches = [gpu for table in model.tables for gpu in table.gpu.values()]
        for gpu in caches:
            gpu.close()
        if caches:
            import cupy  # there were caches: CuPy is installed

            # only free blocks go back: other models' arrays and work in flight keep theirs
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()


def _distinct(caches: Iterable[Any]) -> list[Any]:
    """The caches to write to: a sharded table's views (one per device) share one owner,
    which takes each write once."""
    seen: dict[int, Any] = {}
    for gpu in caches:
        owner = getattr(gpu, "owner", gpu)
        seen.setdefault(id(owner), owner)
    return list(seen.values())


def _release_pool(device: int) -> None:
    """Gives the device's free pool blocks back after a warm-up: its chunks' device copies
    (a static table warms up from the whole file at once) stayed in CuPy's pool, held
    from every other process (a sharded static table of 2M keys × 64 held 1,196 MiB of
    a device where its shard takes 663, by nvidia-smi)."""
    import cupy

    with cupy.cuda.Device(device):
        cupy.get_default_memory_pool().free_all_blocks()


def _fill_total(gpu: Any, cfg: ModelConfig, reader: Any) -> int:
    """Keys a cache filled from the files takes: the whole table (static, uvm), else at
    most its capacity."""
    if cfg.cache_type in ("static", "uvm"):
        return int(reader.num_keys)
    return min(int(reader.num_keys), int(gpu.stats().get("capacity", reader.num_keys)))


def _warm_chunk(gpu: Any, pct: float, reader: Any) -> int:
    """Keys per warm-up chunk: `pct` of the cache's capacity, or the whole table."""
    capacity = int(gpu.stats().get("capacity", reader.num_keys))
    return max(1, int(min(pct, 1.0) * capacity)) if pct > 0 else reader.num_keys
