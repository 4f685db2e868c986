"""What every update source does, run over each over the wire (the `updates` fixture):
Redis Streams on a real redis-server, Kafka on librdkafka's mock cluster. Rows reach
every tier, the last row of a key wins, a restart resumes after what was committed, what
was not committed comes again, bad messages are skipped and counted, replicas apply
every update, an in-process tier alone replays the log."""

from __future__ import annotations

from typing import Any

import numpy as np

from hps import HierarchicalParameterServer
from hps.config import UpdateSourceConfig
from hps.updates import codec
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_source
from tests.support.redis_servers import eventually
from tests.updates.conftest import (
    SOURCE_NAMES,
    TOPIC,
    Model,
    committed,
    publish,
    random_rows,
    unchecked_message,
    wait_rows,
    wait_status,
)


def test_updates_reach_lookups_and_every_tier(
        model: Model, updates: dict[str, Any], publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = np.concatenate([model.keys[:64], np.arange(10, dtype=np.int64)])  # 10 new keys
    first, second = random_rows(rng, keys.size), random_rows(rng, 32)
    with HierarchicalParameterServer(model.config({**updates, "group": "a"})) as server:
        publish(publisher, keys, first)
        publish(publisher, keys[:32], second)
        expected = np.concatenate([second, first[32:]])
        wait_rows(server, keys, expected)
        name = server.model("m").tables[0].storage_name
        for tier in (server.volatile, server.persistent):
            got, found = tier.fetch(name, keys)
            assert found.all()
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[100:200]),
                                      model.vectors[100:200])
        status = wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                             "lag read back")
        table = status["tables"][TOPIC]
        assert status["state"] == "running"
        assert status["source"] == SOURCE_NAMES[updates["type"]]
        assert table["messages"] == 2 and table["rows"] == keys.size + 32
        assert table["rejected"] == {} and table["last_position"]
    assert committed(updates, "a") == 2


def test_later_rows_of_a_key_win_within_and_across_messages(
        model: Model, updates: dict[str, Any], publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = model.keys[:50]
    first, second, third = random_rows(rng, 50), random_rows(rng, 50), random_rows(rng, 50)
    with HierarchicalParameterServer(model.config(updates)) as server:
        # three messages in one publish: the consumer may take them in one round
        publisher.publish(TOPIC, [codec.encode(keys, first), codec.encode(keys, second),
                                  codec.encode(np.concatenate([keys, keys]),
                                               np.concatenate([first, third]))])
        publisher.flush(10.0)
        wait_rows(server, keys, third)


def test_a_restart_resumes_after_what_it_committed(
        model: Model, updates: dict[str, Any], publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**updates, "group": "resume", "max_commit_interval": 2})
    before, after = random_rows(rng, 300), random_rows(rng, 100)
    with HierarchicalParameterServer(config) as server:
        for i in range(0, 300, 30):  # ten messages, committed two at a time at most
            publish(publisher, model.keys[i:i + 30], before[i:i + 30])
        wait_rows(server, model.keys[:300], before)
        wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0, "caught up")
    # while it is down: new rows for a third of the keys
    for i in range(0, 100, 25):
        publish(publisher, model.keys[i:i + 25], after[i:i + 25])
    with HierarchicalParameterServer(config) as server:
        wait_rows(server, model.keys[:300], np.concatenate([after, before[100:]]))
        status = wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                             "caught up again")
        # resumed after the committed ten: only the four new messages were applied; the
        # rows of the earlier ten came back from RocksDB (the volatile tier is refilled
        # from it, not from the files)
        assert status["tables"][TOPIC]["messages"] == 4
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[300:400]),
                                      model.vectors[300:400])
    assert committed(updates, "resume") == 14


def test_messages_not_committed_are_delivered_again(
        updates: dict[str, Any], publisher: UpdatePublisher, rng: np.random.Generator
) -> None:
    """At-least-once over the wire: a consumer that polled and stopped before committing
    all it took (a crash between apply and commit) leaves its successor in the same group
    the rest, and only the rest."""
    config = UpdateSourceConfig(**updates, group="at-least-once")
    for i in range(3):
        publish(publisher, np.arange(i, i + 1), random_rows(rng, 1))
    first = open_source(config)
    first.follow({"m": ["sparse_embedding0"]})
    got = eventually(lambda: _some(first.poll(2, 0.2)), 30.0, "first poll")
    first.commit(got[:1])
    first.close()  # the rest is not committed
    second = open_source(config)
    second.follow({"m": ["sparse_embedding0"]})
    again: list[Any] = []

    def the_rest() -> None:
        again.extend(second.poll(3, 0.2))
        assert len(again) >= 2

    eventually(the_rest, 30.0, "the uncommitted messages again")
    positions = [m.position for m in again]
    assert len(positions) == 2 and got[0].position not in positions
    assert positions[:len(got) - 1] == [m.position for m in got[1:]]
    second.commit(again)
    assert second.backlog() == {TOPIC: 0}
    second.close()


def _some(messages: list[Any]) -> list[Any]:
    assert messages
    return messages


def test_bad_messages_are_skipped_counted_and_change_no_row(
        model: Model, updates: dict[str, Any], publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = model.keys[:10]
    good = codec.encode(keys, random_rows(rng, 10))
    nan_rows = random_rows(rng, 10)
    nan_rows[3, 2] = np.nan
    inf_rows = random_rows(rng, 10)
    inf_rows[0, 0] = np.inf
    bad = {
        "magic": b"XCTR" + good[4:],
        "value_size": codec.encode(keys, random_rows(rng, 10)[:, :4]),
        "truncated": good[:-3],
    }
    with HierarchicalParameterServer(model.config(updates)) as server:
        publisher.publish(TOPIC, list(bad.values()))
        publisher.publish(TOPIC, [unchecked_message(keys, nan_rows),
                                  unchecked_message(keys, inf_rows),
                                  b"", b"HC"])
        publisher.publish("hps_et.m.no_such_table", [good])
        last = random_rows(rng, 5)
        publish(publisher, model.keys[10:15], last)  # a good one after the bad
        wait_rows(server, model.keys[10:15], last)
        # the topic is found (and shown) before its message is read and rejected
        status = wait_status(
            server, lambda s: bool(s["tables"].get("hps_et.m.no_such_table", {}).get("rejected")),
            "the message of an unknown table's topic rejected", timeout=40.0)
        np.testing.assert_array_equal(server.lookup("m", 0, keys), model.vectors[:10])
        assert status["tables"][TOPIC]["rejected"] == {
            "magic": 1, "value_size": 1, "truncated": 3, "non_finite": 2}
        assert status["tables"]["hps_et.m.no_such_table"]["rejected"] == {"unknown_table": 1}
        assert status["state"] == "running"


def test_two_replicas_with_groups_of_their_own_each_apply_every_update(
        model: Model, updates: dict[str, Any], publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """Each replica reads with a consumer group of its own and writes its own tiers (and
    GPU caches): both serve every update."""
    a = model.config({**updates, "group": "replica-a"}, rocksdb=False)
    b = model.config({**updates, "group": "replica-b"}, rocksdb=False)
    with HierarchicalParameterServer(a) as first, HierarchicalParameterServer(b) as second:
        published = [random_rows(rng, 30) for _ in range(5)]
        for i, part in enumerate(published):
            publish(publisher, model.keys[i * 30:(i + 1) * 30], part)
        for server in (first, second):
            wait_rows(server, model.keys[:150], np.concatenate(published), timeout=40.0)
            status = wait_status(server, lambda s: s["tables"][TOPIC]["messages"] == 5,
                                 "all five messages")
            assert status["tables"][TOPIC]["rows"] == 150


def test_an_in_process_tier_alone_replays_the_log_at_a_restart(
        model: Model, updates: dict[str, Any], publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**updates, "group": "memory-only"}, rocksdb=False)
    published = random_rows(rng, 40)
    with HierarchicalParameterServer(config) as server:
        publish(publisher, model.keys[:40], published)
        wait_rows(server, model.keys[:40], published, timeout=40.0)
        wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0, "committed")
    # the offset is committed, but the hash map starts empty: the log is read again
    with HierarchicalParameterServer(config) as server:
        wait_rows(server, model.keys[:40], published, timeout=40.0)
