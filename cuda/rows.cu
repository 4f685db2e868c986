// Row movers around the caches: the scatter of host-fetched (float32) rows into a lookup's
// output of any output type, and the dense float4 gather that the benchmark measures the
// caches against.
#include "hps_common.cuh"

// out[pos[j]] = rows[inv[j]] for j < count (inv null: rows[j]): hps_scatter_rows.
extern "C" __global__ void scatter_rows(const int* __restrict__ pos, const int* __restrict__ inv,
                                        const long long count, const float* __restrict__ rows,
                                        hps_out_t* __restrict__ out, const int vec4) {
    hps_scatter_rows(blockIdx.x, gridDim.x, pos, inv, count, rows, out, vec4);
}

// The baseline: out[i] = table[idx[i]] for a dense [rows, DIM] table, DIM % 4 == 0, one
// float4 per thread.
extern "C" __global__ void dense_gather(const long long* __restrict__ idx, const long long n,
                                        const float4* __restrict__ table, float4* __restrict__ out) {
    const long long total = n * ROW4;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long i = t / ROW4;
        const int c = (int)(t - i * ROW4);
        out[t] = table[idx[i] * ROW4 + c];
    }
}

// Nothing: the benchmark's floor for a launch and a host wait.
extern "C" __global__ void noop() {}

#if STORAGE == HPS_INT8 && OUT_TYPE == HPS_F32
// The floor of int8 rows into float32 outputs: out[i] = the decode of table[idx[i]] for a
// dense table of stored int8 rows (ROW_BYTES each: DIM codes, then scale and bias, as
// hps/rows/storage_types.py lays them out), DIM % 4 == 0, one float4 of output per thread. What the
// GPU's memory gives an int8 table into float32 outputs before any hash probe: its rows are
// a quarter of float32's, its outputs the same 4 bytes a value.
extern "C" __global__ void dense_gather_int8(const long long* __restrict__ idx, const long long n,
                                             const unsigned char* __restrict__ table,
                                             float4* __restrict__ out) {
    const long long total = n * (DIM / 4);
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long i = t / (DIM / 4);
        const int c = (int)(t - i * (DIM / 4));
        const unsigned char* row = table + idx[i] * ROW_BYTES;
        const u32 w = *reinterpret_cast<const u32*>(row + 4 * c);
        const float* sb = reinterpret_cast<const float*>(row + ROW_BYTES - 8);
        const float scale = sb[0], bias = sb[1];
        out[t] = make_float4(hps_dequant(w & 0xffu, scale, bias),
                             hps_dequant((w >> 8) & 0xffu, scale, bias),
                             hps_dequant((w >> 16) & 0xffu, scale, bias),
                             hps_dequant(w >> 24, scale, bias));
    }
}
#endif
