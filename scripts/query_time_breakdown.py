"""Probe: where a static table's large-batch query spends its kernel time.

    python scripts/query_time_breakdown.py [--dim 128] [--keys 1048576]

A static table of `--keys` keys per storage case; the same uniform draw of as many keys
is queried by each kernel, 30 times, timed with CUDA events (medians):
  static_query            the one-round query (float32 outputs take it)
  static_query_pipelined  the pipelined query (16-bit outputs take it), one wave of blocks
  probe only              the same probe, each key's slot written out (no rows)
  rows only               the same row reads and output writes at hashed slots (no probe)
The last two are kernels of this script, compiled with the table's own constants over
cuda/static_table.cu: what the memory allows each part alone. Kernel time, not what a
user sees: `hps bench gpu --profile storage` times the public call.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

PARTS = r"""
extern "C" __global__ void probe_only(
    const hps_key* __restrict__ keys, const long long n, const hps_key* __restrict__ slot_keys,
    const u32 num_buckets, const int* __restrict__ flags, long long* __restrict__ slots) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long base = warp * (KPW * UNROLL); base < n; base += nwarps * (KPW * UNROLL)) {
        long long pos[UNROLL];
        hps_key key[UNROLL];
        long long slot[UNROLL];
        static_find_slots(keys, n, base, g, gl, gmask, slot_keys, num_buckets, flags[0] != 0,
                          pos, key, slot);
        for (int u = 0; u < UNROLL; ++u)
            if (gl == 0 && pos[u] < n) slots[pos[u]] = slot[u];
    }
}

extern "C" __global__ void rows_only(
    const hps_key* __restrict__ keys, const long long n, const hps_row_t* __restrict__ vecs,
    const u32 num_slots, hps_out_t* __restrict__ out, const int out_vec4) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long base = warp * (KPW * UNROLL); base < n; base += nwarps * (KPW * UNROLL)) {
        long long pos[UNROLL];
        long long slot[UNROLL];
        for (int u = 0; u < UNROLL; ++u) {
            pos[u] = base + u * KPW + g;
            slot[u] = pos[u] < n ? (long long)hps_set_of(keys[pos[u]], num_slots) : -1;
        }
        hps_lane_row r[UNROLL];
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_load_row(vecs + slot[u] * ROW_STRIDE, gl, r[u]);
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_store_out(out + pos[u] * DIM, gl, r[u], out_vec4 != 0);
    }
}
"""

CASES = (("float32", "float32"), ("float16", "float32"), ("float16", "float16"),
         ("bfloat16", "bfloat16"), ("int8", "float32"))


def main() -> None:
    import cupy as cp

    from hps.gpu import kernels
    from hps.gpu.device_table import BLOCK
    from hps.rows.gpu_layout import OUTPUT_CODES
    from hps.gpu.static_table import StaticEmbeddingTable

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--keys", type=int, default=1 << 20)
    args = parser.parse_args()
    dim, n = args.dim, args.keys
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim), dtype=np.float32)
    draw = cp.asarray(keys[rng.integers(0, n, n)])
    sms = kernels.multiprocessors(0)
    source = kernels._source_text("static_table.cu") + PARTS
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(kernel, grid: int, params: tuple) -> float:
        took = []
        for r in range(33):
            start.record()
            kernel((grid,), (BLOCK,), params)
            stop.record()
            stop.synchronize()
            if r >= 3:
                took.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
        return statistics.median(took)

    print(f"static table, {n:,} keys, dim {dim}, {n:,}-key draws; kernel time (CUDA events)")
    for storage, out_name in CASES:
        table = StaticEmbeddingTable(n, dim, storage=storage)
        table.build(keys, rows)
        out_type = OUTPUT_CODES[out_name]
        out = cp.empty((n, dim), dtype=np.float32 if out_name == "float32" else np.float16)
        ctl, count = cp.zeros(2, np.int32), cp.zeros(2, np.int32)
        miss_pos, miss_keys = cp.empty(n, np.int32), cp.empty(n, np.int64)
        slots = cp.empty(n, np.int64)
        query_args = (draw, np.int64(n), table._keys, table._vecs, np.uint32(table.num_sets),
                      table._flags, out, np.int32(1), ctl, count, miss_pos, miss_keys,
                      np.float32(0))
        shape = {**table._defines}
        if out_type:
            shape["OUT_TYPE"] = out_type
        parts = cp.RawModule(code=source, options=kernels.compile_options(shape))
        blocks = -(-n // (table._unroll * (32 // table._group) * (BLOCK // 32)))
        found = {"static_query": timed(table._kernel("static_query", out_type), blocks,
                                       query_args)}
        if out_type:
            pipelined = kernels.function("static_table.cu", "static_query_pipelined", 0,
                                         **{**shape, "UNROLL": 1})
            wave = min(-(-n // ((32 // table._group) * (BLOCK // 32))),
                       sms * kernels.resident_blocks(pipelined, BLOCK))
            found["static_query_pipelined"] = timed(pipelined, wave, query_args)
        found["probe only"] = timed(
            parts.get_function("probe_only"), blocks,
            (draw, np.int64(n), table._keys, np.uint32(table.num_sets), table._flags, slots))
        found["rows only"] = timed(
            parts.get_function("rows_only"), blocks,
            (draw, np.int64(n), table._vecs, np.uint32(table.num_slots), out, np.int32(1)))
        print(f"\n{storage} rows -> {out_name}")
        for part, us in found.items():
            print(f"  {part:24} {us:8.1f} us  {n / us / 1e3:6.3f} G keys/s")
        table.close()


if __name__ == "__main__":
    main()
