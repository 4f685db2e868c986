"""Model files the loader refuses or reports (issue 14 item 7): NaN/inf rows, duplicate
keys, widths and sizes beyond memory. Real RocksDB on temp dirs, the in-process tier."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import ConfigError, ModelFileError
from hps.loader import available_memory
from hps.server import HierarchicalParameterServer
from tests.conftest import model_config, write_table


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


@pytest.mark.parametrize("persistent", [True, False])
def test_duplicate_keys_are_counted_and_the_last_row_wins(
    tmp_path: Path, persistent: bool, caplog: pytest.LogCaptureFixture
) -> None:
    keys = np.concatenate([np.arange(3000), np.arange(0, 3000, 10)]).astype(np.int64)
    vectors = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    caplog.set_level(logging.WARNING, logger="hps.loader")
    config = one_table(tmp_path, keys, vectors, persistent=persistent)
    with HierarchicalParameterServer(config, chunk_bytes=4096) as server:
        table = server.model("m").table(0)
        assert table.source.duplicate_keys == 300
        assert table.source.as_dict()["duplicate_keys"] == 300  # in the load report
        np.testing.assert_array_equal(server.lookup("m", 0, [0, 10, 11]),
                                      vectors[[3000, 3001, 11]])
    assert any("300 rows whose key a later row repeats" in r.getMessage()
               for r in caplog.records)
    if persistent:  # a restart over the same RocksDB keeps the count from its record
        with HierarchicalParameterServer(config, chunk_bytes=4096) as server:
            source = server.model("m").table(0).source
            assert source.reused and source.duplicate_keys == 300


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
