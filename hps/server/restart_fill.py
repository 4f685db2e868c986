"""The volatile tier's rows on a restart over a persistent tier that holds the files.

When the persistent tier already holds a table's files (the loader's fingerprint check:
the same files, sizes and modification times), the loader skips rewriting it, but the
volatile tier (the in-process hash map) starts empty and takes its `initial_cache_rate`
share again. Its rows come from one of two places, chosen per table (`choose_source`):

- **the files**, when the store holds their rows but for keys it can name: the store's
  change log (`BulkLoadTier.changes`; RocksDB: hps.tiers.rocksdb.changes) lists every
  key written or removed since the load (online updates), and the files repeat no key
  (a share of a chunk may hold a repeated key's earlier row, where the store serves its
  last). The files are read as the load read them, at their speed (the load gate
  checked these same files when they were loaded); then the listed keys' rows are read
  from the store by key and written over the files' (where the volatile tier takes a
  share: those of its keys), and the keys the store no longer holds removed. A store
  whose load record has no change log (written by an older `hps`) is taken from the
  files only where its `stored_version` (RocksDB: its table files) is still the one
  recorded right after the load;
- **the store** otherwise (a log that cannot tell: writes it did not note, more than
  half the table's keys changed; no record; repeated keys): where the volatile tier
  takes the whole table, the table is scanned in bulk (`BulkLoadTier.scan`: RocksDB's
  iterators, one snapshot); where it takes a share, the share's keys are the files' and
  their rows are fetched from the store chunk by chunk.

The persistent tier is only read, never written, either way. Each table's log line says
which source filled it, why, and at what rate; `advance` is told the keys filled so far,
chunk by chunk (the load's progress).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.modelfiles.formats import ModelReader
from hps.modelfiles.read_ahead import read_ahead
from hps.server.volatile_share import shares, stored_rows
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import Tier

log = logging.getLogger("hps.server.loader")

#: the load record's key for the persistent tier's `stored_version` right after the load
STORED_VERSION = "stored_version"
#: the load record's key for the token of the store's change log (`note_changes`)
CHANGES = "changes"
#: a change log listing more than this share of a table's keys: the store is scanned
#: instead (reading that many rows by key is no faster)
MOST_CHANGED = 0.5
#: keys read from the store by key at once (the rows of keys the log lists)
_CHANGED_ROWS = 1 << 16
#: the changed keys' rows are read while the files are (on a thread: RocksDB's reads
#: leave the GIL) where they take at most this much memory, else after the files
_EARLY_BYTES = 256 << 20
#: rows a scan of the store hands over at once (a progress count every few 0.1 s)
_SCAN_ROWS = 1 << 17


@dataclass(frozen=True)
class FillSource:
    """Where a restart's volatile rows come from: `source` "files" or "store", and why;
    `changed`: the keys written or removed since the load, read from the store after the
    files (source "files")."""

    source: str
    why: str
    changed: np.ndarray | None = None


def choose_source(persistent: BulkLoadTier, name: str, stored: dict[str, Any] | None
                  ) -> FillSource:
    """The files, with the keys written since the load from the store, when the store
    can name those keys; else the store (see the module's docstring)."""
    if stored is None:
        return FillSource("store", "the store holds no load record of it")
    if int(stored.get("duplicate_keys", 0) or 0):
        return FillSource("store", "its files repeat keys, whose served rows the store holds")
    token = str(stored.get(CHANGES, "") or "")
    if token:
        most = int(int(stored.get("num_keys", 0) or 0) * MOST_CHANGED)
        changed = persistent.changes(name, token, most)
        if changed is None:
            return FillSource("store", "its change log does not tell what was written "
                                       "since the load (more than half the keys, or writes "
                                       "it did not note)")
        if not changed.size:
            return FillSource("files", "the store holds the files' rows, unchanged since "
                                       "the load")
        return FillSource("files", f"the store holds the files' rows but for {changed.size} "
                                   "keys written or removed since the load (online "
                                   "updates), read from it", changed)
    recorded = str(stored.get(STORED_VERSION, "") or "")
    if not recorded:
        return FillSource("store", "its load record does not say what the store held "
                                   "after the load")
    if persistent.stored_version(name) != recorded:
        return FillSource("store", "the store was written since the load (online updates)")
    return FillSource("files", "the store holds the files' rows, unchanged since the load")


def refill_volatile(name: str, reader: ModelReader, volatile: Tier,
                    persistent: BulkLoadTier, stored: dict[str, Any] | None, rate: float,
                    advance: Callable[[int, int], None]) -> FillSource:
    """Write the volatile tier's `rate` share of a table the persistent tier holds, from
    the source `choose_source` names; returns it. `advance(keys, file_bytes)` after each
    chunk written. Raises TierError when the volatile tier cannot take the rows (the
    persistent tier is only read)."""
    started = time.perf_counter()
    choice = choose_source(persistent, name, stored)
    bytes_per_row = reader.num_bytes / max(1, reader.num_keys)
    parts: Iterator[tuple[np.ndarray, np.ndarray]]
    changed = choice.changed
    in_share: list[np.ndarray] | None = None  # the share's changed keys, chunk by chunk
    if choice.source == "files":
        parts = shares(read_ahead(reader.chunks()), rate)  # the next chunk read meanwhile
        if changed is not None and rate < 1.0:
            in_share = []
            parts = _noting_changed(parts, np.sort(changed), in_share)
    elif rate >= 1.0 and persistent.can_scan:
        parts = persistent.scan(name, _SCAN_ROWS)
    else:  # the files' share of each chunk, its rows as the store holds them
        parts = ((keys, stored_rows(persistent, name, keys, rows))
                 for keys, rows in shares(reader.chunks(), rate))
    early = None  # the changed keys' rows, read meanwhile
    if changed is not None and changed.size * 4 * reader.vec_size <= _EARLY_BYTES:
        early = ThreadPoolExecutor(1, thread_name_prefix="hps-changed-rows")
        fetched = early.submit(persistent.fetch, name, changed)
    written = 0
    try:
        for keys, rows in parts:
            volatile.insert(name, keys, rows)
            written += len(keys)
            advance(len(keys), int(len(keys) * bytes_per_row))
    finally:
        if early is not None:
            early.shutdown()
    only = None if in_share is None else np.concatenate([np.empty(0, np.int64), *in_share])
    if early is not None:
        _write_fetched(name, volatile, changed, *fetched.result(), only)  # type: ignore[arg-type]
    elif changed is not None:
        _write_changed(name, volatile, persistent, changed if only is None else only)
    seconds = time.perf_counter() - started
    log.info("%s: the %s tier took %d keys from the %s in %.2fs (%.0f keys/s): %s", name,
             volatile.name, written, choice.source, seconds, written / max(seconds, 1e-9),
             choice.why)
    return choice


def _noting_changed(parts: Iterator[tuple[np.ndarray, np.ndarray]], changed: np.ndarray,
                    found: list[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`parts` as they are, appending to `found` the keys of each that `changed` (sorted)
    holds: the changed keys the volatile share takes."""
    for keys, rows in parts:
        at = np.searchsorted(changed, keys)
        at[at == changed.size] = 0
        found.append(keys[changed[at] == keys])
        yield keys, rows


def _write_changed(name: str, volatile: Tier, persistent: BulkLoadTier, keys: np.ndarray
                   ) -> None:
    """Write the store's rows of `keys` (written or removed since the load) over the
    files' in the volatile tier, and remove those the store no longer holds."""
    for start in range(0, keys.size, _CHANGED_ROWS):  # a loop over chunks, not keys
        part = keys[start:start + _CHANGED_ROWS]
        _write_fetched(name, volatile, part, *persistent.fetch(name, part), None)


def _write_fetched(name: str, volatile: Tier, keys: np.ndarray, rows: np.ndarray,
                   found: np.ndarray, only: np.ndarray | None) -> None:
    """Write `rows` of the `found` `keys` to the volatile tier and remove the others;
    `only`: of `keys`, only those (the volatile share's)."""
    if only is not None:
        taken = np.isin(keys, only)
        keys, rows, found = keys[taken], rows[taken], found[taken]
    if found.any():
        volatile.insert(name, keys[found], rows[found])
    if not found.all():
        volatile.remove(name, keys[~found])
