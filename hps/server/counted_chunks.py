"""Chunks a GPU cache fills from, counted as a step of the load's progress.

A cache filled from the model files (`init_ec`: hps/server/gpu_caches.py) takes chunks
until it holds its capacity (a dynamic cache) or the whole table (static, uvm): seconds
for a large table, a step of its own (`LoadProgress.start_step`) counted in keys in the
cache. A chunk counts once the cache asked for the next one, or once the fill returned
(`finish`), so the count says what the cache took, never what it was only handed; at
most `total`, since the last chunk a cache takes may be cut to fit. Generic over what
consumes the chunks: nothing here touches the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import numpy as np

from hps.server.loader import LoadProgress

#: what a fill's count is read as ("300,000 of 1,000,000 keys in the cache")
UNIT = "keys in the cache"


class CountedChunks:
    """`chunks(source)` hands `source`'s (keys, vectors) chunks on, counting each as a
    step of `progress` ("`what`: N of `total` keys in the cache"); `finish()` once the
    consumer returned."""

    def __init__(self, progress: LoadProgress, what: str, total: int) -> None:
        self.progress, self.total = progress, total
        self.done = 0
        self._handed = 0  # keys of the chunk handed over and not counted yet
        self._started = time.perf_counter()
        progress.start_step(what, total, UNIT)

    def chunks(self, source: Iterable[tuple[np.ndarray, np.ndarray]]
               ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for keys, vectors in source:
            self._count()
            self._handed = int(keys.size)
            yield keys, vectors
        self._count()

    def finish(self) -> None:
        self._count()
        self.progress.finish_step(time.perf_counter() - self._started)

    def _count(self) -> None:
        taken = min(self._handed, self.total - self.done)
        self._handed = 0
        if taken > 0:
            self.done += taken
            self.progress.step(taken)
