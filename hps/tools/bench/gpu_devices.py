"""Several GPUs through the public call (`hps bench gpu --profile devices`).

One model deployed on every device (`deployed_device_list` [0, 1, …]), a static table of
dim 64 on each, batches of torch keys on each device. Measured in the same process:
- one thread driving device 0: keys/s;
- one thread per device, all at once, each on its own device's keys (the threads' current
  device left at 0: the call serves keys on device k from device k's table whatever the
  thread's current device): keys/s of them all, and the ratio to one device.
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


def bench_devices(dim: int = 64, n: int = 1 << 18, table_keys: int = 1 << 21,
                  seconds: float = 3.0, seed: int = 0) -> list[dict[str, Any]]:
    """keys/s of one device and of every device driven by a thread each (see above)."""
    import cupy as cp
    import torch

    devices = list(range(cp.cuda.runtime.getDeviceCount()))
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    picks = [rng.integers(0, table_keys, n) for _ in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        hps = server_over_files(Path(tmp), keys, rows, n, devices[0],
                                deployed_device_list=devices)
        try:
            batches = {d: [torch.as_tensor(keys[p], device=f"cuda:{d}") for p in picks]
                       for d in devices}
            outs = {d: torch.empty((n, dim), device=f"cuda:{d}") for d in devices}
            counts: dict[int, int] = {}

            def drive(device: int, stop: float) -> None:
                torch.cuda.set_device(devices[0])  # not the keys' device, on purpose
                done, i = 0, 0
                sync = torch.cuda.current_stream(device).synchronize
                while time.perf_counter() < stop:
                    hps.lookup_fromdlpack(batches[device][i % 4], outs[device], MODEL, 0)
                    sync()
                    done += n
                    i += 1
                counts[device] = done

            def run(which: list[int]) -> float:
                for d in which:  # warm-up: workspaces, launches
                    drive(d, time.perf_counter() + 0.2)
                counts.clear()
                start = time.perf_counter()
                threads = [threading.Thread(target=drive, args=(d, start + seconds))
                           for d in which]
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
        finally:
            hps.close()
    return [
        {"bench": "devices", "dim": dim, "batch": n, "mode": "1 GPU, 1 thread",
         "mkeys_s": one / 1e6},
        {"bench": "devices", "dim": dim, "batch": n,
         "mode": f"{len(devices)} GPUs, a thread each", "mkeys_s": every / 1e6,
         "vs_one": every / one},
    ]
