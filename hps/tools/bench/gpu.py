"""GPU tier benchmarks (`python -m hps.tools.bench.gpu`; needs CuPy and a CUDA device).

Beside each measured thing, in the same process, on the same rows:

- throughput: batches of `batch` uniform keys, 100% hits, from a cache of `slots` slots
  (filled with `slots` random keys; the keys that stayed resident are queried): the
  dynamic cache, the static table holding the same keys, a dense gather of the same rows
  from a plain [slots, dim] table (a float4 RawKernel, cuda/rows.cu), and
  `torch.index_select` on that table. Device time only (CUDA events around the queued
  launches), median of `repeats` runs after warm-up, key batches rotated.
- latency: `GpuEmbeddingTable.lookup` of 2,000 device keys, all hits, end to end: wall
  clock around the call and CUDA events around it on the caller's stream; p50 and p99.
- mixed: 90% hits, the misses served from a host NumPy store (searchsorted; the stand-in
  of the in-process tier): lookups/s and keys/s, misses synchronous (hit_rate_threshold
  above 1) and asynchronous (HugeCTR's default 0.9 semantics).

`bench_gpu()` returns the rows (dicts); `--sweep` also times other kernel launch shapes
(lanes per key, keys in flight per group, grid cap) of both modes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hps.gpu import kernels, overlap
from hps.gpu.dynamic_cache import EmbeddingCache
from hps.gpu.static_table import StaticEmbeddingTable
from hps.tools.bench.gpu_public import PINNED_COPIES
from hps.tools.bench.gpu_rows import PROFILES, format_rows

# HugeCTR's figures on the same H100 beside the same gather: G keys/s
HUGECTR_STATIC = {16: 3.79, 64: 2.93, 128: 2.06}
HUGECTR_DYNAMIC = {16: 0.89, 64: 0.82, 128: 0.72}

_CHUNK = 1 << 20


def _event_ms(cp: Any, fn: Callable[[int], None], repeats: int, warmup: int = 3,
              inner: int = 1) -> float:
    """Median device milliseconds of `inner` calls of fn (events on the current stream)."""
    for i in range(warmup):
        fn(i)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(repeats):
        start.record()
        for j in range(inner):
            fn(i * inner + j)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / inner)
    return float(statistics.median(times))


def _record(event: Any) -> None:
    event.record()


def _query_ms(cp: Any, fn: Callable[[int, Any], None], repeats: int, warmup: int = 3
              ) -> float:
    """Median device milliseconds of one call of fn(i, stop), which records `stop` on
    the current stream itself, right after the work it times."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for i in range(warmup):
        fn(i, stop)
    times = []
    for i in range(repeats):
        start.record()
        fn(i, stop)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(statistics.median(times))


def _variants(dim: int, sweep: bool, default: tuple[int, ...]
              ) -> list[tuple[int, int, int, int]]:
    """(group, unroll, waves, hints) launch shapes to time: other lane groups and unrolls
    with the table's hints, then its own shape capped at 16 waves, then with each hint bit
    flipped."""
    hints = default[3]
    if not sweep:
        return [(default[0], default[1], 0, hints)]
    shapes = [(2, 2), (4, 2), (4, 4), (8, 2)] if dim <= 32 else [(4, 1), (8, 1), (8, 2)]
    out = [(g, u, 0, hints) for g, u in shapes]
    return out + [(default[0], default[1], 16, hints), (default[0], default[1], 0, hints ^ 1),
                  (default[0], default[1], 0, hints ^ 2)]


def bench_throughput(dim: int, slots: int = 1 << 24, batch: int = 1 << 20, repeats: int = 20,
                     sweep: bool = False, device_id: int = 0, seed: int = 0
                     ) -> list[dict[str, Any]]:
    """Rows for one width: float4 gather, index_select, dynamic and static (G keys/s)."""
    import cupy as cp

    rows: list[dict[str, Any]] = []
    with cp.cuda.Device(device_id):
        cp.random.seed(seed)
        table = cp.random.random_sample((slots, dim), dtype=cp.float32)
        keys_all = cp.unique(cp.random.randint(-(2**62), 2**62, size=slots, dtype=cp.int64))
        n_keys = int(keys_all.size)
        cache = EmbeddingCache(slots, dim, device_id)
        for i in range(0, n_keys, _CHUNK):
            cache.insert(keys_all[i:i + _CHUNK], table[i:i + _CHUNK])
        resident = cp.ones(n_keys, dtype=cp.bool_)
        out = cp.empty((_CHUNK, dim), dtype=cp.float32)
        for i in range(0, n_keys, _CHUNK):
            part = keys_all[i:i + _CHUNK]
            missed, _ = cache.query(part, out[: part.size])
            resident[i + missed] = False
        resident_idx = cp.flatnonzero(resident)
        idx = [resident_idx[cp.random.randint(0, resident_idx.size, batch)] for _ in range(4)]
        qkeys = [keys_all[i] for i in idx]
        out = cp.empty((batch, dim), dtype=cp.float32)
        stream = cp.cuda.get_current_stream()
        qkeys_ptr = [int(k.data.ptr) for k in qkeys]
        out_ptr = int(out.data.ptr)
        ws = cache.workspace()
        ws.reserve(batch)
        base = {"bench": "throughput", "dim": dim, "slots": cache.num_slots, "batch": batch,
                "resident": int(resident_idx.size)}

        # baselines: the same rows from a plain table
        gather = kernels.function("rows.cu", "dense_gather", device_id, DIM=dim)
        threads = batch * (dim // 4)

        def dense(i: int) -> None:
            gather((-(-threads // 256),), (256,), (idx[i % 4], np.int64(batch), table, out))

        dense(0)
        np.testing.assert_array_equal(out[:1000].get(), table[idx[0][:1000]].get())
        t_dense = _event_ms(cp, dense, repeats)
        rows.append({**base, "mode": "float4 gather", "gkeys_s": batch / t_dense / 1e6,
                     "ms": t_dense})
        try:
            import torch
            import torch.utils.dlpack

            from_dlpack = torch.utils.dlpack.from_dlpack
            tt, to = from_dlpack(table), from_dlpack(out)
            ti = [from_dlpack(i) for i in idx]

            def index_select(i: int) -> None:
                torch.index_select(tt, 0, ti[i % 4], out=to)

            t_torch = _event_ms(cp, index_select, repeats)
            rows.append({**base, "mode": "torch.index_select",
                         "gkeys_s": batch / t_torch / 1e6, "ms": t_torch})
        except ImportError:
            t_torch = float("nan")

        def timed(t: EmbeddingCache | StaticEmbeddingTable, mode: str, **shape: Any
                  ) -> dict[str, Any]:
            out.fill(np.nan)
            _, count = t.query(qkeys[0], out)
            assert count == 0, f"{mode}: {count} misses in an all-hit batch"
            np.testing.assert_array_equal(out[:2000].get(), table[idx[0][:2000]].get())

            def run(i: int, stop: Any) -> None:
                # the lookup path's query; `stop` is recorded as soon as the kernel is
                # queued (the query's host work while it waits, hps/gpu/overlap.py), so
                # the host's wait for the miss count is not timed: device time only
                overlap.set_task(_record, stop)
                t.query_ptr(qkeys_ptr[i % 4], batch, out_ptr, 0.0, ws, stream.ptr)

            ms = _query_ms(cp, run, repeats)
            return {**base, "mode": mode, **shape, "gkeys_s": batch / ms / 1e6, "ms": ms,
                    "vs_float4": t_dense / ms, "vs_torch": t_torch / ms,
                    "hugectr": (HUGECTR_STATIC if mode.startswith("static") else HUGECTR_DYNAMIC
                                ).get(dim)}

        def time_table(t: EmbeddingCache | StaticEmbeddingTable, mode: str) -> None:
            default = (t._group, t._unroll, t._waves, t._hints)
            if sweep:
                for g, u, w, h in _variants(dim, sweep, default):
                    t.set_launch(g, u, w, h)
                    rows.append(timed(t, f"{mode} (sweep)", group=g, unroll=u, waves=w,
                                      hints=h))
                t.set_launch(*default)
            if isinstance(t, EmbeddingCache):
                shipped = t.lru_sample_shift
                for shift in sorted({shipped, 0, 2} | ({3, 8} if sweep else set())):
                    t.set_lru_sample_shift(shift)
                    label = "exact LRU" if shift == 0 else f"LRU 1/{2**shift}"
                    label += " (default)" if shift == shipped else ""
                    rows.append(timed(t, f"{mode}, {label}", group=default[0],
                                      unroll=default[1]))
                t.set_lru_sample_shift(shipped)
            else:
                rows.append(timed(t, mode, group=default[0], unroll=default[1]))

        time_table(cache, "dynamic")
        cache.close()
        del cache
        static = StaticEmbeddingTable(int(resident_idx.size), dim, device_id)
        for i in range(0, int(resident_idx.size), _CHUNK):
            sel = resident_idx[i:i + _CHUNK]
            static.build(keys_all[sel], table[sel])
        ws = static.workspace()
        ws.reserve(batch)
        time_table(static, "static")
        static.close()
    return rows


class _HostStore:
    """Sorted keys + rows; fetch by searchsorted (the in-process tier's stand-in)."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self.keys, self.rows = keys, rows

    def fetch(self, keys: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        out = self.rows[at]
        out[self.keys[at] != keys] = 0.0
        return out


def _model(dim: int, **extra: Any) -> Any:
    from hps.config import ModelConfig

    fields: dict[str, Any] = {
        "model": "bench", "sparse_files": ["/bench"], "embedding_vecsize_per_table": [dim],
        "maxnum_catfeature_query_per_table_per_sample": [1 << 20],
        "default_value_for_each_table": [0.0], "deployed_device_list": [0],
        "gpucacheper": 1.0,
    }
    fields.update(extra)
    return ModelConfig(**fields)


def bench_latency(dim: int = 16, n: int = 2000, iters: int = 2000, device_id: int = 0,
                  seed: int = 0) -> list[dict[str, Any]]:
    """p50/p99 of GpuEmbeddingTable.lookup of n device keys, all hits (and variants)."""
    import cupy as cp

    from hps.gpu.table import GpuEmbeddingTable

    rng = np.random.default_rng(seed)
    total = 1 << 20
    keys = np.unique(rng.integers(0, 2**62, total + 1000))[:total]
    store = _HostStore(keys, rng.random((keys.size, dim), dtype=np.float32))
    rows: list[dict[str, Any]] = []
    with cp.cuda.Device(device_id):
        # the floor under any lookup that launches a kernel and waits for it
        noop = kernels.Launch(kernels.function("rows.cu", "noop", device_id, DIM=4), "")
        event = cp.cuda.Event(block=False, disable_timing=True)
        sptr = cp.cuda.get_current_stream().ptr
        wall = []
        for i in range(iters + 200):
            t0 = time.perf_counter()
            noop(1, 32, sptr)
            cp.cuda.runtime.eventRecord(event.ptr, sptr)
            cp.cuda.runtime.eventSynchronize(event.ptr)
            if i >= 200:
                wall.append((time.perf_counter() - t0) * 1e6)
        rows.append({"bench": "latency", "dim": dim, "batch": 0,
                     "mode": "floor: empty kernel + event wait",
                     "p50_us": statistics.median(wall), "p99_us": float(np.percentile(wall, 99))})
        for label, extra in (
            ("GpuEmbeddingTable.lookup", {}),
            ("lookup, static", {"embedding_cache_type": "static"}),
        ):
            table = GpuEmbeddingTable(_model(dim, **extra), 0, total, device_id, store.fetch)
            half = total // 2
            table.warm_up((store.keys[i:i + 100_000], store.rows[i:i + 100_000])
                          for i in range(0, half if table.mode == "dynamic" else total, 100_000))
            held = table._table.dump(0, table._table.num_sets)
            batches = [held[cp.random.randint(0, held.size, n)] for _ in range(64)]
            out = cp.empty((n, dim), dtype=cp.float32)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            wall, dev = [], []
            before = table.stats()["misses"]
            for i in range(iters + 200):
                b = batches[i % 64]
                e0.record()
                t0 = time.perf_counter()
                table.lookup(b, out)
                t1 = time.perf_counter()
                e1.record()
                e1.synchronize()
                if i >= 200:
                    wall.append((t1 - t0) * 1e6)
                    dev.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
            misses = table.stats()["misses"] - before
            np.testing.assert_array_equal(out.get(), store.fetch(batches[(iters + 199) % 64].get()))
            rows.append({"bench": "latency", "dim": dim, "batch": n, "mode": label,
                         "p50_us": statistics.median(wall),
                         "p99_us": float(np.percentile(wall, 99)),
                         "events_p50_us": statistics.median(dev), "misses": misses})
            if label == "GpuEmbeddingTable.lookup":
                cache = table._table
                ws = cache.workspace()
                keys_ptrs = [int(b.data.ptr) for b in batches]
                out_ptr = int(out.data.ptr)
                wall = []
                for i in range(iters + 200):
                    t0 = time.perf_counter()
                    cache.query_ptr(keys_ptrs[i % 64], n, out_ptr, 0.0, ws, sptr)
                    if i >= 200:
                        wall.append((time.perf_counter() - t0) * 1e6)
                rows.append({"bench": "latency", "dim": dim, "batch": n,
                             "mode": "bare cache query", "p50_us": statistics.median(wall),
                             "p99_us": float(np.percentile(wall, 99))})
            table.close()
    return rows


def bench_mixed(dim: int = 16, batches: tuple[int, ...] = (2000, 100_000), iters: int = 30,
                device_id: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """90% hits, misses from a host NumPy store: sync and async miss handling."""
    import cupy as cp

    from hps.gpu.table import GpuEmbeddingTable

    rng = np.random.default_rng(seed)
    total = 4 << 20
    keys = np.unique(rng.integers(0, 2**62, total + 1000))[:total]
    rng.shuffle(keys)
    hot_keys, cold_keys = keys[: 1 << 20], keys[1 << 20:]
    order = np.argsort(keys)
    store = _HostStore(keys[order], rng.random((keys.size, dim), dtype=np.float32))
    rows: list[dict[str, Any]] = []
    with cp.cuda.Device(device_id):
        for label, threshold in (("90% hits, misses sync", 1.01),
                                 ("90% hits, misses async", 0.5)):
            table = GpuEmbeddingTable(_model(dim, hit_rate_threshold=threshold), 0, 2 << 20,
                                      device_id, store.fetch)
            hot_rows = store.fetch(hot_keys)
            table.warm_up((hot_keys[i:i + 200_000], hot_rows[i:i + 200_000])
                          for i in range(0, hot_keys.size, 200_000))
            hot = table._table.dump(0, table._table.num_sets).get()
            cold_at = 0
            for n in batches:
                n_cold = n // 10
                plan = []
                for _ in range(iters + 3):
                    k = np.r_[rng.choice(hot, n - n_cold), cold_keys[cold_at:cold_at + n_cold]]
                    cold_at += n_cold
                    rng.shuffle(k)
                    plan.append(cp.asarray(k))
                out = cp.empty((n, dim), dtype=cp.float32)
                s0 = table.stats()
                times = []
                for i, k in enumerate(plan):
                    t0 = time.perf_counter()
                    table.lookup(k, out)
                    cp.cuda.get_current_stream().synchronize()
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                s1 = table.stats()
                looked = (s1["hits"] - s0["hits"]) + (s1["misses"] - s0["misses"])
                t = statistics.median(times)
                rows.append({"bench": "mixed", "dim": dim, "batch": n, "mode": label,
                             "hit_rate": (s1["hits"] - s0["hits"]) / looked,
                             "p50_us": t * 1e6, "mkeys_s": n / t / 1e6})
            table.close()
    return rows


def bench_gpu(dims: tuple[int, ...] = (16, 64, 128), slots: int = 1 << 24,
              batch: int = 1 << 20, sweep: bool = False, device_id: int = 0,
              repeats: int = 20) -> list[dict[str, Any]]:
    """Every GPU benchmark; a list of row dicts (see the module docstring)."""
    import cupy as cp

    rows: list[dict[str, Any]] = []
    for dim in dims:
        rows += bench_throughput(dim, slots, batch, repeats, sweep, device_id)
        cp.get_default_memory_pool().free_all_blocks()
    rows += bench_latency(16, device_id=device_id)
    rows += bench_mixed(16, device_id=device_id)
    return rows


#: the bound on hps.torch.LookupLayer's cost over lookup_fromdlpack, µs a call
LAYER_OVERHEAD_US = 5.0


def bench_profile(profile: str, device_id: int = 0, **options: Any) -> list[dict[str, Any]]:
    """The rows of one profile: "public" (hps/tools/bench/gpu_public.py), "threads"
    (hps/tools/bench/gpu_threads.py: 1-8 caller threads on their own streams), "hugectr" or "misses"
    (hps/tools/bench/gpu_misses.py), "uvm" (hps/tools/bench/gpu_uvm.py), "devices"
    (hps/tools/bench/gpu_devices.py: every GPU at once), "sharded" (hps/tools/bench/gpu_sharded.py:
    a table split into shards beside it whole), "storage" (hps/tools/bench/gpu_storage.py:
    each embedding_storage_dtype beside float32), "torch" (hps/tools/bench/torch_layer.py:
    hps.torch.LookupLayer over lookup_fromdlpack, 2,000 CUDA keys); "kernels" is
    bench_gpu."""
    if profile == "public":
        from hps.tools.bench.gpu_public import bench_public_latency

        return bench_public_latency(device_id=device_id, **options)
    if profile == "threads":
        from hps.tools.bench.gpu_threads import bench_threads

        return bench_threads(device_id=device_id, **options)
    if profile == "hugectr":
        from hps.tools.bench.gpu_misses import bench_hugectr_profile

        return bench_hugectr_profile(device_id=device_id, **options)
    if profile == "misses":
        from hps.tools.bench.gpu_misses import bench_large_misses

        return bench_large_misses(device_id=device_id, **options)
    if profile == "uvm":
        from hps.tools.bench.gpu_uvm import bench_uvm

        return bench_uvm(device_id=device_id, **options)
    if profile == "devices":
        from hps.tools.bench.gpu_devices import bench_devices

        return bench_devices(**options)
    if profile == "sharded":
        from hps.tools.bench.gpu_sharded import bench_sharded

        return bench_sharded(**options)
    if profile == "storage":
        from hps.tools.bench.gpu_storage import bench_storage

        return bench_storage(device_id=device_id, **options)
    if profile == "processes":
        from hps.tools.bench.gpu_processes import bench_processes

        return bench_processes(device_id=device_id, **options)
    if profile == "torch":
        from hps.tools.bench.torch_layer import bench_torch_layer

        keys, dim = options.pop("keys", 2000), options.pop("dim", 16)
        return [{"bench": "torch layer", "dim": dim, "batch": keys, "mode": r["name"],
                 "us_per_call": r["us_per_call"], "over_baseline_us": r["over_baseline_us"],
                 "vs_baseline": r["vs_baseline"]}
                for r in bench_torch_layer(keys, dim, device="cuda", **options)]
    return bench_gpu(device_id=device_id, **options)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU tier's acceptance figures, read off the rows: (target, measured, met)."""
    out: list[dict[str, Any]] = []

    def find(bench: str, dim: int, mode_start: str) -> dict[str, Any] | None:
        for r in rows:
            if r["bench"] == bench and r.get("dim") == dim and str(r["mode"]).startswith(
                    mode_start) and "(sweep)" not in str(r["mode"]):
                if mode_start != "dynamic" or "(default)" in str(r["mode"]):
                    return r
        return None

    def add(target: str, value: float | None, ok: bool | None) -> None:
        out.append({"target": target, "measured": value,
                    "met": "n/a" if ok is None else ("yes" if ok else "NO")})

    for dim, floor in ((16, None), (64, 0.6), (128, 0.7)):
        dyn, sta = find("throughput", dim, "dynamic"), find("throughput", dim, "static")
        if dyn is None or sta is None:
            continue
        if floor is None:
            add(f"dim {dim} dynamic >= 6 G keys/s", dyn["gkeys_s"], dyn["gkeys_s"] >= 6.0)
        else:
            add(f"dim {dim} dynamic >= {floor} x float4 gather", dyn["vs_float4"],
                dyn["vs_float4"] >= floor)
        add(f"dim {dim} static >= dynamic (G keys/s)", sta["gkeys_s"],
            sta["gkeys_s"] >= dyn["gkeys_s"])
        add(f"dim {dim} static >= HugeCTR static {HUGECTR_STATIC[dim]}", sta["gkeys_s"],
            sta["gkeys_s"] >= HUGECTR_STATIC[dim])
    for r in rows:
        if (r["bench"] == "public latency" and str(r["mode"]).startswith(("lookup_f", "HPS."))
                and "in the call" not in str(r["mode"])):
            if not str(r["mode"]).startswith("HPS."):  # host arrays: copies both ways
                add(f"{r['mode']}: p50 <= 1.45 x floor", r["vs_floor"], r["vs_floor"] <= 1.45)
            add(f"{r['mode']}: <= 5 us over the inner call", r["over_inner_us"],
                r["over_inner_us"] <= 5.0)
        if r["bench"] == "public latency" and r["mode"] == "HPS.lookup, NumPy keys":
            copies = next((c["p50_us"] for c in rows if c["bench"] == "public latency"
                           and c["mode"] == PINNED_COPIES), None)
            if copies is not None:
                bound = 2 * r["p50_us"] / r["vs_floor"] + copies
                add(f"HPS.lookup, NumPy keys: p50 <= 2 x floor + pinned copies "
                    f"({bound:.1f} us)", r["p50_us"], r["p50_us"] <= bound)
        if r["bench"] == "hugectr" and "wrong_rows" in r:
            how = str(r["mode"]).rpartition("; ")[2]
            add(f"hugectr profile ({how}): mean <= 100 us", r["mean_us"],
                r["mean_us"] <= 100.0)
            add(f"hugectr profile ({how}): p99 <= 200 us", r["p99_us"], r["p99_us"] <= 200.0)
            add(f"hugectr profile ({how}): every vector exact", r["wrong_rows"],
                r["wrong_rows"] == 0)
        if r["bench"] == "torch layer" and r["mode"] == "LookupLayer":
            add(f"LookupLayer, {r['batch']:,} CUDA keys: <= {LAYER_OVERHEAD_US:g} us over "
                "lookup_fromdlpack", r["over_baseline_us"],
                r["over_baseline_us"] <= LAYER_OVERHEAD_US)
        if r["bench"] == "devices" and "vs_one" in r:
            add(f"{r['mode']}, {r['batch']:,} keys: >= 1.9 x one GPU's keys/s", r["vs_one"],
                r["vs_one"] >= 1.9)
        if r["bench"] == "devices" and "wrong_rows" in r:
            add(f"{r['mode']}, {r['batch']:,} keys: every vector exact", r["wrong_rows"],
                r["wrong_rows"] == 0)
        if r["bench"] == "misses" and "wrong_rows" in r:
            add("1M uniform misses: >= 50 M keys/s", r["mkeys_s"], r["mkeys_s"] >= 50.0)
            add("1M uniform misses: checked vectors exact", r["wrong_rows"],
                r["wrong_rows"] == 0)
    lat = find("latency", 16, "GpuEmbeddingTable.lookup")
    if lat is not None:
        add("lookup 2000 device keys, all hits: p50 < 30 us", lat["p50_us"],
            lat["p50_us"] < 30.0)
    for r in rows:
        if r["bench"] == "mixed":
            add(f"{r['mode']}, batch {r['batch']}: M keys/s", r["mkeys_s"], None)
    from hps.tools.bench.gpu_processes import targets as processes_targets
    from hps.tools.bench.gpu_sharded import targets as sharded_targets
    from hps.tools.bench.gpu_storage import targets as storage_targets
    from hps.tools.bench.gpu_threads import targets as threads_targets
    from hps.tools.bench.gpu_uvm import targets as uvm_targets

    return (out + threads_targets(rows) + uvm_targets(rows) + storage_targets(rows)
            + processes_targets(rows) + sharded_targets(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="16,64,128")
    parser.add_argument("--slots", type=int, default=1 << 24)
    parser.add_argument("--batch", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true",
                        help="also time other launch shapes (kernels, storage, sharded)")
    parser.add_argument("--only", choices=("throughput", "latency", "mixed"))
    parser.add_argument("--profile", action="append", choices=PROFILES,
                        help="public: the public calls' latency beside their floor; "
                             "hugectr: HugeCTR's hps_profiler workload; misses: 1M-key "
                             "miss batches; devices: every GPU, a thread each, then a "
                             "process each; storage: each embedding_storage_dtype beside "
                             "float32 (d128, 1M keys); "
                             "torch: hps.torch.LookupLayer over lookup_fromdlpack; "
                             "kernels: the cache kernels (default). Repeatable.")
    parser.add_argument("--table-keys", type=int, default=None,
                        help="table size of the misses profile (default 20M)")
    parser.add_argument("--updates", type=int, default=0,
                        help="hugectr profile: rows a second of an update stream applied "
                             "meanwhile")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    import cupy as cp

    dims = tuple(int(d) for d in args.dims.split(","))
    rows: list[dict[str, Any]] = []
    for profile in args.profile or ["kernels"]:
        if profile != "kernels":
            options: dict[str, Any] = ({"table_keys": args.table_keys}
                                       if profile == "misses" and args.table_keys else {})
            if profile in ("storage", "sharded") and args.sweep:
                options["sweep"] = True
            if profile == "hugectr" and args.updates:
                options["updates"] = args.updates
            rows += bench_profile(profile, args.device, **options)
        elif args.only == "throughput":
            for dim in dims:
                rows += bench_throughput(dim, args.slots, args.batch, args.repeats,
                                         args.sweep, args.device)
                cp.get_default_memory_pool().free_all_blocks()
        elif args.only == "latency":
            rows += bench_latency(16, device_id=args.device)
        elif args.only == "mixed":
            rows += bench_mixed(16, device_id=args.device)
        else:
            rows += bench_gpu(dims, args.slots, args.batch, args.sweep, args.device,
                              args.repeats)
        print(format_rows(rows), flush=True)  # so far, in case a later profile fails
        print(flush=True)
    sweep_rows = [r for r in rows if "(sweep)" in str(r.get("mode"))]
    if sweep_rows:
        print(format_rows(sweep_rows))
        print()
    print(format_rows([r for r in rows if "(sweep)" not in str(r.get("mode"))]))
    summary = targets(rows)
    if summary:
        print()
        print(format_rows(summary, ("target", "measured", "met")))


if __name__ == "__main__":
    main()
