"""The serving contract every database tier keeps (volatile and persistent alike).

A tier stores tables of fixed-width float32 vectors by int64 key. Tables are named
`hps_et.<model>.<table>` (see `table_name`). `Tier` is what a lookup and an online update
need: tables made and dropped, rows fetched, inserted and removed, health for metrics.
Loading whole tables is a second contract, `hps.tiers.bulk_load.BulkLoadTier`, that the
tiers taking model loads keep on top of this one.

Every method takes and returns whole arrays: no tier ever sees a per-key Python object,
and the server knows tiers only through these two classes. Capabilities are class
attributes (`in_process`, `read_only`, `compact_storage`), declared, never probed.

Thread safety: every method may be called from several threads at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import LookupInputError, UnknownTableError

if TYPE_CHECKING:
    from hps.rows.storage_types import StorageType

TABLE_PREFIX = "hps_et"


def table_name(model: str, table: str) -> str:
    """Storage name of a table, as HugeCTR named it: `hps_et.<model>.<table>`."""
    return f"{TABLE_PREFIX}.{model}.{table}"


_INT64 = np.dtype(np.int64)


def as_keys(keys: np.ndarray) -> np.ndarray:
    """View 1-D keys as contiguous int64 (the tiers' only key type)."""
    # Shortcut: a C-contiguous 1-D int64 ndarray, what the lookup path hands over, is
    # taken as it is, skipping ascontiguousarray + reshape (0.38 µs a call against 0.88).
    if (type(keys) is np.ndarray and keys.dtype is _INT64 and keys.ndim == 1
            and keys.flags.c_contiguous):
        return keys
    return np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)


def as_vectors(vectors: np.ndarray, dim: int) -> np.ndarray:
    """View vectors as contiguous float32 rows of width `dim`."""
    return np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, dim)


def as_rows(keys: np.ndarray, vectors: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and vectors of an insert as int64[n] and float32[n, dim].

    Raises LookupInputError when the vectors do not hold n × dim values.
    """
    k = as_keys(keys)
    v = np.asarray(vectors, dtype=np.float32)
    if v.size != k.size * dim:
        raise LookupInputError(
            f"{k.size} keys need {k.size} × {dim} float32 values, got array of shape {v.shape}"
        )
    return k, as_vectors(v, dim)


class Tier(ABC):
    """One database tier: a set of named tables of float32 rows keyed by int64."""

    #: short name used in logs and metric labels ("hash_map", "redis", "rocksdb")
    name: str = "tier"
    #: a read-only tier serves what it holds; loads and drops leave it alone
    read_only: bool = False
    #: the tier keeps its rows in this process's memory (a load checks it has room)
    in_process: bool = False
    #: the tier stores a table's rows in the storage type `create_table` names (float16,
    #: bfloat16, int8: hps/rows/storage_types.py); else float32 whatever it is told (Redis,
    #: RocksDB: HugeCTR's layout, so stores shared between servers stay compatible)
    compact_storage: bool = False

    def __init__(self) -> None:
        self._dims: dict[str, int] = {}

    # -- tables -------------------------------------------------------------------------

    def create_table(self, table: str, dim: int, storage: StorageType | str = "float32"
                     ) -> None:
        """Make `table` known with rows of width `dim`; keeps existing contents.

        `storage` is the model's `embedding_storage_dtype`: tiers with `compact_storage`
        keep the rows in it; the others keep float32 rows. Either way rows go in and come
        out of every method as float32.
        """
        self._dims[table] = int(dim)

    def dim(self, table: str) -> int:
        """Row width of `table`; raises UnknownTableError if it was never created."""
        try:
            return self._dims[table]
        except KeyError:
            raise UnknownTableError(f"{self.name} tier has no table {table!r}") from None

    def tables(self) -> list[str]:
        """Names of the tables this tier was told about, sorted."""
        return sorted(self._dims)

    def drop_table(self, table: str) -> None:
        """Forget `table` and delete its contents."""
        self._dims.pop(table, None)

    def clear_table(self, table: str, dim: int, storage: StorageType | str = "float32"
                    ) -> None:
        """Delete `table`'s rows and keep it, with rows of width `dim`: the start of a fill
        that writes it anew. This default drops and creates it; a tier that other
        processes read (Redis) keeps it known throughout instead, since under `hps serve
        --workers N` its drops of a served table wait until every worker moved on
        (hps/http/workers_drops.py), and a writer in between would find no table."""
        self.drop_table(table)
        self.create_table(table, dim, storage)

    # -- data ---------------------------------------------------------------------------

    @abstractmethod
    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Look up `keys` (int64[n]).

        Returns `(vectors, found)`: float32[n, dim] and bool[n]. Rows of keys not found
        are left zero; callers fill them from the next tier or the default value.
        Duplicate keys are answered alike. Raises UnknownTableError for a table never
        created, TierUnavailableError when a network tier cannot answer.
        """

    def fetch_into(self, table: str, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Look up `keys` (int64[n]) writing the vectors into `out` (float32[n, dim],
        C-contiguous, writable: e.g. the GPU path's pinned staging buffer); rows of keys
        not found become zeros. Returns found (bool[n]). Tiers that can write in place
        override this; here: fetch, then copy.
        """
        vectors, found = self.fetch(table, keys)
        out[:] = vectors
        return found

    @abstractmethod
    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Insert or overwrite the rows of `keys` (int64[n]) with `vectors`
        (float32[n, dim]); the last of duplicate keys wins; a tier with an overflow margin
        prunes after. Raises LookupInputError, writing nothing, when `vectors` does not
        hold n × dim values."""

    def insert_within_capacity(self, table: str, keys: np.ndarray, vectors: np.ndarray
                               ) -> np.ndarray | None:
        """`insert`, for a tier whose capacity is fixed (a shared hash map table once the
        workers map it): past it, the rows of keys it holds are still written and every
        row of a key it lacks is left out. Returns which rows were left out, None when
        every row was written. Here: a plain insert."""
        self.insert(table, keys, vectors)
        return None

    def insert_async(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> bool:
        """`insert` without making the caller wait where the tier can (network tiers
        queue the write from a copy of `vectors`). Returns False when the write was
        dropped. Here: a plain insert."""
        self.insert(table, keys, vectors)
        return True

    @abstractmethod
    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys` (int64[n]); returns how many distinct keys were present."""

    @abstractmethod
    def size(self, table: str) -> int:
        """Number of keys `table` holds now."""

    # -- resources and health -----------------------------------------------------------

    def trim(self) -> None:  # noqa: B027 - optional: most tiers keep nothing for reuse
        """Give back memory kept between writes for the next one (called when writes
        pause, e.g. online updates idle). Here: nothing."""

    def memory_bytes(self, table: str) -> int:
        """Bytes of process memory `table` takes here (0 for out-of-process tiers)."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Health and counters of the tier, for metrics; cheap, no I/O, never raises.

        Every tier answers at least:
        - `available` (bool): whether the tier answers calls now;
        - `failures` ({kind: count}): calls that failed, by kind of failure
          ("connection", "timeout", ...; a tier that cannot fail reports none);
        - `dropped` ({kind: keys}): keys of writes the tier dropped instead of making;
        and may add figures of its own (`tables`, `keys`, `memory_bytes`, ...): every
        number among them is exported as a metric. Here: an in-process tier, always up.
        """
        return {"available": True, "failures": {}, "dropped": {}, "tables": len(self._dims)}

    def close(self) -> None:  # noqa: B027 - optional: in-process tiers hold nothing to release
        """Release connections, files and memory. Further calls are undefined."""
