"""The background filler of hot copies (hps/server/hot_fill.py): when it fills a table's
copies again (`refill_due`), its config key, what a server without GPUs does with it (no
copies: no thread, a clear refusal on demand), and the hot-rows board that carries a fill
asked of one worker to the others (hps/http/workers_hot_rows.py), over real files. The
fills themselves need GPUs: tests/gpu/test_hot_rows.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import ModelConfig
from hps.errors import ConfigError, NoHotCopiesError, UnknownModelError, UnknownTableError
from hps.http.workers_hot_rows import HotRowsBoard
from hps.server import HierarchicalParameterServer
from hps.server.hot_fill import REFILL_MOVED, refill_due

COUNTS = np.array([50, 30, 10, 6, 4], np.int64)  # the sketch's top keys' counts


def _due(**change: Any) -> bool:
    case: dict[str, Any] = {"now": 100.0, "filled_at": 98.0, "interval": 1.0,
                            "total": 500, "filled_total": 400, "counts": COUNTS,
                            "offered": np.array([True, True, False, True, True])}
    case.update(change)
    return refill_due(**case)


def test_a_refill_waits_for_the_interval_new_traffic_and_moved_keys() -> None:
    # the heaviest keys moved (10 of 100 counted not offered: over REFILL_MOVED), traffic
    # since, the interval passed: due
    assert 10 / 100 >= REFILL_MOVED and _due()
    assert not _due(now=98.5)  # within the interval of the last fill
    assert _due(now=98.5, interval=0.25)
    assert not _due(interval=0.0)  # 0: never in the background
    assert not _due(total=400)  # nothing counted since the last fill
    assert not _due(offered=np.array([True, True, True, True, False]))  # 4 of 100: noise
    assert _due(offered=np.zeros(5, bool), filled_at=None)  # never filled: at once
    assert _due(offered=np.zeros(5, bool), now=98.1, filled_at=None)
    assert not _due(counts=np.empty(0, np.int64), offered=np.empty(0, bool))  # no keys yet


def test_the_interval_is_a_model_key_on_by_default() -> None:
    base = {"model": "m", "sparse_files": ["/m/t0"], "embedding_vecsize_per_table": [8],
            "maxnum_catfeature_query_per_table_per_sample": [4], "deployed_device_list": [0]}
    assert ModelConfig(**base).gpu_hot_rows_refresh_seconds == 1.0
    assert ModelConfig(**base, gpu_hot_rows_refresh_seconds=0).gpu_hot_rows_refresh_seconds == 0
    with pytest.raises(ValueError, match="gpu_hot_rows_refresh_seconds"):
        ModelConfig(**base, gpu_hot_rows_refresh_seconds=-1)


def test_a_server_without_gpus_starts_no_filler_and_refuses_a_fill(
        two_tables: dict[str, Any]) -> None:
    config = two_tables["config"]
    config["models"][0].update(gpucache=True, gpu_sharding="row_wise", hot_key_sampling=1)
    with HierarchicalParameterServer(config) as server:
        keys = two_tables["tables"][0][0]
        for _ in range(20):
            server.lookup("m", 0, keys[:50])
        server.hot_fill.tick()  # a look finds no table with copies: nothing to do
        assert server.hot_fill._thread is None  # none was started for no copies
        with pytest.raises(NoHotCopiesError, match="no table of model 'm' keeps hot copies"):
            server.fill_hot_rows("m")
        with pytest.raises(ConfigError, match="table 'sparse_embedding1' of model 'm' keeps "
                                              "no hot copies"):
            server.fill_hot_rows("m", 1)
        with pytest.raises(UnknownModelError):
            server.fill_hot_rows("nope")
        with pytest.raises(UnknownTableError):
            server.fill_hot_rows("m", 9)


def test_the_board_carries_a_fill_to_the_other_workers(tmp_path: Path) -> None:
    first = HotRowsBoard(tmp_path, 0)
    first.ask("m", None)  # before the second worker started: not its to take
    second = HotRowsBoard(tmp_path, 1)
    assert second.new_requests() == []
    first.ask("m", "t0")
    second.ask("other", 3)
    assert second.new_requests() == [("m", "t0")]  # its own request is not read back
    assert first.new_requests() == [("other", "3")]
    assert first.new_requests() == second.new_requests() == []  # each read once
    # a line being appended (no newline yet) is read once whole
    with open(first.path, "a") as f:
        f.write('{"model": "m", "table": null, "from": 0}')
    assert second.new_requests() == []
    with open(first.path, "a") as f:
        f.write("\n")
    assert second.new_requests() == [("m", None)]
