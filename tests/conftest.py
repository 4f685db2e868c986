"""Shared fixtures: HugeCTR-style sparse model folders written with plain NumPy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.redis_servers import RedisClusterProcs, RedisServer

# cp, seed and rng (seeded, replayable with HPS_SEED) and a moto S3 server for every folder
pytest_plugins = ["tests.support.gpu_fixtures", "tests.support.s3_server"]


def write_table(folder: Path, keys: np.ndarray, vectors: np.ndarray) -> Path:
    """Write a sparse model folder the way HugeCTR's own tests do: raw tofile()."""
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(keys, dtype="<i8").tofile(folder / "key")
    np.asarray(vectors, dtype="<f4").tofile(folder / "emb_vector")
    return folder


def make_table(rng: np.random.Generator, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    keys = rng.choice(np.int64(2**40), size=n, replace=False) - np.int64(2**39)
    return keys.astype(np.int64), rng.standard_normal((n, dim)).astype(np.float32)


def model_config(files: list[str], dims: list[int], name: str = "m", **extra: Any
                 ) -> dict[str, Any]:
    model = {
        "model": name,
        "sparse_files": files,
        "embedding_vecsize_per_table": dims,
        "maxnum_catfeature_query_per_table_per_sample": [32] * len(files),
        "default_value_for_each_table": [0.5] * len(files),
        "deployed_device_list": [0],
        "max_batch_size": 1024,
        "gpucache": False,
    }
    model.update(extra)
    return model


@pytest.fixture
def two_tables(tmp_path: Path, rng: np.random.Generator) -> dict[str, Any]:
    """A model of two tables (widths 8 and 16) on disk, with its source arrays."""
    k0, v0 = make_table(rng, 3000, 8)
    k1, v1 = make_table(rng, 2000, 16)
    write_table(tmp_path / "t0", k0, v0)
    write_table(tmp_path / "t1", k1, v1)
    config = {
        "supportlonglong": True,
        "models": [model_config([str(tmp_path / "t0"), str(tmp_path / "t1")], [8, 16])],
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")},
    }
    return {"config": config, "tables": [(k0, v0), (k1, v1)], "dir": tmp_path}


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A 3-master Redis Cluster (no replicas) on loopback, shared by the session."""
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster"), masters=3).start()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone server of the test's own, for tests that kill, pause or restart it."""
    server = RedisServer(tmp_path_factory.mktemp("redis-own")).start()
    yield server
    server.close()
