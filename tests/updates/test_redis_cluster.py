"""Online updates through Redis Streams on a real 3-master Redis Cluster: each table's
stream is a key on the master of its slot, read, acknowledged and resumed there."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis.crc import key_slot

from hps import HierarchicalParameterServer
from hps.config import UpdateSourceConfig
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_publisher
from tests.conftest import make_table, model_config, write_table
from tests.support.redis_servers import RedisClusterProcs
from tests.updates.conftest import publish, wait_status

#: three tables whose streams hash to slots of the three masters (12992, 8929, 4738)
TABLES = ["sparse_embedding0", "sparse_embedding1", "sparse_embedding2"]
DIMS = [8, 8, 4]
TOPICS = [f"hps_et.m.{t}" for t in TABLES]


@pytest.fixture
def cluster(redis_cluster: RedisClusterProcs) -> Iterator[RedisClusterProcs]:
    """The session's cluster without the streams of these tests (before and after)."""
    def drop() -> None:
        for node in redis_cluster.masters():
            with node.client() as c:
                for topic in TOPICS:
                    if key_slot(topic.encode()) in _slots_of(c):
                        c.delete(topic)

    drop()
    yield redis_cluster
    drop()


def _slots_of(client: redis.Redis) -> set[int]:
    """The slots the node behind `client` serves."""
    me = client.execute_command("CLUSTER", "MYID").decode()
    slots: set[int] = set()
    for start, stop, *nodes in client.execute_command("CLUSTER", "SLOTS"):
        if nodes[0][2].decode() == me:
            slots.update(range(int(start), int(stop) + 1))
    return slots


def _tables(folder: Path, rng: np.random.Generator, count: int
            ) -> tuple[list[str], list[tuple[np.ndarray, np.ndarray]]]:
    files, tables = [], []
    for i in range(count):
        keys, vectors = make_table(rng, 500, DIMS[i])
        files.append(str(write_table(folder / f"t{i}", keys, vectors)))
        tables.append((keys, vectors))
    return files, tables


def _config(folder: Path, files: list[str], address: str, group: str) -> dict[str, Any]:
    return {
        "models": [model_config(files, DIMS[:len(files)])],
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(folder / "rocks")},
        "update_source": {"type": "redis_stream", "address": address, "group": group,
                          "poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200,
                          "failure_backoff_ms": 20, "failure_backoff_max_ms": 200},
    }


@pytest.fixture
def cluster_publisher(cluster: RedisClusterProcs) -> Iterator[UpdatePublisher]:
    publisher = open_publisher(UpdateSourceConfig(type="redis_stream",
                                                  address=cluster.address))
    yield publisher
    publisher.close()


def _wait_rows(server: HierarchicalParameterServer, table: int, keys: np.ndarray,
               vectors: np.ndarray) -> None:
    from tests.support.redis_servers import eventually

    eventually(lambda: np.testing.assert_array_equal(server.lookup("m", table, keys),
                                                     vectors),
               20.0, f"updated rows of table {table} visible")


def test_updates_reach_every_table_from_streams_on_three_masters(
        cluster: RedisClusterProcs, cluster_publisher: UpdatePublisher, tmp_path: Path,
        rng: np.random.Generator) -> None:
    files, tables = _tables(tmp_path, rng, 3)
    group = f"cluster-{uuid.uuid4().hex[:8]}"
    with HierarchicalParameterServer(_config(tmp_path, files, cluster.address, group)) as s:
        fresh = []
        for i, (keys, _) in enumerate(tables):
            rows = rng.standard_normal((50, DIMS[i])).astype(np.float32)
            publish(cluster_publisher, keys[:50], rows, topic=TOPICS[i])
            fresh.append(rows)
        for i, (keys, vectors) in enumerate(tables):
            _wait_rows(s, i, keys[:50], fresh[i])
            np.testing.assert_array_equal(s.lookup("m", i, keys[50:100]), vectors[50:100])
        status = wait_status(s, lambda st: all(st["tables"].get(t, {}).get("lag_messages")
                                               == 0 for t in TOPICS), "every stream acked")
        assert status["state"] == "running" and status["retries"] == 0
        assert all(status["tables"][t]["messages"] == 1 for t in TOPICS)
    # each stream lives on one master, each on another one, and the group acknowledged
    # its entry there
    holders = {}
    for node in cluster.masters():
        with node.client() as c:
            served = _slots_of(c)
            for topic in TOPICS:
                if key_slot(topic.encode()) in served:
                    assert c.exists(topic)
                    holders[topic] = node.port
                    (info,) = [g for g in c.xinfo_groups(topic) if g["name"] == group.encode()]
                    assert info["pending"] == 0 and info["lag"] == 0
    assert sorted(holders) == sorted(TOPICS) and len(set(holders.values())) == 3


def test_a_restart_resumes_after_what_it_committed_on_a_cluster(
        cluster: RedisClusterProcs, cluster_publisher: UpdatePublisher, tmp_path: Path,
        rng: np.random.Generator) -> None:
    """One stream (the path that blocks on it), acknowledged on its master: a restarted
    server applies only what came after, over the RocksDB that kept the rest."""
    files, tables = _tables(tmp_path, rng, 1)
    keys, vectors = tables[0]
    config = _config(tmp_path, files, cluster.nodes[0].address, "cluster-restart")
    before = rng.standard_normal((60, DIMS[0])).astype(np.float32)
    with HierarchicalParameterServer(config) as server:
        for i in range(0, 60, 20):
            publish(cluster_publisher, keys[i:i + 20], before[i:i + 20], topic=TOPICS[0])
        _wait_rows(server, 0, keys[:60], before)
    after = rng.standard_normal((20, DIMS[0])).astype(np.float32)
    publish(cluster_publisher, keys[:20], after, topic=TOPICS[0])
    with HierarchicalParameterServer(config) as server:
        _wait_rows(server, 0, keys[:60], np.concatenate([after, before[20:]]))
        status = wait_status(server, lambda s: s["tables"][TOPICS[0]]["lag_messages"] == 0,
                             "caught up")
        assert status["tables"][TOPICS[0]]["messages"] == 1
        np.testing.assert_array_equal(server.lookup("m", 0, keys[60:120]), vectors[60:120])


def test_a_cluster_that_does_not_answer_is_an_outage(tmp_path: Path,
                                                     rng: np.random.Generator) -> None:
    """Seeds that do not answer: the source is down, retried, and the model serves."""
    from tests.support.redis_servers import free_port

    files, tables = _tables(tmp_path, rng, 1)
    seeds = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with HierarchicalParameterServer(_config(tmp_path, files, seeds, "nobody")) as server:
        status = wait_status(server, lambda s: s["state"] == "down", "the outage seen")
        assert "Redis at" in status["last_error"]
        np.testing.assert_array_equal(server.lookup("m", 0, tables[0][0][:10]),
                                      tables[0][1][:10])
