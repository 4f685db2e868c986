"""A table's GPU cache split row-wise into shards, beside the same table whole, through the
public call (`hps bench gpu --profile sharded`).

Shard s lives on device s % devices (with one device, every shard on it: the routing's
cost alone). Rows:
- all hits (a dynamic cache holding the whole table): batches of 2,000 and 1M torch keys on
  cuda:0, uniform and power-law, the sharded table timed two ways in the same run: the one
  pass (hps/gpu/sharded_query.py: one kernel on the caller's device reads each row where
  it lives) and the copy path (hps/gpu/sharded.py: partition, a lookup per shard with peer
  copies, a scatter). Beside each: the floor, torch.index_select of the same rows from a
  dense table on cuda:0; with several devices the link bound of the batch: the one-GPU
  time or the remote rows' bytes at the peer-read bandwidth that a plain gather kernel on
  cuda:0 reading cuda:1's copy of the rows measures in the same run, whichever is longer
  (`bound_M_keys_per_s`, `vs_bound`);
- misses (`_miss_rows`): a quarter of the table cached, one GPU and the shards at the
  same hit rate, filling from empty and in steady state; with several devices the case
  sharding exists for, each device's cache budget half the table (one GPU caching half,
  the shards all of it), with the link bound. 2,000-key batches from a pool of fresh
  power-law or uniform draws, misses fetched from the in-process tier.
Every output is checked against the model file's rows (`wrong_rows`).
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
    sharded = {**all_hits, "gpu_sharding": "row_wise", "gpu_shards": num_shards,
               "deployed_device_list": devices}
    whole = _timed(keys, rows, all_hits, cases, seconds, (True,))
    split = _timed(keys, rows, sharded, cases, seconds, (True, False))
    results: list[dict[str, Any]] = []
    bounds: dict[str, float] = {}  # the 2,000-key cases' bounds, for the capacity rows
    for c, (n, how, _, _, _, floor, peer) in enumerate(cases):
        base = {"bench": "sharded", "table": "all hits", "keys": how, "batch": n,
                "devices": len(devices), "shards": num_shards,
                "floor_M_keys_per_s": floor / 1e6}
        w_rate, w_wrong = whole[c][True]
        results.append({**base, "layout": "whole, one GPU", "M_keys_per_s": w_rate / 1e6,
                        "vs_floor": w_rate / floor, "wrong_rows": w_wrong})
        for one_pass, label in ((True, "sharded, one pass"), (False, "sharded, copies")):
            rate, wrong = split[c][one_pass]
            row = {**base, "layout": label, "M_keys_per_s": rate / 1e6,
                   "vs_floor": rate / floor, "vs_whole": rate / w_rate, "wrong_rows": wrong}
            if peer is not None:  # one GPU serving all of it, or the link, if slower
                bound_s = max(n / w_rate, n * (num_shards - 1) / num_shards / peer)
                row["bound_M_keys_per_s"] = n / bound_s / 1e6
                row["vs_bound"] = rate * bound_s / n
                if n == 2000:
                    bounds[how] = n / bound_s
            results.append(row)
    results += _miss_rows(keys, rows, devices, num_shards, seconds, rng, bounds)
    return results


def _miss_rows(keys: np.ndarray, rows: np.ndarray, devices: list[int], num_shards: int,
               seconds: float, rng: np.random.Generator, bounds: dict[str, float]
               ) -> list[dict[str, Any]]:
    """Tables with misses (below the hit rate threshold: each batch's misses fetched and
    inserted before it returns), 2,000-key batches drawn fresh from a pool of POOL_BATCHES
    (more distinct keys than a quarter of the table), no warm-up, one GPU beside the
    shards with the same batches in the same order:
    - a quarter of the table cached, one GPU and sharded alike (so at the same hit rate,
      printed): filling from empty (the first FILL_BATCHES), then in steady state;
    - each device's cache budget half the table (the case sharding exists for): one GPU
      caching half against the shards caching all of it, in steady state, with the link
      bound of the all-hits rows (`bounds`: keys/s by "uniform" and "power-law", alpha
      1.1, which the alpha 1.05 row borrows)."""
    import torch

    n = 2000
    quarter = {"embedding_cache_type": "dynamic", "gpucacheper": 0.25,
               "hit_rate_threshold": 1.1, "init_ec": False}
    half = {**quarter, "gpucacheper": 0.5}
    shard = {"gpu_sharding": "row_wise", "gpu_shards": num_shards,
             "deployed_device_list": devices}
    setups = [("a quarter cached", "alpha 1.05", quarter, {**quarter, **shard}),
              ("a quarter cached", "alpha 1.1", quarter, {**quarter, **shard})]
    if len(devices) > 1:
        whole_budget = {**half, **shard, "gpucacheper": min(1.0, 0.5 * len(devices))}
        setups += [("half a table a GPU", how, half, whole_budget)
                   for how in ("uniform", "alpha 1.05", "alpha 1.1")]
    out: list[dict[str, Any]] = []
    pools: dict[str, tuple[np.ndarray, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        from hps import write_sparse_model

        write_sparse_model(Path(tmp) / "t0", keys, rows)
        for table, how, one_model, sharded_model in setups:
            if how not in pools:
                picks = (rng.integers(0, keys.size, POOL_BATCHES * n) if how == "uniform"
                         else _power_law(rng, keys.size, POOL_BATCHES * n, float(how[6:])))
                picks = picks.reshape(POOL_BATCHES, n)
                pools[how] = (picks, torch.as_tensor(keys[picks], device="cuda:0"))
            picks, batches = pools[how]
            base = {"bench": "sharded", "table": table, "keys": how, "batch": n,
                    "devices": len(devices), "shards": num_shards}
            measured = {layout: _filling(Path(tmp), rows, picks, batches, model, seconds)
                        for layout, model in (("whole, one GPU", one_model),
                                              ("sharded, one pass", sharded_model))}
            one = measured["whole, one GPU"]
            for layout, phases in measured.items():
                for phase, (rate, hit_rate, wrong) in phases.items():
                    if table != "a quarter cached" and phase != "steady state":
                        continue
                    row = {**base, "phase": phase, "layout": layout,
                           "M_keys_per_s": rate / 1e6, "hit_rate": hit_rate,
                           "vs_whole": rate / one[phase][0], "wrong_rows": wrong}
                    bound = bounds.get("uniform" if how == "uniform" else "power-law")
                    if table != "a quarter cached" and bound and layout != "whole, one GPU":
                        row["bound_M_keys_per_s"] = bound / 1e6
                        row["vs_bound"] = rate / bound
                    out.append(row)
    return out


#: the batches the miss rows draw from (16M power-law draws: about 2.5M distinct keys of
#: the 4M, so a quarter-table cache keeps missing), and the first of them that fill
POOL_BATCHES, FILL_BATCHES = 8000, 1000


def _filling(folder: Path, rows: np.ndarray, picks: np.ndarray, batches: Any,
             model: dict[str, Any], seconds: float) -> dict[str, tuple[float, float, int]]:
    """{phase: (keys/s, hit rate, wrong rows)} of a table of `model` filling from empty
    (one pass over the first FILL_BATCHES), then in steady state (`seconds` looping over
    all of them, after twice as long)."""
    import torch

    from hps.tools.bench.gpu_public import server_over_folder

    count, n = picks.shape
    hps = server_over_folder(folder, rows.shape[1], n, 0, **model)
    try:
        table = hps.server.model(MODEL).tables[0].gpu[0]
        result = torch.empty((n, rows.shape[1]), device="cuda:0")
        sync = torch.cuda.current_stream().synchronize
        at = [FILL_BATCHES]  # the steady state goes on from where the fill stopped

        def call(i: int) -> None:
            hps.lookup_fromdlpack(batches[(at[0] + i) % count], result, MODEL, 0)

        # the first call's one-time costs (kernels loaded, buffers made) are not the fill's:
        # a batch of keys the table does not have, which fills nothing the pool asks for
        hps.lookup_fromdlpack(-1 - batches[0], result, MODEL, 0)
        sync()
        phases: dict[str, tuple[float, float, int]] = {}
        for phase in ("filling from empty", "settling", "steady state"):
            before = table.stats()
            if phase == "filling from empty":
                start = time.perf_counter()
                for i in range(FILL_BATCHES):
                    hps.lookup_fromdlpack(batches[i], result, MODEL, 0)
                    sync()
                rate = FILL_BATCHES * n / (time.perf_counter() - start)
            else:
                rate = _rate(call, n, seconds * (2 if phase == "settling" else 1), warm=0)
                at[0] += int(rate * seconds) // n
            after = table.stats()
            hits = after["hits"] - before["hits"]
            looked = hits + after["misses"] - before["misses"]
            hps.lookup_fromdlpack(batches[0], result, MODEL, 0)
            sync()
            wrong = int((result.cpu().numpy() != rows[picks[0]]).any(axis=1).sum())
            if phase != "settling":
                phases[phase] = (rate, hits / looked if looked else float("nan"), wrong)
        return phases
    finally:
        hps.close()


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


def _rate(call: Any, n: int, seconds: float, warm: int = 3) -> float:
    """keys/s of `call(i)` looped for `seconds`, a sync after each call, after `warm`
    calls untimed."""
    import torch

    sync = torch.cuda.current_stream().synchronize
    for i in range(warm):
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


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 61's figures, read off the profile's one-pass rows: (target, measured, met)."""
    out: list[dict[str, Any]] = []

    def add(target: str, value: float, ok: bool) -> None:
        out.append({"target": target, "measured": value, "met": "yes" if ok else "NO"})

    for r in rows:
        if r["bench"] != "sharded" or r["layout"] != "sharded, one pass":
            continue
        phase = f"{r['phase']}, " if "phase" in r else ""
        what = f"sharded, {r['table']}, {phase}{r['keys']}, batch {r['batch']}"
        if r["table"] == "a quarter cached":
            add(f"{what}: >= 0.8x one GPU", r["vs_whole"], r["vs_whole"] >= 0.8)
        elif r["table"] == "all hits" and r["batch"] > 2000 and "vs_bound" in r:
            add(f"{what}: >= 0.8x the link bound", r["vs_bound"], r["vs_bound"] >= 0.8)
        elif r["table"] == "all hits":
            add(f"{what}: >= 0.8x one GPU", r["vs_whole"], r["vs_whole"] >= 0.8)
        else:  # the capacity case: the whole table sharded against half of it on one GPU
            add(f"{what}: >= 1.0x one GPU", r["vs_whole"], r["vs_whole"] >= 1.0)
        add(f"{what}: wrong rows 0", r["wrong_rows"], r["wrong_rows"] == 0)
    return out


if __name__ == "__main__":
    for row in bench_sharded():
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
