"""Online updates from Kafka, over the wire: librdkafka's mock cluster speaks the Kafka
protocol on a loopback port; the server's consumer joins its group there, consumes and
commits offsets like against any broker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hps import HierarchicalParameterServer
from hps.config import UpdateSourceConfig
from hps.updates import codec
from hps.updates.kafka import KafkaSource
from hps.updates.source import UpdatePublisher, open_publisher
from tests.redis_servers import eventually
from tests.updates.conftest import DIM, TOPIC, Model, publish, wait_rows, wait_status


@pytest.fixture
def kafka_publisher(kafka_updates: dict[str, Any]) -> Iterator[UpdatePublisher]:
    publisher = open_publisher(UpdateSourceConfig(**kafka_updates))
    yield publisher
    publisher.close()


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, DIM)).astype(np.float32)


def _committed(brokers: str, group: str) -> int:
    import confluent_kafka as ck

    consumer = ck.Consumer({"bootstrap.servers": brokers, "group.id": group})
    try:
        [tp] = consumer.committed([ck.TopicPartition(TOPIC, 0)], timeout=10.0)
        return int(tp.offset)
    finally:
        consumer.close()


def test_updates_reach_every_tier_and_offsets_are_committed(
        model: Model, kafka_updates: dict[str, Any], kafka_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**kafka_updates, "group": "replica-a"})
    keys = model.keys[:64]
    first, second = _rows(rng, 64), _rows(rng, 64)
    with HierarchicalParameterServer(config) as server:
        publish(kafka_publisher, keys, first)
        publish(kafka_publisher, keys[:32], second[:32])
        expected = np.concatenate([second[:32], first[32:]])
        wait_rows(server, keys, expected)
        name = server.model("m").tables[0].storage_name
        for tier in (server.volatile, server.persistent):
            got, found = tier.fetch(name, keys)
            assert found.all()
            np.testing.assert_array_equal(got, expected)
        status = wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                             "no lag")
        table = status["tables"][TOPIC]
        assert status["source"] == "kafka" and status["state"] == "running"
        assert table["messages"] == 2 and table["last_offset"] == 1
        assert table["last_position"] == "0:1"
    assert _committed(kafka_updates["brokers"], "replica-a") == 2


def test_a_restart_resumes_from_the_committed_offset(
        model: Model, kafka_updates: dict[str, Any], kafka_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**kafka_updates, "group": "resume"})
    before, after = _rows(rng, 90), _rows(rng, 30)
    with HierarchicalParameterServer(config) as server:
        for i in range(0, 90, 30):
            publish(kafka_publisher, model.keys[i:i + 30], before[i:i + 30])
        wait_rows(server, model.keys[:90], before)
        wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0, "caught up")
    publish(kafka_publisher, model.keys[:30], after)  # while it is down
    with HierarchicalParameterServer(config) as server:
        wait_rows(server, model.keys[:90], np.concatenate([after, before[30:]]))
        status = wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                             "caught up again")
        assert status["tables"][TOPIC]["messages"] == 1  # only the one published since
    assert _committed(kafka_updates["brokers"], "resume") == 4


def test_a_message_not_committed_is_consumed_again(
        kafka_updates: dict[str, Any], kafka_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = UpdateSourceConfig(**kafka_updates)
    for i in range(3):
        publish(kafka_publisher, np.arange(i, i + 1), _rows(rng, 1))
    first = KafkaSource(config, "at-least-once")
    first.follow({"m": ["sparse_embedding0"]})
    got = eventually(lambda: _some(first.poll(3, 0.2)), 30.0, "first poll")
    first.commit(got[:1])
    first.close()  # the rest is not committed: a crash between apply and commit
    second = KafkaSource(config, "at-least-once")
    second.follow({"m": ["sparse_embedding0"]})
    again = eventually(lambda: _some(second.poll(3, 0.2)), 30.0, "second poll")
    assert [m.offset for m in again] == [m.offset for m in got[1:]]
    second.commit(again)
    assert second.backlog() == {TOPIC: 0}
    second.close()


def _some(messages: list[Any]) -> list[Any]:
    assert messages
    return messages


def test_bad_messages_and_unknown_tables_are_skipped(
        model: Model, kafka_updates: dict[str, Any], kafka_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = model.keys[:10]
    good = codec.encode(keys, _rows(rng, 10))
    with HierarchicalParameterServer(model.config(kafka_updates)) as server:
        kafka_publisher.publish(TOPIC, [b"XCTR" + good[4:], good[:-1],
                                        codec.encode(keys, _rows(rng, 10)[:, :2])])
        kafka_publisher.publish("hps_et.m.no_such_table", [good])
        kafka_publisher.flush(10.0)
        fine = _rows(rng, 5)
        publish(kafka_publisher, model.keys[10:15], fine)
        wait_rows(server, model.keys[10:15], fine)
        status = wait_status(server, lambda s: "hps_et.m.no_such_table" in s["tables"],
                             "the topic of an unknown table found", timeout=40.0)
        np.testing.assert_array_equal(server.lookup("m", 0, keys), model.vectors[:10])
        assert status["tables"][TOPIC]["rejected"] == {
            "magic": 1, "truncated": 1, "value_size": 1}
        assert status["tables"]["hps_et.m.no_such_table"]["rejected"] == {"unknown_table": 1}


def test_two_replicas_with_groups_of_their_own_both_apply(
        model: Model, kafka_updates: dict[str, Any], kafka_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    rows = _rows(rng, 40)
    a = model.config({**kafka_updates, "group": "a"}, rocksdb=False)
    b = model.config({**kafka_updates, "group": "b"}, rocksdb=False)
    with HierarchicalParameterServer(a) as first, HierarchicalParameterServer(b) as second:
        publish(kafka_publisher, model.keys[:40], rows)
        for server in (first, second):
            wait_rows(server, model.keys[:40], rows, timeout=40.0)


def test_an_in_process_tier_alone_replays_the_topic_at_a_restart(
        model: Model, kafka_updates: dict[str, Any], kafka_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**kafka_updates, "group": "memory-only"}, rocksdb=False)
    rows = _rows(rng, 40)
    with HierarchicalParameterServer(config) as server:
        publish(kafka_publisher, model.keys[:40], rows)
        wait_rows(server, model.keys[:40], rows, timeout=40.0)
        wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0, "committed")
    # the offset is committed, but the hash map starts empty: the topic is read again
    with HierarchicalParameterServer(config) as server:
        wait_rows(server, model.keys[:40], rows, timeout=40.0)


def test_brokers_gone_is_an_outage_and_lookups_go_on(
        model: Model, kafka_updates: dict[str, Any], rng: np.random.Generator) -> None:
    """The mock cluster lives in the process of its producer: closing that one takes every
    broker away, as an outage does (a new mock would listen elsewhere, so recovery is
    shown on Redis Streams in test_redis_stream.py)."""
    import confluent_kafka as ck

    from tests.updates.conftest import mock_cluster

    with mock_cluster() as (brokers, holder):
        config = model.config({**kafka_updates, "brokers": brokers, "group": "outage"})
        with HierarchicalParameterServer(config) as server:
            publisher = ck.Producer({"bootstrap.servers": brokers})
            publisher.produce(TOPIC, codec.encode(model.keys[:5], _rows(rng, 5)), partition=0)
            publisher.flush(10.0)
            wait_status(server, lambda s: s["tables"].get(TOPIC, {}).get("messages") == 1,
                        "applied", timeout=40.0)
            holder.close()  # every broker goes away
            wait_status(server, lambda s: s["state"] == "down", "the outage seen",
                        timeout=60.0)
            np.testing.assert_array_equal(server.lookup("m", 0, model.keys[10:60]),
                                          model.vectors[10:60])
