"""The in-process hash map tier beyond the Tier contract (tests/tiers/test_tier_contract.py):
its width check, slot-array rebuilds, overflow policies, memory bound, threads."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hps.config import VolatileDBConfig
from hps.errors import ConfigError, LookupInputError
from hps.tiers.hash_map import HashMapTier, bulk
from hps.tiers.hash_map import loops as kernels
from hps.tiers.hash_map import tier as hash_map_tier
from hps.tiers.partition import partition_of, rrxmrrxmsx_0
from tests.support.numpy_hash_map import NumpyHashMap
from tests.support.rows import vectors_of

T = "hps_et.model.table0"


def config(**kw: Any) -> VolatileDBConfig:
    return VolatileDBConfig.model_validate(kw)


@pytest.fixture
def tier() -> HashMapTier:
    t = HashMapTier(config())
    t.create_table(T, 4)
    return t


def test_remove_everything_then_refill(tier: HashMapTier) -> None:
    keys = np.arange(50_000)
    tier.insert(T, keys, vectors_of(keys, 4))
    assert tier.remove(T, keys) == 50_000
    assert tier.size(T) == 0
    assert not tier.fetch(T, keys)[1].any()
    assert tier.memory_bytes(T) < 10_000  # slots and rows were given back
    tier.insert(T, keys[:10], vectors_of(keys[:10], 4))
    assert tier.fetch(T, keys[:20])[1].tolist() == [True] * 10 + [False] * 10


def test_many_keys_through_rebuilds(tier: HashMapTier) -> None:
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-(2**62), 2**62, 120_000))
    for chunk in np.array_split(keys, 7):
        tier.insert(T, chunk, vectors_of(chunk, 4))
    assert tier.size(T) == keys.size
    query = np.concatenate([keys, rng.integers(2**62, 2**63 - 1, 5000)])
    got, found = tier.fetch(T, query)
    assert found[: keys.size].all() and not found[keys.size :].any()
    assert np.array_equal(got[: keys.size], vectors_of(keys, 4))


def test_create_table_with_another_width_is_refused(tier: HashMapTier) -> None:
    with pytest.raises(ConfigError, match="width 4, not 8"):
        tier.create_table(T, 8)
    assert tier.size(T) == 0 and tier.dim(T) == 4


# -- overflow --------------------------------------------------------------------------


def keys_in_partition(partition: int, num_partitions: int, count: int) -> np.ndarray:
    candidates = np.arange(count * num_partitions * 4, dtype=np.int64)
    chosen = candidates[partition_of(candidates, num_partitions) == partition][:count]
    assert chosen.size == count
    return chosen


@pytest.mark.parametrize("policy", ["evict_random", "evict_least_used", "evict_oldest"])
def test_overflow_prunes_partition_to_target(policy: str) -> None:
    tier = HashMapTier(
        config(num_partitions=4, overflow_margin=50, overflow_resolution_target=0.8,
               overflow_policy=policy),
        seed=1,
    )
    tier.create_table(T, 2)
    keys = keys_in_partition(2, 4, 51)
    tier.insert(T, keys[:50], vectors_of(keys[:50], 2))
    assert tier.partition_sizes(T).tolist() == [0, 0, 50, 0]
    tier.insert(T, keys[50:], vectors_of(keys[50:], 2))
    assert tier.partition_sizes(T).tolist() == [0, 0, 40, 0]
    assert tier.size(T) == 40
    got, found = tier.fetch(T, keys)
    assert found.sum() == 40
    assert np.array_equal(got[found], vectors_of(keys[found], 2))


@pytest.mark.parametrize("policy", ["evict_random", "evict_least_used", "evict_oldest"])
def test_overflow_keeps_every_partition_within_margin(policy: str) -> None:
    tier = HashMapTier(
        config(num_partitions=8, overflow_margin=100, overflow_policy=policy), seed=2
    )
    tier.create_table(T, 2)
    rng = np.random.default_rng(5)
    for _ in range(30):
        keys = rng.integers(0, 1 << 40, 300)
        tier.insert(T, keys, vectors_of(keys, 2))
        sizes = tier.partition_sizes(T)
        assert sizes.max() <= 100
        assert sizes.sum() == tier.size(T)
    # every key still held answers with its own vector
    held = tier.size(T)
    assert 8 * 80 <= held <= 8 * 100


def test_evict_random_really_evicts_at_random() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=1000,
                              overflow_resolution_target=0.5), seed=3)
    tier.create_table(T, 1)
    old, new = np.arange(0, 600), np.arange(600, 1001)
    tier.insert(T, old, np.zeros((600, 1)))
    tier.insert(T, new, np.zeros((401, 1)))
    assert tier.size(T) == 500
    kept_old = tier.fetch(T, old)[1].mean()
    kept_new = tier.fetch(T, new)[1].mean()
    assert 0.35 < kept_old < 0.65 and 0.35 < kept_new < 0.65


def test_evict_least_used_keeps_hot_keys() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_least_used",
                              overflow_resolution_target=0.5))
    tier.create_table(T, 2)
    keys = np.arange(100)
    tier.insert(T, keys, vectors_of(keys, 2))
    hot = keys[::3][:30]
    for _ in range(3):
        tier.fetch(T, hot)
    tier.fetch(T, np.repeat(keys[1:20:3], 1))  # lukewarm: one hit each
    tier.insert(T, np.array([1000]), vectors_of(np.array([1000]), 2))
    assert tier.size(T) == 50
    assert tier.fetch(T, hot)[1].all()


def test_evict_oldest_keeps_recent_keys() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_oldest",
                              overflow_resolution_target=0.5))
    tier.create_table(T, 2)
    old, mid, new = np.arange(0, 40), np.arange(40, 80), np.arange(80, 101)
    for batch in (old, mid, new):
        tier.insert(T, batch, vectors_of(batch, 2))
    tier.fetch(T, old)  # fetches do not refresh the stamp by default (as in HugeCTR)
    assert tier.size(T) == 50
    assert tier.fetch(T, new)[1].all()
    assert tier.fetch(T, mid)[1].sum() == 29
    assert not tier.fetch(T, old)[1].any()


def test_evict_oldest_with_refresh_time_after_fetch() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_oldest", overflow_resolution_target=0.5,
                              refresh_time_after_fetch=True))
    tier.create_table(T, 2)
    old, new = np.arange(0, 60), np.arange(60, 100)
    tier.insert(T, old, vectors_of(old, 2))
    tier.insert(T, new, vectors_of(new, 2))
    tier.fetch(T, old[:20])
    tier.insert(T, np.array([500]), vectors_of(np.array([500]), 2))
    assert tier.size(T) == 50
    assert tier.fetch(T, old[:20])[1].all()
    assert tier.fetch(T, np.array([500]))[1].all()


# -- memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("margin", [None, 10**9])
def test_memory_bound(dim: int, margin: int | None) -> None:
    """At most 1.5 × the raw key + vector bytes, whatever the fill of the slot array."""
    cfg = config() if margin is None else config(overflow_margin=margin,
                                                  overflow_policy="evict_oldest")
    tier = HashMapTier(cfg)
    tier.create_table(T, dim)
    rng = np.random.default_rng(dim)
    total = 0
    worst = 0.0
    for _ in range(40):
        keys = rng.integers(0, 2**62, 2500)
        tier.insert(T, keys, np.zeros((keys.size, dim), np.float32))
        total = tier.size(T)
        worst = max(worst, tier.memory_bytes(T) / (total * (8 + 4 * dim)))
    assert total > 99_000
    assert worst <= 1.5, worst


# -- threads ---------------------------------------------------------------------------


def test_threads_insert_fetch_remove() -> None:
    tier = HashMapTier(config())
    tier.create_table(T, 8)
    errors: list[BaseException] = []
    per_writer = 40_000

    def writer(w: int) -> None:
        try:
            keys = np.arange(w * per_writer, (w + 1) * per_writer)
            for chunk in np.array_split(keys, 20):
                tier.insert(T, chunk, vectors_of(chunk, 8))
                tier.remove(T, chunk[::10])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def reader(r: int) -> None:
        try:
            rng = np.random.default_rng(r)
            for _ in range(60):
                q = rng.integers(0, 3 * per_writer, 3000)
                got, found = tier.fetch(T, q)
                assert np.array_equal(got[found], vectors_of(q[found], 8))
                assert not got[~found].any()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    keys = np.arange(3 * per_writer)
    removed = np.concatenate(
        [c[::10] for w in range(3)
         for c in np.array_split(np.arange(w * per_writer, (w + 1) * per_writer), 20)]
    )
    got, found = tier.fetch(T, keys)
    assert found.sum() == keys.size - removed.size
    assert not found[removed].any()
    assert np.array_equal(got[found], vectors_of(keys[found], 8))


def test_concurrent_fetches_count_every_hit() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_least_used",
                              overflow_resolution_target=0.5))
    tier.create_table(T, 2)
    keys = np.arange(100)
    tier.insert(T, keys, vectors_of(keys, 2))
    hot, warm = keys[:40], keys[40:60]

    def fetcher() -> None:
        for _ in range(25):
            tier.fetch(T, hot)
            tier.fetch(T, warm[:1])

    threads = [threading.Thread(target=fetcher) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.fetch(T, np.repeat(warm, 99))  # 99 hits each: still fewer than the hot keys' 100
    tier.insert(T, np.array([1000]), vectors_of(np.array([1000]), 2))
    assert tier.size(T) == 50
    assert tier.fetch(T, hot)[1].all()  # 100 hits each, none lost between threads


# -- the former NumPy path -------------------------------------------------------------

wide_keys = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-300, 300))
batches = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "fetch"]),
              st.lists(wide_keys, max_size=400),
              st.integers(1, 2000)),
    max_size=30,
)


def assert_same_answers(tier: HashMapTier, reference: NumpyHashMap, keys: np.ndarray) -> None:
    got, found = tier.fetch(T, keys)
    want, want_found = reference.fetch(keys)
    assert np.array_equal(found, want_found)
    assert np.array_equal(got, want)
    assert tier.size(T) == reference.size


@settings(max_examples=120, deadline=None)
@given(batches)
def test_compiled_tier_answers_like_the_numpy_path(
    sequence: list[tuple[str, list[int], int]],
) -> None:
    """Random batches (repeats, extremes, dense small ranges that collide), then a wide
    batch of consecutive keys: every answer, count and size agrees with the NumPy path."""
    tier = HashMapTier(config(num_partitions=8))
    tier.create_table(T, 5)
    reference = NumpyHashMap(5)
    for step, (op, key_list, run) in enumerate(sequence):
        # each batch also carries a run of consecutive keys: many collisions, many rebuilds
        keys = np.concatenate([np.array(key_list, np.int64),
                               np.arange(step * 500, step * 500 + run, dtype=np.int64)])
        if op == "insert":
            vecs = vectors_of(keys, 5, salt=step)
            tier.insert(T, keys, vecs)
            reference.insert(keys, vecs)
        elif op == "remove":
            assert tier.remove(T, keys) == reference.remove(keys)
        assert_same_answers(tier, reference, keys)
    live = reference.keys[: reference.size]
    assert_same_answers(tier, reference, np.concatenate([live, live + 1]))
    assert np.array_equal(tier.partition_sizes(T),
                          np.bincount(partition_of(live, 8), minlength=8))


def test_compiled_tier_like_the_numpy_path_at_scale() -> None:
    """A million random keys in uneven chunks, removals, re-inserts; fetches of keys held
    and never held, split over the cores, agree with the NumPy path row for row."""
    rng = np.random.default_rng()
    tier = HashMapTier(config())
    tier.create_table(T, 3)
    reference = NumpyHashMap(3)
    keys = rng.integers(-(2**63), 2**63 - 1, 1_000_000, dtype=np.int64)
    for chunk in np.array_split(keys, 9):
        vecs = rng.standard_normal((chunk.size, 3), dtype=np.float32)
        tier.insert(T, chunk, vecs)
        reference.insert(chunk, vecs)
    gone = keys[rng.integers(0, keys.size, 200_000)]
    assert tier.remove(T, gone) == reference.remove(gone)
    back = gone[:50_000]
    vecs = rng.standard_normal((back.size, 3), dtype=np.float32)
    tier.insert(T, back, vecs)
    reference.insert(back, vecs)
    query = np.concatenate([keys, rng.integers(-(2**63), 2**63 - 1, 100_000, dtype=np.int64)])
    assert_same_answers(tier, reference, rng.permutation(query))


def _homed_at_region_ends(tier: HashMapTier, parts: int, rng: np.random.Generator
                          ) -> np.ndarray:
    """Keys whose home slot is one of the last 4 of a region when the reserved table's
    slots are split in `parts`: about 16 a region, so some probe past its end whatever
    the table holds there (the reserve's size alone decides how many a load leaves)."""
    capacity = tier._table(T).slots.size
    region = -(-capacity // parts)
    candidates = rng.integers(-(2**63), 2**63 - 1, 4 * capacity, dtype=np.int64)
    homes = (rrxmrrxmsx_0(candidates) % np.uint64(capacity)).astype(np.int64)
    return candidates[homes % region >= region - 4]


@pytest.mark.parametrize("workers", [4, 48])
def test_an_insert_split_over_the_cores_answers_like_the_numpy_path(
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """Large inserts into a reserved table run on `workers` threads, each owning a
    region of the slots: repeats in a batch (the last wins), keys already held, slots
    freed by removals, and the keys whose probes reach a region's end (inserted after,
    on one thread) all end as on the NumPy path, partition counts included."""
    rng = np.random.default_rng()
    monkeypatch.setattr(hash_map_tier, "PARALLEL_KEYS", 2048)  # many regions at a test's size
    tier = HashMapTier(config(num_partitions=8))
    tier._workers = workers
    seams: list[int] = []
    real = bulk.split_insert
    monkeypatch.setattr(bulk, "split_insert", lambda *a: (
        lambda left: (seams.append(left[0].size), left)[1])(real(*a)))
    tier.create_table(T, 3)
    tier.reserve(T, 300_000)
    reference = NumpyHashMap(3)
    first = rng.integers(-(2**63), 2**63 - 1, 100_000, dtype=np.int64)
    batches = [first, np.concatenate([first[:25_000], rng.integers(0, 200_000, 150_000),
                                      _homed_at_region_ends(tier, workers, rng)])]
    for step, keys in enumerate(batches):
        keys = rng.permutation(keys)  # repeats anywhere in the batch
        vecs = rng.standard_normal((keys.size, 3), dtype=np.float32)
        tier.insert(T, keys, vecs)
        reference.insert(keys, vecs)
        if step == 0:
            gone = first[rng.integers(0, first.size, 15_000)]  # tombstones to reuse
            assert tier.remove(T, gone) == reference.remove(gone)
    assert len(seams) == 2  # both batches were split
    assert seams[1] > 0  # the keys homed at the regions' ends
    live = reference.keys[: reference.size]
    assert tier.size(T) == reference.size
    assert_same_answers(tier, reference, np.concatenate([live, live + 1, first]))
    assert np.array_equal(tier.partition_sizes(T),
                          np.bincount(partition_of(live, 8), minlength=8))
    more = np.arange(10**12, 10**12 + 100_000, dtype=np.int64)  # and it goes on working
    tier.insert(T, more, vectors_of(more, 3))
    got, found = tier.fetch(T, more)
    assert found.all() and np.array_equal(got, vectors_of(more, 3))


def test_sorted_rows_hands_the_rows_in_place_and_holds_writes_off() -> None:
    tier = HashMapTier(config())
    tier.create_table(T, 4)
    keys = np.random.default_rng(5).permutation(np.arange(-3000, 3000)).astype(np.int64)
    tier.insert(T, keys, vectors_of(keys, 4))
    wrote = threading.Event()
    writer = threading.Thread(target=lambda: (tier.insert(T, keys[:1], vectors_of(keys[:1], 4)),
                                              wrote.set()))
    with tier.sorted_rows(T, lambda k: (np.sort(k), np.argsort(k))) as (ordered, rows,
                                                                         positions):
        assert positions is not None
        assert np.array_equal(ordered, np.sort(keys))
        assert np.array_equal(rows[positions], vectors_of(ordered, 4))  # no copy made
        writer.start()
        assert not wrote.wait(0.3)  # the rows stay where they are while they are read
    writer.join()
    assert wrote.is_set()
    with tier.sorted_rows(T, lambda k: None) as (ordered, rows, positions):
        assert positions is None and np.array_equal(rows, vectors_of(ordered, 4))


# -- the compiled path's own promises --------------------------------------------------


def test_fetch_into_a_callers_buffer(tier: HashMapTier) -> None:
    keys = np.array([3, 8, 5])
    tier.insert(T, keys, vectors_of(keys, 4))
    out = np.full((4, 4), 7.0, np.float32)
    found = tier.fetch_into(T, np.array([5, 9, 3, 5]), out)
    assert found.tolist() == [True, False, True, True]
    assert np.array_equal(out[[0, 2, 3]], vectors_of(np.array([5, 3, 5]), 4))
    assert not out[1].any()
    for bad in (np.zeros((4, 4), np.float64), np.zeros((3, 4), np.float32),
                np.zeros((4, 8), np.float32)[:, ::2], np.zeros((4, 4), np.float32).T.copy().T):
        before = bad.copy()
        with pytest.raises(LookupInputError, match="fetch_into needs"):
            tier.fetch_into(T, np.array([5, 9, 3, 5]), bad)
        assert np.array_equal(bad, before)


def test_read_only_and_strided_keys(tier: HashMapTier) -> None:
    keys = np.arange(10, dtype=np.int64)
    tier.insert(T, np.frombuffer(keys.tobytes(), np.int64), vectors_of(keys, 4))
    got, found = tier.fetch(T, np.frombuffer(keys[::-1].tobytes(), np.int64))
    assert found.all() and np.array_equal(got, vectors_of(keys[::-1], 4))
    got, found = tier.fetch(T, keys[::3])
    assert found.all() and np.array_equal(got, vectors_of(keys[::3], 4))


def test_reserve_allocates_once_and_keeps_contents(tier: HashMapTier) -> None:
    tier.insert(T, np.array([1, 2]), vectors_of(np.array([1, 2]), 4))
    tier.reserve(T, 100_000)
    keys = np.arange(3, 100_000)
    tier.insert(T, keys, vectors_of(keys, 4))
    assert tier.size(T) == 99_999
    got, found = tier.fetch(T, np.arange(1, 100_000))
    assert found.all() and np.array_equal(got, vectors_of(np.arange(1, 100_000), 4))
    # slots sized for the announced load: under 1.1 × raw for 4-wide rows (24 bytes)
    assert tier.memory_bytes(T) <= 1.35 * 99_999 * 24


def test_a_loads_reserve_takes_the_new_keys_of_updates_without_moving_its_rows(
        tier: HashMapTier) -> None:
    """`reserve` leaves rows for a quarter more keys than the load's, never written (not
    resident, not counted): the new keys of updates after the load go there instead of
    every row being copied under the table's write lock, every lookup waiting."""
    keys = np.arange(100_000)
    tier.reserve(T, keys.size)
    tier.insert(T, keys, vectors_of(keys, 4))
    rows = tier._tables[T].vectors
    for start in range(0, 20_000, 2_000):  # rounds of updates: a fifth more keys
        new = np.arange(start, start + 2_000) + 10**9
        tier.insert(T, new, vectors_of(new, 4))
        assert tier._tables[T].vectors is rows  # written in place, never moved
    every = np.concatenate([keys, np.arange(20_000) + 10**9])
    got, found = tier.fetch(T, every)
    assert found.all() and np.array_equal(got, vectors_of(every, 4))
    assert tier.memory_bytes(T) <= 1.5 * every.size * 24  # the rows written, not the room


def test_kernels_release_the_gil_and_never_compile_in_a_lookup() -> None:
    """Each kernel is declared for its signatures (compiled at their first use), without
    the GIL; a call with other types raises instead of compiling another version."""
    # one signature each, but for the stored row types (float32, 16-bit, int8 rows) and
    # fetch's decodes (hps.rows.decode_loops)
    counts = {"fetch": 5, "insert": 3, "remove": 3}
    for name in ("fetch", "insert", "remove", "place_rows", "partitions", "count_hits",
                 "stamp_rows"):
        dispatcher = getattr(kernels, name)
        assert dispatcher.targetoptions["nogil"] is True, name
        assert len(dispatcher.declared) == counts.get(name, 1), name
        assert not dispatcher._can_compile, name
    with pytest.raises(TypeError):
        kernels.place_rows(np.full(16, -1, np.int64), np.zeros(4, np.int64), 4, 4)


@pytest.mark.parametrize("tag_bits", [0, 2, None])
def test_slot_tags_only_narrow_the_probe(tag_bits: int | None) -> None:
    """The kernels on their own, with tags of no bits (every slot's tag matches: each
    probe falls back to comparing keys), of 2 bits (many false matches), and as wide as
    the slot array leaves them: inserts, overwrites, removals (which move rows and their
    slots) and fetches of held and absent keys agree with a dict."""
    capacity, width = 4099, 3
    bits = kernels.row_bits(capacity) if tag_bits is None else 31 - tag_bits
    slots = np.full(capacity, -1, np.int32)
    row_keys = np.zeros(2048, np.int64)
    vectors = np.zeros((2048, width), np.float32)
    sizes, state = np.zeros(4, np.int64), np.zeros(2, np.int64)
    no_stats = np.empty(0, np.uint32)
    rng = np.random.default_rng()
    # random keys, and a dense run whose homes crowd together
    keys = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 1200, dtype=np.int64),
                           np.arange(300, dtype=np.int64)])
    held: dict[int, np.ndarray] = {}
    for salt, batch in enumerate((keys, keys[::3].copy())):  # the second overwrites
        rows = vectors_of(batch, width, salt=salt)
        done = kernels.insert(slots, row_keys, vectors, no_stats, sizes, state, bits, batch,
                              rows, 0, 2800, 0, -1)
        assert done == batch.size
        held.update(zip(batch.tolist(), rows, strict=True))
    gone = keys[rng.permutation(keys.size)[:500]]
    removed = kernels.remove(slots, row_keys, vectors, no_stats, sizes, state, bits, gone)
    assert removed == np.unique(gone).size
    for key in gone.tolist():
        held.pop(key, None)
    query = np.concatenate([keys, keys + 7, rng.integers(-(2**63), 2**63 - 1, 500,
                                                         dtype=np.int64)])
    out = np.full((query.size, width), np.nan, np.float32)
    found = np.zeros(query.size, np.bool_)
    rows_of = np.empty(query.size, np.int64)
    hits = kernels.fetch(slots, row_keys, vectors, np.empty((0, 2), np.float32), bits,
                         query, out, found, rows_of)
    want_found = np.array([k in held for k in query.tolist()])
    assert np.array_equal(found, want_found) and hits == want_found.sum()
    want = np.array([held.get(k, np.zeros(width, np.float32)) for k in query.tolist()])
    assert np.array_equal(out, want)
    assert np.array_equal(row_keys[rows_of[found]], query[found])
    assert (rows_of[~found] == -1).all()
    assert state[0] == len(held)
