"""Where one `lookup_fromdlpack` call's host time goes, layer by layer (GPU machine).

One thread, its torch stream made current once, a dynamic cache holding the whole table
(4M x 64, every key held), 2,000 power-law keys a call: the threads profile's one-caller
point. Each line times one layer of the public call, called directly with the same
arguments, in µs a call (mean of `--calls` calls; the lines take turns for `--rounds`
rounds and the median round is printed). Layers that wait for the kernel (the public call
and everything down to the query) include the kernel; "no wait" lines replace the query's
wait for its miss count by "none" (right here: every key is held).

    python scripts/probe_call_layers.py [--rounds 5] [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--table-keys", type=int, default=1 << 22)
    args = parser.parse_args()

    import torch

    from hps import write_sparse_model
    from hps.gpu import device_table
    from hps.intake.keys import device_pair
    from hps.tools.bench.gpu_public import MODEL, server_over_folder
    from hps.tools.bench.gpu_threads import _draws

    dim, n = 64, 2000
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, args.table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((args.table_keys, dim)).astype(np.float32)
    dense = torch.as_tensor(rows, device="cuda:0")
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    pos = torch.as_tensor(_draws(rng, args.table_keys, n, 1, 1.1, False)[0], device="cuda:0")
    dkeys = torch.as_tensor(keys, device="cuda:0")[pos].contiguous()
    out = torch.empty((n, dim), device="cuda:0")
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_model(Path(tmp) / "t0", keys, rows)
        hps = server_over_folder(Path(tmp), dim, n, 0, embedding_cache_type="dynamic",
                                 gpucacheper=1.0, hit_rate_threshold=1.0)
    try:
        server = hps.server
        gpu = server.model(MODEL).tables[0].gpu[0]
        table = gpu._table
        sync = stream.synchronize
        pair = device_pair(dkeys, out)
        assert pair is not None
        kp, count, op, _, _, sp, out_type = pair
        state = gpu._state()
        ws = state.ws
        held = device_table.wait_while_held

        def none(address: int, sentinel: int, spins: int) -> int:
            return 0

        def no_wait(call: Callable[[], object]) -> Callable[[], object]:
            def run() -> object:
                device_table.wait_while_held = none
                try:
                    return call()
                finally:
                    device_table.wait_while_held = held
            return run

        def batched(call: Callable[[], object]) -> Callable[[], None]:
            """`call` made 100 times, then one sync: its host cost, the GPU's hidden."""
            def run() -> None:
                for _ in range(100):
                    call()
                sync()
            return run

        lines: dict[str, tuple[Callable[[], object], int]] = {
            "floor: index_select + sync": (
                lambda: (torch.index_select(dense, 0, pos, out=out), sync()), 1),
            "floor: index_select alone (100 a sync)": (
                batched(lambda: torch.index_select(dense, 0, pos, out=out)), 100),
            "HPS.lookup_fromdlpack + sync": (
                lambda: (hps.lookup_fromdlpack(dkeys, out, MODEL, 0), sync()), 1),
            "HPS.lookup_fromdlpack": (lambda: hps.lookup_fromdlpack(dkeys, out, MODEL, 0), 1),
            "server.lookup_into": (lambda: server.lookup_into(MODEL, 0, dkeys, out), 1),
            "GpuEmbeddingTable.lookup_contiguous": (
                lambda: gpu.lookup_contiguous(kp, count, op, sp, out_type), 1),
            "DeviceTable.query_ptr": (
                lambda: table.query_ptr(kp, count, op, 0.0, ws, sp, out_type), 1),
            "no wait: HPS.lookup_fromdlpack (100 a sync)": (
                no_wait(batched(lambda: hps.lookup_fromdlpack(dkeys, out, MODEL, 0))), 100),
            "no wait: DeviceTable.query_ptr (100 a sync)": (
                no_wait(batched(lambda: table.query_ptr(kp, count, op, 0.0, ws, sp,
                                                        out_type))), 100),
            "device_pair(keys, out)": (lambda: device_pair(dkeys, out), 1),
            "registry acquire + release": (
                lambda: server._registry.acquire(MODEL).refs.release(), 1),
            "torch.cuda.current_stream()": (lambda: torch.cuda.current_stream(), 1),
            "stream.synchronize() (idle)": (sync, 1),
        }
        for call, _ in lines.values():  # warm-up
            for _ in range(50):
                call()
        sync()
        times: dict[str, list[float]] = {name: [] for name in lines}
        for _ in range(args.rounds):
            for name, (call, per) in lines.items():
                calls = max(args.calls // per, 1)
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                sync()
                times[name].append((time.perf_counter() - start) / (calls * per) * 1e6)
        print(f"one thread, stream set once, {n} keys, dim {dim}, all held; µs a call, "
              f"median of {args.rounds} rounds (min-max)")
        for name, ts in times.items():
            print(f"  {name:48s} {statistics.median(ts):7.2f}  ({min(ts):.2f}-{max(ts):.2f})")
        got = out.cpu().numpy()
        hps.lookup_fromdlpack(dkeys, out, MODEL, 0)
        sync()
        assert np.array_equal(out.cpu().numpy(), rows[pos.cpu().numpy()]), "wrong rows"
        del got
    finally:
        hps.close()


if __name__ == "__main__":
    main()
