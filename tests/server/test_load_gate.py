"""The load gate in the server: loads and reloads refused or let through, the served
version kept, the verdict in each table's source record and in the registry's ledger.
Real RocksDB on temp dirs, the in-process hash map, a real redis-server."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gate.verdict import LoadGateError
from hps.server import HierarchicalParameterServer
from tests.conftest import make_table, model_config, write_table

TABLE = "hps_et.m.sparse_embedding0"


def config_of(tmp_path: Path, folder: str, dim: int, persistent: bool = True,
              validation: dict[str, Any] | None = None, **volatile: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": [model_config([str(tmp_path / folder)], [dim])],
        "volatile_db": {"type": "hash_map", **volatile},
    }
    if persistent:
        config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    if validation is not None:
        config["validation"] = validation
    return config


def stored(server: HierarchicalParameterServer) -> dict[str, list[str]]:
    return {tier.name: sorted(tier.tables()) for tier in server.tiers}


def reload_from(server: HierarchicalParameterServer, folder: Path) -> Any:
    return server.reload_model("m", [str(folder)])


@pytest.mark.parametrize("persistent", [True, False])
def test_a_reload_with_non_finite_rows_is_refused_and_the_old_version_serves(
        tmp_path: Path, rng: np.random.Generator, persistent: bool) -> None:
    keys, rows = make_table(rng, 4000, 8)
    write_table(tmp_path / "v1", keys, rows)
    bad = rows + 1
    bad[2345, 3] = np.nan
    write_table(tmp_path / "v2", keys, bad)
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 8, persistent),
                                     chunk_bytes=4096) as server:
        before = stored(server)
        first = server.model("m").table(0).source.load_gate
        assert first is not None and first["passed"] and first["drift"] is None
        with pytest.raises(LoadGateError, match=r"v2: row 2,345 holds NaN") as refused:
            reload_from(server, tmp_path / "v2")
        assert refused.value.details() == {"model": "m", "table": "sparse_embedding0",
                                           "check": "non_finite", "figure": 1.0,
                                           "limit": 0.0}
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:50]), rows[:50])
        assert stored(server) == before  # the staging version is gone
        gate = server.model("m").table(0).source.load_gate
        assert gate is not None and not gate["passed"] and not gate["served"]
        assert gate["uri"] == str(tmp_path / "v2")
        assert gate["findings"][0]["check"] == "non_finite"
        ledger = server.registry.gate_ledger
        assert ledger.refusals() == {("m", "sparse_embedding0", "non_finite"): 1}


def test_a_table_of_another_width_is_refused_before_anything_is_written(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 1000, 8)
    write_table(tmp_path / "v1", keys, rows)
    write_table(tmp_path / "v2", keys, np.ones((1000, 16), np.float32))
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 8)) as server:
        before = stored(server)
        with pytest.raises(LoadGateError, match="rows are 16 wide but "
                                                "embedding_vecsize_per_table says 8") as refused:
            reload_from(server, tmp_path / "v2")
        details = refused.value.details()
        assert (details["check"], details["figure"], details["limit"]) == ("width", 16.0, 8.0)
        assert stored(server) == before
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:5]), rows[:5])
        assert server.model("m").table(0).source.load_gate["findings"][0]["check"] == "width"
    # a file that is not of any width is the reader's error, as before
    (tmp_path / "v3").mkdir()
    (tmp_path / "v3" / "key").write_bytes(np.arange(3, dtype="<i8").tobytes())
    (tmp_path / "v3" / "emb_vector").write_bytes(b"\0" * 10)
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 8)) as server:
        with pytest.raises(Exception) as error:
            reload_from(server, tmp_path / "v3")
        assert not isinstance(error.value, LoadGateError)


# every way a load writes the tiers: the volatile tier alone, over RocksDB whole (its rows
# read back in place) or a share of each chunk, and Redis over RocksDB
TIERS = [
    pytest.param({}, False, id="hash_map"),
    pytest.param({}, True, id="hash_map+rocksdb"),
    pytest.param({"initial_cache_rate": 0.5}, True, id="hash_map+rocksdb-rate0.5"),
    pytest.param({"type": "redis", "initial_cache_rate": 0.5}, True, id="redis+rocksdb"),
]


@pytest.mark.parametrize(("volatile", "persistent"), TIERS)
def test_duplicates_first_serves_the_first_row_in_every_tier(
        tmp_path: Path, request: pytest.FixtureRequest, volatile: dict[str, Any],
        persistent: bool) -> None:
    # keys 0..2999, then every tenth key again, in 170-row chunks
    keys = np.concatenate([np.arange(3000), np.arange(0, 3000, 10)]).astype(np.int64)
    rows = np.arange(keys.size * 4, dtype=np.float32).reshape(-1, 4)
    write_table(tmp_path / "t0", keys, rows)
    config = config_of(tmp_path, "t0", 4, persistent, {"duplicates": "first"}, **volatile)
    if volatile.get("type") == "redis":
        config["volatile_db"]["address"] = request.getfixturevalue("redis_server").address
    with HierarchicalParameterServer(config, chunk_bytes=4096) as server:
        table = server.model("m").table(0)
        assert table.source.duplicate_keys == 300
        assert table.source.load_gate["duplicate_keys"] == 300
        distinct = np.arange(3000, dtype=np.int64)
        np.testing.assert_array_equal(server.lookup("m", 0, distinct), rows[:3000])
        for tier in server.tiers:  # each tier on its own
            got, found = tier.fetch(TABLE, distinct)
            assert found.any(), tier.name
            np.testing.assert_array_equal(got[found], rows[:3000][found], err_msg=tier.name)


@pytest.mark.parametrize("persistent", [True, False])
def test_duplicates_refuse_refuses_the_load(tmp_path: Path, persistent: bool) -> None:
    keys = np.concatenate([np.arange(3000), [1234]]).astype(np.int64)
    write_table(tmp_path / "t0", keys, np.ones((keys.size, 4), np.float32))
    config = config_of(tmp_path, "t0", 4, persistent, {"duplicates": "refuse"})
    with HierarchicalParameterServer(config, load=False, chunk_bytes=4096) as server:
        with pytest.raises(LoadGateError, match="row 3,000 repeats key 1234") as refused:
            server.load_model(server.config.models[0])
        assert refused.value.details()["check"] == "duplicates"
        assert all(not tables for tables in stored(server).values())  # nothing stays
        assert "m" not in server.models
        assert server.registry.gate_ledger.refusals() == {
            ("m", "sparse_embedding0", "duplicates"): 1}


@pytest.mark.parametrize("persistent", [True, False])
def test_norms_blown_up_tenfold_warn_by_default_and_refuse_with_drift_refuse(
        tmp_path: Path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture,
        persistent: bool) -> None:
    keys, rows = make_table(rng, 20_000, 8)
    write_table(tmp_path / "v1", keys, rows)
    write_table(tmp_path / "v2", keys, rows * 10)
    caplog.set_level(logging.WARNING, logger="hps.gate")
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 8, persistent)) as server:
        reload_from(server, tmp_path / "v2")  # warns: the new version serves
        np.testing.assert_allclose(server.lookup("m", 0, keys[:5]), rows[:5] * 10)
        gate = server.model("m").table(0).source.load_gate
        assert gate["passed"] and gate["served"]
        assert [f["check"] for f in gate["findings"]] == ["norm_ratio"]
        assert gate["drift"]["norm_ratio"] == pytest.approx(10.0, rel=1e-4)
        assert gate["drift"]["shared_keys"] == gate["drift"]["sample_keys"] > 5000
        assert server.registry.gate_ledger.warnings() == {
            ("m", "sparse_embedding0", "norm_ratio"): 1}
    assert any("row norms drifted 10×" in r.getMessage() and "the version serves" in
               r.getMessage() for r in caplog.records)
    strict = config_of(tmp_path / "strict", "v1", 8, persistent, {"drift": "refuse"})
    strict["models"][0]["sparse_files"] = [str(tmp_path / "v1")]
    with HierarchicalParameterServer(strict) as server:
        with pytest.raises(LoadGateError, match="row norms drifted 10×.*max_norm_ratio is 2"):
            reload_from(server, tmp_path / "v2")
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:5]), rows[:5])
        gate = server.model("m").table(0).source.load_gate
        assert not gate["passed"] and gate["findings"][0]["refused"]


def test_key_churn_above_the_limit(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 20_000, 4)
    write_table(tmp_path / "v1", keys, rows)
    # the new version drops 40 % of the keys and adds as many others
    new_keys = np.concatenate([keys[:12_000], keys[12_000:] + 2**41])
    write_table(tmp_path / "v2", new_keys, rows)
    model = {"validation": {"max_key_churn": 0.25, "drift": "refuse"}}
    config = config_of(tmp_path, "v1", 4)
    config["models"][0].update(model)  # the model's own section
    with HierarchicalParameterServer(config) as server:
        with pytest.raises(LoadGateError, match="of the keys are new") as refused:
            reload_from(server, tmp_path / "v2")
        figure = refused.value.details()["figure"]
        assert figure == pytest.approx(0.4, abs=0.05)
        drift = refused.value.verdict.drift
        assert drift["keys_added"] == pytest.approx(0.4, abs=0.05)
        assert drift["keys_removed"] == pytest.approx(0.4, abs=0.05)
        np.testing.assert_array_equal(server.lookup("m", 0, keys[-5:]), rows[-5:])
    loose = copy.deepcopy(config)
    loose["models"][0]["validation"]["max_key_churn"] = 0.5
    with HierarchicalParameterServer(loose) as server:
        reload_from(server, tmp_path / "v2")
        gate = server.model("m").table(0).source.load_gate
        assert gate["passed"] and not gate["findings"]
        assert gate["drift"]["key_churn"] == pytest.approx(0.4, abs=0.05)
