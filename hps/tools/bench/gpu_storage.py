"""Compact storage on the public path (`hps bench gpu --profile storage`).

One table of `table_keys` random keys of width `dim` (128 by default) written once as a
model folder, served by one `HPS` per `embedding_storage_dtype` (float32, float16,
bfloat16, int8), each with a static GPU table of the whole table and the in-process tier,
all built from the same folder. Each is timed through the call a user makes:
`HPS.lookup_fromdlpack` of `n` (1M) device keys, all hits, into a torch tensor, float32
for every storage and also float16 / bfloat16 for the storage of that type (written
without widening). The cases take turns, round by round, `calls` each per round; each call
is followed by a sync of the stream (wall clock around both). Rows: G keys/s, the ratio to
float32 storage into float32, and, per storage, the device memory (cudaMemGetInfo before
and after its server was made: the GPU table, its workspaces), the table's own figure
(memory_bytes) and the process RSS the server added (its hash map rows, mostly).

Beside them, two floors of each type, rows of that type's stored size gathered from a
dense table on the same draws: `torch.index_select` and cuda/rows.cu's float4 gather, each
with its ratio to the same floor of float32 rows (what the GPU's memory gives for rows of
that size, before any hash probe or decode); and a third for int8, its rows widened into
float32 outputs by a dense gather (cuda/rows.cu dense_gather_int8) against float32 rows'
float4 gather: the bound of the int8 -> float32 case's gain.

Every case is checked first against hps/rows/storage_types.py's reference (the first 65,536 rows of
a batch): its output equals the reference decode of the reference encode bit for bit (a
16-bit output: the encoded bits), and each value is within the type's error bound of the
file's row (`wrong_rows`, `err_vs_bound`: the largest error over its bound, at most 1).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps.rows.gpu_layout import STORAGE_CODES, stored_row_bytes
from hps.rows.storage_types import STORAGE_NAMES, decode, encode, error_bound, storage_type
from hps.tools.bench.gpu_public import MODEL, server_over_folder
from hps.tools.bench.tiers import current_rss_bytes

# (storage, output dtype) pairs timed, float32 → float32 first: the baseline of the ratios
CASES = (("float32", "float32"), ("float16", "float32"), ("float16", "float16"),
         ("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("int8", "float32"))
# the compact storage's targets: ratio to float32 storage into float32
TARGETS = {("float16", "float32"): 1.25, ("float16", "float16"): 1.8,
           ("int8", "float32"): 1.45}
_CHECKED = 1 << 16  # rows of the first batch checked against the reference
# the floor of int8 rows into float32 outputs (cuda/rows.cu dense_gather_int8)
INT8_WIDENED = "float4 gather widened to float32"


def _rss_bytes() -> int:
    return current_rss_bytes() or 0


def _expected(storage: str, out: str, rows: np.ndarray) -> np.ndarray:
    """What a lookup of `rows` writes: the reference decode of the reference encode
    (float32 output), or the encoded 16-bit patterns (as uint16)."""
    stored = encode(storage, rows)
    if out == "float32":
        return decode(storage, stored, rows.shape[1])
    return np.ascontiguousarray(stored).view(np.uint16)


def _warm_process(folder: Path, dim: int, device_id: int, cache_type: str) -> None:
    """Pays what the first server of each storage type costs the process once (CUDA and
    CuPy set-up, kernels compiled and loaded, the hash map's compiled fetch of that type)
    on a small table, so the measured servers' RSS and device memory are their own."""
    from hps import write_sparse_model

    rng = np.random.default_rng(1)
    write_sparse_model(folder / "t0", rng.choice(2**40, 4096, replace=False).astype(np.int64),
                       rng.standard_normal((4096, dim)).astype(np.float32))
    for storage in STORAGE_NAMES:
        server_over_folder(folder, dim, 4096, device_id, embedding_cache_type=cache_type,
                           embedding_storage_dtype=storage).close()


def bench_storage(dim: int = 128, n: int = 1 << 20, table_keys: int = 1 << 20,
                  rounds: int = 10, calls: int = 10, device_id: int = 0, seed: int = 0,
                  cache_type: str = "static", sweep: bool = False) -> list[dict[str, Any]]:
    """Rows per (storage, output dtype) case (see the module docstring); `sweep` also
    times the compact cases at other launch shapes (lanes per key, keys in flight per
    lane group: SWEEP_SHAPES), rows marked "(sweep)"."""
    import cupy as cp
    import torch

    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    dev = torch.device("cuda", device_id)
    torch_dtype = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}
    servers: dict[str, Any] = {}
    memory: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, cp.cuda.Device(device_id):
        from hps import write_sparse_model

        torch.cuda.set_device(dev)
        _warm_process(Path(tmp) / "warm", dim, device_id, cache_type)
        folder = Path(tmp) / "table"
        write_sparse_model(folder / "t0", keys, rows)
        try:
            for storage in STORAGE_NAMES:
                cp.get_default_memory_pool().free_all_blocks()
                free_before = cp.cuda.runtime.memGetInfo()[0]
                rss_before = _rss_bytes()
                hps = server_over_folder(folder, dim, n, device_id,
                                         embedding_cache_type=cache_type,
                                         embedding_storage_dtype=storage)
                servers[storage] = hps
                cp.get_default_memory_pool().free_all_blocks()  # the load's chunks
                stats = hps.server.model(MODEL).tables[0].gpu[device_id].stats()
                memory[storage] = {
                    "gpu_mib": (free_before - cp.cuda.runtime.memGetInfo()[0]) / 2**20,
                    "table_mib": stats["memory_bytes"] / 2**20,
                    "rss_mib": (_rss_bytes() - rss_before) / 2**20}
            picks = [rng.integers(0, table_keys, n) for _ in range(4)]
            t_keys = [torch.as_tensor(keys[p], device=dev) for p in picks]
            outs = {out: torch.empty((n, dim), dtype=torch_dtype[out], device=dev)
                    for out in torch_dtype}
            stream = torch.cuda.current_stream(dev)
            checks = {}
            looked = rows[picks[0][:_CHECKED]]
            for storage, out in CASES:  # exactness first
                target = outs[out]
                target.fill_(float("nan"))
                servers[storage].lookup_fromdlpack(t_keys[0], target, MODEL, 0, device_id)
                stream.synchronize()
                got = target[:_CHECKED]
                got_np = (got.view(torch.int16) if out != "float32" else got).cpu().numpy()
                want = _expected(storage, out, looked)
                if out != "float32":
                    got_np = got_np.view(np.uint16)
                    values = decode(storage, got_np.view(np.float16) if out == "float16"
                                    else got_np, dim)
                else:
                    values = got_np
                wrong = int((~(got_np == want).all(axis=1)).sum())
                err = np.abs(values.astype(np.float64) - looked)
                bound = np.maximum(error_bound(storage, looked), 1e-300)
                checks[(storage, out)] = (wrong, float((err / bound).max()))
            samples: dict[tuple[str, str], list[float]] = {case: [] for case in CASES}
            clock = time.perf_counter
            for r in range(rounds + 1):  # round 0 warms up
                for storage, out in CASES:
                    call = servers[storage].lookup_fromdlpack
                    target = outs[out]
                    for i in range(calls):
                        t0 = clock()
                        call(t_keys[i % 4], target, MODEL, 0, device_id)
                        stream.synchronize()
                        if r:
                            samples[(storage, out)].append(clock() - t0)
            floors = _floors(dim, table_keys, picks, dev, rounds, calls)
            swept = _sweep(servers, outs, t_keys, looked, stream, device_id, rounds, calls) \
                if sweep else []
        finally:
            for hps in servers.values():
                hps.close()
    base = statistics.median(samples[CASES[0]])
    result = []
    for storage, out in CASES:
        took = statistics.median(samples[(storage, out)])
        wrong, worst = checks[(storage, out)]
        result.append({"bench": "storage", "dim": dim, "batch": n,
                       "mode": f"{cache_type}, {storage} rows -> {out}",
                       "gkeys_s": n / took / 1e9, "p50_us": took * 1e6,
                       "vs_float32": base / took,
                       "goal": TARGETS.get((storage, out)),
                       **memory[storage],
                       "vs_float32_mem": memory[storage]["table_mib"]
                       / memory["float32"]["table_mib"],
                       "wrong_rows": wrong, "err_vs_bound": worst})
    for (storage, how), took in floors.items():
        base_floor = floors[("float32", "float4 gather" if how == INT8_WIDENED else how)]
        result.append({"bench": "storage", "dim": dim, "batch": n,
                       "mode": f"floor: {how} of {storage} rows "
                               f"({stored_row_bytes(dim, storage_type(storage))} B)",
                       "gkeys_s": n / took / 1e9, "p50_us": took * 1e6,
                       "vs_float32": base_floor / took})
    for storage, out, group, unroll, hints, took, wrong in swept:
        result.append({"bench": "storage", "dim": dim, "batch": n,
                       "mode": f"{cache_type}, {storage} rows -> {out} (sweep)",
                       "group": group, "unroll": unroll, "hints": hints,
                       "gkeys_s": n / took / 1e9,
                       "p50_us": took * 1e6, "vs_float32": base / took, "wrong_rows": wrong})
    return result


# launch shapes (lanes per key, keys in flight per lane group, cache hint bits: see
# hps/gpu/launch_shape.py's default_hints) the sweep tries
SWEEP_SHAPES = ((8, 2, 2), (8, 2, 3), (8, 4, 3), (4, 2, 2), (4, 2, 3), (4, 4, 3))


def _floors(dim: int, table_keys: int, picks: list[np.ndarray], dev: Any, rounds: int,
            calls: int) -> dict[tuple[str, str], float]:
    """Median seconds of each storage type's floors, keyed (storage, floor): rows of that
    type's stored size gathered from a dense table on the same draws as the lookups, no
    hash probe, no decode: "torch.index_select" (rows as int32 words) and "float4 gather"
    (cuda/rows.cu's dense_gather, rows padded to 16 bytes). What the GPU's memory gives
    for rows of that size: the bound of each type's gain."""
    import cupy as cp
    import torch

    from hps.gpu import kernels

    stream = torch.cuda.current_stream(dev)
    on = cp.cuda.ExternalStream(stream.cuda_stream, dev.index)  # the lookups' stream
    index = [torch.as_tensor(p, device=dev) for p in picks]
    n = index[0].numel()
    cases: dict[tuple[str, str], Any] = {}
    for storage in STORAGE_NAMES:
        words = stored_row_bytes(dim, storage_type(storage)) // 4
        table = torch.randint(-2**31, 2**31 - 1, (table_keys, words), dtype=torch.int32,
                              device=dev)
        out = torch.empty((n, words), dtype=torch.int32, device=dev)
        cases[(storage, "torch.index_select")] = (
            lambda i, table=table, out=out: torch.index_select(table, 0, index[i], out=out))
        width = -(-words // 4) * 4  # float4 per row
        padded = torch.zeros((table_keys, width), dtype=torch.float32, device=dev)
        padded_out = torch.empty((n, width), dtype=torch.float32, device=dev)
        args = [(cp.from_dlpack(i), np.int64(n), cp.from_dlpack(padded),
                 cp.from_dlpack(padded_out)) for i in index]
        cases[(storage, "float4 gather")] = _gather_launch(
            kernels.function("rows.cu", "dense_gather", dev.index, DIM=width),
            -(-(n * width // 4) // 256), args, on)
    # int8 rows widened into float32 outputs, as its lookups write them: the bound of the
    # int8 -> float32 case's gain, set against float32 rows' float4 gather
    int8_bytes = stored_row_bytes(dim, storage_type("int8"))
    int8_table = torch.randint(0, 256, (table_keys, int8_bytes), dtype=torch.uint8, device=dev)
    int8_table.view(torch.float32)[:, -2:] = 0.5  # scale and bias of every row
    widened = torch.empty((n, -(-dim // 4) * 4), dtype=torch.float32, device=dev)
    cases[("int8", INT8_WIDENED)] = _gather_launch(
        kernels.function("rows.cu", "dense_gather_int8", dev.index, DIM=dim,
                         STORAGE=STORAGE_CODES["int8"]),
        -(-(n * dim // 4) // 256),
        [(cp.from_dlpack(i), np.int64(n), cp.from_dlpack(int8_table), cp.from_dlpack(widened))
         for i in index], on)
    samples: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    clock = time.perf_counter
    for r in range(rounds + 1):  # round 0 warms up; the cases take turns as the lookups do
        for case, run in cases.items():
            for i in range(calls):
                t0 = clock()
                run(i % len(index))
                stream.synchronize()
                if r:
                    samples[case].append(clock() - t0)
    return {case: statistics.median(t) for case, t in samples.items()}


def _gather_launch(gather: Any, blocks: int, args: list[tuple[Any, ...]], on: Any
                   ) -> Callable[[int], None]:
    """Draw i's dense gather, launched on stream `on`."""
    def run(i: int) -> None:
        with on:
            gather((blocks,), (256,), args[i])
    return run


def _sweep(servers: dict[str, Any], outs: dict[str, Any], t_keys: list[Any],
           looked: np.ndarray, stream: Any, device_id: int, rounds: int, calls: int
           ) -> list[tuple[str, str, int, int, int, float, int]]:
    """(storage, out, group, unroll, hints, median seconds, wrong rows) of each case at each
    SWEEP_SHAPES shape; the tables get their own shape back after."""
    import torch

    found = []
    clock = time.perf_counter
    for storage, out in CASES:
        table = servers[storage].server.model(MODEL).tables[0].gpu[device_id]._table
        default = (table._group, table._unroll, table._waves, table._hints)
        call = servers[storage].lookup_fromdlpack
        target = outs[out]
        want = _expected(storage, out, looked)
        try:
            for group, unroll, hints in SWEEP_SHAPES:
                table.set_launch(group, unroll, hints=hints)
                call(t_keys[0], target, MODEL, 0, device_id)
                stream.synchronize()
                got = target[: looked.shape[0]]
                got_np = (got.view(torch.int16) if out != "float32" else got).cpu().numpy()
                if out != "float32":
                    got_np = got_np.view(np.uint16)
                wrong = int((~(got_np == want).all(axis=1)).sum())
                samples = []
                for r in range(max(1, rounds // 2) + 1):
                    for i in range(calls):
                        t0 = clock()
                        call(t_keys[i % 4], target, MODEL, 0, device_id)
                        stream.synchronize()
                        if r:
                            samples.append(clock() - t0)
                found.append((storage, out, group, unroll, hints, statistics.median(samples),
                              wrong))
        finally:
            table.set_launch(*default)
    return found


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compact storage's targets, read off the rows: (target, measured, met)."""
    out = []
    for r in rows:
        if r["bench"] != "storage" or "(sweep)" in r["mode"]:
            continue
        if r["mode"].startswith("floor:"):  # what the memory allows each type: no target
            out.append({"target": f"{r['mode']}: x float32 rows' floor", "measured":
                        r["vs_float32"], "met": "n/a"})
            continue
        if r.get("goal") is not None:
            out.append({"target": f"{r['mode']}: >= {r['goal']} x float32",
                        "measured": r["vs_float32"],
                        "met": "yes" if r["vs_float32"] >= r["goal"] else "NO"})
        out.append({"target": f"{r['mode']}: every row as the reference",
                    "measured": r["wrong_rows"], "met": "yes" if r["wrong_rows"] == 0
                    else "NO"})
    return out
