"""The online updates of one server: its consumer, wired to the models it serves.

`ServerUpdates` follows the topics of the served models (`hps_et.<model>.<table>`), so a
model is read from the moment it is served; resolves each topic to the served version of
the table (its storage name and GPU caches); and, as the registry's `ReloadObserver`,
carries the updates that arrive during a reload over to the new version at the swap
(applier.py). Started with the server when `update_source.type` is not "null", stopped by
`close`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hps.config import PSConfig
from hps.server.gpu_caches import GpuCaches
from hps.server.models import LoadedModel, LoadedTable
from hps.server.registry import ModelRegistry, ReloadObserver
from hps.tiers import Tiers
from hps.tiers.contract import TABLE_PREFIX, table_name
from hps.updates.applier import UpdateApplier, UpdateTarget
from hps.updates.consumer import UpdateConsumer
from hps.updates.open import open_source
from hps.updates.stats import UpdateStats


class ServerUpdates(ReloadObserver):
    """The update consumer of a server and what it writes to."""

    def __init__(self, config: PSConfig, tiers: Tiers, registry: ModelRegistry,
                 gpu: GpuCaches) -> None:
        updates = config.update_source
        self.registry = registry
        self.gpu = gpu
        source = open_source(updates)
        if not _tiers_keep_updates(config, tiers):
            source.rewind()  # nothing kept the rows of earlier runs: the log has them
        self.stats = UpdateStats(source.name)
        key_bytes = updates.key_bytes or (8 if config.supportlonglong else 4)
        self.applier = UpdateApplier(
            tiers, self.resolve, self.serves, self.stats, key_bytes=key_bytes,
            uint32_keys=not config.supportlonglong, gpu_cache_insert=updates.gpu_cache_insert,
            volatile_filters=config.volatile_db.update_filters,
            persistent_filters=config.persistent_db.update_filters)
        self.consumer = UpdateConsumer(source, self.applier, updates, self.stats,
                                       self.followed)
        registry.observer = self

    def start(self) -> None:
        self.consumer.start()

    def close(self) -> None:
        self.consumer.close()
        self.registry.observer = ReloadObserver()

    def status(self) -> dict[str, Any]:
        """The source's state, rate, and per-table counters and lag."""
        return self.stats.as_dict()

    # -- what the consumer reads and writes -----------------------------------------------

    def followed(self) -> dict[str, list[str]]:
        """The served models and their table names."""
        return {name: [t.name for t in loaded.tables]
                for name, loaded in self.registry.models.items()}

    def serves(self, topic: str) -> bool:
        """Whether the model of `topic` (hps_et.<model>.<table>) is served now."""
        return _model_of(topic) in self.registry.models

    def resolve(self, topic: str) -> UpdateTarget | None:
        """The served table `topic` (hps_et.<model>.<table>) names, None if none."""
        model = _model_of(topic)
        table = topic[len(f"{TABLE_PREFIX}.{model}."):]
        loaded = self.registry.models.get(model) if model is not None else None
        if loaded is None:
            return None
        for t in loaded.tables:
            if t.name == table:
                return self._target(loaded, t)
        return None

    def _target(self, loaded: LoadedModel, table: LoadedTable) -> UpdateTarget:
        model = loaded.config.model
        return UpdateTarget(model, table.name, table_name(model, table.name),
                            table.storage_name, table.dim, self.gpu.writer(model, table),
                            table.storage)

    # -- reloads (ReloadObserver) ---------------------------------------------------------

    def reload_started(self, model: str) -> None:
        self.applier.begin_reload(model)

    def reload_failed(self, model: str) -> None:
        self.applier.end_reload(model)

    def swap(self, old: LoadedModel, new: LoadedModel, install: Callable[[], None]) -> None:
        self.applier.swap(old.config.model,
                          {t.name: self._target(old, t) for t in old.tables},
                          {t.name: self._target(new, t) for t in new.tables}, install)


def _model_of(topic: str) -> str | None:
    """The model of a topic `hps_et.<model>.<table>` (model names hold no "."), None for
    another name."""
    prefix, _, rest = topic.partition(".")
    model, dot, _ = rest.partition(".")
    return model if prefix == TABLE_PREFIX and dot else None


def _tiers_keep_updates(config: PSConfig, tiers: Tiers) -> bool:
    """Whether rows updated before a restart are still in the tiers after it: a
    writable persistent tier (RocksDB) or a Redis volatile tier outlives the process."""
    persistent = tiers.persistent is not None and not tiers.persistent.read_only
    return persistent or (tiers.volatile is not None and config.volatile_db.is_redis)
