"""A Redis that comes back empty (restarted without persistence, FLUSHALL) is noticed
through the tables' markers and refilled in the background: the log says so, /readyz
lists the tables until they are in, Redis hits come back, and every lookup meanwhile is
exact. Real redis-server and uvicorn processes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis as redis_py

from tests.http.conftest import MODEL, Live, serving, wait_until, write_model
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
