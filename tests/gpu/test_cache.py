"""EmbeddingCache (hps/gpu/dynamic_cache.py) against its NumPy model, and its argument checks."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from hps.errors import DeviceError, KeyTypeError, LookupInputError, OutputBufferError
from hps.gpu.cache_model import ReferenceCache
from hps.gpu.dynamic_cache import EMPTY_KEY, SET_SIZE, EmbeddingCache
from hps.rows.storage_types import decode, encode

pytestmark = pytest.mark.gpu


def _compare_state(cache: EmbeddingCache, model: ReferenceCache, seed: int) -> None:
    state = cache.state()
    where = f"(seed={seed})"
    np.testing.assert_array_equal(state["keys"], model.keys, err_msg=f"keys differ {where}")
    np.testing.assert_array_equal(state["stamps"], model.stamps, err_msg=f"stamps {where}")
    held = model.keys != EMPTY_KEY
    np.testing.assert_array_equal(state["rows"][held], model.rows[held], err_msg=f"rows {where}")
    assert state["special"] == model.special, where
    if model.special:
        np.testing.assert_array_equal(state["special_row"], model.special_row)
    assert state["size"] == model.size(), where


def _query_both(cp: Any, cache: EmbeddingCache, model: ReferenceCache, keys: np.ndarray,
                default: float, seed: int) -> None:
    out = cp.full((keys.size, cache.dim), np.nan, dtype=np.float32)
    positions, count = cache.query(cp.asarray(keys), out, default)
    expected, missed = model.query(keys, default)
    np.testing.assert_array_equal(out.get(), expected, err_msg=f"query rows (seed={seed})")
    assert count == int(missed.sum())
    assert sorted(positions.get().tolist()) == np.flatnonzero(missed).tolist()


@pytest.mark.parametrize("dim,group,unroll,shift,storage", [
    (16, 4, 1, 0, "float32"), (16, 4, 4, 0, "float32"), (16, 2, 2, 2, "float32"),
    (5, 8, 2, 0, "float32"), (64, 8, 1, 1, "float32"), (128, 4, 2, 0, "float32"),
    (37, 8, 2, 1, "float16"), (37, 8, 2, 1, "bfloat16"), (37, 8, 2, 1, "int8")])
def test_matches_numpy_model_on_random_operations(cp: Any, rng: np.random.Generator, seed: int,
                                                  dim: int, group: int, unroll: int,
                                                  shift: int, storage: str) -> None:
    num_sets = 23
    cache = EmbeddingCache(num_sets * SET_SIZE, dim, 0, group=group, unroll=unroll,
                           lru_sample_shift=shift, storage=storage)
    model = ReferenceCache(num_sets * SET_SIZE, dim, lru_sample_shift=shift)

    def stored(rows: np.ndarray) -> np.ndarray:
        """What the cache holds of float32 rows: hps/rows/storage_types.py's encode, decoded (the
        device encodes bit for bit as it does)."""
        return decode(storage, encode(storage, rows), dim)

    # a universe twice the capacity: sets overflow and evict; negative keys, the sentinel
    universe = np.r_[rng.integers(-(2**63), 2**63 - 1, 2 * num_sets * SET_SIZE, dtype=np.int64),
                     EMPTY_KEY, 0, -1].astype(np.int64)
    try:
        for step in range(120):
            op = rng.choice(["insert", "query", "query", "update", "remove", "dump"])
            n = int(rng.integers(0, 3 * SET_SIZE * num_sets // 2))
            keys = rng.choice(universe, size=n)
            if op == "insert":
                rows = rng.standard_normal((n, dim)).astype(np.float32)
                cache.insert(cp.asarray(keys), cp.asarray(rows))
                model.insert(keys, stored(rows))
            elif op == "query":
                _query_both(cp, cache, model, keys, float(rng.standard_normal()), seed)
            elif op == "update":
                keys = np.unique(keys)
                rows = rng.standard_normal((keys.size, dim)).astype(np.float32)
                assert cache.update(cp.asarray(keys), cp.asarray(rows)) == model.update(
                    keys, stored(rows))
            elif op == "remove":
                keys = keys[: n // 8]
                cache.remove(cp.asarray(keys))
                model.remove(keys)
            else:
                start = int(rng.integers(0, num_sets))
                stop = int(rng.integers(start, num_sets + 2))
                got = np.sort(cache.dump(start, stop).get())
                np.testing.assert_array_equal(got, model.dump(start, stop),
                                              err_msg=f"dump step {step} (seed={seed})")
            if step % 10 == 9:
                _compare_state(cache, model, seed)
        _compare_state(cache, model, seed)
    finally:
        cache.close()


def test_hits_misses_duplicates_and_empty_batches(cp: Any, rng: np.random.Generator) -> None:
    dim = 16
    # 200 keys in 512 sets of 8: no set overflows (in 128 sets one did for 0.4% of seeds,
    # evicting a key the query then missed twice)
    with EmbeddingCache(4096, dim) as cache:
        keys = rng.choice(2**40, 300, replace=False).astype(np.int64)
        rows = rng.standard_normal((300, dim)).astype(np.float32)
        cache.insert(keys[:200], rows[:200])  # host arrays are accepted
        query = np.r_[keys[:50], keys[:50], keys[250:], keys[10:11]]  # repeats, misses
        out = cp.empty((query.size, dim), dtype=np.float32)
        positions, count = cache.query(cp.asarray(query), out, default_value=-2.0)
        got = out.get()
        assert count == 50
        assert sorted(positions.get().tolist()) == list(range(100, 150))
        np.testing.assert_array_equal(got[:50], rows[:50])
        np.testing.assert_array_equal(got[50:100], rows[:50])
        assert (got[100:150] == -2.0).all()
        np.testing.assert_array_equal(got[150], rows[10])
        # an empty batch: nothing launched, nothing missed
        positions, count = cache.query(cp.empty(0, dtype=np.int64),
                                       cp.empty((0, dim), dtype=np.float32))
        assert count == 0 and positions.size == 0
        assert cache.size() == 200


def test_every_int64_is_a_key_including_the_sentinel(cp: Any) -> None:
    dim = 4
    with EmbeddingCache(64, dim) as cache:
        keys = np.array([EMPTY_KEY, -(2**63), 0, -1], dtype=np.int64)
        rows = np.arange(16, dtype=np.float32).reshape(4, 4)
        cache.insert(keys, rows)
        out = cp.empty((4, dim), dtype=np.float32)
        _, count = cache.query(cp.asarray(keys), out)
        assert count == 0
        np.testing.assert_array_equal(out.get(), rows)
        assert sorted(cache.dump(0, cache.num_sets).get().tolist()) == sorted(keys.tolist())
        cache.remove(np.array([EMPTY_KEY]))
        _, count = cache.query(cp.asarray(keys), out)
        assert count == 1
        assert cache.size() == 3


def test_unaligned_and_odd_width_outputs(cp: Any, rng: np.random.Generator) -> None:
    for dim in (16, 7):
        with EmbeddingCache(256, dim) as cache:
            keys = np.arange(100, dtype=np.int64) * 7919
            rows = rng.standard_normal((100, dim)).astype(np.float32)
            cache.insert(keys, rows)
            base = cp.zeros(100 * dim + 1, dtype=np.float32)
            out = base[1:].reshape(100, dim)  # 4 bytes off 16-byte alignment
            assert out.data.ptr % 16 != 0
            _, count = cache.query(cp.asarray(keys), out)
            assert count == 0
            np.testing.assert_array_equal(out.get(), rows)
            assert float(base[0].get()) == 0.0  # nothing written before the view


def test_query_follows_the_callers_stream(cp: Any, rng: np.random.Generator) -> None:
    dim = 32
    keys = rng.choice(2**40, 10_000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, dim)).astype(np.float32)
    model = ReferenceCache(1 << 14, dim)
    model.insert(keys, rows)
    expected, missed = model.query(keys)
    with EmbeddingCache(1 << 14, dim) as cache:
        cache.insert(cp.asarray(keys), cp.asarray(rows))  # on the cache's own stream
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            # keys written by work queued on the caller's stream just before the query
            q = cp.empty(keys.size, dtype=cp.int64)
            cp.add(cp.asarray(keys) - 7, 7, out=q)
            out = cp.empty((keys.size, dim), dtype=cp.float32)
            _, count = cache.query(q, out)
            got = out.get()
        stream.synchronize()
    assert count == int(missed.sum())
    np.testing.assert_array_equal(got, expected)


def test_argument_errors_change_nothing(cp: Any) -> None:
    dim = 8
    with EmbeddingCache(64, dim) as cache:
        out = cp.empty((3, dim), dtype=np.float32)
        with pytest.raises(KeyTypeError, match="int64"):
            cache.query(cp.arange(3, dtype=cp.int32), out)
        with pytest.raises(KeyTypeError, match="1-D"):
            cache.query(cp.zeros((3, 1), dtype=cp.int64), out)
        with pytest.raises(KeyTypeError):
            cache.query([1, 2, 3], out)
        keys = cp.arange(3, dtype=cp.int64)
        with pytest.raises(OutputBufferError, match="float32"):
            cache.query(keys, cp.empty((3, dim), dtype=np.float64))
        with pytest.raises(OutputBufferError, match="shape"):
            cache.query(keys, cp.empty((3, dim + 1), dtype=np.float32))
        with pytest.raises(OutputBufferError, match="contiguous"):
            cache.query(keys, cp.empty((dim, 3), dtype=np.float32).T)
        with pytest.raises(OutputBufferError, match="CuPy"):
            cache.query(keys, np.empty((3, dim), dtype=np.float32))
        with pytest.raises(LookupInputError, match="shape"):
            cache.insert(keys, cp.empty((2, dim), dtype=np.float32))
        with pytest.raises(LookupInputError, match="float32"):
            cache.insert(keys, cp.empty((3, dim), dtype=np.float16))
        assert cache.size() == 0
        if cp.cuda.runtime.getDeviceCount() > 1:
            with cp.cuda.Device(1):
                other = cp.arange(3, dtype=cp.int64)
            with pytest.raises(DeviceError, match="device 1"):
                cache.query(other, out)
    with pytest.raises(DeviceError, match="closed"):
        cache.query(keys, out)


def test_memory_is_reported_before_allocating(cp: Any) -> None:
    need = EmbeddingCache.memory_required(1000, 10)
    sets = -(-1000 // SET_SIZE)
    assert need == sets * SET_SIZE * 16 + (sets * SET_SIZE + 1) * 12 * 4 + 64
    with EmbeddingCache(1000, 10) as cache:
        assert cache.memory_bytes() == need
    free, total = cp.cuda.runtime.memGetInfo()
    too_many = total // 8  # 8+ bytes per slot of keys alone: more than the device has
    before = cp.cuda.runtime.memGetInfo()[0]
    with pytest.raises(DeviceError, match="GiB"):
        EmbeddingCache(too_many, 64)
    assert cp.cuda.runtime.memGetInfo()[0] >= before - (64 << 20)
    with pytest.raises(DeviceError, match="device_id 99"):
        EmbeddingCache(64, 4, 99)


def test_concurrent_queries_and_inserts(cp: Any, rng: np.random.Generator) -> None:
    """Queries from several threads while another inserts and updates: every hit returns
    the row of its key (rows encode their key), misses get the default."""
    dim = 16
    keys = rng.choice(2**40, 20_000, replace=False).astype(np.int64)

    def rows_of(k: np.ndarray) -> np.ndarray:
        return np.repeat((k % 100_003).astype(np.float32)[:, None], dim, axis=1)

    errors: list[str] = []
    with EmbeddingCache(8192, dim) as cache:
        cache.insert(keys[:4000], rows_of(keys[:4000]))
        stop = threading.Event()

        def writer() -> None:
            w = np.random.default_rng(int(rng.integers(2**32)))
            while not stop.is_set():
                k = w.choice(keys, 2000, replace=False)
                cache.insert(k, rows_of(k))
                cache.update(k[:500], rows_of(k[:500]))

        def reader() -> None:
            r = np.random.default_rng(int(rng.integers(2**32)))
            with cp.cuda.Stream(non_blocking=True):
                for _ in range(40):
                    k = r.choice(keys, 3000)
                    out = cp.empty((k.size, dim), dtype=np.float32)
                    positions, count = cache.query(cp.asarray(k), out, default_value=-1.0)
                    got = out.get()
                    missed = np.zeros(k.size, dtype=bool)
                    missed[positions.get()] = True
                    if not (got[missed] == -1.0).all():
                        errors.append("a miss did not get the default")
                    if not np.array_equal(got[~missed], rows_of(k[~missed])):
                        errors.append("a hit returned another key's row")

        w = threading.Thread(target=writer)
        readers = [threading.Thread(target=reader) for _ in range(4)]
        w.start()
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        w.join()
    assert not errors, errors[:3]
