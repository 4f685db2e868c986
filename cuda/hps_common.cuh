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
//   HINTS      bits: 1 streaming cache hints on row reads and output writes; 2 queries'
//              reads of the index (set or bucket keys) ask L2 to keep their lines
//   EMPTY_KEY  the key of a free slot (2^63 - 1)
//   RANK_BITS  low bits of an LRU stamp that hold the key's rank in its insert batch
//   STORAGE    how rows are stored: 0 float32, 1 float16, 2 bfloat16, 3 int8 (row-wise
//              codes with a float32 scale and bias; hps/rows/storage_types.py's layout)
//   OUT_TYPE   what a query writes: 0 float32 (compact rows widened in registers), or the
//              storage's own 16-bit type (1 float16, 2 bfloat16), copied without widening
//   ROW_BYTES  bytes of one stored row (hps/rows/gpu_layout.py), checked below
// and, for one source each, STAMP_SHIFT (embedding_cache.cu), PROBE_WINDOW (static_table.cu),
// HITS_CAP (uvm_table.cu). Rows arrive as float32 (inserts, updates) and are encoded here,
// bit for bit as hps/rows/storage_types.py's reference encoder does.
#pragma once

typedef long long hps_key;
typedef unsigned long long u64;
typedef unsigned int u32;

#if !defined(DIM) || !defined(GROUP) || !defined(SET_SIZE) || !defined(UNROLL) || \
    !defined(HINTS) || !defined(EMPTY_KEY) || !defined(RANK_BITS)
#error "compile through hps/gpu/kernels.py: it passes DIM, GROUP, SET_SIZE, UNROLL, HINTS, EMPTY_KEY, RANK_BITS"
#endif
#if !defined(STORAGE) || !defined(OUT_TYPE) || !defined(ROW_BYTES)
#error "compile through hps/gpu/kernels.py: it passes STORAGE, OUT_TYPE, ROW_BYTES"
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

#define HPS_F32 0
#define HPS_F16 1
#define HPS_BF16 2
#define HPS_INT8 3

// hps_row_t: the unit rows are addressed in; ROW_STRIDE: units per stored row.
#if STORAGE == HPS_F32
typedef float4 hps_row_t;
#define ROW_STRIDE ROW4
#define HPS_LAYOUT_BYTES (ROW4 * 16)
#elif STORAGE == HPS_F16 || STORAGE == HPS_BF16
typedef uint4 hps_row_t;  // 16-bit patterns, rows padded to 16 bytes
#define ROW_STRIDE (ROW_BYTES / 16)
#define HPS_LAYOUT_BYTES (((DIM + 7) / 8) * 16)
#elif STORAGE == HPS_INT8
typedef u32 hps_row_t;  // [codes, padded to 4 bytes][scale float32][bias float32]
#define ROW_STRIDE (ROW_BYTES / 4)
#define HPS_LAYOUT_BYTES (((DIM + 3) / 4) * 4 + 8)
#else
#error "unknown STORAGE"
#endif
#if ROW_BYTES != HPS_LAYOUT_BYTES
#error "ROW_BYTES disagrees with the row layout of STORAGE"
#endif
#define UPL ((ROW_STRIDE + GROUP - 1) / GROUP)  // row units per lane of a group

#if OUT_TYPE == HPS_F32
typedef float hps_out_t;
#elif OUT_TYPE == HPS_F16 || OUT_TYPE == HPS_BF16
typedef unsigned short hps_out_t;  // the 16-bit patterns
#if OUT_TYPE != STORAGE
#error "a 16-bit output is written from rows stored in that same type only"
#endif
#else
#error "unknown OUT_TYPE"
#endif

// Conversions, IEEE round-to-nearest-even (NumPy's astype; hps/rows/storage_types.py's bfloat16 rule).
__device__ __forceinline__ float hps_half_to_float(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
__device__ __forceinline__ u32 hps_float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float hps_bf16_to_float(u32 b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ u32 hps_float_to_bf16(float f) {
    const u32 u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// A float32 value as the output type (the scatter of host-fetched rows, default values).
__device__ __forceinline__ hps_out_t hps_narrow(float f) {
#if OUT_TYPE == HPS_F16
    return (hps_out_t)hps_float_to_half(f);
#elif OUT_TYPE == HPS_BF16
    return (hps_out_t)hps_float_to_bf16(f);
#else
    return f;
#endif
}

// MurmurHash3's 64-bit finalizer (fmix64); murmur3_fmix64 in hps/gpu/dynamic_cache.py mirrors it
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

// hps_load_set_keys for a kernel that reads sets no kernel running beside it writes (the
// queries): with HINTS bit 2 the lines are kept in L2 ahead of the streamed rows (an
// evict_last policy), since a lookup reads a row once and the index again and again.
__device__ __forceinline__ void hps_load_index_keys(const hps_key* set_keys, int gl,
                                                    hps_key (&k)[KPL]) {
#if (HINTS & 2) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u64 policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    const hps_key* p = set_keys + gl * KPL;
#if (KPL % 2) == 0
#pragma unroll
    for (int j = 0; j < KPL; j += 2)
        asm("ld.global.nc.L2::cache_hint.v2.s64 {%0, %1}, [%2], %3;"
            : "=l"(k[j]), "=l"(k[j + 1]) : "l"(p + j), "l"(policy));
#else
#pragma unroll
    for (int j = 0; j < KPL; ++j)
        asm("ld.global.nc.L2::cache_hint.s64 %0, [%1], %2;" : "=l"(k[j]) : "l"(p + j), "l"(policy));
#endif
#else
    hps_load_set_keys(set_keys, gl, k);
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

#if STORAGE == HPS_F32
// A lane's part of a row: VPL float4.
typedef float4 hps_lane_row[VPL];

// Loads this lane's part of a stored row (VPL float4, strided by GROUP).
__device__ __forceinline__ void hps_load_row(const float4* __restrict__ row, int gl, float4 (&r)[VPL]) {
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = gl + v * GROUP;
#if HINTS & 1
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
#if HINTS & 1
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

#else  // compact rows: float16, bfloat16, int8

// A lane's part of a row is NQ chunks of QW elements, strided by GROUP: QW 4 into a float32
// output (one float4 store per chunk), 8 into a 16-bit output (one 16-byte store).
#if OUT_TYPE == HPS_F32
#define QW 4
#else
#define QW 8
#endif
#define NQ ((DIM + QW - 1) / QW)        // chunks per row (within the padded row)
#define QPL ((NQ + GROUP - 1) / GROUP)  // chunks per lane

#if STORAGE == HPS_INT8
typedef u32 hps_chunk_t;    // 4 codes (int8 rows go to float32 outputs only: QW 4)
#elif QW == 4
typedef uint2 hps_chunk_t;  // 4 halves
#else
typedef uint4 hps_chunk_t;  // 8 halves
#endif

struct hps_lane_row {
    hps_chunk_t c[QPL];
#if STORAGE == HPS_INT8
    float scale, bias;
#endif
};

template <typename T>
__device__ __forceinline__ T hps_ld(const T* p) {
#if HINTS & 1
    return __ldcs(p);
#else
    return *p;
#endif
}

template <typename T>
__device__ __forceinline__ void hps_st(T* p, const T& v) {
#if HINTS & 1
    __stcs(p, v);
#else
    *p = v;
#endif
}

// Loads this lane's chunks of a stored row (and an int8 row's scale and bias).
__device__ __forceinline__ void hps_load_row(const hps_row_t* __restrict__ row, int gl, hps_lane_row& r) {
    const hps_chunk_t* p = reinterpret_cast<const hps_chunk_t*>(row);
#pragma unroll
    for (int v = 0; v < QPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < NQ) r.c[v] = hps_ld(p + c);
    }
#if STORAGE == HPS_INT8
    const float* sb = reinterpret_cast<const float*>(row) + (ROW_BYTES - 8) / 4;
    r.scale = sb[0];
    r.bias = sb[1];
#endif
}

#if OUT_TYPE == HPS_F32
// int8 decode: q · scale, then + bias, each rounded to float32 (no fused multiply-add).
__device__ __forceinline__ float hps_dequant(u32 q, float scale, float bias) {
    return __fadd_rn(__fmul_rn(__uint2float_rn(q), scale), bias);
}

// Chunk v of a lane's row as 4 float32 values.
__device__ __forceinline__ float4 hps_widen(const hps_lane_row& r, int v) {
#if STORAGE == HPS_INT8
    const u32 w = r.c[v];
    return make_float4(hps_dequant(w & 0xffu, r.scale, r.bias),
                       hps_dequant((w >> 8) & 0xffu, r.scale, r.bias),
                       hps_dequant((w >> 16) & 0xffu, r.scale, r.bias),
                       hps_dequant(w >> 24, r.scale, r.bias));
#elif STORAGE == HPS_F16
    const uint2 h = r.c[v];
    return make_float4(hps_half_to_float(h.x & 0xffffu), hps_half_to_float(h.x >> 16),
                       hps_half_to_float(h.y & 0xffffu), hps_half_to_float(h.y >> 16));
#else
    const uint2 h = r.c[v];
    return make_float4(hps_bf16_to_float(h.x & 0xffffu), hps_bf16_to_float(h.x >> 16),
                       hps_bf16_to_float(h.y & 0xffffu), hps_bf16_to_float(h.y >> 16));
#endif
}
#endif

// Stores this lane's part of a row into a caller's row of DIM output elements.
// vec: the caller's buffer is 16-byte aligned and DIM % QW == 0, so 16-byte stores are legal.
__device__ __forceinline__ void hps_store_out(hps_out_t* out_row, int gl, const hps_lane_row& r, bool vec) {
#pragma unroll
    for (int v = 0; v < QPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < NQ) {
#if OUT_TYPE == HPS_F32
            const float4 f = hps_widen(r, v);
            if (vec) {
                hps_st(reinterpret_cast<float4*>(out_row) + c, f);
            } else {
                const float e[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    if (c * 4 + q < DIM) out_row[c * 4 + q] = e[q];
            }
#else
            if (vec) {
                hps_st(reinterpret_cast<uint4*>(out_row) + c, r.c[v]);
            } else {
                const u32 w[4] = {r.c[v].x, r.c[v].y, r.c[v].z, r.c[v].w};
#pragma unroll
                for (int q = 0; q < 8; ++q)
                    if (c * 8 + q < DIM) out_row[c * 8 + q] = (hps_out_t)(w[q >> 1] >> (16 * (q & 1)));
            }
#endif
        }
    }
}

__device__ __forceinline__ void hps_fill_out(hps_out_t* out_row, int gl, float value, bool vec) {
#if OUT_TYPE == HPS_F32
    typedef float4 fill_t;
    const fill_t f = make_float4(value, value, value, value);
#else
    typedef uint4 fill_t;
    const u32 h = (u32)hps_narrow(value);
    const u32 pair = h | (h << 16);
    const fill_t f = make_uint4(pair, pair, pair, pair);
#endif
#pragma unroll
    for (int v = 0; v < QPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < NQ) {
            if (vec) {
                hps_st(reinterpret_cast<fill_t*>(out_row) + c, f);
            } else {
#pragma unroll
                for (int q = 0; q < QW; ++q)
                    if (c * QW + q < DIM) out_row[c * QW + q] = hps_narrow(value);
            }
        }
    }
}

// Encodes a caller's float32 row (DIM floats) into a stored row, bit for bit as
// hps/rows/storage_types.py's encode does. Every lane of the group must call it (int8 rows reduce
// their minimum and maximum over the group).
__device__ __forceinline__ void hps_copy_in(hps_row_t* __restrict__ dst, const float* __restrict__ src,
                                            int gl, bool vec4) {
    float e[VPL][4];  // this lane's quads of the source row, zero past DIM
    if (vec4) {
        const float4* s = reinterpret_cast<const float4*>(src);
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = gl + v * GROUP;
            const float4 x = c < ROW4 ? s[c] : make_float4(0.f, 0.f, 0.f, 0.f);
            e[v][0] = x.x;
            e[v][1] = x.y;
            e[v][2] = x.z;
            e[v][3] = x.w;
        }
    } else {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = gl + v * GROUP;
#pragma unroll
            for (int q = 0; q < 4; ++q) e[v][q] = c < ROW4 && c * 4 + q < DIM ? src[c * 4 + q] : 0.f;
        }
    }
#if STORAGE == HPS_INT8
    // bias = min, scale = float32((float64(max) - float64(min)) / 255), raised to the
    // smallest subnormal when that rounds to 0 over a nonzero span;
    // q = rint((float64(x) - float64(min)) / float64(scale)), 0 for a constant row
    float lo = __int_as_float(0x7f800000), hi = __int_as_float(0xff800000);
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = gl + v * GROUP;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (c < ROW4 && c * 4 + q < DIM) {
                lo = fminf(lo, e[v][q]);
                hi = fmaxf(hi, e[v][q]);
            }
        }
    }
    const u32 gmask = hps_group_mask(threadIdx.x & 31);
#pragma unroll
    for (int off = GROUP / 2; off > 0; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(gmask, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(gmask, hi, off));
    }
    const double span = (double)hi - (double)lo;
    float scale = __double2float_rn(span / 255.0);
    if (scale == 0.f && span > 0.0) scale = __int_as_float(1);
    const double divisor = scale > 0.f ? (double)scale : 1.0;
    u32* d = reinterpret_cast<u32*>(dst);
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < ROW4) {
            u32 w = 0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (c * 4 + q < DIM) {
                    int t = __double2int_rn(((double)e[v][q] - (double)lo) / divisor);
                    t = t < 0 ? 0 : (t > 255 ? 255 : t);
                    w |= (u32)t << (8 * q);
                }
            }
            d[c] = w;
        }
    }
    if (gl == 0) {
        float* sb = reinterpret_cast<float*>(dst) + (ROW_BYTES - 8) / 4;
        sb[0] = scale;
        sb[1] = lo;
    }
#else
    uint2* d = reinterpret_cast<uint2*>(dst);
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < ROW4) {
#if STORAGE == HPS_F16
            const u32 h[4] = {hps_float_to_half(e[v][0]), hps_float_to_half(e[v][1]),
                              hps_float_to_half(e[v][2]), hps_float_to_half(e[v][3])};
#else
            const u32 h[4] = {hps_float_to_bf16(e[v][0]), hps_float_to_bf16(e[v][1]),
                              hps_float_to_bf16(e[v][2]), hps_float_to_bf16(e[v][3])};
#endif
            d[c] = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
        }
    }
#endif
}

#endif  // STORAGE

// The round loop of the pipelined queries (static_query_pipelined, cache_query_pipelined):
// each warp serves rounds base, base + step, ... of a batch of n keys, and issues one
// round's row reads before it probes the next round, so rows are in flight while the next
// keys and sets are read. find(base, pos, key, slot) probes the round at base (slot -1:
// not held); answer(pos, key, slot, r) writes a round whose rows are in r. Every lane of
// the warp must call it (the loop is warp-uniform).
template <typename Find, typename Answer>
__device__ __forceinline__ void hps_pipelined_rounds(const long long n,
                                                     const hps_row_t* __restrict__ vecs,
                                                     const int gl, Find find, Answer answer) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long step = (((long long)gridDim.x * blockDim.x) >> 5) * (KPW * UNROLL);
    long long base = warp * (KPW * UNROLL);
    long long pos[UNROLL];
    hps_key key[UNROLL];
    long long slot[UNROLL];
    if (base < n) find(base, pos, key, slot);
    while (base < n) {
        hps_lane_row r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_load_row(vecs + slot[u] * ROW_STRIDE, gl, r[u]);
        const long long next = base + step;
        long long next_pos[UNROLL];
        hps_key next_key[UNROLL];
        long long next_slot[UNROLL];
        if (next < n) find(next, next_pos, next_key, next_slot);
        answer(pos, key, slot, r);
        base = next;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            pos[u] = next_pos[u];
            key[u] = next_key[u];
            slot[u] = next_slot[u];
        }
    }
}

// Appends (position, key) of the misses of one warp round to the miss lists with one
// atomic per warp on ctl[0]; SYSTEM: a system-scope atomic, for the launches of one query
// on several devices that share the lists (cache_query_sharded). Every lane of the warp
// must call it.
template <bool SYSTEM = false>
__device__ __forceinline__ void hps_record_misses(bool leader_miss, long long pos, hps_key key,
                                                  int lane, int* __restrict__ miss_count,
                                                  int* __restrict__ miss_pos,
                                                  hps_key* __restrict__ miss_keys) {
    const u32 ballot = __ballot_sync(0xffffffffu, leader_miss);
    if (ballot == 0u) return;
    int base = 0;
    if (lane == 0)
        base = SYSTEM ? atomicAdd_system(miss_count, __popc(ballot))
                      : atomicAdd(miss_count, __popc(ballot));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (leader_miss) {
        const int off = base + __popc(ballot & ((1u << lane) - 1u));
        miss_pos[off] = (int)pos;
        miss_keys[off] = key;
    }
}

// hps_finish_query (below) of a query launched as several grids that share ctl, `blocks` in all
// of them (SYSTEM: on several devices, cache_query_sharded's pushed launches, so ctl is
// counted and reset with system-scope atomics and the last block of any grid publishes).
template <bool SYSTEM>
__device__ __forceinline__ void hps_finish_query_of(int* ctl, int* host_count, const u32 blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        u32* done_at = reinterpret_cast<u32*>(ctl + 1);
        const u32 done = SYSTEM ? atomicAdd_system(done_at, 1u) : atomicAdd(done_at, 1u);
        if (done == blocks - 1) {
            __threadfence_system();
            const int count = SYSTEM ? atomicExch_system(ctl, 0) : atomicExch(ctl, 0);
            if (SYSTEM) {
                atomicExch_system(ctl + 1, 0);
                __threadfence_system();
            } else {
                ctl[1] = 0;
                __threadfence();  // the reset is seen before the count: the next query may follow at once
            }
            *reinterpret_cast<volatile int*>(host_count) = count;
        }
    }
}

// The end of every query kernel: the last block to finish publishes the miss count to
// `host_count` (mapped pinned host memory) and resets ctl = {miss count, blocks done} for
// the workspace's next query, so a query needs no memset and no copy of its own. The host
// spins on `host_count` rather than waiting for the kernel to retire: the system-scope
// fences make every block's writes (the missed keys in host memory among them) visible
// before the count, and no block touches the table after it.
__device__ __forceinline__ void hps_finish_query(int* ctl, int* host_count) {
    hps_finish_query_of<false>(ctl, host_count, gridDim.x);
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

// The scatter's float32 values as the output type: 4 at once (16-bit outputs: rounded to
// nearest even, 8 bytes), or one.
#if OUT_TYPE == HPS_F32
typedef float4 hps_out4_t;
#define HPS_NARROW4(v) (v)
#define HPS_NARROW(v) (v)
#else
typedef uint2 hps_out4_t;
__device__ __forceinline__ uint2 hps_narrow4(const float4 v) {
    return make_uint2((u32)hps_narrow(v.x) | ((u32)hps_narrow(v.y) << 16),
                      (u32)hps_narrow(v.z) | ((u32)hps_narrow(v.w) << 16));
}
#define HPS_NARROW4(v) hps_narrow4(v)
#define HPS_NARROW(v) hps_narrow(v)
#endif

// out[pos[j]] = rows[inv[j]] for j < count (inv null: rows[j]); rows is float32 [u, DIM]
// contiguous, out is [n, DIM] of the output type. vec4 (DIM % 4 == 0, out and rows
// 16-byte aligned): one float4 per thread, else one float. Run by blocks [block, blocks)
// of a grid, so a kernel may give this work to some of its blocks (cache_insert_scatter).
__device__ __forceinline__ void hps_scatter_rows(const u32 block, const u32 blocks,
                                                 const int* __restrict__ pos,
                                                 const int* __restrict__ inv,
                                                 const long long count,
                                                 const float* __restrict__ rows,
                                                 hps_out_t* __restrict__ out, const int vec4) {
    const long long stride = (long long)blocks * blockDim.x;
    const long long first = (long long)block * blockDim.x + threadIdx.x;
    if (vec4) {
        const int w = DIM / 4;
        const float4* r4 = reinterpret_cast<const float4*>(rows);
        hps_out4_t* o4 = reinterpret_cast<hps_out4_t*>(out);
        for (long long t = first; t < count * w; t += stride) {
            const long long j = t / w;
            const int e = (int)(t - j * w);
            const long long src = inv ? (long long)inv[j] : j;
            o4[(long long)pos[j] * w + e] = HPS_NARROW4(r4[src * w + e]);
        }
        return;
    }
    for (long long t = first; t < count * DIM; t += stride) {
        const long long j = t / DIM;
        const int e = (int)(t - j * DIM);
        const long long src = inv ? (long long)inv[j] : j;
        out[(long long)pos[j] * DIM + e] = HPS_NARROW(rows[src * DIM + e]);
    }
}

// A sharded table's shards as one query on the caller's device reads them
// (hps/gpu/sharded_query.py): each shard's index, stamps (0 for a static table), rows and
// flags by address, on its own device (a peer's read over NVLink, peer access enabled), in
// a small device array built once for each device launched on, with whether the shard
// lives on another device than that one (`remote`); after the shards, at entry
// `num_shards`, that device's hot copy of its peers' hottest rows (hps/gpu/hot_rows.py;
// no sets: none). The query's tick of each shard's LRU by value.
#define HPS_MAX_SHARDS 8
struct hps_shard {
    const hps_key* slot_keys;
    u64* stamps;
    const hps_row_t* vecs;
    long long num_sets;
    const int* flags;
    long long remote;
};
struct hps_ticks {
    u64 t[HPS_MAX_SHARDS];
};

// The shard of a key among `count`, as hps/gpu/sharded.py shard_of computes it.
__device__ __forceinline__ int hps_shard_of(hps_key key, long long count) {
    return (int)(((hps_murmur3_fmix64((u64)key) & 0xffffffffULL) * (u64)count) >> 32);
}

// The keys of one lane group in one round of a sharded query (cache_query_sharded,
// static_query_sharded): keys[base + u * KPW + g] for u < UNROLL, with each key's shard.
// A key of a shard outside `mine` (bit s: shard s), like a position past n, gets pos n and
// key HPS_EMPTY_KEY: the launch that serves its shard answers it.
__device__ __forceinline__ void hps_sharded_round_keys(
    const hps_key* __restrict__ keys, const long long n, const long long base, const int g,
    const long long num_shards, const u32 mine, long long (&pos)[UNROLL],
    hps_key (&key)[UNROLL], int (&s)[UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        pos[u] = base + u * KPW + g;
        key[u] = pos[u] < n ? keys[pos[u]] : HPS_EMPTY_KEY;
        s[u] = hps_shard_of(key[u], num_shards);
        if (((mine >> s[u]) & 1u) == 0u) pos[u] = n, key[u] = HPS_EMPTY_KEY;
    }
}

// ticks.t[s] without an indexed read of the parameters (which would copy them to local
// memory in every thread).
__device__ __forceinline__ u64 hps_tick_of(const hps_ticks& ticks, int s) {
    u64 tick = 0;
#pragma unroll
    for (int i = 0; i < HPS_MAX_SHARDS; ++i)
        if (i == s) tick = ticks.t[i];
    return tick;
}
