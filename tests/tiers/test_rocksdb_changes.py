"""The RocksDB tier's change log (hps.tiers.rocksdb.changes): the keys written or removed
since a table's load, and when it cannot tell. Real stores in temporary directories; a
crash is a child process that ends without closing its store."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hps.config import PersistentDBConfig
from hps.tiers.rocksdb import changes
from hps.tiers.rocksdb.tier import RocksDBTier

T = "hps_et.model.table0"
OTHER = "hps_et.model.table0~next"  # a name that starts with T's: its notes are its own


def open_tier(store: Path) -> RocksDBTier:
    return RocksDBTier(PersistentDBConfig.model_validate({"type": "rocks_db",
                                                          "path": str(store)}))


def loaded(store: Path, rng: np.random.Generator, n: int = 3000
           ) -> tuple[RocksDBTier, str, np.ndarray]:
    """A store whose table T was loaded with `n` keys and noted since: (tier, token, keys)."""
    tier = open_tier(store)
    tier.create_table(T, 4)
    keys = rng.choice(np.int64(2**40), n, replace=False)
    tier.load(T, [(keys, rng.standard_normal((n, 4)).astype(np.float32))])
    return tier, tier.note_changes(T), keys


def reopened(tier: RocksDBTier) -> RocksDBTier:
    """The store closed (its memtables flushed) and opened again."""
    tier.close()
    gc.collect()
    return open_tier(Path(tier.path))


def test_every_write_after_the_load_is_noted_and_nothing_before(
        tmp_path: Path, rng: np.random.Generator) -> None:
    tier, token, keys = loaded(tmp_path / "rocks", rng)
    tier.create_table(OTHER, 4)
    other = tier.note_changes(OTHER)
    tier.insert(OTHER, keys[:5], np.ones((5, 4), np.float32))
    tier = reopened(tier)
    try:
        assert tier.changes(T, token, 100) is not None
        assert tier.changes(T, token, 100).size == 0  # type: ignore[union-attr]
        fresh = np.arange(10, dtype=np.int64) - 5  # keys the load did not write
        tier.insert(T, np.concatenate([keys[:20], fresh]), np.zeros((30, 4), np.float32))
        tier.remove(T, keys[100:110])
        tier.load(T, [(keys[200:300], np.zeros((100, 4), np.float32))])  # an ingestion
        tier = reopened(tier)
        expected = np.unique(np.concatenate([keys[:20], fresh, keys[100:110], keys[200:300]]))
        noted = tier.changes(T, token, 1000)
        assert noted is not None
        np.testing.assert_array_equal(np.sort(noted), expected)
        assert tier.changes(T, token, expected.size - 1) is None  # more than `most`
        assert tier.changes(T, "another load", 1000) is None
        np.testing.assert_array_equal(np.sort(tier.changes(OTHER, other, 10)),  # type: ignore[arg-type]
                                      np.sort(keys[:5]))
        # a drop forgets them: a new load starts with none, under a new token
        tier.drop_table(T)
        tier.create_table(T, 4)
        assert tier.changes(T, token, 1000) is None
        tier.load(T, [(keys, np.zeros((keys.size, 4), np.float32))])  # not noted: a load
        again = tier.note_changes(T)
        tier = reopened(tier)
        assert tier.changes(T, again, 1000).size == 0  # type: ignore[union-attr]
    finally:
        tier.close()


def test_a_key_written_again_and_again_is_merged_into_one_note(
        tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(changes, "MERGE_KEYS", 100)
    tier, token, keys = loaded(tmp_path / "rocks", rng)
    try:
        for _ in range(30):  # 30 writes of the same 10 keys: merged every 100 keys noted
            tier.insert(T, keys[:10], np.zeros((10, 4), np.float32))
        tier.insert(T, keys[10:12], np.zeros((2, 4), np.float32))
        records = list(tier._changes._cf.keys(from_key=T.encode() + b"\0\1"))  # noqa: SLF001
        assert 1 < len([r for r in records if r.startswith(T.encode() + b"\0\1")]) < 10
        tier = reopened(tier)
        np.testing.assert_array_equal(tier.changes(T, token, 100), np.sort(keys[:12]))
    finally:
        tier.close()


def test_writes_the_log_did_not_note_make_it_answer_none(
        tmp_path: Path, rng: np.random.Generator) -> None:
    tier, token, keys = loaded(tmp_path / "rocks", rng)
    try:
        tier.insert(T, keys[:3], np.zeros((3, 4), np.float32))
        assert tier.changes(T, token, 10) is None  # rows in a memtable: no file tells
        tier = reopened(tier)
        assert tier.changes(T, token, 10) is not None
        raw = tier.raw_table(T)
        raw[keys[5:6].tobytes()] = np.zeros(4, np.float32).tobytes()  # not through the tier
        del raw
        tier = reopened(tier)
        assert tier.changes(T, token, 10) is None  # newer rows than the log covers
    finally:
        tier.close()


_CRASH = """
import os, sys
import numpy as np
from hps.config import PersistentDBConfig
from hps.tiers.rocksdb import changes
from hps.tiers.rocksdb.tier import RocksDBTier
tier = RocksDBTier(PersistentDBConfig(type="rocks_db", path=sys.argv[1]))
keys = np.array([int(k) for k in sys.argv[3:]], np.int64)
tier.create_table({T!r}, 4)
if sys.argv[2] == "insert":
    tier.insert({T!r}, keys, np.full((keys.size, 4), 9, np.float32))
else:  # the keys of an ingestion noted, and the process gone before the ingestion
    tier._changes.add_synced({T!r}, keys)
os._exit(0)  # no close, no flush
"""


def test_a_crash_leaves_every_row_written_noted(tmp_path: Path,
                                                rng: np.random.Generator) -> None:
    store = tmp_path / "rocks"
    tier, token, keys = loaded(store, rng)
    tier.close()
    gc.collect()
    script = textwrap.dedent(_CRASH.format(T=T))
    for how, chosen in (("insert", keys[:4]), ("noted only", keys[10:12])):
        subprocess.run([sys.executable, "-c", script, str(store), how,
                        *map(str, chosen)], check=True, timeout=120)
    tier = open_tier(store)
    try:
        tier.create_table(T, 4)
        noted = tier.changes(T, token, 100)
        assert noted is not None  # the WAL's rows went to a table file at the opening
        np.testing.assert_array_equal(np.sort(noted), np.sort(keys[[0, 1, 2, 3, 10, 11]]))
        rows, found = tier.fetch(T, keys[:4])
        assert found.all() and (rows == 9).all()
    finally:
        tier.close()


def test_updates_leave_at_most_max_wal_mb_of_log_and_every_row_survives_a_reopen(
        tmp_path: Path, rng: np.random.Generator) -> None:
    # Each update writes the table's rows and, in hps_changes, their keys: 1/33 of the
    # bytes. RocksDB deletes a log file once every column family's rows in it are in
    # table files, so without a bound the keys' memtable kept every update's log.
    store = tmp_path / "rocks"
    tier = RocksDBTier(PersistentDBConfig.model_validate(
        {"type": "rocks_db", "path": str(store), "max_wal_mb": 4}))
    tier.create_table(T, 64)
    keys = rng.choice(np.int64(2**40), 4096, replace=False)
    tier.load(T, [(keys, np.zeros((keys.size, 64), np.float32))])
    token = tier.note_changes(T)
    try:
        for round_ in range(48):  # 1 MiB of rows a round, the same keys over and over
            tier.insert(T, keys, np.full((keys.size, 64), round_, np.float32))
        # Past the bound a write starts a flush in the background, and the log files it
        # covers are deleted once it is done: how far the log runs past the bound
        # meanwhile depends on the machine, where it settles does not (the bound and the
        # writes since the last flush; 48 MiB of log for good without the bound).
        assert _settled_log_bytes(store, below=2 * (4 << 20)) < 2 * (4 << 20)
        assert (tier.fetch(T, keys)[0] == 47).all()
        tier = reopened(tier)
        rows, found = tier.fetch(T, keys)
        assert found.all() and (rows == 47).all()
        np.testing.assert_array_equal(tier.changes(T, token, keys.size), np.sort(keys))
    finally:
        tier.close()


def test_a_flush_takes_every_table_and_leaves_no_log_to_replay(
        tmp_path: Path, rng: np.random.Generator) -> None:
    # A follower worker opens a new secondary instance at each change of the table
    # files, replaying every log file kept: the keys noted in hps_changes kept the rows'
    # log after the table's flush (here an ingestion's), so the replays grew with it.
    tier, _, keys = loaded(tmp_path / "rocks", rng, 4096)
    try:
        for round_ in range(4):  # 4 x 64 KiB of rows and their keys, in the log
            tier.insert(T, keys, np.full((keys.size, 4), round_, np.float32))
        assert _log_bytes(tmp_path / "rocks") > 4 * keys.size * 4 * 4
        tier.load(T, [(keys[:10], np.full((10, 4), -1, np.float32))])  # flushes T first
        # what was written after: a record (the flushed log's deletion may trail it)
        assert _settled_log_bytes(tmp_path / "rocks", below=4096) < 4096
    finally:
        tier.close()


def test_a_run_leader_leaves_no_log_to_replay_when_it_makes_a_table_or_ingests(
        tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    # A follower opens a new secondary instance at each such edit, replaying the log
    # with the GIL held: a reload under online updates replayed up to max_wal_mb several
    # times (0.5-0.6 s each for 50 MiB), as a table made or ingested into flushes
    # nothing of the others (a new table's memtable is empty).
    from hps.runtime.run_dir import RUN_DIR_ENV
    from hps.tiers.rocksdb.secondary import WORKER_ENV

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(WORKER_ENV, "0")
    store = tmp_path / "rocks"
    tier, _, keys = loaded(store, rng, 4096)
    try:
        def updates(value: int) -> None:  # 4 x 64 KiB of rows, in the log
            for _ in range(4):
                tier.insert(T, keys, np.full((keys.size, 4), value, np.float32))
            assert _log_bytes(store) > 4 * keys.size * 4 * 4

        updates(1)
        tier.create_table(OTHER, 4)  # a table made
        assert _settled_log_bytes(store, below=4096) < 4096
        updates(2)
        tier.load(OTHER, [(keys, np.full((keys.size, 4), 3, np.float32))])  # an ingestion
        assert _settled_log_bytes(store, below=4096) < 4096
        updates(4)
        tier.drop_table(OTHER)
        assert _settled_log_bytes(store, below=4096) < 4096
        rows, found = tier.fetch(T, keys)
        assert found.all() and (rows == 4).all()
    finally:
        tier.close()


def _log_bytes(store: Path) -> int:
    """Bytes of the store's log files (one RocksDB deletes meanwhile counts none)."""
    total = 0
    for log in store.glob("*.log"):  # a loop over files
        with contextlib.suppress(FileNotFoundError):
            total += log.stat().st_size
    return total


def _settled_log_bytes(store: Path, below: int) -> int:
    """Log bytes once they are under `below`, or after a minute of waiting for it.

    RocksDB deletes the log files a flush covers after it, in the background."""
    deadline = time.monotonic() + 60
    while (size := _log_bytes(store)) >= below and time.monotonic() < deadline:
        time.sleep(0.05)
    return size
