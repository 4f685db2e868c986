"""GET /metrics moves as lookups, errors, loads and tier failures happen."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.http.conftest import MODEL, TABLE_NAMES, Live, ModelFiles, start, wait_until
from tests.support.redis_servers import RedisServer

LOOKUP_ROUTE = "/v1/models/{model}/tables/{table}/lookup"


def test_metrics_move_with_lookups(live: Live) -> None:
    table = TABLE_NAMES[1]
    labels = {"model": MODEL, "table": table}
    names = ["hps_lookups_total", "hps_lookup_keys_total", "hps_default_keys_total"]
    before = {n: live.metric(n, **labels) for n in names}
    hits_before = live.metric("hps_tier_hits_total", tier="volatile", **labels)
    latency_before = live.metric("hps_http_request_duration_seconds_count",
                                 route=LOOKUP_ROUTE, method="POST")
    requests_before = live.metric("hps_http_requests_total", route=LOOKUP_ROUTE,
                                  method="POST", code="200")
    table_latency_before = live.metric("hps_lookup_duration_seconds_count", **labels)
    other_table_before = live.metric("hps_lookup_duration_seconds_count", model=MODEL,
                                     table=TABLE_NAMES[0])
    known = live.model.keys[1][:40]
    unknown = np.setdiff1d(np.arange(-3, 0, dtype=np.int64), live.model.keys[1])
    live.lookup_binary(table, np.concatenate([known, unknown]))
    live.lookup_json(1, known)

    assert live.metric("hps_lookups_total", **labels) == before["hps_lookups_total"] + 2
    assert live.metric("hps_lookup_keys_total", **labels) == (
        before["hps_lookup_keys_total"] + 80 + len(unknown))
    assert live.metric("hps_default_keys_total", **labels) == (
        before["hps_default_keys_total"] + len(unknown))
    assert live.metric("hps_tier_hits_total", tier="volatile", **labels) == hits_before + 80
    assert live.metric("hps_http_request_duration_seconds_count", route=LOOKUP_ROUTE,
                       method="POST") == latency_before + 2
    assert live.metric("hps_http_requests_total", route=LOOKUP_ROUTE, method="POST",
                       code="200") == requests_before + 2
    # per table: both body forms are timed, the other table's histogram does not move
    assert live.metric("hps_lookup_duration_seconds_count", **labels) == \
        table_latency_before + 2
    assert live.metric("hps_lookup_duration_seconds_count", model=MODEL,
                       table=TABLE_NAMES[0]) == other_table_before
    assert live.metric("hps_lookup_duration_seconds_sum", **labels) > 0


def test_metrics_count_errors_by_kind(live: Live) -> None:
    before = live.metric("hps_http_errors_total", kind="bad_body", code="400")
    live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=b"123",
                     headers={"Content-Type": "application/octet-stream"})
    assert live.metric("hps_http_errors_total", kind="bad_body", code="400") == before + 1


def test_fast_routes_count_every_answer_by_status(live: Live) -> None:
    """The lookup routes answer before the middleware stack: they count their requests
    themselves, errors under the error's status, v2 infer under its own route."""
    infer_route = "/v2/models/{model}/infer"

    def requests(route: str, code: str) -> float:
        return live.metric("hps_http_requests_total", route=route, method="POST", code=code)

    bad_before, missing_before = requests(LOOKUP_ROUTE, "400"), requests(LOOKUP_ROUTE, "404")
    infer_before, infer_bad_before = requests(infer_route, "200"), requests(infer_route, "400")
    kinds_before = live.metric("hps_http_errors_total", kind="unknown_table", code="404")
    live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=b"1234567",
                     headers={"Content-Type": "application/octet-stream"})
    live.lookup_binary("no_such_table", np.arange(3, dtype=np.int64))
    keys = live.model.keys[0][:5]
    answer = live.client.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "KEYS", "shape": [5], "datatype": "INT64", "data": keys.tolist()},
        {"name": "NUMKEYS", "shape": [1], "datatype": "INT32", "data": [5]}]})
    assert answer.status_code == 200, answer.text
    bad = live.client.post(f"/v2/models/{MODEL}/infer", json={"inputs": []})
    assert bad.status_code == 400, bad.text

    assert requests(LOOKUP_ROUTE, "400") == bad_before + 1
    assert requests(LOOKUP_ROUTE, "404") == missing_before + 1
    assert live.metric("hps_http_errors_total", kind="unknown_table",
                       code="404") == kinds_before + 1
    assert requests(infer_route, "200") == infer_before + 1
    assert requests(infer_route, "400") == infer_bad_before + 1


def test_load_progress_and_unmatched_routes(live: Live) -> None:
    total = sum(len(k) for k in live.model.keys)
    assert live.metric("hps_load_keys_total", model=MODEL) >= total
    assert live.metric("hps_model_ready", model=MODEL) == 1.0
    live.client.get("/no/such/route/1")
    live.client.get("/no/such/route/2")
    text = live.client.get("/metrics").text
    assert "/no/such" not in text  # raw paths never become labels
    assert 'route="unmatched"' in text


@pytest.fixture
def live_over_redis(model_files: ModelFiles, redis_server: RedisServer,
                    tmp_path: Path) -> Iterator[Live]:
    """The model served from a Redis of the test's own over RocksDB."""
    config = {**model_files.config,
              "volatile_db": {"type": "redis", "address": redis_server.address,
                              "reconnect_backoff": 0.05, "reconnect_backoff_max": 0.2},
              "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")}}
    yield from start(replace(model_files, config=config))


def test_redis_failure_reaches_metrics(live_over_redis: Live, redis_server: RedisServer
                                       ) -> None:
    live = live_over_redis
    table = TABLE_NAMES[0]
    keys = live.model.keys[0][:50]
    per_table = {"model": MODEL, "table": table}
    assert live.lookup_binary(table, keys).status_code == 200
    assert live.metric("hps_tier_available", tier="redis") == 1.0
    assert live.metric("hps_tier_available", tier="rocksdb") == 1.0
    assert live.metric("hps_tier_failures_total", tier="redis", kind="connection") == 0.0
    assert live.metric("hps_tier_failures_total", **per_table) == 0.0

    redis_server.kill()
    answer = live.lookup_binary(table, keys)  # falls through to RocksDB
    assert answer.status_code == 200
    got = np.frombuffer(answer.content, dtype="<f4").reshape(len(keys), -1)
    np.testing.assert_array_equal(got, live.model.expected(0, keys))

    assert live.metric("hps_tier_failures_total", tier="redis", kind="connection") >= 1
    assert live.metric("hps_tier_failures_total", **per_table) == 1.0
    assert live.metric("hps_tier_available", tier="redis") == 0.0
    assert live.metric("hps_tier_available", tier="rocksdb") == 1.0
    assert live.metric("hps_tier_hits_total", tier="persistent", **per_table) == len(keys)

    redis_server.start()
    wait_until(lambda: live.metric("hps_tier_available", tier="redis") == 1.0)
    assert live.metric("hps_tier_stats", tier="redis", stat="episodes") == 1.0
