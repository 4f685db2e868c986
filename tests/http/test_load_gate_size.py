"""The load gate's size check over HTTP: uvicorn on a socket, `hps serve` and `hps serve
--workers 2` as processes. A table of no keys is answered 422 naming the files and the
sizes, served only when the request or the config opts in; the version served before
always comes back."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.http.conftest import DIMS, MODEL, TABLE_NAMES, Live, start, write_model
from tests.http.test_serve import ROOT, Process
from tests.support.redis_servers import free_port

#: the gate of the report: drift refused past a key churn of 0.2
STRICT = {"drift": "refuse", "max_key_churn": 0.2}


def empty_table(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "key").write_bytes(b"")
    (folder / "emb_vector").write_bytes(b"")
    return folder


@pytest.fixture
def live_strict(tmp_path: Path) -> Iterator[Live]:
    model = write_model(tmp_path / "v1", seed=7)
    model.config["validation"] = STRICT
    yield from start(model, allow_roots=[str(tmp_path)])


def reload(url: str, tables: list[Path] | None, **body: Any) -> httpx.Response:
    if tables is not None:
        body["sparse_files"] = [str(t) for t in tables]
    return httpx.post(f"{url}/v1/models/{MODEL}/reload", json=body or None, timeout=120)


def users(url: str, keys: np.ndarray) -> np.ndarray:
    answer = httpx.post(f"{url}/v1/models/{MODEL}/tables/users/lookup",
                        json={"keys": keys.tolist()}, timeout=30)
    assert answer.status_code == 200, answer.text
    return np.asarray(answer.json()["vectors"], np.float32)


def check_empty_reload_refused_allowed_and_rolled_back(url: str, model_dir: Path,
                                                       empty: Path, keys: np.ndarray,
                                                       rows: np.ndarray) -> None:
    """The report's sequence: an empty reload, then the good version again."""
    items = model_dir / TABLE_NAMES[1]
    refused = reload(url, [empty, items])
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (error["kind"], error["table"], error["check"]) == ("load_gate", "users", "size")
    assert (error["figure"], error["limit"]) == (0, 1)
    assert (f"{empty}: the table holds no keys (key: 0 bytes, emb_vector: 0 bytes); the "
            "served version holds 3,000 keys") in error["message"]
    np.testing.assert_array_equal(users(url, keys), rows)

    allowed = reload(url, [empty, items], allow_empty=True)
    assert allowed.status_code == 200, allowed.text
    gate = allowed.json()["tables"][0]["source"]["load_gate"]
    assert gate["keys"] == 0 and gate["drift"]["key_churn"] == 1.0
    assert [(a["check"], a["by"]) for a in gate["admitted"]] == [
        ("size", "allow_empty"), ("key_churn", "allow_empty")]
    np.testing.assert_array_equal(users(url, keys), np.full_like(rows, 0.5))

    back = reload(url, [model_dir / TABLE_NAMES[0], items])
    assert back.status_code == 200, back.text
    gate = back.json()["tables"][0]["source"]["load_gate"]
    assert gate["previous_version"] and gate["drift"]["key_churn"] == 1.0
    assert [(a["check"], a["by"]) for a in gate["admitted"]] == [
        ("key_churn", "previous_version")]
    np.testing.assert_array_equal(users(url, keys), rows)


def test_an_empty_reload_answers_422_until_asked_and_the_good_version_comes_back(
        live_strict: Live, tmp_path: Path) -> None:
    keys, rows = live_strict.model.keys[0][:40], live_strict.model.vectors[0][:40]
    empty = empty_table(tmp_path / "empty")
    wrong = reload(live_strict.url, [empty, live_strict.model.dir / TABLE_NAMES[1]],
                   allow_empty="yes")
    assert wrong.status_code == 422 and wrong.json()["error"]["kind"] != "load_gate"
    check_empty_reload_refused_allowed_and_rolled_back(
        live_strict.url, live_strict.model.dir, empty, keys, rows)
    assert live_strict.metric("hps_load_gate_refusals_total", model=MODEL, table="users",
                              check="size") == 1.0


def test_an_added_model_with_an_empty_table_needs_the_blocks_opt_in(
        live_strict: Live, tmp_path: Path) -> None:
    extra = write_model(tmp_path / "extra", seed=8)
    empty = empty_table(tmp_path / "extra-empty")
    block = {**copy.deepcopy(extra.config["models"][0]), "model": "extra",
             "sparse_files": [str(empty), str(extra.dir / TABLE_NAMES[1])]}
    refused = live_strict.client.post("/v1/models", json=block)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["check"] == "size"
    assert "extra" not in [m["model"] for m in
                           live_strict.client.get("/v1/models").json()["models"]]
    added = live_strict.client.post("/v1/models", json={**block,
                                                        "validation": {"allow_empty": True}})
    assert added.status_code == 201, added.text
    assert added.json()["tables"][0]["source"]["load_gate"]["admitted"][0]["by"] == \
        "allow_empty"


def serve_argv(config: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port", str(port),
            *extra]


def test_hps_serve_refuses_an_empty_table_at_start_unless_the_config_allows_it(
        tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=9)
    config = copy.deepcopy(model.config)
    config["models"][0]["sparse_files"][0] = str(empty_table(tmp_path / "empty"))
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    port = free_port()
    proc = Process(serve_argv(path, port), env)
    try:
        line = proc.wait_for(f"hps: model '{MODEL}' failed to load", timeout=120)
        assert "the table holds no keys (key: 0 bytes, emb_vector: 0 bytes)" in line
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 503
    finally:
        assert proc.interrupt() in (0, 130)
    config["models"][0]["validation"] = {"allow_empty": True}
    path.write_text(json.dumps(config))
    port = free_port()
    proc = Process(serve_argv(path, port), env)
    try:
        proc.wait_for("hps: every model is loaded", timeout=120)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/readyz").status_code == 200
        np.testing.assert_array_equal(users(url, model.keys[0][:5]),
                                      np.full((5, DIMS[0]), 0.5, np.float32))
    finally:
        assert proc.interrupt() in (0, 130)


def test_workers_refuse_an_empty_reload_until_asked_and_take_the_good_version_back(
        tmp_path: Path) -> None:
    from tests.http.test_workers import serve, stop, write_run

    model = write_model(tmp_path / "v1", seed=7)
    model.config["validation"] = STRICT
    served = serve(*write_run(tmp_path, model.config), "--allow-root", str(tmp_path))
    try:
        check_empty_reload_refused_allowed_and_rolled_back(
            served.url, model.dir, empty_table(tmp_path / "empty"), model.keys[0][:40],
            model.vectors[0][:40])
        for _ in range(6):  # new connections: each may land on either worker
            np.testing.assert_array_equal(users(served.url, model.keys[0][:40]),
                                          model.vectors[0][:40])
    finally:
        assert stop(served) == 0


def test_hps_models_reload_allow_empty(live_strict: Live, tmp_path: Path) -> None:
    empty = empty_table(tmp_path / "empty")
    argv = [sys.executable, "-m", "hps.tools.cli", "models", "reload", MODEL, str(empty),
            str(live_strict.model.dir / TABLE_NAMES[1]), "--url", live_strict.url]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    refused = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0
    assert "the table holds no keys" in refused.stdout + refused.stderr
    done = subprocess.run([*argv, "--allow-empty"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"reloaded model {MODEL}" in done.stdout
    np.testing.assert_array_equal(users(live_strict.url, live_strict.model.keys[0][:3]),
                                  np.full((3, DIMS[0]), 0.5, np.float32))


def test_a_shrunken_version_needs_its_opt_in_after_every_rollback(
        live_strict: Live, tmp_path: Path) -> None:
    """allow_shrink lets a version in once: after a rollback the same files without it
    answer 422 (they were let in as `previous_version`), with it 200, as often as they
    alternate; the rollback always comes back."""
    from tests.conftest import write_table

    model = live_strict.model
    keys, rows = model.keys[0], model.vectors[0]
    write_table(tmp_path / "small", keys[:500], rows[:500])
    items = model.dir / TABLE_NAMES[1]
    small, whole = [tmp_path / "small", items], [model.dir / TABLE_NAMES[0], items]
    for turn in range(3):
        refused = reload(live_strict.url, small)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert (error["kind"], error["table"], error["check"]) == ("load_gate", "users",
                                                                    "size")
        assert ("passed only with allow_shrink: give it again" in error["message"]) == (
            turn > 0)
        np.testing.assert_array_equal(users(live_strict.url, keys[-20:]), rows[-20:])
        allowed = reload(live_strict.url, small, allow_shrink=True)
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["tables"][0]["source"]["load_gate"]["opt_ins"] == [
            "allow_shrink"]
        back = reload(live_strict.url, whole)
        assert back.status_code == 200, back.text
        gate = back.json()["tables"][0]["source"]["load_gate"]
        assert gate["previous_version"] and gate["opt_ins"] == []
        np.testing.assert_array_equal(users(live_strict.url, keys[-20:]), rows[-20:])
