"""Fixtures of the update tests: a model on disk, servers that read updates from a real
`redis-server` (Redis Streams) or librdkafka's mock Kafka cluster, and a publisher."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import HierarchicalParameterServer
from hps.config import UpdateSourceConfig
from hps.updates import codec
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_publisher
from tests.conftest import make_table, model_config, write_table
from tests.support.redis_servers import RedisServer, eventually

DIM = 8
TOPIC = "hps_et.m.sparse_embedding0"


class Model:
    """One table of DIM on disk, and a way to publish and wait for its updates."""

    def __init__(self, folder: Path, rng: np.random.Generator, n: int = 2000) -> None:
        self.folder = folder
        self.keys, self.vectors = make_table(rng, n, DIM)
        write_table(folder / "t0", self.keys, self.vectors)

    def config(self, update_source: dict[str, Any], *, rocksdb: bool = True,
               **top: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "models": [model_config([str(self.folder / "t0")], [DIM])],
            "volatile_db": {"type": "hash_map"},
            "update_source": {"poll_timeout_ms": 100, "metadata_refresh_interval_ms": 200,
                              "failure_backoff_ms": 20, "failure_backoff_max_ms": 200,
                              **update_source},
            **top,
        }
        if rocksdb:
            config["persistent_db"] = {"type": "rocks_db", "path": str(self.folder / "rocks")}
        return config


#: the name each source type has in the update status
SOURCE_NAMES = {"redis_stream": "redis_stream", "kafka_message_queue": "kafka"}


def random_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` random float32 rows of DIM."""
    return rng.standard_normal((n, DIM)).astype(np.float32)


def publish(publisher: UpdatePublisher, keys: np.ndarray, vectors: np.ndarray,
            topic: str = TOPIC, key_bytes: int = 8) -> None:
    publisher.publish(topic, [codec.encode(keys, vectors, key_bytes=key_bytes)])
    publisher.flush(10.0)


def unchecked_message(keys: np.ndarray, vectors: np.ndarray) -> bytes:
    """A message the codec would refuse to encode (NaN rows), built from its layout."""
    records = np.empty(keys.size, dtype=[("key", "<i8"), ("vec", "<f4", (vectors.shape[1],))])
    records["key"], records["vec"] = keys, vectors
    return b"HCTR" + np.uint32(vectors.shape[1] * 4).tobytes() + records.tobytes()


def wait_rows(server: HierarchicalParameterServer, keys: np.ndarray, vectors: np.ndarray,
              timeout: float = 20.0) -> None:
    """Wait until lookups of `keys` answer `vectors`."""
    def check() -> None:
        np.testing.assert_array_equal(server.lookup("m", 0, keys), vectors)

    eventually(check, timeout, "updated rows visible to lookups")


def wait_status(server: HierarchicalParameterServer, test: Callable[[dict[str, Any]], bool],
                what: str, timeout: float = 20.0) -> dict[str, Any]:
    def check() -> dict[str, Any]:
        status = server.update_status()
        assert status is not None and test(status), status
        return status

    return eventually(check, timeout, what)


@pytest.fixture
def model(tmp_path: Path, rng: np.random.Generator) -> Model:
    return Model(tmp_path, rng)


@pytest.fixture
def stream_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The Redis that carries the update streams (the tiers are in-process)."""
    server = RedisServer(tmp_path_factory.mktemp("redis-streams")).start()
    yield server
    server.close()


@pytest.fixture
def redis_updates(stream_redis: RedisServer) -> dict[str, Any]:
    return {"type": "redis_stream", "address": f"127.0.0.1:{stream_redis.port}"}


@contextmanager
def _publisher(updates: dict[str, Any]) -> Iterator[UpdatePublisher]:
    publisher = open_publisher(UpdateSourceConfig(**updates))
    try:
        yield publisher
    finally:
        publisher.close()


@pytest.fixture
def redis_publisher(redis_updates: dict[str, Any]) -> Iterator[UpdatePublisher]:
    with _publisher(redis_updates) as publisher:
        yield publisher


@pytest.fixture
def kafka_publisher(kafka_updates: dict[str, Any]) -> Iterator[UpdatePublisher]:
    with _publisher(kafka_updates) as publisher:
        yield publisher


@pytest.fixture(params=["redis_stream", "kafka_message_queue"])
def updates(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The update_source block of each source in turn, on a broker of the test's own: a
    real redis-server, librdkafka's mock Kafka cluster."""
    kind = "redis" if request.param == "redis_stream" else "kafka"
    return request.getfixturevalue(f"{kind}_updates")  # type: ignore[no-any-return]


@pytest.fixture
def publisher(updates: dict[str, Any]) -> Iterator[UpdatePublisher]:
    with _publisher(updates) as publisher:
        yield publisher


def committed(updates: dict[str, Any], group: str) -> int:
    """Messages of TOPIC that consumer group `group` has committed, asked of the broker:
    Kafka's committed offset, or the entries a Redis group read and acknowledged."""
    if updates["type"] == "kafka_message_queue":
        import confluent_kafka as ck

        consumer = ck.Consumer({"bootstrap.servers": updates["brokers"], "group.id": group})
        try:
            [tp] = consumer.committed([ck.TopicPartition(TOPIC, 0)], timeout=10.0)
            return int(tp.offset)
        finally:
            consumer.close()
    import redis

    host, port = updates["address"].rsplit(":", 1)
    with redis.Redis(host=host, port=int(port), decode_responses=True) as client:
        [info] = [g for g in client.xinfo_groups(TOPIC) if g["name"] == group]
        return int(info["entries-read"]) - int(info["pending"])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def mock_cluster() -> Iterator[tuple[str, Any]]:
    """librdkafka's mock cluster (the real Kafka protocol on a loopback port): its
    bootstrap address, read from the mock's debug log line, and the producer that holds
    it (the cluster lives until that one is closed)."""
    import confluent_kafka as ck  # the test extra installs it

    handler = _Lines()
    logger = logging.getLogger(f"tests.kafka-mock.{id(handler)}")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    holder = ck.Producer({"bootstrap.servers": "unused:9092", "test.mock.num.brokers": 1,
                          "logger": logger, "debug": "mock"})

    def address() -> str:
        holder.poll(0.05)
        found = [m for line in handler.lines
                 if (m := re.search(r"bootstrap\.servers=(127\.0\.0\.1:\d+)", line))]
        assert found, handler.lines
        return found[0].group(1)

    try:
        yield eventually(address, 10.0, "the mock Kafka cluster's address"), holder
    finally:
        with suppress(RuntimeError):  # a test closed it (an outage)
            holder.flush(1.0)
        logger.removeHandler(handler)


class MockBrokers:
    """librdkafka's mock cluster made through its C API (rdkafka_mock.h) in the
    librdkafka that confluent-kafka loaded: the same brokers as `test.mock.num.brokers`
    (the Kafka protocol on a loopback port), whose brokers can also be taken down
    (connections closed, new ones refused) and brought up again on the same port, which
    confluent-kafka's Python API cannot do. Use as a context manager."""

    def __init__(self, brokers: int = 1) -> None:
        import ctypes

        import confluent_kafka  # noqa: F401 - loads librdkafka into the process

        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "librdkafka" in line)
        lib = self._lib = ctypes.CDLL(path)
        pointer, broker = ctypes.c_void_p, ctypes.c_int32
        lib.rd_kafka_conf_new.restype = pointer
        lib.rd_kafka_new.restype = pointer
        lib.rd_kafka_new.argtypes = [ctypes.c_int, pointer, ctypes.c_char_p, ctypes.c_size_t]
        lib.rd_kafka_destroy.argtypes = [pointer]
        lib.rd_kafka_mock_cluster_new.restype = pointer
        lib.rd_kafka_mock_cluster_new.argtypes = [pointer, ctypes.c_int]
        lib.rd_kafka_mock_cluster_destroy.argtypes = [pointer]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [pointer]
        lib.rd_kafka_mock_topic_create.argtypes = [pointer, ctypes.c_char_p, ctypes.c_int,
                                                   ctypes.c_int]
        for name in ("rd_kafka_mock_broker_set_down", "rd_kafka_mock_broker_set_up"):
            getattr(lib, name).argtypes = [pointer, broker]
        error = ctypes.create_string_buffer(512)
        # a client handle of its own (a producer that sends nothing) owns the cluster
        self._client = lib.rd_kafka_new(0, lib.rd_kafka_conf_new(), error, len(error))
        assert self._client, error.value
        self._cluster = lib.rd_kafka_mock_cluster_new(self._client, brokers)
        assert self._cluster
        self.address: str = lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()

    def create_topic(self, topic: str, partitions: int = 1) -> None:
        assert self._lib.rd_kafka_mock_topic_create(self._cluster, topic.encode(),
                                                    partitions, 1) == 0

    def down(self, broker: int = 1) -> None:
        assert self._lib.rd_kafka_mock_broker_set_down(self._cluster, broker) == 0

    def up(self, broker: int = 1) -> None:
        assert self._lib.rd_kafka_mock_broker_set_up(self._cluster, broker) == 0

    def __enter__(self) -> MockBrokers:
        return self

    def __exit__(self, *exc: object) -> None:
        self._lib.rd_kafka_mock_cluster_destroy(self._cluster)
        self._lib.rd_kafka_destroy(self._client)


@pytest.fixture
def kafka_cluster() -> Iterator[str]:
    """The bootstrap address of a mock Kafka cluster of the test's own."""
    with mock_cluster() as (address, _):
        yield address


@pytest.fixture
def kafka_updates(kafka_cluster: str) -> dict[str, Any]:
    # the mock's group coordinator waits a session timeout before it rebalances onto a
    # topic that appeared after the subscription; a short one keeps the tests short
    return {"type": "kafka_message_queue", "brokers": kafka_cluster,
            "kafka_options": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}}
