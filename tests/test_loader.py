"""Model files the loader refuses or reports: NaN/inf rows, duplicate
keys, widths and sizes beyond memory; and the two ways a load writes RocksDB (from the
volatile tier's whole copy, or from the files). Real RocksDB on temp dirs, the in-process
tier."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import ConfigError, ModelFileError
from hps.runtime.memory_available import available_memory
from hps.server import HierarchicalParameterServer
from hps.server.loader import open_reader, served_chunks
from hps.tiers.rocksdb.tier import RocksDBTier
from tests.conftest import model_config, write_table

TABLE = "hps_et.m.sparse_embedding0"


def one_table(tmp_path: Path, keys: np.ndarray, vectors: np.ndarray,
              persistent: bool = True, **model: Any) -> dict[str, Any]:
    write_table(tmp_path / "t0", keys, vectors)
    config: dict[str, Any] = {
        "models": [model_config([str(tmp_path / "t0")], [vectors.shape[1]], **model)],
        "volatile_db": {"type": "hash_map"},
    }
    if persistent:
        config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    return config


def stored(server: HierarchicalParameterServer) -> dict[str, list[str]]:
    return {tier.name: tier.tables() for tier in server.tiers}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_refused_naming_row_and_file(tmp_path: Path, bad: float) -> None:
    keys = np.arange(5000, dtype=np.int64)
    vectors = np.ones((5000, 8), np.float32)
    vectors[3210, 5] = bad
    config = one_table(tmp_path, keys, vectors)
    with HierarchicalParameterServer(config, load=False, chunk_bytes=4096) as server:
        with pytest.raises(ModelFileError, match=rf"{tmp_path / 't0'}: row 3,210 holds NaN"):
            server.load_model(server.config.models[0])
        assert stored(server) == {"hash_map": [], "rocksdb": []}  # nothing stays
    allowed = copy.deepcopy(config)
    allowed["models"][0]["allow_non_finite_vectors"] = True
    with HierarchicalParameterServer(allowed, chunk_bytes=4096) as server:
        got = server.lookup("m", 0, keys[3205:3215])
        np.testing.assert_array_equal(got, vectors[3205:3215])  # NaN == NaN in this check


# Every tier combination a load can make: each must serve the last row of a repeated key.
# With initial_cache_rate < 1 the volatile tier takes a share of each chunk, so a key's
# earlier row may be in the share and its later row past it; without a persistent tier the
# volatile tier takes the whole table whatever the rate.
TIER_COMBINATIONS = [
    pytest.param({"type": "hash_map"}, False, id="hash_map"),
    pytest.param({"type": "hash_map", "initial_cache_rate": 0.5}, False, id="hash_map-rate0.5"),
    pytest.param({"type": "hash_map"}, True, id="hash_map+rocksdb"),
    pytest.param({"type": "hash_map", "initial_cache_rate": 0.5}, True,
                 id="hash_map+rocksdb-rate0.5"),
    pytest.param({"type": "hash_map", "initial_cache_rate": 0.5, "overflow_margin": 10**9},
                 True, id="bounded_hash_map+rocksdb-rate0.5"),
    pytest.param({"type": "redis", "initial_cache_rate": 0.5}, True,
                 id="redis+rocksdb-rate0.5"),
]


@pytest.mark.parametrize(("volatile", "persistent"), TIER_COMBINATIONS)
def test_duplicate_keys_are_counted_and_the_last_row_wins_in_every_tier(
    tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture,
    volatile: dict[str, Any], persistent: bool,
) -> None:
    # keys 0..2999, then every tenth key again: 170-row chunks (4 KiB) put some second
    # rows past a chunk's cached half while their first rows are in one
    keys = np.concatenate([np.arange(3000), np.arange(0, 3000, 10)]).astype(np.int64)
    vectors = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    last = {k: i for i, k in enumerate(keys.tolist())}  # the row each key must serve
    distinct = np.array(sorted(last), dtype=np.int64)
    served = vectors[[last[k] for k in distinct.tolist()]]
    caplog.set_level(logging.WARNING, logger="hps.server.loader")
    config = one_table(tmp_path, keys, vectors, persistent=persistent)
    config["volatile_db"] = dict(volatile)
    if volatile["type"] == "redis":
        config["volatile_db"]["address"] = request.getfixturevalue("redis_server").address
    with HierarchicalParameterServer(config, chunk_bytes=4096) as server:
        table = server.model("m").table(0)
        assert table.source.duplicate_keys == 300
        assert table.source.as_dict()["duplicate_keys"] == 300  # in the load report
        np.testing.assert_array_equal(server.lookup("m", 0, distinct), served)
        np.testing.assert_array_equal(server.lookup("m", 0, [0, 10, 11]),
                                      vectors[[3000, 3001, 11]])
        for tier in server.tiers:  # each tier on its own, not only the first that answers
            got, found = tier.fetch(TABLE, distinct)
            held_repeats = np.count_nonzero(found[distinct % 10 == 0])
            assert held_repeats > 0, f"{tier.name} holds none of the repeated keys"
            np.testing.assert_array_equal(got[found], served[found], err_msg=tier.name)
    assert any("300 rows whose key a later row repeats" in r.getMessage()
               for r in caplog.records)
    if persistent:  # a restart over the same RocksDB keeps the count from its record
        with HierarchicalParameterServer(config, chunk_bytes=4096) as server:
            source = server.model("m").table(0).source
            assert source.reused and source.duplicate_keys == 300
            np.testing.assert_array_equal(server.lookup("m", 0, distinct), served)
            got, found = server.volatile.fetch(TABLE, distinct)
            np.testing.assert_array_equal(got[found], served[found])


@pytest.mark.parametrize("persistent", [True, False])
def test_warm_up_chunks_carry_the_last_row_of_a_repeated_key(tmp_path: Path,
                                                             persistent: bool) -> None:
    """What a GPU cache warms up from when the files repeat keys: the files' keys in file
    order, each with the row every tier serves (hps/server/gpu_caches.py)."""
    keys = np.concatenate([np.arange(3000), np.arange(0, 3000, 10)]).astype(np.int64)
    vectors = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    last = {k: i for i, k in enumerate(keys.tolist())}
    config = one_table(tmp_path, keys, vectors, persistent=persistent)
    config["volatile_db"]["initial_cache_rate"] = 0.5
    with HierarchicalParameterServer(config, chunk_bytes=4096) as server:
        whole = server.persistent or server.volatile
        reader = open_reader(server.config, server.config.models[0], 0, chunk_bytes=4096)
        with reader:
            chunks = list(served_chunks(TABLE, reader.chunks(), whole))
    got_keys = np.concatenate([k for k, _ in chunks])
    got_rows = np.concatenate([v for _, v in chunks])
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_rows, vectors[[last[k] for k in keys.tolist()]])


def test_absurd_width_is_a_config_error(tmp_path: Path) -> None:
    config = one_table(tmp_path, np.arange(4, dtype=np.int64), np.ones((4, 2), np.float32))
    config["models"][0]["embedding_vecsize_per_table"] = [10**12]
    with pytest.raises(ConfigError, match="at most 1,048,576"):
        HierarchicalParameterServer(config)


def test_a_table_larger_than_memory_is_refused_before_allocating(tmp_path: Path) -> None:
    """A file that claims more rows than memory can hold is a ConfigError before the
    in-process tier allocates anything (it was a MemoryError, or the OOM killer)."""
    free = available_memory()
    assert free is not None, "this test needs /proc/meminfo"
    dim = 1 << 20  # 4 MiB a row: the rows a table of this size would need, never written
    rows = free // (4 * dim) + 16
    folder = tmp_path / "t0"
    folder.mkdir()
    with open(folder / "key", "wb") as f:  # sparse files: the sizes, not the bytes
        f.truncate(rows * 8)
    with open(folder / "emb_vector", "wb") as f:
        f.truncate(rows * 4 * dim)
    config = {"models": [model_config([str(folder)], [dim])],
              "volatile_db": {"type": "hash_map"}}
    with pytest.raises(ConfigError, match="GiB are available"):
        HierarchicalParameterServer(config)


# -- the persistent tier from the volatile tier's copy, or from the files -----------------


def files_with_repeats(folder: Path, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A table whose file repeats keys (the last row of a key wins); returns the file's
    distinct keys and the rows that must be served for them."""
    keys = rng.integers(-(2**62), 2**62, 20_000)
    keys = np.concatenate([keys, keys[:3000]])  # repeated, later rows
    vectors = rng.standard_normal((keys.size, 8)).astype(np.float32)
    write_table(folder, keys, vectors)
    last = {}
    for key, row in zip(keys.tolist(), vectors, strict=True):
        last[key] = row
    distinct = np.array(sorted(last), dtype=np.int64)
    return distinct, np.stack([last[k] for k in distinct.tolist()])


@pytest.mark.parametrize(("volatile", "path_taken"), [
    ({"type": "hash_map"}, "load_sorted"),  # the hash map holds it all: its rows in place
    ({"type": "hash_map", "initial_cache_rate": 0.5}, "load"),  # half: from the files
    ({"type": "hash_map", "overflow_margin": 10**9}, "load"),  # may evict: from the files
    ({}, "load"),  # no volatile tier
])
def test_both_ways_store_the_same_rows(tmp_path: Path, rng: np.random.Generator,
                                       monkeypatch: pytest.MonkeyPatch,
                                       volatile: dict[str, Any], path_taken: str) -> None:
    keys, rows = files_with_repeats(tmp_path / "t0", rng)
    taken: list[str] = []
    for name in ("load", "load_ordered", "load_sorted"):
        real = getattr(RocksDBTier, name)
        monkeypatch.setattr(RocksDBTier, name, lambda self, *a, _n=name, _r=real, **kw: (
            taken.append(_n), _r(self, *a, **kw))[1])
    config = {"models": [model_config([str(tmp_path / "t0")], [8])], "volatile_db": volatile,
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")}}
    with HierarchicalParameterServer(config) as server:
        assert taken == [path_taken]
        persistent = server.persistent
        got, found = persistent.fetch(TABLE, keys)
        assert found.all() and np.array_equal(got, rows)
        assert persistent.size(TABLE) == keys.size
        # the table's rows (8-byte keys; the load record's column family has files too)
        rows_files = [f for f in persistent.raw_table(TABLE).live_files()
                      if len(f["start_key"]) == 8]
        assert {f["level"] for f in rows_files} == {6}
        np.testing.assert_array_equal(server.lookup("m", 0, keys), rows)
        if server.volatile is not None:  # the volatile tier's own rows, where it has any
            got, found = server.volatile.fetch(TABLE, keys)
            assert found.any()
            np.testing.assert_array_equal(got[found], rows[found])



def test_the_hash_map_hands_the_whole_table_over_whatever_the_format(
        tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash map hands a loaded table to RocksDB once, whole and in place, whatever
    chunks the format read its files in (Parquet decodes in smaller chunks of its own)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys, rows = rng.permutation(5000).astype(np.int64), rng.random((5000, 16), np.float32)
    write_table(tmp_path / "t0", keys, rows)
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 16)
    pq.write_table(pa.table({"key": keys, "vector": column}), tmp_path / "t.parquet",
                   row_group_size=700)
    handed: list[tuple[int, bool]] = []
    real = RocksDBTier.load_sorted
    monkeypatch.setattr(RocksDBTier, "load_sorted", lambda self, table, k, r, p: (
        handed.append((k.size, p is not None)), real(self, table, k, r, p))[1])
    config = {"models": [model_config([str(tmp_path / "t0"), str(tmp_path / "t.parquet")],
                                      [16, 16])],
              "volatile_db": {"type": "hash_map"},
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")}}
    with HierarchicalParameterServer(config) as server:
        for table in (0, 1):
            np.testing.assert_array_equal(server.lookup("m", table, keys), rows)
            got, found = server.persistent.fetch(f"hps_et.m.sparse_embedding{table}", keys)
            assert found.all() and np.array_equal(got, rows)
    assert handed == [(5000, True)] * 2
