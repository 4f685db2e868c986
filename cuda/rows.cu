// Row movers around the caches: the scatter of host-fetched rows into a lookup's output, and
// the dense float4 gather that the benchmark measures the caches against.
#include "hps_common.cuh"

// out[pos[j]] = rows[inv[j]] for j < count (inv null: rows[j]); rows is [u, DIM]
// contiguous, out is [n, DIM]. vec4 (DIM % 4 == 0, out and rows 16-byte aligned): one
// float4 per thread, else one float.
extern "C" __global__ void scatter_rows(const int* __restrict__ pos, const int* __restrict__ inv,
                                        const long long count, const float* __restrict__ rows,
                                        float* __restrict__ out, const int vec4) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec4) {
        const int w = DIM / 4;
        const float4* r4 = reinterpret_cast<const float4*>(rows);
        float4* o4 = reinterpret_cast<float4*>(out);
        for (long long t = first; t < count * w; t += stride) {
            const long long j = t / w;
            const int e = (int)(t - j * w);
            const long long src = inv ? (long long)inv[j] : j;
            o4[(long long)pos[j] * w + e] = r4[src * w + e];
        }
        return;
    }
    for (long long t = first; t < count * DIM; t += stride) {
        const long long j = t / DIM;
        const int e = (int)(t - j * DIM);
        const long long src = inv ? (long long)inv[j] : j;
        out[(long long)pos[j] * DIM + e] = rows[src * DIM + e];
    }
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
