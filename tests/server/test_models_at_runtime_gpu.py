"""A model added and removed at runtime through the admin routes of a real uvicorn server
(hps/tools/bench/model_memory.py): its GPU cache serves exact rows, and removing it returns its
device memory."""

from __future__ import annotations

import pytest

from hps.gpu.dynamic_cache import EmbeddingCache
from hps.gpu.static_table import StaticEmbeddingTable
from hps.tools.bench.model_memory import BASE, measure

pytestmark = pytest.mark.gpu

MIB = 2**20


@pytest.mark.parametrize("cache_type", ["static", "dynamic"])
def test_removed_model_returns_its_device_memory(cache_type: str) -> None:
    keys, dim = 300_000, 64
    found = measure(keys, dim, cache_type, settle_seconds=30.0)
    taken = found["served"]["gpu"] - found["before"]["gpu"]
    table = (StaticEmbeddingTable.memory_required(keys, dim) if cache_type == "static"
             else EmbeddingCache.memory_required(keys, dim))
    assert taken >= table, f"{taken / MIB:.0f} MiB in use for a {table / MIB:.0f} MiB table"
    assert found["exact"], "the added model's rows did not read back exact"
    left = found["after"]["gpu"] - found["before"]["gpu"]
    assert left <= max(16 * MIB, taken // 20), \
        f"{left / MIB:.0f} of {taken / MIB:.0f} MiB still in use after the removal"
    assert found["status_after"] == 404
    assert found["models_after"] == [BASE]
