"""The tables `hps plan` plans for: their sizes and what their config says about them.

A `TableShape` is one table as the planner needs it: keys and width, and the settings
that size its tiers (gpucacheper, cache type, storage type, lookup size, devices, the
volatile tier's partitions, overflow policy and share). Two sources:

- `shapes_from_config(config, sizes)`: every table of every model of a ps.json / YAML;
  its key count from its files (the reader contract's header read: no rows are read), or
  from `sizes`, a `TableSize` per table given on the command line instead;
- `shapes_from_sizes(sizes)`: tables given on the command line alone, with the settings a
  ps.json gets by default.

A table is named `table` or `model/table`; a size or a key log naming no planned table (or
more than one) is a ConfigError that lists the tables there are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hps.errors import ConfigError

if TYPE_CHECKING:
    from hps.config import ModelConfig, PSConfig


@dataclass(frozen=True)
class TableSize:
    """A table's size given on the command line (`NAME:ROWS:DIM`)."""

    name: str
    num_keys: int
    dim: int


@dataclass(frozen=True)
class TableShape:
    """One table as the planner sizes it (defaults: what a ps.json gets by default)."""

    model: str
    table: str
    num_keys: int
    dim: int
    gpucacheper: float = 0.2
    cache_type: str = "dynamic"
    storage: str = "float32"
    lookup_keys: int = 64  # keys of the largest lookup: max_batch_size × maxnum_catfeature…
    devices: int = 1
    gpu_memory_budget_mb: float | None = None
    volatile_type: str = "hash_map"
    num_partitions: int = 16
    overflow_policy: str = "evict_random"
    volatile_keys: int = -1  # keys the volatile tier holds (-1: every key)
    persistent: bool = False
    shards: int = 1  # gpu_sharding row_wise: the table's GPU shards over its devices
    hot_rows: int = 0  # keys of each device's hot copy (gpu_hot_rows: a sharded static table)
    gpucache: bool = True  # the model's `gpucache`: False serves it from the host tiers alone

    @property
    def shards_per_device(self) -> int:
        """Shards on the device holding the most of them (shard s on device s % devices)."""
        return -(-self.shards // max(1, self.devices))

    @property
    def label(self) -> str:
        return f"{self.model}/{self.table}" if self.model else self.table

    @property
    def held_by_volatile(self) -> int:
        return self.num_keys if self.volatile_keys < 0 else self.volatile_keys

    def answers_to(self, name: str) -> bool:
        return name in (self.table, self.label)


def shapes_from_sizes(sizes: Sequence[TableSize]) -> list[TableShape]:
    """The command line's tables, with a ps.json's default settings."""
    names = [s.name for s in sizes]
    if len(set(names)) != len(names):
        raise ConfigError(f"--table names a table twice: {names}")
    return [TableShape("", s.name, s.num_keys, s.dim) for s in sizes]


def shapes_from_config(config: PSConfig, sizes: Sequence[TableSize] = (),
                       model: str | None = None) -> list[TableShape]:
    """Every table of the config's models (of `model` alone when given), sized by
    `sizes` where one names it, else from its files. Raises ConfigError for a size or
    model naming nothing, or a size whose width is not the config's; the readers' own
    errors (SourceError, ModelFileError) for files that cannot be read."""
    models = [m for m in config.models if model is None or m.model == model]
    if not models:
        raise ConfigError(f"no model {model!r} in the config (it has "
                          f"{', '.join(m.model for m in config.models)})")
    tables = [(m, i) for m in models for i in range(m.num_tables)]
    unsized = [_shape(config, m, i, 0) for m, i in tables]
    given: dict[int, int] = {}
    for size in sizes:
        j = find_table(unsized, size.name, "--table")
        if size.dim != unsized[j].dim:
            raise ConfigError(f"--table {size.name}: width {size.dim}, but the config "
                              f"says {unsized[j].dim}")
        given[j] = size.num_keys
    return [_shape(config, m, i, given[j] if j in given else _file_keys(config, m, i))
            for j, (m, i) in enumerate(tables)]


def find_table(shapes: Sequence[TableShape], name: str, option: str) -> int:
    """The index of the one table of `shapes` that answers to `name`; ConfigError else."""
    found = [i for i, s in enumerate(shapes) if s.answers_to(name)]
    if len(found) == 1:
        return found[0]
    known = ", ".join(s.label for s in shapes)
    what = "names more than one table: use MODEL/TABLE" if found else "names no table"
    raise ConfigError(f"{option} {name!r} {what} (tables: {known})")


def _shape(config: PSConfig, model: ModelConfig, i: int, num_keys: int) -> TableShape:
    from hps.gpu.hot_rows import HOT_ROWS

    volatile = config.volatile_db
    persistent = config.persistent_db.enabled
    return TableShape(
        model=model.model, table=model.embedding_table_names[i], num_keys=num_keys,
        dim=model.embedding_vecsize_per_table[i], gpucacheper=model.gpucacheper,
        cache_type=model.cache_type, storage=model.embedding_storage_dtype,
        lookup_keys=model.max_batch_size * model.maxnum_catfeature_query_per_table_per_sample[i],
        devices=max(1, len(model.deployed_device_list)),
        gpu_memory_budget_mb=model.gpu_memory_budget_mb, volatile_type=volatile.type,
        num_partitions=volatile.num_partitions, overflow_policy=volatile.overflow_policy,
        volatile_keys=volatile_keys(num_keys, volatile.initial_cache_rate, persistent,
                                    volatile.overflow_margin, volatile.num_partitions),
        persistent=persistent,
        shards=(model.gpu_shards or len(model.deployed_device_list)
                if model.gpu_sharding == "row_wise" else 1),
        hot_rows=(HOT_ROWS if model.gpu_hot_rows is None else model.gpu_hot_rows)
        if model.gpu_sharding == "row_wise" else 0,
        gpucache=model.gpucache,
    )


def _file_keys(config: PSConfig, model: ModelConfig, i: int) -> int:
    """The key count of table `i` of `model`, from its files' headers."""
    from hps.server.loader import open_reader

    reader = open_reader(config, model, i)
    try:
        return int(reader.num_keys)
    finally:
        reader.close()


def volatile_keys(num_keys: int, rate: float, persistent: bool, margin: int,
                  partitions: int) -> int:
    """Keys the volatile tier holds of a table of `num_keys`: all of them without a
    persistent tier, else the initial_cache_rate share a load writes (server/loader.py),
    at most overflow_margin × num_partitions."""
    held = num_keys if not persistent or rate >= 1.0 else math.ceil(num_keys * rate)
    return int(min(held, margin * partitions))
