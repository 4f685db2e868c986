"""A table's GPU cache split row-wise into shards (hps/gpu/sharded.py), several shards on one
device: the routing, each shard's misses and its contents against the NumPy model, updates
reaching the owning shard, and every lookup entry of the public API exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gpu.cache_model import ReferenceCache
from hps.gpu.shard_routing import shard_of
from tests.support.one_pass_calls import record_compiled_calls

pytestmark = pytest.mark.gpu

DEFAULT = 0.5


def _write_model(folder: Path, keys: np.ndarray, rows: np.ndarray) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    keys.astype("<i8").tofile(folder / "key")
    rows.astype("<f4").tofile(folder / "emb_vector")
    return str(folder)


def _server(tmp_path: Path, keys: np.ndarray, rows: np.ndarray, **model: Any) -> Any:
    from hps import api

    config = {
        "supportlonglong": True,
        "models": [{
            "model": "m", "sparse_files": [_write_model(tmp_path / "t0", keys, rows)],
            "embedding_vecsize_per_table": [rows.shape[1]],
            "maxnum_catfeature_query_per_table_per_sample": [4096],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": True, "gpu_sharding": "row_wise",
            **model,
        }],
        "volatile_db": {"type": "hash_map"},
    }
    return api.HPS(config)


def _a_set_of_each_set(keys: np.ndarray, num_sets: list[int]) -> np.ndarray:
    """The first SET_SIZE keys (in `keys`' order) of each set of each shard, whose caches
    have `num_sets` sets each."""
    from hps.gpu.dynamic_cache import SET_SIZE, set_of

    owned = shard_of(keys, len(num_sets))
    sets = np.empty(keys.size, np.int64)
    for s, count in enumerate(num_sets):
        sets[owned == s] = set_of(keys[owned == s], count)
    group = owned.astype(np.int64) << 32 | sets
    order = np.argsort(group, kind="stable")
    grouped = group[order]
    starts = np.r_[0, np.flatnonzero(grouped[1:] != grouped[:-1]) + 1]
    rank = np.arange(keys.size) - np.repeat(starts, np.diff(np.r_[starts, keys.size]))
    return keys[order[rank < SET_SIZE]]


def _looked_up(cp: Any, hps: Any, q: np.ndarray, dim: int) -> np.ndarray:
    """The rows of host keys `q` through lookup_fromdlpack with CuPy arrays, to the host."""
    out = cp.empty((q.size, dim), cp.float32)
    hps.lookup_fromdlpack(cp.asarray(q), out, "m", 0)
    return out.get()


def _expected(keys: np.ndarray, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
    order = np.argsort(keys)
    at = np.minimum(np.searchsorted(keys[order], q), keys.size - 1)
    found = keys[order][at] == q
    want = np.full((q.size, rows.shape[1]), DEFAULT, np.float32)
    want[found] = rows[order][at[found]]
    return want


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cache_type,shards,storage", [
    ("dynamic", 3, "float32"), ("static", 2, "float32"), ("dynamic", 2, "float16")])
def test_sharded_lookups_are_exact_through_every_entry(
        cp: Any, rng: np.random.Generator, tmp_path: Path, cache_type: str, shards: int,
        storage: str) -> None:
    import torch
    import torch.utils.dlpack as tdl

    dim, n = 16, 6000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, gpu_shards=shards, embedding_cache_type=cache_type,
                  gpucacheper=0.5, hit_rate_threshold=1.1, embedding_storage_dtype=storage,
                  cache_refresh_percentage_per_iteration=0.25)
    if storage == "float16":  # the stored rows, widened back: what every tier serves
        rows = rows.astype(np.float16).astype(np.float32)
    try:
        view = hps.server.model("m").tables[0].gpu[0]
        assert view.stats()["shards"] == shards
        for _ in range(3):
            q = np.r_[rng.choice(keys, 3000), [2**45, -7]].astype(np.int64)
            want = _expected(keys, rows, q)
            tk = torch.as_tensor(q, device="cuda")
            to = torch.empty((q.size, dim), dtype=torch.float32, device="cuda")
            hps.lookup_fromdlpack(tk, to, "m", 0)
            np.testing.assert_array_equal(to.cpu().numpy(), want)
            co = cp.empty((q.size, dim), cp.float32)
            hps.lookup_fromdlpack(cp.asarray(q), co, "m", 0)
            np.testing.assert_array_equal(co.get(), want)
            capsule = tdl.to_dlpack(torch.zeros((q.size, dim), device="cuda"))
            hps.lookup_fromdlpack(tdl.to_dlpack(tk), capsule, "m", 0)
            np.testing.assert_array_equal(tdl.from_dlpack(capsule).cpu().numpy(), want)
            np.testing.assert_array_equal(hps.lookup(q, "m", 0), want)  # host keys
            strided = np.zeros((q.size, dim * 2), np.float32)[:, ::2]  # a strided host output
            view.lookup(q, strided)
            np.testing.assert_array_equal(strided, want)
        stats = view.stats()
        per_shard = [p["keys"] for p in stats["per_shard"]]
        # the one pass counts its keys itself, its misses too (it serves them:
        # hps/gpu/sharded_misses.py; the unknown keys at least), the shards the misses of
        # the entries it does not serve (a float16 output)
        one_pass = stats["one_pass"]
        assert sum(per_shard) + one_pass["keys"] == stats["keys"] > 0
        assert one_pass["hits"] + one_pass["misses"] == one_pass["keys"] > 0
        assert one_pass["misses"] > 0
        assert min(p["size"] for p in stats["per_shard"]) > 0  # every shard holds its share
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_shard_holds_its_keys_as_the_numpy_model_of_its_cache(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    """No warm-up; each batch's misses are fetched once and inserted into the shard that
    owns them, so after every batch each shard holds what the NumPy model of its cache
    holds when given the keys of its shard, and each missed key was fetched once. (The
    batches are drawn from at most a set's worth of keys of each set of each shard: no set
    overflows, so the held keys do not depend on the order of inserts within a batch,
    which follows the order the kernel listed its misses in.)"""
    dim, n, shards = 8, 20000, 3
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, gpu_shards=shards, gpucacheper=0.5,
                  hit_rate_threshold=1.1, init_ec=False)
    try:
        owner = hps.server.model("m").tables[0].gpu[0].owner
        caches = [shard._table for shard in owner.shards]
        models = [ReferenceCache(c.num_slots, dim) for c in caches]
        pool = _a_set_of_each_set(keys, [c.num_sets for c in caches])
        seen: set[int] = set()
        for _ in range(4):
            q = rng.permutation(np.unique(rng.choice(pool, 800))).astype(np.int64)
            out = cp.empty((q.size, dim), cp.float32)
            hps.lookup_fromdlpack(cp.asarray(q), out, "m", 0)
            np.testing.assert_array_equal(out.get(), _expected(keys, rows, q))
            owned = shard_of(q, shards)
            for s, model in enumerate(models):
                mine = q[owned == s]
                _, missed = model.query(mine, DEFAULT)
                if missed.any():
                    model.insert(mine[missed], _expected(keys, rows, mine[missed]))
            seen.update(q.tolist())
        cp.cuda.Device(0).synchronize()
        for s, (cache, model) in enumerate(zip(caches, models, strict=True)):
            held = np.sort(cache.dump(0, cache.num_sets).get())
            np.testing.assert_array_equal(held, model.dump(0, model.num_sets))
            assert held.size > 0 and np.all(shard_of(held, shards) == s)
        assert owner.stats()["sync_fetches"] == len(seen)  # each missed key fetched once
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("every_device", [False, True])
def test_the_warm_up_fills_each_shard_in_file_order_as_the_numpy_model(
        cp: Any, rng: np.random.Generator, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, every_device: bool) -> None:
    """The warm-up (cache_refresh_percentage_per_iteration) sends each chunk to the
    first device, in parts (a small part size here: several a chunk), and from there to
    the others (shards on every device where there are several); each device picks out
    its shards' keys and inserts them in file order until each shard holds its capacity:
    each shard holds what the NumPy model of its cache holds given the same inserts. The
    sets overflow (more keys a shard than it holds), so the order is checked too."""
    from hps.gpu import sharded

    dim, n, part = 8, 30000, 700
    monkeypatch.setattr(sharded, "WARM_PART_BYTES", part * dim * 4)
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    devices = list(range(int(cp.cuda.runtime.getDeviceCount()))) if every_device else [0]
    # three shards, or one a device where there are more (gpu_shards >= devices); on two
    # devices a device holds two shards, on one all three
    shards = max(3, len(devices))
    hps = _server(tmp_path, keys, rows, gpu_shards=shards, gpucacheper=0.5,
                  cache_refresh_percentage_per_iteration=0.25, hit_rate_threshold=1.1,
                  deployed_device_list=devices)
    try:
        owner = hps.server.model("m").tables[0].gpu[0].owner
        caches = [shard._table for shard in owner.shards]
        models = [ReferenceCache(c.num_slots, dim) for c in caches]
        room = [int(shard.capacity) for shard in owner.shards]
        chunk = int(0.25 * owner.capacity)  # hps/server/gpu_caches.py _warm_chunk
        owned = shard_of(keys, shards)
        for first in range(0, n, chunk):
            for start in range(first, min(first + chunk, n), part):
                stop = min(start + part, first + chunk, n)
                for s, model in enumerate(models):
                    mine = np.flatnonzero(owned[start:stop] == s)[:max(room[s], 0)] + start
                    room[s] -= mine.size
                    if mine.size:
                        model.insert(keys[mine], rows[mine])
        assert min(room) <= 0  # every shard was filled to its capacity
        for cache, model in zip(caches, models, strict=True):
            held = np.sort(cache.dump(0, cache.num_sets).get())
            np.testing.assert_array_equal(held, model.dump(0, model.num_sets))
        q = rng.choice(keys, 3000)
        np.testing.assert_array_equal(_looked_up(cp, hps, q, dim), _expected(keys, rows, q))
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_misses_above_the_hit_rate_threshold_are_inserted_later(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    """HugeCTR's semantics on a sharded table: a batch whose hit rate reaches the
    threshold keeps the default rows of its misses, and their shards insert them in the
    background, after which they are served."""
    dim, shards = 8, 2
    keys = rng.choice(2**40, 20000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, dim)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, gpu_shards=shards, gpucacheper=0.5,
                  hit_rate_threshold=0.5, init_ec=False)
    try:
        view = hps.server.model("m").tables[0].gpu[0]
        known = np.unique(rng.choice(keys, 1000))
        out = cp.empty((known.size, dim), cp.float32)
        hps.lookup_fromdlpack(cp.asarray(known), out, "m", 0)  # all miss: fetched now
        np.testing.assert_array_equal(out.get(), _expected(keys, rows, known))
        new = np.setdiff1d(np.unique(rng.choice(keys, 200)), known)
        q = np.r_[known, new]  # most held: above the threshold
        out = cp.empty((q.size, dim), cp.float32)
        hps.lookup_fromdlpack(cp.asarray(q), out, "m", 0)
        got = out.get()
        np.testing.assert_array_equal(got[:known.size], _expected(keys, rows, known))
        assert np.all(got[known.size:] == DEFAULT)  # the new keys' rows come later
        for shard in view.owner.shards:
            shard._inserts.wait_idle(timeout=30)
        hps.lookup_fromdlpack(cp.asarray(q), out, "m", 0)
        np.testing.assert_array_equal(out.get(), _expected(keys, rows, q))
        stats = view.stats()
        assert stats["async_inserts"] == new.size
        assert stats["sync_fetches"] == known.size
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_updates_and_refresh_reach_the_owning_shard(cp: Any, rng: np.random.Generator,
                                                    tmp_path: Path) -> None:
    dim, n, shards = 8, 4000, 4
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, gpu_shards=shards, embedding_cache_type="static")
    try:
        server = hps.server
        table = server.model("m").tables[0]
        view = table.gpu[0]
        assert view.stats()["size"] == n  # the static shards together hold the table

        def lookup_all_hits(q: np.ndarray) -> np.ndarray:
            before = view.stats()["hits"]
            got = _looked_up(cp, hps, q, dim)
            assert view.stats()["hits"] - before == q.size
            return got

        # an online update: the tiers first, then the caches, as hps/server/updates.py does
        changed = rng.choice(keys, 500, replace=False)
        fresh = rng.standard_normal((changed.size, dim)).astype(np.float32)
        server.tiers.volatile.insert(table.storage_name, changed, fresh)
        server._gpu.writer("m", table)(changed, fresh)
        np.testing.assert_array_equal(lookup_all_hits(changed), fresh)
        # a refresh re-reads every shard's keys from the tiers
        others = np.setdiff1d(keys, changed)[:700]
        newer = rng.standard_normal((others.size, dim)).astype(np.float32)
        server.tiers.volatile.insert(table.storage_name, others, newer)
        assert hps.server.refresh("m") == n
        np.testing.assert_array_equal(lookup_all_hits(others), newer)
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_one_pass_runs_compiled_while_no_write_is_pending(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    """The one pass's fast path (hps/gpu/sharded_query.py) serves the lookups between
    writes; a write closes its shard's gate, the next lookup takes the locked path, sees
    the write, and reopens the gates for the ones after it. Every row exact."""
    from hps.gpu.fast_query import FALLBACK

    dim, n, shards = 8, 4000, 2
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, gpu_shards=shards, embedding_cache_type="static")
    try:
        server = hps.server
        table = server.model("m").tables[0]
        one_pass = table.gpu[0]._one_pass
        results = record_compiled_calls(one_pass)

        q = rng.choice(keys, 1000)
        for _ in range(4):
            np.testing.assert_array_equal(_looked_up(cp, hps, q, dim),
                                          _expected(keys, rows, q))
        assert results[-3:] == [0, 0, 0]  # compiled, all hits (the first may reopen the gates)
        changed = rng.choice(keys, 300, replace=False)
        fresh = rng.standard_normal((changed.size, dim)).astype(np.float32)
        server.tiers.volatile.insert(table.storage_name, changed, fresh)
        server._gpu.writer("m", table)(changed, fresh)  # closes the written shards' gates
        results.clear()
        for _ in range(3):  # the locked path reopens once it finds the write done
            np.testing.assert_array_equal(_looked_up(cp, hps, changed, dim), fresh)
        assert results[0] == FALLBACK and results[-1] == 0
    finally:
        hps.close()
