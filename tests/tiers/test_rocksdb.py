"""The RocksDB tier beyond the Tier contract (tests/tiers/test_tier_contract.py), on real
stores in temporary directories: key bytes, HugeCTR layout, persistence, read-only,
bulk loads through SST ingestion, threads."""

from __future__ import annotations

import gc
import logging
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rocksdict

from hps.config import PersistentDBConfig
from hps.errors import LookupInputError, StoreInUseError, TierError, TierSetupError
from hps.tiers.rocksdb.store import CHANGES_CF, writer_of
from hps.tiers.rocksdb.tier import META_CF, RocksDBTier, key_bytes
from tests.support.rows import vectors_of

T = "hps_et.model.table0"


def config(path: Path, **kw: Any) -> PersistentDBConfig:
    return PersistentDBConfig.model_validate({"type": "rocks_db", "path": str(path), **kw})


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "rocks"


@pytest.fixture
def tier(store: Path) -> Iterator[RocksDBTier]:
    t = RocksDBTier(config(store))
    t.create_table(T, 4)
    yield t
    t.close()


def reopen(tier: RocksDBTier, **kw: Any) -> RocksDBTier:
    path = Path(tier.path)
    tier.close()
    gc.collect()
    return RocksDBTier(config(path, **kw))


def test_key_bytes_keep_trailing_zero_bytes() -> None:
    keys = np.array([0, 1, 256, -1, 2**63 - 1, -(2**63)], dtype=np.int64)
    raw = key_bytes(keys)
    assert all(type(b) is bytes and len(b) == 8 for b in raw)
    assert raw == [struct.pack("<q", int(k)) for k in keys]


def test_many_keys_over_several_multi_gets(store: Path) -> None:
    tier = RocksDBTier(config(store, max_batch_size=100, num_threads=4))
    tier.create_table(T, 3)
    keys = np.random.default_rng(1).integers(-(2**62), 2**62, 5000)
    tier.insert(T, keys, vectors_of(keys, 3))
    query = np.concatenate([keys[::-1], keys[:100] + 1])
    got, found = tier.fetch(T, query)
    present = np.isin(query, keys)
    assert np.array_equal(found, present)
    assert np.array_equal(got[found], vectors_of(query[found], 3))
    tier.close()


def test_rows_of_another_width_fall_through(tier: RocksDBTier,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Values of another width answer "not found" (the key gets the default value), are
    counted as failures of kind bad_row and logged once per minute."""
    tier.insert(T, np.array([1, 2]), np.ones((2, 4)))
    tier = reopen(tier)
    tier.create_table(T, 8)  # keeps the 4-wide contents
    caplog.set_level(logging.WARNING, logger="hps.tiers.rocksdb.tier")
    for _ in range(2):
        vectors, found = tier.fetch(T, np.array([1, 2, 1]))
        assert not found.any() and not vectors.any()
    assert tier.stats()["failures"] == {"bad_row": 4}
    assert [r.getMessage() for r in caplog.records if "not 8 float32 wide" in r.getMessage()
            ] and len(caplog.records) == 1
    tier.close()


# -- persistence and layout ------------------------------------------------------------


def test_reopen_keeps_tables_widths_and_metadata(tier: RocksDBTier) -> None:
    keys = np.arange(-50, 50)
    tier.create_table("hps_et.model.empty", 2)
    tier.insert(T, keys, vectors_of(keys, 4))
    tier.set_metadata(T, {"uri": "s3://bucket/t0", "num_keys": 100})
    tier = reopen(tier)
    assert tier.stored_tables() == ["hps_et.model.empty", T]
    assert tier.tables() == [T]  # the empty one's width is unknown until created
    assert tier.dim(T) == 4
    assert tier.metadata(T) == {"uri": "s3://bucket/t0", "num_keys": 100}
    assert tier.metadata("hps_et.model.empty") is None
    got, found = tier.fetch(T, keys)
    assert found.all() and np.array_equal(got, vectors_of(keys, 4))
    assert tier.size(T) == 100
    tier.close()


def test_layout_is_hugectrs(tier: RocksDBTier) -> None:
    keys = np.array([1, 256, -2])
    vecs = vectors_of(keys, 4)
    tier.insert(T, keys, vecs)
    tier.set_metadata(T, {"a": 1})
    path = tier.path
    tier.close()
    gc.collect()
    options = rocksdict.Options(raw_mode=True)
    assert set(rocksdict.Rdict.list_cf(path, options)) == {"default", T, META_CF, CHANGES_CF}
    db = rocksdict.Rdict(path, options, column_families={
        T: options, META_CF: options, CHANGES_CF: options})
    cf = db.get_column_family(T)
    stored = dict(cf.items())
    assert stored == {struct.pack("<q", int(k)): v.tobytes() for k, v in zip(keys, vecs,
                                                                            strict=True)}
    assert db.get_column_family(META_CF)[T.encode()] == b'{"a": 1}'
    del cf
    db.close()


def test_serves_a_store_written_in_hugectr_layout(store: Path) -> None:
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    db = rocksdict.Rdict(str(store), options)
    cf = db.create_column_family(T, options)
    for k in (7, 8, 2**40):
        cf[struct.pack("<q", k)] = struct.pack("<3f", k, k + 0.5, -k)
    del cf
    db.close()
    gc.collect()
    tier = RocksDBTier(config(store))
    assert tier.tables() == [T] and tier.dim(T) == 3
    got, found = tier.fetch(T, np.array([8, 9, 2**40]))
    assert found.tolist() == [True, False, True]
    assert got[0].tolist() == [8.0, 8.5, -8.0]
    tier.close()


def test_drop_table_removes_column_family_and_metadata(tier: RocksDBTier) -> None:
    tier.insert(T, np.array([1]), np.ones((1, 4)))
    tier.set_metadata(T, {"a": 1})
    tier.drop_table(T)
    assert T not in tier.stored_tables() and tier.metadata(T) is None
    tier = reopen(tier)
    assert T not in tier.stored_tables()
    tier.close()


def test_second_writer_is_refused(tier: RocksDBTier) -> None:
    assert writer_of(tier.path) == os.getpid()
    with pytest.raises(TierSetupError, match="cannot open RocksDB.*this process"):
        RocksDBTier(config(Path(tier.path)))


def test_a_writer_in_another_process_is_named_and_its_files_are_left_alone(
        store: Path) -> None:
    """A store another process has open for writing: `writer_of` names that process, and
    a second writer is refused, naming it and the read-only ways, before RocksDB writes
    anything in the store (its info log is not rotated); a read-only open reads it."""
    RocksDBTier(config(store)).close()
    assert writer_of(str(store)) is None and writer_of(str(store / "none")) is None
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hps.config import PersistentDBConfig; "
         "from hps.tiers.rocksdb.tier import RocksDBTier; import numpy as np; "
         f"t = RocksDBTier(PersistentDBConfig(path={str(store)!r})); t.create_table({T!r}, 4); "
         f"t.insert({T!r}, np.arange(3), np.ones((3, 4), np.float32)); t._db.flush(True); "
         "print('open', flush=True); sys.stdin.read(); t.close()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[2])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        before = sorted((p.name, p.stat().st_mtime_ns) for p in store.iterdir())
        assert writer_of(str(store)) == holder.pid
        with pytest.raises(StoreInUseError) as refused:
            RocksDBTier(config(store))
        message = str(refused.value)
        assert f"process {holder.pid}" in message and "\n" not in message
        assert "persistent_db.read_only" in message
        assert sorted((p.name, p.stat().st_mtime_ns) for p in store.iterdir()) == before
        reader = RocksDBTier(config(store, read_only=True))
        try:
            _, found = reader.fetch(T, np.arange(5))
            assert found.tolist() == [True, True, True, False, False]
        finally:
            reader.close()
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0 and writer_of(str(store)) is None


# -- read-only -------------------------------------------------------------------------


def test_read_only(tier: RocksDBTier) -> None:
    tier.insert(T, np.array([1, 2]), np.ones((2, 4)))
    tier.set_metadata(T, {"a": 1})
    ro = reopen(tier, read_only=True)
    assert ro.read_only
    assert ro.fetch(T, np.array([1, 3]))[1].tolist() == [True, False]
    assert ro.metadata(T) == {"a": 1} and ro.size(T) == 2
    ro.create_table(T, 4)  # an existing table is fine
    writes = [
        lambda: ro.insert(T, np.array([5]), np.ones((1, 4))),
        lambda: ro.remove(T, np.array([1])),
        lambda: ro.load(T, [(np.array([5]), np.ones((1, 4)))]),
        lambda: ro.drop_table(T),
        lambda: ro.set_metadata(T, {}),
    ]
    for write in writes:
        with pytest.raises(TierSetupError, match="open read-only"):
            write()
    with pytest.raises(TierSetupError, match="read-only and has no table"):
        ro.create_table("hps_et.model.other", 4)
    assert ro.fetch(T, np.array([1, 2]))[1].all()
    ro.close()


def _times(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Size, modification and change time of the folder and of every file in it."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns,
                                         p.stat().st_ctime_ns)
            for p in [folder, *sorted(folder.rglob("*"))]}


def test_a_read_only_open_leaves_every_file_of_the_store_untouched(
        tier: RocksDBTier, tmp_path: Path) -> None:
    """Not a file of the store is written, rocksdict's own settings file included (it
    rewrites that at every open of the folder it is given), nor the folder itself; rows
    of several table files, bulk-loaded ones too, are read; the store's folder need not
    be writable; no folder of links is left behind."""
    keys = np.arange(4000)
    for part in np.array_split(keys[:3000], 3):  # three table files
        tier.insert(T, part, vectors_of(part, 4))
        tier._db.flush(True)
    tier.create_table("hps_et.model.loaded", 4)
    assert tier.load("hps_et.model.loaded", [(keys, vectors_of(keys, 4))]) == keys.size
    tier.insert(T, keys[3000:], vectors_of(keys[3000:], 4))
    path = Path(tier.path)
    tier.close()
    gc.collect()
    assert len(list(path.glob("*.sst"))) >= 2 and (path / "rocksdict-config.json").is_file()
    links_before = set(Path(tempfile.gettempdir()).glob("hps-rocksdb-read-*"))
    path.chmod(0o555)
    try:
        before = _times(path)
        time.sleep(0.01)  # a rewrite would show in the times
        reader = RocksDBTier(config(path, read_only=True))
        try:
            for table in (T, "hps_et.model.loaded"):
                got, found = reader.fetch(table, keys)
                assert found.all(), table
                np.testing.assert_array_equal(got, vectors_of(keys, 4))
        finally:
            reader.close()
        assert _times(path) == before
    finally:
        path.chmod(0o755)
    assert set(Path(tempfile.gettempdir()).glob("hps-rocksdb-read-*")) == links_before


def test_a_read_only_open_of_a_folder_that_holds_no_store_names_that_folder(
        store: Path) -> None:
    store.mkdir()
    with pytest.raises(TierSetupError) as refused:
        RocksDBTier(config(store, read_only=True))
    assert f"{store}/CURRENT" in str(refused.value)
    assert "hps-rocksdb-read-" not in str(refused.value)  # not the folder of links


def test_read_only_needs_an_existing_store(store: Path) -> None:
    with pytest.raises(TierSetupError, match="does not exist"):
        RocksDBTier(config(store, read_only=True))


# -- bulk load -------------------------------------------------------------------------


def test_load_leaves_no_files_and_is_counted_on_reopen(tier: RocksDBTier) -> None:
    keys = np.random.default_rng(4).permutation(np.arange(-3000, 3000))
    assert tier.load(T, [(c, vectors_of(c, 4)) for c in np.array_split(keys, 5)]) == 6000
    assert not [n for n in os.listdir(tier.path) if n.startswith("hps_ingest")]
    tier = reopen(tier)
    assert tier.size(T) == 6000  # counted again, by iterating
    tier.close()


def test_load_makes_one_sorted_run(tier: RocksDBTier) -> None:
    keys = np.random.default_rng(5).permutation(20_000)
    tier.load(T, [(c, vectors_of(c, 4)) for c in np.array_split(keys, 4)])
    files = tier.raw_table(T).live_files()
    assert files and {f["level"] for f in files} == {6}  # ingested at the bottom level


def test_load_in_several_runs(store: Path) -> None:
    tier = RocksDBTier(config(store), load_run_bytes=16 * 1000)  # 1000 rows of 4 floats
    tier.create_table(T, 4)
    keys = np.random.default_rng(6).permutation(np.arange(-2500, 2500))
    chunks = [(c, vectors_of(c, 4)) for c in np.array_split(keys, 7)]
    chunks.append((keys[:10], vectors_of(keys[:10], 4, salt=0.5)))  # a later run wins
    assert tier.load(T, chunks) == 5010
    got, found = tier.fetch(T, keys)
    assert found.all()
    assert np.array_equal(got[:10], vectors_of(keys[:10], 4, salt=0.5))
    assert np.array_equal(got[10:], vectors_of(keys[10:], 4))
    assert tier.size(T) == 5000
    assert {f["level"] for f in tier.raw_table(T).live_files()} == {6}  # compacted
    tier.close()


@pytest.mark.parametrize("run_bytes, spilled", [(256 << 20, False), (16 * 1000, True)])
def test_one_chunk_over_held_rows_keeps_the_last_row_of_each_key(
        store: Path, monkeypatch: pytest.MonkeyPatch, run_bytes: int, spilled: bool) -> None:
    """A load of one chunk (a round of online updates) within load_run_bytes is sorted in
    memory, a larger one spilled; either way over rows the table holds, the last row of a
    repeated key wins and the rows it does not name stay."""
    from hps.tiers.rocksdb import bulk as rocksdb_bulk

    spills: list[int] = []
    add = rocksdb_bulk.BucketSpill.add
    monkeypatch.setattr(rocksdb_bulk.BucketSpill, "add",
                        lambda self, k, v: (spills.append(k.size), add(self, k, v))[1])
    tier = RocksDBTier(config(store), load_run_bytes=run_bytes)
    tier.create_table(T, 4)
    held = np.arange(3000)
    tier.load(T, [(c, vectors_of(c, 4)) for c in np.array_split(held, 3)])
    spills.clear()
    rng = np.random.default_rng(8)
    keys = rng.integers(1000, 5000, 4000)  # repeats; half of them new keys
    rows = rng.standard_normal((keys.size, 4)).astype(np.float32)
    assert tier.load(T, [(keys, rows)]) == keys.size
    assert bool(spills) == spilled
    last = dict(zip(keys.tolist(), rows, strict=True))
    want = np.array(sorted(last))
    got, found = tier.fetch(T, want)
    assert found.all() and np.array_equal(got, np.stack([last[k] for k in want.tolist()]))
    untouched = np.setdiff1d(held, keys)
    got, found = tier.fetch(T, untouched)
    assert found.all() and np.array_equal(got, vectors_of(untouched, 4))
    assert tier.size(T) == np.union1d(held, keys).size
    tier.close()


def test_files_of_a_cut_short_load_are_removed_on_open(tier: RocksDBTier) -> None:
    stale = Path(tier.path) / "hps_ingest_crashed"
    stale.mkdir()
    (stale / "rows.f32").write_bytes(b"0" * 64)
    tier = reopen(tier)
    assert not stale.exists()
    tier.close()


def test_load_is_durable(tier: RocksDBTier) -> None:
    keys = np.arange(2000)
    tier.load(T, [(keys, vectors_of(keys, 4))])
    tier = reopen(tier)
    got, found = tier.fetch(T, keys)
    assert found.all() and np.array_equal(got, vectors_of(keys, 4))
    tier.close()


# -- threads ---------------------------------------------------------------------------


def test_threads_insert_and_fetch(store: Path) -> None:
    tier = RocksDBTier(config(store, num_threads=4, max_batch_size=500))
    tier.create_table(T, 4)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for c in np.array_split(np.arange(w * 5000, (w + 1) * 5000), 10):
                tier.insert(T, c, vectors_of(c, 4))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def reader(r: int) -> None:
        try:
            rng = np.random.default_rng(r)
            for _ in range(20):
                q = rng.integers(0, 15_000, 2000)
                got, found = tier.fetch(T, q)
                assert np.array_equal(got[found], vectors_of(q[found], 4))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert tier.size(T) == 15_000
    tier.close()


def test_load_ordered_writes_rows_as_they_come(tier: RocksDBTier) -> None:
    keys = np.random.default_rng(7).permutation(np.arange(-4000, 4000))
    ordered = keys[tier.bulk_order(keys)]
    assert tier.load_ordered(T, [(c, vectors_of(c, 4)) for c in np.array_split(ordered, 5)]
                             ) == 8000
    got, found = tier.fetch(T, keys)
    assert found.all() and np.array_equal(got, vectors_of(keys, 4))
    assert tier.size(T) == 8000
    assert {f["level"] for f in tier.raw_table(T).live_files()} == {6}


def test_load_sorted_writes_each_key_the_row_its_position_names(tier: RocksDBTier) -> None:
    """The whole table as arrays, rows anywhere in a larger array (as the hash map holds
    them): files are encoded from the rows where they lie, one sorted run ingested."""
    rng = np.random.default_rng(11)
    keys = rng.choice(np.arange(-50_000, 50_000), 40_000, replace=False).astype(np.int64)
    rows = np.zeros((50_000, 4), np.float32)
    where = rng.permutation(50_000)[: keys.size]  # row of keys[i]: rows[where[i]]
    rows[where] = vectors_of(keys, 4)
    ordered, order = tier.bulk_sorted(keys)
    assert np.array_equal(ordered, keys[order])
    assert tier.load_sorted(T, ordered, rows, where[order]) == keys.size
    got, found = tier.fetch(T, keys)
    assert found.all() and np.array_equal(got, vectors_of(keys, 4))
    assert tier.size(T) == keys.size
    assert {f["level"] for f in tier.raw_table(T).live_files()} == {6}


def test_load_sorted_refuses_bad_arrays_and_ingests_nothing(tier: RocksDBTier) -> None:
    keys = np.arange(1000, dtype=np.int64)
    ordered, order = tier.bulk_sorted(keys)
    rows = vectors_of(keys, 4)
    for bad_rows, positions in ((rows.astype(np.float64), order), (rows[:, :3].copy(), order),
                                (rows, order[:10]), (rows[:10], None)):
        with pytest.raises(LookupInputError, match="load_sorted"):
            tier.load_sorted(T, ordered, bad_rows, positions)
    with pytest.raises(TierError, match="bytewise order"):
        tier.load_sorted(T, keys[::-1].copy(), rows, None)  # out of RocksDB's order
    assert tier.size(T) == 0 and not tier.fetch(T, keys)[1].any()
    assert not [n for n in os.listdir(tier.path) if n.startswith("hps_ingest")]


def test_load_ordered_refuses_rows_out_of_order_and_ingests_nothing(tier: RocksDBTier) -> None:
    keys = np.arange(1000)
    ordered = keys[tier.bulk_order(keys)]
    chunks = [(ordered[:600], vectors_of(ordered[:600], 4)),
              (ordered[500:], vectors_of(ordered[500:], 4))]  # overlaps the first chunk
    with pytest.raises(TierError, match="bytewise order"):
        tier.load_ordered(T, chunks)
    assert tier.size(T) == 0 and not tier.fetch(T, keys)[1].any()
    assert not [n for n in os.listdir(tier.path) if n.startswith("hps_ingest")]


def _leader_and_follower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any
                         ) -> tuple[RocksDBTier, RocksDBTier]:
    """Worker 0's tier (the writer) and worker 1's (a secondary instance of its store, in
    a run folder), both with table "t" of width 4."""
    from hps.runtime.run_dir import RUN_DIR_ENV
    from hps.tiers.rocksdb.secondary import WORKER_ENV

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(WORKER_ENV, "0")
    leader = RocksDBTier(config(tmp_path / "rocks", **kw))
    leader.create_table("t", 4)
    monkeypatch.setenv(WORKER_ENV, "1")
    follower = RocksDBTier(config(tmp_path / "rocks", **kw))
    follower.create_table("t", 4)
    assert follower.secondary is not None
    return leader, follower


def test_a_follower_keeps_one_secondary_instance_while_only_the_wal_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower worker's tier (a secondary instance of the leader's store, in a run
    folder) catches up with rows the leader writes on the instance it has; a table made
    or dropped opens a new one, and the folder of the one before is removed at once;
    closing removes the follower's folders."""
    leader, follower = _leader_and_follower(tmp_path, monkeypatch)
    folder = follower.secondary
    assert folder is not None

    def instances() -> list[str]:
        return sorted(p.name for p in folder.iterdir())

    try:
        first = instances()
        for i in range(20):  # a loop over writes: each changes the WAL only
            leader.insert("t", np.array([i]), np.full((1, 4), i, np.float32))
            follower.catch_up()
        assert instances() == first and len(first) == 1
        vectors, found = follower.fetch("t", np.arange(20))
        assert found.all() and np.array_equal(vectors[:, 0], np.arange(20))
        for step in range(3):  # tables made and dropped: the MANIFEST changes
            leader.create_table(f"u{step}", 4)
            leader.drop_table(f"u{step}")
            follower.catch_up()
            assert len(instances()) == 1
        assert instances() != first
        assert follower.fetch("t", np.arange(20))[1].all()
    finally:
        follower.close()
        leader.close()
    assert not folder.exists()


def test_a_follower_reads_the_rows_the_leader_flushed_and_ingested(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An ingested file is newer than rows a secondary instance replayed from the WAL
    # into its memtable, which a catch-up keeps: on that instance a lookup read the
    # older row. A change of table files takes a new instance (secondary.py).
    leader, follower = _leader_and_follower(tmp_path, monkeypatch, max_wal_mb=1)
    keys = np.random.default_rng(3).choice(np.int64(2**40), 8192, replace=False)
    try:
        for round_ in range(12):  # 12 x 128 KiB of rows: past max_wal_mb, flushes
            leader.insert("t", keys, np.full((keys.size, 4), round_, np.float32))
            follower.catch_up()
            vectors, found = follower.fetch("t", keys)
            assert found.all() and (vectors == round_).all()
        leader.load("t", [(keys[:100], np.full((100, 4), -1, np.float32))])  # ingested
        follower.catch_up()
        vectors, found = follower.fetch("t", keys)
        assert found.all() and (vectors[:100] == -1).all() and (vectors[100:] == 11).all()
    finally:
        follower.close()
        leader.close()
