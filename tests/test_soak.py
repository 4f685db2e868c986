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
