"""The bulk-load contract: what a tier that takes whole tables offers on top of `Tier`.

A model load writes each table whole, once, and keeps a record of what it wrote; that is
a different job from serving a lookup or an online update (`hps.tiers.contract.Tier`),
and it has its own contract here. Every tier a config opens keeps it (`hps.tiers.open`):
the loader (`hps.server.loader`) writes through it, online updates hand RocksDB a large
round through `load`.

The methods below are the general path: a load is inserts chunk by chunk, any key order
is as good as another, no record is kept. A tier with a faster way overrides them and
says so in its docstring: RocksDB writes sorted table files and ingests them (`load`,
`load_ordered`, `load_sorted` in its `bulk_order`) and keeps load records; the in-process
hash map allocates a load's rows once (`reserve`) and hands a table it holds whole back
where its rows lie (`sorted_rows`, where `can_export`), so the persistent tier is filled
from it without a second sort.

Thread safety: as `Tier`, every method may be called from several threads at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from hps.tiers.contract import Tier

#: bytes of rows the default `load_sorted` gathers at once
LOAD_SORTED_BYTES = 64 << 20


class BulkLoadTier(Tier):
    """A tier that takes whole tables: loads, their order, their records, and export."""

    #: whether `export` and `sorted_rows` list every row the tier was given (it keeps them
    #: in process and never evicts): a load can then read a table back instead of
    #: sorting a copy
    can_export: bool = False
    #: whether `scan` reads every row the tier holds of a table back in bulk (RocksDB)
    can_scan: bool = False

    # -- loading ------------------------------------------------------------------------

    def loaded_elsewhere(self, table: str) -> bool:
        """Whether another process already wrote `table`'s rows into this tier (a table
        in shared memory that this process maps): a load then skips writing them. Here:
        never."""
        return False

    def reserve(self, table: str, num_keys: int) -> None:  # noqa: B027 - a hint
        """Prepare for a load of about `num_keys` keys in all into `table`; a hint (an
        in-process tier allocates once, RocksDB sizes its sort). Here: nothing."""

    def load(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Bulk-insert a whole table from `(keys int64[n], vectors float32[n, dim])`
        chunks in any order; of a key given more than once the last row is kept.

        Returns the keys read (repeats included). Here: one `insert` per chunk.
        """
        total = 0
        for keys, vectors in chunks:
            self.insert(table, keys, vectors)
            total += len(keys)
        return total

    def bulk_order(self, keys: np.ndarray) -> np.ndarray | None:
        """The permutation of `keys` (int64[n]) in which `load_ordered` takes rows
        fastest, or None when any order is as good (here)."""
        return None

    def bulk_sorted(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`(keys in bulk_order, that permutation)` of `keys` (int64[n]), or None when any
        order is as good; tiers with a faster way to both than a gather after the sort
        override this. Here: from `bulk_order`."""
        order = self.bulk_order(keys)
        return None if order is None else (keys[order], order)

    def load_ordered(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]
                     ) -> int:
        """`load` of distinct keys that come in `bulk_order`, chunk after chunk; tiers
        that sort for a bulk load skip the sort. Returns the keys written. Here: `load`."""
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

    # -- reading a table back -----------------------------------------------------------

    def sorted_rows(self, table: str,
                    order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray] | None]
                    ) -> AbstractContextManager[tuple[np.ndarray, np.ndarray,
                                                      np.ndarray | None]]:
        """Every row of `table`, in place: a context that gives `(keys, rows, positions)`
        with `order(keys) -> (ordered keys, permutation)` (a tier's `bulk_sorted`)
        applied, the row of `keys[i]` at `rows[positions[i]]` (`positions` None: rows in
        key order), for `load_sorted`. No row is copied: the table takes no writes until
        the context ends. Only where `can_export`, for float32 rows; here: raises
        NotImplementedError."""
        raise NotImplementedError(f"the {self.name} tier cannot export a table")

    def export(self, table: str, order: Callable[[np.ndarray], np.ndarray | None],
               chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row of `table` as `(keys, vectors)` chunks of at most `chunk_rows`, in
        the order `order(keys)` gives (any order for None). Only where `can_export`;
        here: raises NotImplementedError."""
        raise NotImplementedError(f"the {self.name} tier cannot export a table")

    def scan(self, table: str, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row of `table` as `(keys, vectors)` chunks of at most `chunk_rows`, in
        the tier's own order, from one snapshot. Only where `can_scan`; here: raises
        NotImplementedError."""
        raise NotImplementedError(f"the {self.name} tier cannot scan a table")

    # -- the load record ----------------------------------------------------------------

    def stored_version(self, table: str) -> str:
        """A mark of what the tier holds of `table` now that any write to it changes
        (RocksDB: its table files); a load records it, so a restart can tell whether
        the table still holds exactly the rows it loaded. "" when the tier cannot tell
        (here: always); "" never equals a recorded mark."""
        return ""

    def note_changes(self, table: str) -> str:
        """From now on, note the keys every write to `table` writes or removes (`changes`),
        forgetting those noted before; called right after a load wrote the table, whose
        record keeps the token returned (it names this load). "" when the tier notes
        nothing (here)."""
        return ""

    def changes(self, table: str, token: str, most: int) -> np.ndarray | None:
        """The keys (int64, distinct) written or removed in `table` since the load that
        `token` names, None when the tier cannot tell (it noted none, or the table took
        writes it did not note) or they are more than `most`. Here: None."""
        return None

    def metadata(self, table: str) -> dict[str, Any] | None:
        """The load record stored with `table` (source, fingerprint), None if none (a
        dropped table has none). Here: None, always."""
        return None

    def set_metadata(self, table: str, record: dict[str, Any]) -> None:  # noqa: B027
        """Store `record` (a small JSON-serializable dict) as the load record of `table`;
        tiers that cannot keep one ignore it (here)."""
