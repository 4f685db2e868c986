"""GpuEmbeddingTable (hps/gpu/table.py): the lookup path, warm-up, refresh, concurrency,
every DLPack producer, and the HPS API over a GPU cache."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.config import ModelConfig
from hps.errors import DeviceError, KeyTypeError, OutputBufferError
from hps.gpu.cache_model import ReferenceCache
from hps.gpu.dynamic_cache import EmbeddingCache
from hps.gpu.open import cache_slots
from hps.gpu.static_table import StaticEmbeddingTable
from hps.gpu.table import GpuEmbeddingTable, cuda_available
from hps.gpu.workspace import SPARE_STATES

pytestmark = pytest.mark.gpu

DEFAULT = 0.25


class HostStore:
    """A stand-in for the server's host path: sorted keys, searchsorted, default rows."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray) -> None:
        order = np.argsort(keys)
        self.keys, self.rows = keys[order], rows[order].copy()
        self.calls = 0
        self.lock = threading.Lock()

    def fetch(self, keys: np.ndarray) -> np.ndarray:
        with self.lock:
            self.calls += 1
            at = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
            found = self.keys[at] == keys
            out = np.full((keys.size, self.rows.shape[1]), DEFAULT, dtype=np.float32)
            out[found] = self.rows[at[found]]
            return out

    def set(self, keys: np.ndarray, rows: np.ndarray) -> None:
        with self.lock:
            at = np.searchsorted(self.keys, keys)
            self.rows[at] = rows


def _model(dim: int, **extra: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "model": "m", "sparse_files": ["/nowhere"], "embedding_vecsize_per_table": [dim],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
    }
    fields.update(extra)
    return ModelConfig(**fields)


def _store(rng: np.random.Generator, n: int, dim: int, span: int = 2**40) -> HostStore:
    keys = rng.choice(span, n, replace=False).astype(np.int64) - span // 2
    return HostStore(keys, rng.standard_normal((n, dim)).astype(np.float32))


def _chunks(store: HostStore, size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(store.keys[i:i + size], store.rows[i:i + size])
            for i in range(0, store.keys.size, size)]


def test_cuda_available() -> None:
    assert cuda_available()


@pytest.mark.parametrize("pct,expected_chunks", [(0.3, 4), (1.0, 1), (2.5, 1)])
def test_warm_up_inserts_every_chunk_including_the_last(
        cp: Any, rng: np.random.Generator, pct: float, expected_chunks: int) -> None:
    dim, n = 8, 4000
    store = _store(rng, n, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=0.5,
                                  cache_refresh_percentage_per_iteration=pct),
                           0, n, 0, store.fetch) as table:
        capacity = table.capacity
        assert capacity == 2000
        inserted: list[np.ndarray] = []
        real_insert = table._table.insert

        def spy(keys: Any, vectors: Any) -> None:
            inserted.append(np.asarray(keys))
            real_insert(keys, vectors)

        table._table.insert = spy  # type: ignore[method-assign]
        # the server's chunking: pct × capacity keys per chunk (all at once for pct ≥ 1)
        chunk = max(1, int(min(pct, 1.0) * capacity))
        assert table.warm_up(_chunks(store, chunk)) == capacity
        assert len(inserted) == expected_chunks
        np.testing.assert_array_equal(np.concatenate(inserted), store.keys[:capacity])
        # exactly what the NumPy model holds after the same chunks
        model = ReferenceCache(table._table.num_slots, dim)  # the sizing's extra slots too
        for keys in inserted:
            model.insert(keys, np.zeros((keys.size, dim), np.float32))
        held = np.sort(table._table.dump(0, table._table.num_sets).get())
        np.testing.assert_array_equal(held, model.dump(0, model.num_sets))
        assert table.stats()["size"] == held.size
    with GpuEmbeddingTable(_model(dim), 0, n, 0, store.fetch) as table:
        assert table.warm_up([]) == 0  # pct 0: the server passes no chunk
        assert table.stats()["size"] == 0


@pytest.mark.parametrize("dim", [16, 7])
def test_synchronous_misses_return_real_vectors(cp: Any, rng: np.random.Generator,
                                                dim: int) -> None:
    store = _store(rng, 5000, dim)
    # a roomy cache (num_keys × 10): no set overflows, so everything fetched stays
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, hit_rate_threshold=1.01),
                           0, 50_000, 0, store.fetch) as table:
        keys = np.r_[rng.choice(store.keys, 3000), [2**50, 2**50]].astype(np.int64)
        out = cp.full((keys.size, dim), np.nan, dtype=np.float32)
        table.lookup(cp.asarray(keys), out)
        np.testing.assert_array_equal(out.get(), store.fetch(keys))
        calls = store.calls
        out2 = cp.full((keys.size, dim), np.nan, dtype=np.float32)
        table.lookup(cp.asarray(keys), out2)  # all cached now (the unknown key's default too)
        assert store.calls == calls
        np.testing.assert_array_equal(out2.get(), store.fetch(keys))
        stats = table.stats()
        assert stats["hits"] >= keys.size - 2 and stats["mode"] == "dynamic"


def test_high_hit_rate_misses_get_defaults_then_arrive(cp: Any, rng: np.random.Generator
                                                       ) -> None:
    dim = 16
    store = _store(rng, 4000, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, hit_rate_threshold=0.5),
                           0, 40_000, 0, store.fetch) as table:
        table.warm_up(_chunks(store, 1000)[:3])  # 3000 keys cached
        keys = np.r_[store.keys[:900], store.keys[3900:]]  # 90% hits ≥ threshold 0.5
        out = cp.empty((keys.size, dim), dtype=np.float32)
        table.lookup(cp.asarray(keys), out)
        got = out.get()
        np.testing.assert_array_equal(got[:900], store.fetch(keys[:900]))
        assert (got[900:] == DEFAULT).all()  # this request: the default
        deadline = time.time() + 10
        while table.stats()["async_inserts"] < 100 and time.time() < deadline:
            time.sleep(0.01)
        table.lookup(cp.asarray(keys), out)
        np.testing.assert_array_equal(out.get(), store.fetch(keys))  # later: the real ones


def test_host_and_mixed_residency(cp: Any, rng: np.random.Generator) -> None:
    dim = 32
    store = _store(rng, 2000, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, hit_rate_threshold=2.0),
                           0, 2000, 0, store.fetch) as table:
        keys = rng.choice(store.keys, 700)
        expected = store.fetch(keys)
        out = np.empty((700, dim), dtype=np.float32)
        table.lookup(keys, out)  # host keys, host out
        np.testing.assert_array_equal(out, expected)
        out = np.empty((700, dim), dtype=np.float32)
        table.lookup(cp.asarray(keys), out)  # device keys, host out
        np.testing.assert_array_equal(out, expected)
        dout = cp.empty((700, dim), dtype=np.float32)
        table.lookup(keys, dout)  # host keys, device out
        np.testing.assert_array_equal(dout.get(), expected)
        table.lookup(np.empty(0, np.int64), np.empty((0, dim), np.float32))


def test_static_mode(cp: Any, rng: np.random.Generator) -> None:
    dim = 16
    store = _store(rng, 3000, dim)
    with GpuEmbeddingTable(_model(dim, embedding_cache_type="static"), 0, 3000, 0,
                           store.fetch) as table:
        assert table.warm_up(_chunks(store, 1000)) == 3000
        keys = np.r_[store.keys, [2**55]].astype(np.int64)
        out = cp.empty((keys.size, dim), dtype=np.float32)
        table.lookup(cp.asarray(keys), out)
        np.testing.assert_array_equal(out.get(), store.fetch(keys))
        stats = table.stats()
        assert stats["mode"] == "static" and stats["size"] == 3000
    with GpuEmbeddingTable(_model(dim, use_static_table=True), 0, 10, 0, store.fetch) as t:
        assert t.mode == "static"


def test_refresh_after_database_changes(cp: Any, rng: np.random.Generator) -> None:
    dim = 16
    store = _store(rng, 3000, dim)
    for kind in ("dynamic", "static", "uvm"):
        with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, embedding_cache_type=kind,
                                      cache_refresh_percentage_per_iteration=0.1,
                                      hit_rate_threshold=1.01),
                               0, 3000, 0, store.fetch) as table:
            table.warm_up(_chunks(store, 300))
            held = table.stats()["size"]
            changed = store.keys[::3]
            store.set(changed, rng.standard_normal((changed.size, dim)).astype(np.float32))
            assert table.refresh() == held
            out = cp.empty((store.keys.size, dim), dtype=np.float32)
            table.lookup(cp.asarray(store.keys), out)
            np.testing.assert_array_equal(out.get(), store.fetch(store.keys))


def test_refresh_interval_runs_in_the_background(cp: Any, rng: np.random.Generator) -> None:
    dim = 8
    store = _store(rng, 1000, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, refresh_interval=0.05),
                           0, 10_000, 0, store.fetch) as table:
        table.warm_up(_chunks(store, 1000))
        # a pass already running when the rows change may have read the old ones: wait
        # for two whole passes after the change, so that one of them began after it
        before = table.stats()["refreshed"]
        store.set(store.keys, np.full((1000, dim), 3.0, dtype=np.float32))
        deadline = time.time() + 10
        while table.stats()["refreshed"] < before + 2000 and time.time() < deadline:
            time.sleep(0.02)
        out = cp.empty((1000, dim), dtype=np.float32)
        table.lookup(cp.asarray(store.keys), out)
        assert table.stats()["misses"] == 0
        assert (out.get() == 3.0).all()


def _in_threads(worker: Any, n: int) -> None:
    """worker(0) … worker(n - 1), each on a thread of its own, all started, all joined."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_concurrent_lookups_with_background_inserts_and_refresh(
        cp: Any, rng: np.random.Generator, seed: int) -> None:
    """Several threads look up (on their own streams) while misses are inserted in the
    background and a refresh keeps running: each row is its key's row, or the default
    for a miss served asynchronously."""
    dim = 16
    store = _store(rng, 20_000, dim)
    errors: list[str] = []
    with GpuEmbeddingTable(_model(dim, gpucacheper=0.3, hit_rate_threshold=0.6,
                                  cache_refresh_percentage_per_iteration=0.2,
                                  refresh_interval=0.01),
                           0, 20_000, 0, store.fetch) as table:
        table.warm_up(_chunks(store, 1200))

        def worker(i: int) -> None:
            r = np.random.default_rng(seed + i)
            with cp.cuda.Stream(non_blocking=True):
                for _ in range(40):
                    keys = r.choice(store.keys[: 8000 + 1000 * i], int(r.integers(1, 4000)))
                    out = cp.empty((keys.size, dim), dtype=np.float32)
                    table.lookup(cp.asarray(keys), out)
                    got, want = out.get(), store.fetch(keys)
                    ok = (got == want).all(axis=1) | (got == DEFAULT).all(axis=1)
                    if not ok.all():
                        errors.append(f"thread {i}: {int((~ok).sum())} wrong rows")

        _in_threads(worker, 4)
        stats = table.stats()
    assert not errors, errors[:3]
    assert stats["async_inserts"] + stats["sync_fetches"] > 0 and stats["refreshed"] > 0


def test_threads_beyond_the_spare_states_serve_and_count_alike(
        cp: Any, rng: np.random.Generator) -> None:
    """The first SPARE_STATES threads take states built at load, the others build their
    own: every thread's rows are exact and every lookup is counted once."""
    dim = 16
    store = _store(rng, 6000, dim)
    threads_n = SPARE_STATES + 2
    errors: list[str] = []
    with GpuEmbeddingTable(_model(dim, gpucacheper=0.5, hit_rate_threshold=1.0),
                           0, 6000, 0, store.fetch) as table:
        batches = [rng.choice(store.keys, (10, 500)) for _ in range(threads_n)]
        keys_in = [cp.asarray(b) for b in batches]
        outs = [cp.empty((10, 500, dim), dtype=np.float32) for _ in range(threads_n)]
        cp.cuda.Device().synchronize()

        def worker(i: int) -> None:
            # the thread's first CUDA work is the lookup itself (no stream or array made
            # here first): a spare state must make the device's context current itself
            for j in range(10):
                table.lookup(keys_in[i][j], outs[i][j])
            cp.cuda.get_current_stream().synchronize()
            if not (outs[i].get() == store.fetch(batches[i].ravel()).reshape(10, 500, dim)).all():
                errors.append(f"thread {i}: wrong rows")

        _in_threads(worker, threads_n)
        stats = table.stats()
    assert not errors, errors[:3]
    assert stats["hits"] + stats["misses"] == threads_n * 10 * 500


def test_argument_errors(cp: Any, rng: np.random.Generator) -> None:
    dim = 8
    store = _store(rng, 100, dim)
    with GpuEmbeddingTable(_model(dim), 0, 100, 0, store.fetch) as table:
        with pytest.raises(KeyTypeError, match="int64"):
            table.lookup(cp.arange(3, dtype=cp.float32), cp.empty((3, dim), cp.float32))
        with pytest.raises(OutputBufferError, match="float32"):
            table.lookup(cp.arange(3), cp.empty((3, dim), cp.float16))
        with pytest.raises(OutputBufferError, match=r"\[3, 8\]"):
            table.lookup(cp.arange(3), cp.empty((3, dim + 1), cp.float32))
        ro = np.empty((3, dim), np.float32)
        ro.flags.writeable = False
        with pytest.raises(OutputBufferError, match="read-only"):
            table.lookup(np.arange(3), ro)
    with pytest.raises(DeviceError, match="closed"):
        table.lookup(cp.arange(3), cp.empty((3, dim), cp.float32))


# -- intake of any DLPack producer (hps/intake/keys.py) and the HPS API ------------------------

def _producers(cp: Any, torch: Any, keys: np.ndarray, n: int, dim: int
               ) -> list[tuple[str, Any, Any, Any]]:
    """(name, keys object, out object, read back out as numpy)."""
    import torch.utils.dlpack as tdl

    out: list[tuple[str, Any, Any, Any]] = []
    ck, co = cp.asarray(keys), cp.empty((n, dim), dtype=cp.float32)
    out.append(("cupy", ck, co, lambda: co.get()))
    tk = torch.as_tensor(keys, device="cuda")
    to = torch.empty((n, dim), dtype=torch.float32, device="cuda")
    out.append(("torch", tk, to, lambda: to.cpu().numpy()))
    tk2 = torch.as_tensor(keys, device="cuda")
    to2 = torch.empty((1, n * dim), dtype=torch.float32, device="cuda")  # HugeCTR's shape
    out.append(("capsule", tdl.to_dlpack(tk2), tdl.to_dlpack(to2),
                lambda: tdl.from_dlpack(tdl.to_dlpack(to2)).cpu().numpy().reshape(n, dim)))
    tk3 = torch.as_tensor(keys.astype(np.int32), device="cuda")  # narrower keys, widened
    to3 = torch.empty((n, dim), dtype=torch.float32, device="cuda")
    out.append(("torch-int32", tk3, to3, lambda: to3.cpu().numpy()))
    ho = np.empty((n, dim), dtype=np.float32)
    out.append(("numpy", keys.copy(), ho, lambda: ho))
    return out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_every_dlpack_producer_through_keys_intake(cp: Any, rng: np.random.Generator) -> None:
    import torch

    from hps.intake import keys as keys_mod

    dim = 16
    store = _store(rng, 3000, dim, span=2**31)  # int32-representable keys
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, hit_rate_threshold=1.5),
                           0, 3000, 0, store.fetch) as table:
        keys = rng.choice(store.keys, 500)
        for name, k, o, read in _producers(cp, torch, keys, 500, dim):
            karr = keys_mod.as_key_array(k)
            oarr = keys_mod.as_output_array(o, karr.size, dim)
            table.lookup(karr, oarr)
            cp.cuda.get_current_stream().synchronize()
            np.testing.assert_array_equal(read(), store.fetch(keys), err_msg=name)


def _write_model(folder: Path, keys: np.ndarray, rows: np.ndarray) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    keys.astype("<i8").tofile(folder / "key")
    rows.astype("<f4").tofile(folder / "emb_vector")
    return str(folder)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("cache_type", ["dynamic", "static", "uvm"])
def test_hps_lookup_fromdlpack(cp: Any, rng: np.random.Generator, tmp_path: Path,
                               cache_type: str) -> None:
    import torch

    from hps import api

    dim, n = 16, 4000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    config = {
        "supportlonglong": True,
        "models": [{
            "model": "m", "sparse_files": [_write_model(tmp_path / "t0", keys, rows)],
            "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [64],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
            "max_batch_size": 64, "gpucache": True, "gpucacheper": 0.5,
            "cache_refresh_percentage_per_iteration": 0.25, "hit_rate_threshold": 1.1,
            "embedding_cache_type": cache_type,
        }],
        "volatile_db": {"type": "hash_map"},
    }
    expected = dict(zip(keys.tolist(), rows, strict=True))
    hps = api.HPS(config)
    try:
        gpu = hps.server.model("m").tables[0].gpu
        assert 0 in gpu, "the server did not attach a GPU table"
        assert gpu[0].stats()["size"] > 0  # warmed up
        q = np.r_[rng.choice(keys, 2000), [2**45]].astype(np.int64)
        want = np.stack([expected.get(k, np.full(dim, DEFAULT, np.float32)) for k in q.tolist()])
        tk = torch.as_tensor(q, device="cuda")
        to = torch.empty((q.size, dim), dtype=torch.float32, device="cuda")
        hps.lookup_fromdlpack(tk, to, "m", 0)
        np.testing.assert_array_equal(to.cpu().numpy(), want)
        import torch.utils.dlpack as tdl

        co = torch.zeros((1, q.size * dim), dtype=torch.float32, device="cuda")
        capsule = tdl.to_dlpack(co)
        hps.lookup_fromdlpack(tdl.to_dlpack(tk), capsule, "m", 0)
        # HugeCTR's callers read the output capsule again afterwards
        np.testing.assert_array_equal(
            tdl.from_dlpack(capsule).cpu().numpy().reshape(q.size, dim), want)
        np.testing.assert_array_equal(hps.lookup(q, "m", 0), want)
        assert gpu[0].stats()["hits"] > 0
    finally:
        hps.close()


def test_large_miss_batches_are_exact(cp: Any, rng: np.random.Generator,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """More misses than the host dedupe takes (HOST_MISSES): no dedupe, set codes sorted on
    the device, rows fetched in chunks on the fetch threads and sent chunk by chunk."""
    from hps.gpu import table as lookup_module

    monkeypatch.setattr(lookup_module, "CHUNK_BYTES", 1 << 16)  # many chunks
    dim = 12
    store = _store(rng, 300_000, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=0.5, hit_rate_threshold=1.01), 0,
                           300_000, 0, store.fetch) as table:
        keys = np.r_[rng.choice(store.keys, 150_000), [2**50] * 3].astype(np.int64)
        assert keys.size > lookup_module.HOST_MISSES
        for _ in range(2):  # cold, then mostly held
            out = cp.full((keys.size, dim), np.nan, dtype=np.float32)
            table.lookup(cp.asarray(keys), out)
            np.testing.assert_array_equal(out.get(), store.fetch(keys))
        stats = table.stats()
        assert stats["hits"] > 0 and stats["size"] > 100_000


@pytest.mark.parametrize(("hits", "synchronous"), [(92, True), (93, False), (94, False)])
def test_hit_rate_threshold_boundary(cp: Any, rng: np.random.Generator, hits: int,
                                     synchronous: bool) -> None:
    """100 distinct keys against hit_rate_threshold 0.93: 92 hits (below) fetch the misses
    before returning, 93 (at; 1 - 7/100 is 0.9299999999999999 in floats) and 94 (above)
    answer the misses with the default and fetch them in the background."""
    dim = 8
    store = _store(rng, 1000, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, hit_rate_threshold=0.93),
                           0, 10_000, 0, store.fetch) as table:
        table.warm_up(_chunks(store, 500)[:1])  # store.keys[:500] cached
        keys = np.r_[store.keys[:hits], store.keys[900:900 + 100 - hits]]
        assert np.unique(keys).size == 100
        out = cp.empty((100, dim), dtype=np.float32)
        table.lookup(cp.asarray(keys), out)
        got = out.get()
        np.testing.assert_array_equal(got[:hits], store.fetch(keys[:hits]))
        if synchronous:
            np.testing.assert_array_equal(got[hits:], store.fetch(keys[hits:]))
        else:
            assert (got[hits:] == DEFAULT).all()


@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("gpucacheper", [0.05, 0.5, 0.9])
def test_a_warmed_up_cache_holds_what_it_promises(cp: Any, rng: np.random.Generator,
                                                  gpucacheper: float, dim: int) -> None:
    """At least 0.97 of min(table keys, capacity) after a full warm-up, and exactly what
    the NumPy model of the same policy holds after the same inserts."""
    n = 100_000
    store = _store(rng, n, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=gpucacheper,
                                  cache_refresh_percentage_per_iteration=0.5),
                           0, n, 0, store.fetch) as table:
        capacity = table.capacity
        assert capacity == int(np.ceil(gpucacheper * n))
        chunk = capacity // 2 + 1
        assert table.warm_up(_chunks(store, chunk)) == capacity
        stats = table.stats()
        assert stats["size"] >= 0.97 * min(n, capacity), stats
        model = ReferenceCache(table._table.num_slots, dim)
        for i in range(0, capacity, chunk):
            part = store.keys[i:min(i + chunk, capacity)]
            model.insert(part, np.zeros((part.size, dim), np.float32))
        assert stats["size"] == model.size()
        assert stats["slots"] == cache_slots(capacity) + (-cache_slots(capacity)) % 8
        assert stats["memory_bytes"] == EmbeddingCache.memory_required(stats["slots"], dim)


def test_gpucacheper_one_holds_the_whole_table(cp: Any, rng: np.random.Generator) -> None:
    n, dim = 60_000, 16
    store = _store(rng, n, dim)
    with GpuEmbeddingTable(_model(dim, gpucacheper=1.0, hit_rate_threshold=1.01,
                                  cache_refresh_percentage_per_iteration=0.25),
                           0, n, 0, store.fetch) as table:
        assert table.warm_up(_chunks(store, n // 4)) == n
        stats = table.stats()
        assert stats["size"] == n and stats["mode"] == "dynamic"
        assert stats["memory_bytes"] == StaticEmbeddingTable.memory_required(n, dim)
        calls = store.calls
        for _ in range(3):  # any batch of the table's keys: hit rate 1.0
            keys = rng.choice(store.keys, 20_000)
            out = cp.full((keys.size, dim), np.nan, dtype=np.float32)
            table.lookup(cp.asarray(keys), out)
            np.testing.assert_array_equal(out.get(), store.fetch(keys))
        assert table.stats()["misses"] == 0 and store.calls == calls + 3
