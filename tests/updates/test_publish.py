"""Publishing rows as update messages (publish_arrays, publish_table, `hps publish`) to
Redis Streams and Kafka, read back from the real servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from hps import HierarchicalParameterServer
from hps.errors import BadUpdateError, UnknownModelError, UnknownTableError
from hps.server.loader import LoadProgress
from hps.updates import codec
from hps.updates.publish import publish_arrays, publish_table
from tests.conftest import write_table
from tests.support.redis_servers import RedisServer
from tests.updates.conftest import DIM, TOPIC, Model, wait_rows, wait_status

REPO = Path(__file__).resolve().parents[2]


class _Counted(LoadProgress):
    def __init__(self) -> None:
        self.keys = 0
        self.started: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        self.started.append((table, num_keys))

    def advance(self, keys: int, num_bytes: int) -> None:
        self.keys += keys

    def finish_table(self, table: str, seconds: float) -> None:
        self.finished.append(table)


def _stream(stream_redis: RedisServer, topic: str = TOPIC) -> list[tuple[np.ndarray, ...]]:
    client = redis.Redis(port=stream_redis.port)
    try:
        entries = client.xrange(topic)
    finally:
        client.close()
    return [codec.decode(fields[b"u"], dim=DIM, key_bytes=8, uint32_keys=False)
            for _, fields in entries]


def test_arrays_go_out_in_messages_of_max_batch_size_rows(
        model: Model, redis_updates: dict[str, Any], stream_redis: RedisServer,
        rng: np.random.Generator) -> None:
    config = model.config({**redis_updates, "max_batch_size": 300})
    keys, rows = model.keys[:1000], rng.standard_normal((1000, DIM)).astype(np.float32)
    progress = _Counted()
    assert publish_arrays(config, "m", "sparse_embedding0", keys, rows, progress=progress) == 4
    messages = _stream(stream_redis)
    assert [k.size for k, _ in messages] == [300, 300, 300, 100]
    np.testing.assert_array_equal(np.concatenate([k for k, _ in messages]), keys)
    np.testing.assert_array_equal(np.concatenate([v for _, v in messages]), rows)
    assert progress.started == [(TOPIC, 1000)] and progress.keys == 1000
    assert progress.finished == [TOPIC]
    with HierarchicalParameterServer(config) as server:  # a new group reads them all
        wait_rows(server, keys, rows)


def test_a_sparse_model_folder_is_published_and_served(
        model: Model, redis_updates: dict[str, Any], stream_redis: RedisServer,
        rng: np.random.Generator, tmp_path: Path) -> None:
    new_rows = rng.standard_normal((model.keys.size, DIM)).astype(np.float32)
    write_table(tmp_path / "retrained", model.keys, new_rows)
    config = model.config({**redis_updates, "max_batch_size": 512})
    with HierarchicalParameterServer(config) as server:
        sent = publish_table(config, "m", 0, str(tmp_path / "retrained"))
        assert sent == -(-model.keys.size // 512)
        wait_rows(server, model.keys, new_rows)
        wait_status(server, lambda s: s["tables"][TOPIC]["rows"] == model.keys.size,
                    "every row applied")
    # None: the files the config names (the original ones)
    assert publish_table(config, "m", "sparse_embedding0") == sent
    assert len(_stream(stream_redis)) == 2 * sent


def test_a_table_is_published_to_kafka(
        model: Model, kafka_updates: dict[str, Any], rng: np.random.Generator,
        tmp_path: Path) -> None:
    new_rows = rng.standard_normal((model.keys.size, DIM)).astype(np.float32)
    write_table(tmp_path / "retrained", model.keys, new_rows)
    config = model.config({**kafka_updates, "max_batch_size": 1000})
    with HierarchicalParameterServer(config) as server:
        assert publish_table(config, "m", 0, str(tmp_path / "retrained")) == 2
        wait_rows(server, model.keys, new_rows, timeout=40.0)


def test_what_a_consumer_would_skip_is_refused_before_anything_is_sent(
        model: Model, redis_updates: dict[str, Any], stream_redis: RedisServer,
        tmp_path: Path) -> None:
    config = model.config({**redis_updates, "max_batch_size": 2})
    keys = model.keys[:10]
    rows = np.ones((10, DIM), np.float32)
    rows[9, 0] = np.nan
    with pytest.raises(BadUpdateError) as info:
        publish_arrays(config, "m", 0, keys, rows)
    assert info.value.reason == "non_finite"
    with pytest.raises(BadUpdateError) as info:
        publish_arrays(config, "m", 0, keys, np.ones((10, DIM + 1), np.float32))
    assert info.value.reason == "value_size"
    with pytest.raises(BadUpdateError) as info:
        publish_arrays(config, "m", 0, keys.astype(float), np.ones((10, DIM), np.float32))
    with pytest.raises(UnknownTableError):
        publish_arrays(config, "m", "nope", keys, np.ones((10, DIM), np.float32))
    with pytest.raises(UnknownModelError):
        publish_arrays(config, "x", 0, keys, np.ones((10, DIM), np.float32))
    narrow = model.config({**redis_updates}, supportlonglong=False)
    with pytest.raises(BadUpdateError) as info:
        publish_arrays(narrow, "m", 0, np.array([1, 2**32]), np.ones((2, DIM), np.float32))
    assert info.value.reason == "key_range"
    assert _stream(stream_redis) == []


def test_uint32_servers_get_4_byte_keys(
        model: Model, redis_updates: dict[str, Any], stream_redis: RedisServer) -> None:
    narrow = model.config({**redis_updates}, supportlonglong=False)
    publish_arrays(narrow, "m", 0, np.array([7, 2**32 - 1]), np.ones((2, DIM), np.float32))
    client = redis.Redis(port=stream_redis.port)
    [(_, fields)] = client.xrange(TOPIC)
    client.close()
    assert len(fields[b"u"]) == 8 + 2 * (4 + DIM * 4)
    keys, _ = codec.decode(fields[b"u"], dim=DIM, key_bytes=4, uint32_keys=True)
    assert keys.tolist() == [7, 2**32 - 1]


def test_hps_publish_cli(model: Model, redis_updates: dict[str, Any],
                         stream_redis: RedisServer, tmp_path: Path,
                         rng: np.random.Generator) -> None:
    config_path = tmp_path / "ps.json"
    config_path.write_text(json.dumps(model.config({**redis_updates,
                                                    "max_batch_size": 1000})))
    keys = model.keys[:1500]
    rows = rng.standard_normal((1500, DIM)).astype(np.float32)
    np.save(tmp_path / "k.npy", keys)
    np.save(tmp_path / "v.npy", rows)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hps.tools.cli", "publish", str(config_path),
                               *args], cwd=REPO, capture_output=True, text=True, timeout=120)

    done = run("m", "--table", "sparse_embedding0", "--keys", str(tmp_path / "k.npy"),
               "--vectors", str(tmp_path / "v.npy"))
    assert done.returncode == 0, done.stderr
    assert "2 messages published to redis_stream (hps_et.m.sparse_embedding0)" in done.stdout
    done = run("m")  # every table from the config's files
    assert done.returncode == 0, done.stderr
    messages = _stream(stream_redis)
    assert len(messages) == 4
    np.testing.assert_array_equal(messages[1][1], rows[1000:])
    np.testing.assert_array_equal(np.concatenate([k for k, _ in messages[2:]]), model.keys)
    bad = run("m", "--keys", str(tmp_path / "k.npy"), "--vectors", str(tmp_path / "v.npy"))
    assert bad.returncode == 2 and "--table" in bad.stderr
    bad = run("nope")
    assert bad.returncode == 2 and "no model 'nope'" in bad.stderr
