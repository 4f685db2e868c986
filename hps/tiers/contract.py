"""The contract every database tier keeps (volatile and persistent alike).

A tier stores tables of fixed-width float32 vectors by int64 key. Tables are named
`hps_et.<model>.<table>` (see `table_name`). Every method takes and returns whole arrays:
no tier ever sees a per-key Python object, and the server knows tiers only through this
class.

Thread safety: every method may be called from several threads at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import LookupInputError, UnknownTableError

if TYPE_CHECKING:
    from hps.rows.storage_types import StorageType

TABLE_PREFIX = "hps_et"


def table_name(model: str, table: str) -> str:
    """Storage name of a table, as HugeCTR named it: `hps_et.<model>.<table>`."""
    return f"{TABLE_PREFIX}.{model}.{table}"


def as_keys(keys: np.ndarray) -> np.ndarray:
    """View 1-D keys as contiguous int64 (the tiers' only key type)."""
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


#: bytes of rows the default `load_sorted` gathers at once
LOAD_SORTED_BYTES = 64 << 20


class Tier(ABC):
    """One database tier: a set of named tables of float32 rows keyed by int64."""

    #: short name used in logs and metric labels ("hash_map", "redis", "rocksdb")
    name: str = "tier"
    #: a read-only tier serves what it holds; loads and drops leave it alone
    read_only: bool = False
    #: the tier keeps its rows in this process's memory (a load checks it has room)
    in_process: bool = False

    def __init__(self) -> None:
        self._dims: dict[str, int] = {}

    # -- tables -------------------------------------------------------------------------

    #: the tier stores a table's rows in the storage type `create_table` names (float16,
    #: bfloat16, int8: hps/rows/storage_types.py); else float32 whatever it is told (Redis, RocksDB:
    #: HugeCTR's layout, so stores shared between servers stay compatible)
    compact_storage: bool = False

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
        """Names of the tables this tier was told about."""
        return sorted(self._dims)

    def drop_table(self, table: str) -> None:
        """Forget `table` and delete its contents."""
        self._dims.pop(table, None)

    # -- data ---------------------------------------------------------------------------

    @abstractmethod
    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Look up `keys` (int64[n]).

        Returns `(vectors, found)`: float32[n, dim] and bool[n]. Rows of keys not found
        are left zero; callers fill them from the next tier or the default value.
        Duplicate keys are answered alike. Raises TierUnavailableError when a network
        tier cannot answer.
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
        """Insert or overwrite rows; a tier with an overflow margin prunes after."""

    @abstractmethod
    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys`; returns how many were present."""

    @abstractmethod
    def size(self, table: str) -> int:
        """Number of keys `table` holds now."""

    def load(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Bulk-insert a whole table from `(keys, vectors)` chunks; returns keys written.

        Tiers with a faster bulk path (RocksDB SST ingestion) override this.
        """
        total = 0
        for keys, vectors in chunks:
            self.insert(table, keys, vectors)
            total += len(keys)
        return total

    def reserve(self, table: str, num_keys: int) -> None:  # noqa: B027 - a hint
        """Prepare for a load of about `num_keys` keys in all into `table`; a hint (an
        in-process tier allocates once, RocksDB sizes its sort). Here: nothing."""

    def bulk_order(self, keys: np.ndarray) -> np.ndarray | None:
        """The permutation of `keys` in which `load_ordered` takes rows fastest, or None
        when any order is as good (here)."""
        return None

    def bulk_sorted(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(`keys` in `bulk_order`, that permutation) or None when any order is as good;
        tiers with a faster way to both than a gather after the sort override this."""
        order = self.bulk_order(keys)
        return None if order is None else (keys[order], order)

    def load_ordered(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]
                     ) -> int:
        """`load` of distinct keys that come in `bulk_order`, chunk after chunk; tiers
        that sort for a bulk load skip the sort. Here: `load`."""
        return self.load(table, chunks)

    def load_sorted(self, table: str, keys: np.ndarray, rows: np.ndarray,
                    positions: np.ndarray | None) -> int:
        """Bulk-load a whole table given as arrays: distinct int64 `keys` in `bulk_order`,
        the float32 row of `keys[i]` at `rows[positions[i]]` (at `rows[i]` for None), as
        a tier that holds the table in process hands it over without copying its rows.
        Returns the keys written. Here: `load_ordered`, in chunks of LOAD_SORTED_BYTES."""
        step = max(1, LOAD_SORTED_BYTES // max(1, rows.itemsize * rows.shape[1]))

        def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for start in range(0, keys.size, step):  # a loop over chunks, not keys
                part = slice(start, start + step)
                yield keys[part], rows[part] if positions is None else rows[positions[part]]

        return self.load_ordered(table, chunks())

    #: whether `export` lists every row the tier was given (it keeps them in process
    #: and never evicts): a load can then read a table back instead of sorting a copy
    can_export: bool = False

    def sorted_rows(self, table: str,
                    order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray] | None]
                    ) -> AbstractContextManager[tuple[np.ndarray, np.ndarray,
                                                      np.ndarray | None]]:
        """Every row of `table`, in place: a context that gives `(keys, rows, positions)`
        with `order(keys) -> (ordered keys, permutation)` (a tier's `bulk_sorted`)
        applied, the row of `keys[i]` at `rows[positions[i]]` (`positions` None: rows in
        key order), for `load_sorted`. No row is copied: the table takes no writes until
        the context ends. Only where `can_export`, for float32 rows."""
        raise NotImplementedError(f"the {self.name} tier cannot export a table")

    def export(self, table: str, order: Callable[[np.ndarray], np.ndarray | None],
               chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row of `table` as `(keys, vectors)` chunks of at most `chunk_rows`, in
        the order `order(keys)` gives (any order for None). Only where `can_export`."""
        raise NotImplementedError(f"the {self.name} tier cannot export a table")

    def insert_async(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> bool:
        """Insert without making the caller wait where the tier can (network tiers queue
        the write); returns False when the write was dropped. Here: a plain insert."""
        self.insert(table, keys, vectors)
        return True

    def trim(self) -> None:  # noqa: B027 - optional: most tiers keep nothing for reuse
        """Give back memory kept between writes for the next one (called when writes
        pause, e.g. online updates idle). Here: nothing."""

    def metadata(self, table: str) -> dict[str, Any] | None:
        """The load record stored with `table` (source, fingerprint), None if none."""
        return None

    def set_metadata(self, table: str, record: dict[str, Any]) -> None:  # noqa: B027
        """Store a load record with `table`; tiers that cannot keep one ignore it."""

    def memory_bytes(self, table: str) -> int:
        """Bytes of process memory the table takes here (0 for out-of-process tiers)."""
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
