"""`hps plan` reads alone (hps/tools/plan/uses.py): a CPU-only config's table has no GPU
rows, the layouts and tiers the config does not use are marked as alternatives with the
setting that would use them, the totals per GPU, of host memory and of disk add up what the
config uses, and without a key log the output says how to get hit rates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hps.rows.storage_types import STORAGE_NAMES
from tests.tools.test_cli import hps, write_config


def _plan(config: Path, *args: str) -> dict[str, Any]:
    result = hps("plan", str(config), "--json", *args)
    assert result.returncode == 0, result.stderr
    table: dict[str, Any] = json.loads(result.stdout)["tables"][0]
    return table


def _by_part(table: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {m["part"]: m["by_storage"] for m in table["memory"]}


def test_a_cpu_only_config_prints_no_gpu_row_and_its_totals(two_tables: dict[str, Any]
                                                            ) -> None:
    config = write_config(two_tables)  # gpucache false, the hash map over RocksDB
    text = hps("plan", str(config), "-m", "m", columns=200)
    assert text.returncode == 0, text.stderr
    assert "no GPU cache: gpucache false" in text.stdout
    rows = [line for line in text.stdout.splitlines() if line.startswith("│")]
    assert not [r for r in rows if "GPU" in r.split("│")[1]], rows
    assert "GPU rows left out: the model has gpucache false" in text.stdout
    assert "total host memory" in text.stdout and "total disk" in text.stdout
    assert "total per GPU" not in text.stdout and "hit rates:" not in text.stdout
    assert "Redis used_memory (est.), if volatile_db.type: redis_cluster" in text.stdout
    assert "all 2 tables, each in its storage type: " in text.stdout
    table = _plan(config)
    parts = _by_part(table)
    totals = {t["tier"]: t["by_storage"] for t in table["totals"]}
    assert set(totals) == {"total host memory", "total disk"}
    assert totals["total host memory"] == parts["hash_map"]
    assert totals["total disk"] == parts["rocksdb"]
    assert table["alternatives"]["redis"] == "volatile_db.type: redis_cluster"


def test_a_gpu_config_marks_the_other_layouts_and_adds_up_its_own(
        two_tables: dict[str, Any], tmp_path: Path) -> None:
    model = two_tables["config"]["models"][0]
    model.update(gpucache=True, embedding_cache_type="uvm")
    two_tables["config"]["persistent_db"] = {"type": "disabled"}
    config = write_config(two_tables)
    text = hps("plan", str(config), columns=200)
    assert text.returncode == 0, text.stderr
    for line in ("GPU dynamic cache, 20%, if embedding_cache_type: dynamic",
                 "GPU static table, if embedding_cache_type: static",
                 "RocksDB files (est.), if persistent_db.type: rocks_db"):
        assert line in text.stdout, text.stdout
    assert "GPU uvm index + hot rows †" in text.stdout  # the config's own: unmarked
    assert "hit rates:" not in text.stdout  # a uvm table holds every key it serves
    table = _plan(config)
    parts = _by_part(table)
    totals = {t["tier"]: t["by_storage"] for t in table["totals"]}
    assert set(totals) == {"total per GPU", "total host memory"}
    for s in STORAGE_NAMES:
        assert totals["total per GPU"][s] == parts["uvm"][s] + parts["query"][s]
        assert totals["total host memory"][s] == (parts["uvm_rows"][s] + parts["query_host"][s]
                                                  + parts["hash_map"][s])
    assert table["alternatives"] == {"dynamic": "embedding_cache_type: dynamic",
                                     "static": "embedding_cache_type: static",
                                     "redis": "volatile_db.type: redis_cluster",
                                     "rocksdb": "persistent_db.type: rocks_db"}


def test_without_a_key_log_it_says_how_to_get_hit_rates(two_tables: dict[str, Any],
                                                        tmp_path: Path) -> None:
    two_tables["config"]["models"][0]["gpucache"] = True
    config = write_config(two_tables)
    text = hps("plan", str(config), "-m", "m", columns=200)
    assert text.returncode == 0, text.stderr
    assert ("hit rates: give --key-log m/sparse_embedding0=FILE, keys this table is looked "
            "up with") in text.stdout
    assert "GET /v1/models/m/tables/sparse_embedding0/hot-set" in text.stdout
    log = tmp_path / "keys.bin"
    two_tables["tables"][0][0][:500].astype("<i8").tofile(log)
    replayed = hps("plan", str(config), "--key-log", f"m/sparse_embedding0={log}",
                   columns=200)
    assert replayed.returncode == 0, replayed.stderr
    assert "hit rates: give --key-log m/sparse_embedding0" not in replayed.stdout
    assert "dynamic GPU cache on" in replayed.stdout
