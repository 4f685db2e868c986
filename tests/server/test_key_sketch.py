"""The frequent-keys sketch (hps/server/key_sketch.py) alone and as lookups feed it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.errors import ConfigError, HPSError, UnknownModelError, UnknownTableError
from hps.server import HierarchicalParameterServer
from hps.server.key_sketch import KeySketch, TableKeys
from hps.server.sketch_loops import new_state


def _zipf(rng: np.random.Generator, n: int, universe: int = 1_000_000) -> np.ndarray:
    """A skewed key stream: Zipf ranks scattered over int64 keys (not 1, 2, 3, ...)."""
    ranks = rng.zipf(1.1, n) % universe
    return (ranks.astype(np.int64) * 0x9E3779B1 + 12345) ^ 0x5555


def _true_top(stream: np.ndarray, n: int) -> tuple[np.ndarray, dict[int, int]]:
    keys, counts = np.unique(stream, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return keys[order[:n]], dict(zip(keys.tolist(), counts.tolist(), strict=True))


def test_a_skewed_stream_finds_the_true_top_10_among_its_top_20() -> None:
    rng = np.random.default_rng(7)
    stream = _zipf(rng, 1_000_000)
    sketch = KeySketch(slots=1024, most=1 << 30)  # every key counted: 768 keys tracked
    for start in range(0, stream.size, 2000):
        sketch.feed(stream[start:start + 2000])
    top = sketch.top(20)
    true10, counts = _true_top(stream, 10)
    assert set(true10.tolist()) <= set(top["keys"].tolist())
    assert top["total"] == stream.size
    assert top["error"] > 0  # the stream has far more distinct keys than slots: purged
    for key, count in zip(top["keys"].tolist(), top["counts"].tolist(), strict=True):
        assert count - top["error"] <= counts[key] <= count


def test_sampled_feeds_find_the_top_10_too() -> None:
    # as a table's hot sketch is fed: 64 keys of a batch, every 16th batch, weighted 16
    rng = np.random.default_rng(8)
    stream = _zipf(rng, 2_000_000)
    sketch = KeySketch(most=64, weight=16)
    for i, start in enumerate(range(0, stream.size, 2000)):
        if i % 16 == 0:
            sketch.feed(stream[start:start + 2000])
    top = sketch.top(20)
    true10, _ = _true_top(stream, 10)
    assert set(true10.tolist()) <= set(top["keys"].tolist())
    assert 0.5 * stream.size < top["total"] < 1.5 * stream.size


def test_few_keys_are_counted_exactly_and_ties_ordered_by_key() -> None:
    sketch = KeySketch(slots=64)
    sketch.feed(np.array([5, 3, 5, 9, 3, 5], np.int64))
    sketch.feed(np.array([-1, 2**62], np.int64))
    top = sketch.top(10)
    assert top["keys"].tolist() == [5, 3, -1, 9, 2**62]
    assert top["counts"].tolist() == [3, 2, 1, 1, 1]
    assert top["error"] == 0 and top["total"] == 8
    assert sketch.top(2)["keys"].tolist() == [5, 3]
    assert sketch.top(0)["keys"].size == 0


def test_keys_of_any_layout_and_integer_type_are_taken() -> None:
    sketch = KeySketch(slots=64)
    sketch.feed(np.arange(20, dtype=np.int64)[::2])  # strided view
    sketch.feed(np.array([4, 4], np.int32))
    assert sketch.top(1)["keys"].tolist() == [4]
    assert sketch.top(1)["counts"].tolist() == [3]


def test_a_bad_slot_count_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        new_state(100)


def test_threads_feeding_at_once_keep_the_sketch_consistent() -> None:
    sketch = KeySketch(slots=256, most=1 << 30)
    rng = np.random.default_rng(9)
    batches = [_zipf(rng, 500, 5000) for _ in range(400)]

    def feed(part: list[np.ndarray]) -> None:
        for b in part:
            sketch.feed(b)

    threads = [threading.Thread(target=feed, args=(batches[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    top = sketch.top(1000)
    # busy feeds are skipped, never torn: every count stays within the stream's
    assert 0 < top["total"] <= 400 * 500
    assert (top["counts"] > 0).all() and len(set(top["keys"].tolist())) == top["keys"].size
    assert top["keys"].size <= sketch.capacity


# -- as lookups feed it ------------------------------------------------------------------

def _server(two_tables: dict[str, Any], **model: Any) -> HierarchicalParameterServer:
    config = two_tables["config"]
    config["models"][0].update(model)
    return HierarchicalParameterServer(config)


def test_lookups_feed_the_hot_and_missing_sketches(two_tables: dict[str, Any]) -> None:
    keys0 = two_tables["tables"][0][0]
    hot = keys0[:5]
    absent = np.array([-7, -8, -9], np.int64)
    assert not np.isin(absent, keys0).any()
    with _server(two_tables, hot_key_sampling=1) as server:
        for _ in range(50):
            server.lookup("m", 0, np.concatenate([hot, hot, keys0[50:60], absent[:1]]))
        server.lookup("m", 0, absent)
        top = server.top_keys("m", 0, "hot", 6)
        assert sorted(top["keys"][:5].tolist()) == sorted(hot.tolist())
        assert top["keys"][5] == -7 and top["counts"].tolist() == [100] * 5 + [51]
        assert top["source"] == "lookups" and top["sampling"].startswith("1 in 1 ")
        missing = server.top_keys("m", "sparse_embedding0", "missing", 10)
        assert missing["keys"].tolist() == [-7, -9, -8]
        assert missing["counts"][0] == 51 and missing["error"] == 0
        assert server.top_keys("m", 1, "missing", 10)["keys"].size == 0


def test_sampling_counts_every_nth_lookup_weighted(two_tables: dict[str, Any]) -> None:
    keys0 = two_tables["tables"][0][0]
    with _server(two_tables, hot_key_sampling=4) as server:
        for _ in range(64):
            server.lookup("m", 0, keys0[:1])
        top = server.top_keys("m", 0, "hot", 1)
        assert top["keys"].tolist() == [keys0[0]]
        assert top["counts"].tolist() == [64] and top["total"] == 64


def test_sampling_off_leaves_the_hot_sketch_empty(two_tables: dict[str, Any]) -> None:
    keys0 = two_tables["tables"][0][0]
    with _server(two_tables, hot_key_sampling=0) as server:
        for _ in range(40):
            server.lookup("m", 0, keys0[:3])
        top = server.top_keys("m", 0, "hot", 10)
        assert top["keys"].size == 0 and top["sampling"].startswith("off")


def test_hot_key_sampling_must_be_a_power_of_two(two_tables: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="power of two"):
        _server(two_tables, hot_key_sampling=3)


def test_bad_top_keys_questions_are_refused(two_tables: dict[str, Any]) -> None:
    with _server(two_tables) as server:
        with pytest.raises(ConfigError, match="kind"):
            server.top_keys("m", 0, "warm", 5)
        with pytest.raises(UnknownModelError):
            server.top_keys("nope", 0)
        with pytest.raises(UnknownTableError):
            server.top_keys("m", 7)


def test_a_reload_starts_fresh_sketches(two_tables: dict[str, Any], tmp_path: Path) -> None:
    keys0 = two_tables["tables"][0][0]
    with _server(two_tables, hot_key_sampling=1) as server:
        server.lookup("m", 0, keys0[:3])
        assert server.top_keys("m", 0)["keys"].size == 3
        server.reload_model("m")
        assert server.top_keys("m", 0)["keys"].size == 0


def test_setting_the_sampling_keeps_the_source_and_the_missing_keys(
        two_tables: dict[str, Any]) -> None:
    with _server(two_tables) as server:
        server.lookup("m", 0, np.array([-5], np.int64))
        table = server.model("m").tables[0]
        table.keys_seen.source = "gpu_misses"  # as GpuCaches.attach marks a cached table
        table.sample_hot_keys(4)
        assert table.keys_seen.source == "gpu_misses" and table.hot_mask == 3
        assert server.top_keys("m", 0, "missing")["keys"].tolist() == [-5]
        assert server.top_keys("m", 0, "hot")["source"] == "gpu_misses"
        table.sample_hot_keys(0)
        assert table.hot_mask == -1


# -- samples taken elsewhere (a GPU table's, hps/gpu/key_sample.py) -----------------------

def test_a_sample_is_weighted_as_the_host_path_weights_its_own() -> None:
    rng = np.random.default_rng(10)
    batch = _zipf(rng, 256, 50)
    host = KeySketch(slots=64, most=64, weight=16)
    host.feed(batch)  # 64 of 256: every 4th from the first
    sampled = KeySketch(slots=64, most=64, weight=16)
    sampled.feed_sample(np.ascontiguousarray(batch[::4]), 4)
    mine, theirs = host.top(100), sampled.top(100)
    assert mine["keys"].tolist() == theirs["keys"].tolist()
    assert mine["counts"].tolist() == theirs["counts"].tolist()
    assert mine["total"] == theirs["total"] == 256 * 16
    sampled.feed_sample(np.empty(0, np.int64), 4)  # an empty sample counts nothing
    assert sampled.top(1)["total"] == 256 * 16


def test_a_read_feeds_what_is_pending_first() -> None:
    sketch = KeySketch(slots=64)
    calls = []

    def pending() -> None:
        calls.append(1)
        sketch.feed_sample(np.array([42], np.int64), 3)

    sketch.pending = pending
    top = sketch.top(5)
    assert calls == [1] and top["keys"].tolist() == [42] and top["counts"].tolist() == [3]


def test_the_sampling_is_described_by_where_it_is_taken() -> None:
    assert TableKeys(16).sampling("hot").startswith("1 in 16 host lookups")
    assert TableKeys(8, source="gpu_lookups").sampling("hot").startswith("1 in 8 GPU lookups")


def test_hot_copies_are_refused_where_a_table_has_none(two_tables: dict[str, Any]) -> None:
    """`replicate_hot_rows` of a table with no GPU cache sharded over devices: a clear
    error, as for an unknown model or table or keys that are not integers."""
    server = _server(two_tables)
    try:
        with pytest.raises(ConfigError, match="no hot copies"):
            server.replicate_hot_rows("m", 0, [1, 2, 3])
        with pytest.raises(ConfigError, match="no hot copies"):
            server.replicate_hot_rows("m", 0)  # the sketch's keys
        with pytest.raises(UnknownModelError):
            server.replicate_hot_rows("nope", 0, [1])
        with pytest.raises(UnknownTableError):
            server.replicate_hot_rows("m", 7, [1])
        with pytest.raises(HPSError):
            server.replicate_hot_rows("m", 0, ["a", "b"])
    finally:
        server.close()
