"""The load gate over HTTP (uvicorn on a socket): a refused reload or add answers 422
naming the table, check, figure and limit, the old version keeps serving, and
`GET /v1/models/{model}` and /metrics show the verdicts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_table
from tests.http.conftest import DIMS, MODEL, TABLE_NAMES, Live, start, write_model


@pytest.fixture
def live_gate(tmp_path: Path) -> Iterator[Live]:
    """A server over a model of the test's own; reloads and adds may read anywhere
    under tmp_path; drift refuses."""
    model = write_model(tmp_path / "v1", seed=7)
    model.config["http"] = {"allowed_sources": [str(tmp_path)]}
    model.config["validation"] = {"drift": "refuse"}
    yield from start(model, allow_roots=[str(tmp_path)])


def _reload(live: Live, first_table: Path) -> dict:  # type: ignore[type-arg]
    answer = live.client.post(f"/v1/models/{MODEL}/reload", json={"sparse_files": [
        str(first_table), str(live.model.dir / TABLE_NAMES[1])]})
    return {"status": answer.status_code, **answer.json()}


def _served(live: Live, keys: np.ndarray) -> np.ndarray:
    answer = live.lookup_binary(0, keys)
    assert answer.status_code == 200, answer.text
    return np.frombuffer(answer.content, "<f4").reshape(len(keys), DIMS[0])


def test_a_refused_reload_answers_422_and_the_old_version_serves(live_gate: Live,
                                                                  tmp_path: Path) -> None:
    keys, rows = live_gate.model.keys[0], live_gate.model.vectors[0]
    bad = rows.copy()
    bad[100:104, 1] = np.inf
    write_table(tmp_path / "nan", keys, bad)
    answer = _reload(live_gate, tmp_path / "nan")
    assert answer["status"] == 422
    error = answer["error"]
    assert (error["kind"], error["model"], error["table"]) == ("load_gate", MODEL, "users")
    # the figure is the rows of the chunk that failed
    assert (error["check"], error["figure"], error["limit"]) == ("non_finite", 4.0, 0.0)
    assert "row 100 holds NaN or infinity (4 such rows so far)" in error["message"]
    np.testing.assert_array_equal(_served(live_gate, keys[:50]), rows[:50])

    write_table(tmp_path / "blown", keys, rows * 10)
    answer = _reload(live_gate, tmp_path / "blown")
    assert answer["status"] == 422
    assert answer["error"]["check"] == "norm_ratio"
    assert answer["error"]["figure"] == pytest.approx(10.0, rel=1e-4)
    assert answer["error"]["limit"] == 2.0
    np.testing.assert_array_equal(_served(live_gate, keys[:50]), rows[:50])

    info = live_gate.client.get(f"/v1/models/{MODEL}").json()
    gate = info["tables"][0]["source"]["load_gate"]
    assert not gate["passed"] and not gate["served"]
    assert gate["uri"] == str(tmp_path / "blown")
    assert gate["drift"]["norm_ratio"] == pytest.approx(10.0, rel=1e-4)
    assert info["tables"][0]["source"]["uri"] == str(live_gate.model.dir / TABLE_NAMES[0])

    assert live_gate.metric("hps_load_gate_refusals_total", model=MODEL, table="users",
                            check="non_finite") == 1.0
    assert live_gate.metric("hps_load_gate_refusals_total", model=MODEL, table="users",
                            check="norm_ratio") == 1.0
    assert live_gate.metric("hps_load_gate_passed", model=MODEL, table="users") == 0.0
    assert live_gate.metric("hps_load_gate_drift", model=MODEL, table="users",
                            figure="norm_ratio") == pytest.approx(10.0, rel=1e-4)
    assert live_gate.metric("hps_http_errors_total", kind="load_gate", code="422") == 2.0


def test_a_passing_reload_answers_its_verdict(live_gate: Live, tmp_path: Path) -> None:
    keys, rows = live_gate.model.keys[0], live_gate.model.vectors[0]
    write_table(tmp_path / "next", keys, rows * 1.1)
    answer = _reload(live_gate, tmp_path / "next")
    assert answer["status"] == 200, answer
    gate = answer["tables"][0]["source"]["load_gate"]
    assert gate["passed"] and gate["served"] and not gate["findings"]
    assert gate["drift"]["norm_ratio"] == pytest.approx(1.1, rel=1e-4)
    assert gate["drift"]["key_churn"] == 0.0
    np.testing.assert_allclose(_served(live_gate, keys[:5]), rows[:5] * 1.1)
    assert live_gate.metric("hps_load_gate_passed", model=MODEL, table="users") == 1.0
    assert live_gate.metric("hps_load_gate_drift", model=MODEL, table="users",
                            figure="norm_new_mean") > 0


def test_an_added_model_of_another_width_answers_422(live_gate: Live,
                                                     tmp_path: Path) -> None:
    extra = write_model(tmp_path / "extra", seed=8)
    block = {**extra.config["models"][0], "model": "extra",
             "embedding_vecsize_per_table": [16, DIMS[1]]}
    answer = live_gate.client.post("/v1/models", json=block)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["check"], error["figure"], error["limit"]) == ("width", 8.0, 16.0)
    assert (error["model"], error["table"]) == ("extra", "users")
    assert "extra" not in live_gate.client.get("/v1/models").json()["models"]
    assert live_gate.metric("hps_load_gate_refusals_total", model="extra", table="users",
                            check="width") == 1.0
