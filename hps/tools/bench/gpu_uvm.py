"""The uvm cache type beside dynamic and static, through the public call
(`python -m hps.tools.bench.gpu_uvm`; needs CuPy and a CUDA device).

One table of `keys` keys (default 20M) of width `dim` (64) is written as a HugeCTR sparse
model and loaded by one `HPS` as three models over the same files:

- uvm: `gpucacheper` (0.1) of the rows in GPU memory beside the index of every key, the
  rest in pinned, device-mapped host memory;
- dynamic: an LRU cache given at most the GPU memory of the uvm table (its sets sized
  for CACHE_LOAD, hps/gpu/open.py), warmed up from the file, misses served
  synchronously from the in-process hash map (`hit_rate_threshold` above 1, so every
  lookup returns the real vectors, as uvm's do);
- static: the whole table in GPU memory (the upper bound; it takes about 7× the memory).

Draws: power-law ranks (alpha 1.05, 1.2 and 1.5, one rank order) mapped to keys by a
random permutation (the hot keys are spread over the file, so file-order placement does
not favour uvm), and uniform keys over the whole table. Timed through
`HPS.lookup_fromdlpack` with CuPy keys and outputs on the device: 2,000 power-law keys
p50/p99 (wall clock around the call, which returns with the output complete), and 1M-key
batches in G keys/s (for at least 0.5 s). Before timing each alpha, its 1M-key batches
run until the uvm table moves few rows (by passes and on lookups), or three rounds for the
dynamic cache. Its 2,000-key batches are timed twice, each time after running back to
back for `small_warmup_s` (1 s) in both modes, with the modes taking turns (ten rounds of
200 calls each): 64 recurring batches (after their warm-up the dynamic cache holds every
key they have and never misses), then fresh draws, a new batch for every call, as a
serving stream brings them (tail keys the dynamic cache lacks and fetches).

Printed side by side, one row per workload: each mode's figure, uvm over dynamic (>= 1:
uvm is not slower; latencies inverted), and HierarchicalKV's published hybrid figures on
an H100 (HKV_HYBRID). Baseline in the same run: the pinned host-to-device copy bandwidth
(cudaMemcpyAsync of 256 MiB); uvm's uniform figure is also printed as keys/s × row bytes
over it (HierarchicalKV's hybrid mode measured 0.92 of it).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

_H2D = 1  # cudaMemcpyHostToDevice


def h2d_bandwidth(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Pinned host-to-device copy bandwidth, bytes/s (median of `repeats` copies)."""
    import cupy as cp

    host = cp.cuda.alloc_pinned_memory(nbytes)
    np.frombuffer(host, np.uint8, nbytes)[:] = 1
    dev = cp.empty(nbytes, np.uint8)
    stream = cp.cuda.get_current_stream()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(repeats + 2):
        e0.record()
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ptr, nbytes, _H2D, stream.ptr)
        e1.record()
        e1.synchronize()
        if i >= 2:
            times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return float(nbytes / statistics.median(times))


class PowerLaw:
    """Keys drawn with P(rank r) ∝ r^-alpha over a permutation of `keys`."""

    def __init__(self, keys: np.ndarray, alpha: float, rng: np.random.Generator) -> None:
        weights = np.arange(1, keys.size + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.by_rank = rng.permutation(keys)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(n)), self.cdf.size - 1)
        return self.by_rank[ranks]


def _model(name: str, files: str, dim: int, device_id: int, **extra: Any) -> dict[str, Any]:
    return {"model": name, "sparse_files": [files], "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [1 << 20], "max_batch_size": 1,
            "deployed_device_list": [device_id], "gpucache": True, "hit_rate_threshold": 1.1,
            **extra}


def _time_batches(cp: Any, hps: Any, model: str, batches: list[Any], out: Any,
                  repeats: int, device_id: int, min_seconds: float = 0.5) -> float:
    """G keys/s of lookup_fromdlpack over the batches (wall clock, output complete): at
    least `repeats` batches and `min_seconds`, so background work (uvm's passes, every 0.1
    s) weighs in as often as it runs rather than by whether one falls in a short window."""
    n = int(batches[0].size)
    hps.lookup_fromdlpack(batches[0], out, model, 0, device_id)
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    done = 0
    t0 = time.perf_counter()
    while done < repeats or time.perf_counter() - t0 < min_seconds:
        for _ in range(len(batches)):
            hps.lookup_fromdlpack(batches[done % len(batches)], out, model, 0, device_id)
            done += 1
        stream.synchronize()
    return n * done / (time.perf_counter() - t0) / 1e9


def _latencies(hps: Any, modes: tuple[str, ...], batches: list[Any], out: Any, iters: int,
               device_id: int, rounds: int = 10) -> dict[str, tuple[float, float]]:
    """Per mode, p50 and p99 microseconds of lookup_fromdlpack (it returns with `out`
    complete) over `iters` calls, the modes taking turns in `rounds` rounds (after 20
    untimed calls each), so the machine's drift weighs on every mode alike. With at least
    `calls_of(iters, rounds)` batches, no batch is looked up twice by one mode (fresh
    draws; every mode gets the same ones), else the batches recur."""
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    per_round = 20 + iters // rounds
    fresh = len(batches) >= calls_of(iters, rounds)
    for r in range(rounds):
        for mode in modes:
            for i in range(per_round):
                b = batches[r * per_round + i] if fresh else batches[(r + i) % len(batches)]
                t0 = time.perf_counter()
                hps.lookup_fromdlpack(b, out, mode, 0, device_id)
                t1 = time.perf_counter()
                if i >= 20:
                    wall[mode].append((t1 - t0) * 1e6)
    return {mode: (statistics.median(w), float(np.percentile(w, 99)))
            for mode, w in wall.items()}


def _fresh_batches(cp: Any, power: PowerLaw, rng: np.random.Generator, count: int,
                   size: int = 2000) -> list[Any]:
    """`count` batches of `size` new draws, as views of one device array."""
    keys = cp.asarray(power.draw(rng, count * size))
    return [keys[i * size:(i + 1) * size] for i in range(count)]


def calls_of(iters: int, rounds: int = 10) -> int:
    """The calls `_latencies` makes per mode, untimed ones included."""
    return rounds * (20 + iters // rounds)


def _run_for(hps: Any, model: str, batches: list[Any], out: Any, seconds: float,
             device_id: int) -> None:
    """lookup_fromdlpack over the batches, back to back, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for b in batches:
            hps.lookup_fromdlpack(b, out, model, 0, device_id)


def _moved(stats: dict[str, Any]) -> int:
    return int(stats.get("rows_moved", 0)) + int(stats.get("rows_promoted_on_lookup", 0))


def _settle(cp: Any, hps: Any, model: str, gpu: Any, batches: list[Any], out: Any,
            seconds: float, device_id: int) -> dict[str, Any]:
    """Runs the batches until the uvm table moves few rows (passes and lookups alike) for
    three rounds in a row after two passes have run (or `seconds`)."""
    start = time.monotonic()
    first = gpu.stats()
    last, quiet, rounds = _moved(first), 0, 0
    while time.monotonic() - start < seconds:
        for b in batches:
            hps.lookup_fromdlpack(b, out, model, 0, device_id)
        cp.cuda.get_current_stream().synchronize()
        time.sleep(0.25)  # passes run between
        now = gpu.stats()
        rounds += 1
        quiet = quiet + 1 if _moved(now) - last <= max(100, now["gpu_rows"] // 1000) else 0
        last = _moved(now)
        if rounds >= 5 and quiet >= 3 and \
                now["promotion_passes"] >= first["promotion_passes"] + 2:
            break
    stats: dict[str, Any] = gpu.stats()
    stats["settle_s"] = time.monotonic() - start
    return stats


def bench_host_reads(num_keys: int = 20_000_000, dim: int = 64, device_id: int = 0,
                     seed: int = 0) -> list[dict[str, Any]]:
    """The uvm table's host-row reads alone (one GPU row, every other row on the host), for
    each kind of host memory (hps/gpu/host_memory.py) and each way of reading them (direct,
    or grouped by region: hps/gpu/uvm_table.py): 1M and 64K uniform keys in G keys/s, 1M
    as a fraction of the pinned host-to-device copy, and 2,000 uniform keys p50 (table
    query, not the public call)."""
    import cupy as cp

    from hps.gpu.uvm_table import UvmEmbeddingTable

    cp.cuda.Device(device_id).use()
    bandwidth = h2d_bandwidth()
    rows: list[dict[str, Any]] = []
    cp.random.seed(seed)
    keys = cp.arange(num_keys, dtype=cp.int64) * 7 + 11

    def rate(table: Any, batches: list[Any], out: Any, ws: Any, repeats: int) -> float:
        # the lookup path's query (query_ptr) on the current stream, in batches[0].size keys
        n, out_ptr, stream = int(batches[0].size), int(out.data.ptr), cp.cuda.get_current_stream()
        keys_ptrs = [int(b.data.ptr) for b in batches]
        table.query_ptr(keys_ptrs[0], n, out_ptr, 0.0, ws, stream.ptr)
        stream.synchronize()
        t0 = time.perf_counter()
        for i in range(repeats):
            table.query_ptr(keys_ptrs[i % len(batches)], n, out_ptr, 0.0, ws, stream.ptr)
        stream.synchronize()
        return repeats * n / (time.perf_counter() - t0) / 1e9

    for huge in (True, False):
        table = UvmEmbeddingTable(num_keys, dim, device_id, gpu_rows=1, huge_pages=huge,
                                  promotion_interval=0)
        try:
            for i in range(0, num_keys, 1 << 21):
                part = keys[i:i + (1 << 21)]
                table.build(part, cp.random.random_sample((part.size, dim), dtype=cp.float32))
            big = [keys[cp.random.randint(0, num_keys, 1 << 20)] for _ in range(4)]
            mid = [keys[cp.random.randint(0, num_keys, 1 << 16)] for _ in range(16)]
            small = [keys[cp.random.randint(0, num_keys, 2000)] for _ in range(16)]
            out = cp.empty((1 << 20, dim), cp.float32)
            ws = table.workspace()
            for path, threshold in (("direct", 2**31), ("grouped", 1)):
                table.grouped_reads_from = threshold
                gkeys = rate(table, big, out, ws, 12)
                mid_gkeys = rate(table, mid, out[:1 << 16], ws, 48)
                wall = []
                small_ptrs = [int(b.data.ptr) for b in small]
                out_ptr, stream_ptr = int(out.data.ptr), cp.cuda.get_current_stream().ptr
                for i in range(600):
                    t0 = time.perf_counter()
                    table.query_ptr(small_ptrs[i % 16], 2000, out_ptr, 0.0, ws, stream_ptr)
                    if i >= 100:
                        wall.append((time.perf_counter() - t0) * 1e6)
                rows.append({"bench": "host reads",
                             "mode": f"{table.memory_stats()['host_memory_kind']}, {path}",
                             "uniform_gkeys_s": gkeys,
                             "uniform_vs_h2d": gkeys * 1e9 * dim * 4 / bandwidth,
                             "uniform_64k_gkeys_s": mid_gkeys,
                             "p50_us": statistics.median(wall)})
        finally:
            table.close()
    return rows


#: HierarchicalKV's hybrid mode (hot rows in HBM, the rest in host memory) on an H100,
#: as published: 1M uniform and power-law keys G keys/s, 2,000 power-law keys p50 µs
HKV_HYBRID = {"uniform": 0.196, "power": 0.45, "p50": 64.0}
ALPHAS = (1.05, 1.2, 1.5)


def _equal_memory_fraction(num_keys: int, dim: int, device_bytes: int) -> float:
    """The largest gpucacheper whose dynamic cache takes at most device_bytes."""
    from hps.gpu.open import cache_memory_bytes

    pct = min(0.99, device_bytes / cache_memory_bytes(num_keys, dim, 1.0 - 1e-9))
    while pct > 0 and cache_memory_bytes(num_keys, dim, pct) > device_bytes:
        pct *= 0.999
    return pct


def bench_uvm(num_keys: int = 20_000_000, dim: int = 64, gpu_fraction: float = 0.1,
              alphas: tuple[float, ...] = ALPHAS, seed: int = 0, workdir: str | None = None,
              modes: tuple[str, ...] = ("uvm", "dynamic", "static"),
              settle_seconds: float = 30.0, device_id: int = 0,
              small_warmup_s: float = 1.0) -> list[dict[str, Any]]:
    """Rows: the copy bandwidth; then one row per workload (1M uniform keys; per alpha,
    1M power-law keys G keys/s and 2,000 power-law keys p50 and p99 µs, recurring and
    fresh) with each mode's figure, uvm over dynamic (>= 1: uvm is not slower) and
    HierarchicalKV's hybrid figure; then what the uvm table moved."""
    import cupy as cp

    from hps.api import HPS
    from hps.gpu.uvm_table import UvmEmbeddingTable
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    cp.cuda.Device(device_id).use()
    bandwidth = h2d_bandwidth()
    rows.append({"bench": "baseline", "workload": "pinned H2D copy, 256 MiB, GB/s",
                 "uvm": bandwidth / 1e9})
    keys = rng.permutation(np.arange(num_keys, dtype=np.int64) * 7 + 11)
    folder = Path(workdir or tempfile.mkdtemp(prefix="hps-uvm-bench-"))
    t0 = time.perf_counter()
    chunk = 1 << 20
    vectors = np.empty((num_keys, dim), np.float32)
    for i in range(0, num_keys, chunk):
        vectors[i:i + chunk] = rng.random((min(chunk, num_keys - i), dim), np.float32)
    write_sparse_model(folder / "t0", keys, vectors)
    probe_at = rng.choice(num_keys, 4096, replace=False)
    probe_keys, probe_rows = keys[probe_at], vectors[probe_at]
    del vectors
    write_s = time.perf_counter() - t0
    uvm_rows = int(np.ceil(gpu_fraction * num_keys))
    uvm_bytes = UvmEmbeddingTable.device_bytes_required(num_keys, dim, uvm_rows)
    dyn_pct = _equal_memory_fraction(num_keys, dim, uvm_bytes)
    files = str(folder / "t0")
    models = {
        "uvm": _model("uvm", files, dim, device_id, embedding_cache_type="uvm",
                      gpucacheper=gpu_fraction),
        "dynamic": _model("dynamic", files, dim, device_id, gpucacheper=dyn_pct,
                          cache_refresh_percentage_per_iteration=1.0),
        "static": _model("static", files, dim, device_id, embedding_cache_type="static"),
    }
    config = {"supportlonglong": True, "models": [models[m] for m in modes],
              "volatile_db": {"type": "hash_map"}}
    t0 = time.perf_counter()
    hps = HPS(config)
    rows.append({"bench": "setup", "workload": f"{num_keys} keys dim {dim}: write, load s",
                 "uvm": time.perf_counter() - t0, "dynamic": write_s})
    try:
        power = {a: PowerLaw(keys, a, rng) for a in alphas}  # one rank order: shared hot keys
        for a in alphas[1:]:
            power[a].by_rank = power[alphas[0]].by_rank
        big_uniform = [cp.asarray(rng.choice(keys, 1 << 20)) for _ in range(8)]
        big_out = cp.empty((1 << 20, dim), np.float32)
        small_out = cp.empty((2000, dim), np.float32)
        figures: dict[tuple[str, str], float] = {}
        gpus = {mode: hps.server.model(mode).tables[0].gpu[device_id] for mode in modes}
        for mode in modes:
            figures[("GPU MiB", mode)] = gpus[mode].stats()["memory_bytes"] / 2**20
        for a in alphas:
            big = [cp.asarray(power[a].draw(rng, 1 << 20)) for _ in range(8)]
            small = [cp.asarray(power[a].draw(rng, 2000)) for _ in range(64)]
            for mode in modes:
                if mode == "uvm":
                    settled = _settle(cp, hps, mode, gpus[mode], big, big_out, settle_seconds,
                                      device_id)
                    rows.append({"bench": "uvm settle 1M", "workload": f"alpha {a}",
                                 "uvm": settled["settle_s"],
                                 "rows_moved": settled["rows_moved"],
                                 "promoted_on_lookup": settled["rows_promoted_on_lookup"]})
                else:
                    for b in big * 3:  # the dynamic cache fills
                        hps.lookup_fromdlpack(b, big_out, mode, 0, device_id)
                figures[(f"1M power-law {a} keys G keys/s", mode)] = _time_batches(
                    cp, hps, mode, big, big_out, 64, device_id)  # background passes included
            # then each mode's 2,000-key batches run back to back for a while, as they are
            # timed: the 1M batches' keys hold uvm's GPU rows with high counts, which passes
            # (every 0.1 s) take some tenths of a second to decay before the small batches'
            # keys can take their rows. A table gets no passes while others are looked up.
            for mode in modes:
                moved = _moved(gpus[mode].stats()) if mode == "uvm" else 0
                _run_for(hps, mode, small, small_out, small_warmup_s, device_id)
                if mode == "uvm":
                    rows.append({"bench": "uvm warm-up 2,000", "workload": f"alpha {a}",
                                 "uvm": small_warmup_s,
                                 "rows_moved": _moved(gpus[mode].stats()) - moved})
            latencies = _latencies(hps, modes, small, small_out, 2000, device_id)
            for mode, (p50, p99) in latencies.items():
                figures[(f"2,000 power-law {a} keys (64 recurring) p50 us", mode)] = p50
                figures[(f"2,000 power-law {a} keys (64 recurring) p99 us", mode)] = p99
            # fresh draws, as a serving stream brings them: the 64 batches above recur, so
            # after its warm-up the dynamic cache holds every key they have (~10^5 of a 20M
            # table) and never misses, where new requests bring tail keys it lacks. Warmed
            # on draws of their own, then timed on draws no mode has seen (the same for all)
            warm = _fresh_batches(cp, power[a], rng, 1000)
            for mode in modes:
                _run_for(hps, mode, warm, small_out, small_warmup_s, device_id)
            del warm
            fresh = _fresh_batches(cp, power[a], rng, calls_of(2000))
            latencies = _latencies(hps, modes, fresh, small_out, 2000, device_id)
            del fresh
            for mode, (p50, p99) in latencies.items():
                figures[(f"2,000 power-law {a} keys (fresh) p50 us", mode)] = p50
                figures[(f"2,000 power-law {a} keys (fresh) p99 us", mode)] = p99
        for mode in modes:
            moved = _moved(gpus[mode].stats()) if mode == "uvm" else 0
            figures[("1M uniform keys G keys/s", mode)] = _time_batches(
                cp, hps, mode, big_uniform, big_out, 8, device_id)
            if mode == "uvm":  # passes beside the timing read host rows over the bus too
                rows.append({"bench": "uvm timed 1M", "workload": "uniform",
                             "rows_moved": _moved(gpus[mode].stats()) - moved})
        for mode in modes:  # the timed path returns the file's rows
            out = cp.empty((probe_keys.size, dim), np.float32)
            hps.lookup_fromdlpack(cp.asarray(probe_keys), out, mode, 0, device_id)
            np.testing.assert_array_equal(out.get(), probe_rows)
        for workload in dict.fromkeys(w for w, _ in figures):
            row: dict[str, Any] = {"bench": "uvm", "workload": workload}
            for mode in modes:
                row[mode] = figures[(workload, mode)]
            if "uvm" in row and "dynamic" in row and workload != "GPU MiB":
                # >= 1: uvm is not slower (a rate over a rate, a latency under a latency)
                row["uvm_vs_dynamic"] = (row["uvm"] / row["dynamic"] if "G keys" in workload
                                         else row["dynamic"] / row["uvm"])
            if workload == "1M uniform keys G keys/s":
                row["hkv_hybrid"] = HKV_HYBRID["uniform"]
                if "uvm" in row:
                    row["uvm_vs_h2d"] = row["uvm"] * 1e9 * dim * 4 / bandwidth
            elif workload.startswith("1M power-law"):
                row["hkv_hybrid"] = HKV_HYBRID["power"]
            elif workload.endswith("p50 us"):
                row["hkv_hybrid"] = HKV_HYBRID["p50"]
            if workload == "GPU MiB" and "dynamic" in row:
                row["uvm_vs_dynamic"] = dyn_pct  # the dynamic cache's gpucacheper
            rows.append(row)
    finally:
        hps.close()
        if workdir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return rows


COLUMNS = ("bench", "workload", "mode", "dynamic", "uvm", "static", "uvm_vs_dynamic",
           "hkv_hybrid", "uvm_vs_h2d", "rows_moved", "promoted_on_lookup",
           "gb_s", "uniform_gkeys_s", "uniform_vs_h2d", "uniform_64k_gkeys_s", "p50_us")


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The uvm table's targets, read off the rows: (target, measured, met): never slower
    than dynamic at equal GPU memory on any workload; uniform >= 0.9 of the pinned copy."""
    out = []
    for r in rows:
        if r["bench"] != "uvm" or r.get("workload") == "GPU MiB":
            continue
        if "uvm_vs_dynamic" in r:
            out.append({"target": f"{r['workload']}: uvm >= 1.0x dynamic",
                        "measured": r["uvm_vs_dynamic"],
                        "met": "yes" if r["uvm_vs_dynamic"] >= 1.0 else "NO"})
        if "uvm_vs_h2d" in r:
            out.append({"target": "1M uniform keys: uvm >= 0.9 of pinned H2D",
                        "measured": r["uvm_vs_h2d"],
                        "met": "yes" if r["uvm_vs_h2d"] >= 0.9 else "NO"})
    return out


def main() -> None:
    from hps.tools.bench.gpu_rows import format_rows

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--gpu-fraction", type=float, default=0.1)
    parser.add_argument("--modes", default="uvm,dynamic,static")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--settle-seconds", type=float, default=30.0)
    parser.add_argument("--small-warmup-seconds", type=float, default=1.0)
    parser.add_argument("--alphas", default=",".join(map(str, ALPHAS)))
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--promote-from-host", action="store_true",
                        help="lookup promotions read their rows from host memory again "
                             "(before they copied the batch's output)")
    parser.add_argument("--host-reads", action="store_true",
                        help="instead: the host-row reads alone, for each kind of host memory")
    args = parser.parse_args()
    if args.host_reads:
        print(format_rows(bench_host_reads(args.keys, args.dim, args.device), COLUMNS))
        return
    from hps.gpu.uvm_table import UvmEmbeddingTable

    if args.promote_from_host:
        UvmEmbeddingTable.promote_from_output = False
    rows = bench_uvm(args.keys, args.dim, args.gpu_fraction,
                     tuple(float(a) for a in args.alphas.split(",")), workdir=args.workdir,
                     modes=tuple(args.modes.split(",")), settle_seconds=args.settle_seconds,
                     device_id=args.device, small_warmup_s=args.small_warmup_seconds)
    print(format_rows(rows, COLUMNS))
    summary = targets(rows)
    if summary:
        print()
        print(format_rows(summary, ("target", "measured", "met")))


if __name__ == "__main__":
    main()
