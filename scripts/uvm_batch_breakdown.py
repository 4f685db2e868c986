"""Probe: where a large uniform uvm batch's time goes, kernel by kernel.

    python scripts/uvm_batch_breakdown.py [--keys 20000000] [--dim 64] [--batch 1048576]

Builds a uvm table (`--keys` keys of width `--dim`, a tenth of its rows in GPU memory,
no promotion) and queries it with uniform batches of `--batch` keys, which read their
host rows grouped by region (cuda/uvm_table.cu): the query, the region scan, the scatter
into region order and the gather of the host rows. Prints the wall time of a batch, and
with CUDA events recorded between the four launches, each kernel's median time, beside
the pinned host-to-device copy bandwidth of the same run. A diagnostic of the table
itself: the public call's figures are `python -m hps.tools.bench.gpu_uvm`'s.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import numpy as np

KERNELS = ("query", "scan", "scatter", "gather")


def main() -> None:
    import cupy as cp

    from hps.tools.bench.gpu_uvm import h2d_bandwidth
    from hps.gpu.uvm_table import UvmEmbeddingTable

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=20_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1 << 20)
    parser.add_argument("--calls", type=int, default=12)
    args = parser.parse_args()
    bandwidth = h2d_bandwidth()
    table = UvmEmbeddingTable(args.keys, args.dim, 0, gpu_rows=args.keys // 10,
                              promotion_interval=0)
    keys = cp.arange(args.keys, dtype=cp.int64) * 7 + 11
    for i in range(0, args.keys, 1 << 20):
        part = keys[i:i + (1 << 20)]
        table.build(part, cp.random.random_sample((part.size, args.dim), dtype=cp.float32))
    launches = table._grouped_launches
    marks: list[tuple[str, Any, Any]] = []  # (kernel, event before it, its stream)

    def timed_launches(out_type: int) -> tuple[Any, ...]:
        def stamped(name: str, launch: Any) -> Any:
            def run(grid: int, block: int, stream_ptr: int, *launch_args: Any) -> None:
                stream = cp.cuda.ExternalStream(stream_ptr)
                event = cp.cuda.Event()
                event.record(stream)
                marks.append((name, event, stream))
                launch(grid, block, stream_ptr, *launch_args)
            return run
        return tuple(stamped(n, f) for n, f in zip(KERNELS, launches(out_type), strict=True))

    table._grouped_launches = timed_launches  # type: ignore[method-assign]
    table._grouped = {}
    rng = np.random.default_rng(0)
    batches = [keys[cp.asarray(rng.integers(0, args.keys, args.batch))] for _ in range(4)]
    out = cp.empty((args.batch, args.dim), dtype=cp.float32)
    walls: list[float] = []
    parts: dict[str, list[float]] = {name: [] for name in KERNELS}
    for call in range(args.calls + 2):  # two warm-up calls
        marks.clear()
        start = time.perf_counter()
        table.query_misses(batches[call % 4], out)
        end = cp.cuda.Event()
        end.record(marks[-1][2])
        end.synchronize()
        if call >= 2:
            walls.append(time.perf_counter() - start)
            events = [(name, event) for name, event, _ in marks] + [("end", end)]
            for (name, a), (_, b) in itertools.pairwise(events):
                parts[name].append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    table.close()
    wall = statistics.median(walls)
    row_bytes = args.dim * 4
    print(f"pinned host-to-device copy: {bandwidth / 1e9:.1f} GB/s")
    print(f"batch of {args.batch:,} uniform keys: {wall * 1e6:,.0f} µs, "
          f"{args.batch / wall / 1e9:.3f} G keys/s, "
          f"{args.batch * row_bytes / wall / bandwidth:.3f} of the copy")
    for name in KERNELS:
        print(f"  {name:8} {statistics.median(parts[name]):9,.1f} µs")


if __name__ == "__main__":
    main()
