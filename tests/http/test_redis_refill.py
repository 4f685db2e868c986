"""A Redis that comes back empty (restarted without persistence, FLUSHALL) is noticed
through the tables' markers and refilled in the background: the log says so, /readyz
lists the tables until they are in, Redis hits come back, and every lookup meanwhile is
exact; the files of a model a request named are read beneath the allowed root again.
Real redis-server and uvicorn processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis as redis_py

from tests.http.conftest import (
    DIMS,
    MODEL,
    TABLE_NAMES,
    Live,
    serving,
    wait_until,
    write_model,
)
from tests.http.test_confined_sources import link_out
from tests.http.test_redis_outage import NAMES, checking_clients, exact, with_redis
from tests.support.redis_servers import RedisServer


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.close()


def _volatile_hits(live: Live) -> float:
    return sum(live.metric("hps_tier_hits_total", model=MODEL, table=t, tier="volatile")
               for t in ("items", "users"))


def _in_redis(live: Live) -> int:
    volatile = live.server.tiers.volatile
    assert volatile is not None
    return sum(volatile.size(name) for name in NAMES)


def _empty_under_lookups(live: Live, empty: Callable[[], None],
                         caplog: pytest.LogCaptureFixture) -> None:
    """Empty Redis while four clients check every answer; wait for the refill."""
    full = _in_redis(live)
    assert full > 0
    with checking_clients(live) as wrong, caplog.at_level(logging.WARNING, logger="hps"):
        empty()
        wait_until(lambda: "redis tier available again, refilling 2 tables"
                   in caplog.text, timeout=30)
        wait_until(lambda: live.client.get("/readyz").json()["degraded"] == {}
                   and _in_redis(live) == full, timeout=30)
        hits = _volatile_hits(live)
        wait_until(lambda: _volatile_hits(live) > hits, timeout=30)
    assert wrong == []
    assert live.server.tiers.volatile.stats()["lost_tables"] == []  # type: ignore[union-attr]


def test_redis_restarted_empty_is_refilled(tmp_path: Path, redis: RedisServer,
                                           caplog: pytest.LogCaptureFixture) -> None:
    model = with_redis(write_model(tmp_path / "model"), redis, tmp_path / "db")
    with serving(model) as live:
        exact(live, np.random.default_rng(1))

        def restart() -> None:
            redis.kill()
            redis.start()  # empty: it keeps nothing

        _empty_under_lookups(live, restart, caplog)


def test_redis_flushed_is_refilled(tmp_path: Path, redis: RedisServer,
                                   caplog: pytest.LogCaptureFixture) -> None:
    model = with_redis(write_model(tmp_path / "model"), redis, tmp_path / "db")
    with serving(model) as live:
        exact(live, np.random.default_rng(1))

        def flush() -> None:
            with redis_py.Redis(redis.host, redis.port) as client:
                client.flushall()

        _empty_under_lookups(live, flush, caplog)
        # a reload writes new markers under its own names: nothing is reported lost
        assert live.client.post(f"/v1/models/{MODEL}/reload").status_code == 200
        assert live.server.tiers.volatile.stats()["lost_tables"] == []  # type: ignore[union-attr]


def test_a_refill_reads_an_added_model_beneath_the_root(tmp_path: Path, redis: RedisServer,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """The refill of a model a request named reads its files beneath the allowed root
    again: files swapped for links out after the add are refused (nothing of them reaches
    Redis or an answer, the log names the path only) and the tables serve from RocksDB."""
    model = with_redis(write_model(tmp_path / "models" / "m"), redis, tmp_path / "db")
    inside = write_model(tmp_path / "models" / "added", seed=5, sizes=(300, 200))
    outside = write_model(tmp_path / "elsewhere", seed=9, sizes=(300, 200))
    block = {**model.config["models"][0], "model": "added",
             "sparse_files": [str(inside.dir / t) for t in TABLE_NAMES]}
    with serving(model, allow_roots=[str(tmp_path / "models")]) as live:
        assert live.client.post("/v1/models", json=block).status_code == 201
        link_out(inside.dir, outside, ("key", "emb_vector"))
        with caplog.at_level(logging.INFO, logger="hps"):
            with redis_py.Redis(redis.host, redis.port) as client:
                client.flushall()
            wait_until(lambda: "redis tier available again, refilling 4 tables"
                       in caplog.text, timeout=30)
            wait_until(lambda: live.client.get("/readyz").json()["degraded"] == {}
                       and _in_redis(live) > 0, timeout=30)
        volatile = live.server.tiers.volatile
        assert volatile is not None
        assert [volatile.size(f"hps_et.added.{t}") for t in TABLE_NAMES] == [0, 0]
        assert "leads out of its model folder" in caplog.text
        assert not any(size in caplog.text for size in
                       (str(os.path.getsize(outside.dir / t / "emb_vector"))
                        for t in TABLE_NAMES))
        for table in (0, 1):
            keys = np.concatenate([outside.keys[table][:40], inside.keys[table][:40]])
            for _ in range(2):  # the second lookup would hit what a refill wrote
                got = live.lookup_binary(table, keys, model="added")
                assert got.status_code == 200, got.text
                assert np.array_equal(np.frombuffer(got.content, "<f4")
                                      .reshape(-1, DIMS[table]),
                                      inside.expected(table, keys))
