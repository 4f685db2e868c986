"""The node: processes on every GPU through the public call (`python -m
hps.tools.bench.gpu_node`).

An inference node runs several processes on each of its GPUs (HTTP workers, a model
server's instances). Here P processes (`--per-device`, default 4) on each of D devices
(`--devices`, default every visible one) each loop the public call,
`HPS.lookup_fromdlpack` of 2,000 power-law torch keys, on its own stream with a sync
after each call (hps/tools/bench/gpu_processes.py's caller). The processes of a device
serve the model from one GPU cache of that device (`gpu_cache_scope: "host"`, deployed on
that device alone): its first process allocates and warms it up, the others map it.
Points, all `seconds` long, every process loaded throughout:

- one process on device 0;
- the P processes of device 0 (one GPU's share of the node);
- all P × D at once (the node).

Printed per point: keys/s, p50 and p99 of the calls, wrong rows (every process checks its
last output against the model files), beside the floor: the same processes and points
with `torch.index_select` from one dense table on each device (CUDA IPC), timed first.
Then the node over device 0's P processes (issue 74's target: >= 0.9 × D, 3.6x on four
GPUs, with the p99 <= 100 µs); the GPU memory in use on each device while every process
is loaded (this bench's own context on each device included), and each process's as
nvidia-smi lists it (one cache per device: a device's memory is one table's and P
contexts, not P tables), the shared cache's own MiB (the owner's less the others') beside
what `hps plan` computes for it (hps/tools/plan/memory.py, within 10%); and whether an
MPS control daemon answers (run it with MPS on: `hps mps start`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_processes import MODEL, Callers, nvidia_smi, process_config
from hps.tools.plan.memory import dynamic_cache_bytes

#: the node's target: its keys/s over one GPU's share, per device
SCALE_PER_DEVICE = 0.9
#: the node's target p99 of a call (µs)
P99_US = 100.0


def node_setups(folder: Path, devices: list[int], per_device: int, dim: int, n: int,
                alpha: float, seed: int, cached: float) -> list[dict[str, Any]]:
    """One caller setup per process, device by device (device d's processes at
    d_index × per_device ...): each the model deployed on its device alone, one GPU
    cache per device shared by the device's processes."""
    setups = []
    for device in devices:
        config = process_config(folder, dim, n, device, cached, "host")
        setups += [{"folder": str(folder), "n": n, "dim": dim, "device": device,
                    "alpha": alpha, "seed": seed, "cached": cached, "config": config}
                   for _ in range(per_device)]
    return setups


def memory_by_device(gpus: str, apps: str) -> tuple[dict[int, int], dict[int, list[int]]]:
    """(MiB in use on each device, MiB of each process on it) from nvidia-smi's
    `--query-gpu=index,uuid,memory.used` and `--query-compute-apps=gpu_uuid,used_memory`
    lines (csv, no header, no units)."""
    used: dict[int, int] = {}
    index_of: dict[str, int] = {}
    for line in gpus.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            used[int(parts[0])] = int(parts[2])
            index_of[parts[1]] = int(parts[0])
    per: dict[int, list[int]] = {d: [] for d in used}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] in index_of and parts[1].isdigit():
            per[index_of[parts[0]]].append(int(parts[1]))
    return used, per


def shared_cache_mib(per_process: list[int]) -> float | None:
    """A device's shared cache as nvidia-smi shows it: the MiB of the process that holds
    it (its owner, the largest) less the median of the others' (their contexts and query
    buffers, which the owner has too); None with fewer than two processes."""
    if len(per_process) < 2:
        return None
    ordered = sorted(per_process)
    return float(ordered[-1] - np.median(ordered[:-1]))


def _nvidia_smi_memory() -> tuple[dict[int, int], dict[int, list[int]]]:
    """memory_by_device of nvidia-smi's answers now ({}, {} where it does not answer)."""
    with contextlib.suppress(Exception):
        return memory_by_device(nvidia_smi("--query-gpu=index,uuid,memory.used"),
                                nvidia_smi("--query-compute-apps=gpu_uuid,used_memory"))
    return {}, {}


def _row(name: str, got: list[tuple[Any, ...]]) -> dict[str, Any]:
    """A point's row from its callers' (index, keys, seconds, latencies, wrong, hit rate)."""
    keys = sum(g[1] for g in got)
    elapsed = max(g[2] for g in got)
    lat = [s for g in got for s in g[3]]
    return {"point": name, "processes": len(got), "mkeys_s": keys / elapsed / 1e6,
            "p50_us": float(np.percentile(lat, 50)) * 1e6,
            "p99_us": float(np.percentile(lat, 99)) * 1e6,
            "wrong_rows": sum(g[4] for g in got),
            "each_mkeys_s": [round(g[1] / g[2] / 1e6, 1) for g in sorted(got)]}


def _points(callers: Callers, per_device: int, devices: list[int], seconds: float,
            name: str) -> list[dict[str, Any]]:
    """The three points of the module's docstring from `callers` (stopped after)."""
    first = list(range(per_device))  # the first device's processes
    try:
        return [_row(f"{name}, one process, GPU {devices[0]}",
                     callers.run(first[:1], seconds)),
                _row(f"{name}, {per_device} processes, GPU {devices[0]}",
                     callers.run(first, seconds)),
                _row(f"{name}, {per_device} processes on each of {len(devices)} GPUs",
                     callers.run(range(per_device * len(devices)), seconds))]
    finally:
        callers.stop()


def bench_node(per_device: int = 4, devices: list[int] | None = None, dim: int = 64,
               n: int = 2000, table_keys: int = 1 << 22, alpha: float = 1.1,
               seconds: float = 3.0, seed: int = 0, cached: float = 1.0) -> dict[str, Any]:
    """The figures of the module's docstring as a dict: `rows` (per point), `scale` (the
    node over device 0's processes), `memory` (per device: MiB in use, MiB per process),
    `mps`, `devices`, `per_device`."""
    import cupy

    from hps import write_sparse_model
    from hps.runtime.mps import daemon_found

    if devices is None:
        devices = list(range(int(cupy.cuda.runtime.getDeviceCount())))
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    vectors = rng.standard_normal((table_keys, dim)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="hps-bench-node-") as tmp:
        folder = Path(tmp)
        write_sparse_model(folder / "t0", keys, vectors)
        setups = node_setups(folder, devices, per_device, dim, n, alpha, seed, cached)
        # the floor first: index_select from one dense table per device (CUDA IPC)
        import torch

        dense = {d: torch.as_tensor(vectors, device=f"cuda:{d}") for d in devices}
        del vectors
        floor = _points(Callers("floor", setups, dense), per_device, devices, seconds,
                        "floor: index_select")
        del dense
        torch.cuda.empty_cache()
        owners = tuple(range(0, len(setups), per_device))  # each device's first process
        callers = Callers("shared cache", setups, owners=owners)
        used, per = _nvidia_smi_memory()  # every process loaded (and this one's contexts)
        rows = _points(callers, per_device, devices, seconds, "hps")
    for row, base in zip(rows, floor, strict=True):
        row["vs_floor"] = row["mkeys_s"] / base["mkeys_s"]
    return {"rows": rows, "floor": floor, "scale": rows[2]["mkeys_s"] / rows[1]["mkeys_s"],
            "floor_scale": floor[2]["mkeys_s"] / floor[1]["mkeys_s"],
            "memory": {d: {"used_mib": used[d], "per_process_mib": per.get(d, []),
                           "cache_mib": shared_cache_mib(per.get(d, []))}
                       for d in devices if d in used},
            "planned_mib": dynamic_cache_bytes(table_keys, dim, cached)["float32"] / 2**20,
            "mps": daemon_found(), "devices": devices, "per_device": per_device,
            "model": MODEL, "table_keys": table_keys, "dim": dim, "batch": n}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 74's targets of the node: >= SCALE_PER_DEVICE × D over device 0's share,
    p99 <= P99_US at the node, every vector exact."""
    node = result["rows"][2]
    want = SCALE_PER_DEVICE * len(result["devices"])
    return [
        {"target": f"the node >= {want:.1f}x device 0's processes",
         "measured": result["scale"], "met": result["scale"] >= want},
        {"target": f"the node's p99 <= {P99_US:g} µs", "measured": node["p99_us"],
         "met": node["p99_us"] <= P99_US},
        *({"target": f"GPU {d}'s shared cache within 10% of hps plan",
           "measured": m["cache_mib"] / result["planned_mib"],
           "met": abs(m["cache_mib"] / result["planned_mib"] - 1) <= 0.1}
          for d, m in result.get("memory", {}).items() if m["cache_mib"] is not None),
        {"target": "every vector exact", "measured": sum(r["wrong_rows"] for r in result["rows"]),
         "met": all(r["wrong_rows"] == 0 for r in result["rows"])},
    ]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-device", type=int, default=4)
    parser.add_argument("--devices", help="comma-separated device ids (default: every one)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--table-keys", type=int, default=1 << 22)
    parser.add_argument("--cached", type=float, default=1.0,
                        help="gpucacheper: 1.0 all hits; less, misses from the host tier")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    result = bench_node(args.per_device, devices, seconds=args.seconds,
                        table_keys=args.table_keys, cached=args.cached)
    print(f"table of {result['table_keys']:,} keys, width {result['dim']}, "
          f"{result['batch']:,} power-law torch keys a call (HPS.lookup_fromdlpack), "
          f"gpucacheper {args.cached}; devices {result['devices']}, "
          f"{result['per_device']} processes each, one shared GPU cache per device; "
          f"MPS {'on' if result['mps'] else 'off'}")
    for r in result["floor"] + result["rows"]:
        beside = f" ({r['vs_floor']:.2f}x the floor)" if "vs_floor" in r else ""
        print(f"  {r['point']}: {r['mkeys_s']:,.1f} M keys/s{beside}, p50 "
              f"{r['p50_us']:.1f} µs, p99 {r['p99_us']:.1f} µs, wrong rows "
              f"{r['wrong_rows']}; per process {r['each_mkeys_s']}")
    print(f"the node over device 0's {result['per_device']} processes: "
          f"{result['scale']:.2f}x (the floor: {result['floor_scale']:.2f}x)")
    for d, m in result["memory"].items():
        cache = m["cache_mib"]
        print(f"  GPU {d}: {m['used_mib']:,} MiB in use; per process (nvidia-smi) "
              f"{' '.join(map(str, m['per_process_mib']))} MiB; the shared cache "
              + ("unseen" if cache is None else f"{cache:,.0f} MiB")
              + f" (hps plan: {result['planned_mib']:,.0f} MiB)")
    for t in targets(result):
        print(f"  {'yes' if t['met'] else 'NO '}  {t['target']} ({t['measured']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
