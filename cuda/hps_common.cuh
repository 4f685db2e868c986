// Shared definitions of the hps kernels: key type, the empty-slot sentinel, the set/bucket
// hash, lane groups, and row copies with 16-byte accesses.
//
// hps/gpu/kernels.py pastes this header into each .cu source before compiling it with
// NVRTC (so CuPy's on-disk kernel cache sees header changes) and passes every compile-time
// constant as a -D option (no source defines its own; a missing one is an #error):
//   DIM        vector width in floats
//   GROUP      lanes that serve one key (a power of two, 1..32)
//   SET_SIZE   slots per set (dynamic cache) or per bucket (static table); multiple of GROUP
//   UNROLL     keys a lane group serves per loop round (more loads in flight)
//   HINTS      1: streaming cache hints on row reads and output writes
//   EMPTY_KEY  the key of a free slot (2^63 - 1)
//   RANK_BITS  low bits of an LRU stamp that hold the key's rank in its insert batch
// and, for one source each, STAMP_SHIFT (embedding_cache.cu), PROBE_WINDOW (static_table.cu),
// HITS_CAP (uvm_table.cu).
#pragma once

typedef long long hps_key;
typedef unsigned long long u64;
typedef unsigned int u32;

#if !defined(DIM) || !defined(GROUP) || !defined(SET_SIZE) || !defined(UNROLL) || \
    !defined(HINTS) || !defined(EMPTY_KEY) || !defined(RANK_BITS)
#error "compile through hps/gpu/kernels.py: it passes DIM, GROUP, SET_SIZE, UNROLL, HINTS, EMPTY_KEY, RANK_BITS"
#endif

// Empty slots hold this key. The key itself is still servable: it lives in one extra
// "special" slot (index num_slots) flagged present or not, outside every set.
#define HPS_EMPTY_KEY ((hps_key)EMPTY_KEY)

#define ROW4 ((DIM + 3) / 4)                    // float4 per stored row (rows padded to 16 B)
#define VPL ((ROW4 + GROUP - 1) / GROUP)        // float4 per lane of a group
#define KPL (SET_SIZE / GROUP)                  // set keys per lane
#define KPW (32 / GROUP)                        // groups (keys) per warp and round

#if (SET_SIZE % GROUP) != 0
#error "SET_SIZE must be a multiple of GROUP"
#endif

// MurmurHash3's 64-bit finalizer (fmix64); murmur3_fmix64 in hps/gpu/cache.py mirrors it
// bit for bit.
__device__ __forceinline__ u64 hps_murmur3_fmix64(u64 k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

// Set (bucket) of a key among n: the high 32 bits of the hash scaled to [0, n), no modulo.
__device__ __forceinline__ u32 hps_set_of(hps_key key, u32 n) {
    return (u32)(((hps_murmur3_fmix64((u64)key) >> 32) * (u64)n) >> 32);
}

__device__ __forceinline__ u32 hps_group_mask(int lane) {
#if GROUP == 32
    return 0xffffffffu;
#else
    return ((1u << GROUP) - 1u) << (lane & ~(GROUP - 1));
#endif
}

// Loads this lane's KPL keys of a set (16-byte loads where KPL is even).
__device__ __forceinline__ void hps_load_set_keys(const hps_key* set_keys, int gl, hps_key (&k)[KPL]) {
    const hps_key* p = set_keys + gl * KPL;
#if (KPL % 2) == 0
#pragma unroll
    for (int j = 0; j < KPL; j += 2) {
        const longlong2 v = *reinterpret_cast<const longlong2*>(p + j);
        k[j] = v.x;
        k[j + 1] = v.y;
    }
#else
#pragma unroll
    for (int j = 0; j < KPL; ++j) k[j] = p[j];
#endif
}

// Index within the set of `key` among this lane's keys, or -1.
__device__ __forceinline__ int hps_match(const hps_key (&k)[KPL], hps_key key, int gl) {
    int found = -1;
#pragma unroll
    for (int j = 0; j < KPL; ++j)
        if (k[j] == key) found = gl * KPL + j;
    return found;
}

// Loads this lane's part of a stored row (VPL float4, strided by GROUP).
__device__ __forceinline__ void hps_load_row(const float4* __restrict__ row, int gl, float4 (&r)[VPL]) {
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = gl + v * GROUP;
#if HINTS
        if (c < ROW4) r[v] = __ldcs(row + c);
#else
        if (c < ROW4) r[v] = row[c];
#endif
    }
}

// Stores this lane's part of a row into a caller's float32 row of DIM floats.
// vec4: the caller's buffer is 16-byte aligned and DIM % 4 == 0, so float4 stores are legal.
__device__ __forceinline__ void hps_store_out(float* out_row, int gl, const float4 (&r)[VPL], bool vec4) {
    if (vec4) {
        float4* o = reinterpret_cast<float4*>(out_row);
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = gl + v * GROUP;
#if HINTS
            if (c < ROW4) __stcs(o + c, r[v]);
#else
            if (c < ROW4) o[c] = r[v];
#endif
        }
    } else {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = gl + v * GROUP;
            if (c < ROW4) {
                const float e[4] = {r[v].x, r[v].y, r[v].z, r[v].w};
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    if (c * 4 + q < DIM) out_row[c * 4 + q] = e[q];
            }
        }
    }
}

__device__ __forceinline__ void hps_fill_out(float* out_row, int gl, float value, bool vec4) {
    float4 r[VPL];
#pragma unroll
    for (int v = 0; v < VPL; ++v) r[v] = make_float4(value, value, value, value);
    hps_store_out(out_row, gl, r, vec4);
}

// Copies a caller's float32 row (DIM floats) into a stored row (ROW4 float4, zero padded).
__device__ __forceinline__ void hps_copy_in(float4* __restrict__ dst, const float* __restrict__ src,
                                            int gl, bool vec4) {
    float4 r[VPL];
    if (vec4) {
        const float4* s = reinterpret_cast<const float4*>(src);
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = gl + v * GROUP;
            if (c < ROW4) r[v] = s[c];
        }
    } else {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = gl + v * GROUP;
            float e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (c < ROW4 && c * 4 + q < DIM) e[q] = src[c * 4 + q];
            r[v] = make_float4(e[0], e[1], e[2], e[3]);
        }
    }
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < ROW4) dst[c] = r[v];
    }
}

// Appends (position, key) of the misses of one warp round to the miss lists with one
// atomic per warp on ctl[0]. Every lane of the warp must call it.
__device__ __forceinline__ void hps_record_misses(bool leader_miss, long long pos, hps_key key,
                                                  int lane, int* __restrict__ miss_count,
                                                  int* __restrict__ miss_pos,
                                                  hps_key* __restrict__ miss_keys) {
    const u32 ballot = __ballot_sync(0xffffffffu, leader_miss);
    if (ballot == 0u) return;
    int base = 0;
    if (lane == 0) base = atomicAdd(miss_count, __popc(ballot));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (leader_miss) {
        const int off = base + __popc(ballot & ((1u << lane) - 1u));
        miss_pos[off] = (int)pos;
        miss_keys[off] = key;
    }
}

// The end of every query kernel: the last block to finish publishes the miss count to
// `host_count` (mapped pinned host memory) and resets ctl = {miss count, blocks done} for
// the workspace's next query, so a query needs no memset and no copy of its own. The host
// spins on `host_count` rather than waiting for the kernel to retire: the system-scope
// fences make every block's writes (the missed keys in host memory among them) visible
// before the count, and no block touches the table after it.
__device__ __forceinline__ void hps_finish_query(int* ctl, int* host_count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        const u32 done = atomicAdd(reinterpret_cast<u32*>(ctl + 1), 1u);
        if (done == gridDim.x - 1) {
            __threadfence_system();
            const int count = atomicExch(ctl, 0);
            ctl[1] = 0;
            __threadfence();  // the reset is seen before the count: the next query may follow at once
            *reinterpret_cast<volatile int*>(host_count) = count;
        }
    }
}

// Writes the present (non-empty) keys of slots [first, last) to out, order unspecified;
// the special slot's key is appended when flagged and its set lies in the range.
__device__ __forceinline__ void hps_dump_slots(const hps_key* __restrict__ slot_keys, long long first,
                                               long long last, int* __restrict__ count,
                                               hps_key* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const long long stride = (long long)gridDim.x * blockDim.x;
    // warp-uniform loop so the whole warp takes part in each ballot
    for (long long base = first + ((long long)blockIdx.x * blockDim.x + threadIdx.x - lane);
         base < last; base += stride) {
        const long long s = base + lane;
        const hps_key k = s < last ? slot_keys[s] : HPS_EMPTY_KEY;
        const bool present = k != HPS_EMPTY_KEY;
        const u32 ballot = __ballot_sync(0xffffffffu, present);
        if (ballot == 0u) continue;
        int off = 0;
        if (lane == 0) off = atomicAdd(count, __popc(ballot));
        off = __shfl_sync(0xffffffffu, off, 0);
        if (present) out[off + __popc(ballot & ((1u << lane) - 1u))] = k;
    }
}

// out[pos[j]] = rows[inv[j]] for j < count (inv null: rows[j]); rows is [u, DIM]
// contiguous, out is [n, DIM]. vec4 (DIM % 4 == 0, out and rows 16-byte aligned): one
// float4 per thread, else one float. Run by blocks [block, blocks) of a grid, so a kernel
// may give this work to some of its blocks (cache_insert_scatter).
__device__ __forceinline__ void hps_scatter_rows(const u32 block, const u32 blocks,
                                                 const int* __restrict__ pos,
                                                 const int* __restrict__ inv,
                                                 const long long count,
                                                 const float* __restrict__ rows,
                                                 float* __restrict__ out, const int vec4) {
    const long long stride = (long long)blocks * blockDim.x;
    const long long first = (long long)block * blockDim.x + threadIdx.x;
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
