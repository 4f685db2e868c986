"""Online updates from Redis Streams into a served model, against a real redis-server:
every tier, restart mid-stream, bad messages, outage and recovery, two replicas, reloads."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from hps import HierarchicalParameterServer
from hps.config import UpdateSourceConfig
from hps.loader import LoadProgress
from hps.updates import codec
from hps.updates.redis_stream import RedisStreamSource
from hps.updates.source import UpdatePublisher, open_publisher
from tests.conftest import write_table
from tests.redis_servers import RedisServer, eventually
from tests.updates.conftest import DIM, TOPIC, Model, publish, wait_rows, wait_status


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, DIM)).astype(np.float32)


def test_an_update_reaches_lookups_and_every_tier(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = np.concatenate([model.keys[:100], np.arange(10, dtype=np.int64)])  # 10 new keys
    rows = _rows(rng, keys.size)
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        publish(redis_publisher, keys, rows)
        wait_rows(server, keys, rows)
        name = server.model("m").tables[0].storage_name
        for tier in (server.volatile, server.persistent):
            got, found = tier.fetch(name, keys)
            assert found.all()
            np.testing.assert_array_equal(got, rows)
        untouched = server.lookup("m", 0, model.keys[100:200])
        np.testing.assert_array_equal(untouched, model.vectors[100:200])
        status = wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                             "lag read back")
        table = status["tables"][TOPIC]
        assert status["state"] == "running" and status["source"] == "redis_stream"
        assert table["rows"] == keys.size and table["messages"] == 1
        assert table["rejected"] == {} and table["last_position"].endswith("-0")


def test_later_rows_of_a_key_win_within_and_across_messages(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = model.keys[:50]
    first, second, third = _rows(rng, 50), _rows(rng, 50), _rows(rng, 50)
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        # three messages in one XADD pipeline: the consumer takes them in one round
        redis_publisher.publish(TOPIC, [codec.encode(keys, first), codec.encode(keys, second),
                                        codec.encode(np.concatenate([keys, keys]),
                                                     np.concatenate([first, third]))])
        wait_rows(server, keys, third)


def test_a_new_group_starts_from_the_earliest_message(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    rows = [_rows(rng, 20) for _ in range(3)]
    for part in rows:  # published before any server exists
        publish(redis_publisher, model.keys[:20], part)
    with HierarchicalParameterServer(model.config({**redis_updates, "group": "new"})) as s:
        wait_rows(s, model.keys[:20], rows[-1])
        wait_status(s, lambda st: st["tables"][TOPIC]["messages"] == 3, "three messages")


def test_a_restart_resumes_after_what_it_committed(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**redis_updates, "group": "replica-a", "max_commit_interval": 2})
    before, after = _rows(rng, 300), _rows(rng, 100)
    with HierarchicalParameterServer(config) as server:
        for i in range(0, 300, 30):  # ten messages, applied two per round
            publish(redis_publisher, model.keys[i:i + 30], before[i:i + 30])
        wait_rows(server, model.keys[:300], before)
    # while it is down: new rows for a third of the keys
    for i in range(0, 100, 25):
        publish(redis_publisher, model.keys[i:i + 25], after[i:i + 25])
    with HierarchicalParameterServer(config) as server:
        expected = np.concatenate([after, before[100:]])
        wait_rows(server, model.keys[:300], expected)
        status = wait_status(server, lambda s: s["tables"][TOPIC]["lag_messages"] == 0,
                             "caught up")
        # resumed after the committed ten: only the four new messages were applied; the
        # rows of the earlier ten came back from RocksDB (the volatile tier is refilled
        # from it, not from the files)
        assert status["tables"][TOPIC]["messages"] == 4
        np.testing.assert_array_equal(server.lookup("m", 0, model.keys[300:400]),
                                      model.vectors[300:400])


def test_an_in_process_tier_alone_replays_the_log_at_a_restart(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    config = model.config({**redis_updates, "group": "memory-only"}, rocksdb=False)
    rows = _rows(rng, 40)
    with HierarchicalParameterServer(config) as server:
        publish(redis_publisher, model.keys[:40], rows)
        wait_rows(server, model.keys[:40], rows)
    # the hash map starts empty again: the committed position would skip these rows
    with HierarchicalParameterServer(config) as server:
        wait_rows(server, model.keys[:40], rows)


def test_entries_not_acknowledged_are_delivered_again(
        redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    """At-least-once over the wire: a consumer that polled and stopped before committing
    (a crash between apply and commit) gives its successor the same entries."""
    config = UpdateSourceConfig(**redis_updates, poll_timeout_ms=100)
    for i in range(3):
        publish(redis_publisher, np.arange(i, i + 1), _rows(rng, 1))
    first = RedisStreamSource(config, "g")
    first.follow({"m": ["sparse_embedding0"]})
    got = eventually(lambda: _nonempty(first.poll(2, 0.1)), 10.0, "first poll")
    first.close()  # no commit
    second = RedisStreamSource(config, "g")
    second.follow({"m": ["sparse_embedding0"]})
    again = second.poll(10, 0.1)
    assert [m.position for m in again] == [m.position for m in got]
    second.commit(again)
    rest = second.poll(10, 0.1)
    assert len(rest) == 1 and rest[0].position not in {m.position for m in got}
    second.commit(rest)
    assert second.backlog() == {TOPIC: 0}
    second.close()


def _nonempty(messages: list[Any]) -> list[Any]:
    assert messages
    return messages


def test_bad_messages_are_skipped_counted_and_change_no_row(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = model.keys[:10]
    good = codec.encode(keys, _rows(rng, 10))
    nan_rows = _rows(rng, 10)
    nan_rows[3, 2] = np.nan
    inf_rows = _rows(rng, 10)
    inf_rows[0, 0] = np.inf
    bad = {
        "magic": b"XCTR" + good[4:],
        "value_size": codec.encode(keys, _rows(rng, 10)[:, :4]),
        "truncated": good[:-3],
    }
    with HierarchicalParameterServer(model.config(redis_updates)) as server:
        redis_publisher.publish(TOPIC, list(bad.values()))
        redis_publisher.publish(TOPIC, [_unchecked(keys, nan_rows), _unchecked(keys, inf_rows),
                                        b"", b"HC"])
        redis_publisher.publish("hps_et.m.no_such_table", [good])
        last = _rows(rng, 5)
        publish(redis_publisher, model.keys[10:15], last)  # a good one after the bad
        wait_rows(server, model.keys[10:15], last)
        status = wait_status(
            server, lambda s: "hps_et.m.no_such_table" in s["tables"], "unknown table seen")
        np.testing.assert_array_equal(server.lookup("m", 0, keys), model.vectors[:10])
        assert status["tables"][TOPIC]["rejected"] == {
            "magic": 1, "value_size": 1, "truncated": 3, "non_finite": 2}
        assert status["tables"]["hps_et.m.no_such_table"]["rejected"] == {"unknown_table": 1}
        assert status["state"] == "running"


def _unchecked(keys: np.ndarray, vectors: np.ndarray) -> bytes:
    """A message the codec would refuse to encode (NaN rows), built from its layout."""
    records = np.empty(keys.size, dtype=[("key", "<i8"), ("vec", "<f4", (vectors.shape[1],))])
    records["key"], records["vec"] = keys, vectors
    return b"HCTR" + np.uint32(vectors.shape[1] * 4).tobytes() + records.tobytes()


def test_int64_keys_out_of_range_of_a_uint32_server_are_rejected(
        tmp_path: Any, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator) -> None:
    keys = np.arange(100, dtype=np.int64) * 7
    write_table(tmp_path / "u32", keys, _rows(rng, 100))
    model = Model.__new__(Model)
    model.folder = tmp_path
    config = model.config({**redis_updates, "key_bytes": 8}, supportlonglong=False)
    config["models"][0]["sparse_files"] = [str(tmp_path / "u32")]
    with HierarchicalParameterServer(config) as server:
        before = server.lookup("m", 0, keys[:2])
        publish(redis_publisher, np.array([keys[0], 2**32 + 5]), _rows(rng, 2))
        fine = _rows(rng, 1)
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
        rows = _rows(rng, 50)
        publish(publisher, model.keys[:50], rows)
        publisher.close()
        wait_rows(server, model.keys[:50], rows)
        status = wait_status(server, lambda s: s["state"] == "running", "recovered")
        assert status["retries"] >= 1 and "Redis" in status["last_error"]


def test_two_replicas_on_one_redis_each_apply_every_update(
        model: Model, redis_updates: dict[str, Any], redis_publisher: UpdatePublisher,
        rng: np.random.Generator, tmp_path: Any) -> None:
    """Each replica reads with a consumer group of its own and writes its own tiers (and
    GPU caches): both serve every update."""
    a = model.config({**redis_updates, "group": "replica-a"}, rocksdb=False)
    b = model.config({**redis_updates, "group": "replica-b"}, rocksdb=False)
    with HierarchicalParameterServer(a) as first, HierarchicalParameterServer(b) as second:
        for i in range(5):
            rows = _rows(rng, 30)
            publish(redis_publisher, model.keys[i * 30:(i + 1) * 30], rows)
        final = server_rows = None
        for server in (first, second):
            wait_rows(server, model.keys[120:150], rows)
            server_rows = server.lookup("m", 0, model.keys[:150])
            if final is None:
                final = server_rows
            np.testing.assert_array_equal(server_rows, final)
            status = wait_status(server, lambda s: s["tables"][TOPIC]["messages"] == 5,
                                 "all five messages")
            assert status["tables"][TOPIC]["rows"] == 150


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
    new_vectors = _rows(rng, model.keys.size)
    write_table(tmp_path / "v2", model.keys, new_vectors)
    early, during, later = _rows(rng, 40), _rows(rng, 40), _rows(rng, 40)
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
    """A round of more than BULK_ROWS rows reaches RocksDB through Tier.load (an ingested
    SST file): still the last row of each key, beside the rows it did not touch."""
    from hps.updates.applier import BULK_ROWS

    per_message = 8192
    messages = -(-BULK_ROWS // per_message) + 1
    keys = [rng.integers(0, 30_000, per_message) for _ in range(messages)]
    rows = [_rows(rng, per_message) for _ in range(messages)]
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
    rows = _rows(rng, 8)
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
        rows = _rows(rng, 4)
        publish(redis_publisher, model.keys[:4], rows)
        wait_rows(server, model.keys[:4], rows)
        config = server.model("m").config
        server.unload_model("m")
        fresh = _rows(rng, 8)
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
        rows = _rows(rng, 20)
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
