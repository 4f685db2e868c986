"""Where a uvm table's 2,000-key lookups lose to the static table's when every row is in GPU
memory (a diagnostic, not a benchmark: `python scripts/probe_uvm_small.py` on a GPU).

One table (default 2M keys, dim 64) loaded by one `HPS` as three models: static, uvm with
every row in GPU memory (gpucacheper 1.0, `--gpu-fraction`), so no lookup reads host
memory, and a dynamic cache in the uvm table's GPU memory. The same power-law draws (alpha
1.2, `--alpha`) go through `lookup_fromdlpack`: first back to back for `--warmup-seconds`
each (the dynamic cache inserts them, uvm's passes promote them), then in rounds taking
turns: wall p50 of the call and the GPU time between CUDA events recorded around it. The
uvm model then runs without its promotion task: as it was, with its counts halved (as a pass
does) before each round, and with every key's count seeded to HITS_CAP (its query then
only reads the counts, no atomics); one pass, called directly, is timed between.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _time(cp: Any, hps: Any, model: str, batches: list[Any], out: Any, calls: int
          ) -> tuple[float, float]:
    """(wall p50 µs, GPU p50 µs) of lookup_fromdlpack over `calls` calls."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    wall, gpu = [], []
    for i in range(calls):
        start.record()
        t0 = time.perf_counter()
        hps.lookup_fromdlpack(batches[i % len(batches)], out, model, 0)
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        wall.append((t1 - t0) * 1e6)
        gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(wall), statistics.median(gpu)


def _time_table(cp: Any, table: Any, batches: list[Any], out: Any, calls: int
                ) -> tuple[float, float]:
    """(wall p50 µs, 0) of the table's own query_ptr, below the lookup path's layers."""
    ws = table.workspace()
    stream = cp.cuda.get_current_stream().ptr
    ptrs = [int(b.data.ptr) for b in batches]
    out_ptr = int(out.data.ptr)
    wall = []
    for i in range(calls):
        t0 = time.perf_counter()
        table.query_ptr(ptrs[i % len(ptrs)], 2000, out_ptr, 0.0, ws, stream)
        wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(wall), 0.0


_GATE = r"""
extern "C" __global__ void gate(const long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def _time_kernel(cp: Any, table: Any, batches: list[Any], out: Any, calls: int
                 ) -> tuple[float, float]:
    """(0, GPU p50 µs) of the table's query_ptr with its launch queued behind a ~50 µs gate
    kernel: from an event after the gate to one recorded once the call returns, so the
    host's time before the launch is hidden and the figure is the kernel's (plus the
    return)."""
    gate = cp.RawKernel(_GATE, "gate")
    ws = table.workspace()
    stream = cp.cuda.get_current_stream()
    ptrs = [int(b.data.ptr) for b in batches]
    out_ptr = int(out.data.ptr)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    gpu = []
    for i in range(calls):
        gate((1,), (1,), (np.int64(100_000),))
        start.record(stream)
        table.query_ptr(ptrs[i % len(ptrs)], 2000, out_ptr, 0.0, ws, stream.ptr)
        end.record(stream)
        end.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return 0.0, statistics.median(gpu)


def main() -> None:
    import cupy as cp

    from hps.api import HPS
    from hps.gpu.uvm_table import HITS_CAP, UvmEmbeddingTable
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tools.bench.gpu_uvm import PowerLaw, _equal_memory_fraction, _model, _run_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpu-fraction", type=float, default=1.0)
    parser.add_argument("--alpha", type=float, default=1.2)
    parser.add_argument("--warmup-seconds", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=2000, help="calls a figure")
    parser.add_argument("--probe-window", type=int, default=None,
                        help="buckets a small batch's probe loads at once (static and uvm; "
                             "default: hps/gpu/static_table.py's)")
    parser.add_argument("--small-batch", type=int, default=None,
                        help="batches up to this many keys take the small-batch query "
                             "(static and uvm; 0: every batch the larger one, whose lane "
                             "groups probe the first buckets of two keys at once)")
    parser.add_argument("--load-factor", type=float, default=None,
                        help="the uvm index's keys per slot (default: the table's)")
    args = parser.parse_args()
    if args.probe_window is not None:
        import hps.gpu.static_table

        hps.gpu.static_table._WINDOW = args.probe_window
    if args.small_batch is not None:
        import hps.gpu.static_table

        hps.gpu.static_table.SMALL_BATCH = args.small_batch
    if args.load_factor is not None:
        UvmEmbeddingTable.__init__.__kwdefaults__["load_factor"] = args.load_factor
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(args.keys, dtype=np.int64) * 7 + 11)
    folder = Path(tempfile.mkdtemp(prefix="hps-uvm-probe-"))
    write_sparse_model(folder / "t0", keys, rng.random((args.keys, args.dim), np.float32))
    files = str(folder / "t0")
    uvm_bytes = UvmEmbeddingTable.device_bytes_required(
        args.keys, args.dim, int(np.ceil(args.gpu_fraction * args.keys)))
    config = {"supportlonglong": True, "volatile_db": {"type": "hash_map"}, "models": [
        _model("static", files, args.dim, 0, embedding_cache_type="static"),
        _model("uvm", files, args.dim, 0, embedding_cache_type="uvm",
               gpucacheper=args.gpu_fraction),
        _model("dynamic", files, args.dim, 0, cache_refresh_percentage_per_iteration=1.0,
               gpucacheper=min(1.0, _equal_memory_fraction(args.keys, args.dim, uvm_bytes)))]}
    hps = HPS(config)
    power = PowerLaw(keys, args.alpha, rng)
    batches = [cp.asarray(power.draw(rng, 2000)) for _ in range(64)]
    out = cp.empty((2000, args.dim), np.float32)
    uvm = hps.server.model("uvm").tables[0].gpu[0]._table
    print(f"uvm GPU rows {uvm.gpu_rows} of {args.keys} keys; used {uvm.gpu_rows_used()}")
    models = ("static", "dynamic", "uvm")
    for model in models:
        _run_for(hps, model, batches, out, args.warmup_seconds, 0)
    print(f"uvm GPU rows used after the warm-up {uvm.gpu_rows_used()}")
    tables = {m: hps.server.model(m).tables[0].gpu[0]._table for m in models}
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for m in models:
            rows.setdefault(m, []).append(_time(cp, hps, m, batches, out, args.calls))
        for m in models:
            rows.setdefault(f"{m} table query_ptr", []).append(
                _time_table(cp, tables[m], batches, out, args.calls))
        for m in models:
            rows.setdefault(f"{m} kernel (gated)", []).append(
                _time_kernel(cp, tables[m], batches, out, args.calls // 4))
    # what a pass costs here, called directly
    hits, links = uvm._hits, uvm._gpu_row
    print(f"candidates (hits >= 2, no GPU row): "
          f"{int(cp.count_nonzero((hits >= 2) & (links == 0xFFFFFFFF)))}")
    for _ in range(3):
        t0 = time.perf_counter()
        moved = uvm.promote()
        print(f"promote(): {(time.perf_counter() - t0) * 1e3:.2f} ms, {moved} rows moved")
    if uvm._promoter is not None:
        uvm._promoter.close(timeout=30)
    for _ in range(args.rounds):
        rows.setdefault("uvm, no promotion task", []).append(
            _time(cp, hps, "uvm", batches, out, args.calls))
    for _ in range(args.rounds):  # the counts halved as a pass does, nothing else
        with uvm._stream:
            cp.right_shift(hits, 1, out=hits)
        uvm._stream.synchronize()
        rows.setdefault("uvm, no task, counts halved", []).append(
            _time(cp, hps, "uvm", batches, out, args.calls))
    for _ in range(args.rounds):  # no atomics: every count at the cap
        uvm.seed_hits(cp.asarray(keys), cp.full(keys.size, HITS_CAP, np.uint32))
        rows.setdefault("uvm, no task, counts capped", []).append(
            _time(cp, hps, "uvm", batches, out, args.calls))
    print(f"{'model':30s} {'wall p50 us (rounds)':40s} GPU p50 us (rounds)")
    for name, figures in rows.items():
        print(f"{name:30s} {' '.join(f'{w:5.1f}' for w, _ in figures):40s} "
              f"{' '.join(f'{g:5.1f}' for _, g in figures)}")
    hps.close()


if __name__ == "__main__":
    main()
