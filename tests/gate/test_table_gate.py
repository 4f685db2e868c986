"""The load gate's checks on a stream of chunks (hps/gate/), without a server: the
compiled key set against NumPy, each check's figure and limit, the drift figures
against files (`FileRows`), and the `validation` config section."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import ConfigError, load_config
from hps.gate.drift import FileRows
from hps.gate.key_set import KeySet, sample_rows, sample_threshold
from hps.gate.settings import ValidationConfig, effective
from hps.gate.table_gate import TableGate
from hps.gate.verdict import GateLedger, LoadGateError, PassedVersion
from hps.modelfiles.formats import ReadOptions, open_model
from hps.rows.storage_types import storage_type
from tests.conftest import model_config, write_table


def chunked(keys: np.ndarray, rows: np.ndarray, size: int = 100
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(keys[i:i + size], rows[i:i + size]) for i in range(0, len(keys), size)]


def gate(keys: np.ndarray, rows: np.ndarray, **settings: Any) -> TableGate:
    options = {k: settings.pop(k) for k in ("served", "storage", "allow_non_finite",
                                             "count_duplicates", "previous") if k in settings}
    return TableGate(ValidationConfig(**settings), model="m", table="t", uri="/files",
                     dim=rows.shape[1], num_keys=len(keys), **options)


def run(g: TableGate, keys: np.ndarray, rows: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray]:
    out = list(g.check(chunked(keys, rows)))
    return np.concatenate([k for k, _ in out]), np.concatenate([r for _, r in out])


def test_key_set_marks_first_rows_as_numpy_does(rng: np.random.Generator) -> None:
    keys = rng.integers(-50, 50, size=5000).astype(np.int64)
    keys[::97] = np.iinfo(np.int64).min  # the slots' empty value is a key like any other
    keys[5::89] = np.iinfo(np.int64).max
    seen = KeySet(len(keys))
    keep = np.concatenate([seen.first_rows(c)[0] for c in np.array_split(keys, 7)])
    expected = np.zeros(len(keys), dtype=bool)
    expected[np.unique(keys, return_index=True)[1]] = True
    np.testing.assert_array_equal(keep, expected)
    assert seen.size == np.unique(keys).size


def test_sample_picks_the_same_keys_in_any_version(rng: np.random.Generator) -> None:
    keys = rng.permutation(200_000).astype(np.int64)
    threshold = sample_threshold(len(keys), 2000)
    picked = keys[sample_rows(keys, threshold)]
    assert 1700 < picked.size < 2300  # about the sample size asked for
    later = np.concatenate([keys[::-1], rng.integers(10**6, 10**7, 5000)])
    again = later[sample_rows(later, threshold)]
    assert set(picked.tolist()) <= set(again.tolist())  # a key's pick is its own
    assert sample_threshold(10, 2000) == np.uint64(2**64 - 1)  # small tables: every key


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_counted_against_max_nan_rows(bad: float) -> None:
    keys = np.arange(1000, dtype=np.int64)
    rows = np.ones((1000, 4), np.float32)
    rows[[120, 450, 451], 2] = bad
    with pytest.raises(LoadGateError, match="row 120 holds NaN or infinity") as refused:
        run(gate(keys, rows), keys, rows)
    assert refused.value.details() == {"model": "m", "table": "t", "check": "non_finite",
                                       "figure": 1.0, "limit": 0.0}
    with pytest.raises(LoadGateError, match="3 such rows so far.*max_nan_rows allows 2"):
        run(gate(keys, rows, max_nan_rows=2), keys, rows)
    g = gate(keys, rows, max_nan_rows=3)
    got_keys, got_rows = run(g, keys, rows)  # tolerated rows load as they are
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_rows, rows)
    assert g.finish().non_finite_rows == 3 and g.verdict.passed
    assert run(gate(keys, rows, allow_non_finite=True), keys, rows)[0].size == 1000


def test_rows_a_compact_storage_cannot_hold_are_refused() -> None:
    keys = np.arange(300, dtype=np.int64)
    rows = np.ones((300, 4), np.float32)
    rows[201, 0] = 1e6
    with pytest.raises(LoadGateError, match="row 201 holds 1e\\+06, past the range of "
                                            "float16") as refused:
        run(gate(keys, rows, storage=storage_type("float16")), keys, rows)
    assert refused.value.finding.check == "encodable"
    assert refused.value.finding.limit == storage_type("float16").max_magnitude


def test_a_chunk_of_another_width_is_refused() -> None:
    keys = np.arange(10, dtype=np.int64)
    g = TableGate(ValidationConfig(), model="m", table="t", uri="/files", dim=8,
                  num_keys=10)
    with pytest.raises(LoadGateError, match="rows are 4 wide but .* says 8") as refused:
        list(g.check([(keys, np.ones((10, 4), np.float32))]))
    assert (refused.value.finding.figure, refused.value.finding.limit) == (4.0, 8.0)


def repeated() -> tuple[np.ndarray, np.ndarray]:
    keys = np.concatenate([np.arange(500), np.arange(0, 500, 10)]).astype(np.int64)
    rows = np.arange(keys.size * 2, dtype=np.float32).reshape(-1, 2)
    return keys, rows


def test_duplicates_first_drops_later_rows_and_refuse_refuses() -> None:
    keys, rows = repeated()
    g = gate(keys, rows, duplicates="first")
    got_keys, got_rows = run(g, keys, rows)
    np.testing.assert_array_equal(got_keys, np.arange(500))
    np.testing.assert_array_equal(got_rows, rows[:500])  # the first row of every key
    assert g.finish().duplicate_keys == 50
    assert list(g.replay(chunked(keys, rows)))[-1][0].size == 0  # a second read alike
    with pytest.raises(LoadGateError, match="row 500 repeats key 0 of an earlier row"
                       ) as refused:
        run(gate(keys, rows, duplicates="refuse"), keys, rows)
    assert refused.value.details()["check"] == "duplicates"


def test_duplicates_last_pass_every_row_and_are_counted() -> None:
    keys, rows = repeated()
    g = gate(keys, rows)
    assert run(g, keys, rows)[0].size == keys.size  # the tiers keep the last row
    assert g.finish(distinct_keys=500).duplicate_keys == 50  # the whole tier's size
    counted = gate(keys, rows, count_duplicates=True)  # hps validate: no tier
    assert run(counted, keys, rows)[0].size == keys.size
    assert counted.finish().duplicate_keys == 50


def served(tmp_path: Path, keys: np.ndarray, rows: np.ndarray) -> FileRows:
    write_table(tmp_path / "old", keys, rows)
    return FileRows(open_model(str(tmp_path / "old"), ReadOptions(rows.shape[1])))


def test_norms_blown_up_tenfold_warn_by_default_and_refuse_on_request(
        tmp_path: Path, rng: np.random.Generator) -> None:
    keys = rng.permutation(20_000).astype(np.int64)
    old = rng.standard_normal((keys.size, 8)).astype(np.float32)
    new = old * 10
    g = gate(keys, new, served=served(tmp_path, keys, old), drift_sample_keys=1000)
    run(g, keys, new)
    verdict = g.finish()
    assert verdict.passed and [f.check for f in verdict.findings] == ["norm_ratio"]
    drift = verdict.drift
    assert drift is not None and 800 < drift["sample_keys"] == drift["shared_keys"] < 1200
    assert drift["norm_ratio"] == pytest.approx(10.0, rel=1e-4)
    for stat in ("mean", "p50", "p99"):
        assert drift["norm_new"][stat] == pytest.approx(10 * drift["norm_old"][stat], rel=1e-4)
    assert drift["key_churn"] == 0.0
    g = gate(keys, new, served=served(tmp_path, keys, old), drift="refuse")
    run(g, keys, new)
    with pytest.raises(LoadGateError, match="row norms drifted 10×") as refused:
        g.finish()
    assert refused.value.details()["check"] == "norm_ratio"
    assert refused.value.details()["limit"] == 2.0
    collapsed = gate(keys, old / 10, served=served(tmp_path, keys, old), drift="refuse")
    run(collapsed, keys, old / 10)
    with pytest.raises(LoadGateError, match="drifted 10×"):  # a collapse counts alike
        collapsed.finish()


def test_key_churn_is_estimated_from_the_sample(tmp_path: Path,
                                                rng: np.random.Generator) -> None:
    old_keys = np.arange(40_000, dtype=np.int64)
    new_keys = np.arange(10_000, 50_000, dtype=np.int64)  # a quarter gone, a quarter new
    old = rng.standard_normal((old_keys.size, 4)).astype(np.float32)
    new = rng.standard_normal((new_keys.size, 4)).astype(np.float32)
    g = gate(new_keys, new, served=served(tmp_path, old_keys, old), drift_sample_keys=4000,
             max_key_churn=0.2, drift="refuse")
    run(g, new_keys, new)
    with pytest.raises(LoadGateError, match="of the keys are new") as refused:
        g.finish()
    drift = refused.value.verdict.drift
    assert drift["keys_added"] == pytest.approx(0.25, abs=0.04)
    assert drift["keys_removed"] == pytest.approx(0.25, abs=0.04)
    assert refused.value.details()["check"] == "key_churn"
    assert refused.value.details()["figure"] == pytest.approx(0.25, abs=0.04)
    loose = gate(new_keys, new, served=served(tmp_path, old_keys, old), max_key_churn=0.3)
    run(loose, new_keys, new)
    assert loose.finish().passed and not loose.verdict.findings


def _digest(keys: np.ndarray, rows: np.ndarray) -> str:
    g = gate(keys, rows)
    run(g, keys, rows)
    return g.finish().digest


def test_a_rollback_comes_back_only_with_the_opt_ins_its_pass_rested_on(
        tmp_path: Path, rng: np.random.Generator) -> None:
    """The version served before passed only with allow_shrink: a reload of its rows is
    let in by the previous-version rule only where allow_shrink is given again; one that
    passed without an opt-in comes back without one."""
    keys = np.arange(8000, dtype=np.int64)
    rows = rng.standard_normal((keys.size, 4)).astype(np.float32)
    small_keys, small = keys[:1000], rows[:1000]
    shrunk = PassedVersion(_digest(small_keys, small), frozenset({"allow_shrink"}))

    def reload(**settings: Any) -> TableGate:
        g = gate(small_keys, small, served=served(tmp_path, keys, rows), **settings)
        run(g, small_keys, small)
        return g

    with pytest.raises(LoadGateError, match="passed only with allow_shrink: give it "
                       "again to load them") as refused:
        reload(previous=shrunk).finish()
    assert refused.value.details()["check"] == "size"
    assert refused.value.verdict.previous_version
    verdict = reload(previous=shrunk, allow_shrink=True).finish()
    assert [(a["check"], a["by"]) for a in verdict.admitted] == [("size", "allow_shrink")]
    assert verdict.opt_ins == ["allow_shrink"] and verdict.as_dict()["opt_ins"] == [
        "allow_shrink"]
    clean = PassedVersion(shrunk.digest)  # the same rows, once passed without an opt-in
    verdict = reload(previous=clean).finish()
    assert [(a["check"], a["by"]) for a in verdict.admitted] == [("size", "previous_version")]
    assert verdict.opt_ins == []
    with pytest.raises(LoadGateError, match="the table holds 1,000 keys") as refused:
        reload(previous=PassedVersion("0" * 32)).finish()  # another version's rows
    assert not refused.value.verdict.previous_version
    assert "passed only with" not in str(refused.value)


def test_a_rollback_let_in_by_the_rule_keeps_the_opt_ins_of_its_earlier_pass(
        tmp_path: Path, rng: np.random.Generator) -> None:
    """Rows let back by the previous-version rule (a drift no opt-in allows) rest on what
    their earlier pass rested on: the next rollback to them needs it again too."""
    keys = np.arange(4000, dtype=np.int64)
    rows = rng.standard_normal((keys.size, 4)).astype(np.float32)
    blown = rows * 10
    earlier = PassedVersion(_digest(keys, blown), frozenset({"allow_shrink"}))
    g = gate(keys, blown, served=served(tmp_path, keys, rows), drift="refuse",
             previous=earlier, allow_shrink=True)
    run(g, keys, blown)
    verdict = g.finish()
    assert [(a["check"], a["by"]) for a in verdict.admitted] == [
        ("norm_ratio", "previous_version")]
    assert verdict.opt_ins == ["allow_shrink"]
    g = gate(keys, blown, served=served(tmp_path, keys, rows), drift="refuse",
             previous=earlier)
    run(g, keys, blown)
    with pytest.raises(LoadGateError, match="row norms drifted 10×.*passed only with "
                       "allow_shrink"):
        g.finish()


def test_ledger_counts_refusals_and_warnings_by_check() -> None:
    keys = np.arange(10, dtype=np.int64)
    rows = np.ones((10, 2), np.float32)
    rows[3] = np.nan
    ledger = GateLedger()
    for _ in range(2):
        try:
            run(gate(keys, rows), keys, rows)
        except LoadGateError as exc:
            ledger.record(exc.verdict)
    assert ledger.refusals() == {("m", "t", "non_finite"): 2}
    assert not ledger.last()[("m", "t")].passed


def config_with(validation: Any, model_validation: Any = None) -> dict[str, Any]:
    model = model_config(["/srv/t0"], [8])
    if model_validation is not None:
        model["validation"] = model_validation
    return {"models": [model], "validation": validation}


def test_the_validation_section_defaults_and_per_model_keys() -> None:
    defaults = load_config(config_with({})).validation
    assert (defaults.max_nan_rows, defaults.duplicates, defaults.drift) == (0, "last", "warn")
    config = load_config(config_with({"drift": "refuse", "max_norm_ratio": 4},
                                     {"max_key_churn": 0.1}))
    limits = effective(config.validation, config.models[0].validation)
    assert (limits.drift, limits.max_norm_ratio, limits.max_key_churn) == ("refuse", 4.0, 0.1)
    assert effective(config.validation, None) is config.validation


@pytest.mark.parametrize(("validation", "message"), [
    ({"max_nan_row": 1}, "unknown key 'max_nan_row' in validation \\(did you mean "
                         "'max_nan_rows'\\?\\)"),
    ({"duplicates": "middle"}, "validation.duplicates: Input should be 'last', 'first' or "
                               "'refuse'"),
    ({"max_norm_ratio": 0.5}, "validation.max_norm_ratio: Input should be greater than or "
                              "equal to 1"),
    ({"max_key_churn": "0.2"}, "validation.max_key_churn: must be a number, got '0.2'"),
    ({"drift_sample_keys": 0}, "validation.drift_sample_keys"),
])
def test_bad_validation_sections_are_config_errors(validation: dict[str, Any],
                                                   message: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match=message):
            load_config(config_with(validation))
        with pytest.raises(ConfigError, match=message.replace("validation.", "models\\[0\\]"
                                                              ".validation.")):
            load_config(config_with({}, validation))


def test_a_refusal_crosses_processes_whole() -> None:
    # with --workers the leader's refusal reaches the answering worker pickled
    import pickle

    from hps.gate.verdict import Finding, GateVerdict, LoadGateError

    verdict = GateVerdict(model="m", table="t", uri="/x")
    verdict.add(Finding("size", 0, 3000, True, "the table holds no keys"))
    error = pickle.loads(pickle.dumps(LoadGateError(verdict)))
    assert isinstance(error, LoadGateError) and error.kind == "load_gate"
    assert str(error) == "the table holds no keys"
    assert error.details() == {"model": "m", "table": "t", "check": "size", "figure": 0,
                               "limit": 3000}
