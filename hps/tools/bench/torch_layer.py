"""`hps bench torch`: what `hps.torch.LookupLayer` costs over the call it wraps.

One table of a synthetic model in HugeCTR's format (`--table-keys` keys of width `--dim`)
is served by HPS: from the GPU cache, filled at load, with `--device cuda`; from the
in-process tier with `--device cpu`. Each measure looks up the same batches of `--keys`
keys, all present, on that device:

- `lookup_fromdlpack`: into a preallocated output (the baseline);
- `lookup_fromdlpack + torch.empty`: into a fresh output, as the layer must allocate one;
- `LookupLayer`: the layer called eagerly;
- `torch.ops.hps.lookup`: the custom op through PyTorch's dispatcher;
- `torch.compile(layer)`: the layer compiled with `fullgraph=True` (backend aot_eager: the
  op inside a traced graph).

A round runs `--calls` calls of one measure (then one device synchronize on CUDA); the
measures take turns, and each figure is the median over `--rounds` rounds of the time per
call. The layer's overhead is its time minus the baseline's, in µs and as a ratio.
Run `hps bench torch` or `python -m hps.tools.bench.torch_layer`.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps.modelfiles.formats.sparse_folder import write_sparse_model
from hps.tools.bench.tiers import _interleaved_medians

MODEL = "bench"


def _config(folder: Path, dim: int, device: str) -> dict[str, Any]:
    gpu = device == "cuda"
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [str(folder / "table0")],
            "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [1],
            "deployed_device_list": [0], "max_batch_size": 1 << 20,
            "gpucache": gpu, "gpucacheper": 1.0, "hit_rate_threshold": 1.0,
            "cache_refresh_percentage_per_iteration": 1.0 if gpu else 0.0,
        }],
        "volatile_db": {"type": "hash_map"},
    }


def bench_torch_layer(keys: int = 2000, dim: int = 16, table_keys: int = 100_000,
                      device: str = "cpu", rounds: int = 30, calls: int = 100,
                      seed: int = 0) -> list[dict[str, Any]]:
    """Rows of {name, us_per_call, over_baseline_us, vs_baseline} (see the module doc)."""
    import torch

    from hps.api import HPS
    from hps.torch import LookupLayer, close_servers, lookup

    rng = np.random.default_rng(seed)
    file_keys = rng.choice(np.int64(2**62), size=table_keys, replace=False)
    with tempfile.TemporaryDirectory(prefix="hps-bench-torch-") as tmp:
        folder = Path(tmp)
        write_sparse_model(folder / "table0", file_keys,
                           rng.standard_normal((table_keys, dim), dtype=np.float32))
        config = _config(folder, dim, device)
        server = HPS(config)  # the layer below shares its server (one per config)
        try:
            layer = LookupLayer(config, MODEL, 0, dim)
            batches = [torch.as_tensor(file_keys[rng.integers(0, table_keys, keys)],
                                       device=device) for _ in range(8)]
            out = torch.empty((keys, dim), dtype=torch.float32, device=device)
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
            sync: Callable[[], None] = (torch.cuda.synchronize if device == "cuda"
                                        else (lambda: None))
            measures: dict[str, Callable[[torch.Tensor], object]] = {
                "lookup_fromdlpack": lambda k: server.lookup_fromdlpack(k, out, MODEL, 0),
                "lookup_fromdlpack + torch.empty": lambda k: server.lookup_fromdlpack(
                    k, torch.empty((keys, dim), dtype=torch.float32, device=device), MODEL, 0),
                "LookupLayer": layer,
                "torch.ops.hps.lookup": lambda k: lookup(k, layer._handle, MODEL, 0, dim, 0),
                "torch.compile(layer)": compiled,
            }
            expected = server.lookup(batches[0].cpu(), MODEL, 0)
            for name, fn in measures.items():  # every measure returns the same vectors
                got: Any = fn(batches[0])
                got = out if got is None else got
                np.testing.assert_array_equal(got.cpu().numpy().reshape(keys, dim), expected,
                                              err_msg=name)

            def rounds_of(fn: Callable[[Any], object]) -> Callable[[int], None]:
                def run(i: int) -> None:
                    for c in range(calls):
                        fn(batches[(i + c) % len(batches)])
                    sync()
                return run

            seconds = _interleaved_medians(
                {name: rounds_of(fn) for name, fn in measures.items()}, rounds, warmup=3)
        finally:
            close_servers()
            server.close()
    base = seconds["lookup_fromdlpack"] / calls * 1e6
    rows = []
    for name, s in seconds.items():
        us = s / calls * 1e6
        rows.append({"name": name, "us_per_call": us, "over_baseline_us": us - base,
                     "vs_baseline": us / base})
    return rows


def format_rows(rows: list[dict[str, Any]], device: str, keys: int, dim: int) -> str:
    lines = [f"LookupLayer vs lookup_fromdlpack: {keys:,} keys, width {dim}, on {device}",
             f"{'measure':34} {'µs/call':>10} {'over baseline µs':>17} {'ratio':>7}"]
    for r in rows:
        lines.append(f"{r['name']:34} {r['us_per_call']:10.1f} {r['over_baseline_us']:17.1f} "
                     f"{r['vs_baseline']:7.3f}")
    layer = next(r for r in rows if r["name"] == "LookupLayer")
    lines.append(f"LookupLayer overhead over lookup_fromdlpack: "
                 f"{layer['over_baseline_us']:.1f} µs per call ({layer['vs_baseline']:.3f}×)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--table-keys", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    rows = bench_torch_layer(args.keys, args.dim, args.table_keys, args.device, args.rounds,
                             args.calls)
    print(format_rows(rows, args.device, args.keys, args.dim))


if __name__ == "__main__":
    main()
