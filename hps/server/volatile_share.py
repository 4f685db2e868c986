"""The volatile tier's share of a table: how many rows of a chunk, and which rows.

Over a persistent tier, the volatile tier takes the first `initial_cache_rate` of every
chunk of a table's files (the same keys whoever fills it: a load, a fill after the load,
a restart); where the persistent tier may hold newer rows than the files (online
updates), the share's rows are the ones it holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np

from hps.tiers.contract import Tier


def volatile_rows(n: int, rate: float) -> int:
    """The rows of a chunk of `n` the volatile tier takes at `rate`."""
    return n if rate >= 1.0 else int(math.ceil(n * rate))


def shares(chunks: Iterable[tuple[np.ndarray, np.ndarray]], rate: float
           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The `rate` share of each `(keys, vectors)` chunk (views, no copy)."""
    for keys, vectors in chunks:
        m = volatile_rows(len(keys), rate)
        yield keys[:m], vectors[:m]


def stored_rows(persistent: Tier, name: str, keys: np.ndarray, file_rows: np.ndarray
                ) -> np.ndarray:
    """The rows the persistent tier holds for `keys`, the file's where it holds none."""
    stored, found = persistent.fetch(name, keys)
    if not found.all():
        stored[~found] = file_rows[~found]
    return stored
