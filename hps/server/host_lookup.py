"""The host half of the lookup path: volatile tier → persistent tier → default value.

Lookups of tables without a GPU cache take this path whole; a GPU cache takes it for the
keys it missed, through a `TableFetch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.errors import TableUnreadableError, TierError
from hps.rows.storage_types import narrow
from hps.server.models import LoadedTable
from hps.tiers import Tiers


class HostLookup:
    """Vectors of host keys from the tiers, counted in each table's `TableStats`.

    Never fails on a volatile tier outage: its keys fall through to the persistent tier
    and the failure is counted (`TableStats.tier_failures`). Tables a load left out of
    the volatile tier (`volatile_ready` False) skip it until they are filled. With
    `cache_missed_embeddings`, vectors found only in the persistent tier are written to
    the volatile tier in the background. Every lookup's keys found in no tier feed the
    table's missing-key sketch, and every `hot_key_sampling`-th lookup's keys its hot-key
    sketch (`LoadedTable.keys_seen`; hps/server/key_sketch.py says what that costs).

    Outputs are float32, or the 16-bit type of a table stored as float16 / bfloat16
    (float16, uint16 bits; hps/intake/keys.py decides which are accepted): a volatile tier that
    stores the table compact writes its rows into those as they are, without widening;
    rows of float32 tiers and default values are rounded to it as the storage rounds.
    """

    def __init__(self, tiers: Tiers, *, cache_missed_embeddings: bool) -> None:
        self.tiers = tiers
        self.cache_missed = cache_missed_embeddings and tiers.volatile is not None

    def fetch(self, table: LoadedTable, keys: np.ndarray, dtype: Any = np.float32
              ) -> np.ndarray:
        """Vectors of `keys` (host int64[n]) as a new [n, table.dim] array of `dtype`
        (float32, or the table's 16-bit output type: see the class docstring)."""
        vectors = np.empty((keys.size, table.dim), dtype=dtype)
        self.fetch_into(table, keys, vectors)
        return vectors

    def fetch_into(self, table: LoadedTable, keys: np.ndarray, out: np.ndarray) -> None:
        """Vectors of `keys` (host int64[n]) written into `out` ([n, table.dim],
        C-contiguous: the GPU path passes its pinned staging buffer; float32, or the
        table's 16-bit output type)."""
        volatile = self.tiers.volatile
        if out.dtype != _FLOAT32 and not (volatile is not None and volatile.compact_storage):
            # no tier holds 16-bit rows: the lookup in float32, rounded once at the end
            out[:] = narrow(table.storage, self.fetch(table, keys))
            return
        n = keys.size
        name = table.storage_name
        persistent = self.tiers.persistent
        found: np.ndarray | None = None
        if volatile is not None and n and table.volatile_ready:
            try:
                found = volatile.fetch_into(name, keys, out)
            except TierError as exc:  # down, or its data unreadable: the next tier answers
                if persistent is None and isinstance(exc, TableUnreadableError):
                    raise  # no tier below holds its rows: defaults would be wrong answers
                table.stats.add_tier_failure()
        if found is None:
            found = np.zeros(n, dtype=bool)
        volatile_hits = int(np.count_nonzero(found))
        if volatile_hits == n:  # the common case: the volatile tier held every key
            if not table.stats.add(n, n, 0, 0) & table.hot_mask:
                table.keys_seen.hot.feed(keys)
            return
        persistent_hits = 0
        if volatile_hits < n and persistent is not None:
            missing = np.flatnonzero(~found)
            unique, inverse = np.unique(keys[missing], return_inverse=True)
            rows, present = persistent.fetch(name, unique)
            out[missing] = _as_output(table, rows[inverse], out)
            found[missing] = present[inverse]
            persistent_hits = int(np.count_nonzero(present[inverse]))
            if self.cache_missed and table.volatile_ready:
                self._cache_missed(name, unique[present], rows[present])
        defaults = n - volatile_hits - persistent_hits
        if defaults:
            absent = ~found
            out[absent] = _as_output(table, np.full((1, table.dim), table.default_value,
                                                    np.float32), out)
            table.keys_seen.missing.feed(keys[absent])
        if not table.stats.add(n, volatile_hits, persistent_hits, defaults) & table.hot_mask:
            table.keys_seen.hot.feed(keys)

    def for_table(self, table: LoadedTable) -> TableFetch:
        """This path for one table, as a GPU cache calls it for its misses."""
        return TableFetch(self, table)

    def _cache_missed(self, name: str, keys: np.ndarray, rows: np.ndarray) -> None:
        if not keys.size:
            return
        try:
            self.tiers.volatile.insert_async(name, keys, rows)  # type: ignore[union-attr]
        except TierError:
            pass  # the next lookup of these keys reaches the persistent tier again


_FLOAT32 = np.dtype(np.float32)


def _as_output(table: LoadedTable, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float32 `rows` in the dtype of `out` (float32, or the table's 16-bit type)."""
    return rows if out.dtype == _FLOAT32 else narrow(table.storage, rows)


@dataclass(frozen=True)
class TableFetch:
    """The host lookup path of one table: `fetch(keys) -> vectors`, for a GPU cache's
    misses (host int64[n] in, float32 [n, dim] out)."""

    host: HostLookup
    table: LoadedTable

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        return self.host.fetch(self.table, keys)

    def into(self, keys: np.ndarray, out: np.ndarray) -> None:
        """The vectors of `keys` written into `out` (float32 [n, dim]) in place."""
        self.host.fetch_into(self.table, keys, out)
