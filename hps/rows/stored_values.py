"""Stored values → float32 rows, for the tiers that store one value per key (Redis,
RocksDB): rows of the wrong width are set aside as not found instead of failing the
whole fetch, so their keys fall through to the next tier."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import numpy as np


def decode_rows(values: Sequence[bytes | None], dim: int
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """`(rows, good, bad)` of stored `values` (None where a key is absent).

    `good` (bool[m]) marks the values that are `dim` little-endian float32 wide; `rows`
    (float32[good.sum(), dim]) holds them in order; `bad` counts present values of another
    size (they are not in `good`). The common case (every present value the right size,
    told by the total length) costs one join; sizes are checked one by one only when the
    total is off, so two bad values whose sizes make up for each other exactly go
    unnoticed: a tier only holds such rows if something else wrote them.
    """
    m = len(values)
    missing = values.count(None)
    present = m - missing
    width = 4 * dim
    if present == 0:
        return np.empty((0, dim), np.float32), np.zeros(m, bool), 0
    data = b"".join(filter(None, values)) if missing else b"".join(values)  # type: ignore[arg-type]
    if len(data) == present * width:
        good = (np.fromiter(map(bool, values), bool, m) if missing
                else np.ones(m, bool))
        return np.frombuffer(data, "<f4").reshape(present, dim), good, 0
    here = np.fromiter(map(operator.is_not, values, itertools.repeat(None)), bool, m)
    stored = list(itertools.compress(values, here))
    sizes = np.fromiter(map(len, stored), np.int64, present)  # type: ignore[arg-type]
    ok = sizes == width
    good = here.copy()
    good[here] = ok
    data = b"".join(itertools.compress(stored, ok))  # type: ignore[arg-type]
    rows = np.frombuffer(data, "<f4").reshape(-1, dim)
    return rows, good, int(present - np.count_nonzero(ok))
