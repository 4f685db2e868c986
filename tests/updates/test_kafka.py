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
    broker away, as an outage does (a new mock would listen elsewhere, so recovery is
    shown on Redis Streams in test_redis_stream.py)."""
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
