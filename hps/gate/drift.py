"""How far a new version of a table drifted from the one served: row norms and key churn.

Measured on a sample of the new version's keys (`key_set.sample_rows`: picked by a hash
of the key, about `drift_sample_keys` of them, while the files stream), against the
rows the served version holds for them, fetched in one batch (`ServedRows.fetch`):

- norms: mean, p50 and p99 of the L2 row norms of both versions on the sampled keys
  both hold; `norm_ratio` is the largest of the three ratios, new/old or old/new, so a
  blow-up and a collapse both count;
- churn: `keys_added` = the sampled keys the served version lacks (a share of the new
  version); `keys_removed` = the served keys the new version lacks, estimated as
  1 − shared / served keys with shared = (1 − keys_added) × the new version's keys;
  `key_churn` is the larger. With an empty side it is exact: 1.0 (every key removed,
  or every key added), never unmeasured.

The served version is whatever the caller hands in: a table in a tier (`TierRows`,
the server's reload) or another set of files (`FileRows`, `hps validate --against`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from hps.errors import TierError

#: added to both norms of a ratio, so that zero rows give a large finite figure
_TINY = 1e-12


class ServedRows(Protocol):
    """The version served now, as the drift reads it."""

    def count(self) -> int:
        """The distinct keys it holds (TierError when they cannot be counted now)."""

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [n, dim] rows, bool[n] found) of host int64 `keys`, in one batch."""


class TierRows:
    """A served table in the tiers, read as a lookup reads it: the volatile tier first
    (when it holds the table: `volatile` None otherwise), the persistent tier for the keys
    it lacks. The persistent tier's random reads cost about 0.1 ms a key on a freshly
    ingested table (10,000 keys: 0.95 s, measured on the 2-core build machine), the
    in-process hash map's a few nanoseconds: a reload over a whole volatile copy pays
    almost nothing for its drift."""

    def __init__(self, volatile: Any | None, persistent: Any | None, storage_name: str,
                 dim: int) -> None:
        self.volatile = volatile
        self.persistent = persistent
        self.storage_name = storage_name
        self.dim = dim

    def count(self) -> int:
        """The keys of the tier that holds the table whole (TierError)."""
        whole = self.persistent if self.persistent is not None else self.volatile
        return int(whole.size(self.storage_name))

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `keys` (TierError)."""
        rows, found = self._volatile_rows(keys)
        if self.persistent is not None and not found.all():
            rest = np.flatnonzero(~found)
            more, held = self.persistent.fetch(self.storage_name, keys[rest])
            rows[rest] = more
            found[rest] = held
        return rows, found

    def _volatile_rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What the volatile tier holds of `keys`: none without one, or while it is down
        and the persistent tier answers (as for a lookup)."""
        if self.volatile is not None:
            try:
                rows, found = self.volatile.fetch(self.storage_name, keys)
                return np.array(rows, dtype=np.float32), np.array(found, dtype=bool)
            except TierError:
                if self.persistent is None:
                    raise
        return (np.zeros((keys.size, self.dim), dtype=np.float32),
                np.zeros(keys.size, dtype=bool))


class FileRows:
    """A table's files as the served version: `fetch` streams them once, keeping the
    rows of the asked keys (the last row of a repeated key)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def count(self) -> int:
        """The rows the files hold (repeated keys counted each time)."""
        return int(self.reader.num_keys)

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(keys, kind="stable")
        wanted = keys[order]
        rows = np.zeros((keys.size, self.reader.vec_size), dtype=np.float32)
        found = np.zeros(keys.size, dtype=bool)
        for chunk_keys, chunk_rows in self.reader.chunks():
            at = np.clip(np.searchsorted(wanted, chunk_keys), 0, max(0, wanted.size - 1))
            hit = wanted.size > 0 and wanted[at] == chunk_keys
            if np.any(hit):
                where = order[at[hit]]
                rows[where] = chunk_rows[hit]
                found[where] = True
        return rows, found


def norm_figures(norms: np.ndarray) -> dict[str, float]:
    """mean, p50 and p99 of row norms (float64[n], n > 0)."""
    p50, p99 = np.percentile(norms, [50.0, 99.0])
    return {"mean": float(norms.mean()), "p50": float(p50), "p99": float(p99)}


def row_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norms (float64) of float32 rows [n, dim]."""
    return np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))


def measure(sample_keys: np.ndarray, sample_norms: np.ndarray, new_keys: int,
            served: ServedRows) -> dict[str, Any]:
    """The drift figures of the module docstring. `sample_keys` are distinct, with the
    new version's norms in `sample_norms`; `new_keys` is its distinct key count. Either
    side may be empty: the churn is then measured all the same (an empty new version
    removed every served key, an empty served one has every new key added); only the
    norms, which need keys both hold, stay None. A served version that cannot be read (a
    tier down) gives figures with a `note`."""
    out: dict[str, Any] = {"sample_keys": int(sample_keys.size), "shared_keys": 0,
                           "norm_new": None, "norm_old": None, "norm_ratio": None,
                           "keys_added": None, "keys_removed": None, "key_churn": None,
                           "served_keys": None}
    try:
        served_keys = served.count()
        old_rows, found = (served.fetch(sample_keys) if sample_keys.size else
                           (np.empty((0, 0), np.float32), np.zeros(0, dtype=bool)))
    except TierError as exc:
        out["note"] = f"the served version could not be read: {exc}"
        return out
    shared = int(np.count_nonzero(found))
    # no sample: the new version holds no key (or too few to sample any: none added seen)
    added = 1.0 - shared / sample_keys.size if sample_keys.size else 0.0
    held = (1.0 - added) * new_keys
    removed = max(0.0, served_keys - held) / served_keys if served_keys else 0.0
    out.update(shared_keys=shared, keys_added=added, keys_removed=removed,
               key_churn=max(added, removed), served_keys=served_keys)
    if not shared:
        out["note"] = ("no sampled key is held by both versions: the norms are not "
                       "compared" if new_keys and served_keys else
                       "the new version holds no keys" if not new_keys else
                       "the served version holds no keys")
        return out
    # rows with NaN or infinity (allowed by the config) have no norm to compare
    old_norms = row_norms(old_rows[found])
    usable = np.isfinite(sample_norms[found]) & np.isfinite(old_norms)
    if usable.any():
        new = norm_figures(sample_norms[found][usable])
        old = norm_figures(old_norms[usable])
        ratios = [(new[k] + _TINY) / (old[k] + _TINY) for k in new]
        out.update(norm_new=new, norm_old=old,
                   norm_ratio=float(max(max(r, 1.0 / r) for r in ratios)))
    return out
