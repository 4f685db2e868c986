"""Online updates through a served app (uvicorn over a socket, a real redis-server for the
streams): rows become visible over HTTP, /metrics counts them, rejections and lag, and
/readyz stays ready while the update source is down, showing its state apart."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hps.config import UpdateSourceConfig
from hps.updates import codec
from hps.updates.open import open_publisher
from tests.http.conftest import DIMS, Live, start, wait_until, write_model
from tests.support.redis_servers import RedisServer

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


ITEMS = "hps_et.m.items"


@pytest.fixture
def durable_streams(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis that logs every write to its AOF and syncs it before it answers: killed
    and started again in the same folder, it holds its streams, groups and pending
    lists as they were."""
    server = RedisServer(tmp_path / "durable-streams",
                         extra=["--appendonly", "yes", "--appendfsync", "always"]).start()
    yield server
    server.close()


def test_redis_killed_mid_stream_and_restarted_with_its_data(
        tmp_path: Path, durable_streams: RedisServer) -> None:
    """Redis is killed (SIGKILL) while the server drains a backlog and started again on
    the same port with its data: lookups go on meanwhile, /metrics and /readyz show the
    outage, the rest of the backlog and what is published after arrive, and every key
    ends with the last row published for it (a round cut short is applied again, in log
    order, never an older row over a newer one)."""
    model = write_model(tmp_path / "model")
    config = copy.deepcopy(model.config)
    config["update_source"] = {"type": "redis_stream", "address": durable_streams.address,
                               "poll_timeout_ms": 100, "failure_backoff_ms": 20,
                               "failure_backoff_max_ms": 200, "max_commit_interval": 2,
                               "group": "durable"}
    rng = np.random.default_rng(9)
    keys = model.keys[1]
    last: dict[int, np.ndarray] = {}
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream",
                                                  address=durable_streams.address))

    def publish(count: int) -> None:
        payloads = []
        for _ in range(count):
            chosen = rng.choice(keys, 1000)
            rows = rng.standard_normal((chosen.size, DIMS[1])).astype(np.float32)
            payloads.append(codec.encode(chosen, rows))
            last.update(zip(chosen.tolist(), rows, strict=True))
        publisher.publish(ITEMS, payloads)

    publish(120)  # the backlog, before the server (its new group reads from the first)
    with contextmanager(start)(replace(model, config=config)) as live:

        def applied() -> float:
            return live.metric("hps_update_messages_total", table=ITEMS)

        def applied_here() -> int:  # in-process: read far more often than /metrics can be
            status = live.server.update_status()
            return int(status["tables"].get(ITEMS, {}).get("messages", 0)) if status else 0

        deadline = time.monotonic() + 20
        while applied_here() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        durable_streams.kill()
        wait_until(lambda: live.client.get("/readyz").json()["updates"]["state"] == "down",
                   timeout=20)
        assert live.client.get("/readyz").status_code == 200
        assert live.metric("hps_update_source_up", source="redis_stream") == 0
        answer = live.lookup_binary("items", keys)  # serving goes on from the tiers
        assert answer.status_code == 200
        cut = applied()
        durable_streams.start()  # same port, same folder: the AOF brings everything back
        publish(10)
        wait_until(lambda: live.metric("hps_update_lag_messages", table=ITEMS) == 0
                   and applied() >= 130, timeout=60)
        assert live.metric("hps_update_source_up", source="redis_stream") == 1
        assert live.metric("hps_update_retries_total", source="redis_stream") >= 1
        assert live.metric("hps_update_rejected_total", table=ITEMS) == 0
        # at-least-once: what was in flight at the kill may come twice (at most the round
        # being written and the one read ahead of it), nothing is lost
        assert 130 <= applied() <= 130 + 2 * 2, (cut, applied())
        want_keys = np.array(sorted(last), dtype=np.int64)
        got = live.lookup_binary("items", want_keys)
        np.testing.assert_array_equal(
            np.frombuffer(got.content, dtype="<f4").reshape(-1, DIMS[1]),
            np.stack([last[k] for k in want_keys.tolist()]))
    publisher.close()


def test_a_removed_model_takes_its_consumer_group_and_metric_series_with_it(
        tmp_path: Path, streams: RedisServer) -> None:
    """A model added, updated, looked up and removed: this server's consumer group on
    the model's streams stayed (Redis kept a pending list and a position for a reader
    that was gone) and so did its series in /metrics (`hps_update_table_failing`,
    rows, lag, load and lookup figures). Both go with the model now; the streams stay
    (other replicas read them)."""
    import redis

    served = write_model(tmp_path / "model")
    extra = write_model(tmp_path / "extra", seed=12)
    config = copy.deepcopy(served.config)
    config["update_source"] = {"type": "redis_stream", "address": streams.address,
                               "poll_timeout_ms": 100, "group": "replica-a"}
    client = redis.Redis(host=streams.host, port=int(streams.address.rsplit(":", 1)[1]))
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream",
                                                  address=streams.address))
    with contextmanager(start)(replace(served, config=config),
                               allow_roots=[str(tmp_path)]) as live:
        block = {**extra.config["models"][0], "model": "extra"}
        assert live.client.post("/v1/models", json=block).status_code == 201
        topic = "hps_et.extra.users"
        keys, rows = extra.keys[0][:10], np.full((10, DIMS[0]), 7.0, np.float32)
        publisher.publish(topic, [codec.encode(keys, rows)])
        wait_until(lambda: live.metric("hps_update_rows_total", table=topic) == 10,
                   timeout=20)
        assert live.lookup_binary(0, keys, model="extra").status_code == 200

        def groups(stream: str) -> list[bytes]:
            return [g["name"] for g in client.xinfo_groups(stream)]

        assert groups(topic) == [b"replica-a"] and groups(USERS) == [b"replica-a"]
        text = live.client.get("/metrics").text
        assert 'table="hps_et.extra.users"' in text and 'model="extra"' in text

        assert live.client.delete("/v1/models/extra").status_code == 200
        wait_until(lambda: groups(topic) == [] and groups("hps_et.extra.items") == [],
                   timeout=20)
        assert client.exists(topic) and client.xlen(topic) == 1  # the stream stays
        assert groups(USERS) == [b"replica-a"]  # the served model's group stays
        text = live.client.get("/metrics").text
        assert "hps_et.extra." not in text and 'model="extra"' not in text, [
            line for line in text.splitlines() if "extra" in line]
        # the served model's updates and series go on
        publisher.publish(USERS, [codec.encode(served.keys[0][:3],
                                               np.ones((3, DIMS[0]), np.float32))])
        wait_until(lambda: live.metric("hps_update_rows_total", table=USERS) == 3,
                   timeout=20)
    publisher.close()
    client.close()
