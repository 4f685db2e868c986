"""The public calls over a GPU cache (HPS.lookup_fromdlpack, HPS.lookup): every producer
(torch, CuPy, capsules, NumPy, torch CPU), every key width, strided and host outputs,
hits, misses, defaults and duplicates, against the model file's rows; device errors; and
with two GPUs, each device's cache serving its own keys from any thread."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.errors import DeviceError, KeyTypeError

pytestmark = pytest.mark.gpu

DEFAULT = -0.5
MODEL = "m"


class Table:
    """A model file's keys and rows, and the rows any key set must get."""

    def __init__(self, rng: np.random.Generator, n: int, dim: int) -> None:
        self.keys = rng.choice(2**30, n, replace=False).astype(np.int64)  # int32-safe
        self.rows = rng.standard_normal((n, dim)).astype(np.float32)
        self.dim = dim
        self._order = np.argsort(self.keys)

    def expected(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.int64).reshape(-1)
        at = np.minimum(np.searchsorted(self.keys, keys, sorter=self._order), self.keys.size - 1)
        at = self._order[at]
        out = np.full((keys.size, self.dim), DEFAULT, np.float32)
        found = self.keys[at] == keys
        out[found] = self.rows[at[found]]
        return out


def _config(folder: Path, table: Table, devices: list[int], **model: Any) -> dict[str, Any]:
    write_sparse_model(folder / "t0", table.keys, table.rows)
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [str(folder / "t0")],
            "embedding_vecsize_per_table": [table.dim],
            "maxnum_catfeature_query_per_table_per_sample": [1 << 16],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": devices,
            "max_batch_size": 1, "gpucache": True, **model,
        }],
        "volatile_db": {"type": "hash_map"},
    }


MODES = {
    "dynamic, misses sync": {"gpucacheper": 0.5, "hit_rate_threshold": 1.0,
                             "cache_refresh_percentage_per_iteration": 0.2},
    "dynamic, cold": {"gpucacheper": 0.3, "hit_rate_threshold": 1.0},
    "static": {"embedding_cache_type": "static",
               "cache_refresh_percentage_per_iteration": 1.0},
}


def _batch(rng: np.random.Generator, table: Table, n: int) -> np.ndarray:
    """Hits, repeats and unknown keys (their rows: the default value)."""
    keys = rng.choice(table.keys, n)
    keys[::7] = keys[3]  # duplicates
    keys[5::11] = rng.integers(2**30, 2**31 - 1, keys[5::11].size)  # in no tier: defaults
    return keys


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("mode", list(MODES))
def test_every_producer_width_and_layout_is_exact(cp: Any, rng: np.random.Generator,
                                                  tmp_path: Path, mode: str) -> None:
    import torch
    import torch.utils.dlpack as tdl

    table = Table(rng, 20_000, 12)
    n, dim = 3000, table.dim
    with HPS(_config(tmp_path, table, [0], **MODES[mode])) as hps:
        for round_ in range(3):  # cold, then warmer: misses inserted, then served as hits
            keys = _batch(rng, table, n)
            want = table.expected(keys)
            tk = torch.as_tensor(keys, device="cuda")
            cases: list[tuple[str, Any, Any, Any]] = []
            out = torch.full((n, dim), np.nan, device="cuda")
            cases.append(("torch", tk, out, lambda o=out: o.cpu().numpy()))
            out32 = torch.full((n, dim), np.nan, device="cuda")
            cases.append(("torch int32 keys", tk.to(torch.int32), out32,
                          lambda o=out32: o.cpu().numpy()))
            ck, co = cp.asarray(keys.astype(np.uint32)), cp.full((n, dim), np.nan, cp.float32)
            cases.append(("cupy uint32 keys", ck, co, lambda o=co: o.get()))
            ck64, co64 = cp.asarray(keys), cp.full((n + 3, dim), np.nan, cp.float32)
            cases.append(("cupy, output longer than needed", ck64, co64,
                          lambda o=co64: o[:n].get()))
            cap_out = torch.full((1, n * dim), np.nan, device="cuda")  # HugeCTR's shape
            cases.append(("capsules", tdl.to_dlpack(tk), tdl.to_dlpack(cap_out),
                          lambda o=cap_out: o.cpu().numpy().reshape(n, dim)))
            wide = torch.full((n, dim + 5), np.nan, device="cuda")
            cases.append(("strided torch out", tk, wide[:, 2:2 + dim],
                          lambda o=wide: o[:, 2:2 + dim].cpu().numpy()))
            cols = cp.full((dim, n), np.nan, cp.float32)
            cases.append(("transposed cupy out", cp.asarray(keys), cols.T,
                          lambda o=cols: o.T.get()))
            strided_keys = torch.as_tensor(np.repeat(keys, 2), device="cuda")[::2]
            skout = torch.full((n, dim), np.nan, device="cuda")
            cases.append(("strided torch keys", strided_keys, skout,
                          lambda o=skout: o.cpu().numpy()))
            host = np.full((n, dim), np.nan, np.float32)
            cases.append(("device keys, host out", tk, host, lambda o=host: o))
            host2 = torch.full((n, dim), np.nan)
            cases.append(("host torch keys and out", torch.as_tensor(keys), host2,
                          lambda o=host2: o.numpy()))
            dev_out = torch.full((n, dim), np.nan, device="cuda")
            cases.append(("host keys, device out", keys.astype(np.int32), dev_out,
                          lambda o=dev_out: o.cpu().numpy()))
            for name, k, o, read in cases:
                hps.lookup_fromdlpack(k, o, MODEL, 0)
                torch.cuda.synchronize()
                np.testing.assert_array_equal(read(), want, err_msg=f"{mode}, round "
                                              f"{round_}: {name}")
            np.testing.assert_array_equal(hps.lookup(keys, MODEL, 0), want)
            np.testing.assert_array_equal(hps.lookup(keys.reshape(50, -1).astype(np.uint32),
                                                     MODEL, 0), want)
            assert (wide[:, :2].isnan().all() and wide[:, 2 + dim:].isnan().all()), \
                "a strided output was written outside its view"
        stats = hps.server.model(MODEL).tables[0].gpu[0].stats()
        assert stats["hits"] > 0 and stats["misses"] > 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_device_errors_name_both_sides_and_nothing_raw_escapes(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    import torch
    import torch.utils.dlpack as tdl

    table = Table(rng, 1000, 8)
    with HPS(_config(tmp_path, table, [0], gpucacheper=1.0)) as hps:
        keys = torch.as_tensor(table.keys[:10], device="cuda")
        out = torch.zeros((10, 8), device="cuda")
        with pytest.raises(DeviceError, match=r"cuda:0 but device_id 1"):
            hps.lookup_fromdlpack(keys, out, MODEL, 0, device_id=1)
        with pytest.raises(DeviceError, match=r"device_id 3 is not in deployed_device_list"):
            hps.lookup_fromdlpack(keys.cpu(), out.cpu(), MODEL, 0, device_id=3)
        capsule = tdl.to_dlpack(keys)
        tdl.from_dlpack(capsule)
        with pytest.raises(KeyTypeError, match="already consumed"):
            hps.lookup_fromdlpack(capsule, out, MODEL, 0)
        assert (out == 0).all()  # nothing written by a refused call
        hps.lookup_fromdlpack(keys, out, MODEL, 0, device_id=0)
        np.testing.assert_array_equal(out.cpu().numpy(), table.expected(table.keys[:10]))


def _device_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@pytest.mark.multi_gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_device_serves_its_own_keys_from_any_thread(
        cp: Any, rng: np.random.Generator, tmp_path: Path) -> None:
    import torch

    assert _device_count() >= 2, "run on a machine with two GPUs (gpu_check.sh selects it)"
    table = Table(rng, 20_000, 16)
    with HPS(_config(tmp_path, table, [0, 1], gpucacheper=0.5, hit_rate_threshold=1.0,
                     cache_refresh_percentage_per_iteration=0.5)) as hps:
        gpu = hps.server.model(MODEL).tables[0].gpu
        errors: list[str] = []

        def worker(current: int, target: int, seed: int) -> None:
            try:
                torch.cuda.set_device(current)
                r = np.random.default_rng(seed)
                for _ in range(20):
                    keys = _batch(r, table, 2000)
                    tk = torch.as_tensor(keys, device=f"cuda:{target}")
                    out = torch.full((2000, 16), np.nan, device=f"cuda:{target}")
                    hps.lookup_fromdlpack(tk, out, MODEL, 0)
                    torch.cuda.synchronize(target)
                    if not np.array_equal(out.cpu().numpy(), table.expected(keys)):
                        errors.append(f"current {current}, keys on {target}: wrong rows")
            except Exception as exc:  # reported below, with the thread's setting
                errors.append(f"current {current}, keys on {target}: {exc!r}")

        before = {d: gpu[d].stats()["keys"] for d in (0, 1)}
        threads = [threading.Thread(target=worker, args=(c, t, i))
                   for i, (c, t) in enumerate([(0, 1), (1, 0), (0, 0), (1, 1)])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for d in (0, 1):  # two threads' 20 lookups of 2,000 keys each per device
            assert gpu[d].stats()["keys"] - before[d] == 2 * 20 * 2000
        keys = torch.as_tensor(table.keys[:10], device="cuda:0")
        with pytest.raises(DeviceError, match=r"keys are on cuda:0 but the output is on cuda:1"):
            hps.lookup_fromdlpack(keys, torch.zeros((10, 16), device="cuda:1"), MODEL, 0)
        with pytest.raises(DeviceError, match=r"cuda:1 but device_id 0"):
            hps.lookup_fromdlpack(keys.to("cuda:1"), torch.zeros((10, 16), device="cuda:1"),
                                  MODEL, 0, device_id=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("mode", ["dynamic, warm", "static", "uvm"])
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_warm_cache_serves_the_last_row_of_a_repeated_key(
        cp: Any, rng: np.random.Generator, tmp_path: Path, mode: str, rate: float) -> None:
    """Files that repeat keys: the warm-up reads the files in order, and a key's first row
    comes before its last; the cache must hold the last row, as every tier does."""
    table = Table(rng, 20_000, 8)
    keys = np.concatenate([table.keys, table.keys[:3000]])  # repeated, later rows win
    rows = np.concatenate([table.rows, rng.standard_normal((3000, 8)).astype(np.float32)])
    table.rows[:3000] = rows[20_000:]  # what table.expected serves
    model = {"dynamic, warm": {"gpucacheper": 0.5, "hit_rate_threshold": 1.0,
                               "cache_refresh_percentage_per_iteration": 1.0},
             "static": {"embedding_cache_type": "static",
                        "cache_refresh_percentage_per_iteration": 1.0},
             "uvm": {"embedding_cache_type": "uvm"}}[mode]
    config = _config(tmp_path, table, [0], **model)
    write_sparse_model(tmp_path / "t0", keys, rows)  # over the distinct rows _config wrote
    config["volatile_db"]["initial_cache_rate"] = rate
    config["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocks")}
    with HPS(config) as hps:
        assert hps.server.model(MODEL).tables[0].source.duplicate_keys == 3000
        repeated = table.keys[:3000]
        np.testing.assert_array_equal(hps.lookup(repeated, MODEL, 0), table.expected(repeated))
        stats = hps.server.model(MODEL).tables[0].gpu[0].stats()
        assert stats["hits"] > 0, f"{mode}: the warm cache served none of them"
