"""Which path answers a table's lookups whose keys arrive and rows leave on the host
(HTTP, gRPC): its GPU cache, or its host tiers directly (../shared/DESIGN.md: such a
lookup may skip the GPU cache where the host tiers answer it faster).

With host keys the GPU path adds work the host path does not have: the keys copied to the
device, the launches, the wait for the miss count, the rows back to pinned memory. Where
the host tiers hold the table in this process's memory that can cost more than it saves
(8 workers under MPS, one cache of the whole table: 0.88-0.95x the same server without a
GPU cache, issue 74). So each table's version measures both paths before it serves (its
warm-up, hps/server/warm_paths.py: `measure`), at a few batch sizes, and answers each
request size with the path measured faster for the nearest size (`HttpPath.uses_host`).

Both paths answer alike where hps/host_answers.py says so (a GPU cache is a cache over
the same host tiers); elsewhere the GPU path answers, as it does with `http_lookup_path`
"gpu". In-process callers (`HPS.lookup`, `lookup_into`, DLPack) always start at the GPU
cache: their keys may be on the device, and they asked for its path.

Each process measures for itself (under `hps serve --workers N` each worker on the device
its host-key lookups go to, hps/server/host_device.py): its own caches, its own device,
its own share of the machine, and no record to hand from one process to another.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hps.host_answers import host_path_differs

log = logging.getLogger("hps")

#: the batch sizes timed on each path (each request size takes the nearest, in log scale)
SIZES = (1, 16, 256, 4096)
#: timed calls of each path at each size (after one untimed); the median decides
REPEATS = 5
#: the GPU path answers a size only where its median takes at most this share of the
#: host path's: the warm-up times one process alone on the device, while serving shares
#: it among every process of the host under MPS (launches queue, the wait for the miss
#: count grows) and the host path's cost stays per core. Measured: with 8 workers the GPU
#: path lost 5-12% at 2,000 keys where alone it takes about 53 µs (docs/gpu-latency.md)
GPU_SHARE = 0.8

#: what `HttpPath.path` says
GPU, HOST, BY_SIZE = "gpu", "host", "by_size"


@dataclass
class HttpPath:
    """A table's path for host-key lookups (see the module), with the figures it rests
    on and the count of lookups each path answered."""

    #: "gpu", "host", or "by_size" (`host` says which sizes take the host path)
    path: str
    #: why: "no GPU cache", "measured", "http_lookup_path gpu", or why the host tiers
    #: would answer otherwise
    reason: str
    #: the device whose cache the GPU path takes (None without a GPU cache)
    device: int | None = None
    sizes: tuple[int, ...] = ()
    gpu_us: tuple[float, ...] = ()
    host_us: tuple[float, ...] = ()
    #: per size: whether the host path answers it
    host: tuple[bool, ...] = ()
    _bounds: tuple[int, ...] = field(default=(), init=False, repr=False)
    _answered: list[int] = field(default_factory=lambda: [0, 0], init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self._bounds = size_bounds(self.sizes)

    def uses_host(self, n: int) -> bool:
        """Whether a lookup of `n` host keys takes the host path (counted as answered)."""
        if self.path == BY_SIZE:
            host = self.host[bisect.bisect_left(self._bounds, n)]
        else:
            host = self.path == HOST
        with self._lock:
            self._answered[host] += 1
        return host

    def answered(self) -> dict[str, int]:
        """Lookups with host keys answered by each path so far."""
        with self._lock:
            return {GPU: self._answered[0], HOST: self._answered[1]}

    def as_dict(self) -> dict[str, Any]:
        """What `GET /v1/models/{model}` shows of it (`http_lookup` of each table)."""
        out: dict[str, Any] = {"path": self.path, "reason": self.reason}
        if self.device is not None:
            out["device"] = self.device
        if self.sizes:
            out.update(sizes=list(self.sizes), gpu_us=[round(t, 1) for t in self.gpu_us],
                       host_us=[round(t, 1) for t in self.host_us],
                       paths=[HOST if h else GPU for h in self.host])
        out["answered"] = self.answered()
        return out

    def line(self, model: str, table: str) -> str:
        """The log's line of it."""
        said = f"model {model!r} table {table!r}: HTTP lookups (host keys) take the "
        said += {GPU: "GPU cache", HOST: "host tiers", BY_SIZE: "path by size"}[self.path]
        if self.device is not None:
            said += f" (GPU {self.device})"
        said += f": {self.reason}"
        if self.sizes:
            said += "; " + ", ".join(
                f"{n} keys GPU {g:.1f} µs host {h:.1f} µs -> {HOST if c else GPU}"
                for n, g, h, c in zip(self.sizes, self.gpu_us, self.host_us, self.host,
                                      strict=True))
        return said


def size_bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    """The largest request size each measured size answers, but the last (which takes
    the rest): the geometric means of neighbours (1, 16, 256, 4096 → 4, 64, 1024)."""
    return tuple(int((a * b) ** 0.5) for a, b in zip(sizes, sizes[1:], strict=False))


def decide(gpu_s: Sequence[float], host_s: Sequence[float], share: float = GPU_SHARE
           ) -> tuple[bool, ...]:
    """Per measured size, whether the host path answers it: unless the GPU path's median
    `gpu_s` is at most `share` of the host path's `host_s` (see GPU_SHARE)."""
    return tuple(not g <= share * h for g, h in zip(gpu_s, host_s, strict=True))


def chosen(sizes: Sequence[int], gpu_s: Sequence[float], host_s: Sequence[float],
           device: int, share: float = GPU_SHARE) -> HttpPath:
    """The HttpPath of measured medians (seconds) at `sizes`."""
    host = decide(gpu_s, host_s, share)
    path = HOST if all(host) else GPU if not any(host) else BY_SIZE
    return HttpPath(path, "measured", device, tuple(sizes),
                    tuple(g * 1e6 for g in gpu_s), tuple(h * 1e6 for h in host_s), host)


def without_measuring(config: Any, volatile: Any, persistent: Any, has_gpu: bool,
                      device: int | None) -> HttpPath | None:
    """The path of a table of model `config` that needs no measurement: no GPU cache, the
    config's `http_lookup_path` "gpu" or "host", or host tiers that would answer otherwise
    (hps/host_answers.py); None where it is measured."""
    if not has_gpu:
        return HttpPath(HOST, "no GPU cache")
    asked = config.http_lookup_path
    if asked == GPU:
        return HttpPath(GPU, "http_lookup_path gpu", device)
    differs = host_path_differs(config, volatile, persistent)
    if differs is not None:  # "host" with such tiers is a ConfigError before a load
        return HttpPath(GPU, f"the host tiers may answer otherwise: {differs}", device)
    if asked == HOST:
        return HttpPath(HOST, "http_lookup_path host", device)
    return None


def median_seconds(call: Callable[[], Any], repeats: int = REPEATS) -> float:
    """The median wall time of `repeats` calls of `call`, after one untimed."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_keys(held: np.ndarray, n: int) -> np.ndarray:
    """`n` keys of those a cache holds (`held`, distinct), repeated where it holds fewer:
    the GPU path's all-hit case, which a measurement must not change (no insert)."""
    return np.resize(held, n).astype(np.int64)
