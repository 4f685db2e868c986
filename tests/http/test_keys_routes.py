"""Hot and missing keys and warm-ups over HTTP (hps/http/keys_routes.py): real uvicorn
servers on loopback, hash map over RocksDB, httpx as the client."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from hps.http import create_app
from hps.http.serve import ServerThread
from hps.server import HierarchicalParameterServer
from tests.http.conftest import (
    MODEL,
    Live,
    ModelFiles,
    metric_value,
    serving,
    wait_until,
    write_model,
)

#: keys of table 0 ("users") the tests make hot, and keys no table holds
HOT = 12
ABSENT = np.array([-11, -12, -13], np.int64)


def _with_tiers(model: ModelFiles, rocks: Path, **model_options: Any) -> ModelFiles:
    """`model` served from a hash map over RocksDB at `rocks`, the hash map empty after
    the load (initial_cache_rate 0: rows reach it only by prefetch or warm-up)."""
    config = copy.deepcopy(model.config)
    config["volatile_db"] = {"type": "hash_map", "initial_cache_rate": 0.0}
    config["persistent_db"] = {"type": "rocks_db", "path": str(rocks)}
    config["models"][0].update(model_options)
    return dataclasses.replace(model, config=config)


def _hot_keys(model: ModelFiles) -> np.ndarray:
    return model.keys[0][:HOT]


def _make_hot(live: Live) -> None:
    """Skewed traffic: key i of the hot ones looked up (HOT - i) * 4 times, with one key
    no table holds in every batch."""
    hot = _hot_keys(live.model)
    batch = np.concatenate([np.repeat(hot, np.arange(HOT, 0, -1)), ABSENT[:1]])
    for _ in range(4):
        assert live.lookup_binary(0, batch).status_code == 200


def _in_volatile(server: HierarchicalParameterServer, table: int, keys: np.ndarray
                 ) -> np.ndarray:
    name = server.model(MODEL).tables[table].storage_name
    return server.volatile.fetch(name, keys)[1]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def peer(model_files: ModelFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A server whose table 0 has seen skewed traffic (every lookup sampled)."""
    model = _with_tiers(model_files, tmp_path_factory.mktemp("peer") / "rocks",
                        hot_key_sampling=1)
    with serving(model) as live:
        _make_hot(live)
        yield live


def test_hot_keys_are_listed_heaviest_first_with_counts(peer: Live) -> None:
    answer = peer.client.get(f"/v1/models/{MODEL}/tables/users/keys",
                             params={"top": 3, "kind": "hot"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    hot = _hot_keys(peer.model)
    assert [k["key"] for k in body["keys"]] == hot[:3].tolist()
    assert [k["count"] for k in body["keys"]] == [HOT * 4, (HOT - 1) * 4, (HOT - 2) * 4]
    assert body["error"] == 0 and all(k["error"] == 0 for k in body["keys"])
    assert body["source"] == "lookups" and body["table"] == "users"
    assert body["total"] == 4 * (HOT * (HOT + 1) // 2 + 1)
    assert body["share"] == pytest.approx((HOT + HOT - 1 + HOT - 2) * 4 / body["total"])
    by_index = peer.client.get(f"/v1/models/{MODEL}/tables/0/keys").json()
    assert len(by_index["keys"]) == HOT + 1  # the absent key was looked up too


def test_missing_keys_are_listed(peer: Live) -> None:
    body = peer.client.get(f"/v1/models/{MODEL}/tables/users/keys",
                           params={"kind": "missing"}).json()
    assert body["keys"] == [{"key": int(ABSENT[0]), "count": 4, "error": 0}]
    other = peer.client.get(f"/v1/models/{MODEL}/tables/items/keys",
                            params={"kind": "missing"}).json()
    assert other["keys"] == [] and other["share"] is None


@pytest.mark.parametrize(("path", "params", "status", "kind"), [
    ("/v1/models/nope/tables/users/keys", {}, 404, "unknown_model"),
    (f"/v1/models/{MODEL}/tables/nope/keys", {}, 404, "unknown_table"),
    (f"/v1/models/{MODEL}/tables/users/keys", {"top": 0}, 422, "bad_request"),
    (f"/v1/models/{MODEL}/tables/users/keys", {"top": 10**6}, 422, "bad_request"),
    (f"/v1/models/{MODEL}/tables/users/keys", {"top": "ten"}, 422, "bad_request"),
    (f"/v1/models/{MODEL}/tables/users/keys", {"kind": "warm"}, 422, "bad_request"),
    ("/v1/models/nope/tables/users/hot-set", {}, 404, "unknown_model"),
    (f"/v1/models/{MODEL}/tables/9/hot-set", {}, 404, "unknown_table"),
    (f"/v1/models/{MODEL}/tables/users/hot-set", {"format": "csv"}, 422, "bad_request"),
    (f"/v1/models/{MODEL}/tables/users/hot-set", {"cached": -1}, 422, "bad_request"),
    (f"/v1/models/{MODEL}/tables/users/hot-set", {"cached": 1 << 23}, 422, "bad_request"),
    (f"/v1/models/{MODEL}/prefetch/p999999", {}, 404, "unknown_job"),
])
def test_bad_questions_get_json_errors(peer: Live, path: str, params: dict[str, Any],
                                       status: int, kind: str) -> None:
    answer = peer.client.get(path, params=params)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["kind"] == kind


def test_the_hot_set_exports_as_int64_or_json(peer: Live) -> None:
    hot = _hot_keys(peer.model)
    binary = peer.client.get(f"/v1/models/{MODEL}/tables/users/hot-set", params={"top": 5})
    assert binary.headers["content-type"] == "application/octet-stream"
    assert binary.headers["x-hps-keys"] == "5"
    assert np.frombuffer(binary.content, "<i8").tolist() == hot[:5].tolist()
    whole = peer.client.get(f"/v1/models/{MODEL}/tables/users/hot-set")
    assert np.frombuffer(whole.content, "<i8").size == HOT + 1
    # no GPU cache here: its held keys add nothing, asked for or not
    alone = peer.client.get(f"/v1/models/{MODEL}/tables/users/hot-set", params={"cached": 0})
    assert alone.content == whole.content
    as_json = peer.client.get(f"/v1/models/{MODEL}/tables/users/hot-set",
                              params={"format": "json", "top": 2}).json()
    assert as_json == {"keys": hot[:2].tolist()}


def test_metrics_report_the_missing_rate_and_the_hot_share(peer: Live) -> None:
    text = peer.client.get("/metrics").text
    looked = 4 * (HOT * (HOT + 1) // 2 + 1)
    assert metric_value(text, "hps_missing_rate", model=MODEL, table="users") == \
        pytest.approx(4 / looked)
    assert metric_value(text, "hps_hot_keys_share", model=MODEL, table="users") == \
        pytest.approx(1.0)  # fewer than 100 distinct keys: all of them are the top
    assert "hps_missing_rate" in text and 'table="items"' in text


@pytest.mark.parametrize(("body", "status"), [
    ({}, 422),
    ({"keys": [1, 2]}, 422),  # no table
    ({"table": "users", "keys": [1], "from": "hot-set"}, 422),  # both
    ({"table": "users", "keys": ["1"]}, 422),
    ({"table": "users", "keys": [2**63]}, 422),
    ({"from": "cold-set"}, 422),
    ({"from": "hot-set", "top": 0}, 422),
    ({"table": "users", "keys": [1], "extra": True}, 422),
    ({"table": "nope", "keys": [1]}, 404),
    ({"from": "hot-set", "table": 7}, 404),
])
def test_bad_prefetch_bodies_get_4xx_json(peer: Live, body: dict[str, Any],
                                          status: int) -> None:
    answer = peer.client.post(f"/v1/models/{MODEL}/prefetch", json=body)
    assert answer.status_code == status, answer.text
    assert "kind" in answer.json()["error"]


def test_prefetch_of_another_model_or_a_non_json_body_is_refused(peer: Live) -> None:
    unknown = peer.client.post("/v1/models/nope/prefetch", json={"from": "hot-set"})
    assert unknown.status_code == 404
    text = peer.client.post(f"/v1/models/{MODEL}/prefetch", content=b"{}",
                            headers={"Content-Type": "text/plain"})
    assert text.status_code in (415, 422) and "error" in text.json()


def _job(live: Live, job: str) -> dict[str, Any]:
    answer: dict[str, Any] = {}

    def finished() -> bool:
        answer.update(live.client.get(f"/v1/models/{MODEL}/prefetch/{job}").json())
        return answer["status"] not in ("queued", "running")

    wait_until(finished)
    return answer


def test_prefetch_fills_the_volatile_tier_from_rocksdb(model_files: ModelFiles,
                                                       tmp_path: Path) -> None:
    with serving(_with_tiers(model_files, tmp_path / "rocks")) as live:
        keys = live.model.keys[1][:300]
        assert not _in_volatile(live.server, 1, keys).any()
        answer = live.client.post(f"/v1/models/{MODEL}/prefetch", json={
            "table": "items", "keys": [*keys.tolist(), *ABSENT.tolist(), int(keys[0])]})
        assert answer.status_code == 202, answer.text
        (job,) = answer.json()["jobs"]
        assert job["table"] == "items" and job["keys"] == 303  # distinct keys
        done = _job(live, job["job"])
        assert done["status"] == "done" and done["error"] is None
        assert (done["found"], done["missing"], done["volatile_filled"]) == (300, 3, 300)
        assert done["gpu_inserted"] == 0  # no GPU cache here
        assert _in_volatile(live.server, 1, keys).all()
        assert not _in_volatile(live.server, 1, live.model.keys[1][300:400]).any()
        # a prefetch is no lookup: neither counted nor fed to the sketches
        stats = live.server.model(MODEL).tables[1].stats.as_dict()
        assert stats["lookups"] == 0
        got = live.lookup_binary("items", keys[:5])
        assert np.array_equal(np.frombuffer(got.content, "<f4").reshape(5, -1),
                              live.model.expected(1, keys[:5]))


def test_prefetch_from_the_own_hot_set(model_files: ModelFiles, tmp_path: Path) -> None:
    with serving(_with_tiers(model_files, tmp_path / "rocks", hot_key_sampling=1)) as live:
        _make_hot(live)
        answer = live.client.post(f"/v1/models/{MODEL}/prefetch", json={"from": "hot-set"})
        assert answer.status_code == 202
        jobs = {j["table"]: j for j in answer.json()["jobs"]}
        assert sorted(jobs) == ["items", "users"] and jobs["items"]["keys"] == 0
        done = _job(live, jobs["users"]["job"])
        assert (done["found"], done["missing"]) == (HOT, 1)
        assert _in_volatile(live.server, 0, _hot_keys(live.model)).all()


def test_hps_prefetch_in_python(model_files: ModelFiles, tmp_path: Path) -> None:
    from hps.errors import KeyTypeError, UnknownTableError

    config = _with_tiers(model_files, tmp_path / "rocks").config
    with HierarchicalParameterServer(config) as server:
        keys = model_files.keys[0][:50]
        job = server.prefetch(MODEL, "users", keys)
        assert job.wait(30) and job.status == "done" and job.volatile_filled == 50
        assert _in_volatile(server, 0, keys).all()
        assert server.prefetch_job(job.id) is job
        with pytest.raises(UnknownTableError):
            server.prefetch(MODEL, "nope", keys)
        with pytest.raises(KeyTypeError):
            server.prefetch(MODEL, 0, np.array([1.5]))


# -- warm-ups ----------------------------------------------------------------------------

def _first_ready(model: ModelFiles) -> Iterator[tuple[Live, np.ndarray, np.ndarray]]:
    """Start a server of `model` and, at its first 200 from /readyz, read which of the
    hot keys and of some other keys of table 0 its volatile tier holds."""
    server = HierarchicalParameterServer(model.config, load=False)
    thread = ServerThread(create_app(server))
    url = thread.start()
    client = httpx.Client(base_url=url, timeout=30)
    try:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.005)
        hot = _in_volatile(server, 0, _hot_keys(model))
        cold = _in_volatile(server, 0, model.keys[0][HOT:HOT + 100])
        yield Live(url, client, None, server, model), hot, cold
    finally:
        client.close()
        thread.stop()
        server.close()


def test_a_replica_warmed_from_a_peer_holds_its_hot_keys_when_ready(
        peer: Live, model_files: ModelFiles, tmp_path: Path) -> None:
    model = _with_tiers(model_files, tmp_path / "rocks", warm_from=peer.url,
                        warm_timeout=30.0)
    for live, hot, cold in _first_ready(model):
        assert hot.all(), "the peer's hot keys were not in the volatile tier at ready"
        assert not cold.any()  # only the warm-up put rows there
        got = live.lookup_binary("users", _hot_keys(model))
        assert np.array_equal(np.frombuffer(got.content, "<f4").reshape(HOT, -1),
                              model.expected(0, _hot_keys(model)))


def test_a_replica_warms_from_export_files(peer: Live, model_files: ModelFiles,
                                           tmp_path: Path) -> None:
    for table in ("users", "items"):
        export = peer.client.get(f"/v1/models/{MODEL}/tables/{table}/hot-set").content
        (tmp_path / f"{table}.keys").write_bytes(export)
    model = _with_tiers(model_files, tmp_path / "rocks",
                        warm_from=str(tmp_path / "{table}.keys"))
    for _, hot, cold in _first_ready(model):
        assert hot.all() and not cold.any()


@pytest.mark.parametrize("warm_from", ["http://127.0.0.1:9/", "/nowhere/{table}.keys",
                                       "one-file-for-two-tables.keys"])
def test_a_failed_warm_up_is_logged_and_the_replica_serves_cold(
        model_files: ModelFiles, tmp_path: Path, warm_from: str,
        caplog: pytest.LogCaptureFixture) -> None:
    model = _with_tiers(model_files, tmp_path / "rocks", warm_from=warm_from,
                        warm_timeout=5.0)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="hps"):
        for _, hot, _cold in _first_ready(model):
            assert not hot.any()
    assert time.monotonic() - started < 30
    assert "warm-up of model 'm'" in caplog.text


def test_a_bad_export_is_refused_and_logged(model_files: ModelFiles, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "users.keys").write_bytes(b"\0" * 12)  # not whole int64 keys
    (tmp_path / "items.keys").write_bytes(b"")
    model = _with_tiers(model_files, tmp_path / "rocks",
                        warm_from=str(tmp_path / "{table}.keys"))
    with caplog.at_level("WARNING", logger="hps"):
        for _, hot, _cold in _first_ready(model):
            assert not hot.any()
    assert "not a whole number of int64 keys" in caplog.text


# -- the command line --------------------------------------------------------------------

def _hps(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HPS_URL", "HPS_TOKEN")}
    return subprocess.run([sys.executable, "-m", "hps.tools.cli", *args], capture_output=True,
                          text=True, env={**env, "COLUMNS": "200"}, timeout=300)


def test_hps_models_keys_prints_the_hot_and_missing_keys(peer: Live) -> None:
    hot = _hot_keys(peer.model)
    done = _hps("models", "keys", MODEL, "users", "--top", "3", "--url", peer.url)
    assert done.returncode == 0, done.stderr
    assert str(hot[0]) in done.stdout and f"{HOT * 4:,}" in done.stdout
    assert str(hot[3]) not in done.stdout
    missing = _hps("models", "keys", MODEL, "users", "--kind", "missing", "--url", peer.url)
    assert missing.returncode == 0 and str(ABSENT[0]) in missing.stdout
    bad = _hps("models", "keys", MODEL, "nope", "--url", peer.url)
    assert bad.returncode == 2 and "no table" in bad.stderr


def test_hps_models_prefetch_from_a_file_and_the_hot_set(peer: Live, tmp_path: Path) -> None:
    keys = tmp_path / "users.keys"
    keys.write_bytes(_hot_keys(peer.model).astype("<i8").tobytes())
    done = _hps("models", "prefetch", MODEL, "--table", "users", "--keys-file", str(keys),
                "--url", peer.url)
    assert done.returncode == 0, done.stderr
    assert f"{MODEL} / users: job p" in done.stdout and f"{HOT} keys" in done.stdout
    own = _hps("models", "prefetch", MODEL, "--url", peer.url)
    assert own.returncode == 0 and "items" in own.stdout
    keys.write_bytes(b"\0" * 9)
    bad = _hps("models", "prefetch", MODEL, "--table", "users", "--keys-file", str(keys),
               "--url", peer.url)
    assert bad.returncode == 2 and "whole number" in bad.stderr
    lone = _hps("models", "prefetch", MODEL, "--keys-file", str(keys), "--url", peer.url)
    assert lone.returncode == 2 and "needs --table" in lone.stderr


def test_a_model_added_over_http_warms_only_from_files_under_the_roots(
        peer: Live, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request names the model block, so its `warm_from` is read as its files are:
    beneath the allowed roots, never a URL (the server fetches nothing a request names)."""
    served = write_model(tmp_path / "models" / "m", seed=3)
    extra = write_model(tmp_path / "models" / "extra", seed=4)
    inside, outside = tmp_path / "models" / "hot", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    hot = extra.keys[0][:7]
    for folder in (inside, outside):
        (folder / "users.keys").write_bytes(hot.astype("<i8").tobytes())
        (folder / "items.keys").write_bytes(b"")
    model = _with_tiers(served, tmp_path / "rocks")
    block = {**extra.config["models"][0], "model": "extra"}
    with serving(model, allow_roots=[str(tmp_path / "models")]) as live, \
            caplog.at_level("WARNING", logger="hps"):
        for name, warm_from, warmed in (
                ("by_url", peer.url, False),
                ("outside", str(outside / "{table}.keys"), False),
                ("inside", str(inside / "{table}.keys"), True)):
            added = live.client.post("/v1/models", json={**block, "model": name,
                                                         "warm_from": warm_from})
            assert added.status_code == 201, added.text
            volatile = live.server.volatile
            assert volatile is not None
            held = volatile.fetch(live.server.model(name).tables[0].storage_name, hot)[1]
            assert held.all() == warmed and (warmed or not held.any()), name
        assert "warms from files under the allowed roots only" in caplog.text
        assert "not under an allowed root" in caplog.text
