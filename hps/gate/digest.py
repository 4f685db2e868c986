"""What identifies a version of a table: a digest of its rows at the sampled keys.

The drift sample (`key_set.sample_rows`: the keys whose hash falls under a threshold set
by the table's key count) picks the same keys in every version of a table, so the
digest of those keys' rows, with the key count and the width, tells two versions apart
as well as the drift measured on the same sample does, for the cost of one hash per
sampled row. The server keeps each served table's digest (`TableSource.rows_digest`) and
the digest of the version before it, so a reload of the previous version is recognised
(hps/gate/table_gate.py) whatever files it comes from.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np


@functools.cache
def _multipliers(dim: int) -> np.ndarray:
    """Odd uint64 weights of a row's 32-bit words (a fixed seed: every process alike)."""
    drawn = np.random.default_rng(0x5EED).integers(0, 2**63, size=dim, dtype=np.uint64)
    return drawn * np.uint64(2) + np.uint64(1)


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """One uint64 per float32 row [n, dim]: a weighted sum of the row's bit patterns,
    wrapping; vectorised, for the sampled rows only."""
    words = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (words * _multipliers(words.shape[1])).sum(axis=1, dtype=np.uint64)


def version_digest(keys: np.ndarray, hashes: np.ndarray, num_keys: int, dim: int) -> str:
    """The digest of a version: its distinct sampled `keys` in ascending order with their
    rows' `hashes`, its distinct key count and its width (hex, 32 characters)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.array([num_keys, dim], dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(keys, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(hashes, dtype="<u8").tobytes())
    return digest.hexdigest()
