"""Probe: a GPU table's index reads with and without an L2 evict_last policy.

    python scripts/index_hint_probe.py [--dim 128] [--table-keys 1048576] [--storages ...]
                                       [--cache-type static|dynamic]

For each storage type, two HPS over the same model folder (a GPU table of every key): one
with HINTS bit 2 cleared ("0"), one with it set ("2": the queries' set or bucket lines kept
in L2 ahead of the streamed rows, cuda/hps_common.cuh's hps_load_index_keys). Both
answer the same 1M-key uniform draws through `HPS.lookup_fromdlpack` into torch outputs;
calls alternate between the two, round by round, each followed by a stream sync (wall
clock around both). Prints the median call, G keys/s, each case over float32 storage of
the same launch, and bit 2 over the shipped launch; outputs are compared bit for bit.
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
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--table-keys", type=int, default=1 << 20)
    parser.add_argument("--batch", type=int, default=1 << 20)
    parser.add_argument("--storages", default="float32,float16,int8")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--cache-type", default="static")
    parser.add_argument("--shapes", default="",
                        help="also compact rows at these launch shapes, with bit 2: "
                             "'group,unroll;group,unroll'")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, args.table_keys, replace=False).astype(np.int64)
    dev = torch.device("cuda", 0)
    storages = args.storages.split(",")
    cases = [(s, "float32") for s in storages] + [(s, s) for s in storages
                                                  if s in ("float16", "bfloat16")]
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_sparse_model(folder / "t0", keys, rng.standard_normal(
            (args.table_keys, args.dim), dtype=np.float32))
        servers = {}
        for storage in storages:
            variants = [0, 2] + ([(g, u) for g, u in shapes] if storage != "float32" else [])
            for bit in variants:
                hps = server_over_folder(folder, args.dim, args.batch, 0,
                                         embedding_storage_dtype=storage,
                                         embedding_cache_type=args.cache_type)
                table = hps.server.model(MODEL).tables[0].gpu[0]._table
                if isinstance(bit, tuple):
                    table.set_launch(bit[0], bit[1], table._waves, table._hints | 2)
                else:
                    table.set_launch(table._group, table._unroll, table._waves,
                                     (table._hints & ~2) | bit)
                servers[(storage, bit)] = hps
                print(f"{storage} hints {table._hints}: ready", flush=True)
        draws = [torch.as_tensor(keys[rng.integers(0, args.table_keys, args.batch)],
                                 device=dev) for _ in range(4)]
        outs = {(case, bit): torch.empty((args.batch, args.dim), dtype=dtypes[case[1]],
                                         device=dev) for case in cases
                for (storage, bit) in servers if storage == case[0]}
        stream = torch.cuda.current_stream(dev)
        for case in cases:
            bits = [b for (st, b) in servers if st == case[0]]
            for bit in bits:
                servers[(case[0], bit)].lookup_fromdlpack(draws[0], outs[(case, bit)], MODEL, 0, 0)
            stream.synchronize()
            word = torch.int16 if case[1] != "float32" else torch.int32
            same = all(torch.equal(outs[(case, 0)].view(word), outs[(case, b)].view(word))
                       for b in bits)
            print(f"{case[0]} -> {case[1]}: outputs equal bit for bit: {same}", flush=True)
        samples: dict[tuple[tuple[str, str], int], list[float]] = {k: [] for k in outs}
        clock = time.perf_counter
        for r in range(args.rounds + 1):
            for case in cases:
                for i in range(args.calls):
                    for bit in [b for (st, b) in servers if st == case[0]]:
                        call = servers[(case[0], bit)].lookup_fromdlpack
                        t0 = clock()
                        call(draws[i % 4], outs[(case, bit)], MODEL, 0, 0)
                        stream.synchronize()
                        if r:
                            samples[(case, bit)].append(clock() - t0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        base = cases[0]
        print(f"\n{args.cache_type}, dim {args.dim}, table {args.table_keys:,} keys, "
              f"batch {args.batch:,}")
        print(f"{'case':28} {'launch':>6} {'us':>8} {'Gkeys/s':>8} {'x f32':>6} {'x bit0':>6}")
        for case in cases:
            for bit in [b for (st, b) in servers if st == case[0]]:
                t = med[(case, bit)]
                f32 = med[(base, bit if not isinstance(bit, tuple) else 2)]
                label = bit if not isinstance(bit, tuple) else f"{bit[0]},{bit[1]}+2"
                print(f"{case[0] + ' -> ' + case[1]:28} {label!s:>6} {t * 1e6:8.1f} "
                      f"{args.batch / t / 1e9:8.3f} {f32 / t:6.3f} "
                      f"{med[(case, 0)] / t:6.3f}")
        for hps in servers.values():
            hps.close()


if __name__ == "__main__":
    main()
