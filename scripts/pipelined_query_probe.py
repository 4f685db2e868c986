"""Probe: a GPU table's large batches into 16-bit outputs with and without its pipelined
query kernel (cuda/static_table.cu static_query_pipelined, cuda/embedding_cache.cu
cache_query_pipelined).

    python scripts/pipelined_query_probe.py [--dims 32,64,128,256] [--table-keys 1048576]
                                            [--batches 131072,1048576]
                                            [--cache-type static|dynamic]

For each width: one HPS with float32 rows (the reference of the issue's ratios) and, for
float16 and bfloat16 rows, two HPS over the same model folder: "on" as shipped, "off" with
the pipelined kernel turned off (static_query for every large batch). All answer the same
uniform draws through `HPS.lookup_fromdlpack` into torch outputs (16-bit outputs for the
compact rows); calls alternate round by round, each followed by a stream sync. Prints the
median call, G keys/s, on over off and over float32 rows; outputs of on and off are
compared bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    import torch

    from hps import write_sparse_model
    from hps.tools.bench.gpu_public import MODEL, server_over_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="32,64,128,256")
    parser.add_argument("--table-keys", type=int, default=1 << 20)
    parser.add_argument("--batches", default="131072,1048576")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--cache-type", default="static")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    most = max(batches)
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, args.table_keys, replace=False).astype(np.int64)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    variants = [("float32", "on"), ("float16", "on"), ("float16", "off"),
                ("bfloat16", "on"), ("bfloat16", "off")]
    draws = [torch.as_tensor(keys[rng.integers(0, args.table_keys, most)], device=dev)
             for _ in range(4)]
    print(f"{args.cache_type}, {args.table_keys:,} keys; 16-bit rows into 16-bit outputs")
    print(f"{'dim':>4} {'rows':9} {'batch':>8} {'on us':>8} {'off us':>8} {'on/off':>6} "
          f"{'G keys/s':>8} {'x f32':>6}")
    for dim in (int(d) for d in args.dims.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_sparse_model(folder / "t0", keys, rng.standard_normal(
                (args.table_keys, dim), dtype=np.float32))
            servers = {}
            for storage, mode in variants:
                hps = server_over_folder(folder, dim, most, 0,
                                         embedding_storage_dtype=storage,
                                         embedding_cache_type=args.cache_type)
                if mode == "off":
                    table = hps.server.model(MODEL).tables[0].gpu[0]._table
                    with table._lock:
                        table._pipelined_kernel = None
                        table._fn = {}
                        table._generation += 1
                servers[(storage, mode)] = hps
            outs = {v: torch.empty((most, dim), dtype=dtypes[v[0]], device=dev)
                    for v in variants}
            samples: dict[tuple[tuple[str, str], int], list[float]] = {
                (v, b): [] for v in variants for b in batches}
            clock = time.perf_counter
            for r in range(args.rounds + 1):
                for b in batches:
                    for i in range(args.calls):
                        for v in variants:
                            call = servers[v].lookup_fromdlpack
                            t0 = clock()
                            call(draws[i % 4][:b], outs[v][:b], MODEL, 0, 0)
                            stream.synchronize()
                            if r:
                                samples[(v, b)].append(clock() - t0)
            med = {k: statistics.median(s) for k, s in samples.items()}
            for storage in ("float16", "bfloat16"):
                same = torch.equal(outs[(storage, "on")].view(torch.int16),
                                   outs[(storage, "off")].view(torch.int16))
                for b in batches:
                    on, off = med[((storage, "on"), b)], med[((storage, "off"), b)]
                    f32 = med[(("float32", "on"), b)]
                    print(f"{dim:4d} {storage:9} {b:8d} {on * 1e6:8.1f} {off * 1e6:8.1f} "
                          f"{off / on:6.3f} {b / on / 1e9:8.3f} {f32 / on:6.3f}"
                          f"{'' if same else '  OUTPUTS DIFFER'}", flush=True)
            for hps in servers.values():
                hps.close()


if __name__ == "__main__":
    main()
