"""A restart over a store that took online updates after its load: the volatile tier is
filled from the store (the rows the updates wrote), not from the files, and the store is
not written. Updates come through a real redis-server (Redis Streams)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from hps import HierarchicalParameterServer
from hps.updates.contract import UpdatePublisher
from tests.server.test_restart_fill import table_files
from tests.updates.conftest import TOPIC, Model, publish, random_rows, wait_rows


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_restart_after_online_updates_fills_from_the_store(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator, caplog: pytest.LogCaptureFixture, rate: float) -> None:
    config = model.config(redis_updates)
    config["volatile_db"]["initial_cache_rate"] = rate
    updated = model.vectors.copy()
    changed = rng.choice(model.keys.size, 50, replace=False)
    updated[changed] = random_rows(rng, changed.size)
    with HierarchicalParameterServer(config) as server:
        publish(redis_publisher, model.keys[changed], updated[changed])
        wait_rows(server, model.keys, updated)
    before = table_files(model.folder / "rocks", [TOPIC])
    del config["update_source"]  # nothing but the store can bring the updated rows back
    with caplog.at_level(logging.INFO, logger="hps"):
        with HierarchicalParameterServer(config) as server:
            assert server.model("m").table(0).source.reused
            share = model.keys.size if rate == 1.0 else int(np.ceil(model.keys.size * rate))
            assert server.volatile is not None
            rows, found = server.volatile.fetch(TOPIC, model.keys[:share])
            assert found.all() and server.volatile.size(TOPIC) == share
            np.testing.assert_array_equal(rows, updated[:share])
            np.testing.assert_array_equal(server.lookup("m", 0, model.keys), updated)
    [line] = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith(f"{TOPIC}: the hash_map tier took")]
    assert "from the store" in line and "written since the load" in line, line
    assert table_files(model.folder / "rocks", [TOPIC]) == before  # the table not written
