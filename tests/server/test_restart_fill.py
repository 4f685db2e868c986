"""A restart over the RocksDB store a load filled: the volatile tier's rows come from the
files where the store holds them unchanged, and the persistent tier is never written."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import PersistentDBConfig
from hps.server import HierarchicalParameterServer
from hps.server.restart_fill import STORED_VERSION
from hps.tiers.rocksdb import RocksDBTier

NAMES = ("hps_et.m.sparse_embedding0", "hps_et.m.sparse_embedding1")


def table_files(store: Path, names: Sequence[str]) -> dict[str, Any]:
    """Each table's files in a closed RocksDB store, as the tier lists them
    (`stored_version`: "" if writes wait in a memtable), with each file's size and
    modification time: a restart that wrote to a table would change them."""
    db = RocksDBTier(PersistentDBConfig(type="rocks_db", path=str(store), read_only=True))
    try:
        marks = {name: db.stored_version(name) for name in names}
    finally:
        db.close()
    files = {}
    for mark in marks.values():
        assert mark
        for number in (entry.split(":")[0] for entry in mark.split(",")):
            path = store / f"{int(number):06d}.sst"
            files[path.name] = (path.stat().st_size, path.stat().st_mtime_ns)
    return {"marks": marks, "files": files}


def fill_lines(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """The restart fill's log line of each table."""
    return {name: r.getMessage() for r in caplog.records for name in NAMES
            if r.getMessage().startswith(f"{name}: the hash_map tier took")}


def volatile_rows(server: HierarchicalParameterServer, table: int, keys: np.ndarray
                  ) -> np.ndarray:
    """What the volatile tier itself holds for `keys` (every one of them, or it fails)."""
    assert server.volatile is not None
    rows, found = server.volatile.fetch(NAMES[table], keys)
    assert found.all()
    return rows


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_restart_over_an_unchanged_store_fills_from_the_files(
        two_tables: dict[str, Any], caplog: pytest.LogCaptureFixture, rate: float) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"]["initial_cache_rate"] = rate
    store = Path(config["persistent_db"]["path"])
    with HierarchicalParameterServer(config) as first:
        assert first.persistent is not None
        marks = [first.persistent.stored_version(n) for n in NAMES]  # type: ignore[attr-defined]
        assert all(marks)
        assert [first.persistent.metadata(n)[STORED_VERSION]  # type: ignore[attr-defined]
                for n in NAMES] == marks
    before = table_files(store, NAMES)
    assert before["marks"] == dict(zip(NAMES, marks, strict=True))
    with caplog.at_level(logging.INFO, logger="hps"):
        with HierarchicalParameterServer(config) as second:
            for i, (keys, vectors) in enumerate(two_tables["tables"]):
                assert second.model("m").table(i).source.reused
                share = keys.size if rate == 1.0 else int(np.ceil(keys.size * rate))
                np.testing.assert_array_equal(volatile_rows(second, i, keys[:share]),
                                              vectors[:share])
                assert second.volatile.size(NAMES[i]) == share  # type: ignore[union-attr]
                np.testing.assert_array_equal(second.lookup("m", i, keys), vectors)
                # the restart wrote nothing to the table
                assert second.persistent.stored_version(NAMES[i]) == marks[i]  # type: ignore[union-attr]
    lines = fill_lines(caplog)
    assert set(lines) == set(NAMES)
    assert all("from the files" in line and "unchanged since the load" in line
               for line in lines.values()), lines
    assert table_files(store, NAMES) == before  # the restart wrote nothing to the tables


@pytest.mark.parametrize("through", ["tier", "raw"])
def test_a_store_written_since_the_load_is_read_where_its_change_log_cannot_tell(
        two_tables: dict[str, Any], caplog: pytest.LogCaptureFixture, through: str) -> None:
    """A write the server did not make (another process, while it was down): through the
    tier it is noted in the change log, and the restart takes the files and those keys'
    stored rows; through a raw handle (no note, a newer sequence number than the log
    covers) it takes the rows the store holds."""
    config = two_tables["config"]
    keys, vectors = two_tables["tables"][0]
    HierarchicalParameterServer(config).close()
    db = RocksDBTier(PersistentDBConfig(type="rocks_db", path=config["persistent_db"]["path"]))
    try:
        db.create_table(NAMES[0], 8)
        if through == "tier":
            db.insert(NAMES[0], keys[:10], vectors[:10] + 7)
        else:
            raw = db.raw_table(NAMES[0])
            for key, row in zip(keys[:10], vectors[:10] + 7, strict=True):  # a test's write
                raw[key.tobytes()] = row.tobytes()
            del raw  # the store closes once no handle of it is held
    finally:
        db.close()
    with caplog.at_level(logging.INFO, logger="hps"):
        with HierarchicalParameterServer(config) as server:
            expected = vectors.copy()
            expected[:10] += 7
            np.testing.assert_array_equal(volatile_rows(server, 0, keys), expected)
            np.testing.assert_array_equal(server.lookup("m", 0, keys), expected)
    lines = fill_lines(caplog)
    if through == "tier":
        assert "from the files" in lines[NAMES[0]] and "but for 10 keys" in lines[NAMES[0]]
    else:
        assert "from the store" in lines[NAMES[0]] and "change log does not tell" in lines[
            NAMES[0]]
    assert "from the files" in lines[NAMES[1]]
