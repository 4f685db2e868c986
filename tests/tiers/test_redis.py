"""The Redis volatile tier against real redis-server processes (standalone and cluster).

Covers HugeCTR's layout both ways, every overflow policy, chunking by max_batch_size,
spreading over cluster nodes, the faults (down at start, killed mid-traffic and restarted,
slow server, cluster failover), AUTH and TLS. The partition mixer's known values are
tested with `hps.tiers.partition`.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from hps.config import VolatileDBConfig
from hps.errors import TierSetupError, TierUnavailableError
from hps.tiers.partition import partition_of
from hps.tiers.redis import RedisTier, meta_hash, value_hash
from hps.tiers.redis.layout import marker_key, pack_fields
from tests.support.redis_servers import (
    RedisBinaryMissing,
    RedisClusterProcs,
    RedisServer,
    eventually,
    free_port,
    redis_binary,
)

DIM = 8

Servers = RedisServer | RedisClusterProcs


# -- helpers ----------------------------------------------------------------------------


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    """RedisTier factory; every tier made is closed after the test."""
    made: list[RedisTier] = []

    def make(address: str, **settings: Any) -> RedisTier:
        settings.setdefault("reconnect_backoff", 0.05)
        settings.setdefault("reconnect_backoff_max", 0.2)
        tier = RedisTier(VolatileDBConfig(type="redis_cluster", address=address, **settings))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def new_table(tier: RedisTier | None = None, dim: int = DIM) -> str:
    name = f"hps_et.test.t{uuid.uuid4().hex[:12]}"
    if tier is not None:
        tier.create_table(name, dim)
    return name


def rows_for(keys: np.ndarray, dim: int = DIM, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((keys.size, dim)).astype(np.float32)


def some_keys(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.unique(rng.integers(-(2**62), 2**62, n * 2, dtype=np.int64))[:n]


def raw_client(servers: Servers) -> Any:
    if isinstance(servers, RedisClusterProcs):
        node = servers.nodes[0]
        return redis.RedisCluster(host=node.host, port=node.port)
    return servers.client()


@pytest.fixture(params=["standalone", "cluster"])
def servers(request: pytest.FixtureRequest) -> Servers:
    name = "redis_standalone" if request.param == "standalone" else "redis_cluster"
    result: Servers = request.getfixturevalue(name)
    return result


def stored_names(servers: Servers, table: str) -> list[bytes]:
    """Names of the Redis keys of `table`, from every node."""
    nodes = servers.nodes if isinstance(servers, RedisClusterProcs) else [servers]
    names = []
    for node in nodes:
        with node.client() as client:
            names += client.scan_iter(match=f"hps_et{{{table}/*", count=1000)
    return names


def key_field(key: int) -> bytes:
    return int(key).to_bytes(8, "little", signed=True)


# -- layout -----------------------------------------------------------------------------


def test_hash_names_are_hugectrs() -> None:
    # HugeCTR: "hps_et{" + tag + "/p" + N + "}" + suffix, tag = "hps_et.<model>.<table>"
    assert value_hash("hps_et.m.t", 3) == "hps_et{hps_et.m.t/p3}v"
    assert meta_hash("hps_et.m.t", 15) == "hps_et{hps_et.m.t/p15}t"


def test_key_conversion_is_raw_little_endian() -> None:
    keys = np.array([0, 1, -1, 2**62 + 5, -(2**63)], dtype=np.int64)
    as_bytes = keys.astype("<i8").view("V8").tolist()
    assert all(type(b) is bytes and len(b) == 8 for b in as_bytes)
    assert as_bytes == [key_field(k) for k in keys.tolist()]
    packed = pack_fields(keys).tobytes()
    assert packed == b"".join(b"$8\r\n" + b + b"\r\n" for b in as_bytes)


def test_reads_a_hash_written_by_hand_in_hugectr_format(
    servers: Servers, make_tier: Callable[..., RedisTier]
) -> None:
    tier = make_tier(servers.address, num_partitions=8)
    table = new_table(tier)
    keys = some_keys(200)
    rows = rows_for(keys)
    parts = partition_of(keys, 8)
    with raw_client(servers) as client:
        for key, p, row in zip(keys.tolist(), parts.tolist(), rows, strict=True):
            client.hset(value_hash(table, p), key_field(key), row.astype("<f4").tobytes())
    query = np.concatenate([keys[::-1], [12345, -6789]]).astype(np.int64)
    vectors, found = tier.fetch(table, query)
    assert found.tolist() == [True] * keys.size + [False, False]
    np.testing.assert_array_equal(vectors[: keys.size], rows[::-1])
    assert not vectors[keys.size:].any()
    assert tier.size(table) == keys.size


def test_writes_what_hugectr_reads(servers: Servers, make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(servers.address, num_partitions=4)
    table = new_table(tier)
    keys = some_keys(300, seed=1)
    rows = rows_for(keys, seed=1)
    tier.insert(table, keys, rows)
    parts = partition_of(keys, 4)
    with raw_client(servers) as client:
        names = set()
        for p in range(4):
            mine = keys[parts == p]
            got = client.hmget(value_hash(table, p), [key_field(k) for k in mine.tolist()])
            assert got == [r.astype("<f4").tobytes() for r in rows[parts == p]]
            assert client.hlen(value_hash(table, p)) == mine.size
            names.add(value_hash(table, p).encode())
            names.add(marker_key(table, p).encode())  # ours: HugeCTR reads only the hashes
    # nothing else: evict_random keeps no metadata, as in HugeCTR
    assert set(stored_names(servers, table)) == names


def test_metadata_formats(redis_standalone: RedisServer,
                          make_tier: Callable[..., RedisTier]) -> None:
    keys = some_keys(50, seed=2)
    lfu = make_tier(redis_standalone.address, num_partitions=1,
                    overflow_policy="evict_least_used")
    t1 = new_table(lfu)
    lfu.insert(t1, keys, rows_for(keys))
    lfu.fetch(t1, keys[:10])
    assert lfu.wait_idle(5)
    lru = make_tier(redis_standalone.address, num_partitions=1, overflow_policy="evict_oldest")
    lru._clock = lambda: 1_700_000_123.9
    t2 = new_table(lru)
    lru.insert(t2, keys, rows_for(keys))
    with redis_standalone.client() as client:
        counts = client.hgetall(meta_hash(t1, 0))
        # HugeCTR: HINCRBY per insert and per fetch, ASCII integers
        assert {counts[key_field(k)] for k in keys[:10].tolist()} == {b"2"}
        assert {counts[key_field(k)] for k in keys[10:].tolist()} == {b"1"}
        times = client.hgetall(meta_hash(t2, 0))
        # HugeCTR: time_t seconds as 8 raw bytes
        assert set(times.values()) == {(1_700_000_123).to_bytes(8, "little")}
        assert len(times) == keys.size


# -- tables and batches (the Tier contract itself: tests/tiers/test_tier_contract.py) ---------


def test_drop_unlinks_every_hash(servers: Servers, make_tier: Callable[..., RedisTier]) -> None:
    # evict_oldest keeps metadata hashes too: drop must remove both kinds
    tier = make_tier(servers.address, overflow_policy="evict_oldest")
    table = new_table(tier)
    keys = some_keys(500, seed=4)
    tier.insert(table, keys, rows_for(keys))
    tier.drop_table(table)
    with raw_client(servers) as client:
        left = [client.exists(value_hash(table, p), meta_hash(table, p)) for p in range(16)]
    assert sum(left) == 0


def test_bad_rows_fall_through_counted_and_named(
    redis_standalone: RedisServer, make_tier: Callable[..., RedisTier],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A row of another width, and a partition hash of another type (WRONGTYPE): their
    keys answer "not found" (the next tier serves them), the other keys are served, the
    failures are counted by kind and logged once per kind, naming the right partition."""
    tier = make_tier(redis_standalone.address, num_partitions=4)
    table = new_table(tier, dim=4)
    keys = some_keys(200)
    rows = rows_for(keys, dim=4)
    tier.insert(table, keys, rows)
    parts = partition_of(keys, 4)
    bad_key = keys[0]
    wide, other = int(parts[0]), (int(parts[0]) + 1) % 4
    with redis_standalone.client() as client:
        client.hset(value_hash(table, wide), key_field(bad_key), np.zeros(8, "<f4").tobytes())
        client.delete(value_hash(table, other))
        client.set(value_hash(table, other), b"not a hash")
    caplog.set_level(logging.WARNING, logger="hps.tiers.redis")
    for _ in range(3):
        vectors, found = tier.fetch(table, keys)
        expect = (keys != bad_key) & (parts != other)
        np.testing.assert_array_equal(found, expect)
        np.testing.assert_array_equal(vectors[expect], rows[expect])
    failures = tier.stats()["failures"]
    assert failures["bad_row"] == 3 and failures["wrong_type"] == 3 * int((parts == other).sum())
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2  # once per kind, though each fetch met both
    assert any(f"partition {value_hash(table, wide)} " in m and "bad row" in m for m in logged)
    assert any(f"partition {value_hash(table, other)} " in m and "wrong type" in m
               for m in logged)


def test_batches_larger_than_max_batch_size(servers: Servers,
                                            make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(servers.address, num_partitions=4, max_batch_size=64)
    table = new_table(tier)
    keys = some_keys(5000, seed=5)
    rows = rows_for(keys, seed=5)
    calls = _command_calls(servers, "hset")
    tier.insert(table, keys, rows)
    assert _command_calls(servers, "hset") - calls >= 5000 // 64
    calls = _command_calls(servers, "hmget")
    vectors, found = tier.fetch(table, keys[::-1])
    assert _command_calls(servers, "hmget") - calls >= 5000 // 64
    assert found.all()
    np.testing.assert_array_equal(vectors, rows[::-1])


def _command_calls(servers: Servers, command: str) -> int:
    nodes = servers.nodes if isinstance(servers, RedisClusterProcs) else [servers]
    total = 0
    for node in nodes:
        with node.client() as client:
            stats = client.info("commandstats").get(f"cmdstat_{command}", {})
            total += int(stats.get("calls", 0))
    return total


def test_cluster_spreads_partitions_over_all_nodes(
    redis_cluster: RedisClusterProcs, make_tier: Callable[..., RedisTier]
) -> None:
    tier = make_tier(redis_cluster.address, num_partitions=16)
    assert tier.cluster is True
    assert len(tier.nodes()) == 3
    table = new_table(tier)
    keys = some_keys(4000, seed=6)
    rows = rows_for(keys, seed=6)
    tier.insert(table, keys, rows)
    held = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            held.append(len(list(client.scan_iter(match=f"hps_et{{{table}/*", count=1000))))
    assert all(n > 0 for n in held), held
    assert sum(held) == 2 * 16  # every partition's hash and its marker
    vectors, found = tier.fetch(table, keys)
    assert found.all() and np.array_equal(vectors, rows)


def test_standalone_is_detected(redis_standalone: RedisServer,
                                make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(f"{redis_standalone.address},127.0.0.1:1")
    assert tier.cluster is False
    assert tier.nodes() == [redis_standalone.address]


def test_missing_redis_server_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fixtures raise this (a test error, never a skip) where redis-server is missing
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RedisBinaryMissing, match="apt-get install redis-server"):
        redis_binary("redis-server")


def test_bad_address_is_a_setup_error() -> None:
    with pytest.raises(TierSetupError, match="host:port"):
        RedisTier(VolatileDBConfig(type="redis", address="127.0.0.1:notaport"))


# -- overflow ---------------------------------------------------------------------------


def test_evict_random_really_prunes(servers: Servers, make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(servers.address, num_partitions=4, overflow_margin=100,
                     overflow_resolution_target=0.5)
    table = new_table(tier)
    keys = some_keys(1000, seed=7)
    rows = rows_for(keys, seed=7)
    for a in range(0, 1000, 50):
        tier.insert(table, keys[a:a + 50], rows[a:a + 50])
    with raw_client(servers) as client:
        sizes = [client.hlen(value_hash(table, p)) for p in range(4)]
    assert all(s <= 100 for s in sizes), sizes
    assert tier.size(table) == sum(sizes) < 400
    vectors, found = tier.fetch(table, keys)
    assert np.array_equal(vectors[found], rows[found])  # survivors are intact


def test_evict_random_prunes_to_target(redis_standalone: RedisServer,
                                       make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(redis_standalone.address, num_partitions=1, overflow_margin=100,
                     overflow_resolution_target=0.5)
    table = new_table(tier)
    keys = some_keys(101, seed=8)
    tier.insert(table, keys, rows_for(keys))
    assert tier.size(table) == 50


def test_evict_least_used_keeps_the_used(servers: Servers,
                                         make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(servers.address, num_partitions=1, overflow_margin=100,
                     overflow_resolution_target=0.5, overflow_policy="evict_least_used")
    table = new_table(tier)
    keys = some_keys(120, seed=9)
    rows = rows_for(keys, seed=9)
    tier.insert(table, keys[:100], rows[:100])
    hot = keys[40:70]
    for _ in range(3):
        tier.fetch(table, hot)
    assert tier.wait_idle(5)
    tier.insert(table, keys[100:], rows[100:])  # 120 > 100: prune to 50
    assert tier.size(table) == 50
    assert tier.fetch(table, hot)[1].all()
    with raw_client(servers) as client:
        assert client.hlen(meta_hash(table, 0)) == 50


def test_evict_oldest_drops_the_oldest(servers: Servers,
                                       make_tier: Callable[..., RedisTier]) -> None:
    now = [1000.0]
    tier = make_tier(servers.address, num_partitions=1, overflow_margin=100,
                     overflow_resolution_target=0.5, overflow_policy="evict_oldest")
    tier._clock = lambda: now[0]
    table = new_table(tier)
    keys = some_keys(120, seed=10)
    rows = rows_for(keys, seed=10)
    tier.insert(table, keys[:60], rows[:60])
    now[0] = 2000.0
    tier.insert(table, keys[60:100], rows[60:100])
    now[0] = 3000.0
    tier.insert(table, keys[100:], rows[100:])  # 120 > 100: the 70 oldest go
    assert tier.size(table) == 50
    _, found = tier.fetch(table, keys)
    assert not found[:60].any()
    assert found[100:].all()
    assert found[60:100].sum() == 30


def test_evict_oldest_with_refresh_after_fetch_keeps_the_recent(
    redis_standalone: RedisServer, make_tier: Callable[..., RedisTier]
) -> None:
    now = [1000.0]
    tier = make_tier(redis_standalone.address, num_partitions=1, overflow_margin=100,
                     overflow_resolution_target=0.5, overflow_policy="evict_oldest",
                     refresh_time_after_fetch=True)
    tier._clock = lambda: now[0]
    table = new_table(tier)
    keys = some_keys(120, seed=11)
    tier.insert(table, keys[:100], rows_for(keys[:100]))
    now[0] = 2000.0
    tier.fetch(table, keys[:20])  # read recently: survives
    assert tier.wait_idle(5)
    now[0] = 3000.0
    tier.insert(table, keys[100:], rows_for(keys[100:]))
    _, found = tier.fetch(table, keys)
    assert found[:20].all() and found[100:].all()
    assert found.sum() == 50


# -- background inserts -------------------------------------------------------------------


def test_insert_async_writes_in_the_background(servers: Servers,
                                               make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(servers.address)
    table = new_table(tier)
    keys = some_keys(300, seed=12)
    rows = rows_for(keys, seed=12)
    buffer = rows.copy()
    assert tier.insert_async(table, keys, buffer)
    buffer[:] = 0  # the tier took a copy
    assert tier.wait_idle(5)
    vectors, found = tier.fetch(table, keys)
    assert found.all() and np.array_equal(vectors, rows)


def test_insert_async_drops_and_counts_when_full(redis_server: RedisServer,
                                                 make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(redis_server.address, async_queue_size=1, socket_timeout=2.0)
    table = new_table(tier)
    keys = some_keys(100, seed=13)
    rows = rows_for(keys)
    with redis_server.client() as client:
        client.execute_command("CLIENT", "PAUSE", 600, "WRITE")
        accepted = [tier.insert_async(table, keys[i::5], rows[i::5]) for i in range(5)]
    assert not all(accepted)
    assert tier.dropped["insert"] == sum(20 for ok in accepted if not ok)
    assert tier.wait_idle(5)
    _, found = tier.fetch(table, keys)
    expected = np.zeros(100, dtype=bool)
    for i, ok in enumerate(accepted):
        expected[i::5] = ok
    assert found.tolist() == expected.tolist()


# -- faults -------------------------------------------------------------------------------


def test_down_at_start_then_serves_when_up(tmp_path: Path,
                                           make_tier: Callable[..., RedisTier]) -> None:
    port = free_port()
    tier = make_tier(f"127.0.0.1:{port}", connect_timeout=0.2)
    assert not tier.available
    assert tier.failures["connection"] == 1
    table = new_table(tier)
    keys = some_keys(10)
    for _ in range(20):
        with pytest.raises(TierUnavailableError):
            tier.fetch(table, keys)
    # each call was failed fast by the open breaker, none tried the network
    assert tier.failures["rejected"] == 20 and tier.failures["connection"] == 1
    with pytest.raises(TierUnavailableError):
        tier.insert(table, keys, rows_for(keys))
    with RedisServer(tmp_path / "late", port=port):
        eventually(lambda: tier.fetch(table, keys), 5, "the tier did not connect")
        tier.insert(table, keys, rows_for(keys))
        assert tier.fetch(table, keys)[1].all()
        assert tier.cluster is False


def test_killed_mid_traffic_and_restarted(redis_server: RedisServer,
                                          make_tier: Callable[..., RedisTier],
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hps.tiers.redis")
    tier = make_tier(redis_server.address, socket_timeout=0.5, connect_timeout=0.2)
    table = new_table(tier)
    keys = some_keys(2000, seed=14)
    rows = rows_for(keys, seed=14)
    tier.insert(table, keys, rows)

    outcomes: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                _, found = tier.fetch(table, keys)
                outcomes.append("hit" if found.all() else "miss")
            except TierUnavailableError:
                outcomes.append("unavailable")
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                outcomes.append(f"error: {exc!r}")
            time.sleep(0.002)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        eventually(lambda: outcomes.count("hit") > 5 or 1 / 0, 5, "no traffic")
        redis_server.kill()
        eventually(lambda: outcomes[-1] == "unavailable" or 1 / 0, 5, "no failure seen")
        rejected = tier.failures.get("rejected", 0)
        with pytest.raises(TierUnavailableError):
            tier.fetch(table, keys)
        assert tier.failures["rejected"] > rejected  # failed fast by the open breaker
        redis_server.start()
        eventually(lambda: tier.insert(table, keys, rows), 5, "the tier did not reconnect")
        eventually(lambda: outcomes[-1] == "hit" or 1 / 0, 5, "serving did not resume")
    finally:
        stop.set()
        worker.join()
    assert not [o for o in outcomes if o.startswith("error")], set(outcomes)
    assert tier.failures["connection"] >= 1
    assert tier.failures["rejected"] >= 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per episode
    assert any("is back" in r.getMessage() for r in caplog.records)
    assert tier.stats()["episodes"] == 1


def test_slow_server_times_out_fast(redis_server: RedisServer,
                                    make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(redis_server.address, socket_timeout=0.2, connect_timeout=0.2)
    table = new_table(tier)
    keys = some_keys(100, seed=15)
    tier.insert(table, keys, rows_for(keys))

    def sleep_server() -> None:
        with redis_server.client(socket_timeout=5) as client:
            client.execute_command("DEBUG", "SLEEP", 1.2)

    sleeper = threading.Thread(target=sleep_server)
    sleeper.start()
    try:
        timed_out = False
        while sleeper.is_alive() and not timed_out:  # until a fetch meets the sleep
            try:
                tier.fetch(table, keys)
            except TierUnavailableError:
                timed_out = True
        # a fetch gave up on the sleeping server instead of waiting for its answer
        assert timed_out and tier.failures["timeout"] >= 1
    finally:
        sleeper.join()
    eventually(lambda: tier.fetch(table, keys)[1].all() or 1 / 0, 5, "no recovery")


def test_insert_while_down_raises(redis_server: RedisServer,
                                  make_tier: Callable[..., RedisTier]) -> None:
    tier = make_tier(redis_server.address, socket_timeout=0.3, connect_timeout=0.2)
    table = new_table(tier)
    keys = some_keys(10)
    redis_server.kill()
    with pytest.raises(TierUnavailableError):
        tier.insert(table, keys, rows_for(keys))
    assert not tier.insert_async(table, keys, rows_for(keys))
    assert tier.dropped["insert"] == 10


def _replicated(cluster: RedisClusterProcs) -> None:
    for master in cluster.masters():
        with master.client() as client:
            assert client.execute_command("WAIT", 1, 2000) >= 1


def test_cluster_manual_failover_is_followed(redis_cluster_replicas: RedisClusterProcs,
                                             make_tier: Callable[..., RedisTier]) -> None:
    cluster = redis_cluster_replicas
    tier = make_tier(cluster.address, socket_timeout=1.0)
    table = new_table(tier)
    keys = some_keys(3000, seed=16)
    rows = rows_for(keys, seed=16)
    tier.insert(table, keys, rows)
    _replicated(cluster)
    master = cluster.masters()[0]
    replica = cluster.replica_of(master)
    with replica.client() as client:
        client.execute_command("CLUSTER", "FAILOVER")

    def promoted() -> None:
        with replica.client() as client:
            assert client.execute_command("ROLE")[0] == b"master"
        with master.client() as client:
            assert client.execute_command("ROLE")[0] == b"slave"

    eventually(promoted, 10, "the replica was not promoted")
    cluster.wait_ok()
    # slots moved: the tier follows the MOVED replies at once, without a new object
    vectors, found = tier.fetch(table, keys)
    assert found.all() and np.array_equal(vectors, rows)
    assert tier.failures == {}
    assert replica.address in tier.nodes() and master.address not in tier.nodes()


def test_cluster_master_killed_fails_over(redis_cluster_replicas: RedisClusterProcs,
                                          make_tier: Callable[..., RedisTier]) -> None:
    cluster = redis_cluster_replicas
    tier = make_tier(cluster.address, socket_timeout=0.5, connect_timeout=0.2)
    table = new_table(tier)
    keys = some_keys(3000, seed=17)
    rows = rows_for(keys, seed=17)
    tier.insert(table, keys, rows)
    _replicated(cluster)
    victim = cluster.masters()[1]
    victim.kill()
    with pytest.raises(TierUnavailableError):
        tier.fetch(table, keys)
    vectors, found = eventually(lambda: tier.fetch(table, keys), 20, "no failover")
    assert found.all() and np.array_equal(vectors, rows)
    assert victim.address not in tier.nodes()
    assert tier.failures["connection"] >= 1


# -- auth and TLS -------------------------------------------------------------------------


def test_requirepass(tmp_path: Path, make_tier: Callable[..., RedisTier]) -> None:
    with RedisServer(tmp_path, password="s3cret") as server:
        tier = make_tier(server.address, password="s3cret")
        table = new_table(tier)
        keys = some_keys(10)
        tier.insert(table, keys, rows_for(keys))
        assert tier.fetch(table, keys)[1].all()
        with pytest.raises(TierSetupError, match="password"):
            make_tier(server.address, password="wrong")
        with pytest.raises(TierSetupError, match="requires authentication"):
            make_tier(server.address)


def test_acl_user(tmp_path: Path, make_tier: Callable[..., RedisTier]) -> None:
    acl = ["--user", "alice", "on", ">pw-alice", "~*", "&*", "+@all"]
    with RedisServer(tmp_path, extra=acl) as server:
        tier = make_tier(server.address, user_name="alice", password="pw-alice")
        table = new_table(tier)
        keys = some_keys(10)
        tier.insert(table, keys, rows_for(keys))
        assert tier.fetch(table, keys)[1].all()
        with pytest.raises(TierSetupError, match="'alice'"):
            make_tier(server.address, user_name="alice", password="nope")
        with pytest.raises(TierSetupError, match="user_name"):
            make_tier(server.address, user_name="alice")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}", cwd=folder)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    _make_ca(folder, "ca")
    _make_ca(folder, "other-ca")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=redis.localhost",
             cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=DNS:redis.localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext",
             cwd=folder)
    return folder


def test_tls(tls_files: Path, tmp_path: Path, make_tier: Callable[..., RedisTier]) -> None:
    files = tuple(str(tls_files / f) for f in ("server.crt", "server.key", "ca.crt"))
    with RedisServer(tmp_path, tls=files) as server:  # type: ignore[arg-type]
        tier = make_tier(server.address, enable_tls=True,
                         tls_ca_certificate=str(tls_files / "ca.crt"),
                         tls_server_name_identification="redis.localhost")
        table = new_table(tier)
        keys = some_keys(10)
        tier.insert(table, keys, rows_for(keys))
        assert tier.fetch(table, keys)[1].all()
        with pytest.raises(TierSetupError, match="TLS"):
            make_tier(server.address, enable_tls=True,
                      tls_ca_certificate=str(tls_files / "other-ca.crt"),
                      tls_server_name_identification="redis.localhost")
        with pytest.raises(TierSetupError, match="TLS"):
            make_tier(server.address, enable_tls=True,
                      tls_ca_certificate=str(tls_files / "ca.crt"),
                      tls_server_name_identification="not-the-server.example")
    with pytest.raises(TierSetupError, match="tls_ca_certificate"):
        make_tier("127.0.0.1:1", enable_tls=True,
                  tls_ca_certificate=str(tmp_path / "missing.crt"))
