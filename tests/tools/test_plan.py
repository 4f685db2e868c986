"""`hps plan` (hps/tools/plan/, hps/tools/cli/plan.py): its bytes are the tiers' own sizing
functions', its Redis and RocksDB estimates hold against a real redis-server and real
table files, its hit rates are the NumPy cache model's, replayed directly, and bad input
gets a one-line error and exit status 2. The check against a real GPU cache is
test_plan_gpu.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from hps.config import PersistentDBConfig, VolatileDBConfig
from hps.errors import KeyTypeError, SourceNotFoundError
from hps.gpu.cache_model import ReferenceCache
from hps.gpu.dynamic_cache import DEFAULT_LRU_SAMPLE_SHIFT, SET_SIZE
from hps.gpu.open import cache_memory_bytes, cache_slots
from hps.gpu.static_table import StaticEmbeddingTable
from hps.gpu.uvm_table import UvmEmbeddingTable
from hps.rows.storage_types import STORAGE_NAMES
from hps.tiers.hash_map import HashMapTier
from hps.tiers.redis import RedisTier
from hps.tiers.rocksdb import RocksDBTier
from hps.tools.plan.estimates import jemalloc_size, redis_bytes, rocksdb_bytes
from hps.tools.plan.hit_rates import hit_rate
from hps.tools.plan.key_log import read_key_log
from hps.tools.plan.memory import table_memory
from hps.tools.plan.tables import TableShape
from tests.support.redis_servers import RedisServer, eventually
from tests.tools.test_cli import ROOT, hps, write_config


def _by_tier(memory: list[Any]) -> dict[str, dict[str, int]]:
    return {t.tier: t.by_storage for t in memory}


def test_bytes_are_the_tiers_own_sizing() -> None:
    shape = TableShape("m", "t", 123_457, 24, gpucacheper=0.3, lookup_keys=3000,
                       num_partitions=8)
    got = _by_tier(table_memory(shape))
    for s in STORAGE_NAMES:
        assert got["GPU dynamic cache, 30%"][s] == cache_memory_bytes(123_457, 24, 0.3, s)
        assert got["GPU static table"][s] == StaticEmbeddingTable.memory_required(
            123_457, 24, storage=s)
        assert got["GPU uvm index + hot rows"][s] == UvmEmbeddingTable.device_bytes_required(
            123_457, 24, math.ceil(0.3 * 123_457), storage=s)
        assert got["host uvm rows (pinned)"][s] == UvmEmbeddingTable.host_bytes_required(
            123_457, 24, storage=s)
        assert got["host in-process hash map"][s] == HashMapTier.memory_required(
            123_457, 24, s, num_partitions=8)
        assert got["Redis used_memory (est.)"][s] == redis_bytes(123_457, 24, 8)
        assert got["RocksDB files (est.)"][s] == rocksdb_bytes(123_457, 24)
    # the compact types take less where the tier stores them
    assert got["GPU static table"]["int8"] < got["GPU static table"]["float16"] < \
        got["GPU static table"]["float32"]
    # a budget sets the uvm table's GPU rows: the index and as many rows as fit
    budget = TableShape("m", "t", 100_000, 32, cache_type="uvm", gpu_memory_budget_mb=8)
    uvm = _by_tier(table_memory(budget))["GPU uvm index + hot rows"]
    assert all(uvm[s] <= 8 * 2**20 for s in STORAGE_NAMES)
    assert all(8 * 2**20 - uvm[s] < UvmEmbeddingTable.gpu_row_bytes(32, s)
               for s in STORAGE_NAMES)


def test_a_sharded_table_takes_its_shards_on_each_device() -> None:
    """gpu_sharding row_wise: 3 shards over 2 devices, so the fuller device holds 2 shards,
    each sized as hps/gpu/sharded.py sizes them; unsharded, each device holds it whole."""
    from hps.gpu.shard_routing import shard_keys

    whole = _by_tier(table_memory(TableShape("m", "t", 1_000_000, 32, devices=2)))
    sharded = _by_tier(table_memory(TableShape("m", "t", 1_000_000, 32, devices=2, shards=3)))
    share = shard_keys(1_000_000, 3)
    for s in STORAGE_NAMES:
        assert sharded["GPU dynamic cache, 20%"][s] == 2 * cache_memory_bytes(share, 32, 0.2, s)
        assert sharded["GPU static table"][s] == 2 * StaticEmbeddingTable.memory_required(
            share, 32, storage=s)
        assert sharded["GPU static table"][s] < whole["GPU static table"][s]


def test_a_sharded_static_table_counts_its_hot_copies() -> None:
    """Over several devices, each device's static shards come with its hot copy of its
    peers' rows and their copies' index mirrors (hps/gpu/hot_rows.py), as does a dynamic
    cache holding the whole table (a static table too); none on one device, for int8
    storage or with gpu_hot_rows 0."""
    from hps.gpu.hot_rows import HOT_LOAD_FACTOR, hot_copy_bytes
    from hps.gpu.static_table import num_slots

    def memory(**shape: Any) -> dict[str, dict[str, int]]:
        return _by_tier(table_memory(TableShape("m", "t", 1_000_000, 32, shards=2, **shape)))

    bare = memory(devices=2, hot_rows=0)
    hot = memory(devices=2, hot_rows=4096, gpucacheper=1.0)
    one_device = memory(devices=1, hot_rows=4096)
    for s in STORAGE_NAMES:
        copy = hot_copy_bytes(4096, 32, s, 2) if s != "int8" else 0
        assert copy == (0 if s == "int8" else StaticEmbeddingTable.memory_required(
            4096, 32, HOT_LOAD_FACTOR, s) + num_slots(4096, HOT_LOAD_FACTOR) * 8)
        assert hot["GPU static table"][s] == bare["GPU static table"][s] + copy
        assert hot["GPU dynamic cache, 100%"][s] == memory(
            devices=2, hot_rows=0, gpucacheper=1.0)["GPU dynamic cache, 100%"][s] + copy
        assert one_device["GPU static table"][s] == memory(
            devices=1, hot_rows=0)["GPU static table"][s]
    assert memory(devices=2, hot_rows=4096)["GPU dynamic cache, 20%"] == bare[
        "GPU dynamic cache, 20%"]  # a cache's shards take no copy


def test_jemalloc_size_classes() -> None:
    assert [jemalloc_size(n) for n in (1, 8, 9, 24, 36, 128, 132, 262, 518, 1025)] == \
        [8, 8, 16, 32, 48, 128, 160, 320, 640, 1280]


def _all_fields(client: redis.Redis, hashes: list[bytes], policy: str, num_keys: int) -> int:
    fields = sum(int(client.hlen(h)) for h in hashes)
    assert policy == "evict_random" or fields == num_keys
    return fields


@pytest.mark.parametrize(("num_keys", "dim", "policy"), [
    (20_000, 32, "evict_random"), (30_000, 64, "evict_least_used"),
    (20_000, 8, "evict_oldest"), (50_000, 4, "evict_random")])
def test_redis_estimate_holds_against_a_real_server(redis_server: RedisServer,
                                                    rng: np.random.Generator, num_keys: int,
                                                    dim: int, policy: str) -> None:
    config = VolatileDBConfig.model_validate({
        "type": "redis_cluster", "address": f"127.0.0.1:{redis_server.port}",
        "num_partitions": 16, "overflow_policy": policy})
    client = redis.Redis(port=redis_server.port)
    before = int(client.info("memory")["used_memory"])
    tier = RedisTier(config)
    try:
        tier.create_table("hps_et.m.t", dim)
        keys = rng.choice(2**40, num_keys, replace=False).astype(np.int64)
        tier.insert("hps_et.m.t", keys, rng.standard_normal((num_keys, dim), np.float32))
        # the eviction metadata may go through a background queue: wait until it is in
        meta = [k for k in client.keys() if k.endswith(b"}t")]
        fields = eventually(lambda: _all_fields(client, meta, policy, num_keys), 10,
                            "the eviction metadata")
        assert fields == (0 if policy == "evict_random" else num_keys)
        used = int(client.info("memory")["used_memory"]) - before
    finally:
        tier.close()
        client.close()
    estimate = redis_bytes(num_keys, dim, 16, policy)
    assert abs(estimate - used) <= 0.1 * used, (estimate, used)


@pytest.mark.parametrize(("num_keys", "dim"), [(20_000, 8), (100_000, 64), (30_000, 128)])
def test_rocksdb_estimate_holds_against_the_files(tmp_path: Path, rng: np.random.Generator,
                                                  num_keys: int, dim: int) -> None:
    tier = RocksDBTier(PersistentDBConfig.model_validate(
        {"type": "rocks_db", "path": str(tmp_path / "rocks")}))
    try:
        tier.create_table("hps_et.m.t", dim)
        keys = rng.choice(2**40, num_keys, replace=False).astype(np.int64)
        tier.reserve("hps_et.m.t", num_keys)
        tier.load("hps_et.m.t", [(keys, rng.standard_normal((num_keys, dim), np.float32))])
    finally:
        tier.close()
    on_disk = sum(f.stat().st_size for f in (tmp_path / "rocks").rglob("*") if f.is_file())
    assert abs(rocksdb_bytes(num_keys, dim) - on_disk) <= 0.05 * on_disk


def _replayed_directly(log: np.ndarray, num_keys: int, share: float, batch: int
                       ) -> tuple[int, int]:
    """(hits, hits in the second half) of the log through the model, sized as
    hps/gpu/open.py sizes the cache; misses inserted after each lookup."""
    cache = ReferenceCache(cache_slots(math.ceil(share * num_keys)), 1,
                           DEFAULT_LRU_SAMPLE_SHIFT)
    starts = list(range(0, log.size, batch))
    hits = warm = 0
    for i, start in enumerate(starts):
        lookup = log[start:start + batch]
        _, missed = cache.query(lookup)
        hits += int((~missed).sum())
        warm += int((~missed).sum()) if i >= len(starts) // 2 else 0
        keys, first = np.unique(lookup[missed], return_index=True)
        keys = keys[np.argsort(first)]
        cache.insert(keys, np.zeros((keys.size, 1), np.float32))
    return hits, warm


@pytest.mark.parametrize("share", [0.01, 0.1, 0.4])
def test_hit_rate_is_the_model_replayed_directly(rng: np.random.Generator, share: float
                                                 ) -> None:
    num_keys, batch = 50_000, 1000
    log = (rng.zipf(1.1, 200_500) % num_keys).astype(np.int64)
    got = hit_rate(log, num_keys, share, batch)
    hits, warm = _replayed_directly(log, num_keys, share, batch)
    assert got.hit_rate == hits / log.size
    warm_keys = log.size - (got.lookups // 2) * batch
    assert got.warm_hit_rate == warm / warm_keys
    assert got.capacity == math.ceil(share * num_keys)
    assert got.slots == cache_slots(got.capacity)


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_uniform_log_hits_what_the_cache_can_hold(rng: np.random.Generator, share: float
                                                  ) -> None:
    # Under uniform traffic the warm hit rate is the share of the table the cache holds.
    # Its sets have slots for capacity / CACHE_LOAD keys, and a set holds the table keys
    # that hash to it up to its ways: num_sets × E[min(Poisson(keys per set), ways)].
    num_keys = 20_000
    log = rng.integers(0, num_keys, 400_000)
    got = hit_rate(log, num_keys, share, 1024)
    num_sets = -(-got.slots // SET_SIZE)
    lam = num_keys / num_sets
    pmf = [math.exp(-lam) * lam**k / math.factorial(k) for k in range(SET_SIZE)]
    held = num_sets * sum(min(k, SET_SIZE) * p for k, p in enumerate(pmf)) + \
        num_sets * SET_SIZE * (1 - sum(pmf))
    assert abs(got.warm_hit_rate - held / num_keys) <= 0.02
    assert got.warm_hit_rate > share  # more than `share`: the sizing's extra slots


def test_whole_table_cache_hits_every_key_after_its_first_lookup(
        rng: np.random.Generator) -> None:
    num_keys, batch = 5000, 500
    log = rng.integers(0, num_keys, 50_000)
    got = hit_rate(log, num_keys, 1.0, batch)
    lookup_of = np.arange(log.size) // batch
    _, first = np.unique(log, return_index=True)
    first_lookup = dict(zip(log[first].tolist(), lookup_of[first].tolist(), strict=True))
    seen_before = lookup_of > np.vectorize(first_lookup.get)(log)
    assert got.hit_rate == seen_before.mean()
    # a table with room for half the keys takes lookups' misses until it is full
    half = hit_rate(log, num_keys * 2, 0.25, batch)
    assert 0 < half.hit_rate < got.hit_rate


def test_key_log_formats(tmp_path: Path, rng: np.random.Generator) -> None:
    keys = rng.integers(-2**62, 2**62, 1000, dtype=np.int64)
    keys[0] = ord("{")  # a raw log may open with `{`
    keys.astype("<i8").tofile(tmp_path / "raw.bin")
    np.save(tmp_path / "keys.npy", keys.reshape(10, 100))
    (tmp_path / "hot.json").write_text(json.dumps({"keys": keys.tolist(), "counts": []}))
    np.save(tmp_path / "small.npy", keys.astype(np.int32))
    for name in ("raw.bin", "keys.npy", "hot.json"):
        np.testing.assert_array_equal(read_key_log(tmp_path / name), keys)
    np.testing.assert_array_equal(read_key_log(tmp_path / "small.npy"), keys.astype(np.int32))
    with pytest.raises(SourceNotFoundError, match="no such file"):
        read_key_log(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01" * 12)
    np.save(tmp_path / "floats.npy", np.ones(4))
    (tmp_path / "bad.json").write_text('{"keys": [1, "two"]}')
    (tmp_path / "other.json").write_text('{"rows": [1]}')
    (tmp_path / "empty.bin").write_bytes(b"")
    for name, message in [("odd.bin", "not a multiple of 8"), ("floats.npy", "float64"),
                          ("bad.json", "int64 keys"), ("other.json", 'list "keys"'),
                          ("empty.bin", "no keys")]:
        with pytest.raises(KeyTypeError, match=message):
            read_key_log(tmp_path / name)


def test_plan_of_a_config_reads_table_sizes_from_the_files(two_tables: dict[str, Any]) -> None:
    config = write_config(two_tables)
    result = hps("plan", str(config), "--json")
    assert result.returncode == 0, result.stderr
    tables = json.loads(result.stdout)["tables"]
    assert [(t["table"], t["num_keys"], t["dim"]) for t in tables] == [
        ("sparse_embedding0", 3000, 8), ("sparse_embedding1", 2000, 16)]
    for t in tables:
        shape = TableShape("m", t["table"], t["num_keys"], t["dim"],
                           gpucacheper=t["settings"]["gpucacheper"],
                           lookup_keys=t["settings"]["lookup_keys"],
                           volatile_keys=t["settings"]["volatile_keys"], persistent=True)
        assert t["memory"] == [m.as_dict() for m in table_memory(shape)]
    # the human table: every tier, every storage type
    pretty = hps("plan", str(config), "--table", "m/sparse_embedding1:1M:16", columns=80)
    assert pretty.returncode == 0, pretty.stderr
    assert "1,000,000 keys × 16" in pretty.stdout and "3,000 keys × 8" in pretty.stdout
    assert all(name in pretty.stdout for name in STORAGE_NAMES)
    assert max(map(len, pretty.stdout.splitlines())) <= 80


def test_plan_replays_a_key_log_and_draws_it(tmp_path: Path, rng: np.random.Generator) -> None:
    log = (rng.zipf(1.2, 100_000) % 20_000).astype("<i8")
    log.tofile(tmp_path / "log.bin")
    result = hps("plan", "--table", "t0:20k:32", "--key-log", str(tmp_path / "log.bin"),
                 "--sizes", "1,10%,100", "--batch", "2k", "--json",
                 "--plot", str(tmp_path / "curve.png"))
    assert result.returncode == 0, result.stderr
    (table,) = json.loads(result.stdout)["tables"]
    assert table["log_keys"] == 100_000 and table["batch"] == 2000
    for got, share in zip(table["hit_rates"], [0.01, 0.1, 1.0], strict=True):
        want = hit_rate(log, 20_000, share, 2000)
        assert got["share"] == share and got["hit_rate"] == want.hit_rate
        assert got["warm_hit_rate"] == want.warm_hit_rate
        assert got["cache_bytes"] == cache_memory_bytes(20_000, 32, share)
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    np.arange(100, dtype="<i8").tofile(tmp_path / "log.bin")
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from hps.tools.cli import main; sys.argv[0] = 'hps'; main()")
    result = subprocess.run(
        [sys.executable, "-c", code, "plan", "--table", "t:1k:8", "--key-log",
         str(tmp_path / "log.bin"), "--plot", str(tmp_path / "c.png")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert result.returncode == 2
    assert "hps-server[plot]" in result.stderr and "hps plan --plot" in result.stderr
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize(("args", "message"), [
    ([], "give a config, or tables with --table"),
    (["--table", "t0:10M"], "NAME:ROWS:DIM"),
    (["--table", "t0:lots:8"], "not a key count"),
    (["--table", "t0:1k:8", "--key-log", "{dir}/missing.bin"], "no such file"),
    (["--table", "t0:1k:8", "--key-log", "{dir}/odd.bin"], "not a multiple of 8"),
    (["--table", "t0:1k:8", "--table", "t1:1k:8", "--key-log", "{dir}/log.bin"],
     "name its table"),
    (["--table", "t0:1k:8", "--key-log", "nope={dir}/log.bin"], "names no table"),
    (["--table", "t0:1k:8", "--key-log", "{dir}/log.bin", "--sizes", "0,150"],
     "in (0, 1]"),
    (["--table", "t0:1k:8", "--key-log", "{dir}/log.bin", "--sizes", "abc"],
     "percentages"),
    (["--table", "t0:1k:8", "--plot", "{dir}/c.png"], "give --key-log"),
    (["{config}", "--table", "nope:1k:8"], "names no table"),
    (["{config}", "--table", "sparse_embedding0:1k:9"], "the config says 8"),
    (["{config}", "--model", "other"], "no model 'other'"),
    (["{dir}/missing.json"], "missing.json"),
])
def test_bad_input_is_one_line_and_status_2(two_tables: dict[str, Any], args: list[str],
                                            message: str) -> None:
    folder = two_tables["dir"]
    config = write_config(two_tables)
    np.arange(10, dtype="<i8").tofile(folder / "log.bin")
    (folder / "odd.bin").write_bytes(b"\x00" * 9)
    result = hps("plan", *(a.format(dir=folder, config=config) for a in args))
    assert result.returncode == 2, result.stdout
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not result.stdout
