"""The device whose GPU cache answers a lookup with host keys and no `device_id` (HTTP,
gRPC, `HPS.lookup` of NumPy keys): under `hps serve --workers N` over a model deployed on
several devices, worker i takes `deployed_device_list[i % len]`, so N workers spread over
the devices (docs/workers.md#every-device-of-a-model).

Why the workers spread rather than each worker's requests: a worker already keeps a cache
on every deployed device (a replicated model) and its requests are answered one at a time
on its event loop (or two lookup threads), so spreading one worker's requests over the
devices would only add a device switch per request and leave a device idle whenever a
worker's load is light; N workers of one device each keep one CUDA context busy, their
launches on one device, and spread as the kernel spreads connections over them: with N a
multiple of the devices, each device answers N / devices workers' lookups. One process
(worker index 0) keeps the model's first deployed device, as before.
"""

from __future__ import annotations

from collections.abc import Sequence


def host_device(deployed: Sequence[int], worker: int) -> int:
    """The device of `deployed` (a model's deployed_device_list) whose cache answers
    worker `worker`'s lookups with host keys."""
    return int(deployed[worker % len(deployed)])


def spread_line(model: str, deployed: Sequence[int], worker: int, workers: int | None
                ) -> str:
    """The log's line saying which device answers this process's host-key lookups."""
    device = host_device(deployed, worker)
    who = f"worker {worker} of {workers}" if workers else "this process"
    return (f"model {model!r} (deployed on GPUs {list(deployed)}): {who} answers lookups "
            f"with host keys (HTTP, gRPC) on GPU {device} (deployed_device_list[{worker} % "
            f"{len(deployed)}]); workers spread over the devices, a worker's requests do not")
