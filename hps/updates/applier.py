"""Applying update messages to a table's tiers and GPU caches.

A batch (the messages of one poll) is applied in two steps:

1. `prepare`: each message is decoded (codec.py) against the table its topic names, the
   rows of a table's messages into one buffer (buffers.py: reused, so no fresh pages);
   malformed messages, unknown tables, NaN/inf rows, out-of-range keys and values a
   compact table's storage type cannot hold (float16 past ±65504, ...: "value_range")
   are rejected here (counted in `UpdateStats`, logged with a rate limit), so they
   never change a row. Nothing is written. A message whose decoding fails for any other
   reason is set aside the same way (reason "failed"): it never stops the messages
   after it.
2. `write`: per table, the rows of all its messages (the last row of a key wins, as the
   log's order says) go to the persistent tier (a large batch through its bulk path,
   `BulkLoadTier.load`), then the volatile tier, then every GPU cache of the table (rows it holds
   are overwritten in place; missing keys inserted where `gpu_cache_insert` asks), in
   that order. A shared hash map table at its fixed capacity still overwrites the keys
   it holds and leaves out the rows of new keys (the persistent tier keeps them; counted
   as `left_out`). A tier's `update_filters` (HugeCTR's
   regular expressions over `hps_et.<model>.<table>`) decide whether it takes updates.
   A `TierUnavailableError` leaves the batch to be written again (every write is an
   overwrite, so a replay ends in the same rows); any other failure of one table's write
   sets that table's messages aside ("write_failed") and the other tables are written.

Every tier writes a row whole (a hash-map insert under its table lock, one Redis HSET
field, a RocksDB WriteBatch or ingested SST file, a GPU kernel ordered after the queries
in flight), so a
lookup sees a key's old row or its new one, never a mix.

Reloads. While a model reloads, the keys its updates touch are noted
(`begin_reload`); `swap` then copies their current rows from the served version to the
new one and installs the new version under the same lock that `write` holds, so an
update lands in the version that serves after the swap, whichever moment it came in.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hps.errors import (
    BadUpdateError,
    LookupInputError,
    TierUnavailableError,
    UnknownTableError,
)
from hps.rows.storage_types import FLOAT32, StorageType, first_unencodable_row
from hps.tiers import Tiers
from hps.tiers.bulk_load import BulkLoadTier
from hps.updates import codec
from hps.updates.buffers import RowBuffer, RowBuffers
from hps.updates.contract import UpdateMessage
from hps.updates.stats import UpdateStats

#: writes rows to the GPU caches of one table: (keys int64 [n], vectors float32 [n, dim])
CacheWrite = Callable[[np.ndarray, np.ndarray], None]
#: rows written to the tiers at a time: a tier call holds the GIL for its Python part, so
#: lookups on other threads get their turn between chunks (16 Ki rows of width 64: 4 MiB)
WRITE_CHUNK_BYTES = 4 << 20
#: a table's batch of at least this many rows goes to the persistent tier through its bulk
#: path (`BulkLoadTier.load`: RocksDB ingests a sorted SST file, ~3x a WriteBatch here, durable on
#: return, newer than what it holds); smaller ones through `insert`
BULK_ROWS = 1 << 16


@dataclass(frozen=True)
class UpdateTarget:
    """One served table, as updates reach it.

    topic          hps_et.<model>.<table>, where its updates are published
    storage_name   where its rows are stored now (a reload alternates with a staging name)
    write_caches   its GPU caches, None when it has none
    storage        its embedding_storage_dtype (what the hash map and GPU tables hold)
    """

    model: str
    table: str
    topic: str
    storage_name: str
    dim: int
    write_caches: CacheWrite | None = None
    storage: StorageType = FLOAT32


#: the served table a topic names, None when no served model has that table
Resolve = Callable[[str], "UpdateTarget | None"]
#: whether the model a topic belongs to is served (else its messages wait: not rejected)
Serves = Callable[[str], bool]


@dataclass
class TableBatch:
    """The decoded rows of one table's messages in one poll, in log order, in one buffer
    (buffers.py): `keys` int64 [rows], `vectors` float32 [rows, dim] (a key may repeat:
    the tiers keep the last of duplicate keys, as their contract says)."""

    topic: str
    dim: int
    keys: np.ndarray
    vectors: np.ndarray
    last: UpdateMessage | None = None
    messages: int = 0

    @property
    def rows(self) -> int:
        return int(self.keys.size)


def _check_storage(storage: StorageType, vectors: np.ndarray) -> None:
    """BadUpdateError ("value_range") when a compact table's storage type cannot hold a
    value of `vectors` (float16 past ±65504, ...)."""
    bad = first_unencodable_row(storage, vectors)
    if bad is not None:
        raise BadUpdateError(f"row {bad} holds a value {storage.name} storage cannot hold "
                             f"(magnitude {storage.max_magnitude:g} or more)", "value_range")


def _chunk_rows(dim: int) -> int:
    """Rows of width `dim` in WRITE_CHUNK_BYTES."""
    return max(1, WRITE_CHUNK_BYTES // (4 * dim))


def last_rows(keys: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys with the last row each has in `keys` order (a GPU cache's update takes
    unique keys)."""
    _, first_from_end = np.unique(keys[::-1], return_index=True)
    if first_from_end.size == keys.size:
        return keys, vectors
    last = keys.size - 1 - first_from_end
    return keys[last], vectors[last]


@dataclass
class Prepared:
    """A poll's messages decoded: the rows by table, and the messages to leave
    uncommitted (their model is not served now, e.g. unloaded a moment ago: they are
    read again once it is followed again). `release()` gives the rows' buffers back
    once every tier has them."""

    batches: list[TableBatch]
    held: list[UpdateMessage]
    buffers: list[RowBuffer] = field(default_factory=list)
    pool: RowBuffers | None = None

    def done(self, messages: Sequence[UpdateMessage]) -> list[UpdateMessage]:
        """`messages` less the held ones: what is applied or rejected, to commit."""
        held = {id(m) for m in self.held}
        return [m for m in messages if id(m) not in held]

    def release(self) -> None:
        """Give the buffers back (the batches' arrays must not be read after)."""
        buffers, self.buffers = self.buffers, []
        if self.pool is not None:
            for buffer in buffers:
                self.pool.give(buffer)


class UpdateApplier:
    """Decodes batches of update messages and writes them to the tiers and GPU caches.

    Thread safety: `write`, `begin_reload`, `end_reload` and `swap` exclude each other;
    `prepare` may run anywhere.
    """

    def __init__(self, tiers: Tiers, resolve: Resolve, serves: Serves, stats: UpdateStats, *,
                 key_bytes: int, uint32_keys: bool, gpu_cache_insert: bool,
                 volatile_filters: Sequence[str] = (), persistent_filters: Sequence[str] = ()
                 ) -> None:
        self.tiers = tiers
        self.resolve = resolve
        self.serves = serves
        self.stats = stats
        self.key_bytes = key_bytes
        self.uint32_keys = uint32_keys
        self.gpu_cache_insert = gpu_cache_insert
        self._filters = {
            "volatile": [re.compile(f) for f in volatile_filters],
            "persistent": [re.compile(f) for f in persistent_filters],
        }
        self.buffers = RowBuffers()
        self._lock = threading.Lock()
        self._journals: dict[str, dict[str, list[np.ndarray]]] = {}  # model → table → keys

    # -- step 1: decode -------------------------------------------------------------------

    def prepare(self, messages: Sequence[UpdateMessage]) -> Prepared:
        """The rows of `messages` by table, each table's in one buffer taken from the
        applier's pool (give them back with `Prepared.release`); rejected messages are
        counted and left out, messages of a model not served now are held (see
        Prepared)."""
        groups: dict[tuple[str, int, StorageType],
                     list[tuple[UpdateMessage, np.ndarray]]] = {}
        held: list[UpdateMessage] = []
        for message in messages:
            target = self.resolve(message.topic)
            if target is None:
                if not self.serves(message.topic):
                    held.append(message)
                    continue
                self.stats.rejected(message.topic, "unknown_table",
                                    f"the model has no table {message.topic!r}")
                continue
            try:
                rows = codec.records(message.payload, dim=target.dim,
                                     key_bytes=self.key_bytes)
            except Exception as exc:  # noqa: BLE001 - one message never stops the others
                self._reject(message, exc)
                continue
            groups.setdefault((message.topic, target.dim, target.storage), []).append(
                (message, rows))
        prepared = Prepared([], held, pool=self.buffers)
        for (topic, dim, storage), items in groups.items():
            size = sum(rows.size for _, rows in items)
            buffer = self.buffers.take(size, dim)
            prepared.buffers.append(buffer)
            batch = self._unpack(topic, dim, storage, items, buffer, size)
            if batch.messages:  # else every message of the table was rejected
                prepared.batches.append(batch)
        return prepared

    def _unpack(self, topic: str, dim: int, storage: StorageType,
                items: list[tuple[UpdateMessage, np.ndarray]], buffer: RowBuffer,
                size: int) -> TableBatch:
        """One table's messages (`size` rows in all), copied into `buffer` one after the
        other; a message whose rows fail the checks is counted and overwritten by the
        next. The buffer may be larger than the rows, for rows of another width: only
        its first `size` rows of width `dim` are viewed."""
        keys, vectors = buffer.rows(size, dim)
        end = 0
        last, count = None, 0
        for message, rows in items:
            stop = end + rows.size
            try:
                codec.unpack(rows, keys[end:stop], vectors[end:stop],
                             uint32_keys=self.uint32_keys)
                _check_storage(storage, vectors[end:stop])
            except Exception as exc:  # noqa: BLE001 - one message never stops the others
                self._reject(message, exc)
                continue
            end, last, count = stop, message, count + 1
        return TableBatch(topic, dim, keys[:end], vectors[:end], last, count)

    def _reject(self, message: UpdateMessage, exc: Exception) -> None:
        """Set `message` aside: counted by reason (a failure that is not a bad message:
        "failed"), its id kept as the table's last rejected one, logged (rate-limited)."""
        reason = exc.reason if isinstance(exc, BadUpdateError) else "failed"
        detail = str(exc) if isinstance(exc, BadUpdateError) else f"{type(exc).__name__}: {exc}"
        self.stats.rejected(message.topic, reason, f"{detail} (at {message.position})",
                            position=message.position)

    # -- step 2: write --------------------------------------------------------------------

    def write(self, batches: Sequence[TableBatch]) -> int:
        """Write prepared batches; returns rows written. Raises TierUnavailableError when a
        tier cannot be written (write the same batches again later)."""
        total = 0
        with self._lock:
            for batch in batches:
                target = self.resolve(batch.topic)
                if target is None or target.dim != batch.dim:
                    reason = "unknown_table" if target is None else "value_size"
                    self.stats.rejected(batch.topic, reason, "the table changed while its "
                                        "updates were decoded")
                    continue
                rows = batch.rows
                last = batch.last
                assert last is not None
                try:
                    left_out, kept = self._write_rows(target, batch.keys, batch.vectors)
                except (UnknownTableError, LookupInputError) as exc:
                    self.stats.rejected(batch.topic, "unknown_table", str(exc))
                    continue
                except TierUnavailableError:
                    raise  # the whole batch is written again once the tier is back
                except Exception as exc:  # noqa: BLE001 - one table never stops the others
                    self.stats.rejected(batch.topic, "write_failed",
                                        f"{type(exc).__name__}: {exc} ({batch.messages} "
                                        f"message(s) up to {last.position})",
                                        position=last.position)
                    continue
                journal = self._journals.get(target.model)
                if journal is not None:  # a copy: the batch's buffer is used again
                    journal.setdefault(target.table, []).append(batch.keys.copy())
                if left_out:
                    self.stats.left_out(batch.topic, left_out, kept)
                    if not kept:
                        rows -= left_out
                self.stats.applied(batch.topic, rows, batch.messages,
                                   last.position, last.offset, last.published)
                total += rows
        return total

    def _write_rows(self, target: UpdateTarget, keys: np.ndarray, vectors: np.ndarray
                    ) -> tuple[int, bool]:
        """Persistent tier, volatile tier, GPU caches, in chunks of WRITE_CHUNK_BYTES in
        log order; BULK_ROWS rows or more go to the persistent tier first, whole, as one
        chunk of its bulk path (RocksDB sorts them in memory and ingests a table file).

        A volatile tier at a fixed capacity (a shared hash map table) still overwrites the
        keys it holds and leaves out the rows of new keys. Returns how many rows it left
        out and whether the persistent tier keeps them (lookups then read them there);
        rows no tier keeps go to no GPU cache either, so every path answers alike."""
        persistent = self._tier("persistent", target.topic)
        volatile = self._tier("volatile", target.topic)
        bulk = persistent is not None and keys.size >= BULK_ROWS
        if bulk:
            persistent.load(target.storage_name, [(keys, vectors)])  # type: ignore[union-attr]
        left_out = 0
        step = _chunk_rows(target.dim)
        for start in range(0, keys.size, step):
            k, v = keys[start:start + step], vectors[start:start + step]
            if persistent is not None and not bulk:
                persistent.insert(target.storage_name, k, v)
            missing = None
            if volatile is not None:
                missing = volatile.insert_within_capacity(target.storage_name, k, v)
            if missing is not None:
                left_out += int(missing.sum())
                if persistent is None:
                    k, v = k[~missing], v[~missing]
            if target.write_caches is not None and k.size:
                target.write_caches(*last_rows(k, v))
        return left_out, persistent is not None

    def idle(self) -> None:
        """No messages came: give back the decode buffers, and what the tiers keep
        between writes (RocksDB's encode buffers)."""
        self.buffers.clear()
        for tier in self.tiers:
            tier.trim()

    def _tier(self, role: str, topic: str) -> BulkLoadTier | None:
        """The tier of `role` when it takes updates of `topic` (enabled, writable, and one
        of its update_filters matches)."""
        tier = self.tiers.persistent if role == "persistent" else self.tiers.volatile
        if tier is None or tier.read_only:
            return None
        if not any(f.search(topic) for f in self._filters[role]):
            return None
        return tier

    # -- reloads --------------------------------------------------------------------------

    def begin_reload(self, model: str) -> None:
        """Note the keys of `model`'s updates from now on, for `swap`."""
        with self._lock:
            self._journals[model] = {}

    def end_reload(self, model: str) -> None:
        """Forget the notes of a reload that will not swap (it failed)."""
        with self._lock:
            self._journals.pop(model, None)

    def swap(self, model: str, old: Mapping[str, UpdateTarget],
             new: Mapping[str, UpdateTarget], install: Callable[[], None]) -> None:
        """Copy the rows updated since `begin_reload(model)` from the `old` version's
        tables to the `new` one's (by table name), then `install()` the new version, with
        no update written in between. Raises TierUnavailableError (nothing installed) when
        a tier cannot be read or written."""
        with self._lock:
            journal = self._journals.get(model, {})
            for table, parts in journal.items():
                was, now = old.get(table), new.get(table)
                if was is None or now is None or was.dim != now.dim:
                    continue  # a table the new version lacks, or rows of another width
                keys = np.unique(np.concatenate(parts))
                vectors, found = self._read_back(was, keys)
                if found.any():
                    left_out, kept = self._write_rows(now, keys[found], vectors[found])
                    if left_out:
                        self.stats.left_out(now.topic, left_out, kept)
            install()
            self._journals.pop(model, None)

    def _read_back(self, target: UpdateTarget, keys: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `keys` as updates left them in the tier that took them (the
        persistent one first: it keeps every row)."""
        for role in ("persistent", "volatile"):
            tier = self._tier(role, target.topic)
            if tier is not None:
                return tier.fetch(target.storage_name, keys)
        return np.zeros((keys.size, target.dim), np.float32), np.zeros(keys.size, bool)
