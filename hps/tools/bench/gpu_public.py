"""The public call's latency beside its floor (`hps bench gpu --profile public`).

What a user pays for one lookup of `n` keys, all hits, from a static GPU table of
`table_keys` keys (dim 64 by default), through `HPS` as a user builds it from a model
folder: `lookup_fromdlpack` with torch tensors, CuPy arrays and DLPack capsules made by
`torch.utils.dlpack.to_dlpack` on every call (HugeCTR's own calling style), and `lookup`
with NumPy keys. Beside them, in the same process, taking turns round by round:

- the inner call the public ones wrap: `GpuEmbeddingTable.lookup` with CuPy arrays (and
  with NumPy keys and output, the inner call of `lookup`);
- the floor: `torch.index_select` of the same rows from a dense torch table, then a sync;
- the host arrays' floor, for `lookup` with NumPy keys: the keys copied in from pinned
  memory, the same `index_select`, the rows copied out to pinned memory, one sync; and
  those two pinned copies alone (the bytes at the pinned-copy rate). `lookup`'s target
  is 2x the floor plus the copies.

Capsules are timed twice: made just before the call (what the call's intake costs) and
made inside the timed call (what HugeCTR's style costs a caller, torch's to_dlpack
included).

Every call is followed by a sync of the current stream (wall clock around both), so each
measure is a complete lookup. Returns rows with p50/p99 in µs, the extra cost over the
inner call and the ratio to the floor.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "bench"
HOST_FLOOR = "host floor: pinned keys in, index_select, pinned rows out + sync"
PINNED_COPIES = "pinned copies alone: keys in, rows out + sync"


def server_over_files(folder: Path, keys: np.ndarray, rows: np.ndarray, n: int,
                      device_id: int, top: dict[str, Any] | None = None, **model: Any) -> Any:
    """HPS over a model folder of the table (written here): a static GPU table on
    `device_id`, the in-process tier; `model` overrides the model's config keys, `top`
    adds server config keys."""
    from hps import write_sparse_model

    write_sparse_model(folder / "t0", keys, rows)
    return server_over_folder(folder, rows.shape[1], n, device_id, top, **model)


def server_over_folder(folder: Path, dim: int, n: int, device_id: int,
                       top: dict[str, Any] | None = None, **model: Any) -> Any:
    """HPS over the table `server_over_files` wrote into `folder` (of width `dim`), for
    lookups of up to n keys: a static GPU table on `device_id`, the in-process tier;
    `model` overrides the model's config keys, `top` adds server config keys."""
    from hps.api import HPS

    return HPS(folder_config(folder, dim, n, device_id, top, **model))


def folder_config(folder: Path, dim: int, n: int, device_id: int,
                  top: dict[str, Any] | None = None, **model: Any) -> dict[str, Any]:
    """server_over_folder's config (the in-process tier; `model` overrides the model's
    keys, `top` adds server keys)."""
    config = {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [str(folder / "t0")],
            "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [n],
            "default_value_for_each_table": [0.0], "deployed_device_list": [device_id],
            "max_batch_size": 1, "gpucache": True, "gpucacheper": 1.0,
            "cache_refresh_percentage_per_iteration": 1.0,
            "embedding_cache_type": "static", **model,
        }],
        "volatile_db": {"type": "hash_map"},
        **(top or {}),
    }
    return config


def _percentiles(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), float(np.percentile(samples, 99))


def bench_public_latency(dim: int = 64, n: int = 2000, table_keys: int = 1 << 18,
                         rounds: int = 10, calls: int = 200, device_id: int = 0,
                         seed: int = 0) -> list[dict[str, Any]]:
    """p50/p99 of each public call, the inner call and the index_select floor (see the
    module docstring); all measures take turns, `calls` each per round."""
    import cupy as cp
    import torch
    import torch.utils.dlpack as tdl

    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    dev = torch.device("cuda", device_id)
    with tempfile.TemporaryDirectory() as tmp, cp.cuda.Device(device_id):
        torch.cuda.set_device(dev)
        hps = server_over_files(Path(tmp), keys, rows, n, device_id)
        try:
            gpu = hps.server.model(MODEL).tables[0].gpu[device_id]
            picks = [rng.integers(0, table_keys, n) for _ in range(16)]
            np_keys = [keys[p] for p in picks]
            t_keys = [torch.as_tensor(k, device=dev) for k in np_keys]
            c_keys = [cp.asarray(k) for k in np_keys]
            t_idx = [torch.as_tensor(p, device=dev) for p in picks]
            t_table = torch.as_tensor(rows, device=dev)
            t_out = torch.empty((n, dim), dtype=torch.float32, device=dev)
            pinned_keys = [torch.as_tensor(p).pin_memory() for p in picks]
            pinned_out = torch.empty((n, dim), dtype=torch.float32).pin_memory()
            d_idx = torch.empty(n, dtype=torch.int64, device=dev)
            c_out = cp.empty((n, dim), dtype=cp.float32)
            np_out = np.empty((n, dim), dtype=np.float32)
            stream = torch.cuda.current_stream(dev)
            sync = stream.synchronize
            lookup_into = hps.lookup_fromdlpack

            def public_torch(i: int) -> None:
                lookup_into(t_keys[i % 16], t_out, MODEL, 0, device_id)

            def public_cupy(i: int) -> None:
                lookup_into(c_keys[i % 16], c_out, MODEL, 0, device_id)

            def capsules(i: int) -> tuple[Any, Any]:
                return (tdl.to_dlpack(t_keys[i % 16]),  # type: ignore[attr-defined]
                        tdl.to_dlpack(t_out))  # type: ignore[attr-defined]

            def public_capsules(i: int, made: tuple[Any, Any]) -> None:
                lookup_into(made[0], made[1], MODEL, 0, device_id)

            def public_to_dlpack(i: int) -> None:
                lookup_into(tdl.to_dlpack(t_keys[i % 16]),  # type: ignore[attr-defined]
                            tdl.to_dlpack(t_out), MODEL, 0, device_id)  # type: ignore[attr-defined]

            def public_host(i: int) -> None:
                hps.lookup(np_keys[i % 16], MODEL, 0, device_id)

            def inner_device(i: int) -> None:
                gpu.lookup(c_keys[i % 16], c_out)

            def inner_host(i: int) -> None:
                gpu.lookup(np_keys[i % 16], np_out)

            def floor(i: int) -> None:
                torch.index_select(t_table, 0, t_idx[i % 16], out=t_out)

            def host_floor(i: int) -> None:
                d_idx.copy_(pinned_keys[i % 16], non_blocking=True)
                torch.index_select(t_table, 0, d_idx, out=t_out)
                pinned_out.copy_(t_out, non_blocking=True)

            def pinned_copies(i: int) -> None:
                d_idx.copy_(pinned_keys[i % 16], non_blocking=True)
                pinned_out.copy_(t_out, non_blocking=True)

            inner = "inner GpuEmbeddingTable.lookup (CuPy)"
            cases: list[tuple[str, str, Callable[..., None], Callable[[int], Any] | None]] = [
                ("floor: torch.index_select + sync", "", floor, None),
                (inner, "", inner_device, None),
                ("lookup_fromdlpack, torch tensors", inner, public_torch, None),
                ("lookup_fromdlpack, CuPy arrays", inner, public_cupy, None),
                ("lookup_fromdlpack, DLPack capsules", inner, public_capsules, capsules),
                ("lookup_fromdlpack, to_dlpack in the call", inner, public_to_dlpack, None),
                ("inner GpuEmbeddingTable.lookup (NumPy)", "", inner_host, None),
                ("HPS.lookup, NumPy keys", "inner GpuEmbeddingTable.lookup (NumPy)",
                 public_host, None),
                (HOST_FLOOR, "", host_floor, None),
                (PINNED_COPIES, "", pinned_copies, None),
            ]
            # exactness first: every path returns the file's rows
            want = rows[picks[0]]
            for label, _, fn, prep in cases:
                if label == PINNED_COPIES:  # copies only: no rows of its own to check
                    continue
                t_out.fill_(float("nan"))
                c_out.fill(np.nan)
                np_out.fill(np.nan)
                if prep is None:
                    fn(0)
                else:
                    fn(0, prep(0))
                sync()
                got = {"torch": t_out.cpu().numpy(), "CuPy": c_out.get(),
                       "NumPy": np_out}
                if label == "HPS.lookup, NumPy keys":
                    looked_up = hps.lookup(np_keys[0], MODEL, 0, device_id)
                elif "CuPy" in label:
                    looked_up = got["CuPy"]
                elif "NumPy" in label:
                    looked_up = got["NumPy"]
                else:
                    looked_up = got["torch"]
                np.testing.assert_array_equal(looked_up, want, err_msg=label)
            samples: dict[str, list[float]] = {label: [] for label, _, _, _ in cases}
            clock = time.perf_counter
            for r in range(rounds + 1):  # round 0 warms up
                for label, _, fn, prep in cases:
                    out = samples[label]
                    for i in range(calls):
                        if prep is None:
                            t0 = clock()
                            fn(i)
                        else:
                            made = prep(i)
                            t0 = clock()
                            fn(i, made)
                        sync()
                        if r:
                            out.append((clock() - t0) * 1e6)
        finally:
            hps.close()
    floor_p50 = statistics.median(samples[cases[0][0]])
    rows_out: list[dict[str, Any]] = []
    for label, inner, _, _ in cases:
        p50, p99 = _percentiles(samples[label])
        row: dict[str, Any] = {"bench": "public latency", "dim": dim, "batch": n,
                               "mode": label, "p50_us": p50, "p99_us": p99,
                               "vs_floor": p50 / floor_p50}
        if inner:
            row["over_inner_us"] = p50 - statistics.median(samples[inner])
        rows_out.append(row)
    return rows_out
