"""One GPU cache for every process of the host (gpu_cache_scope: host,
hps/gpu/shared_cache.py), on a GPU: processes that map the owner's cache serve exact rows
through the public call while every process's misses are inserted into it, a process is
SIGKILLed mid-lookup, and a reload of new files moves the processes to a new cache."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DIM, N, KEYS = 16, 512, 40_000


def _config(folder: Path, cached: float = 0.25) -> dict[str, Any]:
    return {"supportlonglong": True, "models": [{
        "model": "m", "sparse_files": [str(folder)], "embedding_vecsize_per_table": [DIM],
        "maxnum_catfeature_query_per_table_per_sample": [N],
        "default_value_for_each_table": [0.0], "deployed_device_list": [0],
        "max_batch_size": 1, "gpucache": True, "gpucacheper": cached,
        "hit_rate_threshold": 1.0, "gpu_cache_scope": "host"}],
        "volatile_db": {"type": "hash_map"}}


@pytest.fixture()
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from hps import write_sparse_model

    monkeypatch.setenv("HPS_SHM_DIR", str(tmp_path / "shm"))
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    keys = rng.choice(2**40, KEYS, replace=False).astype(np.int64)
    write_sparse_model(tmp_path / "t0", keys, rng.standard_normal((KEYS, DIM)).astype(np.float32))
    return tmp_path / "t0"


def _expected(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    keys = np.fromfile(folder / "key", np.int64)
    return keys, np.fromfile(folder / "emb_vector", np.float32).reshape(-1, DIM)


def _lookups(folder: str, shm: str, seconds: float, seed: int, ready: Any, out: Any) -> None:
    """A caller process: maps the cache, looks up mixed hits and misses (known and unknown
    keys) with torch tensors on its own stream, checks every row; puts (calls, wrong,
    attached)."""
    os.environ["HPS_SHM_DIR"] = shm
    import torch

    from hps.api import HPS

    hps = HPS(_config(Path(folder)))
    keys, rows = _expected(Path(folder))
    rng = np.random.default_rng(seed)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    result = torch.empty((N, DIM), device="cuda")
    attached = hps.server.model("m").tables[0].gpu[0].attached  # type: ignore[attr-defined]
    ready.put(os.getpid())
    calls = wrong = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pick = rng.integers(0, KEYS + KEYS // 10, N)  # a tenth of the keys unknown
        batch = np.where(pick < KEYS, keys[np.minimum(pick, KEYS - 1)], -1 - pick)
        hps.lookup_fromdlpack(torch.as_tensor(batch, device="cuda"), result, "m", 0)
        stream.synchronize()
        want = np.where((pick < KEYS)[:, None], rows[np.minimum(pick, KEYS - 1)], 0.0)
        wrong += int((result.cpu().numpy() != want).any(axis=1).sum())
        calls += 1
    hps.close()
    out.put((calls, wrong, attached))


def test_processes_share_one_cache_and_every_row_is_exact(model: Path) -> None:
    import cupy

    from hps.api import HPS

    owner = HPS(_config(model))  # this process allocates the cache
    table = owner.server.model("m").tables[0]
    gpu = table.gpu[0]
    assert not gpu.attached and gpu.stats()["scope"] == "host"
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    shm = os.environ["HPS_SHM_DIR"]
    procs = [ctx.Process(target=_lookups, args=(str(model), shm, 6.0, s, ready, out))
             for s in range(4)]
    for p in procs:
        p.start()
    pids = [ready.get(timeout=300) for _ in procs]
    assert gpu.stats()["processes"] == 5
    victim = procs[3]
    time.sleep(1.0)
    os.kill(victim.pid, signal.SIGKILL)  # mid-lookup: the others lose nothing
    keys, rows = _expected(model)
    rng = np.random.default_rng(7)
    wrong = 0
    for _ in range(200):  # the owner looks up too, host keys through HPS.lookup
        pick = rng.integers(0, KEYS, N)
        got = owner.lookup(keys[pick], "m", 0)
        wrong += int((np.asarray(got) != rows[pick]).any(axis=1).sum())
    results = [out.get(timeout=300) for _ in procs[:3]]
    for p in procs:
        p.join(60)
    assert wrong == 0
    assert all(r[0] > 10 for r in results)
    assert [r[1] for r in results] == [0, 0, 0]
    assert all(r[2] for r in results)  # they mapped it, none allocated its own
    assert gpu.stats()["size"] > 0 and victim.pid in pids
    # one cache: what the other processes took on this device is their contexts and
    # buffers, never another cache's rows (the cache itself is 4 x larger than this bound)
    assert gpu._table.memory_bytes() > 0  # noqa: SLF001
    assert free_before - cupy.cuda.runtime.memGetInfo()[0] < 4 * gpu._table.memory_bytes() + (
        4 << 30)
    owner.close()
