"""Why a caller that checks each output between calls gets slower calls (a diagnostic, not a
benchmark: `python scripts/probe_checked_gap.py` on a GPU).

HugeCTR's profile (`hps bench gpu --profile hugectr`: 630,000 keys dim 16, power law 1.2,
2,000 keys, a cold dynamic cache of 0.9, every miss synchronous) through
`HPS.lookup_fromdlpack` with torch tensors, one output reused, on a fresh server (a cold
cache) for each way of spending the host's time between calls:

- nothing (back to back, as hps_profiler);
- the output filled with NaN and the stream synchronized (the checked caller's first half);
- that, then the check itself: the output copied to the host and compared with the model;
- that, then a busy loop of `--gap-us` instead of the check (host busy, caches kept);
- that, then `time.sleep` of `--gap-us` (host idle);
- that, then a walk over `--flush-mib` of host memory (the caches flushed, no GPU work).

Prints mean, p50 and p99 of the timed call (the last 900 of 1,000) for each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def main() -> None:
    import torch

    from hps.tools.bench.gpu_misses import _power_law_ranks, _server
    from hps.tools.bench.gpu_public import MODEL

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-us", type=float, default=300.0)
    parser.add_argument("--flush-mib", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    table_keys, dim, n = 630_000, 16, 2000
    keys = rng.permutation(np.arange(table_keys, dtype=np.int64)) * 7 + 3
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    batches = _power_law_ranks(rng, table_keys, 1.2, n, args.lookups)
    flush = np.ones(args.flush_mib << 18, np.float32)  # MiB of float32
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev)
    gap = args.gap_us / 1e6

    def busy() -> None:
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass

    between: dict[str, Any] = {
        "back to back": None,
        "fill + sync": lambda out, idx: None,
        "fill + sync + check": lambda out, idx: (out.cpu().numpy() != rows[idx]).any(),
        "fill + sync + busy loop": lambda out, idx: busy(),
        "fill + sync + sleep": lambda out, idx: time.sleep(gap),
        "fill + sync + cache flush": lambda out, idx: float(flush.sum()),
    }
    print(f"{'between calls':28s} {'mean':>7s} {'p50':>7s} {'p99':>7s}  µs")
    for name, then in between.items():
        with tempfile.TemporaryDirectory() as tmp:
            hps = _server(Path(tmp), keys, rows, n, 0, 0.9)
            try:
                t_keys = [torch.as_tensor(keys[b], device=dev) for b in batches]
                out = torch.empty((n, dim), dtype=torch.float32, device=dev)
                torch.cuda.synchronize(dev)
                times = []
                for i, (idx, k) in enumerate(zip(batches, t_keys, strict=True)):
                    if then is not None:
                        out.fill_(float("nan"))
                        stream.synchronize()
                    t0 = time.perf_counter()
                    hps.lookup_fromdlpack(k, out, MODEL, 0, 0)
                    stream.synchronize()
                    t1 = time.perf_counter()
                    if i >= args.lookups // 10:
                        times.append((t1 - t0) * 1e6)
                    if then is not None:
                        then(out, idx)
                print(f"{name:28s} {statistics.fmean(times):7.1f} "
                      f"{statistics.median(times):7.1f} {np.percentile(times, 99):7.1f}")
            finally:
                hps.close()


if __name__ == "__main__":
    main()
