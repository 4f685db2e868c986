"""Online updates that never stall (a served app, a real redis-server for the streams):
rows of tables of different widths in one round, a message that fails set aside with its
id, a stream key of the wrong type that stops only its own table, and /readyz and
/metrics saying which tables fail or lag."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis

from hps.updates import codec
from tests.http.conftest import DIMS, Live, start, wait_until, write_model
from tests.support.redis_servers import RedisServer

USERS, ITEMS = "hps_et.m.users", "hps_et.m.items"


@pytest.fixture
def streams(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "streams").start()
    yield server
    server.close()


@pytest.fixture
def client(streams: RedisServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(host=streams.host, port=streams.port)
    yield conn
    conn.close()


def serve(tmp_path: Path, streams: RedisServer, poll_ms: int = 100) -> Iterator[Live]:
    model = write_model(tmp_path / "model")
    config = copy.deepcopy(model.config)
    config["update_source"] = {"type": "redis_stream", "address": streams.address,
                               "poll_timeout_ms": poll_ms, "failure_backoff_ms": 20,
                               "failure_backoff_max_ms": 200,
                               "metadata_refresh_interval_ms": 200}
    yield from start(replace(model, config=config))


@pytest.fixture
def live(tmp_path: Path, streams: RedisServer) -> Iterator[Live]:
    yield from serve(tmp_path, streams)


def rows_of(live: Live, table: str, keys: np.ndarray) -> np.ndarray:
    answer = live.lookup_binary(table, keys)
    assert answer.status_code == 200, answer.text
    return np.frombuffer(answer.content, dtype="<f4").reshape(len(keys), -1)


def add(client: redis.Redis, topic: str, payload: bytes) -> str:
    return client.xadd(topic, {b"u": payload}).decode()


def updates(live: Live) -> dict:
    return live.client.get("/readyz").json()["updates"]


def test_rounds_of_tables_of_different_widths(tmp_path: Path, streams: RedisServer,
                                              client: redis.Redis) -> None:
    """A round's buffer used again for a wider table's rows was viewed at its capacity:
    `cannot reshape array of size 800 into shape (100,64)`, and the wider table's
    message was never applied. A long poll keeps the buffers between the rounds."""
    for live in serve(tmp_path, streams, poll_ms=3000):
        rng = np.random.default_rng(7)
        users = live.model.keys[0][:100]
        user_rows = rng.standard_normal((100, DIMS[0])).astype(np.float32)
        add(client, USERS, codec.encode(users, user_rows))
        wait_until(lambda: np.array_equal(rows_of(live, "users", users), user_rows), 20)
        time.sleep(0.3)  # the round's buffer is back in the pool
        items = live.model.keys[1][:10]
        item_rows = rng.standard_normal((10, DIMS[1])).astype(np.float32)
        add(client, ITEMS, codec.encode(items, item_rows))
        more = rng.standard_normal((100, DIMS[0])).astype(np.float32)
        add(client, USERS, codec.encode(users, more))
        wait_until(lambda: np.array_equal(rows_of(live, "items", items), item_rows), 20)
        wait_until(lambda: np.array_equal(rows_of(live, "users", users), more), 20)
        tables = live.server.update_status()["tables"]
        assert tables[ITEMS]["rejected"] == {} and tables[USERS]["rejected"] == {}


def test_a_bad_message_is_set_aside_with_its_id(live: Live, client: redis.Redis) -> None:
    keys = live.model.keys[0][:5]
    rows = np.ones((5, DIMS[0]), np.float32)
    bad = add(client, USERS, codec.encode(keys, np.ones((5, 3), np.float32)))
    add(client, USERS, codec.encode(keys, rows))
    wait_until(lambda: np.array_equal(rows_of(live, "users", keys), rows), 20)
    table = live.server.update_status()["tables"][USERS]
    assert table["rejected"] == {"value_size": 1}
    assert table["last_rejected"] == bad


def test_a_stream_of_the_wrong_type_stops_only_its_table(live: Live,
                                                        client: redis.Redis) -> None:
    """`SET hps_et.m.items "not a stream"` stalled every table's updates (WRONGTYPE each
    round); now the users' updates go on, /readyz and /metrics name the broken table,
    and once the key is a stream again its updates are read."""
    rng = np.random.default_rng(3)
    wait_until(lambda: updates(live)["state"] == "running", 20)
    client.delete(ITEMS)
    client.set(ITEMS, "not a stream")
    users = live.model.keys[0][:20]
    for _ in range(2):  # once found on a read, once on a join
        user_rows = rng.standard_normal((20, DIMS[0])).astype(np.float32)
        add(client, USERS, codec.encode(users, user_rows))
        wait_until(lambda: np.array_equal(rows_of(live, "users", users), user_rows), 20)
        wait_until(lambda: ITEMS in updates(live)["failing"], 20)
    ready = live.client.get("/readyz")
    assert ready.status_code == 200 and "not a stream" in ready.json()["updates"]["failing"][
        ITEMS]
    assert live.metric("hps_update_table_failing", table=ITEMS) == 1
    assert live.metric("hps_update_table_failing", table=USERS) == 0

    client.delete(ITEMS)
    items = live.model.keys[1][:4]
    item_rows = rng.standard_normal((4, DIMS[1])).astype(np.float32)
    wait_until(lambda: ITEMS not in updates(live)["failing"], 20)
    add(client, ITEMS, codec.encode(items, item_rows))
    wait_until(lambda: np.array_equal(rows_of(live, "items", items), item_rows), 20)
    assert live.metric("hps_update_table_failing", table=ITEMS) == 0


def test_readyz_names_tables_whose_updates_lag(live: Live) -> None:
    """`lagging` lists the tables with messages waiting (none here, once all applied)."""
    wait_until(lambda: updates(live)["state"] == "running", 20)
    assert updates(live)["lagging"] == {} and updates(live)["failing"] == {}


@pytest.mark.parametrize("refresh_ms", [1000, 100])
def test_a_stream_deleted_under_a_blocked_read_delays_no_other_table(
        tmp_path: Path, streams: RedisServer, client: redis.Redis, refresh_ms: int,
        caplog: pytest.LogCaptureFixture) -> None:
    """A stream key deleted while the source waits on it (Redis answers the blocked read
    `UNBLOCKED the stream key no longer exists`), then set to a string: that error failed
    the round, and the pause after a failed round (failure_backoff_max_ms, 5 s by
    default) held every table's updates. Now the source joins again and reads the other
    streams at once: the users' next update lands within 0.1 s of its usual time."""
    model = write_model(tmp_path / "model")
    config = copy.deepcopy(model.config)
    config["update_source"] = {"type": "redis_stream", "address": streams.address,
                               "metadata_refresh_interval_ms": refresh_ms}  # defaults else
    caplog.set_level(logging.ERROR, logger="hps.updates")
    for live in start(replace(model, config=config)):
        rng = np.random.default_rng(5)
        users = live.model.keys[0][:20]

        def update_seconds() -> float:
            rows = rng.standard_normal((20, DIMS[0])).astype(np.float32)
            started = time.perf_counter()
            add(client, USERS, codec.encode(users, rows))
            wait_until(lambda: np.array_equal(rows_of(live, "users", users), rows), 20)
            return time.perf_counter() - started

        wait_until(lambda: updates(live)["state"] == "running", 20)
        usual = max(update_seconds() for _ in range(3))
        time.sleep(0.3)  # the source waits in XREADGROUP on both streams
        client.delete(ITEMS)
        time.sleep(0.3)
        client.set(ITEMS, "not a stream")
        after = update_seconds()
        wait_until(lambda: ITEMS in updates(live)["failing"], 20)
        assert after < usual + 0.1, (after, usual)
        assert not [r for r in caplog.records if "update round failed" in r.getMessage()]
