"""The Redis volatile tier: fetch, insert, remove and overflow over HugeCTR's layout.

Keys are grouped by partition (`layout.group_by_partition`: argsort + bincount, never a
loop over keys); a fetch sends one `HMGET` per partition and `max_batch_size` chunk, to
every node at once, and decodes each reply while later ones are still on the wire (one
scatter per reply). Inserts are `HSET`s of packed field/value records, followed (when
`overflow_margin` is bounded) by pruning every partition that grew past it, by
`overflow_policy` (`overflow.py`). Connections, the cluster topology and failures are
`connection.py`'s; background writes (`insert_async`, eviction metadata refreshed on fetch) run on
`hps.runtime.background` workers that drop, and count, what they cannot keep up with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.config import UNBOUNDED, VolatileDBConfig
from hps.errors import MissingExtraError, TierError, TierUnavailableError
from hps.rows.storage_types import StorageType
from hps.rows.stored_values import decode_rows
from hps.runtime.background import BackgroundWorker, PeriodicTask
from hps.runtime.throttled_log import ThrottledLog
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import as_keys, as_rows
from hps.tiers.redis.connection import HAVE_REDIS, Cmd, RedisClient, Topology
from hps.tiers.redis.layout import (
    FIELD_WIDTH,
    LFU_SCRIPT,
    TableLayout,
    command,
    group_by_partition,
    head,
    pack_fields,
    pack_pairs,
    table_layout,
)
from hps.tiers.redis.overflow import prune_overflow

log = logging.getLogger("hps.tiers.redis")

_WINDOW_KEYS = 1 << 18  # keys per insert round trip: bounds the packed request in memory
#: seconds between marker probes: one EXISTS per partition per table, pipelined, so a
#: Redis emptied behind the tier's back is refilled within about this long
_HEALTH_SECONDS = 1.0


class RedisTier(BulkLoadTier):
    """The volatile tier on a Redis server or a Redis Cluster (detected from the server).

    `config.address` is a comma list of `host:port` seeds; the first one that answers says
    whether it is a cluster (`cluster_enabled` in INFO) and, if so, where every slot lives.

    Beyond the `Tier` contract:
    - `insert_async(table, keys, vectors)` queues an insert on a background thread (for
      `cache_missed_embeddings`): never blocks, drops and counts when the queue is full.
    - `failures`: failures by kind ("connection", "timeout", "cluster", "loading", "auth",
      "metadata", "pool", and "rejected" for calls failed fast while the breaker was open);
      `dropped`: keys whose background write was dropped ("insert", "metadata");
      `stats()` bundles them with the state for metrics.
    - `wait_idle(timeout)` waits for the background writes queued so far.
    - `follow()`: only read what another process writes (a follower worker of `hps serve
      --workers N`; each has its own pool): loads skip the rows (`loaded_elsewhere`),
      writes raise TierError, background writes and drops are skipped (`read_only`), the
      leader writes and probes the markers; `read_as` maps names to the leader's.

    Bulk loads take the `BulkLoadTier` contract's general path: inserts, chunk by chunk.

    `fetch`, `insert`, `remove`, `size` and `drop_table` raise `TierUnavailableError` when
    Redis cannot answer (at once while the breaker is open), `TierError` when Redis holds
    data that is not this table's layout (rows of another width, a key of another type).
    """

    name = "redis"

    def __init__(self, config: VolatileDBConfig, *, clock: Callable[[], float] = time.time
                 ) -> None:
        super().__init__()
        if not HAVE_REDIS:
            raise MissingExtraError("redis", "redis", "the Redis volatile tier")
        self.config = config
        self.failures: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self._dropped_lock = threading.Lock()
        self._clock = clock
        self._layouts: dict[str, TableLayout] = {}
        self._aliases: dict[str, str] = {}  # a follower's: see read_as
        self._bad_log = ThrottledLog(log)  # bad rows, full Redis: once per kind per minute
        self._client = RedisClient(config, self.failures)
        self._inserter: BackgroundWorker[tuple[str, np.ndarray, np.ndarray]] = BackgroundWorker(
            "hps-redis-insert", config.async_queue_size, self._run_inserts, log=log)
        self._toucher: BackgroundWorker[tuple[str, np.ndarray]] = BackgroundWorker(
            "hps-redis-metadata", config.async_queue_size, self._run_touches, log=log)
        self._client.start()
        # tables whose markers were found missing (rows lost), and a count per table of
        # the markers written, so a probe that read before a new marker cannot undo it
        self._lost: set[str] = set()
        self._marked: dict[str, int] = {}
        self._marks_lock = threading.Lock()
        self._health = PeriodicTask("hps-redis-health", _HEALTH_SECONDS, self.probe_markers,
                                    log=log)

    def follow(self) -> None:
        """Only read from now on: another process writes the tables (see the class)."""
        self.read_only = True
        self._health.close(timeout=5.0)

    def loaded_elsewhere(self, table: str) -> bool:
        """Whether another process writes `table`'s rows (a follower's: every table)."""
        return self.read_only

    def read_as(self, table: str, stored: str, whole: bool = False) -> None:
        """A follower serves `table` from the leader's name for it, `stored` (whole or not)."""
        self._aliases[table] = stored
        self._layouts.pop(table, None)

    def _table_layout(self, table: str) -> TableLayout:
        layout = self._layouts.get(table)
        if layout is None:
            layout = table_layout(self._aliases.get(table, table), self.config.num_partitions)
            self._layouts[table] = layout
        return layout

    # -- reads --------------------------------------------------------------------------

    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `keys` (int64[n]) from Redis: `(float32[n, dim], bool[n] found)`.

        Raises TierUnavailableError when Redis cannot answer (at once while the breaker
        is open). Stored rows that are not `dim` float32 wide, and partitions whose hash
        name holds another type (WRONGTYPE), answer "not found" for their keys, so that
        they fall through to the next tier; they are counted in `failures` ("bad_row",
        "wrong_type", in keys) and logged once per kind per minute, naming the partition.
        """
        dim = self.dim(table)
        keys = as_keys(keys)
        n = keys.size
        vectors = np.zeros((n, dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return vectors, found
        self._client.check()
        grouped = group_by_partition(keys, self.config.num_partitions)
        fields = pack_fields(grouped.keys)
        layout = self._table_layout(table)
        order = grouped.order

        def decode(p: int, a: int, b: int) -> Callable[[Any], None]:
            def on_reply(reply: list[Any]) -> None:
                rows, good, bad = decode_rows(reply, dim)
                if bad:
                    self._bad_data("bad_row", bad, table, layout.values[p],
                                   f"{bad} row(s) not {dim} float32 wide")
                if not rows.shape[0]:
                    return
                at = order[a:b]
                if rows.shape[0] < b - a:
                    at = at[good]
                vectors[at] = rows
                found[at] = True

            return on_reply

        def refused(p: int, a: int, b: int) -> Callable[[BaseException], None]:
            def on_error(exc: BaseException) -> None:  # WRONGTYPE: the keys fall through
                self._bad_data("wrong_type", b - a, table, layout.values[p], str(exc))

            return on_error

        def build(topology: Topology) -> list[Cmd]:
            node_of = topology.node_of(layout)
            return [
                Cmd(int(node_of[p]),
                     [head(2 + b - a, b"HMGET", layout.values[p]),
                      fields[a * FIELD_WIDTH:b * FIELD_WIDTH]],
                     decode(p, a, b), on_error=refused(p, a, b))
                for p, a, b in grouped.chunks(self.config.max_batch_size)
            ]

        self._client.execute(build, f"fetch from {table!r}")
        if self._touch_on_fetch:
            hit = found[order]
            if hit.any():
                self._queue_touch(table, grouped.keys[hit])
        return vectors, found

    @property
    def _touch_on_fetch(self) -> bool:
        policy = self.config.overflow_policy
        return policy == "evict_least_used" or (policy == "evict_oldest"
                                                and self.config.refresh_time_after_fetch)

    def size(self, table: str) -> int:
        """Keys `table` holds now (HLEN of every partition, summed)."""
        self.dim(table)  # UnknownTableError for tables never created
        layout = self._table_layout(table)
        total = np.zeros(1, dtype=np.int64)

        def add(reply: int) -> None:
            total[0] += int(reply)

        def build(topology: Topology) -> list[Cmd]:
            total[0] = 0
            node_of = topology.node_of(layout)
            return [Cmd(int(node_of[p]), [command(b"HLEN", name)], add)
                    for p, name in enumerate(layout.values)]

        self._client.execute(build, f"size of {table!r}")
        return int(total[0])

    # -- writes -------------------------------------------------------------------------

    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Write rows (HSET per partition), then prune partitions over `overflow_margin`.

        Raises TierUnavailableError when Redis cannot answer; nothing is retried.
        """
        keys, vectors = as_rows(keys, vectors, self.dim(table))
        if self.read_only:
            raise TierError(f"redis tier: {table!r} is written by the leader worker only")
        if keys.size == 0:
            return
        self._client.check()
        for start in range(0, keys.size, _WINDOW_KEYS):
            stop = start + _WINDOW_KEYS
            self._insert_window(table, keys[start:stop], vectors[start:stop])

    def _insert_window(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        config = self.config
        grouped = group_by_partition(keys, config.num_partitions)
        layout = self._table_layout(table)
        rows = np.ascontiguousarray(vectors[grouped.order], dtype="<f4").view(np.uint8)
        pairs, width = pack_pairs(grouped.keys, rows)
        meta = self._meta_writer(grouped.keys, layout)
        bounded = config.overflow_margin < UNBOUNDED
        sizes = np.zeros(config.num_partitions, dtype=np.int64)

        def store_size(p: int) -> Callable[[Any], None]:
            def on_reply(reply: int) -> None:
                sizes[p] = int(reply)

            return on_reply

        def build(topology: Topology) -> list[Cmd]:
            node_of = topology.node_of(layout)
            cmds = []
            last = -1
            for p, a, b in grouped.chunks(config.max_batch_size):
                node = int(node_of[p])
                cmds.append(Cmd(node, [head(2 + 2 * (b - a), b"HSET", layout.values[p]),
                                        pairs[a * width:b * width]]))
                if meta is not None:
                    cmds.append(meta(node, p, a, b))
                if bounded and p != last:
                    cmds.append(Cmd(node, [command(b"HLEN", layout.values[p])], store_size(p)))
                last = p
            return cmds

        self._client.execute(build, f"insert into {table!r}")
        if bounded:
            over = np.flatnonzero(sizes > config.overflow_margin)
            if over.size:
                prune_overflow(self._client, config, layout, table, over)

    def _meta_writer(self, keys: np.ndarray, layout: TableLayout
                     ) -> Callable[[int, int, int, int], Cmd] | None:
        """The `t`-hash write that goes with an insert or a touch of sorted `keys`."""
        policy = self.config.overflow_policy
        if policy == "evict_random":
            return None
        if policy == "evict_least_used":
            fields = pack_fields(keys)

            def lfu(node: int, p: int, a: int, b: int) -> Cmd:
                header = head(4 + b - a, b"EVAL", LFU_SCRIPT, b"1", layout.metas[p])
                return Cmd(node, [header, fields[a * FIELD_WIDTH:b * FIELD_WIDTH]],
                            best_effort=True)

            return lfu
        now = np.full(keys.size, int(self._clock()), dtype="<i8").view(np.uint8).reshape(-1, 8)
        pairs, width = pack_pairs(keys, now)

        def lru(node: int, p: int, a: int, b: int) -> Cmd:
            header = head(2 + 2 * (b - a), b"HSET", layout.metas[p])
            return Cmd(node, [header, pairs[a * width:b * width]], best_effort=True)

        return lru

    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys` (and their metadata); returns how many were present."""
        self.dim(table)
        keys = np.unique(as_keys(keys))
        if keys.size == 0:
            return 0
        self._client.check()
        grouped = group_by_partition(keys, self.config.num_partitions)
        layout = self._table_layout(table)
        fields = pack_fields(grouped.keys)
        removed = np.zeros(1, dtype=np.int64)

        def add(reply: int) -> None:
            removed[0] += int(reply)

        def build(topology: Topology) -> list[Cmd]:
            removed[0] = 0
            node_of = topology.node_of(layout)
            cmds = []
            for p, a, b in grouped.chunks(self.config.max_batch_size):
                body = fields[a * FIELD_WIDTH:b * FIELD_WIDTH]
                node = int(node_of[p])
                cmds.append(Cmd(node, [head(2 + b - a, b"HDEL", layout.values[p]), body], add))
                cmds.append(Cmd(node, [head(2 + b - a, b"HDEL", layout.metas[p]), body]))
            return cmds

        self._client.execute(build, f"remove from {table!r}")
        return int(removed[0])

    def drop_table(self, table: str) -> None:
        """Delete every partition hash of `table` (rows, metadata, markers), then forget it."""
        self._unlink(table, "drop")
        super().drop_table(table)
        with self._marks_lock:
            self._lost.discard(table)
            self._marked.pop(table, None)

    def clear_table(self, table: str, dim: int, storage: StorageType | str = "float32"
                    ) -> None:
        """Delete every partition hash of `table` and write its markers again: known
        throughout, to lookups and to online updates' writes (the contract's)."""
        self._unlink(table, "clearing")
        self.create_table(table, dim, storage)

    def _unlink(self, table: str, what: str) -> None:
        layout = self._table_layout(table)

        def build(topology: Topology) -> list[Cmd]:
            node_of = topology.node_of(layout)
            return [Cmd(int(node_of[p]), [command(b"UNLINK", layout.values[p], layout.metas[p],
                                                  layout.markers[p])])
                    for p in range(len(layout.values))]

        self._client.execute(build, f"{what} of {table!r}")

    # -- markers: rows lost behind the tier's back --------------------------------------

    def create_table(self, table: str, dim: int, storage: StorageType | str = "float32"
                     ) -> None:
        """Make `table` known (keeps what Redis holds) and write its markers, before any
        row: a marker gone later means the rows written after it may be gone too. Redis
        being down is not an error here (the load's writes fail and say so; the markers
        are written when the table is filled)."""
        super().create_table(table, dim, storage)
        if self._client.breaker.is_open or self.read_only:
            return  # down (the fill after the outage marks it), or the leader marks it
        layout = self._table_layout(table)

        def build(topology: Topology) -> list[Cmd]:
            node_of = topology.node_of(layout)
            return [Cmd(int(node_of[p]), [command(b"SET", layout.markers[p], b"1")])
                    for p in range(len(layout.markers))]

        try:
            self._client.execute(build, f"markers of {table!r}")
        except TierError as exc:
            log.debug("redis tier: markers of %r not written now: %s", table, exc)
            return
        with self._marks_lock:
            self._marked[table] = self._marked.get(table, 0) + 1
            self._lost.discard(table)

    def probe_markers(self) -> list[str]:
        """Check every known table's markers (one EXISTS per partition, pipelined to
        every node); returns the tables some marker of which is gone, which `stats()`
        lists as `lost_tables` until the table is created again. Runs every
        `_HEALTH_SECONDS` on the tier's health thread; nothing while the breaker is open
        (the reconnect is the breaker's; the first probe after it finds what the outage
        lost)."""
        if self._client.closed or not self.available:
            return sorted(self._lost)
        with self._marks_lock:
            seen = dict(self._marked)
        tables = list(self._dims)
        missing: set[str] = set()

        def check(table: str) -> Callable[[Any], None]:
            def on_reply(reply: int) -> None:
                if not int(reply):
                    missing.add(table)

            return on_reply

        def build(topology: Topology) -> list[Cmd]:
            missing.clear()
            cmds = []
            for table in tables:
                layout = self._table_layout(table)
                node_of = topology.node_of(layout)
                cmds += [Cmd(int(node_of[p]), [command(b"EXISTS", layout.markers[p])],
                             check(table)) for p in range(len(layout.markers))]
            return cmds

        try:
            self._client.execute(build, "marker probe")
        except TierError as exc:
            log.debug("redis tier: marker probe failed: %s", exc)
            return sorted(self._lost)
        with self._marks_lock:
            for table in missing:
                if self._marked.get(table, 0) == seen.get(table, 0) and table in self._dims:
                    if table not in self._lost:
                        log.warning("redis tier: the rows of %s are gone (Redis restarted "
                                    "empty, flushed or failed over)", table)
                    self._lost.add(table)
            return sorted(self._lost)

    # -- background writes --------------------------------------------------------------

    def insert_async(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> bool:
        """Queue an insert on the background writer; returns False if it was dropped.

        Never blocks and never raises for Redis being down: the write is dropped (counted
        in `dropped["insert"]`, in keys) when the queue is full or the breaker is open.
        Takes copies, so the caller may reuse its buffers.
        """
        keys, vectors = as_rows(keys, vectors, self.dim(table))
        keys, vectors = keys.copy(), vectors.copy()  # the caller may reuse its buffers
        if keys.size == 0:
            return True
        if self.read_only:  # a follower's: the leader writes (see the class)
            return False
        if self._client.breaker.is_open or not self._inserter.submit((table, keys, vectors)):
            self._drop("insert", keys.size)
            return False
        return True

    def _run_inserts(self, batch: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        for table, keys, vectors in batch:
            if table not in self._dims:
                continue  # dropped meanwhile
            try:
                self.insert(table, keys, vectors)
            except TierUnavailableError as exc:
                self._drop("insert", keys.size)
                log.debug("redis tier: background insert skipped: %s", exc)
            except TierError as exc:  # Redis full, a key of another type: no traceback
                self._drop("insert", keys.size)
                self._bad_log.warning("insert", "redis tier: background insert of %d keys "
                                      "into %r dropped: %s", keys.size, table, exc)

    def _queue_touch(self, table: str, keys: np.ndarray) -> None:
        if not self._toucher.submit((table, keys)):
            self._drop("metadata", keys.size)

    def _run_touches(self, batch: list[tuple[str, np.ndarray]]) -> None:
        for table, keys in batch:
            try:
                self._touch(table, keys)
            except TierUnavailableError as exc:
                self._drop("metadata", keys.size)
                log.debug("redis tier: metadata refresh skipped: %s", exc)
            except TierError as exc:
                self._drop("metadata", keys.size)
                self._bad_log.warning("metadata", "redis tier: metadata refresh of %r "
                                      "dropped: %s", table, exc)

    def _touch(self, table: str, keys: np.ndarray) -> None:
        """Write the eviction metadata of fetched `keys` (their count or time)."""
        grouped = group_by_partition(keys, self.config.num_partitions)
        layout = self._table_layout(table)
        meta = self._meta_writer(grouped.keys, layout)
        if meta is None:
            return

        def build(topology: Topology) -> list[Cmd]:
            node_of = topology.node_of(layout)
            return [meta(int(node_of[p]), p, a, b)
                    for p, a, b in grouped.chunks(self.config.max_batch_size)]

        self._client.execute(build, f"metadata refresh of {table!r}")

    def _bad_data(self, kind: str, keys: int, table: str, partition: bytes,
                  what: str) -> None:
        self._client.breaker.count(kind, keys)
        self._bad_log.warning(
            kind, "redis tier: %s in partition %s of %r (%s); those keys fall through to "
            "the next tier", kind.replace("_", " "), partition.decode(), table, what)

    def _drop(self, kind: str, count: int) -> None:
        with self._dropped_lock:
            self.dropped[kind] = self.dropped.get(kind, 0) + int(count)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the background inserts and metadata writes queued so far are done."""
        return self._inserter.wait_idle(timeout) and self._toucher.wait_idle(timeout)

    # -- state --------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker is open (Redis is considered down)."""
        return self._client.available

    @property
    def cluster(self) -> bool | None:
        """True for a Redis Cluster, False for a standalone server, None before connecting."""
        topology = self._client.topology
        return None if topology is None else topology.cluster

    def nodes(self) -> list[str]:
        """`host:port` of the masters in use (empty before the first connection)."""
        topology = self._client.topology
        return [] if topology is None else [n.address for n in topology.nodes]

    def stats(self) -> dict[str, Any]:
        """State and counters, for metrics."""
        return {"available": self.available, "cluster": self.cluster, "nodes": self.nodes(),
                "episodes": self._client.breaker.episodes, "failures": dict(self.failures),
                "dropped": dict(self.dropped), "lost_tables": sorted(self._lost),
                "tables_lost": len(self._lost)}

    def close(self) -> None:
        """Finish queued background writes (a few seconds at most), stop reconnecting,
        close every connection."""
        if self._client.closed:
            return
        self._health.close(timeout=5.0)
        self._inserter.close(timeout=5.0)
        self._toucher.close(timeout=5.0)
        self._client.close()
