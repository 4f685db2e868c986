"""Keys and rows as the byte strings RocksDB stores (HugeCTR's layout: the raw 8-byte
little-endian int64 key, the raw float32 bytes of the row), made from whole arrays."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import numpy as np


def consume(iterator: Iterator[Any]) -> None:
    """Run an iterator (a `map` of rocksdict calls) to its end at C speed."""
    collections.deque(iterator, maxlen=0)


def key_bytes(keys: np.ndarray) -> list[bytes]:
    """The raw 8-byte little-endian strings of int64 keys (a `V8` view: no NUL stripping)."""
    raw: list[bytes] = np.ascontiguousarray(keys, dtype="<i8").view("V8").tolist()
    return raw


def row_bytes(vectors: np.ndarray) -> list[bytes]:
    """The raw float32 bytes of each row."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    raw: list[bytes] = rows.view(f"V{rows.shape[1] * 4}").reshape(-1).tolist()
    return raw
