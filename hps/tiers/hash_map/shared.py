"""The hash map in shared memory (`volatile_db.type` "multi_process_hash_map", HugeCTR's
name): `SharedHashMapTier`, one table held once for every process of a host.

It is the in-process tier (`HashMapTier`: the same kernels, contracts and storage types)
over tables that are `SharedTable` files (hps/tiers/hash_map/shared_table.py) in the
run folder (hps/runtime/run_dir.py). `hps serve --workers N` uses it for the in-process
tier; a process serving one by itself makes its own run folder and removes it at close.

Roles. The run's leader (worker 0, or a process on its own) makes the tables, loads
them and applies every write (online updates, removals); the other processes (followers)
map the tables the leader made and only read them: their inserts and removes raise
TierError. A table's file is named after its storage name up to a '~' (the staging
suffix of a version loaded beside the served one) and its `generation`, which the
processes of a run set alike before each load (the op that made that version), so every
process finds the same file whatever storage name its registry gave the version. Outside
a run (`generation` None) every table gets a file of its own. A table already in the run
folder when the leader creates it (a restarted leader replaying the ops its predecessor
completed) is mapped, not made again: `loaded_elsewhere` tells the loader to skip its
rows. The file of an op its predecessor did not complete is another matter: it may hold
part of the rows, and a sequence counter left odd by a write that never ended; the
leader removes it (`remove_unfinished`) before it applies that op again.

Reads never see a torn row: each table's writes go under its sequence counter and a
reader in another process fetches again when a write overlapped its fetch (the
seqlock of shared_table.py); readers in the writing process hold the table's read lock,
as in the in-process tier.

Capacity is fixed once a follower maps a table (its file cannot move under the others):
a load's `reserve` makes it the load's rows plus `shared_headroom` of them; an insert
past it is refused whole (SharedTableFullError) and counted (`refused_inserts` in
`stats()`); an update's write (`insert_within_capacity`) still overwrites the rows the
table holds and leaves out only the new keys, which the persistent tier keeps. No
overflow policy: a bounded `overflow_margin` is a ConfigError.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from hps.config import VolatileDBConfig
from hps.errors import ConfigError, TierError
from hps.rows.storage_types import FLOAT32, StorageType
from hps.runtime import run_dir
from hps.runtime.compiled import compile_declared
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import as_rows
from hps.tiers.hash_map import loops as kernels
from hps.tiers.hash_map.shared_table import SharedTable, SharedTableFullError
from hps.tiers.hash_map.table import Table
from hps.tiers.hash_map.tier import HashMapTier

#: the environment variable that makes a process of a run a follower (any value but "0")
FOLLOWER_ENV = "HPS_WORKER_INDEX"
#: seconds a follower waits for the leader's file of a table to appear
ATTACH_WAIT = 10.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def is_leader() -> bool:
    """Whether this process writes the shared tables of its run (worker 0, or alone)."""
    return os.environ.get(FOLLOWER_ENV, "0") == "0"


class SharedHashMapTier(HashMapTier):
    """The hash map tier over tables in shared memory (`multi_process_hash_map`).

    `SharedHashMapTier(config, *, folder=None, leader=None)`: `folder` is the run folder
    (default `$HPS_RUN_DIR`, else a new one owned and removed by this tier); `leader`
    defaults to `is_leader()`.
    """

    shared = True

    def __init__(self, config: VolatileDBConfig | None = None, *, folder: Path | None = None,
                 leader: bool | None = None, seed: int | None = None) -> None:
        super().__init__(config, seed=seed)
        if self.overflow.bounded:
            raise ConfigError(
                "volatile_db: a multi_process_hash_map has a fixed capacity and refuses "
                "inserts past it; it keeps no overflow policy, so overflow_margin must be "
                "left unbounded")
        self.can_export = True
        self.leader = is_leader() if leader is None else leader
        self.headroom = float(self.config.shared_headroom)
        found = folder or run_dir.current_run_dir()
        self._owned_folder = found is None
        self.folder = run_dir.create_run_dir(private=True) if found is None else found
        self.segments = self.folder / "tables"
        self.segments.mkdir(exist_ok=True)
        #: set alike in every process of a run before a load (see the module docstring)
        self.generation: int | None = None
        self._local = itertools.count()
        self._attached: set[str] = set()  # tables whose rows another process wrote
        self._made_here: dict[str, Path] = {}

    # -- tables -------------------------------------------------------------------------

    def segment_path(self, table: str) -> Path:
        """The file of the version of `table` this process would make or map now."""
        if self.generation is None:
            return self._path(f"{table}#{os.getpid()}.{next(self._local)}")
        return self._generation_path(table, self.generation)

    def _generation_path(self, table: str, generation: int) -> Path:
        return self._path(f"{table.split('~', 1)[0]}#g{generation}")

    def _path(self, key: str) -> Path:
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        return self.segments / f"{_UNSAFE.sub('_', key.split('#')[0])[:80]}.{digest}"

    def create_table(self, table: str, dim: int, storage: StorageType | str = FLOAT32
                     ) -> None:
        """Make (leader) or map (follower) the file of `table`; keeps a table this tier
        already has. Raises ConfigError for a width or storage type other than the
        existing table's, TierError when a follower finds no file to map."""
        dim, kind = HashMapTier.table_kind(table, dim, storage)
        with self._tables_lock:
            existing = self._tables.get(table)
            if existing is None:
                existing = self._open(table, dim, kind)
                self._tables[table] = existing
                BulkLoadTier.create_table(self, table, dim, kind)
        if existing.dim != dim or existing.storage is not kind:
            raise ConfigError(
                f"multi_process_hash_map table {table!r} holds {existing.storage.name} rows "
                f"of width {existing.dim}, not {kind.name} of width {dim}: drop it first")

    def _open(self, table: str, dim: int, kind: StorageType) -> SharedTable:
        path = self.segment_path(table)
        if path.exists() or not self.leader:
            t = SharedTable.attach(path, wait=0.0 if self.leader else ATTACH_WAIT)
            self._attached.add(table)
        else:
            t = SharedTable.create(path, dim, kind, self.overflow.num_partitions)
        if self.leader:
            self._made_here[table] = path
        return t

    def remove_unfinished(self, table: str, generation: int) -> None:
        """Remove the file of `table` at `generation` that a leader which died before it
        completed that generation's op left behind (the leader, before it applies the op
        again). No other process maps it: they map a generation's files only once its
        op has an outcome, which a dead leader never wrote."""
        if not self.leader:
            raise TierError("only the run's leader (worker 0) removes shared tables")
        path = self._generation_path(table, generation)
        with self._tables_lock:
            if path in self._made_here.values():
                return  # made by this process: not a leftover
        path.unlink(missing_ok=True)

    def loaded_elsewhere(self, table: str) -> bool:
        """Whether `table`'s rows were written by another process (a load skips them)."""
        return table in self._attached

    def drop_table(self, table: str) -> None:
        """Forget `table`; the leader also removes its file (processes that map it keep
        their mapping until they drop it too)."""
        with self._tables_lock:
            t = self._tables.pop(table, None)
            self._attached.discard(table)
            path = self._made_here.pop(table, None)
            BulkLoadTier.drop_table(self, table)
        if isinstance(t, SharedTable):
            t.close()
        if path is not None:
            path.unlink(missing_ok=True)

    # -- data ---------------------------------------------------------------------------

    def _fetch(self, t: Table, keys: np.ndarray, out: np.ndarray, found: np.ndarray) -> None:
        """The in-process fetch, again while a write of another process overlapped it."""
        t.read_stable(lambda: HashMapTier._fetch(self, t, keys, out, found))  # type: ignore[attr-defined]

    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """The in-process insert under the table's sequence counter. Raises TierError in
        a follower, SharedTableFullError (nothing written) past the table's capacity."""
        self._insert(table, keys, vectors, whole=True)

    def insert_within_capacity(self, table: str, keys: np.ndarray, vectors: np.ndarray
                               ) -> np.ndarray | None:
        """`insert`, except past the table's capacity: the rows of keys it holds are
        written all the same (an overwrite needs no room) and every row of a key it lacks
        is left out, counted as a refused insert. Returns which rows were left out, None
        when every row was written."""
        return self._insert(table, keys, vectors, whole=False)

    def _insert(self, table: str, keys: np.ndarray, vectors: np.ndarray, whole: bool
                ) -> np.ndarray | None:
        t = self._writable(table)
        k, v = as_rows(keys, vectors, t.dim)
        left_out = None
        if not k.size:
            return left_out
        with t.writer:
            if not t.room_for(k.size):
                absent = np.empty(k.size, np.bool_)
                new = int(kernels.mark_absent(t.slots, t.keys, t.row_bits, k, absent))
                if not t.room_for(new):
                    with t.lock.write():
                        t.begin_write()
                        try:
                            t.grow(new)  # in place, moved (nobody maps it yet), or refused
                        except SharedTableFullError:
                            if whole:
                                raise
                            # every row of a new key, so a repeated key never keeps an
                            # older row of the batch than the tier below got
                            left_out = absent
                        finally:
                            t.end_write()
            if left_out is not None:
                k, v = k[~left_out], v[~left_out]
                if not k.size:
                    return left_out
            t.begin_write()
            try:
                super().insert(table, k, v)
            finally:
                t.end_write()
        return left_out

    def warm_writes(self, table: str) -> None:
        """The in-process tier's, and the count of new keys a batch past the room left
        takes (an update round of 70,000 rows compiled it after ready)."""
        super().warm_writes(table)
        compile_declared(kernels.mark_absent)

    def remove(self, table: str, keys: np.ndarray) -> int:
        """The in-process removal under the table's sequence counter (TierError in a
        follower)."""
        t = self._writable(table)
        with t.writer:
            t.begin_write()
            try:
                return super().remove(table, keys)
            finally:
                t.end_write()

    def reserve(self, table: str, num_keys: int) -> None:
        """Room for `num_keys` keys and the headroom, before any process maps the table
        (a hint once one does)."""
        t = self._tables.get(table) or self._table(table)
        if table in self._attached:
            return
        t.lock.acquire_write()
        try:
            t.reserve(int(num_keys), self.headroom)  # type: ignore[call-arg]
        finally:
            t.lock.release_write()

    def _writable(self, table: str) -> SharedTable:
        t = self._tables.get(table) or self._table(table)
        if not self.leader:
            raise TierError(f"{table!r}: this process only reads the shared tables; the "
                            "run's leader (worker 0) writes them")
        return t  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        """The hash map's stats, plus inserts refused because a table was full."""
        with self._tables_lock:
            tables = list(self._tables.values())
        refused = sum(t.refused for t in tables if isinstance(t, SharedTable))
        return {**super().stats(), "refused_inserts": refused}

    def close(self) -> None:
        """Forget every table; the leader removes the files it made; a run folder this
        tier made goes too."""
        with self._tables_lock:
            tables = list(self._tables.values())
            made = list(self._made_here.values())
            self._made_here.clear()
            self._attached.clear()
        super().close()
        for t in tables:
            if isinstance(t, SharedTable):
                t.close()
        if self.leader:
            for path in made:
                path.unlink(missing_ok=True)
        if self._owned_folder:
            run_dir.remove_run_dir(self.folder)
