"""Where the time of one GPU lookup goes, in HugeCTR's profile with the caller's host work.

Runs HugeCTR's hps_profiler workload (hps/tools/bench/gpu_misses.py) through
`HPS.lookup_fromdlpack`, each variant on a fresh server (a cold cache), with timestamps
taken around each phase of the public call (wrappers put around the lookup path's
functions here, nothing changed in the package) and, per call, the Python garbage
collections that ran in it, this thread's context switches (voluntary: it slept, on the
GIL, a futex or the driver; involuntary: the OS preempted it), its CPU time, the part of
it in the kernel and its page faults. Prints,
per variant, percentiles of the call and of each phase, and what the slowest 2% of calls
had in them against the median call.

    python scripts/probe_gpu_tails.py [--lookups 1000] [--variant checked ...] [--host-lookup]

Variants: back_to_back (as hps_profiler), checked (each output copied and compared on
the host before the next call), upload (keys uploaded from host memory before each call),
checked_nogc (checked, the collector disabled while timing: is it the collector?),
plain_checked (checked, no wrappers: what the wrappers cost), checked_updates (checked,
with 10,000 update rows/s through Redis Streams meanwhile, as `--updates` runs it: what
the consumer thread did during each call), checked_updates_switch (the same with the
interpreter's switch interval at 100 µs: is it the GIL?), checked_updates_released and
checked_released (the miss path's copy, event records and waits through CuPy's runtime
calls, which release the GIL, instead of kernels.HeldCalls), checked_updates_nogpu (the
updates written to the tiers but not to the GPU cache: how much of the tail is the GPU
update), checked_updates_loops_released (the small compiled calls released the GIL, as
before their held twins), checked_updates_unpaced and back_to_back_updates_unpaced (the
consumer's rounds not paced: `min_round_interval_ms` 0, a round per message).
`--profile-updates` prints a cProfile of the background GPU updates.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hps.tools.bench.gpu_misses import (  # noqa: E402
    _power_law_ranks,
    _server,
    _UpdateStream,
)
from hps.tools.bench.gpu_public import MODEL  # noqa: E402

_marks: list[tuple[str, int, int]] = []  # (phase, start ns, end ns) of the current call
_gcs: list[int] = []  # collections (generation) that started in the current call


_undo: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, own attribute)


_bg: list[tuple[str, int, int]] = []  # (what, start ns, end ns) on other threads
_caller = threading.get_ident()
_bg_cpu: dict[str, list[float]] = defaultdict(list)  # CPU µs of each background call
_profiles: Any = None  # a cProfile.Profile of the background GPU updates (--profile-updates)


def _wrap(owner: Any, name: str, label: str) -> None:
    """Times each call of owner.name: into the current call's marks on the caller's
    thread, into _bg on any other."""
    fn = getattr(owner, name)
    _undo.append((owner, name, fn, name in vars(owner)))
    clock = time.perf_counter_ns
    marks = _marks
    ident = threading.get_ident

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        if ident() != _caller:
            c0 = time.thread_time_ns()
            if _profiles is not None and label == "gpu update":
                _profiles.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if _profiles is not None and label == "gpu update":
                    _profiles.disable()
                _bg.append((label, t0, clock()))
                _bg_cpu[label].append((time.thread_time_ns() - c0) / 1e3)
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((label, t0, clock()))

    setattr(owner, name, timed)


def _instrument(hps: Any) -> None:
    from hps.gpu import device_table, dynamic_cache, host_loops, staging
    from hps.server import parameter_server

    _wrap(parameter_server.HierarchicalParameterServer, "lookup_into", "server.lookup_into")
    _wrap(dynamic_cache.EmbeddingCache, "query_ptr", "query_ptr")
    _wrap(device_table.DeviceTable, "_enqueue", "query launch")
    _wrap(device_table, "wait_while", "spin on miss count")
    _wrap(device_table, "wait_while_held", "spin on miss count")
    _wrap(host_loops, "stage", "dedupe + set codes")
    _wrap(staging.MissStaging, "prepare", "staging.prepare")
    _wrap(staging.MissStaging, "send", "staging.send (H2D)")
    _wrap(dynamic_cache.EmbeddingCache, "insert_staged", "insert + scatter launch")
    _wrap(staging.MissStaging, "done", "staging.done")
    gpu = hps.server.model(MODEL).tables[0].gpu[0]
    _wrap(gpu, "_fetch_into", "tier fetch of misses")
    _wrap(type(gpu), "_serve_misses", "miss path")
    _wrap(dynamic_cache.EmbeddingCache, "remove", "cache.remove")
    from hps.updates import applier

    _wrap(applier.UpdateApplier, "prepare", "update prepare")
    _wrap(applier.UpdateApplier, "write", "update write")
    _wrap(type(gpu), "update", "gpu update")
    _wrap(type(gpu), "insert", "gpu insert")


def _uninstrument() -> None:
    while _undo:
        owner, name, fn, own = _undo.pop()
        if own:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gcs.append(int(info["generation"]))


def _run(variant: str, lookups: int, untimed: int) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        return _run_in(variant, lookups, untimed, stack)


def _run_in(variant: str, lookups: int, untimed: int, stack: contextlib.ExitStack
            ) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(0)
    table_keys, dim, n = 630_000, 16, 2000
    keys = rng.permutation(np.arange(table_keys, dtype=np.int64)) * 7 + 3
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    batches = _power_law_ranks(rng, table_keys, 1.2, n, lookups)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(dev)
    per_call: list[dict[str, float]] = []
    top: dict[str, Any] = {}
    stream_of_updates = None
    if "updates" in variant:
        ranks = _power_law_ranks(rng, table_keys, 1.2, 100_000, 1)[0]
        stream_of_updates = stack.enter_context(_UpdateStream(keys, rows, ranks, 10_000))
        top["update_source"] = stream_of_updates.config
    if variant.endswith("released"):  # the miss path's copy, records and waits via CuPy
        from hps.gpu import kernels

        held = kernels.held_calls()
        saved = dict(vars(held))
        rt = kernels.cupy_module().cuda.runtime
        held.copy_to_device = lambda d, s, n, st: rt.memcpyAsync(d, s, n, 1, st)
        held.record = rt.eventRecord
        held.wait = lambda st, ev: rt.streamWaitEvent(st, ev, 0)
        stack.callback(vars(held).update, saved)
    if variant.endswith("nogpu"):  # the updates reach the tiers, not the GPU cache
        from hps.server.gpu_caches import GpuCaches

        stack.callback(setattr, GpuCaches, "apply_update", GpuCaches.apply_update)
        GpuCaches.apply_update = lambda self, table, keys, vectors: None  # type: ignore
    if variant.endswith("loops_released"):  # the small compiled calls release the GIL
        from hps.gpu import host_loops
        from hps.tiers.hash_map import loops

        for owner, name, nogil in ((host_loops, "stage_misses_held", host_loops.stage_misses),
                                   (loops, "fetch_held", loops.fetch),
                                   (loops, "insert_held", loops.insert)):
            stack.callback(setattr, owner, name, getattr(owner, name))
            setattr(owner, name, nogil)
    if "unpaced" in variant and stream_of_updates is not None:  # a round per message
        top["update_source"] = {**top["update_source"], "min_round_interval_ms": 0}
    if variant.endswith("switch"):
        stack.callback(sys.setswitchinterval, sys.getswitchinterval())
        sys.setswitchinterval(1e-4)
    _bg.clear()
    with tempfile.TemporaryDirectory() as tmp:
        hps = _server(Path(tmp), keys, rows, n, 0, 0.9, **top)
        try:
            if variant != "plain_checked":
                _instrument(hps)
            if stream_of_updates is not None:
                stream_of_updates.publish(
                    f"hps_et.{MODEL}.{hps.server.model(MODEL).tables[0].name}")
                time.sleep(2)  # the stream flows before the timing starts
            host_keys = [keys[b] for b in batches]
            t_keys = [torch.as_tensor(k, device=dev) for k in host_keys]
            out = torch.empty((n, dim), dtype=torch.float32, device=dev)
            outs = ([torch.full((n, dim), float("nan"), device=dev) for _ in batches]
                    if variant.startswith("back_to_back") else None)
            checked = not variant.startswith("back_to_back")
            wrong = 0
            torch.cuda.synchronize(dev)
            gc.callbacks.append(_on_gc)
            if variant == "checked_nogc":
                gc.disable()
            try:
                for i, idx in enumerate(batches):
                    target = out if outs is None else outs[i]
                    k = t_keys[i]
                    if variant == "upload":
                        k = torch.as_tensor(host_keys[i], device=dev)
                    if checked:
                        target.fill_(float("nan"))
                        stream.synchronize()
                    _marks.clear()
                    _gcs.clear()
                    ru0 = resource.getrusage(resource.RUSAGE_THREAD)
                    cpu0 = time.thread_time_ns()
                    t0 = time.perf_counter_ns()
                    hps.lookup_fromdlpack(k, target, MODEL, 0, 0)
                    t1 = time.perf_counter_ns()
                    stream.synchronize()
                    t2 = time.perf_counter_ns()
                    cpu1 = time.thread_time_ns()
                    ru1 = resource.getrusage(resource.RUSAGE_THREAD)
                    if i >= untimed:
                        row: dict[str, float] = defaultdict(float)
                        row["_t0"], row["_t2"] = t0, t2
                        row["call + sync"] = (t2 - t0) / 1e3
                        row["call returns"] = (t1 - t0) / 1e3
                        row["sync after"] = (t2 - t1) / 1e3
                        row["cpu of thread"] = (cpu1 - cpu0) / 1e3
                        row["voluntary switches"] = ru1.ru_nvcsw - ru0.ru_nvcsw
                        row["involuntary switches"] = ru1.ru_nivcsw - ru0.ru_nivcsw
                        # kernel time and page faults: a slow call that ran all along
                        # (its CPU time = its wall time) was either in the kernel or slow
                        # in user space (caches, TLB)
                        row["system cpu"] = (ru1.ru_stime - ru0.ru_stime) * 1e6
                        row["minor faults"] = ru1.ru_minflt - ru0.ru_minflt
                        row["major faults"] = ru1.ru_majflt - ru0.ru_majflt
                        row["collections"] = len(_gcs)
                        row["collections gen2"] = sum(g == 2 for g in _gcs)
                        for label, a, b in _marks:
                            row[label] += (b - a) / 1e3
                        per_call.append(row)
                    if checked:
                        wrong += int((target.cpu().numpy() != rows[idx]).any(axis=1).sum())
                if outs is not None:
                    for idx, o in zip(batches, outs, strict=True):
                        wrong += int((o.cpu().numpy() != rows[idx]).any(axis=1).sum())
            finally:
                gc.enable()
                gc.callbacks.remove(_on_gc)
        finally:
            if stream_of_updates is not None:
                stream_of_updates.stop()
            _uninstrument()
            hps.close()
    for row in per_call:  # how long background work ran during each call
        a, b = row.pop("_t0"), row.pop("_t2")
        for label, s0, s1 in _bg:
            if s0 < b and s1 > a:
                row[f"overlapping {label}"] += (min(b, s1) - max(a, s0)) / 1e3
    return {"variant": variant, "calls": per_call, "wrong": wrong,
            "background": [(label, (s1 - s0) / 1e3) for label, s0, s1 in _bg]}


def _report(result: dict[str, Any]) -> None:
    calls = result["calls"]
    totals = np.array([c["call + sync"] for c in calls])
    order = np.argsort(totals)
    slow = order[-max(1, len(calls) // 50):]
    median = order[len(order) // 2 - 10:len(order) // 2 + 10]
    labels = sorted({k for c in calls for k in c}, key=lambda k: (k != "call + sync", k))
    print(f"\n== {result['variant']}: {len(calls)} calls timed, wrong rows {result['wrong']}; "
          f"mean {totals.mean():.1f} us, p50 {np.percentile(totals, 50):.1f}, "
          f"p99 {np.percentile(totals, 99):.1f}, max {totals.max():.1f}")
    print(f"{'phase':32s} {'mean':>8s} {'p50':>8s} {'p99':>8s} {'max':>9s} "
          f"{'median calls':>13s} {'slowest 2%':>11s}")
    for label in labels:
        v = np.array([c.get(label, 0.0) for c in calls])
        print(f"{label:32s} {v.mean():8.1f} {np.percentile(v, 50):8.1f} "
              f"{np.percentile(v, 99):8.1f} {v.max():9.1f} {v[median].mean():13.1f} "
              f"{v[slow].mean():11.1f}")
    background: dict[str, list[float]] = defaultdict(list)
    for label, us in result["background"]:
        background[label].append(us)
    for label, v in sorted(background.items()):
        cpu = _bg_cpu.get(label) or [0.0]
        print(f"background {label}: {len(v)} times, mean {np.mean(v):.1f} us, "
              f"p99 {np.percentile(v, 99):.1f}, max {np.max(v):.1f}; its thread's CPU "
              f"mean {np.mean(cpu):.1f} us, p99 {np.percentile(cpu, 99):.1f}")
    _bg_cpu.clear()
    if _profiles is not None and background:
        import pstats

        pstats.Stats(_profiles).sort_stats("tottime").print_stats(25)
    sys.stdout.flush()


def host_lookup(rounds: int = 10, calls: int = 200) -> None:
    """HPS.lookup with NumPy keys on a static GPU table (2,000 keys, dim 64), three ways
    taking turns round by round: the result in pinned memory written by the kernels in
    place (as served), pinned but copied from a device buffer (GpuEmbeddingTable.lookup
    told it is not mapped), and a NumPy array (pageable); p50 and p99 of each."""
    from hps.gpu import table as gpu_table
    from hps.tools.bench.gpu_public import server_over_files

    rng = np.random.default_rng(0)
    n, dim, table_keys = 2000, 64, 1 << 18
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    pinned = gpu_table.GpuEmbeddingTable.host_output
    in_place = gpu_table.mapped_address

    def pageable(self: Any, count: int) -> np.ndarray:
        return np.empty((count, self.dim), np.float32)

    def unmapped(cupy: Any, ptr: int) -> int:
        return 0

    ways = {"pinned, in place": (pinned, in_place), "pinned, copied": (pinned, unmapped),
            "pageable": (pageable, in_place)}
    samples: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        hps = server_over_files(Path(tmp), keys, rows, n, 0)
        try:
            picks = [rng.integers(0, table_keys, n) for _ in range(16)]
            for how, (fn, mapped) in ways.items():
                gpu_table.GpuEmbeddingTable.host_output = fn  # type: ignore[method-assign]
                gpu_table.mapped_address = mapped
                got = hps.lookup(keys[picks[0]], MODEL, 0, 0)
                assert np.array_equal(got, rows[picks[0]]), how
            for r in range(rounds + 1):
                for how, (fn, mapped) in ways.items():
                    gpu_table.GpuEmbeddingTable.host_output = fn  # type: ignore[method-assign]
                    gpu_table.mapped_address = mapped
                    for i in range(calls):
                        k = keys[picks[i % 16]]
                        t0 = time.perf_counter()
                        hps.lookup(k, MODEL, 0, 0)
                        if r:
                            samples[how].append((time.perf_counter() - t0) * 1e6)
        finally:
            gpu_table.GpuEmbeddingTable.host_output = pinned  # type: ignore[method-assign]
            gpu_table.mapped_address = in_place
            hps.close()
    print("\n== HPS.lookup, NumPy keys, static table 2,000 keys dim 64")
    for how, v in samples.items():
        print(f"{how:18s} p50 {np.percentile(v, 50):7.1f} us  p99 {np.percentile(v, 99):7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--untimed", type=int, default=100)
    parser.add_argument("--variant", action="append",
                        choices=("back_to_back", "checked", "upload", "checked_nogc",
                                 "plain_checked", "checked_updates",
                                 "checked_updates_switch", "checked_updates_released",
                                 "checked_released", "checked_updates_nogpu",
                                 "checked_updates_loops_released", "checked_updates_unpaced",
                                 "back_to_back_updates", "back_to_back_updates_unpaced"))
    parser.add_argument("--profile-updates", action="store_true",
                        help="cProfile the background GPU updates (their Python, by function)")
    parser.add_argument("--host-lookup", action="store_true",
                        help="also HPS.lookup with NumPy keys, pinned result or not")
    args = parser.parse_args()
    if args.profile_updates:
        import cProfile

        global _profiles
        _profiles = cProfile.Profile()
    if args.host_lookup:
        host_lookup()
    variants = args.variant or ["back_to_back", "checked", "upload", "checked_nogc",
                                "plain_checked"]
    summary = []
    for variant in variants:
        result = _run(variant, args.lookups, args.untimed)
        _report(result)
        totals = [c["call + sync"] for c in result["calls"]]
        summary.append((variant, statistics.fmean(totals), float(np.percentile(totals, 99))))
    print()
    for variant, mean, p99 in summary:
        print(f"{variant:16s} mean {mean:8.1f} us  p99 {p99:8.1f} us")


if __name__ == "__main__":
    main()
