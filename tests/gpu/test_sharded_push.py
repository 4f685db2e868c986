"""Large batches of a sharded dynamic cache pushed (hps/gpu/sharded_query.py): each device
serves the keys of the shards it holds and writes their rows into the caller's output,
from callers on every device, with misses fetched and inserted and online updates
meanwhile; every row exact against the model. Memory the peers may not reach (a
stream-ordered pool's) is pulled instead. Runs where there are two devices or more."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gpu.sharded_query import PUSH_AFTER
from tests.support.one_pass_calls import record_compiled_calls

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

DEFAULT = -0.5
DIM = 32
BATCH = PUSH_AFTER + 4321  # pushed, and not a multiple of any launch's keys per round


def _server(tmp_path: Path, keys: np.ndarray, rows: np.ndarray, devices: list[int],
            **model: Any) -> Any:
    from hps import api, write_sparse_model

    write_sparse_model(tmp_path / "t0", keys, rows)
    return api.HPS({
        "supportlonglong": True,
        "models": [{
            "model": "m", "sparse_files": [str(tmp_path / "t0")],
            "embedding_vecsize_per_table": [DIM],
            "maxnum_catfeature_query_per_table_per_sample": [BATCH],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": devices,
            "max_batch_size": 1, "gpucache": True, "gpu_sharding": "row_wise",
            "gpucacheper": 0.5, "hit_rate_threshold": 1.1, "init_ec": False, **model,
        }],
        "volatile_db": {"type": "hash_map"},
    })


class Model:
    """The rows every tier serves: the file's, then the updates'."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self.order = np.argsort(keys)
        self.keys, self.rows = keys[self.order], rows[self.order].copy()

    def expected(self, q: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(self.keys, q), self.keys.size - 1)
        found = self.keys[at] == q
        want = np.full((q.size, DIM), DEFAULT, np.float32)
        want[found] = self.rows[at[found]]
        return want

    def update_online(self, server: Any, keys: np.ndarray, rng: np.random.Generator) -> None:
        """New rows for `keys`, 1,000 at a time, as hps/server/updates.py applies them:
        the tiers, then the caches of table 0 of model "m"; the model follows."""
        table = server.model("m").tables[0]
        for start in range(0, keys.size, 1000):
            part = keys[start:start + 1000]
            fresh = rng.standard_normal((part.size, DIM)).astype(np.float32)
            server.tiers.volatile.insert(table.storage_name, part, fresh)
            server._gpu.writer("m", table)(part, fresh)
            self.rows[np.searchsorted(self.keys, part)] = fresh


def wrong_rows(hps: Any, device: int, q: np.ndarray, model: Model) -> int:
    """Rows of a lookup of `q` (torch keys and output on `device`) that the model does not
    give."""
    import torch

    out = torch.full((q.size, DIM), np.nan, device=f"cuda:{device}")
    hps.lookup_fromdlpack(torch.as_tensor(q, device=f"cuda:{device}"), out, "m", 0)
    return int((out.cpu().numpy() != model.expected(q)).any(axis=1).sum())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("layout", [
    {},  # dynamic shards caching half the table, filling from their misses
    {"gpucacheper": 1.0, "hit_rate_threshold": 1.0},  # shards holding the whole table
    {"embedding_cache_type": "static", "init_ec": True}])
def test_pushed_batches_are_exact_from_every_device_with_misses_and_updates(
        cp: Any, rng: np.random.Generator, tmp_path: Path, layout: dict[str, Any]) -> None:
    import torch

    devices = list(range(int(cp.cuda.runtime.getDeviceCount())))
    assert len(devices) >= 2, "run on a machine with two GPUs or more"
    keys = rng.choice(2**40, 400_000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    model = Model(keys, rows)
    updated, steady = keys[:5000], keys[5000:]
    hps = _server(tmp_path, keys, rows, devices, **layout)
    try:
        server = hps.server
        table = server.model("m").tables[0]
        queries = {d: table.gpu[d]._one_pass for d in devices}
        assert all(q is not None and q.push_after == PUSH_AFTER for q in queries.values())
        errors: list[str] = []
        stop = threading.Event()

        def caller(device: int, seed: int) -> None:
            try:
                torch.cuda.set_device(device)
                r = np.random.default_rng(seed)
                while not stop.is_set():
                    q = r.choice(steady, BATCH)
                    q[::20] = r.integers(2**41, 2**42, q[::20].size)  # in no tier
                    bad = wrong_rows(hps, device, q, model)
                    if bad:
                        errors.append(f"keys on cuda:{device}: {bad} wrong rows")
            except Exception as exc:  # reported below
                errors.append(f"keys on cuda:{device}: {exc!r}")

        threads = [threading.Thread(target=caller, args=(d, 7 + d)) for d in devices]
        for t in threads:
            t.start()
        try:
            # online updates meanwhile (the callers read none of these keys)
            model.update_online(server, updated, rng)
            deadline = time.monotonic() + 60
            while (min(q.pushed for q in queries.values()) < 3 and not errors
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert not errors, errors[:10]
        assert min(q.pushed for q in queries.values()) >= 3, "the large batches were not pushed"
        # the updated rows, pushed, from every device
        for device in devices:
            q = np.r_[updated, rng.choice(steady, BATCH - updated.size)]
            before = queries[device].pushed
            with cp.cuda.Device(device):
                out = cp.empty((q.size, DIM), cp.float32)
                hps.lookup_fromdlpack(cp.asarray(q), out, "m", 0)
                np.testing.assert_array_equal(out.get(), model.expected(q))
            assert queries[device].pushed == before + 1
        stats = table.gpu[0].stats()
        assert stats["one_pass"]["misses"] > 0 and stats["one_pass"]["hits"] > 0  # unknown keys
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_memory_the_peers_cannot_reach_is_pulled(cp: Any, rng: np.random.Generator,
                                                  tmp_path: Path) -> None:
    """Keys and output from CUDA's stream-ordered pool (cudaMallocAsync), which grants
    peers no access unless asked: the batch is pulled, exact."""
    devices = list(range(int(cp.cuda.runtime.getDeviceCount())))
    assert len(devices) >= 2, "run on a machine with two GPUs or more"
    keys = rng.choice(2**40, 200_000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    model = Model(keys, rows)
    hps = _server(tmp_path, keys, rows, devices)
    try:
        query = hps.server.model("m").tables[0].gpu[0]._one_pass
        q = rng.choice(keys, BATCH)
        with cp.cuda.Device(0):
            plain_out = cp.empty((q.size, DIM), cp.float32)
            hps.lookup_fromdlpack(cp.asarray(q), plain_out, "m", 0)
            assert query.pushed == 1
            pool = cp.cuda.MemoryAsyncPool()
            with cp.cuda.using_allocator(pool.malloc):
                pooled_keys = cp.asarray(q)
                pooled_out = cp.empty((q.size, DIM), cp.float32)
            hps.lookup_fromdlpack(pooled_keys, pooled_out, "m", 0)
            assert query.pushed == 1  # pulled
            np.testing.assert_array_equal(pooled_out.get(), model.expected(q))
            np.testing.assert_array_equal(plain_out.get(), model.expected(q))
    finally:
        hps.close()


def _all_hits_server(cp: Any, rng: np.random.Generator, tmp_path: Path
                     ) -> tuple[Any, np.ndarray, Model]:
    """A server over 50,000 keys sharded over every device, each shard caching all of
    its keys (filled by the first lookups' misses); its keys and their model."""
    devices = list(range(int(cp.cuda.runtime.getDeviceCount())))
    assert len(devices) >= 2, "run on a machine with two GPUs or more"
    keys = rng.choice(2**40, 50_000, replace=False).astype(np.int64)
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, devices, gpucacheper=1.0, hit_rate_threshold=1.0)
    return hps, keys, Model(keys, rows)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_compiled_one_pass_serves_its_own_device_and_leaves_others_to_the_switch(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    """Small all-hit batches on device 0 take the one pass's compiled call, which checks
    the current context: looked up while device 1 is current, the call refuses (nothing
    launched) and the lookup switches to device 0 and back, the rows exact; with device 0
    current it serves at once."""
    from hps.gpu.fast_query import FALLBACK

    hps, keys, model = _all_hits_server(cp, rng, tmp_path)
    try:
        query = hps.server.model("m").tables[0].gpu[0]._one_pass
        results = record_compiled_calls(query)
        q = rng.choice(keys, 1500)
        with cp.cuda.Device(0):
            device_keys = cp.asarray(q)
            out = cp.empty((q.size, DIM), cp.float32)
            for _ in range(3):  # the misses fill the shards; then all hits
                hps.lookup_fromdlpack(device_keys, out, "m", 0)
            np.testing.assert_array_equal(out.get(), model.expected(q))
        results.clear()
        out.fill(0)
        with cp.cuda.Device(1):
            hps.lookup_fromdlpack(device_keys, out, "m", 0)
            assert cp.cuda.runtime.getDevice() == 1
        assert results == [FALLBACK, 0]  # refused in device 1's context, then served on 0
        np.testing.assert_array_equal(out.get(), model.expected(q))
        results.clear()
        out.fill(0)
        with cp.cuda.Device(0):
            hps.lookup_fromdlpack(device_keys, out, "m", 0)
        assert results == [0]
        np.testing.assert_array_equal(out.get(), model.expected(q))
    finally:
        hps.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_push_after_is_asked_at_each_lookup(cp: Any, rng: np.random.Generator,
                                            tmp_path: Path) -> None:
    """A thread's bound fast path does not keep the push_after it was bound under: set
    lower later (the bench's sweep sets 0: every batch), a small all-hit batch is pushed
    rather than pulled by the compiled call; set back, it is pulled again. Rows exact."""
    hps, keys, model = _all_hits_server(cp, rng, tmp_path)
    try:
        query = hps.server.model("m").tables[0].gpu[0]._one_pass
        q = rng.choice(keys, 1500)
        with cp.cuda.Device(0):
            device_keys = cp.asarray(q)
            out = cp.empty((q.size, DIM), cp.float32)
            for _ in range(3):  # bound, and the shards filled: all hits from here
                hps.lookup_fromdlpack(device_keys, out, "m", 0)
            assert query.pushed == 0
            query.push_after = 0
            out.fill(0)
            hps.lookup_fromdlpack(device_keys, out, "m", 0)
            assert query.pushed == 1
            np.testing.assert_array_equal(out.get(), model.expected(q))
            query.push_after = PUSH_AFTER
            out.fill(0)
            hps.lookup_fromdlpack(device_keys, out, "m", 0)
            assert query.pushed == 1
            np.testing.assert_array_equal(out.get(), model.expected(q))
    finally:
        hps.close()
