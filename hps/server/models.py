"""A loaded model and its tables, as the lookup path sees them, with their counters and
their key sketches (hps/server/key_sketch.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hps.config import ModelConfig
from hps.errors import BatchTooLargeError, UnknownTableError
from hps.gate.verdict import PassedVersion
from hps.gpu.key_sample import KeySampler
from hps.intake.array_ref import ArrayRef
from hps.intake.keys import key_array, key_ref
from hps.rows.gpu_layout import narrow_output_code
from hps.rows.storage_types import FLOAT32, StorageType
from hps.server.key_sketch import HOT_EVERY, HOT_EVERY_GPU, HOT_MOST, HOT_MOST_COPIES, TableKeys
from hps.server.loader import TableSource
from hps.server.versions import VersionRefs


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

    def add(self, keys: int, volatile: int, persistent: int, defaults: int) -> int:
        """Count one lookup; returns its number (1, 2, ...), which decides whether the
        lookup feeds the table's hot-key sketch (hps/server/key_sketch.py)."""
        with self.lock:
            self.lookups += 1
            self.keys += keys
            self.volatile_hits += volatile
            self.persistent_hits += persistent
            self.defaults += defaults
            return self.lookups

    def add_tier_failure(self) -> None:
        """Count a lookup that fell through a volatile tier that could not answer."""
        with self.lock:
            self.tier_failures += 1

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
    #: the sketches of its hot keys and of the keys no tier holds
    keys_seen: TableKeys = field(default_factory=TableKeys, repr=False)
    #: a lookup whose number (TableStats.add) has none of these bits set feeds the hot
    #: sketch: every Nth lookup for N a power of two; -1 (never) when sampling is off
    hot_mask: int = HOT_EVERY - 1
    gpu: dict[int, Any] = field(default_factory=dict)  # device id → GpuEmbeddingTable
    #: samples the keys of the GPU lookups for the hot sketch (hps/gpu/key_sample.py),
    #: None without a GPU cache or with the sampling off
    hot_sample: KeySampler | None = field(default=None, repr=False)
    #: lookups read the volatile tier for this table; False while a load left it out
    #: (Redis down, full or read-only then) until the background fill is done
    volatile_ready: bool = True
    #: which path answers its lookups with host keys (HTTP, gRPC): hps/server/http_path.py
    #: HttpPath, decided by the warm-up before the version serves (None: not yet)
    http_path: Any = field(default=None, repr=False)
    #: the model's embedding_storage_dtype: how the hash map and GPU tables store rows,
    #: and which output dtypes a lookup accepts (hps/rows/storage_types.py)
    storage: StorageType = FLOAT32
    #: the output type of the storage's own 16-bit outputs (row_format.narrow_output_code),
    #: read once here for the lookup path's common case
    narrow_output_type: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.narrow_output_type = narrow_output_code(self.storage)

    def sample_hot_keys(self, every: int | None) -> None:
        """Feed the hot-key sketch every `every`-th lookup (a power of two; 0: never; None:
        HOT_EVERY, or HOT_EVERY_GPU with GPU caches), afresh; the missing-key sketch is
        kept. A table with GPU caches (attached first) is sampled on the device, and the
        keys its caches miss, which take the host path, do not feed the hot sketch again."""
        if every is None:
            every = HOT_EVERY_GPU if self.gpu else HOT_EVERY
        seen = self.keys_seen
        on_gpu = bool(self.gpu) and every > 0
        self.keys_seen = TableKeys(every, seen.missing, "gpu_lookups" if on_gpu else seen.source)
        self.hot_mask = every - 1 if every and not self.gpu else -1
        self.hot_sample = None
        if on_gpu:
            hot = self.keys_seen.hot
            # a table whose hot copies fill from the sketch (hps/server/hot_fill.py) takes
            # more keys of each sampled call: its copies want its heaviest thousands
            copies = any(getattr(getattr(g, "owner", None), "hot", None)
                         for g in self.gpu.values())
            self.hot_sample = KeySampler(hot.feed_sample, every,
                                         HOT_MOST_COPIES if copies else HOT_MOST, self.gpu)
            hot.pending = self.hot_sample.drain

    def checked_ref(self, keys: Any) -> ArrayRef:
        """Where `keys` are (hps/intake/keys.py `key_ref`), checked to be integers and at most
        `max_keys` of them. Raises KeyTypeError or BatchTooLargeError."""
        ref = key_ref(keys)
        if ref.size > self.max_keys:
            raise BatchTooLargeError(
                f"{ref.size} keys exceed the limit of {self.max_keys} for table "
                f"{self.name!r} (max_batch_size × maxnum_catfeature_query_per_table_per_sample)"
            )
        return ref

    def checked_keys(self, keys: Any) -> Any:
        """`keys` as a 1-D int64 view (host or device, see `keys.as_key_array`), checked as
        by checked_ref."""
        return key_array(self.checked_ref(keys))


@dataclass(eq=False)
class LoadedModel:
    """One version of a served model: its config, its tables, and the lookups holding it
    (`refs`: its tables are dropped only when the last one is done)."""

    config: ModelConfig
    tables: list[LoadedTable]
    refs: VersionRefs = field(default_factory=VersionRefs, repr=False)
    #: the allowed roots its local files were opened beneath (a request named them:
    #: hps.modelfiles.confined); None for the config's own, trusted files. Whatever reads
    #: the same files again (a plain reload, a refill of the volatile tier) reads them
    #: beneath these roots too.
    roots: tuple[str, ...] | None = None
    #: table name → the rows digest of the version this one replaced (hps/gate/digest.py)
    #: and the opt-ins its pass rested on: a reload of those rows is a rollback, which
    #: the load gate lets in as they passed (with those opt-ins given again)
    previous_versions: dict[str, PassedVersion] = field(default_factory=dict)

    def table(self, table: int | str) -> LoadedTable:
        """A table by index, by name, or by its index written in ASCII digits ("0");
        raises UnknownTableError otherwise."""
        if type(table) is int and 0 <= table < len(self.tables):  # the lookup path's case
            return self.tables[table]
        if isinstance(table, (int, np.integer)) and not isinstance(table, bool):
            if 0 <= table < len(self.tables):
                return self.tables[int(table)]
        elif isinstance(table, str):
            for t in self.tables:
                if t.name == table:
                    return t
            # ASCII digits only: '²' is a digit to str.isdigit and '١' an int to int()
            if table.isascii() and table.isdigit() and int(table) < len(self.tables):
                return self.tables[int(table)]
        names = ", ".join(f"{t.index}={t.name}" for t in self.tables)
        raise UnknownTableError(
            f"model {self.config.model!r} has no table {table!r} (tables: {names})"
        )
