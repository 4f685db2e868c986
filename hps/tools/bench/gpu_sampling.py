"""What the hot-key sampling of a GPU table costs the public call
(`python -m hps.tools.bench.gpu_sampling`; needs CuPy, torch and a CUDA device).

One static GPU table (`--profile public`'s: 262,144 keys of width 64, hps/tools/bench/
gpu_public.py) served by one `HPS` with `hot_key_sampling` at a GPU table's default (1
lookup in 32, at most 64 keys of it: hps/gpu/key_sample.py; `--every` sets it).
`lookup_fromdlpack` of 2,000 torch keys into a torch output, a sync of the stream after
each call (wall clock around both), in blocks of `block` calls taking turns: the table's
sampler on, the table's sampler off (the same table with no sampler: what
`hot_key_sampling: 0` serves), and the floor, `torch.index_select` of the same rows from
a dense torch table (each turn starting with the next of the three). Prints p50, mean
and p99 of each, and the sampler's cost per call: the sampled calls' p50 and the other
calls' p50 (with the sampler on) over the p50 with it off, weighted 1 and N - 1 in N
(the bound hps holds it to: 3% of the call). On over off by mean is printed too: it carries the
sampled calls but also every outlier of either turn (on a shared machine, ±10% from run
to run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from hps.tools.bench.gpu_public import MODEL, server_over_files


def bench_sampling(calls: int = 10_240, block: int = 256, n: int = 2000, dim: int = 64,
                   table_keys: int = 1 << 18, device_id: int = 0, seed: int = 0,
                   every: int | None = None) -> dict[str, dict[str, float]]:
    """p50, mean and p99 (µs) of the public call with the sampler on and off and of the
    floor, `calls` each in turns of `block`; see the module docstring."""
    import torch

    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    dev = torch.device("cuda", device_id)
    torch.cuda.set_device(dev)
    with tempfile.TemporaryDirectory() as tmp:
        model = {} if every is None else {"hot_key_sampling": every}
        hps = server_over_files(Path(tmp), keys, rows, n, device_id, **model)
        try:
            table = hps.server.model(MODEL).tables[0]
            sampler = table.hot_sample
            if sampler is None:
                raise RuntimeError("the table has no GPU key sampler (hot_key_sampling 0?)")
            picks = [rng.integers(0, table_keys, n) for _ in range(16)]
            t_keys = [torch.as_tensor(keys[p], device=dev) for p in picks]
            t_idx = [torch.as_tensor(p, device=dev) for p in picks]
            t_table = torch.as_tensor(rows, device=dev)
            out = torch.empty((n, dim), dtype=torch.float32, device=dev)
            stream = torch.cuda.current_stream(dev)
            times: dict[str, list[float]] = {"sampler on": [], "sampler off": [],
                                             "floor: torch.index_select": []}
            sampled: list[bool] = []  # of each "sampler on" call: was it a sampled one
            counted = [0]  # the sampler's count of calls (its `calls` counter, mirrored)

            def public(i: int) -> None:
                hps.lookup_fromdlpack(t_keys[i % 16], out, MODEL, 0, device_id)
                if table.hot_sample is not None:
                    counted[0] += 1

            def floor(i: int) -> None:
                torch.index_select(t_table, 0, t_idx[i % 16], out=out)

            for i in range(3 * block):  # warm: kernels loaded, buffers grown
                public(i)
                floor(i)
            stream.synchronize()
            kinds = [("sampler on", public, True), ("sampler off", public, False),
                     ("floor: torch.index_select", floor, None)]
            for turn in range(calls // block):
                # each turn starts with the next kind: none always follows the same one
                for label, call, with_sampler in kinds[turn % 3:] + kinds[:turn % 3]:
                    if with_sampler is not None:
                        table.hot_sample = sampler if with_sampler else None
                    took = times[label]
                    for i in range(turn * block, (turn + 1) * block):
                        start = time.perf_counter()
                        call(i)
                        stream.synchronize()
                        took.append(time.perf_counter() - start)
                        if with_sampler:  # the server samples when its count & mask is 0
                            sampled.append(not counted[0] & sampler.mask)
            table.hot_sample = sampler
            fed, skipped = sampler.fed, sampler.skipped
        finally:
            hps.close()
    result: dict[str, dict[str, float]] = {}
    for label, took in times.items():
        us = np.asarray(took) * 1e6
        result[label] = {"p50_us": float(np.median(us)), "mean_us": float(us.mean()),
                         "p99_us": float(np.percentile(us, 99)), "calls": len(took)}
    on = np.asarray(times["sampler on"]) * 1e6
    picked = np.asarray(sampled)
    result["sampled calls"] = {"p50_us": float(np.median(on[picked])),
                               "calls": int(picked.sum())}
    result["other calls"] = {"p50_us": float(np.median(on[~picked])),
                             "calls": int((~picked).sum())}
    result["sampler"] = {"fed": fed, "skipped": skipped, "every": sampler.mask + 1}
    return result


def format_sampling(result: dict[str, dict[str, float]]) -> str:
    """The figures of `bench_sampling` as a plain-text table and the cost lines."""
    on, off = result["sampler on"], result["sampler off"]
    floor = result["floor: torch.index_select"]
    lines = [f"{'':>26}  {'p50 µs':>8}  {'mean µs':>8}  {'p99 µs':>8}  {'p50 × floor':>11}"]
    for label in ("sampler on", "sampler off", "floor: torch.index_select"):
        row = result[label]
        lines.append(f"{label:>26}  {row['p50_us']:8.2f}  {row['mean_us']:8.2f}  "
                     f"{row['p99_us']:8.2f}  {row['p50_us'] / floor['p50_us']:10.2f}×")
    p50 = on["p50_us"] / off["p50_us"] - 1
    mean = on["mean_us"] / off["mean_us"] - 1
    every = result["sampler"]["every"]
    extra = result["sampled calls"]["p50_us"] - off["p50_us"]
    others = result["other calls"]["p50_us"] - off["p50_us"]
    share = (extra + (every - 1) * others) / every / off["p50_us"]
    lines += [
        f"sampled calls (1 in {every}) p50 {result['sampled calls']['p50_us']:.2f} µs "
        f"({extra:+.2f} over off), the others {result['other calls']['p50_us']:.2f} µs "
        f"({others:+.2f}): per call on average {share:+.1%} of the call (bound: +3%)",
        f"on over off: p50 {p50:+.1%}, mean {mean:+.1%} (the mean carries every outlier "
        "of either); samples fed " f"{result['sampler']['fed']:,}, skipped "
        f"{result['sampler']['skipped']:,}; {int(on['calls']):,} calls each, "
        "lookup_fromdlpack of 2,000 torch keys, dim 64"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_240, help="calls of each, in all")
    parser.add_argument("--block", type=int, default=256, help="calls of each in a turn")
    parser.add_argument("--every", type=int, help="hot_key_sampling (default: the model's)")
    args = parser.parse_args(argv)
    print(format_sampling(bench_sampling(args.calls, args.block, every=args.every)))


if __name__ == "__main__":
    main()
