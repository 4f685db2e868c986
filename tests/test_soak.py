"""A bounded soak: `hps serve` (Redis over RocksDB) for 60 s with 8
clients, a reload every 5 s and Redis killed and restarted twice: not one lookup may fail
or be wrong (each answer equals one version of the model, whole). `hps bench soak
--minutes N` runs the same for longer."""

from __future__ import annotations

from hps.tools.bench.soak import print_result, soak


def test_soak_60_seconds() -> None:
    result = soak(60.0, clients=8, reload_every=5.0, redis_restarts=2)
    print_result(result)
    assert result.errors == [], result.errors[:5]
    assert result.failed == 0 and result.wrong == 0
    assert result.reloads_failed == 0 and result.reloads >= 2
    assert result.redis_restarts == 2
    assert result.lookups > 0


def test_soak_of_workers_under_updates() -> None:
    # `hps serve --workers 2` with online updates through a Redis stream beside the
    # reloads and a Redis restart: before the fix of volatile_fill's clear, the leader's
    # refill after the restart made it forget a served table (every lookup there: 404)
    result = soak(30.0, clients=4, reload_every=5.0, redis_restarts=1, workers=2,
                  update_rows=5000, check_every=3.0)
    print_result(result)
    assert result.errors == [], result.errors[:5]
    assert result.failed == 0 and result.wrong == 0
    assert result.reloads_failed == 0 and result.reloads >= 2
    updates = result.updates
    assert updates is not None and updates.errors == [], updates.errors[:5]
    assert updates.stale == 0 and updates.checks >= 2 and updates.rows > 0
    assert result.store_mib > 0 and result.rss_end_mib > 0
