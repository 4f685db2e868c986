"""Online updates from Kafka, over the wire: librdkafka's mock cluster speaks the Kafka
protocol on a loopback port; the server's consumer joins its group there, consumes and
commits offsets like against any broker. What every source does is in test_sources.py,
run over this one too; here, what only Kafka shows: every broker gone at once."""

from __future__ import annotations

from typing import Any

import numpy as np

from hps import HierarchicalParameterServer
from hps.updates import codec
from tests.updates.conftest import TOPIC, Model, random_rows, wait_status


def test_brokers_gone_is_an_outage_and_lookups_go_on(
        model: Model, kafka_updates: dict[str, Any], rng: np.random.Generator) -> None:
    """The mock cluster lives in the process of its producer: closing that one takes every
    broker away, as an outage does (recovery: the next test)."""
    import confluent_kafka as ck

    from tests.updates.conftest import mock_cluster

    with mock_cluster() as (brokers, holder):
        config = model.config({**kafka_updates, "brokers": brokers, "group": "outage"})
        with HierarchicalParameterServer(config) as server:
            publisher = ck.Producer({"bootstrap.servers": brokers})
            publisher.produce(TOPIC, codec.encode(model.keys[:5], random_rows(rng, 5)), partition=0)
            publisher.flush(10.0)
            wait_status(server, lambda s: s["tables"].get(TOPIC, {}).get("messages") == 1,
                        "applied", timeout=40.0)
            holder.close()  # every broker goes away
            wait_status(server, lambda s: s["state"] == "down", "the outage seen",
                        timeout=60.0)
            np.testing.assert_array_equal(server.lookup("m", 0, model.keys[10:60]),
                                          model.vectors[10:60])


def test_a_broker_down_and_up_again_is_an_outage_then_recovery(
        model: Model, rng: np.random.Generator) -> None:
    """The broker goes down (connections closed, new ones refused) and comes back on the
    same port: the source is down meanwhile and lookups go on, then updates published
    after it came back arrive, and what was committed before is not applied again."""
    from hps.config import UpdateSourceConfig
    from hps.updates.open import open_publisher
    from tests.updates.conftest import MockBrokers, publish, wait_rows

    with MockBrokers() as mock:
        mock.create_topic(TOPIC)
        updates = {"type": "kafka_message_queue", "brokers": mock.address,
                   "kafka_options": {"session.timeout.ms": 6000,
                                     "heartbeat.interval.ms": 500}}
        config = model.config({**updates, "group": "recovery"})
        with HierarchicalParameterServer(config) as server:
            publisher = open_publisher(UpdateSourceConfig(**updates))
            before = random_rows(rng, 20)
            publish(publisher, model.keys[:20], before)
            wait_rows(server, model.keys[:20], before, timeout=40.0)
            wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                        "committed", timeout=40.0)
            mock.down()
            status = wait_status(server, lambda s: s["state"] == "down", "the outage seen",
                                 timeout=60.0)
            assert "Kafka at" in status["last_error"]
            np.testing.assert_array_equal(server.lookup("m", 0, model.keys[:40]),
                                          np.concatenate([before, model.vectors[20:40]]))
            mock.up()
            after = random_rows(rng, 20)
            publish(publisher, model.keys[10:30], after)
            wait_rows(server, model.keys[:30], np.concatenate([before[:10], after]),
                      timeout=60.0)
            status = wait_status(server, lambda s: s["state"] == "running"
                                 and s["tables"][TOPIC]["lag_messages"] == 0,
                                 "recovered", timeout=60.0)
            assert status["tables"][TOPIC]["messages"] == 2 and status["retries"] >= 1
            publisher.close()
