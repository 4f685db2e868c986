"""Which keys the online updates of one GPU table wrote, numbered, so a miss fill can tell
whether an update overtook it.

A miss fill fetches its rows from the tiers, then inserts them into the cache; an online
update writes the tiers, then the rows the cache holds. An update that lands between the
fill's fetch and its insert leaves the fill inserting a row older than the tiers'. The
fill takes a `mark()` before it fetches and, once its insert is queued, asks `raced(mark,
keys)` for the keys that updates since then wrote: only those are dropped again (an
update queued after the insert overwrites them anyway: the cache orders its writes).

    log = UpdateLog()
    mark = log.mark()             # before the fetch
    log.wrote(keys)               # by update(), before it writes the device
    stale = log.raced(mark, keys) # after the insert: the keys to drop (usually none)

The last KEPT updates are remembered; a fill older than those treats all its keys as
stale. Thread-safe for one writer (the update path holds its lock) and any readers: an
entry is appended before the count moves, and readers copy the entries first.
"""

from __future__ import annotations

from collections import deque

import numpy as np

KEPT = 256


class UpdateLog:
    """The keys of the last KEPT online updates of a table, numbered from 1."""

    def __init__(self) -> None:
        self.count = 0
        self._entries: deque[tuple[int, np.ndarray]] = deque(maxlen=KEPT)

    def mark(self) -> int:
        """The updates started so far (a fill's mark, taken before it fetches)."""
        return self.count

    def wrote(self, keys: np.ndarray) -> None:
        """An update of `keys` (host integers, copied) starts."""
        self._entries.append((self.count + 1, np.array(keys, np.int64).reshape(-1)))
        self.count += 1

    def raced(self, mark: int, keys: np.ndarray) -> np.ndarray:
        """A new array of the `keys` that updates after `mark` wrote: empty when none did,
        all of them when those updates are no longer kept."""
        if self.count == mark:
            return keys[:0].copy()
        entries = tuple(self._entries)
        if not entries or entries[0][0] > mark + 1:
            return keys.copy()
        written = [k for number, k in entries if number > mark]
        if not written:
            return keys[:0].copy()
        return keys[np.isin(keys, np.concatenate(written))]
