"""A restart over a store that took online updates after its load: the volatile tier is
filled from the files and then, from the store, the rows of the keys its change log
names (hps.tiers.rocksdb.changes), and the store is not written. Updates come through a
real redis-server (Redis Streams): small rounds (a WriteBatch) and one large enough for
RocksDB's bulk path (an ingested table file)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from hps import HierarchicalParameterServer
from hps.config import PersistentDBConfig
from hps.tiers.rocksdb import RocksDBTier
from hps.updates.applier import BULK_ROWS
from hps.updates.contract import UpdatePublisher
from tests.conftest import write_table
from tests.server.test_restart_fill import table_files
from tests.updates.conftest import TOPIC, Model, publish, random_rows, wait_rows


def _fill_line(caplog: pytest.LogCaptureFixture) -> str:
    [line] = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith(f"{TOPIC}: the hash_map tier took")]
    caplog.clear()
    return line


def _lookup(server: HierarchicalParameterServer, keys: np.ndarray) -> np.ndarray:
    """Lookups of `keys`, in batches the table takes."""
    return np.concatenate([server.lookup("m", 0, keys[i:i + 8192])
                           for i in range(0, max(1, keys.size), 8192)])


def _check_volatile(server: HierarchicalParameterServer, file_keys: np.ndarray,
                    rate: float, removed: np.ndarray) -> None:
    """Every row the volatile tier holds is the store's row of its key, and it holds
    exactly the keys it should: the store's (rate 1) or the files' share the store
    still holds; lookups answer the store's rows (the default where it has none)."""
    assert server.volatile is not None and server.persistent is not None
    parts = list(server.persistent.scan(TOPIC, 1 << 16))  # type: ignore[attr-defined]
    stored_keys = np.concatenate([k for k, _ in parts])
    stored_rows = np.concatenate([r for _, r in parts])
    share = file_keys if rate >= 1.0 else file_keys[:int(np.ceil(file_keys.size * rate))]
    held = stored_keys if rate >= 1.0 else share[np.isin(share, stored_keys)]
    assert server.volatile.size(TOPIC) == held.size
    rows, found = server.volatile.fetch(TOPIC, stored_keys)
    assert found.sum() == held.size and np.isin(stored_keys[found], held).all()
    np.testing.assert_array_equal(rows[found], stored_rows[found])
    assert not server.volatile.fetch(TOPIC, removed)[1].any()
    np.testing.assert_array_equal(_lookup(server, stored_keys), stored_rows)
    absent = _lookup(server, np.array([-7], np.int64))  # a key no tier holds: the default
    np.testing.assert_array_equal(_lookup(server, removed),
                                  np.repeat(absent, removed.size, axis=0))


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_restart_after_online_updates_fills_from_the_files_and_the_changed_keys(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator, caplog: pytest.LogCaptureFixture, rate: float) -> None:
    config = model.config(redis_updates)
    config["volatile_db"]["initial_cache_rate"] = rate
    changed = rng.choice(model.keys.size, 50, replace=False)
    new_keys = model.keys.max() + 1 + np.arange(30, dtype=np.int64)
    # one round through the bulk path (an ingestion): BULK_ROWS rows of 300 keys, the
    # last row of each key kept
    bulk_keys = np.resize(np.concatenate([model.keys[:100], model.keys.max() + 1000 + np.arange(
        200, dtype=np.int64)]), BULK_ROWS)
    with HierarchicalParameterServer(config) as server:
        publish(redis_publisher, model.keys[changed], random_rows(rng, changed.size))
        publish(redis_publisher, new_keys, random_rows(rng, new_keys.size))
        bulk_rows = random_rows(rng, bulk_keys.size)
        publish(redis_publisher, bulk_keys, bulk_rows)
        wait_rows(server, bulk_keys[-300:], bulk_rows[-300:])
    # removals, as another process would make them (updates carry none): keys of the
    # files (in the share and out of it) and keys only updates wrote
    removed = np.concatenate([model.keys[[0, 1, model.keys.size - 1]], new_keys[:2]])
    db = RocksDBTier(PersistentDBConfig(type="rocks_db", path=str(model.folder / "rocks")))
    try:
        db.create_table(TOPIC, model.vectors.shape[1])
        assert db.remove(TOPIC, removed) == removed.size
    finally:
        db.close()
    before = table_files(model.folder / "rocks", [TOPIC])
    del config["update_source"]  # nothing but the store can bring the updated rows back
    with caplog.at_level(logging.INFO, logger="hps"):
        with HierarchicalParameterServer(config) as server:
            assert server.model("m").table(0).source.reused
            _check_volatile(server, model.keys, rate, removed)
        line = _fill_line(caplog)
    noted = np.unique(np.concatenate([model.keys[changed], new_keys, bulk_keys, removed]))
    assert "from the files" in line and f"but for {noted.size} keys" in line, line
    assert table_files(model.folder / "rocks", [TOPIC]) == before  # the table not written

    # a new version of the files: loaded again, the log cleared with the old table
    time.sleep(0.01)  # another modification time, whatever the file system's grain
    write_table(model.folder / "t0", model.keys, model.vectors + 1)
    with caplog.at_level(logging.INFO, logger="hps"):
        with HierarchicalParameterServer(config) as server:
            assert not server.model("m").table(0).source.reused
        with HierarchicalParameterServer(config) as server:
            assert server.model("m").table(0).source.reused
            _check_volatile(server, model.keys, rate, np.empty(0, np.int64))
            np.testing.assert_array_equal(server.lookup("m", 0, model.keys), model.vectors + 1)
        line = _fill_line(caplog)
    assert "from the files" in line and "unchanged since the load" in line, line
