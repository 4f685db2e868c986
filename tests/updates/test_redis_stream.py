"""Online updates from Redis Streams into a served model, against a real redis-server:
a new group, keys out of range, outage and recovery, reloads, the bulk path, a volatile
Redis down. What every source does is in test_sources.py, run over this one too."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from hps import BadUpdateError, HierarchicalParameterServer
from hps.config import UpdateSourceConfig
from hps.server.loader import LoadProgress
from hps.updates import codec
from hps.updates.contract import UpdateMessage, UpdatePublisher
from hps.updates.open import open_publisher
from tests.conftest import write_table
from tests.support.redis_servers import RedisServer, eventually
from tests.updates.conftest import (
    DIM,
    TOPIC,
    Model,
    publish,
    random_rows,
    unchecked_message,
    wait_rows,
    wait_status,
)


def test_a_new_group_starts_from_the_earliest_message(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    rows = [random_rows(rng, 20) for _ in range(3)]
    for part in rows:  # published before any server exists
        publish(redis_publisher, model.keys[:20], part)
    with HierarchicalParameterServer(model.config({**redis_updates, "group": "new"})) as s:
        wait_rows(s, model.keys[:20], rows[-1])
        wait_status(s, lambda st: st["tables"][TOPIC]["messages"] == 3, "three messages")


def test_int64_keys_out_of_range_of_a_uint32_server_are_rejected(
        tmp_path: Any, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = np.arange(100, dtype=np.int64) * 7
    write_table(tmp_path / "u32", keys, random_rows(rng, 100))
    model = Model.__new__(Model)
    model.folder = tmp_path
    config = model.config({**redis_updates, "key_bytes": 8}, supportlonglong=False)
    config["models"][0]["sparse_files"] = [str(tmp_path / "u32")]
    with HierarchicalParameterServer(config) as server:
        before = server.lookup("m", 0, keys[:2])
        publish(redis_publisher, np.array([keys[0], 2**32 + 5]), random_rows(rng, 2))
        fine = random_rows(rng, 1)
        publish(redis_publisher, keys[5:6], fine)
        wait_rows(server, keys[5:6], fine)
        status = server.update_status()
        assert status is not None
        assert status["tables"][TOPIC]["rejected"] == {"key_range": 1}
        np.testing.assert_array_equal(server.lookup("m", 0, keys[:2]), before)


def test_an_outage_is_retried_and_lookups_keep_serving(
        model: Model, stream_redis: RedisServer, redis_updates: dict[str, Any],
        rng: np.random.Generator) -> None:
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        wait_status(server, lambda s: s["state"] == "running", "running")
        stream_redis.kill()
        wait_status(server, lambda s: s["state"] == "down", "the outage seen")
        # serving goes on from the tiers while the source is down
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[:50]),
                                      model.vectors[:50])
        stream_redis.start()  # same port, empty: the streams and groups are gone
        publisher = open_publisher(UpdateSourceConfig(**redis_updates))
        rows = random_rows(rng, 50)
        publish(publisher, model.keys[:50], rows)
        publisher.close()
        wait_rows(server, model.keys[:50], rows)
        status = wait_status(server, lambda s: s["state"] == "running", "recovered")
        assert status["retries"] >= 1 and "Redis" in status["last_error"]


def test_writes_that_succeed_during_an_outage_leave_the_source_down(
        model: Model, stream_redis: RedisServer, redis_updates: dict[str, Any],
        rng: np.random.Generator) -> None:
    """The writer thread applies the batch it holds while the poll finds Redis gone: its
    success says the tiers took the rows, not that the source is back (CI once read
    /readyz "down" and then hps_update_source_up 1 in between)."""
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        wait_status(server, lambda s: s["state"] == "running", "running")
        stream_redis.kill()
        wait_status(server, lambda s: s["state"] == "down", "the outage seen")
        assert server.updates is not None
        consumer = server.updates.consumer
        rows = random_rows(rng, 10)
        held = [UpdateMessage(TOPIC, codec.encode(model.keys[:10], rows), "1-0", None, 0.0)]
        prepared = consumer.applier.prepare(held)  # the batch the writer thread holds
        consumer._retried(lambda: consumer.applier.write(prepared.batches), reaches="tiers")
        prepared.release()
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[:10]), rows)
        assert server.update_status()["state"] == "down"
        stream_redis.start()
        wait_status(server, lambda s: s["state"] == "running", "recovered")


class _PublishDuringLoad(LoadProgress):
    """Publishes updates (and waits until the served version has them) while the
    reload is half way through writing its new version."""

    def __init__(self, act: Any) -> None:
        self.act = act
        self.done = threading.Event()

    def advance(self, keys: int, num_bytes: int) -> None:
        if not self.done.is_set():
            self.act()
            self.done.set()


def test_updates_racing_a_reload_reach_the_new_version(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator, tmp_path: Any) -> None:
    new_vectors = random_rows(rng, model.keys.size)
    write_table(tmp_path / "v2", model.keys, new_vectors)
    early, during, later = random_rows(rng, 40), random_rows(rng, 40), random_rows(rng, 40)
    with HierarchicalParameterServer(model.config(redis_updates),
                                     chunk_bytes=4096) as server:
        publish(redis_publisher, model.keys[:40], early)  # before the reload: files win
        wait_rows(server, model.keys[:40], early)

        def during_load() -> None:
            publish(redis_publisher, model.keys[40:80], during)
            wait_rows(server, model.keys[40:80], during)  # applied to the served version

        progress = _PublishDuringLoad(during_load)
        server.reload_model("m", [str(tmp_path / "v2")], progress=progress)
        assert progress.done.is_set()
        assert server.model("m").tables[0].storage_name.endswith("~next")
        got = server.lookup("m", 0, model.keys[:200])
        np.testing.assert_array_equal(got[:40], new_vectors[:40])
        np.testing.assert_array_equal(got[40:80], during)
        np.testing.assert_array_equal(got[80:], new_vectors[80:200])
        publish(redis_publisher, model.keys[80:120], later)  # after: the new version
        wait_rows(server, model.keys[80:120], later)
        name = server.model("m").tables[0].storage_name
        rows, found = server.persistent.fetch(name, model.keys[40:120])
        assert found.all()
        np.testing.assert_array_equal(rows, np.concatenate([during, later]))


@pytest.mark.parametrize("bad", ["127.0.0.1", "h:x"])
def test_a_bad_address_is_a_config_error(bad: str) -> None:
    from hps.errors import ConfigError

    with pytest.raises(ConfigError, match="update_source.address"):
        open_publisher(UpdateSourceConfig(type="redis_stream", address=bad))


def test_a_large_batch_takes_the_persistent_tiers_bulk_path(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """A round of more than BULK_ROWS rows reaches RocksDB through BulkLoadTier.load (an ingested
    SST file): still the last row of each key, beside the rows it did not touch."""
    from hps.updates.applier import BULK_ROWS

    per_message = 8192
    messages = -(-BULK_ROWS // per_message) + 1
    keys = [rng.integers(0, 30_000, per_message) for _ in range(messages)]
    rows = [random_rows(rng, per_message) for _ in range(messages)]
    # published before the server starts: its new group reads them in one round
    redis_publisher.publish(TOPIC, [codec.encode(k, v) for k, v in
                                    zip(keys, rows, strict=True)])
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        wait_status(server, lambda s: s["tables"][TOPIC]["messages"] == messages,
                    "every message applied")
        last: dict[int, np.ndarray] = {}
        for k, v in zip(keys, rows, strict=True):
            last.update(zip(k.tolist(), v, strict=True))
        want_keys = np.array(sorted(last), dtype=np.int64)
        want = np.stack([last[k] for k in want_keys.tolist()])
        name = server.model("m").tables[0].storage_name
        for tier in (server.persistent, server.volatile):
            got, found = tier.fetch(name, want_keys)
            assert found.all()
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[:100]),
                                      model.vectors[:100])


def test_hps_in_process_takes_updates_and_stops_with_close(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    from hps import HPS

    hps = HPS(model.config(redis_updates))
    rows = random_rows(rng, 8)
    publish(redis_publisher, model.keys[:8], rows)
    eventually(lambda: np.testing.assert_array_equal(hps.lookup(model.keys[:8], "m", 0), rows),
               20.0, "visible through HPS.lookup")
    hps.close()
    assert not any(t.name.startswith("hps-updates") and t.is_alive()
                   for t in threading.enumerate())


def test_an_unloaded_model_is_no_longer_followed(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """Messages of a model not served wait in the stream (neither applied nor rejected):
    loaded again, the model reads them."""
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        rows = random_rows(rng, 4)
        publish(redis_publisher, model.keys[:4], rows)
        wait_rows(server, model.keys[:4], rows)
        config = server.model("m").config
        server.unload_model("m")
        fresh = random_rows(rng, 8)
        publish(redis_publisher, model.keys[:8], fresh)
        status = wait_status(server, lambda s: s["state"] == "running", "running")
        server.load_model(config)
        wait_rows(server, model.keys[:8], fresh)
        status = server.update_status()
        assert status is not None and status["tables"][TOPIC]["rejected"] == {}


def test_a_volatile_redis_outage_holds_the_batch_until_it_is_back(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        redis_server: RedisServer, rng: np.random.Generator) -> None:
    """Redis as the volatile tier goes down: the batch reached RocksDB first (lookups fall
    through to it and see the new rows), the consumer retries the rest with backoff and
    commits only once Redis took it too."""
    config = model.config(redis_updates)
    config["volatile_db"] = {"type": "redis_cluster", "address": redis_server.address,
                             "reconnect_backoff": 0.05, "reconnect_backoff_max": 0.2,
                             "socket_timeout": 1.0}
    with HierarchicalParameterServer(config) as server:
        wait_status(server, lambda s: s["state"] == "running", "running")
        redis_server.kill()
        rows = random_rows(rng, 20)
        publish(redis_publisher, model.keys[:20], rows)
        status = wait_status(server, lambda s: s["state"] == "retrying", "the tier outage")
        assert "TierUnavailableError" in status["last_error"]
        wait_rows(server, model.keys[:20], rows)  # from RocksDB meanwhile
        assert status["tables"].get(TOPIC, {}).get("messages", 0) == 0  # not applied whole
        redis_server.start()  # empty
        wait_status(server, lambda s: s["state"] == "running"
                    and s["tables"][TOPIC]["messages"] == 1, "applied once Redis is back")
        name = server.model("m").tables[0].storage_name
        got, found = server.volatile.fetch(name, model.keys[:20])
        assert found.all()
        np.testing.assert_array_equal(got, rows)


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "int8"])
def test_updates_of_a_compact_table_are_stored_compact_and_checked_for_range(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator, storage: str) -> None:
    from hps.rows.storage_types import decode, encode, storage_type
    from hps.updates.publish import publish_arrays

    keys = np.concatenate([model.keys[:40], np.arange(5, dtype=np.int64)])  # 5 new keys
    rows = random_rows(rng, keys.size) * np.float32(100)
    config = model.config(redis_updates)
    config["models"][0]["embedding_storage_dtype"] = storage
    with HierarchicalParameterServer(config) as server:
        publish(redis_publisher, keys, rows)
        served = decode(storage, encode(storage, rows), DIM)
        wait_rows(server, keys, served)  # the hash map holds them in the storage type
        name = server.model("m").tables[0].storage_name
        got, found = server.persistent.fetch(name, keys)  # RocksDB keeps float32 as sent
        assert found.all()
        np.testing.assert_array_equal(got, rows)
        # a value past the type's range: the consumer skips the message, the publisher
        # refuses it; no row changes
        huge = rows[:3].copy()
        huge[1, 4] = np.float32(min(storage_type(storage).max_magnitude, 3.4e38))
        redis_publisher.publish(TOPIC, [codec.encode(keys[:3], huge)])
        with pytest.raises(BadUpdateError, match=f"its {storage} storage cannot hold"):
            publish_arrays(config, "m", 0, keys[:3], huge, publisher=redis_publisher)
        status = wait_status(
            server, lambda s: s["tables"][TOPIC]["rejected"].get("value_range") == 1,
            "the out-of-range message rejected")
        assert status["state"] == "running"
        np.testing.assert_array_equal(server.lookup("m", 0, keys), served)


def test_a_bad_message_between_good_ones_of_one_round_leaves_no_row_behind(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """The messages of a round share one buffer: a message refused after its rows were
    copied (NaN) is overwritten by the next, and none of its rows reach a tier."""
    first, then = random_rows(rng, 20), random_rows(rng, 5)
    nan_rows = random_rows(rng, 30)
    nan_rows[-1, 0] = np.nan
    # published before the server starts: its new group reads the three in one round
    redis_publisher.publish(TOPIC, [codec.encode(model.keys[:20], first),
                                    unchecked_message(model.keys[100:130], nan_rows),
                                    codec.encode(model.keys[20:25], then)])
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        status = wait_status(server, lambda s: s["tables"].get(TOPIC, {}).get("messages") == 2,
                             "the two good messages applied")
        assert status["tables"][TOPIC]["rejected"] == {"non_finite": 1}
        assert status["tables"][TOPIC]["rows"] == 25
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[:25]),
                                      np.concatenate([first, then]))
        name = server.model("m").tables[0].storage_name
        for tier in (server.volatile, server.persistent):
            got, found = tier.fetch(name, model.keys[100:130])
            assert found.all()
            np.testing.assert_array_equal(got, model.vectors[100:130])


def test_entries_delivered_before_a_failure_are_read_again(
        tmp_path: Any, rng: np.random.Generator) -> None:
    """Redis may log a delivery to the group's pending list and die before its reply
    arrives: `>` never hands those entries out again, so after a failed poll the source
    reads its pending entries first. Here a delivery whose result is dropped stands for
    the lost reply; Redis (with its AOF) is killed and started again."""
    from hps.errors import UpdateSourceUnavailableError
    from hps.updates.redis_stream import RedisStreamSource

    redis_server = RedisServer(tmp_path / "aof", extra=["--appendonly", "yes",
                                                        "--appendfsync", "always"]).start()
    try:
        config = UpdateSourceConfig(type="redis_stream", address=redis_server.address,
                                    poll_timeout_ms=100)
        publisher = open_publisher(config)
        for i in range(3):
            publish(publisher, np.arange(i, i + 1), random_rows(rng, 1))
        publisher.close()
        source = RedisStreamSource(config, "g")
        source.follow({"m": ["sparse_embedding0"]})
        lost = eventually(lambda: _nonempty(source.poll(10, 0.1)), 10.0, "first poll")
        assert source.poll(10, 0.1) == []  # delivered once: `>` has nothing more
        redis_server.kill()
        with pytest.raises(UpdateSourceUnavailableError):
            source.poll(10, 0.1)
        redis_server.start()  # same folder: the stream, group and pending list are back
        again = eventually(lambda: _nonempty(source.poll(10, 0.1)), 10.0, "read again")
        assert [m.position for m in again] == [m.position for m in lost]
        source.commit(again)
        assert source.poll(10, 0.1) == [] and source.backlog() == {TOPIC: 0}
        source.close()
    finally:
        redis_server.close()


def _nonempty(messages: list[Any]) -> list[Any]:
    assert messages
    return messages


def test_a_busy_stream_is_applied_in_paced_rounds_a_quiet_one_at_once(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """`min_round_interval_ms`: messages that arrive within it of the last round wait and
    are applied together in the next one (each round's Python is paid once for them all);
    a message after a quiet spell is read at once. Each message rewrites the same keys,
    so the last one's rows are the ones served."""
    keys = model.keys[:16]
    interval = 1.0
    config = model.config({**redis_updates, "min_round_interval_ms": int(interval * 1000)})
    with HierarchicalParameterServer(config) as server:
        wait_status(server, lambda s: s["state"] == "running", "running")
        first = random_rows(rng, 16)
        publish(redis_publisher, keys, first)
        wait_rows(server, keys, first)
        rows = [random_rows(rng, 16) for _ in range(24)]
        started = time.monotonic()
        for part in rows:  # a busy stream: a message every 20 ms
            publish(redis_publisher, keys, part)
            time.sleep(0.02)
        wait_rows(server, keys, rows[-1])
        spent = time.monotonic() - started
        status = wait_status(server, lambda s: s["tables"][TOPIC]["messages"] == 25,
                             "every message applied")
        busy_writes = status["tables"][TOPIC]["writes"] - 1
        # rounds at least an interval apart while the 24 messages came and were applied
        assert 1 <= busy_writes <= 2 + spent / interval, (spent, status["tables"][TOPIC])

        time.sleep(interval * 1.2)  # quiet for longer than the interval
        last = random_rows(rng, 16)
        started = time.monotonic()
        publish(redis_publisher, keys, last)
        wait_rows(server, keys, last)
        assert time.monotonic() - started < interval  # read at once, not held back


def test_a_backlog_is_applied_in_full_rounds_back_to_back(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """A round that took `max_commit_interval` messages may have left more waiting: the
    next one is not paced, so a backlog drains at full speed whatever the interval."""
    keys = model.keys[:16]
    rows = [random_rows(rng, 16) for _ in range(20)]
    for part in rows:  # published before the server: a backlog of 10 full rounds
        publish(redis_publisher, keys, part)
    interval = 2.0
    config = model.config({**redis_updates, "group": "backlog", "max_commit_interval": 2,
                           "min_round_interval_ms": int(interval * 1000)})
    with HierarchicalParameterServer(config) as server:
        started = time.monotonic()
        status = wait_status(server, lambda s: s["tables"][TOPIC]["messages"] == 20,
                             "the backlog applied", timeout=60.0)
        # paced, its 10 rounds would take 9 intervals
        assert time.monotonic() - started < 3 * interval, status["tables"][TOPIC]
        assert status["tables"][TOPIC]["writes"] == 10
        wait_rows(server, keys, rows[-1])


def test_models_left_take_the_group_off_their_streams(redis_server: RedisServer) -> None:
    """`follow` without a model it followed destroys this group on that model's streams
    (the streams stay, other groups with them); a stream deleted meanwhile has no group
    to leave and is no error (Redis answers that XGROUP needs the key: that failed the
    round, again at every round)."""
    import redis

    from hps.updates.redis_stream import RedisStreamSource

    source = RedisStreamSource(UpdateSourceConfig(type="redis_stream",
                                                  address=redis_server.address), "g1")
    other = RedisStreamSource(UpdateSourceConfig(type="redis_stream",
                                                 address=redis_server.address), "g2")
    client = redis.Redis(host=redis_server.host, port=int(redis_server.address.rsplit(":")[1]))
    try:
        source.follow({"a": ["t", "u"], "b": ["t"]})
        other.follow({"a": ["t"]})
        client.delete("hps_et.a.u")
        source.follow({"b": ["t"]})
        assert client.exists("hps_et.a.t")
        assert [g["name"] for g in client.xinfo_groups("hps_et.a.t")] == [b"g2"]
        assert [g["name"] for g in client.xinfo_groups("hps_et.b.t")] == [b"g1"]
        assert source.leaves_topics
    finally:
        source.close()
        other.close()
        client.close()


def test_entries_of_a_stream_replaced_since_they_were_read_commit_with_the_rest(
        redis_server: RedisServer, rng: np.random.Generator) -> None:
    """A round read entries of two streams, then one stream's key was set to a string
    before the round committed: XACK on it answers WRONGTYPE, which failed the round
    (and the pause after a failed round held every table's updates). The other stream's
    entries are acknowledged; the replaced key has no group left to acknowledge in."""
    import redis

    from hps.updates.redis_stream import RedisStreamSource

    config = UpdateSourceConfig(type="redis_stream", address=redis_server.address)
    source = RedisStreamSource(config, "g")
    client = redis.Redis(host=redis_server.host, port=int(redis_server.address.rsplit(":")[1]))
    try:
        source.follow({"a": ["t", "u"]})
        for table in ("t", "u"):
            client.xadd(f"hps_et.a.{table}", {b"u": codec.encode(np.arange(2),
                                                                 random_rows(rng, 2))})
        read: list[Any] = []

        def both() -> None:
            read.extend(source.poll(10, 0.1))
            assert len(read) == 2

        eventually(both, 10.0, "both entries read")
        client.delete("hps_et.a.u")
        client.set("hps_et.a.u", "not a stream")
        source.commit(read)
        assert client.xpending("hps_et.a.t", "g")["pending"] == 0
        assert source.poll(10, 0.1) == [] and "hps_et.a.u" in source.faults()
    finally:
        source.close()
        client.close()
