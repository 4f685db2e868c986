"""`hps plan`'s choice between a replicated and a row-wise sharded GPU cache over several
GPUs (hps/tools/plan/layout.py): at the same bytes per GPU, by whether the replicated
cache holds the whole table and, with a key log, by the two caches' replayed hit rates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hps.tools.plan.layout import layout_choice
from hps.tools.plan.tables import TableShape
from tests.tools.test_cli import hps

KEYS = 200_000


def _shape(**kw: object) -> TableShape:
    return TableShape("m", "t", KEYS, 16, **{"devices": 2, **kw})  # type: ignore[arg-type]


def test_one_gpu_and_tables_holding_every_key_have_no_choice() -> None:
    assert layout_choice(_shape(devices=1), 1) is None
    assert layout_choice(_shape(cache_type="static"), 1) is None


def test_a_replicated_cache_of_the_whole_table_stays_replicated() -> None:
    choice = layout_choice(_shape(gpucacheper=1.0), 1)
    assert choice is not None and choice.faster == "replicated"
    assert choice.link_share == 0.5 and "whole table" in choice.why


def test_sharding_compares_at_the_same_bytes_per_gpu() -> None:
    replicated = layout_choice(_shape(gpucacheper=0.25), 1)
    assert replicated is not None and replicated.faster == "row_wise sharded"
    assert (replicated.replicated_share, replicated.sharded_share) == (0.25, 0.5)
    assert "--key-log" in replicated.why
    sharded = layout_choice(_shape(gpucacheper=0.5, shards=2), 1)
    assert sharded is not None and (sharded.replicated_share, sharded.sharded_share) == (0.25, 0.5)


def test_a_key_log_decides_by_the_replayed_hit_rates(rng: np.random.Generator) -> None:
    # a few hot keys: a quarter of the table caches them all, sharding saves no miss
    hot = rng.integers(0, 1000, 200_000).astype(np.int64)
    choice = layout_choice(_shape(gpucacheper=0.25), 1, hot)
    assert choice is not None and choice.faster == "replicated"
    assert abs(choice.sharded_hit_rate - choice.replicated_hit_rate) < 0.005  # type: ignore
    # uniform keys: twice the cache hits about twice as often
    uniform = rng.integers(0, KEYS, 400_000).astype(np.int64)
    choice = layout_choice(_shape(gpucacheper=0.25), 1, uniform)
    assert choice is not None and choice.faster == "row_wise sharded"
    assert choice.sharded_hit_rate > choice.replicated_hit_rate + 0.1  # type: ignore[operator]


def test_the_cli_prints_and_reports_the_choice(tmp_path: Path) -> None:
    config = {"models": [{"model": "m", "sparse_files": [str(tmp_path / "t0")],
                          "embedding_vecsize_per_table": [16], "gpucacheper": 0.25,
                          "maxnum_catfeature_query_per_table_per_sample": [100],
                          "deployed_device_list": [0, 1]}]}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    result = hps("plan", str(path), "--table", "sparse_embedding0:1M:16", "--json")
    assert result.returncode == 0, result.stderr
    layout = json.loads(result.stdout)["tables"][0]["layout"]
    assert layout["faster"] == "row_wise sharded" and layout["devices"] == 2
    assert layout["bytes_per_gpu"] > 0
    text = hps("plan", str(path), "--table", "sparse_embedding0:1M:16")
    assert "over 2 GPUs, row_wise sharded is expected faster" in text.stdout
