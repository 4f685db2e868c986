"""Rows the tier tests write: each vector can be told from its key."""

from __future__ import annotations

import numpy as np


def vectors_of(keys: np.ndarray, dim: int, salt: float = 0.0) -> np.ndarray:
    """Row i is keys[i] + salt + [0, 1/dim, 2/dim, ...], as float32."""
    k = np.asarray(keys, dtype=np.float64)[:, None]
    return (k + salt + np.arange(dim) / dim).astype(np.float32)
