"""Every GPU of the host, through the public calls: keys and output on device k are served by
device k's cache from threads whose current device is any device, for every entry (torch,
CuPy, capsules, host keys with `device_id`, `HPS.lookup`) and every table layout
(replicated dynamic, static and uvm; sharded dynamic and static), while the model is
reloaded, prefetched, refreshed and updated online (a Redis stream), with hot-key sampling
on every call; every vector exact. Runs where there are two devices or more
(scripts/gpu_check.sh selects `multi_gpu` there)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.errors import DeviceError
from hps.tiers.contract import table_name
from tests.support.redis_servers import RedisServer, eventually

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

MODEL = "m"
DEFAULT = -0.25
DIM = 16

LAYOUTS = {
    "replicated dynamic": {"gpucacheper": 0.4, "hit_rate_threshold": 1.0},
    "replicated static": {"embedding_cache_type": "static"},
    "replicated uvm": {"embedding_cache_type": "uvm", "gpucacheper": 0.3},
    # one cache per device for every process of the host (this test's process owns them)
    "replicated dynamic, host scope": {"gpucacheper": 0.4, "hit_rate_threshold": 1.0,
                                       "gpu_cache_scope": "host"},
    "sharded dynamic": {"gpu_sharding": "row_wise", "gpucacheper": 0.4,
                        "hit_rate_threshold": 1.0},
    "sharded static": {"gpu_sharding": "row_wise", "embedding_cache_type": "static"},
}


def _devices() -> list[int]:
    import cupy

    count = int(cupy.cuda.runtime.getDeviceCount())
    assert count >= 2, "run on a machine with two GPUs or more (gpu_check.sh selects it)"
    return list(range(count))


class Rows:
    """The model's rows as the tiers hold them now: the file's, then the updates'."""

    def __init__(self, rng: np.random.Generator, n: int) -> None:
        self.keys = rng.choice(2**40, n, replace=False).astype(np.int64)
        self.rows = rng.standard_normal((n, DIM)).astype(np.float32)
        self._order = np.argsort(self.keys)

    def at(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.minimum(np.searchsorted(self.keys, keys, sorter=self._order), self.keys.size - 1)
        at = self._order[at]
        return at, self.keys[at] == keys

    def expected(self, keys: np.ndarray) -> np.ndarray:
        at, found = self.at(keys)
        out = np.full((keys.size, DIM), DEFAULT, np.float32)
        out[found] = self.rows[at[found]]
        return out


def _config(folder: Path, rows: Rows, devices: list[int], stream_port: int,
            layout: dict[str, Any]) -> dict[str, Any]:
    write_sparse_model(folder / "t0", rows.keys, rows.rows)
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [str(folder / "t0")],
            "embedding_vecsize_per_table": [DIM],
            "maxnum_catfeature_query_per_table_per_sample": [1 << 15],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": devices,
            "max_batch_size": 1, "gpucache": True, "hot_key_sampling": 1,
            "cache_refresh_percentage_per_iteration": 0.5, **layout,
        }],
        "volatile_db": {"type": "hash_map"},
        "update_source": {"type": "redis_stream", "address": f"127.0.0.1:{stream_port}",
                          "poll_timeout_ms": 50},
    }


def _entries(cp: Any, keys: np.ndarray, device: int) -> list[tuple[str, Any]]:
    """(name, call(hps) -> host rows) of every public entry with keys on `device`."""
    import torch
    import torch.utils.dlpack as tdl

    n = keys.size
    on = f"cuda:{device}"

    def torch_call(hps: HPS) -> np.ndarray:
        out = torch.full((n, DIM), np.nan, device=on)
        hps.lookup_fromdlpack(torch.as_tensor(keys, device=on), out, MODEL, 0)
        torch.cuda.synchronize(device)
        return out.cpu().numpy()

    def cupy_call(hps: HPS) -> np.ndarray:
        with cp.cuda.Device(device):
            ck, co = cp.asarray(keys), cp.full((n, DIM), np.nan, cp.float32)
        hps.lookup_fromdlpack(ck, co, MODEL, 0)
        with cp.cuda.Device(device):
            return co.get()

    def capsule_call(hps: HPS) -> np.ndarray:
        out = torch.full((1, n * DIM), np.nan, device=on)  # HugeCTR's shape
        hps.lookup_fromdlpack(tdl.to_dlpack(torch.as_tensor(keys, device=on)),
                              tdl.to_dlpack(out), MODEL, 0)
        torch.cuda.synchronize(device)
        return out.cpu().numpy().reshape(n, DIM)

    def host_keys_call(hps: HPS) -> np.ndarray:
        out = torch.full((n, DIM), np.nan, device=on)
        hps.lookup_fromdlpack(keys, out, MODEL, 0, device_id=device)
        torch.cuda.synchronize(device)
        return out.cpu().numpy()

    def lookup_call(hps: HPS) -> np.ndarray:
        return hps.server.lookup(MODEL, 0, keys, device_id=device)

    return [("torch", torch_call), ("cupy", cupy_call),
            ("capsules", capsule_call), ("host keys, device_id", host_keys_call),
            ("HPS.lookup, device_id", lookup_call)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_entry_on_every_device_from_every_thread(
        cp: Any, rng: np.random.Generator, tmp_path: Path, layout: str) -> None:
    import torch

    from hps.config import UpdateSourceConfig
    from hps.updates import codec
    from hps.updates.open import open_publisher

    devices = _devices()
    rows = Rows(rng, 40_000)
    # the keys online updates change; the lookup threads read only the others meanwhile
    updated = rows.keys[:2000].copy()
    steady = rows.keys[2000:]
    redis = RedisServer(tmp_path / "redis").start()
    try:
        config = _config(tmp_path, rows, devices, redis.port, LAYOUTS[layout])
        with HPS(config) as hps:
            errors: list[str] = []
            stop = threading.Event()
            served = {d: 0 for d in devices}

            def caller(current: int, target: int, seed: int) -> None:
                try:
                    torch.cuda.set_device(current)
                    r = np.random.default_rng(seed)
                    while not stop.is_set():
                        keys = r.choice(steady, 1500)
                        keys[::9] = r.integers(2**41, 2**42, keys[::9].size)  # in no tier
                        want = rows.expected(keys)
                        for name, call in _entries(cp, keys, target):
                            got = call(hps)
                            if not np.array_equal(got, want):
                                bad = int((~(got == want).all(axis=1)).sum())
                                errors.append(f"current {current}, keys on {target}, {name}: "
                                              f"{bad} wrong rows")
                            served[target] += 1
                except Exception as exc:  # reported below with the thread's setting
                    errors.append(f"current {current}, keys on {target}: {exc!r}")

            threads = [threading.Thread(target=caller, args=(c, t, 10 * c + t))
                       for t in devices for c in devices]
            for t in threads:
                t.start()
            try:
                time.sleep(1.0)
                hps.server.reload_model(MODEL)  # the same files: every vector stays exact
                hps.prefetch(MODEL, 0, steady[:5000]).wait(60)
                hps.refresh(MODEL)
                # the updates: new rows of `updated`, through the stream the server follows
                new = rng.standard_normal((updated.size, DIM)).astype(np.float32)
                topic = table_name(MODEL, hps.server.model(MODEL).tables[0].name)
                publisher = open_publisher(UpdateSourceConfig(**config["update_source"]))
                try:
                    publisher.publish(topic, [codec.encode(updated[i:i + 500], new[i:i + 500])
                                              for i in range(0, updated.size, 500)])
                finally:
                    publisher.close()
                at, _ = rows.at(updated)
                rows.rows[at] = new
                eventually(lambda: _check_applied(hps, updated.size), 30,
                           "the online updates applied")
                time.sleep(0.5)
            finally:
                stop.set()
                for t in threads:
                    t.join(120)
            assert not errors, errors[:10]
            assert all(served[d] > 0 for d in devices), served
            # the updated rows from every device, every entry, a thread on another device
            for target in devices:
                other = (target + 1) % len(devices)
                result: list[str] = []

                def check(target: int = target, other: int = other,
                          result: list[str] = result) -> None:
                    torch.cuda.set_device(other)
                    for name, call in _entries(cp, updated, target):
                        if not np.array_equal(call(hps), rows.expected(updated)):
                            result.append(f"keys on {target}, {name}: updates not served")
                t = threading.Thread(target=check)
                t.start()
                t.join(60)
                assert not result, result
            # keys and output on different devices keep their clear error
            keys = torch.as_tensor(steady[:10], device="cuda:0")
            with pytest.raises(DeviceError, match=r"keys are on cuda:0 but the output is on "
                                                  r"cuda:1"):
                hps.lookup_fromdlpack(keys, torch.zeros((10, DIM), device="cuda:1"), MODEL, 0)
            hot = hps.server.top_keys(MODEL, 0, "hot", top=10)
            assert hot["total"] > 0, "no lookup was sampled for the hot-key sketch"
    finally:
        redis.close()


def _check_applied(hps: HPS, rows: int) -> None:
    status = hps.server.update_status()
    applied = sum(int(t.get("rows", 0)) for t in status["tables"].values()) if status else 0
    assert applied >= rows, f"{applied} of {rows} update rows applied"

