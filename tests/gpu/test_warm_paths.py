"""A GPU table's lookup paths run before its version serves (hps/server/warm_paths.py):
after the load, the lookups a server makes (host keys of every route dtype, batches past
the miss path's bounds, device keys) compile nothing, answer the files' rows, and the
warm-up left no trace in the table's counters, its thread states or its hot keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gpu.workspace import SPARE_STATES
from hps.runtime.compile_on_use import CompileEvent, compile_events
from hps.server import HierarchicalParameterServer
from hps.server.warm_paths import KEY_DTYPES, warm_keys
from tests.conftest import make_table, model_config, write_table

pytestmark = pytest.mark.gpu

DIMS = [16, 64]


@pytest.mark.parametrize("cache_type", ["dynamic", "static"])
def test_after_the_load_no_gpu_lookup_compiles_and_the_warm_up_left_no_counts(
        tmp_path: Path, rng: np.random.Generator, cp: Any, cache_type: str) -> None:
    tables = [make_table(rng, 5000, dim) for dim in DIMS]
    files = [str(write_table(tmp_path / f"t{i}", k, v)) for i, (k, v) in enumerate(tables)]
    config = {"supportlonglong": True,
              "models": [model_config(files, DIMS, gpucache=True, gpucacheper=0.5,
                                      embedding_cache_type=cache_type,
                                      maxnum_catfeature_query_per_table_per_sample=[80, 80])],
              "volatile_db": {"type": "hash_map"}}
    compiles: list[CompileEvent] = []
    with HierarchicalParameterServer(config) as server:
        loaded = server.model("m")
        warm = set(warm_keys(1 << 17, KEY_DTYPES[0]).tolist()) | set(
            warm_keys(1 << 17, KEY_DTYPES[1]).astype(np.int64).tolist())
        for table in loaded.tables:
            for gpu in table.gpu.values():
                stats = gpu.stats()
                assert stats["lookups"] == 0 and stats["keys"] == 0, stats
                assert len(gpu._spares._spares) == SPARE_STATES  # handed back
                assert not warm & set(gpu.held_keys(1 << 20).tolist())  # let go
        with compile_events(lambda e: compiles.append(e) if e.seconds is not None else None):
            for index, (keys, rows) in enumerate(tables):
                expected = dict(zip(keys.tolist(), range(keys.size), strict=True))
                for size in (1, 300, 3000, 70000):
                    batch = rng.choice(keys, size=min(size, loaded.tables[index].max_keys))
                    got = server.lookup("m", index, batch)
                    np.testing.assert_array_equal(
                        got, rows[[expected[k] for k in batch.tolist()]])
                for dtype in KEY_DTYPES:  # keys no table holds: the defaults, every dtype
                    absent = server.lookup("m", index, warm_keys(40, dtype, offset=1 << 18))
                    np.testing.assert_array_equal(absent, np.full_like(absent, 0.5))
                device_keys = cp.asarray(keys[:100])
                out = cp.empty((100, DIMS[index]), cp.float32)
                server.lookup_into("m", index, device_keys, out)
                np.testing.assert_array_equal(cp.asnumpy(out), rows[:100])
                server.lookup_into("m", index, device_keys.astype(cp.int32), out)
        cp.cuda.get_current_stream().synchronize()
        assert compiles == [], [e.function for e in compiles]
        for index in range(len(tables)):
            hot = server.top_keys("m", index, "hot", 1000)
            assert not warm & set(np.asarray(hot["keys"]).tolist())
