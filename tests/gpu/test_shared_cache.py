"""One GPU cache for every process of the host (gpu_cache_scope: host,
hps/gpu/shared_cache.py), on a GPU: processes that map the owner's cache serve exact rows
through the public call while every process's misses are inserted into it and a process is
SIGKILLed mid-lookup; while every process reloads the same files, online updates arrive
through a real Redis stream and the owner is SIGKILLed, every row stays exact, and a
process that loads afterwards makes a new cache."""

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


class _Caller:
    """A caller process's side: its HPS over the model files, on a torch stream of its own
    (made current), and a lookup of mixed known and unknown keys whose every row it
    checks against the files."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        import torch

        from hps.api import HPS

        self.torch = torch
        self.hps = HPS(config)
        self.keys, self.rows = _expected(folder)
        self.stream = torch.cuda.Stream()
        torch.cuda.set_stream(self.stream)
        self.result = torch.empty((N, DIM), device="cuda")
        table = self.hps.server.model("m").tables[0]
        self.attached = table.gpu[0].attached  # type: ignore[attr-defined]

    def wrong_rows(self, pick: np.ndarray) -> int:
        """Looks up the file's keys at `pick` (past its end: unknown keys, the default
        row); the rows that differ from the file's."""
        keys, rows = self.keys, self.rows
        batch = np.where(pick < KEYS, keys[np.minimum(pick, KEYS - 1)], -1 - pick)
        self.hps.lookup_fromdlpack(self.torch.as_tensor(batch, device="cuda"), self.result,
                                   "m", 0)
        self.stream.synchronize()
        want = np.where((pick < KEYS)[:, None], rows[np.minimum(pick, KEYS - 1)], 0.0)
        return int((self.result.cpu().numpy() != want).any(axis=1).sum())


def _lookups(folder: str, shm: str, seed: int, ready: Any, killed: Any, stop: Any,
             out: Any) -> None:
    """A caller process: maps the cache, looks up mixed hits and misses (known and unknown
    keys) with torch tensors on its own stream until `stop`, checks every row; puts (calls
    after `killed`, wrong rows, attached, its longest call in s, when that began)."""
    os.environ["HPS_SHM_DIR"] = shm
    me = _Caller(Path(folder), _config(Path(folder)))
    rng = np.random.default_rng(seed)
    # the first call compiles what a cold machine has not cached yet (seconds): before the
    # others' lookups are counted, not among them
    wrong = me.wrong_rows(rng.integers(0, KEYS + KEYS // 10, N))
    ready.put(os.getpid())
    after = 0
    longest = (0.0, 0.0)
    while not stop.is_set():
        began, start = time.time(), time.monotonic()
        wrong += me.wrong_rows(rng.integers(0, KEYS + KEYS // 10, N))  # a tenth unknown
        longest = max(longest, (time.monotonic() - start, began))
        after += killed.is_set()
    me.hps.close()
    out.put((after, wrong, me.attached, *longest))


def test_processes_share_one_cache_and_every_row_is_exact(model: Path) -> None:
    import cupy

    from hps.api import HPS

    owner = HPS(_config(model))  # this process allocates the cache
    table = owner.server.model("m").tables[0]
    gpu = table.gpu[0]
    assert not gpu.attached and gpu.stats()["scope"] == "host"
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    ctx = mp.get_context("spawn")
    ready, out, killed, stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    shm = os.environ["HPS_SHM_DIR"]
    procs = [ctx.Process(target=_lookups, args=(str(model), shm, s, ready, killed, stop, out))
             for s in range(4)]
    for p in procs:
        p.start()
    pids = [ready.get(timeout=300) for _ in procs]
    assert gpu.stats()["processes"] == 5
    victim = procs[3]
    time.sleep(1.0)
    os.kill(victim.pid, signal.SIGKILL)  # mid-lookup: the others lose nothing
    at = time.time()
    killed.set()
    keys, rows = _expected(model)
    rng = np.random.default_rng(7)
    wrong = 0
    for _ in range(200):  # the owner looks up too, host keys through HPS.lookup
        pick = rng.integers(0, KEYS, N)
        got = owner.lookup(keys[pick], "m", 0)
        wrong += int((np.asarray(got) != rows[pick]).any(axis=1).sum())
    time.sleep(max(0.0, at + 3.0 - time.time()))
    stop.set()
    results = [out.get(timeout=300) for _ in procs[:3]]
    for p in procs:
        p.join(60)
    # each: calls after the kill, wrong rows, mapped, its longest call (s) and when that
    # began, from the kill (s)
    seen = [(r[0], r[1], r[2], round(r[3], 3), round(r[4] - at, 3)) for r in results]
    assert wrong == 0
    assert all(r[0] > 10 for r in results), seen  # every survivor went on serving
    assert [r[1] for r in results] == [0, 0, 0], seen
    assert all(r[2] for r in results)  # they mapped it, none allocated its own
    assert gpu.stats()["size"] > 0 and victim.pid in pids
    # one cache: what the other processes took on this device is their contexts and
    # buffers, never another cache's rows (the cache itself is 4 x larger than this bound)
    assert gpu._table.memory_bytes() > 0  # noqa: SLF001
    assert free_before - cupy.cuda.runtime.memGetInfo()[0] < 4 * gpu._table.memory_bytes() + (
        4 << 30)
    owner.close()


# -- the cache's life: reloads, online updates, the owner's death -----------------------

UPDATED = 2_000  # the first keys of the file, which the online updates change


def _new_rows() -> np.ndarray:
    return np.random.default_rng(99).standard_normal((UPDATED, DIM)).astype(np.float32)


def _following(folder: Path, port: int, group: str) -> dict[str, Any]:
    """The model, following a Redis stream with a consumer group of this process's own
    (every process applies every update to its own tiers: docs/updates.md)."""
    config = _config(folder)
    config["update_source"] = {"type": "redis_stream", "address": f"127.0.0.1:{port}",
                               "group": group, "poll_timeout_ms": 50}
    return config


def _applied(hps: Any) -> int:
    status = hps.server.update_status()
    return sum(int(t.get("rows", 0)) for t in status["tables"].values()) if status else 0


def _hold(folder: str, shm: str, port: int, ready: Any, reload: Any) -> None:
    """The owner: loads first (allocates the cache), reloads the same files when told (its
    new version uses its own allocations and inherits them), then waits to be killed."""
    os.environ["HPS_SHM_DIR"] = shm
    from hps.api import HPS

    hps = HPS(_following(Path(folder), port, "owner"))
    ready.put(os.getpid())
    reload.wait(300)
    hps.server.reload_model("m")
    ready.put("reloaded")
    time.sleep(600)


def _serve(folder: str, shm: str, port: int, seed: int, ready: Any, reload: Any,
           updated: Any, stop: Any, out: Any) -> None:
    """A caller process: mixed hits and misses of the keys the updates leave alone, every
    row checked; reloads the same files when told; once told of the updates and once its
    own tiers applied them, checks the updated keys' new rows too."""
    os.environ["HPS_SHM_DIR"] = shm
    me = _Caller(Path(folder), _following(Path(folder), port, f"caller-{seed}"))
    hps, torch, stream, result = me.hps, me.torch, me.stream, me.result
    changed, new = me.keys[:UPDATED], _new_rows()
    rng = np.random.default_rng(seed)
    ready.put(os.getpid())
    calls = wrong = checked = 0
    reloaded = False
    while not stop.is_set():
        wrong += me.wrong_rows(rng.integers(UPDATED, KEYS + KEYS // 10, N))  # a tenth unknown
        calls += 1
        if reload.is_set() and not reloaded:
            hps.server.reload_model("m")  # the same files: the same shared cache
            reloaded = True
        if updated.is_set() and not checked and _applied(hps) >= UPDATED:
            for at in range(0, UPDATED, N):
                part = torch.as_tensor(changed[at:at + N], device="cuda")
                hps.lookup_fromdlpack(part, result[:part.numel()], "m", 0)
                stream.synchronize()
                got = result[:part.numel()].cpu().numpy()
                wrong += int((got != new[at:at + N]).any(axis=1).sum())
                checked += part.numel()
    hps.close()
    out.put((calls, wrong, me.attached, reloaded, checked))


def test_reloads_updates_and_the_owners_death_keep_every_row_exact(model: Path,
                                                                 tmp_path: Path) -> None:
    from hps.api import HPS
    from hps.config import UpdateSourceConfig
    from hps.tiers.contract import table_name
    from hps.updates import codec
    from hps.updates.open import open_publisher
    from tests.support.redis_servers import RedisServer, eventually

    redis = RedisServer(tmp_path / "redis").start()
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    reload, updated, stop = ctx.Event(), ctx.Event(), ctx.Event()
    shm = os.environ["HPS_SHM_DIR"]
    procs: list[Any] = []
    try:
        owner = ctx.Process(target=_hold, args=(str(model), shm, redis.port, ready, reload))
        owner.start()
        procs.append(owner)
        assert ready.get(timeout=300) == owner.pid
        callers = [ctx.Process(target=_serve, args=(str(model), shm, redis.port, s, ready,
                                                    reload, updated, stop, out))
                   for s in range(3)]
        for p in callers:
            p.start()
        procs += callers
        for _ in callers:
            ready.get(timeout=300)
        time.sleep(1.0)
        reload.set()  # every process reloads the same files, the owner included
        assert ready.get(timeout=300) == "reloaded"
        time.sleep(1.0)
        keys, _ = _expected(model)
        config = _following(model, redis.port, "publisher")
        publisher = open_publisher(UpdateSourceConfig(**config["update_source"]))
        try:
            new = _new_rows()
            publisher.publish(table_name("m", "sparse_embedding0"),  # HugeCTR's default name
                              [codec.encode(keys[i:i + 500], new[i:i + 500])
                               for i in range(0, UPDATED, 500)])
        finally:
            publisher.close()
        updated.set()
        time.sleep(2.0)
        os.kill(owner.pid, signal.SIGKILL)  # the process that allocated the cache
        owner.join(30)
        time.sleep(1.5)  # the others go on serving from the cache they map
        # a process that loads the model now cannot map the dead owner's memory: it
        # allocates a new cache, serving the file's rows and the updates exactly
        late = HPS(_following(model, redis.port, "late"))
        gpu = late.server.model("m").tables[0].gpu[0]  # type: ignore[attr-defined]
        assert not gpu.attached
        eventually(lambda: _assert_applied(late), 60, "the late process applied the updates")
        changed = keys[:UPDATED]
        got = np.concatenate([late.lookup(changed[i:i + N], "m", 0)
                              for i in range(0, UPDATED, N)])
        assert np.array_equal(got, new)
        stop.set()
        results = [out.get(timeout=300) for _ in callers]
        late.close()
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(30)
        redis.close()
    assert all(r[0] > 10 for r in results), results
    assert [r[1] for r in results] == [0, 0, 0], results
    assert all(r[2] and r[3] for r in results), results  # they mapped it and reloaded
    assert all(r[4] == UPDATED for r in results), results  # each saw the new rows


def _assert_applied(hps: Any) -> None:
    assert _applied(hps) >= UPDATED
