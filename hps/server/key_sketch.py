"""The hot and the missing keys of a table: a frequent-items sketch of the keys a table is
asked for, and one of the keys no tier holds.

`KeySketch.feed(keys)` counts a batch in one compiled call (`sketch_loops.feed`); `top(n)`
reads the `n` heaviest keys with their estimated counts and the error bound. A key's true
count (in the fed stream) lies in [count - error, count]; any key not listed has at most
`error`. A sketch holds `slots * 3/4` keys in `16 * slots` bytes, whatever the traffic.

What is fed, and the bias it brings (`TableKeys`):
- hot keys: the keys of every Nth lookup of the table (N: the model's
  `hot_key_sampling`, default `HOT_EVERY`, `HOT_EVERY_GPU` with GPU caches), at most
  `HOT_MOST` of a batch (a strided subset whose start rotates), each weighted by what it
  stands for, so counts estimate lookups. Traffic whose pattern repeats with a period of
  exactly N calls is seen from one phase only, and a count is exact only up to that
  sampling. A table without a GPU cache is sampled on the host (a lookup's number is
  `TableStats.add`'s; source "lookups"); one with a GPU cache on the device, where its
  keys are (hps/gpu/key_sample.py: the sample is copied off the GPU call without waiting
  for it and fed later through `feed_sample`; source "gpu_lookups"), and the keys its
  cache misses do not feed it again.
- missing keys: the keys a lookup found in no tier, every time (at most `MISSING_MOST` of
  a batch): they are on the host already and rare in a healthy table.

Threads: a feed that finds the sketch busy (another thread feeding it) is skipped rather
than waited for, so lookups never queue on it; under contention fewer batches are
counted, the weights of those counted stay right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.server.sketch_loops import ACTIVE, META, OFFSET, TOTAL, feed, new_state

#: every HOT_EVERY-th lookup of a table feeds the hot sketch by default (the model's
#: `hot_key_sampling`, a power of two: the lookup path tests `number & (every - 1)`).
#: `hps bench tiers` prints what it costs beside the same lookups without it.
HOT_EVERY = 16
#: the default of a table with GPU caches: a sampled GPU call launches a copy kernel and
#: its caller's sync waits for it (~10 µs on the H100, hps/gpu/key_sample.py), so 1 in 32
#: keeps it near 1.5% of a 2,000-key call (`python -m hps.tools.bench.gpu_sampling`)
HOT_EVERY_GPU = 32
#: keys of one batch fed to the hot sketch at most (a strided subset beyond)
HOT_MOST = 64
#: the same of a GPU table that keeps hot copies, which fill from the sketch
#: (hps/server/hot_fill.py): 1M-key batches of Zipf 1.1 over 4M keys, 1 in 32 sampled,
#: at 64 keys a sample show about 8,000 keys in 10 s, whose heaviest take ~60% of the
#: lookups; at 1,024, ~75% (a copy's 64K heaviest take 87%)
HOT_MOST_COPIES = 1024
#: keys of one batch fed to the missing sketch at most
MISSING_MOST = 1024
#: slots of a table's hot sketch: 12,288 keys tracked (what a warm-up can export), 256 KiB
HOT_SLOTS = 16384
#: slots of a sketch by default, and of a table's missing-key sketch: 3,072 keys, 64 KiB
SLOTS = 4096

_INT64 = np.dtype(np.int64)


class KeySketch:
    """One frequent-items sketch (see the module docstring); thread-safe."""

    def __init__(self, slots: int = SLOTS, most: int = HOT_MOST, weight: int = 1) -> None:
        self._state = new_state(slots)
        self._slots = slots
        self._most = most
        self._weight = weight
        self._lock = threading.Lock()
        #: called before a read: feeds what a sampler holds that is ready (a GPU table's
        #: samples whose copies are done), so a read sees every sample taken so far
        self.pending: Callable[[], None] | None = None

    def feed(self, keys: np.ndarray) -> None:
        """Count `keys` (host int64[n], C-contiguous); skipped when another thread is
        feeding this sketch now."""
        if keys.dtype != _INT64 or not keys.flags.c_contiguous:
            keys = np.ascontiguousarray(keys, np.int64)
        if self._lock.acquire(False):
            try:
                feed(self._state, keys, self._most, self._weight)
            finally:
                self._lock.release()

    def feed_sample(self, keys: np.ndarray, stride: int) -> None:
        """Count `keys` (host int64[m], C-contiguous), a sample taken already, 1 key in
        `stride` of a batch: each weighted as `feed` weights the keys it takes at that
        stride; skipped when another thread is feeding this sketch now."""
        if keys.size and self._lock.acquire(False):
            try:
                feed(self._state, keys, keys.size, self._weight * stride)
            finally:
                self._lock.release()

    def top(self, n: int) -> dict[str, Any]:
        """The `n` heaviest keys: `keys` int64[m], `counts` int64[m] (estimates, heaviest
        first, m <= n), `error` (the bound of every count), `total` (the weight fed)."""
        if self.pending is not None:
            self.pending()
        s = self._slots
        with self._lock:
            keys = self._state[:s].copy()
            counts = self._state[s:2 * s].copy()
            meta = self._state[2 * s:2 * s + META].copy()
        held = np.flatnonzero(counts)
        # heaviest first; ties by key, so an answer does not depend on slot order
        order = np.lexsort((keys[held], -counts[held]))[:max(0, n)]
        chosen = held[order]
        error = int(meta[OFFSET])
        return {"keys": keys[chosen], "counts": counts[chosen] + error, "error": error,
                "total": int(meta[TOTAL]), "held": int(meta[ACTIVE])}

    @property
    def capacity(self) -> int:
        """The most keys the sketch tracks."""
        return self._slots * 3 // 4


class TableKeys:
    """The two sketches of one table: `hot` (looked-up keys, sampled) and `missing` (keys
    found in no tier). `source` says where the hot sketch's samples are taken: "lookups"
    (on the host), "gpu_lookups" (on the device, of a table with a GPU cache)."""

    def __init__(self, every: int = HOT_EVERY, missing: KeySketch | None = None,
                 source: str = "lookups") -> None:
        self.every = every
        self.hot = KeySketch(HOT_SLOTS, most=HOT_MOST, weight=max(every, 1))
        self.missing = missing if missing is not None else KeySketch(most=MISSING_MOST)
        self.source = source

    def sketch(self, kind: str) -> KeySketch:
        """The sketch of `kind` ("hot" or "missing")."""
        return self.hot if kind == "hot" else self.missing

    def sampling(self, kind: str) -> str:
        """How the sketch of `kind` is fed, in words (for the answers that list it)."""
        if kind == "hot":
            if not self.every:
                return "off (hot_key_sampling: 0)"
            where = "GPU" if self.source == "gpu_lookups" else "host"
            return (f"1 in {self.every} {where} lookups, at most {HOT_MOST} keys of each (a "
                    "strided subset), weighted to estimate all lookups")
        return f"every lookup, at most {MISSING_MOST} missing keys of a batch"
