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
