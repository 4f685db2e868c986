"""Reused buffers that a round's messages are decoded into.

A round holds up to `max_commit_interval` messages of a table (32 × 8,192 rows of width
64: 64 MiB). Decoding each message into arrays of its own, or a round into one fresh
array, spends more time faulting in new pages than copying (measured: 40 ms for 32
messages into arrays of their own, 14 ms into one fresh buffer, 6 ms into one used
before). So a round's rows go into buffers taken from here, and come back once the round
is written to every tier (each tier copies what it keeps).

At most two rounds are in flight (one decoded while the one before is written), so a
few buffers cover a steady stream; `clear()` lets them go when the stream is idle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

#: buffers kept for reuse (a round per table being decoded and one being written)
KEEP = 4


# eq=False: the pool tells buffers apart by identity (list.remove comparing their arrays
# by value raises once the pool is full)
@dataclass(frozen=True, eq=False)
class RowBuffer:
    """Room for `capacity` rows: their keys, and their float32 values (any width)."""

    keys: np.ndarray  # int64 [capacity]
    values: np.ndarray  # float32 [capacity × width], flat

    @property
    def capacity(self) -> int:
        return int(self.keys.size)

    def rows(self, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the first `n` rows of width `dim`: keys int64 [n], float32 [n, dim]."""
        return self.keys[:n], self.values[:n * dim].reshape(n, dim)


class RowBuffers:
    """A small pool of RowBuffer. Thread safety: any thread may take and give back."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._free: list[RowBuffer] = []
        self._lock = threading.Lock()

    def take(self, rows: int, dim: int) -> RowBuffer:
        """A buffer for `rows` rows of width `dim` (one held in the pool when one is
        large enough, else a new one)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.capacity >= rows and buffer.values.size >= rows * dim:
                    return self._free.pop(i)
        return RowBuffer(np.empty(rows, np.int64), np.empty(rows * dim, np.float32))

    def give(self, buffer: RowBuffer) -> None:
        """Return a buffer nothing reads any more; the smallest is dropped when the pool
        is full."""
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=lambda b: b.values.size))

    def clear(self) -> None:
        """Drop the buffers held (their memory goes back to the OS)."""
        with self._lock:
            self._free.clear()
