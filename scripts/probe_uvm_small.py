"""Where a uvm table's 2,000-key lookups lose to the static table's when every row is in GPU
memory (a diagnostic, not a benchmark: `python scripts/probe_uvm_small.py` on a GPU).

One table (default 2M keys, dim 64) loaded by one `HPS` as two models: static, and uvm with
every row in GPU memory (gpucacheper 1.0), so no lookup reads host memory. The same
power-law draws (alpha 1.2) go through `lookup_fromdlpack` in rounds taking turns: wall p50
of the call and the GPU time between CUDA events recorded around it. The uvm model runs
twice: as loaded, and with every key's access count seeded to HITS_CAP (its query then
only reads the counts, no atomics).
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
    from hps.gpu.uvm_table import HITS_CAP
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tools.bench.gpu_uvm import PowerLaw, _model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls a figure")
    parser.add_argument("--load-factor", type=float, default=None,
                        help="the uvm index's keys per slot (default: the table's)")
    args = parser.parse_args()
    if args.load_factor is not None:
        from hps.gpu.uvm_table import UvmEmbeddingTable

        UvmEmbeddingTable.__init__.__kwdefaults__["load_factor"] = args.load_factor
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(args.keys, dtype=np.int64) * 7 + 11)
    folder = Path(tempfile.mkdtemp(prefix="hps-uvm-probe-"))
    write_sparse_model(folder / "t0", keys, rng.random((args.keys, args.dim), np.float32))
    files = str(folder / "t0")
    config = {"supportlonglong": True, "volatile_db": {"type": "hash_map"}, "models": [
        _model("static", files, args.dim, 0, embedding_cache_type="static"),
        _model("uvm", files, args.dim, 0, embedding_cache_type="uvm", gpucacheper=1.0)]}
    hps = HPS(config)
    power = PowerLaw(keys, 1.2, rng)
    batches = [cp.asarray(power.draw(rng, 2000)) for _ in range(64)]
    out = cp.empty((2000, args.dim), np.float32)
    uvm = hps.server.model("uvm").tables[0].gpu[0]._table
    print(f"uvm GPU rows {uvm.gpu_rows} of {args.keys} keys; used {uvm.gpu_rows_used()}")
    for model in ("static", "uvm"):
        _time(cp, hps, model, batches, out, args.calls // 4)
    static = hps.server.model("static").tables[0].gpu[0]._table
    rows: dict[str, list[tuple[float, float]]] = {
        "static": [], "uvm": [], "uvm, counts capped": [], "static table query_ptr": [],
        "uvm table query_ptr": [], "static kernel (gated)": [], "uvm kernel (gated)": [],
        "uvm, no promotion task": []}
    for _ in range(args.rounds):
        rows["static"].append(_time(cp, hps, "static", batches, out, args.calls))
        rows["uvm"].append(_time(cp, hps, "uvm", batches, out, args.calls))
        uvm.seed_hits(cp.asarray(keys), cp.full(keys.size, HITS_CAP, np.uint32))
        rows["uvm, counts capped"].append(_time(cp, hps, "uvm", batches, out, args.calls))
        for name, table in (("static table query_ptr", static), ("uvm table query_ptr", uvm)):
            rows[name].append(_time_table(cp, table, batches, out, args.calls))
        for name, table in (("static kernel (gated)", static), ("uvm kernel (gated)", uvm)):
            rows[name].append(_time_kernel(cp, table, batches, out, args.calls // 4))
    if uvm._promoter is not None:
        uvm._promoter.close(timeout=30)
    for _ in range(args.rounds):
        rows["uvm, no promotion task"].append(_time(cp, hps, "uvm", batches, out, args.calls))
    print(f"{'model':22s} {'wall p50 us (rounds)':40s} GPU p50 us (rounds)")
    for name, figures in rows.items():
        print(f"{name:22s} {' '.join(f'{w:5.1f}' for w, _ in figures):40s} "
              f"{' '.join(f'{g:5.1f}' for _, g in figures)}")
    hps.close()


if __name__ == "__main__":
    main()
