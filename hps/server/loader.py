"""Loading a model's sparse files into the tiers, chunk by chunk.

One read pass per table feeds both database tiers: every chunk goes wholly into the
persistent tier and `initial_cache_rate` of it into the volatile tier. A load validates
every table's files before it writes anything (each format's reader checks its headers
when it opens; a width other than the config's is the load gate's `width` refusal), so
a malformed model changes nothing; what only the rows can show (a corrupt page, a key
out of range, and the load gate's checks: hps/gate/) fails mid-read, and the server
drops what was written.
The GPU cache is warmed afterwards from a second, short read of the files. Files of any
format come through the ModelReader contract (hps.modelfiles.formats); nothing here knows one.

The volatile tier is a cache over the persistent one: when it cannot take a table (Redis
down, full or read-only), the load goes on without it and says so in the table's source
record (`volatile_error`); the server fills it later (`fill_volatile`). Without a
persistent tier the volatile tier holds the only copy, and its failure fails the load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hps.config import ModelConfig, PSConfig
from hps.errors import ConfigError, HPSError, ModelFileError, TierError
from hps.gate.table_gate import TableGate, width_refusal
from hps.gate.verdict import GateVerdict
from hps.modelfiles.formats import DEFAULT_CHUNK_BYTES, ModelReader, ReadOptions, open_model
from hps.modelfiles.read_ahead import read_ahead
from hps.modelfiles.source import SourceOptions
from hps.rows.storage_types import FLOAT32, StorageType
from hps.runtime.memory_available import available_memory
from hps.server.restart_fill import CHANGES, STORED_VERSION, refill_volatile
from hps.server.source_keys import naming_the_key, source_key
from hps.server.volatile_share import shares, stored_rows, volatile_rows
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import Tier

log = logging.getLogger("hps.server.loader")


class LoadProgress:
    """Receives load progress; the CLI draws a progress bar from it. Methods may no-op."""

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        """A table of `num_keys` keys and `num_bytes` bytes starts loading."""

    def advance(self, keys: int, num_bytes: int) -> None:
        """`keys` more keys (`num_bytes` bytes of files) were written to the tiers."""

    def finish_table(self, table: str, seconds: float) -> None:
        """The table finished loading."""

    def start_step(self, what: str, total: int, unit: str) -> None:
        """A part of the work that counts `total` things other than a table's keys starts
        (a version's lookup paths warmed, workers started): `what` names it, `unit` is
        read after "N of `total`" ("lookups run", "workers ready"). One step at a time: a
        new one replaces the one before."""

    def step(self, done: int) -> None:
        """`done` more of the step's things are done."""

    def finish_step(self, seconds: float) -> None:
        """The step is over, `seconds` after it started: done, or stopped short where
        what it did failed (its count then says how far it got)."""


class BothProgress(LoadProgress):
    """Tells two LoadProgress the same (the server's metrics and the terminal's lines)."""

    def __init__(self, first: LoadProgress, second: LoadProgress) -> None:
        self.first, self.second = first, second

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        self.first.start_table(table, num_keys, num_bytes)
        self.second.start_table(table, num_keys, num_bytes)

    def advance(self, keys: int, num_bytes: int) -> None:
        self.first.advance(keys, num_bytes)
        self.second.advance(keys, num_bytes)

    def finish_table(self, table: str, seconds: float) -> None:
        self.first.finish_table(table, seconds)
        self.second.finish_table(table, seconds)

    def start_step(self, what: str, total: int, unit: str) -> None:
        self.first.start_step(what, total, unit)
        self.second.start_step(what, total, unit)

    def step(self, done: int) -> None:
        self.first.step(done)
        self.second.step(done)

    def finish_step(self, seconds: float) -> None:
        self.first.finish_step(seconds)
        self.second.finish_step(seconds)


@dataclass
class TableSource:
    """Where a loaded table came from, for `hps inspect`, the API and reload checks."""

    uri: str
    num_keys: int
    vec_size: int
    num_bytes: int
    fingerprint: str
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    reused: bool = False
    #: rows whose key another row of the files repeats (validation.duplicates says which
    #: row serves: the last by default)
    duplicate_keys: int = 0
    #: why the volatile tier did not take this load ("" when it did)
    volatile_error: str = ""
    #: the load gate's last verdict on this table (GateVerdict.as_dict()): the load that
    #: made this version, or a later reload it refused (then `served` is false)
    load_gate: dict[str, Any] | None = None
    #: the digest of the version's rows (hps/gate/digest.py): a reload of the version
    #: served before is recognised by it; "" when not known
    rows_digest: str = ""
    #: the opt-ins (allow_empty, allow_shrink) the gate's pass of these rows rested on: a
    #: rollback to them needs the same (GateVerdict.opt_ins); kept with the digest
    rows_opt_ins: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def source_options(config: PSConfig) -> SourceOptions:
    """How the config's model sources are reached (S3 endpoint, timeouts, redirects)."""
    return SourceOptions(s3_endpoint=config.s3_endpoint,
                         connect_timeout=config.source_connect_timeout,
                         read_timeout=config.source_read_timeout,
                         redirect_hosts=frozenset(
                             h.lower() for h in config.source_redirect_hosts))


def open_reader(config: PSConfig, model: ModelConfig, index: int,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ModelReader:
    """Open and validate the files of table `index` of `model`; files whose rows are of
    another width than the config's are the load gate's `width` refusal (LoadGateError)."""
    options = source_options(config)
    width = model.embedding_vecsize_per_table[index]
    read = ReadOptions(width, uint32_keys=not config.supportlonglong, chunk_bytes=chunk_bytes)
    spec = model.table_spec(index)
    try:
        with naming_the_key(source_key(config, model, index)):
            return open_model(spec, read, options)
    except ModelFileError as exc:
        found = _own_width(spec, read, options)
        if found is None or found == width:
            raise
        verdict = GateVerdict(model.model, model.embedding_table_names[index], spec.path)
        raise width_refusal(verdict, found, width) from exc


def _own_width(spec: Any, read: ReadOptions, options: SourceOptions) -> int | None:
    """The width of files that did not open at the config's width, read from the files
    themselves; None when they do not open that way either (the fault is another)."""
    try:
        with open_model(spec, ReadOptions(None, read.uint32_keys, read.chunk_bytes),
                        options) as reader:
            return int(reader.vec_size)
    except HPSError:  # the first error is the one reported
        return None


def open_readers(config: PSConfig, model: ModelConfig, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                 ) -> list[ModelReader]:
    """Open and validate every table's files; raises before anything is written."""
    readers: list[ModelReader] = []
    try:
        for i in range(model.num_tables):
            readers.append(open_reader(config, model, i, chunk_bytes))
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers


def fill_volatile(name: str, reader: ModelReader, volatile: Tier, rate: float,
                  stored: Tier | None = None) -> int:
    """Write the `rate` share of every chunk of a table into the volatile tier, as a load
    does (for a fill after the load, when the tier could not take it then); returns the
    keys written. The rows come from `stored` (the persistent tier, which keeps the rows
    online updates wrote since the load) where it holds them, else from the files.
    Raises TierError when the tier cannot take them."""
    written = 0
    for keys, vectors in shares(reader.chunks(), rate):
        rows = vectors if stored is None else stored_rows(stored, name, keys, vectors)
        volatile.insert(name, keys, rows)
        written += len(keys)
    return written


def served_chunks(name: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]],
                  whole: Tier) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`chunks` of a table's files with each row replaced by the row `whole` (the tier
    holding the whole table: persistent, else volatile) holds for its key, the file's
    where it holds none. A GPU cache warms up from these when the files repeat keys: every
    tier serves a key's last row, which a chunk read before it does not have."""
    for keys, vectors in chunks:
        yield keys, stored_rows(whole, name, keys, vectors)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere a no-op).

    A dropped table frees its arrays, and a load frees its buffers (some on worker
    threads' heaps), but glibc keeps freed heap memory for reuse unless asked; without
    this the RSS of a server stays at its peak after a model is unloaded or loaded.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, looked up once (finding libc runs a subprocess); None elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def check_memory(name: str, rows: int, dim: int, tier: Tier | None,
                 storage: StorageType = FLOAT32) -> None:
    """ConfigError, before anything is allocated, when an in-process tier cannot hold
    `rows` rows of width `dim` (8 bytes of key and the stored row each at least: 4 × dim
    bytes as float32) in the memory available."""
    if tier is None or not tier.in_process or rows <= 0:
        return
    stored = storage if tier.compact_storage else FLOAT32
    need = rows * (8 + stored.row_bytes(dim))
    free = available_memory()
    if free is not None and need > free:
        raise ConfigError(
            f"{name}: {rows:,} keys of width {dim} need at least {need / 2**30:.1f} GiB in "
            f"the in-process {tier.name} tier, and {free / 2**30:.1f} GiB are available: "
            "check embedding_vecsize_per_table, lower volatile_db.initial_cache_rate over a "
            "persistent_db, or use Redis")


def load_table(
    name: str,
    reader: ModelReader,
    volatile: BulkLoadTier | None,
    persistent: BulkLoadTier | None,
    initial_cache_rate: float,
    progress: LoadProgress,
    gate: TableGate,
    *,
    storage: StorageType = FLOAT32,
) -> TableSource:
    """Write one table into the tiers, its rows streamed through `gate` (the load gate:
    hps/gate/); returns its source record, the gate's verdict in `load_gate`.

    The persistent tier is skipped when it already holds these exact files (same
    fingerprint), which makes restarting a server over a filled RocksDB fast; the volatile
    tier then takes its rows from the files where the persistent tier holds them
    unchanged, else from the persistent tier, which keeps the rows online updates wrote
    since the files were loaded (hps.server.restart_fill). A volatile tier that fails
    (TierError) while a persistent tier takes the table is left out of the rest of the
    load: `volatile_error` of the record says why.

    Checks: an in-process tier must have the memory for its rows before any is
    allocated (ConfigError); the gate's checks (non-finite rows, rows a compact `storage`
    cannot hold, repeated keys, and a reload's drift) raise LoadGateError naming the
    check, its figure and its limit. Keys the files hold more than once are counted in
    `duplicate_keys`; under `duplicates: last` every tier keeps the last row of a key (a
    volatile share taken before a later row of its key is written again, from the
    persistent tier), under `first` the gate drops the later rows before any tier sees
    them.
    """
    started = time.perf_counter()
    dim = reader.vec_size
    mark = reader.fingerprint()
    source = TableSource(reader.uri, reader.num_keys, dim, reader.num_bytes, mark)
    for tier in (volatile, persistent):
        if tier is not None:
            tier.create_table(name, dim, storage)

    reuse = False
    stored: dict[str, Any] | None = None
    if persistent is not None:
        stored = persistent.metadata(name) if mark else None
        # a read-only store serves what it holds, and so does one another process of the
        # run wrote the table into whole (its readers read it meanwhile: never rewritten)
        reuse = persistent.read_only or persistent.loaded_elsewhere(name) or (
            stored is not None and stored.get("fingerprint") == mark)
    # Without a persistent tier the volatile tier is the only copy: it takes everything.
    rate = initial_cache_rate if persistent is not None else 1.0
    # a table another process of the run loaded into shared memory is already whole
    write_volatile = (volatile is not None and rate > 0.0
                      and not volatile.loaded_elsewhere(name))

    # progress counts file bytes, which compressed formats do not spend evenly per row
    bytes_per_row = reader.num_bytes / max(1, reader.num_keys)

    read = 0

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        nonlocal read
        # the gate runs on the read-ahead thread: its checks, and the first touch of the
        # chunk's pages, overlap the tiers' writes of the chunk before
        for keys, vectors in read_ahead(gate.check(reader.chunks())):
            read += len(keys)
            if write_volatile and not source.volatile_error:
                m = volatile_rows(len(keys), rate)
                try:
                    rows = vectors[:m]
                    if reuse:  # the store may hold newer rows (online updates) than files
                        rows = stored_rows(persistent, name, keys[:m], rows)  # type: ignore[arg-type]
                    volatile.insert(name, keys[:m], rows)  # type: ignore[union-attr]
                except TierError as exc:
                    if persistent is None:
                        raise TierError(
                            f"the {volatile.name} tier holds the only copy of {name} "  # type: ignore[union-attr]
                            f"(no persistent_db) and cannot take it: {exc}") from exc
                    _leave_out_volatile(source, name, volatile, exc)  # type: ignore[arg-type]
            progress.advance(len(keys), int(len(keys) * bytes_per_row))
            yield keys, vectors

    if write_volatile:
        check_memory(name, volatile_rows(reader.num_keys, rate), dim, volatile, storage)
        volatile.reserve(name, volatile_rows(reader.num_keys, rate))  # type: ignore[union-attr]
    progress.start_table(name, reader.num_keys, reader.num_bytes)
    if persistent is not None and not reuse:
        persistent.drop_table(name)
        persistent.create_table(name, dim, storage)
        if (write_volatile and rate >= 1.0 and volatile.can_export  # type: ignore[union-attr]
                and not (storage.compact and volatile.compact_storage)):  # type: ignore[union-attr]
            # The volatile tier ends up holding the whole table, repeats resolved: read it
            # back in the persistent tier's order instead of sorting a second copy (not
            # when it holds compact rows: the persistent tier keeps the files' float32).
            for _ in chunks():
                pass
            if source.volatile_error:  # it could not take the table after all: the files
                persistent.reserve(name, reader.num_keys)
                persistent.load(name, read_ahead(gate.replay(reader.chunks())))
            else:
                with volatile.sorted_rows(  # type: ignore[union-attr]
                        name, persistent.bulk_sorted) as (keys, rows, positions):
                    persistent.load_sorted(name, keys, rows, positions)
        else:
            persistent.reserve(name, reader.num_keys)
            persistent.load(name, chunks())
        verdict = gate.finish(_distinct_keys(name, persistent))
        source.duplicate_keys = verdict.duplicate_keys
        source.rows_digest = verdict.digest  # recorded with the table, for a restart
        source.rows_opt_ins = verdict.opt_ins
        if (source.duplicate_keys and gate.settings.duplicates == "last" and write_volatile
                and rate < 1.0 and not source.volatile_error):
            _rewrite_share(name, reader, volatile, persistent, rate, source)  # type: ignore[arg-type]
        record = {k: v for k, v in source.as_dict().items()
                  if k not in ("reused", "volatile_error", "load_gate")}
        # what the store holds right after the load, and from now on the keys written to
        # it: a restart fills the volatile tier from the files and those keys' stored
        # rows (hps.server.restart_fill); the mark serves an older `hps` reading the store
        record[STORED_VERSION] = persistent.stored_version(name)
        record[CHANGES] = persistent.note_changes(name)
        persistent.set_metadata(name, record)
    elif write_volatile and reuse and stored is not None:
        try:  # the persistent tier is only read: from its rows or, unchanged, the files'
            refill_volatile(name, reader, volatile, persistent, stored, rate,  # type: ignore[arg-type]
                            progress.advance)
        except TierError as exc:
            _leave_out_volatile(source, name, volatile, exc)  # type: ignore[arg-type]
        verdict = gate.finish(_stored_keys(stored), reused=True,
                              digest=str(stored.get("rows_digest", "")),
                              passed_with=_stored_opt_ins(stored))
    elif write_volatile:
        for _ in chunks():
            pass
        # without a persistent tier the volatile tier holds the whole table
        verdict = gate.finish(_distinct_keys(name, volatile) if persistent is None else None,
                              passed_with=_stored_opt_ins(stored) if reuse else ())
        source.duplicate_keys = verdict.duplicate_keys
    else:  # the persistent tier held these files and no volatile tier takes a share
        verdict = gate.finish(_stored_keys(stored) if stored is not None
                              else _distinct_keys(name, volatile), reused=True,
                              digest=str((stored or {}).get("rows_digest", "")),
                              passed_with=_stored_opt_ins(stored))
    if reuse and stored is not None:
        source.duplicate_keys = verdict.duplicate_keys = int(stored.get("duplicate_keys", 0))
    source.rows_digest = verdict.digest
    source.rows_opt_ins = verdict.opt_ins
    source.reused = reuse
    source.load_gate = verdict.as_dict()
    return_freed_memory()  # the load's buffers: the process keeps what the tiers hold
    source.load_seconds = time.perf_counter() - started
    progress.finish_table(name, source.load_seconds)
    log.info("loaded %s: %d keys, width %d, %.2fs%s", name, reader.num_keys, dim,
             source.load_seconds, " (persistent tier already held it)" if reuse else "")
    return source


def _leave_out_volatile(source: TableSource, name: str, volatile: Tier, exc: TierError
                        ) -> None:
    """The load goes on without the volatile tier, which says why in the source record
    (the server fills it once it can)."""
    source.volatile_error = str(exc)
    log.warning("%s: the %s tier cannot take it now (%s); loading on without it, it is "
                "filled once it can", name, volatile.name, exc)


def _rewrite_share(name: str, reader: ModelReader, volatile: Tier, persistent: Tier,
                   rate: float, source: TableSource) -> None:
    """Write the volatile tier's share of a table whose files repeat keys again, with the
    rows the persistent tier kept.

    A share of each chunk went to the volatile tier as it was read, so a key's earlier
    row may be in it while its last row, later in the files, was not. Every tier serves
    the last row of a key (RocksDB kept it), so the share is written again from there:
    a second read of the files, only for tables with repeated keys.
    """
    try:
        fill_volatile(name, reader, volatile, rate, stored=persistent)
    except TierError as exc:
        _leave_out_volatile(source, name, volatile, exc)


def _stored_opt_ins(stored: dict[str, Any] | None) -> list[str]:
    """The opt-ins recorded with a table's stored rows (none in a store written before
    they were recorded, or of another shape)."""
    recorded = (stored or {}).get("rows_opt_ins")
    return [str(name) for name in recorded] if isinstance(recorded, list) else []


def _stored_keys(stored: dict[str, Any]) -> int | None:
    """The distinct keys of the files a persistent tier's record says it holds (rows less
    repeats), None for a record without them; counting the tier instead would read
    every key of it."""
    try:
        return int(stored["num_keys"]) - int(stored.get("duplicate_keys", 0))
    except (KeyError, TypeError, ValueError):
        return None


def _distinct_keys(name: str, whole: Tier | None) -> int | None:
    """The keys the tier holding the whole table has (the rows read less the repeats of
    a key); None when it cannot tell (Redis gone since: the count is unknown, not an error
    of the load)."""
    if whole is None:
        return None
    try:
        return int(whole.size(name))
    except TierError:
        return None
