"""Several GPUs through the public call (`hps bench gpu --profile devices`).

One model deployed on every device (`deployed_device_list` [0, 1, …]), a dynamic cache
holding the whole table (4M x 64 by default: all hits) on each, batches of power-law torch
keys (Zipf 1.1) on each device, of 2,000 and of 1M keys. Measured in the same process, for
each batch size:
- one thread driving device 0 on its own stream: keys/s;
- one thread per device, all at once, each on its own stream and its own device's keys (the
  threads' current device left at 0: the call serves keys on device k from device k's
  cache whatever the thread's current device): keys/s of them all, and the ratio to one
  device (the target: >= 1.9x on 2 GPUs).
And in processes, the way past the GIL (hps/tools/bench/gpu_processes.py's caller): one
process per device, each loading the model deployed on its device alone (replicated: a
cache each), on its own stream; one process on device 0 alone, then every process at once.
Every output is checked against the model file's rows after the timing.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_public import MODEL, server_over_files
from hps.tools.bench.gpu_threads import draws

BATCHES = (2000, 1 << 20)


def bench_devices(dim: int = 64, table_keys: int = 1 << 22, seconds: float = 2.0,
                  alpha: float = 1.1, seed: int = 0) -> list[dict[str, Any]]:
    """keys/s of one device and of every device driven by a thread each (see above)."""
    import cupy as cp
    import torch

    devices = list(range(cp.cuda.runtime.getDeviceCount()))
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hps = server_over_files(Path(tmp), keys, rows, max(BATCHES), devices[0],
                                deployed_device_list=devices, embedding_cache_type="dynamic",
                                hit_rate_threshold=1.0)
        try:
            for n in BATCHES:
                results += _one_size(hps, torch, devices, keys, rows, n, dim, seconds,
                                     draws(rng, table_keys, n, 4, alpha, False))
        finally:
            hps.close()
        del rows
        for n in BATCHES:
            results += _process_per_device(Path(tmp), devices, n, dim, seconds, alpha, seed)
    return results


def _process_per_device(folder: Path, devices: list[int], n: int, dim: int, seconds: float,
                        alpha: float, seed: int) -> list[dict[str, Any]]:
    """keys/s of one process on device 0, then of a process on every device at once."""
    from hps.tools.bench.gpu_processes import Callers, process_config

    callers = Callers("own caches", [
        {"folder": str(folder), "n": n, "dim": dim, "device": device, "alpha": alpha,
         "seed": seed, "cached": 1.0,
         "config": process_config(folder, dim, n, device, 1.0, "process")}
        for device in devices])

    def point(count: int) -> tuple[float, int]:
        got = callers.point(count, seconds)
        return (sum(g[1] for g in got) / max(g[2] for g in got), sum(g[4] for g in got))

    try:
        one, wrong_one = point(1)
        every, wrong_every = point(len(devices))
    finally:
        callers.stop()
    return [
        {"bench": "devices", "dim": dim, "batch": n, "mode": "1 GPU, 1 process",
         "mkeys_s": one / 1e6, "wrong_rows": wrong_one},
        {"bench": "devices", "dim": dim, "batch": n,
         "mode": f"{len(devices)} GPUs, a process each", "mkeys_s": every / 1e6,
         "vs_one": every / one, "wrong_rows": wrong_every},
    ]


def _one_size(hps: Any, torch: Any, devices: list[int], keys: np.ndarray, rows: np.ndarray,
              n: int, dim: int, seconds: float, picks: list[np.ndarray]
              ) -> list[dict[str, Any]]:
    batches = {d: [torch.as_tensor(keys[p], device=f"cuda:{d}") for p in picks]
               for d in devices}
    outs = {d: torch.empty((n, dim), device=f"cuda:{d}") for d in devices}
    streams = {d: torch.cuda.Stream(device=d) for d in devices}
    counts: dict[int, int] = {}

    def drive(device: int, stop: float) -> None:
        torch.cuda.set_device(devices[0])  # not the keys' device, on purpose
        done, i = 0, 0
        stream = streams[device]
        with torch.cuda.stream(stream):
            while time.perf_counter() < stop:
                hps.lookup_fromdlpack(batches[device][i % 4], outs[device], MODEL, 0)
                stream.synchronize()
                done += n
                i += 1
        counts[device] = done

    def run(which: list[int]) -> float:
        for d in which:  # warm-up: workspaces, launches
            drive(d, time.perf_counter() + 0.2)
        counts.clear()
        start = time.perf_counter()
        threads = [threading.Thread(target=drive, args=(d, start + seconds)) for d in which]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts.values()) / (time.perf_counter() - start)

    one = run(devices[:1])
    every = run(devices)
    for d in devices:
        got = outs[d].cpu().numpy()
        want = rows[picks[(counts[d] // n - 1) % 4]]
        np.testing.assert_array_equal(got, want, err_msg=f"device {d}")
    return [
        {"bench": "devices", "dim": dim, "batch": n, "mode": "1 GPU, 1 thread",
         "mkeys_s": one / 1e6},
        {"bench": "devices", "dim": dim, "batch": n,
         "mode": f"{len(devices)} GPUs, a thread each", "mkeys_s": every / 1e6,
         "vs_one": every / one},
    ]
