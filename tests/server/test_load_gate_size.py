"""The load gate's size check and rollbacks in the server: a table of no keys, or a reload
far smaller than the served version, is refused unless the load opts in; the churn is
measured with an empty side; the version served before always comes back. Real RocksDB
on temp dirs and the in-process hash map."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gate.settings import ValidationConfig
from hps.gate.verdict import LoadGateError
from hps.server import HierarchicalParameterServer
from tests.conftest import make_table, write_table
from tests.server.test_load_gate import config_of, reload_from, stored

STRICT = {"drift": "refuse", "max_key_churn": 0.2}


def elsewhere(tmp_path: Path, store: str, validation: dict[str, Any]) -> dict[str, Any]:
    """A config serving `tmp_path / "v1"` over a RocksDB of its own (`store`)."""
    config = config_of(tmp_path / store, "v1", 4, True, validation)
    config["models"][0]["sparse_files"] = [str(tmp_path / "v1")]
    return config


def empty_table(folder: Path) -> Path:
    """A sparse folder of 0-byte `key` and `emb_vector` files."""
    folder.mkdir(parents=True)
    (folder / "key").write_bytes(b"")
    (folder / "emb_vector").write_bytes(b"")
    return folder


@pytest.mark.parametrize("persistent", [True, False])
def test_an_empty_reload_is_refused_and_then_allowed_and_the_previous_version_comes_back(
        tmp_path: Path, rng: np.random.Generator, persistent: bool) -> None:
    keys, rows = make_table(rng, 3000, 8)
    write_table(tmp_path / "v1", keys, rows)
    empty = empty_table(tmp_path / "v2")
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 8, persistent, STRICT)
                                     ) as server:
        before = stored(server)
        with pytest.raises(LoadGateError, match=r"v2: the table holds no keys \(key: 0 bytes, "
                           r"emb_vector: 0 bytes\); the served version holds 3,000 keys"
                           ) as refused:
            reload_from(server, empty)
        assert refused.value.details() == {"model": "m", "table": "sparse_embedding0",
                                           "check": "size", "figure": 0.0, "limit": 1.0}
        verdict = refused.value.verdict
        assert verdict.drift is not None and verdict.drift["key_churn"] == 1.0
        assert (verdict.drift["keys_added"], verdict.drift["keys_removed"]) == (0.0, 1.0)
        assert stored(server) == before
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:20]), rows[:20])

        # asked for: it serves (defaults only), and says what let it in
        server.reload_model("m", [str(empty)], allow_empty=True)
        gate = server.model("m").table(0).source.load_gate
        assert gate["passed"] and gate["served"] and gate["keys"] == 0
        assert gate["served_keys"] == 3000 and gate["drift"]["key_churn"] == 1.0
        assert [(a["check"], a["by"]) for a in gate["admitted"]] == [
            ("size", "allow_empty"), ("key_churn", "allow_empty")]
        assert [f["refused"] for f in gate["findings"]] == [False, False]
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:3]),
                                      np.full((3, 8), 0.5, np.float32))

        # the previous version comes back although its churn against the empty one is 1.0
        server.reload_model("m", [str(tmp_path / "v1")])
        gate = server.model("m").table(0).source.load_gate
        assert gate["previous_version"] and gate["drift"]["key_churn"] == 1.0
        assert [(a["check"], a["by"]) for a in gate["admitted"]] == [
            ("key_churn", "previous_version")]
        assert "version served before" in gate["admitted"][0]["why"]
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:20]), rows[:20])


def test_the_previous_version_is_known_by_its_rows_not_its_files(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 5000, 4)
    write_table(tmp_path / "v1", keys, rows)
    write_table(tmp_path / "v2", keys, rows * 10)  # a blow-up let in by drift: warn
    write_table(tmp_path / "v3", keys, rows * 100)
    shutil.copytree(tmp_path / "v1", tmp_path / "v1-copy")  # other files, other times
    config = config_of(tmp_path, "v1", 4, True)
    with HierarchicalParameterServer(config) as server:
        reload_from(server, tmp_path / "v2")

        def strict(folder: Path) -> Any:  # the model's own section refuses drifts now
            model = server.model("m").config
            return server.load_model(model.model_copy(update={
                "sparse_files": [str(folder)],
                "validation": ValidationConfig(drift="refuse")}))

        with pytest.raises(LoadGateError, match="row norms drifted 10×"):
            strict(tmp_path / "v3")
        strict(tmp_path / "v1-copy")
        gate = server.model("m").table(0).source.load_gate
        assert gate["previous_version"]
        assert [(a["check"], a["by"]) for a in gate["admitted"]] == [
            ("norm_ratio", "previous_version")]
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:5]), rows[:5])
        # only the version just replaced is a rollback: v3 is still measured
        with pytest.raises(LoadGateError, match="row norms drifted 100×"):
            strict(tmp_path / "v3")


def test_a_reload_far_smaller_than_the_served_version_is_refused_unless_allowed(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 4000, 4)
    write_table(tmp_path / "v1", keys, rows)
    write_table(tmp_path / "small", keys[:1000], rows[:1000])
    write_table(tmp_path / "half", keys[:2000], rows[:2000])
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 4)) as server:
        with pytest.raises(LoadGateError, match=r"small: the table holds 1,000 keys \(key: "
                           r"8,000 bytes, emb_vector: 16,000 bytes\) where the served version "
                           r"holds 4,000: validation.min_key_ratio 0.5 asks for 2,000"
                           ) as refused:
            reload_from(server, tmp_path / "small")
        details = refused.value.details()
        assert (details["check"], details["figure"], details["limit"]) == ("size", 1000, 2000)
        np.testing.assert_array_equal(server.lookup("m", 0, keys[-3:]), rows[-3:])
        reload_from(server, tmp_path / "half")  # at the limit: its churn only warns
        assert server.model("m").table(0).source.load_gate["keys"] == 2000
    with HierarchicalParameterServer(elsewhere(tmp_path, "other", {"min_key_ratio": 0.2})
                                     ) as server:
        reload_from(server, tmp_path / "small")  # 25 % of the keys: over a limit of 20 %
    with HierarchicalParameterServer(elsewhere(tmp_path, "third", STRICT)) as server:
        server.reload_model("m", [str(tmp_path / "small")], allow_shrink=True)
        gate = server.model("m").table(0).source.load_gate
        assert [(a["check"], a["by"]) for a in gate["admitted"]] == [
            ("size", "allow_shrink"), ("key_churn", "allow_shrink")]


def test_a_first_load_of_an_empty_table_is_refused_unless_the_config_allows_it(
        tmp_path: Path) -> None:
    empty_table(tmp_path / "e")
    with HierarchicalParameterServer(config_of(tmp_path, "e", 8, True), load=False) as server:
        with pytest.raises(LoadGateError, match=r"e: the table holds no keys \(key: 0 bytes"):
            server.load_model(server.config.models[0])
        assert "m" not in server.models
        assert all(not tables for tables in stored(server).values())
    allowed: dict[str, Any] = config_of(tmp_path, "e", 8, True)
    allowed["models"][0]["validation"] = {"allow_empty": True}
    with HierarchicalParameterServer(allowed) as server:
        gate = server.model("m").table(0).source.load_gate
        assert gate["passed"] and gate["keys"] == 0 and gate["drift"] is None
        assert gate["admitted"] == [{"check": "size", "by": "allow_empty",
                                     "why": gate["admitted"][0]["why"]}]


def test_the_digest_outlives_a_restart_over_the_same_rocksdb(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys, rows = make_table(rng, 3000, 4)
    write_table(tmp_path / "v1", keys, rows)
    config = config_of(tmp_path, "v1", 4, True)
    with HierarchicalParameterServer(config) as server:
        digest = server.model("m").table(0).source.rows_digest
        assert len(digest) == 32
    with HierarchicalParameterServer(config) as server:
        source = server.model("m").table(0).source
        assert source.reused and source.rows_digest == digest


@pytest.mark.parametrize("opt_in", ["allow_shrink", "allow_empty"])
def test_an_opt_in_lets_a_version_in_once_not_after_every_rollback(
        tmp_path: Path, rng: np.random.Generator, opt_in: str) -> None:
    """The report's alternation: a version let in by an opt-in, a rollback, the same
    version again without the opt-in: refused every time (it was let in as
    `previous_version` as often as they alternated), served every time the opt-in comes
    with it, and the rollback always comes back."""
    keys, rows = make_table(rng, 4000, 4)
    write_table(tmp_path / "v1", keys, rows)
    if opt_in == "allow_shrink":
        write_table(tmp_path / "v2", keys[:500], rows[:500])
    else:
        empty_table(tmp_path / "v2")
    check = "size"
    with HierarchicalParameterServer(config_of(tmp_path, "v1", 4, True, STRICT)) as server:
        for turn in range(3):
            with pytest.raises(LoadGateError) as refused:
                reload_from(server, tmp_path / "v2")
            assert refused.value.details()["check"] == check
            # from the second turn on, v2 is the version served before: the refusal says
            # which opt-in its pass rested on
            assert refused.value.verdict.previous_version == (turn > 0)
            assert (f"passed only with {opt_in}: give it again" in str(refused.value)) == (
                turn > 0)
            np.testing.assert_array_equal(server.lookup("m", 0, keys[-3:]), rows[-3:])

            server.reload_model("m", [str(tmp_path / "v2")], **{opt_in: True})
            gate = server.model("m").table(0).source.load_gate
            assert gate["opt_ins"] == [opt_in] and gate["previous_version"] == (turn > 0)
            assert {a["by"] for a in gate["admitted"]} == {opt_in}
            assert server.model("m").table(0).source.rows_opt_ins == [opt_in]

            reload_from(server, tmp_path / "v1")  # the rollback: no opt-in needed
            gate = server.model("m").table(0).source.load_gate
            assert gate["previous_version"] and gate["opt_ins"] == []
            assert [a["by"] for a in gate["admitted"]] == ["previous_version"]
            np.testing.assert_array_equal(server.lookup("m", 0, keys[-3:]), rows[-3:])


def test_the_opt_ins_of_stored_rows_outlive_a_restart(
        tmp_path: Path, rng: np.random.Generator) -> None:
    """Rows let in by allow_shrink and served again after a restart over the same RocksDB
    (not read again) still need allow_shrink to come back as the previous version."""
    keys, rows = make_table(rng, 4000, 4)
    write_table(tmp_path / "v1", keys, rows)
    write_table(tmp_path / "half", keys[:2000], rows[:2000])
    write_table(tmp_path / "small", keys[:500], rows[:500])
    config = config_of(tmp_path, "v1", 4, True)
    with HierarchicalParameterServer(config) as server:
        reload_from(server, tmp_path / "half")  # at the limit: no opt-in
        server.reload_model("m", [str(tmp_path / "small")], allow_shrink=True)
        assert server.model("m").table(0).source.rows_opt_ins == ["allow_shrink"]
    config["models"][0]["sparse_files"] = [str(tmp_path / "small")]
    with HierarchicalParameterServer(config) as server:
        source = server.model("m").table(0).source
        assert source.reused and source.rows_opt_ins == ["allow_shrink"]
        reload_from(server, tmp_path / "half")
        with pytest.raises(LoadGateError, match="passed only with allow_shrink"):
            reload_from(server, tmp_path / "small")
        server.reload_model("m", [str(tmp_path / "small")], allow_shrink=True)
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:3]), rows[:3])
