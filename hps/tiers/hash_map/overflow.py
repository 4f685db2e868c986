"""The overflow policy of the in-process hash map: how a table is kept under its bound.

`overflow_margin` bounds the entries of each partition (`partition_of(key,
num_partitions)`, hps/tiers/partition.py). When an insert takes a partition past it, that
partition is pruned to `int(overflow_margin × overflow_resolution_target)` entries: random
victims (`evict_random`), the fewest fetch hits (`evict_least_used`) or the oldest stamp
(`evict_oldest`: insert/overwrite time, also fetch time when `refresh_time_after_fetch`,
as in HugeCTR). The hits and stamps are the table's per-row `stats`, kept only while the
margin is bounded; fetches update them through `note_fetch`, under the table's
`stats_lock`.
"""

from __future__ import annotations

import numpy as np

from hps.config import UNBOUNDED, VolatileDBConfig
from hps.tiers.hash_map import loops as kernels
from hps.tiers.hash_map.table import Table

#: least-used counts are halved when one passes this (each op adds < 2**28 between checks)
_COUNT_LIMIT = 1 << 31
_COUNT_CHECK_EVERY = 4096


class Overflow:
    """The bound of a hash map tier's tables and the policy that keeps it, read from its
    `VolatileDBConfig` (`num_partitions`, `overflow_margin`, `overflow_policy`,
    `overflow_resolution_target`, `refresh_time_after_fetch`); `seed` seeds the random
    victims of `evict_random`."""

    def __init__(self, config: VolatileDBConfig, seed: int | None = None) -> None:
        self.num_partitions = int(config.num_partitions)
        self.margin = int(config.overflow_margin)
        self.policy = config.overflow_policy
        self.prune_target = int(self.margin * config.overflow_resolution_target)
        self.refresh_time_after_fetch = bool(config.refresh_time_after_fetch)
        #: whether tables are pruned at all (else they keep no per-row stats)
        self.bounded = self.margin < UNBOUNDED
        self._rng = np.random.default_rng(seed)

    def note_fetch(self, t: Table, rows: np.ndarray) -> None:
        """Count a fetch of `rows` (int64 row numbers, -1 for keys not found) in the
        per-row stats of `t`. The caller holds `t.stats_lock`."""
        clock = t.tick()
        if self.policy == "evict_least_used":
            kernels.count_hits(t.stats, rows)
            if clock % _COUNT_CHECK_EVERY == 0 and t.stats[: t.size].max(initial=0) > _COUNT_LIMIT:
                t.stats[: t.size] >>= 1
        elif self.refresh_time_after_fetch:
            kernels.stamp_rows(t.stats, rows, np.uint32(clock))

    def prune(self, t: Table) -> None:
        """Prune every partition of `t` past the margin down to the resolution target.
        The caller holds `t`'s write lock."""
        over = np.flatnonzero(t.partition_sizes > self.margin)
        if not over.size:
            return
        parts = np.empty(t.size, np.int64)
        kernels.partitions(t.keys, t.size, self.num_partitions, parts)
        # Rows of the overflowing partitions only, grouped by partition.
        rows_over = np.flatnonzero(np.isin(parts, over))
        rows_over = rows_over[np.argsort(parts[rows_over], kind="stable")]
        starts = np.concatenate([[0], np.cumsum(t.partition_sizes[over])])
        victims = []
        for i in range(over.size):  # a loop over partitions, not keys
            members = rows_over[starts[i] : starts[i + 1]]
            excess = members.size - self.prune_target
            victims.append(members[self._victims(t, members, excess)])
        # by key: removing a row moves another into its place
        victim_keys = t.keys[np.concatenate(victims)]
        kernels.remove(t.slots, t.keys, t.vectors, t.stats, t.partition_sizes, t.state,
                       t.row_bits, victim_keys)
        t.shrink()

    def _victims(self, t: Table, members: np.ndarray, excess: int) -> np.ndarray:
        """Positions in `members` of the `excess` rows the policy evicts."""
        if excess >= members.size:
            return np.arange(members.size)
        if self.policy == "evict_random":
            return self._rng.choice(members.size, excess, replace=False)
        return np.argpartition(t.stats[members], excess - 1)[:excess]

