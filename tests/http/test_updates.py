"""Online updates through a served app (uvicorn over a socket, a real redis-server for the
streams): rows become visible over HTTP, /metrics counts them, rejections and lag, and
/readyz stays ready while the update source is down, showing its state apart."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hps.config import UpdateSourceConfig
from hps.updates import codec
from hps.updates.source import open_publisher
from tests.http.conftest import DIMS, Live, start, wait_until, write_model
from tests.redis_servers import RedisServer

USERS = "hps_et.m.users"


@pytest.fixture
def streams(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "streams").start()
    yield server
    server.close()


@pytest.fixture
def live(tmp_path: Path, streams: RedisServer) -> Iterator[Live]:
    model = write_model(tmp_path / "model")
    config = copy.deepcopy(model.config)
    config["update_source"] = {"type": "redis_stream", "address": streams.address,
                               "poll_timeout_ms": 100, "failure_backoff_ms": 20,
                               "failure_backoff_max_ms": 200}
    yield from start(replace(model, config=config))


def _lookup(live: Live, keys: np.ndarray) -> np.ndarray:
    answer = live.lookup_binary("users", keys)
    assert answer.status_code == 200
    return np.frombuffer(answer.content, dtype="<f4").reshape(-1, DIMS[0])


def test_updates_over_http_metrics_and_readiness(live: Live, streams: RedisServer) -> None:
    rng = np.random.default_rng(5)
    keys = live.model.keys[0][:100]
    rows = rng.standard_normal((100, DIMS[0])).astype(np.float32)
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream",
                                                  address=streams.address))
    publisher.publish(USERS, [codec.encode(keys, rows), b"HCTR\x00"])
    wait_until(lambda: np.array_equal(_lookup(live, keys), rows), timeout=20)
    wait_until(lambda: live.metric("hps_update_lag_messages", table=USERS) == 0
               and live.metric("hps_update_rejected_total", table=USERS,
                               reason="truncated") == 1, timeout=20)
    assert live.metric("hps_update_rows_total", table=USERS) == 100
    assert live.metric("hps_update_messages_total", table=USERS) == 1
    assert live.metric("hps_update_source_up", source="redis_stream") == 1
    assert live.metric("hps_update_last_applied_timestamp_seconds", table=USERS) > 0
    ready = live.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["updates"]["state"] == "running"

    streams.kill()
    wait_until(lambda: live.client.get("/readyz").json()["updates"]["state"] == "down",
               timeout=20)
    ready = live.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    np.testing.assert_array_equal(_lookup(live, keys), rows)  # serving goes on
    assert live.metric("hps_update_source_up", source="redis_stream") == 0
    streams.start()
    wait_until(lambda: live.client.get("/readyz").json()["updates"]["state"] == "running",
               timeout=20)
    assert live.metric("hps_update_retries_total", source="redis_stream") >= 1
    publisher.close()
