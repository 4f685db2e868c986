"""The hash map in shared memory across real processes (`multi_process_hash_map`): another
process maps the leader's table and reads its exact rows in every storage type, never a
torn row while the leader rewrites it, and no file outlives the run. The tier contract
suites (test_tier_contract.py, test_bulk_load.py) run against it in one process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from hps.config import VolatileDBConfig
from hps.errors import ConfigError, TableUnreadableError, TierError
from hps.runtime import run_dir
from hps.tiers.hash_map import shared_table
from hps.tiers.hash_map.shared import SharedHashMapTier
from hps.tiers.hash_map.shared_table import SharedTable, SharedTableFullError

TABLE = "hps_et.m.t"
SPAWN = multiprocessing.get_context("spawn")


def _config(**extra: object) -> VolatileDBConfig:
    return VolatileDBConfig.model_validate({"type": "multi_process_hash_map", **extra})


def _tier(folder: Path, leader: bool) -> SharedHashMapTier:
    tier = SharedHashMapTier(_config(), folder=folder, leader=leader)
    tier.generation = 1  # as the workers set it: the same file in every process
    return tier


STORAGES = ("float32", "float16", "bfloat16", "int8")
DIM = 24


def _read_in_child(folder: str, keys: np.ndarray, results: multiprocessing.Queue) -> None:
    tier = _tier(Path(folder), leader=False)
    try:
        for storage in STORAGES:  # one table of each storage type
            name = f"{TABLE}_{storage}"
            tier.create_table(name, DIM, storage)
            out, found = tier.fetch(name, keys)
            narrow_out = None
            if storage in ("float16", "bfloat16"):  # the stored 16-bit rows as they are
                narrow_out = np.empty((keys.size, DIM), np.float16 if storage == "float16"
                                      else np.uint16)
                tier.fetch_into(name, keys, narrow_out)
            try:
                tier.insert(name, keys[:1], out[:1])
                writes = "allowed"
            except TierError as exc:
                writes = str(exc)
            results.put((storage, out, found, narrow_out, tier.loaded_elsewhere(name),
                         writes))
    finally:
        tier.close()


def test_another_process_maps_the_tables_and_reads_their_exact_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    keys = rng.choice(2**40, 5000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    asked = np.concatenate([keys[::7], [-5, 2**50]]).astype(np.int64)
    leader = _tier(tmp_path, leader=True)
    try:
        for storage in STORAGES:
            name = f"{TABLE}_{storage}"
            leader.create_table(name, DIM, storage)
            leader.reserve(name, keys.size)
            leader.insert(name, keys, rows)
        results = SPAWN.Queue()
        child = SPAWN.Process(target=_read_in_child, args=(str(tmp_path), asked, results))
        child.start()
        for _ in STORAGES:
            storage, out, found, narrow_out, elsewhere, writes = results.get(timeout=60)
            name = f"{TABLE}_{storage}"
            expected, expected_found = leader.fetch(name, asked)
            np.testing.assert_array_equal(found, expected_found)
            assert expected.tobytes() == out.tobytes()  # bit for bit, decoded alike
            if narrow_out is not None:
                mine = np.empty_like(narrow_out)
                leader.fetch_into(name, asked, mine)
                assert mine.tobytes() == narrow_out.tobytes()
            assert elsewhere  # its load would have skipped the rows
            assert "only reads" in writes
            assert not leader.loaded_elsewhere(name)
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        leader.close()
    assert not any((tmp_path / "tables").iterdir())  # the leader removed its files


A = 1.0
B = 2.0
WIDTH = 1024  # a torn row would mix the two values somewhere in its 4 KiB


def _rewrite(folder: str, ready: multiprocessing.Event, stop: multiprocessing.Event
             ) -> None:
    tier = _tier(Path(folder), leader=True)
    tier.create_table(TABLE, WIDTH)
    tier.reserve(TABLE, 100)
    others = np.arange(1000, 1050, dtype=np.int64)
    tier.insert(TABLE, others, np.zeros((others.size, WIDTH), np.float32))
    key = np.array([7], np.int64)
    rows = [np.full((1, WIDTH), A, np.float32), np.full((1, WIDTH), B, np.float32)]
    tier.insert(TABLE, key, rows[0])
    ready.set()  # the table exists: readers may map it
    end = time.monotonic() + 60  # bounded, should the test die before it says stop
    i = 0
    while not stop.is_set() and time.monotonic() < end:
        i += 1
        tier.insert(TABLE, key, rows[i % 2])
        if i % 50 == 0:  # removals move rows: the row of key 7 moves with them
            tier.remove(TABLE, others[:5])
            tier.insert(TABLE, others[:5], np.zeros((5, WIDTH), np.float32))
    # the file stays until the readers are done (the test closes the run folder)


def _check_reads(folder: str, seconds: float, ready: multiprocessing.Event,
                 results: multiprocessing.Queue) -> None:
    assert ready.wait(60)
    tier = _tier(Path(folder), leader=False)
    tier.create_table(TABLE, WIDTH)
    keys = np.array([7, 1001, 7], np.int64)
    seen = {A: 0, B: 0}
    bad = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out, found = tier.fetch(TABLE, keys)
        for row in (out[0], out[2]):
            value = float(row[0])
            if not found[0] or value not in seen or not (row == value).all():
                bad += 1
            else:
                seen[value] += 1
    results.put((bad, seen[A], seen[B]))
    tier.close()


def test_readers_never_see_a_torn_row_while_the_leader_rewrites_it(tmp_path: Path) -> None:
    ready, stop = SPAWN.Event(), SPAWN.Event()
    results = SPAWN.Queue()
    writer = SPAWN.Process(target=_rewrite, args=(str(tmp_path), ready, stop))
    readers = [SPAWN.Process(target=_check_reads, args=(str(tmp_path), 2.0, ready, results))
               for _ in range(2)]
    for proc in [writer, *readers]:  # all start at once: the readers wait for the table
        proc.start()
    try:
        counts = [results.get(timeout=90) for _ in readers]
    finally:
        stop.set()
    for proc in [*readers, writer]:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    for bad, saw_a, saw_b in counts:
        assert bad == 0
        assert saw_a + saw_b > 0  # how many of each depends on timing; none is torn


def _die_writing(folder: str, ready: multiprocessing.Event) -> None:
    """A leader that loads part of a table and is in the middle of a write (the counter
    odd) when it is killed."""
    tier = _tier(Path(folder), leader=True)
    tier.create_table(TABLE, DIM)
    tier.insert(TABLE, np.arange(100, dtype=np.int64), np.ones((100, DIM), np.float32))
    SharedTable.attach(tier.segment_path(TABLE)).begin_write()
    ready.set()
    time.sleep(60)


def _killed_mid_write(folder: Path) -> None:
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_die_writing, args=(str(folder), ready))
    child.start()
    assert ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=30)


def test_a_write_whose_writer_died_fails_the_read_at_once(tmp_path: Path) -> None:
    """A reader never waits for a write whose process is gone: TableUnreadableError (the
    next tier answers, or a 503) within WRITER_CHECK, not a wait without end."""
    _killed_mid_write(tmp_path)
    reader = _tier(tmp_path, leader=False)
    try:
        reader.create_table(TABLE, DIM)
        started = time.monotonic()
        with pytest.raises(TableUnreadableError, match="died in the middle of a write"):
            reader.fetch(TABLE, np.arange(10, dtype=np.int64))
        assert time.monotonic() - started < 1.0
    finally:
        reader.close()


def test_a_write_that_does_not_end_fails_the_read_after_read_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_table, "READ_WAIT", 0.2)
    leader = _tier(tmp_path, leader=True)
    reader = _tier(tmp_path, leader=False)
    try:
        leader.create_table(TABLE, DIM)
        leader.insert(TABLE, np.arange(10, dtype=np.int64), np.ones((10, DIM), np.float32))
        reader.create_table(TABLE, DIM)
        SharedTable.attach(leader.segment_path(TABLE)).begin_write()  # a writer alive
        started = time.monotonic()
        with pytest.raises(TableUnreadableError, match="has not ended"):
            reader.fetch(TABLE, np.arange(10, dtype=np.int64))
        assert 0.2 <= time.monotonic() - started < 2.0
    finally:
        reader.close()
        leader.close()


def test_a_leader_started_again_makes_the_table_of_an_unfinished_op_anew(
        tmp_path: Path) -> None:
    """The file a killed leader was loading (part of the rows, the counter odd) is
    removed and made again by its successor, not mapped as a whole table."""
    _killed_mid_write(tmp_path)
    leader = _tier(tmp_path, leader=True)
    left = leader.segment_path(TABLE)
    assert left.exists()
    try:
        leader.remove_unfinished(TABLE, 1)
        assert not left.exists()
        leader.create_table(TABLE, DIM)
        assert not leader.loaded_elsewhere(TABLE)
        out, found = leader.fetch(TABLE, np.arange(10, dtype=np.int64))
        assert not found.any()  # a new, empty table: the load writes it whole
        leader.insert(TABLE, np.arange(10, dtype=np.int64), np.full((10, DIM), 2, np.float32))
        out, found = leader.fetch(TABLE, np.arange(10, dtype=np.int64))
        assert found.all() and (out == 2).all()
        leader.remove_unfinished(TABLE, 1)  # made by this leader: not a leftover
        assert left.exists()
    finally:
        leader.close()
    follower = _tier(tmp_path, leader=False)
    try:
        with pytest.raises(TierError, match="only the run's leader"):
            follower.remove_unfinished(TABLE, 1)
    finally:
        follower.close()


@contextmanager
def _full_table(folder: Path) -> Iterator[tuple[SharedHashMapTier, SharedHashMapTier]]:
    """A leader's table of 100 rows of width 4 (ones) with no headroom, and a follower
    mapping it: its capacity is fixed from then on."""
    leader = SharedHashMapTier(_config(shared_headroom=0.0), folder=folder, leader=True)
    leader.generation = 1
    follower = _tier(folder, leader=False)
    try:
        leader.create_table(TABLE, 4)
        leader.reserve(TABLE, 100)
        leader.insert(TABLE, np.arange(100, dtype=np.int64), np.ones((100, 4), np.float32))
        follower.create_table(TABLE, 4)  # mapped elsewhere: the capacity is fixed now
        yield leader, follower
    finally:
        follower.close()
        leader.close()


def test_a_full_table_refuses_the_whole_insert_and_counts_it(tmp_path: Path) -> None:
    with _full_table(tmp_path) as (leader, follower):
        capacity = leader._tables[TABLE].keys.size
        new = np.arange(1000, 1000 + capacity, dtype=np.int64)
        with pytest.raises(SharedTableFullError, match="nothing was written"):
            leader.insert(TABLE, new, np.ones((new.size, 4), np.float32))
        assert leader.size(TABLE) == 100
        assert not follower.fetch(TABLE, new[:10])[1].any()
        assert leader.stats()["refused_inserts"] == 1
        # overwriting rows it holds needs no room
        leader.insert(TABLE, np.arange(100, dtype=np.int64), np.zeros((100, 4), np.float32))
        np.testing.assert_array_equal(follower.fetch(TABLE, np.arange(3))[0], 0.0)


def test_an_update_past_the_capacity_overwrites_the_held_keys_and_leaves_out_the_new(
        tmp_path: Path) -> None:
    """`insert_within_capacity` (the update applier's write): where the whole batch does
    not fit, every row of a key the table holds is written, the last of a repeated key
    winning, and every row of a new key is left out, repeats included."""
    with _full_table(tmp_path) as (leader, follower):
        room = leader._tables[TABLE].keys.size - 100
        held = np.array([5, 7, 5], np.int64)  # 5 twice: its second row wins
        new = np.arange(1000, 1000 + room + 1, dtype=np.int64)
        keys = np.concatenate([held[:2], new, held[2:], new[:1]])
        rows = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
        left_out = leader.insert_within_capacity(TABLE, keys, rows)
        assert left_out is not None
        np.testing.assert_array_equal(left_out, np.isin(keys, new))
        got, found = follower.fetch(TABLE, np.array([5, 7], np.int64))
        assert found.all()
        np.testing.assert_array_equal(got, rows[[room + 3, 1]])
        assert not follower.fetch(TABLE, new)[1].any()
        assert leader.size(TABLE) == 100
        assert leader.stats()["refused_inserts"] == 1
        # a batch that fits is written whole, and says so
        assert leader.insert_within_capacity(TABLE, new[:room], rows[:room]) is None
        assert follower.fetch(TABLE, new[:room])[1].all()


def test_a_bounded_margin_is_refused() -> None:
    with pytest.raises(ConfigError, match="overflow_margin"):
        SharedHashMapTier(_config(overflow_margin=1000))


def test_a_tier_alone_owns_its_run_folder_and_dead_runs_are_removed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    monkeypatch.setenv(run_dir.BASE_ENV, str(tmp_path))
    monkeypatch.delenv(run_dir.RUN_DIR_ENV, raising=False)
    dead = SPAWN.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    left = tmp_path / f"{run_dir.PREFIX}{dead.pid}"  # a run whose owner was killed
    (left / "tables").mkdir(parents=True)
    (left / "tables" / "x").write_bytes(b"rows")
    tier = SharedHashMapTier(_config())
    assert not left.exists()
    assert tier.folder.name.startswith(f"{run_dir.PREFIX}{os.getpid()}-")
    other = SharedHashMapTier(_config())  # a second one in the process: a folder of its own
    assert other.folder != tier.folder
    other.close()
    assert tier.folder.exists()
    tier.create_table(TABLE, 4)
    tier.insert(TABLE, np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))
    assert any((tier.folder / "tables").iterdir())
    tier.close()
    assert not tier.folder.exists()
