"""Fixtures for the database tier tests: real Redis servers on loopback ports, and every
backend a tier runs on, for the contract suites.

`redis_standalone` (one server) lives for the whole session; `redis_cluster_replicas` (3
masters with a replica each, for the failover tests) is made only when a test asks for
it. Each runs in its own temporary folder and is torn down at the end. `redis_server`, a
server of a test's own to kill or restart, and `redis_cluster` (3 masters, no replicas,
for the whole session) live in tests/conftest.py, where the HTTP and update tests reach
them too. A missing `redis-server` fails these
fixtures (it is never a skip): scripts/test.sh installs it, and CI always has it.

`backend` (the hash map, Redis standalone, the Redis Cluster, RocksDB in a temporary
folder), `tier` (one opened over it) and `table` (a fresh table of width DIM in it) run
the two contract suites, tests/tiers/test_tier_contract.py and
tests/tiers/test_bulk_load.py, over every backend.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hps.config import PersistentDBConfig, VolatileDBConfig
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.hash_map import HashMapTier
from hps.tiers.hash_map.shared import SharedHashMapTier
from hps.tiers.redis import RedisTier
from hps.tiers.rocksdb.tier import RocksDBTier
from tests.support.redis_servers import RedisClusterProcs, RedisServer

#: width of the rows of the `table` fixture
DIM = 4


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-standalone")).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster_replicas(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterProcs]:
    cluster = RedisClusterProcs(
        tmp_path_factory.mktemp("redis-cluster-replicas"), masters=3, replicas=1,
        # 1 s let a loaded 2-core CI machine miss pings: a node flagged a live master as
        # failing and answered CLUSTERDOWN just after a manual failover. A killed master is
        # still taken over within about 5 s.
        node_timeout_ms=3000,
    ).start()
    yield cluster
    cluster.close()


@dataclass
class Backend:
    """Opens tiers over one backing store (the same store on every call).

    `durable`: a closed tier's rows are still there for the next tier opened over it.
    `examples`: how many sequences the dict model tries (fewer where every call crosses a
    socket or the disk).
    """

    name: str
    make: Callable[[], BulkLoadTier]
    durable: bool
    examples: int = 60
    opened: list[BulkLoadTier] = field(default_factory=list)

    def open(self) -> BulkLoadTier:
        tier = self.make()
        self.opened.append(tier)
        return tier

    def close(self, tier: BulkLoadTier) -> None:
        self.opened.remove(tier)
        tier.close()


def redis_backend(name: str, address: str) -> Backend:
    config = VolatileDBConfig.model_validate({
        "type": "redis_cluster", "address": address,
        "reconnect_backoff": 0.05, "reconnect_backoff_max": 0.2,
    })
    return Backend(name, lambda: RedisTier(config), durable=True)


@pytest.fixture(params=["hash_map", "multi_process_hash_map", "redis_standalone",
                        "redis_cluster", "rocksdb"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    kind = request.param
    if kind == "hash_map":
        volatile = VolatileDBConfig.model_validate({})
        made = Backend(kind, lambda: HashMapTier(volatile), durable=False, examples=150)
    elif kind == "multi_process_hash_map":
        shared = VolatileDBConfig.model_validate({"type": kind})
        made = Backend(kind, lambda: SharedHashMapTier(shared), durable=False, examples=60)
    elif kind == "rocksdb":
        persistent = PersistentDBConfig.model_validate(
            {"type": "rocks_db", "path": str(tmp_path / "rocks")})
        made = Backend(kind, lambda: RocksDBTier(persistent), durable=True)
    else:
        made = redis_backend(kind, request.getfixturevalue(kind).address)
    yield made
    for tier in list(made.opened):
        made.close(tier)


@pytest.fixture
def tier(backend: Backend) -> BulkLoadTier:
    return backend.open()


@pytest.fixture
def table(tier: BulkLoadTier) -> str:
    """A fresh table of width DIM (unique: the Redis servers live for the whole session)."""
    name = f"hps_et.contract.t{uuid.uuid4().hex[:12]}"
    tier.create_table(name, DIM)
    return name
