"""Probe: what the common-case intake (hps/intake/fast.py) saves a lookup into a 16-bit
output, through the public call.

    python scripts/narrow_output_probe.py [--dim 64] [--batches 1,16,256,2000,65536,1048576]

One static table of `--table-keys` keys per storage type (float16, bfloat16), served by
`HPS`, looked up with `lookup_fromdlpack(torch keys, torch output)` into the storage's own
16-bit output: "common" as shipped, "general" with the common-case reader turned off in
this process (every call through hps/intake/array_ref.py and hps/intake/keys.py, as 16-bit outputs went
before). Beside them, on the same draws and taking turns call by call: the same table into
a float32 output (common case), and the floor, `torch.index_select` of the same 16-bit rows
from a dense torch table. Each call is followed by a sync of the stream (wall clock around
both). Prints p50 in µs, general / common, and common over the floor; outputs of the two
intakes are compared bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _general_only(keys: Any, out: Any) -> None:
    return None  # hps/intake/fast.py's reader, turned off: every call the general path


def _caller(call: Callable[..., Any], table: Any, outs: dict[str, Any], draws: list[Any],
            index: list[Any]) -> Callable[[str, int, int], None]:
    """looked(name, i, b): case `name` on the first b keys of draw i (see the docstring)."""
    import torch

    from hps.tools.bench.gpu_public import MODEL
    from hps.server import parameter_server

    common_reader = parameter_server.device_pair

    def looked(name: str, i: int, b: int) -> None:
        if name == "floor":
            torch.index_select(table, 0, index[i % 4][:b], out=outs[name][:b])
            return
        if name == "general":
            parameter_server.device_pair = _general_only  # type: ignore[assignment]
        try:
            call(draws[i % 4][:b], outs[name][:b], MODEL, 0, 0)
        finally:
            parameter_server.device_pair = common_reader

    return looked


def main() -> None:
    import torch

    from hps import write_sparse_model
    from hps.tools.bench.gpu_public import server_over_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--table-keys", type=int, default=1 << 20)
    parser.add_argument("--batches", default="1,16,256,2000,65536,1048576")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    most = max(batches)
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, args.table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((args.table_keys, args.dim), dtype=np.float32)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev)
    picks = [rng.integers(0, args.table_keys, most) for _ in range(4)]
    draws = [torch.as_tensor(keys[p], device=dev) for p in picks]
    index = [torch.as_tensor(p, device=dev) for p in picks]
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    print(f"static table, {args.table_keys:,} keys, dim {args.dim}; "
          "lookup_fromdlpack(torch, torch) + stream sync, p50 us")
    print(f"{'rows':9} {'batch':>8} {'common':>8} {'general':>8} {'gen/com':>7} "
          f"{'f32 out':>8} {'floor':>8} {'com/floor':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_model(Path(tmp) / "t0", keys, rows)
        for storage, dtype in dtypes.items():
            hps = server_over_folder(Path(tmp), args.dim, most, 0,
                                     embedding_storage_dtype=storage)
            table = torch.as_tensor(rows, device=dev).to(dtype)
            outs = {name: torch.empty((most, args.dim), dtype=dtype, device=dev)
                    for name in ("common", "general", "floor")}
            outs["f32 out"] = torch.empty((most, args.dim), dtype=torch.float32, device=dev)
            looked = _caller(hps.lookup_fromdlpack, table, outs, draws, index)

            try:
                for b in batches:
                    calls = max(4, min(args.calls, (4 << 20) // b))
                    samples: dict[str, list[float]] = {name: [] for name in outs}
                    clock = time.perf_counter
                    for r in range(args.rounds + 1):  # round 0 warms up
                        for i in range(calls):
                            for name in outs:
                                t0 = clock()
                                looked(name, i, b)
                                stream.synchronize()
                                if r:
                                    samples[name].append(clock() - t0)
                    med = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
                    same = torch.equal(outs["common"][:b].view(torch.int16),
                                       outs["general"][:b].view(torch.int16))
                    print(f"{storage:9} {b:8d} {med['common']:8.1f} {med['general']:8.1f} "
                          f"{med['general'] / med['common']:7.3f} {med['f32 out']:8.1f} "
                          f"{med['floor']:8.1f} {med['common'] / med['floor']:9.3f}"
                          f"{'' if same else '  OUTPUTS DIFFER'}", flush=True)
            finally:
                hps.close()


if __name__ == "__main__":
    main()
