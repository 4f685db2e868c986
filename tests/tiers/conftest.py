"""Fixtures for the database tier tests: real Redis servers on loopback ports.

`redis_standalone` (one server) lives for the whole session; `redis_cluster_replicas` (3
masters with a replica each, for the failover tests) is made only when a test asks for
it. Each runs in its own temporary folder and is torn down at the end. `redis_server`, a
server of a test's own to kill or restart, and `redis_cluster` (3 masters, no replicas,
for the whole session) live in tests/conftest.py, where the HTTP and update tests reach
them too. A missing `redis-server` fails these
fixtures (it is never a skip): scripts/test.sh installs it, and CI always has it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis_servers import RedisClusterProcs, RedisServer


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
        tmp_path_factory.mktemp("redis-cluster-replicas"), masters=3, replicas=1
    ).start()
    yield cluster
    cluster.close()
