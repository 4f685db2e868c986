"""A table's GPU cache split row-wise into shards, beside the same table whole, through the
public call (`hps bench gpu --profile sharded`).

Shard s lives on device s % devices (with one device, every shard on it: the routing's
cost alone). Each sharded table is timed two ways in the same run: the one pass
(hps/gpu/sharded_query.py: one kernel on the caller's device reads each row where it lives)
and the copy path (hps/gpu/sharded.py: partition, a lookup per shard with peer copies, a
scatter). Tables: a dynamic cache holding the whole table (all hits) and a dynamic cache of
25% of the table with power-law keys (misses fetched from the in-process tier); with
several devices also the case sharding exists for, each device's cache budget half the
table: sharded over the devices (all of it in GPU memory) against one GPU caching half.
Batches of 2,000 and 1M torch keys on cuda:0, uniform and power-law; every output checked
against the model file's rows. Beside each row: the floor, torch.index_select of the same
rows from a dense table on cuda:0; with several devices the link bound of the batch: the
one-GPU time or the remote rows' bytes at the peer-read bandwidth that a plain gather
kernel on cuda:0 reading cuda:1's copy of the rows measures in the same run, whichever is
longer (`bound_M_keys_per_s`).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_public import MODEL, server_over_files


def _power_law(rng: np.random.Generator, size: int, n: int, alpha: float = 1.1) -> np.ndarray:
    ranks = rng.zipf(alpha, size * 2)
    ranks = ranks[ranks <= size][:n] - 1
    while ranks.size < n:  # zipf draws beyond the table are dropped; draw again
        more = rng.zipf(alpha, n)
        ranks = np.r_[ranks, more[more <= size] - 1][:n]
    return ranks


def bench_sharded(dim: int = 64, table_keys: int = 1 << 22, shards: int = 2,
                  seconds: float = 1.0, seed: int = 0) -> list[dict[str, Any]]:
    """keys/s of sharded vs whole tables (see the module docstring), with ratios."""
    import cupy as cp
    import torch

    devices = list(range(cp.cuda.runtime.getDeviceCount()))
    num_shards = max(shards, len(devices))
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    dense = torch.as_tensor(rows, device="cuda:0")
    remote = torch.as_tensor(rows, device="cuda:1") if len(devices) > 1 else None
    cases = []  # (n, keys drawn, their picks, batches, output, floor, peer gather rate)
    for n in (2000, 1 << 20):
        for how in ("uniform", "power-law"):
            picks = [rng.integers(0, table_keys, n) if how == "uniform"
                     else _power_law(rng, table_keys, n) for _ in range(4)]
            index = [torch.as_tensor(p, device="cuda:0") for p in picks]
            out = torch.empty((n, dim), device="cuda:0")
            floor = _rate(lambda i, x=index, o=out, d=dense: torch.index_select(
                d, 0, x[i % 4], out=o), n, seconds)
            peer = (_peer_gather_rate(remote, index, out, n, dim, seconds)
                    if remote is not None else None)
            batches = [torch.as_tensor(keys[p], device="cuda:0") for p in picks]
            cases.append((n, how, picks, batches, out, floor, peer))
    del dense, remote
    all_hits = {"embedding_cache_type": "dynamic", "gpucacheper": 1.0, "hit_rate_threshold": 1.0}
    setups = [("all hits", all_hits, all_hits)]
    if len(devices) > 1:  # each device's cache budget half the table
        half = {"embedding_cache_type": "dynamic", "gpucacheper": 0.5, "hit_rate_threshold": 1.1}
        setups.append(("half a table a GPU", half,
                       {**half, "gpucacheper": min(1.0, 0.5 * len(devices))}))
    results: list[dict[str, Any]] = []
    for name, whole_model, sharded_model in setups:
        sharded = {**sharded_model, "gpu_sharding": "row_wise", "gpu_shards": num_shards,
                   "deployed_device_list": devices}
        whole = _timed(keys, rows, whole_model, cases, seconds, (True,))
        split = _timed(keys, rows, sharded, cases, seconds, (True, False))
        for c, (n, how, _, _, _, floor, peer) in enumerate(cases):
            if name != "all hits" and how == "uniform":
                continue  # the half-table case is about power-law keys
            base = {"bench": "sharded", "table": name, "keys": how, "batch": n,
                    "devices": len(devices), "shards": num_shards,
                    "floor_M_keys_per_s": floor / 1e6}
            w_rate, w_wrong = whole[c][True]
            results.append({**base, "layout": "whole, one GPU", "M_keys_per_s": w_rate / 1e6,
                            "vs_floor": w_rate / floor, "wrong_rows": w_wrong})
            for one_pass, label in ((True, "sharded, one pass"), (False, "sharded, copies")):
                rate, wrong = split[c][one_pass]
                row = {**base, "layout": label, "M_keys_per_s": rate / 1e6,
                       "vs_floor": rate / floor, "vs_whole": rate / w_rate,
                       "wrong_rows": wrong}
                if peer is not None and name == "all hits":
                    bound_s = max(n / w_rate, n * (num_shards - 1) / num_shards / peer)
                    row["bound_M_keys_per_s"] = n / bound_s / 1e6
                    row["vs_bound"] = rate * bound_s / n
                results.append(row)
    return results


def _timed(keys: np.ndarray, rows: np.ndarray, model: dict[str, Any], cases: list[Any],
           seconds: float, modes: tuple[bool, ...]) -> list[dict[bool, tuple[float, int]]]:
    """For each case, and each of `modes` (one pass or not, on a sharded table): keys/s of
    HPS over the table with `model`'s config keys, and the wrong rows of a checked lookup
    after the timing. One server for every case."""
    import torch

    most = max(case[0] for case in cases)
    out: list[dict[bool, tuple[float, int]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hps = server_over_files(Path(tmp), keys, rows, most, 0, **model)
        try:
            views = list(hps.server.model(MODEL).tables[0].gpu.values())
            for n, _, picks, batches, result, _, _ in cases:
                timed: dict[bool, tuple[float, int]] = {}
                for one_pass in modes:
                    for view in views:
                        if hasattr(view, "use_one_pass"):
                            view.use_one_pass = one_pass
                    for i in range(3):  # warm-up rounds: the caches fill
                        hps.lookup_fromdlpack(batches[i % 4], result, MODEL, 0)
                    rate = _rate(lambda i, b=batches, o=result:
                                 hps.lookup_fromdlpack(b[i % 4], o, MODEL, 0), n, seconds)
                    hps.lookup_fromdlpack(batches[0], result, MODEL, 0)
                    torch.cuda.synchronize()
                    wrong = int((result.cpu().numpy() != rows[picks[0]]).any(axis=1).sum())
                    timed[one_pass] = (rate, wrong)
                out.append(timed)
        finally:
            hps.close()
    return out


def _peer_gather_rate(remote: Any, index: list[Any], out: Any, n: int, dim: int,
                      seconds: float) -> float:
    """Rows/s of a plain gather kernel on cuda:0 reading the rows of `index` from the
    table copy on cuda:1 (peer access): what NVLink gives a row gather."""
    import cupy as cp

    from hps.gpu import kernels
    from hps.gpu.sharded_query import peers_reachable

    if not peers_reachable(cp, 0, {0, 1}):
        return float("nan")
    launch = kernels.Launch(kernels.function("rows.cu", "dense_gather", 0, DIM=dim),
                            "ptr i64 ptr ptr")
    threads = n * (dim // 4)
    blocks = min(-(-threads // 256), kernels.multiprocessors(0) * 16)

    def gather(i: int) -> None:
        import torch

        stream = torch.cuda.current_stream(0).cuda_stream
        launch(blocks, 256, stream, index[i % 4].data_ptr(), n, remote.data_ptr(),
               out.data_ptr())

    return _rate(gather, n, seconds)


def _rate(call: Any, n: int, seconds: float) -> float:
    """keys/s of `call(i)` looped for `seconds`, a sync after each call."""
    import torch

    sync = torch.cuda.current_stream().synchronize
    for i in range(3):
        call(i)
    sync()
    done, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        call(i)
        sync()
        done += n
        i += 1
    return done / (time.perf_counter() - start)


if __name__ == "__main__":
    for row in bench_sharded():
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
