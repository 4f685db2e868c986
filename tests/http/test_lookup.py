"""Lookups over HTTP, binary and JSON, checked against the model files."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.http.conftest import DIMS, MAX_KEYS, MODEL, TABLE_NAMES, Live, ModelFiles, start


@pytest.mark.parametrize("table", [0, 1])
@pytest.mark.parametrize("by", ["name", "index"])
def test_binary_round_trip(live: Live, rng: np.random.Generator, table: int, by: str) -> None:
    keys = live.model.sample_keys(rng, table, 500, unknown=20)
    answer = live.lookup_binary(TABLE_NAMES[table] if by == "name" else table, keys)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/octet-stream"
    assert answer.headers["x-hps-keys"] == str(len(keys))
    assert answer.headers["x-hps-width"] == str(DIMS[table])
    assert answer.headers["x-hps-table"] == TABLE_NAMES[table]
    assert len(answer.content) == len(keys) * DIMS[table] * 4
    got = np.frombuffer(answer.content, dtype="<f4").reshape(len(keys), DIMS[table])
    np.testing.assert_array_equal(got, live.model.expected(table, keys))


@pytest.mark.parametrize("table", [0, 1])
def test_json_round_trip(live: Live, rng: np.random.Generator, table: int) -> None:
    keys = live.model.sample_keys(rng, table, 200, unknown=5)
    answer = live.lookup_json(TABLE_NAMES[table], keys)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["model"], body["table"], body["width"], body["count"]) == (
        MODEL, TABLE_NAMES[table], DIMS[table], len(keys))
    # float32 → JSON → float32 is exact: both encoders write a round-tripping decimal
    got = np.asarray(body["vectors"], dtype=np.float32)
    np.testing.assert_array_equal(got, live.model.expected(table, keys))


def test_extreme_keys_and_duplicates(live: Live) -> None:
    keys = np.array([-(2**63), 2**63 - 1, 0, -1, 0, -(2**63)], dtype=np.int64)
    keys[2] = keys[4] = live.model.keys[0][7]
    for answer in (live.lookup_binary(0, keys), live.lookup_json(0, keys)):
        assert answer.status_code == 200, answer.text
    got = np.frombuffer(live.lookup_binary(0, keys).content, "<f4").reshape(-1, DIMS[0])
    np.testing.assert_array_equal(got, live.model.expected(0, keys))
    got_json = np.asarray(live.lookup_json(0, keys).json()["vectors"], np.float32)
    np.testing.assert_array_equal(got_json, got)


def test_empty_lookups(live: Live) -> None:
    answer = live.lookup_binary(0, np.empty(0, np.int64))
    assert answer.status_code == 200
    assert answer.content == b"" and answer.headers["x-hps-keys"] == "0"
    body = live.lookup_json(1, np.empty(0, np.int64)).json()
    assert body["vectors"] == [] and body["count"] == 0 and body["width"] == DIMS[1]


def test_batch_at_the_limit(live: Live, rng: np.random.Generator) -> None:
    keys = live.model.sample_keys(rng, 1, MAX_KEYS)
    answer = live.lookup_binary(1, keys)
    assert answer.status_code == 200
    got = np.frombuffer(answer.content, "<f4").reshape(-1, DIMS[1])
    np.testing.assert_array_equal(got, live.model.expected(1, keys))


def test_charset_parameter_is_accepted(live: Live) -> None:
    keys = live.model.keys[0][:3]
    answer = live.client.post(
        f"/v1/models/{MODEL}/tables/0/lookup", content=json.dumps({"keys": keys.tolist()}),
        headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert answer.status_code == 200
    np.testing.assert_array_equal(np.asarray(answer.json()["vectors"], np.float32),
                                  live.model.vectors[0][:3])


def test_concurrent_clients_get_their_own_answers(live: Live) -> None:
    """8 clients, each on its own connection, mixed binary and JSON, different tables."""

    def client_run(seed: int) -> int:
        rng = np.random.default_rng(seed)
        checked = 0
        with httpx.Client(base_url=live.url, timeout=30) as client:
            for i in range(15):
                table = (seed + i) % 2
                keys = live.model.sample_keys(rng, table, int(rng.integers(1, 600)), unknown=3)
                url = f"/v1/models/{MODEL}/tables/{table}/lookup"
                if i % 3:
                    answer = client.post(url, content=keys.astype("<i8").tobytes(),
                                         headers={"Content-Type": "application/octet-stream"})
                    got = np.frombuffer(answer.content, "<f4").reshape(-1, DIMS[table])
                else:
                    answer = client.post(url, json={"keys": keys.tolist()})
                    got = np.asarray(answer.json()["vectors"], np.float32)
                assert answer.status_code == 200, answer.text
                np.testing.assert_array_equal(got, live.model.expected(table, keys))
                checked += len(keys)
        return checked

    with ThreadPoolExecutor(8) as pool:
        assert all(n > 0 for n in pool.map(client_run, range(8)))


def test_event_loop_and_thread_pool_answer_alike(model_files: ModelFiles,
                                                 rng: np.random.Generator) -> None:
    """In-memory tiers only: lookups run on the event loop by default; a pool on request."""
    keys = model_files.sample_keys(rng, 1, 300, unknown=5)
    for threads, expected_mode in ((None, 0), (2, 2)):
        for live in start(model_files, lookup_threads=threads):
            assert live.app.state.hps.lookup_threads == expected_mode
            answer = live.lookup_binary(1, keys)
            assert answer.status_code == 200, answer.text
            np.testing.assert_array_equal(
                np.frombuffer(answer.content, "<f4").reshape(len(keys), 64),
                model_files.expected(1, keys))
