"""Which path answers a table's lookups whose keys arrive and rows leave on the host
(HTTP, gRPC): its GPU cache, or its host tiers directly (../shared/DESIGN.md: such a
lookup may skip the GPU cache where the host tiers answer it faster).

With host keys the GPU path adds work the host path does not have: the keys copied to the
device, the launches, the wait for the miss count, the rows back to pinned memory. Where
the host tiers hold the table in this process's memory that can cost more than it saves
(8 workers under MPS, one cache of the whole table: 0.88-0.95x the same server without a
GPU cache, issue 74). So each version decides per table and per request size:

- at load, its warm-up times both paths (hps/server/warm_paths.py `measure_http`) at each
  of SIZES on keys its cache holds, and each request size takes the path measured faster
  for the nearest size, the GPU path only by a margin (`decide`, GPU_MARGIN);
- serving, where the two were near at load (within CLOSE) or could not be timed (a
  static or uvm table names no key it holds), the first PROBES lookups of each path at
  each size, and as many again every RECHECK lookups of that size, are timed on the
  clients' own keys and with the device shared as it is while serving (other workers,
  MPS), and decide again (`HttpPath.pick`, `took`): the warm-up's keys and its idle
  device are not what the clients send nor how they share it. A change is logged.

Both paths answer alike where hps/host_answers.py says so (a GPU cache is a cache over
the same host tiers), so a lookup may take either; elsewhere the GPU path answers, as it
does with `http_lookup_path` "gpu". In-process callers (`HPS.lookup`, `lookup_into`,
DLPack) always start at the GPU cache: their keys may be on the device, and they asked
for its path.

Each process decides for itself (under `hps serve --workers N` each worker on the device
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
from typing import Any

import numpy as np

from hps.host_answers import host_path_differs

log = logging.getLogger("hps")

#: the batch sizes timed on each path (each request size takes the nearest, in log scale)
SIZES = (1, 16, 256, 4096)
#: timed calls of each path at each size at load (after one untimed); the median decides
REPEATS = 5
#: lookups of each path timed at a size while serving before it decides again
PROBES = 16
#: lookups of a size between two rounds of probes
RECHECK = 1 << 14
#: sizes whose two paths took within this factor of each other at load are probed while
#: serving (the clients' keys move the host path: a power law's hot rows stay in the CPU's
#: caches, the warm-up's distinct keys do not; 2,000 keys on an H100: 212 µs at load, 155
#: serving). Past it the slower path is not worth a client's wait: a probe costs its
#: client up to this factor of its lookup, and the first PROBES of a size fall in the
#: first lookups after ready (at 10x, 16-key lookups 6x apart were probed, and the first
#: 1,000 lookups' p99 read 3.7x the later one's: `hps bench ready --gpu`, issue 72)
CLOSE = 3.0

#: the GPU path takes a size only where it took under this fraction of the host path's
#: time; nearer, the host path answers. Under load the two were near at 2,000 keys (8
#: workers under MPS on one H200, 2026-11-28: served 145 µs GPU, 158 host), and there
#: the GPU path bought nothing: the same CPU a request (354 µs against 360 without a GPU
#: cache) and a worse p99 (1.08-1.23x that server's), while the host path read 0.98-1.06x
#: its keys/s and 0.94-1.03x its p99 (`python -m hps.tools.bench.http_gpu --workers 8
#: --client-processes 16 --pin --rounds 3`, docs/workers.md)
GPU_MARGIN = 0.8

#: what `HttpPath.path` says
GPU, HOST, BY_SIZE = "gpu", "host", "by_size"


class HttpPath:
    """A table's path for host-key lookups (see the module), with the figures it rests
    on and the count of lookups each path answered. Thread-safe.

    `path` "gpu", "host", or "by_size" (which sizes take which: `as_dict()["paths"]`);
    `reason` why ("no GPU cache", "measured", "http_lookup_path gpu", ...); `device` the
    device whose cache the GPU path takes (None without one); `sizes`, `gpu_us`,
    `host_us` the load's medians; `host` per size whether the host path answers it;
    `probe` per size whether serving times it again."""

    def __init__(self, reason: str, host: Sequence[bool], device: int | None = None,
                 sizes: Sequence[int] = (), gpu_us: Sequence[float] = (),
                 host_us: Sequence[float] = (), probe: Sequence[bool] = (),
                 label: str = "") -> None:
        self.reason, self.device, self.label = reason, device, label
        self.sizes, self.gpu_us, self.host_us = tuple(sizes), tuple(gpu_us), tuple(host_us)
        self._host = list(host)
        self._probe = list(probe) or [False] * len(self._host)
        self._bounds = size_bounds(self.sizes) if len(self._host) > 1 else ()
        self._answered = [0, 0]
        self._seen = [0] * len(self._host)  # lookups of each size
        self._next = [0] * len(self._host)  # the lookup of a size that opens its probes
        self._timed: list[tuple[list[float], list[float]]] = [([], []) for _ in self._host]
        # the probes' CPU time on the calling thread, beside their wall time: a GPU path
        # whose wait spins takes CPU that a saturated server's other requests lack (shown,
        # not decided on yet: issue 74)
        self._cpu: list[tuple[list[float], list[float]]] = [([], []) for _ in self._host]
        self._served: list[tuple[float, float] | None] = [None] * len(self._host)
        self._served_cpu: list[tuple[float, float] | None] = [None] * len(self._host)
        self._lock = threading.Lock()

    @property
    def host(self) -> tuple[bool, ...]:
        """Per size: whether the host path answers it now."""
        with self._lock:
            return tuple(self._host)

    @property
    def path(self) -> str:
        host = self.host
        return HOST if all(host) else GPU if not any(host) else BY_SIZE

    def pick(self, n: int) -> tuple[bool, int]:
        """The path of a lookup of `n` > 0 host keys: (whether the host path answers it,
        the size it is timed for, -1 when it is not: then `took` need not hear of it)."""
        b = bisect.bisect_left(self._bounds, n) if self._bounds else 0
        with self._lock:
            host, probe = self._host[b], -1
            if self._probe[b] and self._seen[b] >= self._next[b]:
                on_gpu, on_host = self._timed[b]
                host, probe = len(on_host) < len(on_gpu), b  # the one timed fewer times
            self._seen[b] += 1
            self._answered[host] += 1
        return host, probe

    def took(self, probe: int, host: bool, seconds: float,
             cpu_seconds: float | None = None) -> None:
        """A lookup `pick` chose to time at size `probe` took `seconds` on its path (and
        `cpu_seconds` of its thread's CPU): once both have PROBES, `decide` gives the
        size, until the next round RECHECK lookups on."""
        with self._lock:
            on_gpu, on_host = self._timed[probe]
            (on_host if host else on_gpu).append(seconds)
            if cpu_seconds is not None:
                self._cpu[probe][host].append(cpu_seconds)
            if len(on_gpu) < PROBES or len(on_host) < PROBES:
                return
            gpu_s, host_s = statistics.median(on_gpu), statistics.median(on_host)
            before = self._host[probe]
            self._host[probe] = decide([gpu_s], [host_s])[0]
            self._served[probe] = (gpu_s * 1e6, host_s * 1e6)
            cpu_gpu, cpu_host = self._cpu[probe]
            if cpu_gpu and cpu_host:
                self._served_cpu[probe] = (statistics.median(cpu_gpu) * 1e6,
                                           statistics.median(cpu_host) * 1e6)
            for timed in (on_gpu, on_host, cpu_gpu, cpu_host):
                timed.clear()
            self._next[probe] = self._seen[probe] + RECHECK
            changed = self._host[probe] != before
        if changed:
            size = self.sizes[probe] if self.sizes else "any"
            log.info("%s: lookups of about %s host keys now take the %s (serving: GPU %.1f "
                     "µs, host %.1f µs, medians of %d each)", self.label or "a table", size,
                     "host tiers" if not before else "GPU cache", gpu_s * 1e6, host_s * 1e6,
                     PROBES)

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
            with self._lock:
                served = list(self._served)
                served_cpu = list(self._served_cpu)
                probed = list(self._probe)
            out.update(sizes=list(self.sizes), paths=[HOST if h else GPU for h in self.host],
                       probed=probed, gpu_us=[round(t, 1) for t in self.gpu_us],
                       host_us=[round(t, 1) for t in self.host_us],
                       served_us=_rounded(served), served_cpu_us=_rounded(served_cpu))
        out["answered"] = self.answered()
        return out

    def line(self) -> str:
        """The log's line of it, made at load."""
        said = f"{self.label}: HTTP lookups (host keys) take the "
        said += {GPU: "GPU cache", HOST: "host tiers", BY_SIZE: "path by size"}[self.path]
        if self.device is not None:
            said += f" (GPU {self.device})"
        said += f": {self.reason}"
        if self.gpu_us:
            said += "; " + ", ".join(
                f"{n} keys GPU {g:.1f} µs host {h:.1f} µs -> {HOST if c else GPU}"
                for n, g, h, c in zip(self.sizes, self.gpu_us, self.host_us, self.host,
                                      strict=True))
        if any(self._probe):
            said += f"; timed again while serving (every {RECHECK} lookups of a size)"
        return said


def _rounded(pairs: Sequence[tuple[float, float] | None]) -> list[list[float] | None]:
    """(GPU, host) µs pairs per size as `as_dict` shows them, to 0.1 µs."""
    return [None if p is None else [round(p[0], 1), round(p[1], 1)] for p in pairs]


def size_bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    """The largest request size each measured size answers, but the last (which takes
    the rest): the geometric means of neighbours (1, 16, 256, 4096 → 4, 64, 1024)."""
    return tuple(int((a * b) ** 0.5) for a, b in zip(sizes, sizes[1:], strict=False))


def decide(gpu_s: Sequence[float], host_s: Sequence[float]) -> tuple[bool, ...]:
    """Per size, whether the host path answers it: unless the GPU path's median `gpu_s`
    is under GPU_MARGIN of the host path's `host_s` (near, the host path: no device
    work, no launches, no wait on a device other processes share)."""
    return tuple(g >= GPU_MARGIN * h for g, h in zip(gpu_s, host_s, strict=True))


def chosen(sizes: Sequence[int], gpu_s: Sequence[float], host_s: Sequence[float],
           device: int, label: str = "") -> HttpPath:
    """The HttpPath of the load's medians (seconds) at `sizes`: each size on the path
    `decide` gives it, probed while serving where the two are within CLOSE of each other."""
    probe = [max(g, h) <= CLOSE * min(g, h) for g, h in zip(gpu_s, host_s, strict=True)]
    return HttpPath("measured", decide(gpu_s, host_s), device, sizes,
                    [g * 1e6 for g in gpu_s], [h * 1e6 for h in host_s], probe, label)


def unmeasured(device: int, label: str = "") -> HttpPath:
    """The path of a table both paths answer alike whose cache named no key it holds at
    load: the GPU cache until serving has timed both at each size."""
    return HttpPath("not measured at load (its GPU cache named no key it holds: static, "
                    "uvm or empty): timed while serving", [False] * len(SIZES), device,
                    SIZES, probe=[True] * len(SIZES), label=label)


def without_measuring(config: Any, volatile: Any, persistent: Any, has_gpu: bool,
                      device: int | None, label: str = "") -> HttpPath | None:
    """The path of a table of model `config` that needs no measurement: no GPU cache, the
    config's `http_lookup_path` "gpu" or "host", or host tiers that would answer otherwise
    (hps/host_answers.py); None where it is measured."""
    if not has_gpu:
        return HttpPath("no GPU cache", [True], label=label)
    asked = config.http_lookup_path
    if asked == GPU:
        return HttpPath("http_lookup_path gpu", [False], device, label=label)
    differs = host_path_differs(config, volatile, persistent)
    if differs is not None:  # "host" with such tiers is a ConfigError before a load
        return HttpPath(f"the host tiers may answer otherwise: {differs}", [False], device,
                        label=label)
    if asked == HOST:
        return HttpPath("http_lookup_path host", [True], device, label=label)
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
