// The uvm table: the static table's index of every key in GPU memory (its kernels are
// included below and build, probe and dump this table too), each key's row in two places:
//
//   host_vecs  hps_row_t [(slots + 1) * ROW_STRIDE] in pinned, device-mapped host memory: every
//              key's row at its slot (the static table's layout, the special slot last);
//              the query kernel reads it directly over the bus, no host thread involved
//   gpu_row    u32 [slots + 1] (every LINKth u32): the GPU row holding a copy of slot s's
//              row, or NO_ROW
//   hits       u32 [slots + 1] (every LINKth u32, beside gpu_row): accesses since the last
//              promotion pass (halved by each pass), counted up to HITS_CAP: a counter at
//              the cap is only read, so the hottest keys do not serialise a batch on
//              same-address atomics
//   gpu_vecs   hps_row_t [gpu_rows * ROW_STRIDE] in GPU memory: copies of the hottest rows
//   owner      u32 [gpu_rows]: the slot whose row a GPU row holds, or NO_ROW
//
// gpu_row and hits of a slot share one 8-byte pair (the kernels take pointers to the
// pair's first and second u32): a query reads and counts both, so a key costs one random
// access to them instead of two. On an H100 a 1M-key uniform batch's query over 20M keys
// took 314-325 µs this way, 383-389 µs with separate arrays
// (scripts/uvm_batch_breakdown.py).
//
// A key's host row is always current (updates write both places), so a demotion only
// unlinks the GPU copy. A move runs in steps on the table's stream, ordered by
// hps/gpu/uvm_table.py: uvm_demote unlinks rows (queries issued after it wait for it);
// once the queries that may still read those rows are done, uvm_fill copies the promoted
// keys' host rows into them and then uvm_publish links them. A query therefore reads
// gpu_row as NO_ROW (the host row) or as a row already filled, which holds the same values:
// every query is exact while rows move. A grouped query may also promote the rows it read
// itself (uvm_promote_read_rows, below), alone on the device.
#include "static_table.cu"

// Index of slot s in gpu_row and in hits (u32 pairs: see above).
#define LINK(s) ((u64)(s) * 2u)

#ifndef HITS_CAP
#error "HITS_CAP must be passed by hps/gpu/uvm_table.py (through hps/gpu/kernels.py)"
#endif

#define NO_ROW 0xffffffffu

// Random reads of host rows over a large table are bound by address translation, not by
// the bus: on an H100 1M reads of 256-byte rows spread over 5.3 GiB ran at 0.18 of the
// pinned copy bandwidth, over 543 MiB (or the first 543 MiB of the same allocation) at
// 0.92, and the same 5.3 GiB read in address order at 0.90 (with 128 MiB allocations or
// transparent huge pages alike: scripts/uvm_host_reads_probe.py). So a large batch reads
// its host rows grouped by REGION of host memory (HierarchicalKV's hybrid find likewise
// sorts its value addresses before reading them): uvm_query_grouped serves GPU rows and
// misses and notes, at each batch position, the slot whose host row it defers (NO_ROW for
// the others) with a count per region; uvm_region_scan turns the counts into each region's
// place in the order; uvm_region_scatter puts the deferred rows in that order; uvm_gather
// reads the rows in it and publishes the miss count. Within a region the order is
// arbitrary: a 2 MiB region read in any order ran as fast as sorted rows. The notes are
// kept by position rather than appended to a list: an append takes its place from one
// counter that every warp of the batch contends for (the query took 402-418 µs with the
// list, 383-389 without, in the measurement below).

// static_query's contract (hits copied to out[pos], misses filled with default_value and
// appended to the miss lists), each row read from GPU memory when it has a copy there,
// else from the mapped host memory: at once (a batch below grouped_reads_from, whose
// latency counts more than the bus), or (GROUPED) noted in by_pos for uvm_gather, which
// then publishes the miss count instead.
//
// Every access is counted in hits: the slot's GPU row link and hit count come in one
// 8-byte load, and the group leader adds one when the count it read is below the cap (no
// second read of the count before the atomic). Accesses that run at once may each see a
// count below the cap, so a count can pass it by a few.
template <bool GROUPED>
__device__ __forceinline__ void uvm_query_rows(
    const hps_key* __restrict__ keys, const long long n, const hps_key* __restrict__ slot_keys,
    const hps_row_t* __restrict__ host_vecs, const u32 num_buckets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const float default_value,
    const u32* __restrict__ gpu_row, const hps_row_t* __restrict__ gpu_vecs, u32* hits,
    u32* __restrict__ by_pos, u32* region_count, const int region_shift) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const bool special_present = flags[0] != 0;
    const bool vec4 = out_vec4 != 0;

    for (long long base = warp * (KPW * UNROLL); base < n; base += nwarps * (KPW * UNROLL)) {
        long long pos[UNROLL];
        hps_key key[UNROLL];
        long long slot[UNROLL];
        static_find_slots(keys, n, base, g, gl, gmask, slot_keys, num_buckets, special_present,
                          pos, key, slot);
        const hps_row_t* row[UNROLL];
        bool deferred[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            row[u] = nullptr;
            deferred[u] = false;
            if (slot[u] >= 0) {
                // the GPU row link and, beside it, the hit count (see above)
                const uint2 link = *reinterpret_cast<const uint2*>(gpu_row + LINK(slot[u]));
                const u32 at = link.x;
                if (at != NO_ROW) row[u] = gpu_vecs + (u64)at * ROW_STRIDE;
                else if (GROUPED) deferred[u] = true;
                else row[u] = host_vecs + slot[u] * ROW_STRIDE;
                if (gl == 0 && link.y < (u32)HITS_CAP) atomicAdd(hits + LINK(slot[u]), 1u);
            }
        }
        hps_lane_row r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (row[u] != nullptr) hps_load_row(row[u], gl, r[u]);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const bool valid = pos[u] < n;
            if (valid) {
                hps_out_t* orow = out + pos[u] * DIM;
                if (row[u] != nullptr) hps_store_out(orow, gl, r[u], vec4);
                else if (!deferred[u]) hps_fill_out(orow, gl, default_value, vec4);
            }
            hps_record_misses(gl == 0 && valid && slot[u] < 0, pos[u], key[u], lane, ctl,
                              miss_pos, miss_keys);
            if (GROUPED && gl == 0 && valid) {
                by_pos[pos[u]] = deferred[u] ? (u32)slot[u] : NO_ROW;
                if (deferred[u]) atomicAdd(region_count + ((u32)slot[u] >> region_shift), 1u);
            }
        }
    }
    if (!GROUPED) hps_finish_query(ctl, host_count);
}

// The query of batches below grouped_reads_from: host rows read at once.
extern "C" __global__ void uvm_query(
    const hps_key* __restrict__ keys, const long long n, const hps_key* __restrict__ slot_keys,
    const hps_row_t* __restrict__ host_vecs, const u32 num_buckets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const float default_value,
    const u32* __restrict__ gpu_row, const hps_row_t* __restrict__ gpu_vecs, u32* hits) {
    uvm_query_rows<false>(keys, n, slot_keys, host_vecs, num_buckets, flags, out, out_vec4, ctl,
                          host_count, miss_pos, miss_keys, default_value, gpu_row, gpu_vecs, hits,
                          nullptr, nullptr, 0);
}

// Step 1 of a grouped query (see above): by_pos [n], region_count all 0.
extern "C" __global__ void uvm_query_grouped(
    const hps_key* __restrict__ keys, const long long n, const hps_key* __restrict__ slot_keys,
    const hps_row_t* __restrict__ host_vecs, const u32 num_buckets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const float default_value,
    const u32* __restrict__ gpu_row, const hps_row_t* __restrict__ gpu_vecs, u32* hits,
    u32* __restrict__ by_pos, u32* region_count, const int region_shift) {
    uvm_query_rows<true>(keys, n, slot_keys, host_vecs, num_buckets, flags, out, out_vec4, ctl,
                         host_count, miss_pos, miss_keys, default_value, gpu_row, gpu_vecs, hits,
                         by_pos, region_count, region_shift);
}

// Step 2, one block of 1024 threads: region_start[b] = the deferred rows of regions before
// b, listed[0] = all of them (listed[1] = 0); region_count is zeroed, ready for the next
// query. Each thread scans a run of consecutive regions.
extern "C" __global__ void uvm_region_scan(u32* __restrict__ region_count,
                                           u32* __restrict__ region_start, const u32 regions,
                                           u32* __restrict__ listed) {
    __shared__ u32 sums[1024];
    const u32 t = threadIdx.x;
    const u32 per = (regions + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(t * per, regions), hi = min(lo + per, regions);
    u32 own = 0;
    for (u32 b = lo; b < hi; ++b) own += region_count[b];
    sums[t] = own;
    __syncthreads();
    for (u32 off = 1; off < blockDim.x; off <<= 1) {  // inclusive scan of the runs' sums
        const u32 add = t >= off ? sums[t - off] : 0u;
        __syncthreads();
        sums[t] += add;
        __syncthreads();
    }
    u32 start = sums[t] - own;
    for (u32 b = lo; b < hi; ++b) {
        const u32 c = region_count[b];
        region_start[b] = start;
        start += c;
        region_count[b] = 0;
    }
    if (t == blockDim.x - 1) {
        listed[0] = sums[t];
        listed[1] = 0;  // uvm_promote_read_rows' claims
    }
}

// Step 3: each deferred row to the next place of its region.
extern "C" __global__ void uvm_region_scatter(const long long n, const u32* __restrict__ by_pos,
                                              u32* __restrict__ region_start,
                                              const int region_shift,
                                              u32* __restrict__ order_slot,
                                              u32* __restrict__ order_pos) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const u32 slot = by_pos[i];
        if (slot == NO_ROW) continue;
        const u32 at = atomicAdd(region_start + (slot >> region_shift), 1u);
        order_slot[at] = slot;
        order_pos[at] = (u32)i;
    }
}

// Step 4: one lane group per deferred row, in region order: the host row into out[pos]; then
// the miss count is published (hps_finish_query), so the caller sees it after every row, or
// (publish 0) by the promotion queued after this kernel.
extern "C" __global__ void uvm_gather(const u32* __restrict__ listed,
                                      const u32* __restrict__ order_slot,
                                      const u32* __restrict__ order_pos,
                                      const hps_row_t* __restrict__ host_vecs,
                                      hps_out_t* __restrict__ out, const int out_vec4,
                                      int* __restrict__ ctl, int* host_count,
                                      const int publish) {
    const int gl = threadIdx.x & (GROUP - 1);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    const long long m = listed[0];
    for (long long i = group; i < m; i += ngroups) {
        hps_lane_row r;
        hps_load_row(host_vecs + (long long)order_slot[i] * ROW_STRIDE, gl, r);
        hps_store_out(out + (long long)order_pos[i] * DIM, gl, r, out_vec4 != 0);
    }
    if (publish) hps_finish_query(ctl, host_count);  // else the promotion after it does
}

// Overwrites the rows of present keys in both places (refresh, updates); absent keys are
// skipped.
extern "C" __global__ void uvm_update(
    const hps_key* __restrict__ keys, const long long n, const float* __restrict__ src,
    const int src_vec4, const hps_key* __restrict__ slot_keys, hps_row_t* __restrict__ host_vecs,
    const u32 num_buckets, const int* __restrict__ flags, int* __restrict__ updated,
    const u32* __restrict__ gpu_row, hps_row_t* __restrict__ gpu_vecs) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    for (long long i = group; i < n; i += ngroups) {
        const long long slot = static_slot_of(keys[i], slot_keys, num_buckets, flags, gl, gmask);
        if (slot < 0) continue;
        hps_copy_in(host_vecs + slot * ROW_STRIDE, src + i * DIM, gl, src_vec4 != 0);
        const u32 at = gpu_row[LINK(slot)];
        if (at != NO_ROW) hps_copy_in(gpu_vecs + (u64)at * ROW_STRIDE, src + i * DIM, gl, src_vec4 != 0);
        if (gl == 0) atomicAdd(updated, 1);
    }
}

// Copies one host row into a GPU row (a lane group's share of it).
__device__ __forceinline__ void uvm_copy_row(hps_row_t* __restrict__ dst,
                                             const hps_row_t* __restrict__ src, int gl) {
#pragma unroll
    for (int v = 0; v < UPL; ++v) {
        const int c = gl + v * GROUP;
        if (c < ROW_STRIDE) dst[c] = src[c];
    }
}

// Initial placement, after static_build wrote keys[0, n) and their host rows: key i takes
// GPU row first_row + i when that row exists and is free and the key has no GPU row yet;
// a key that has one gets its copy rewritten from the host row (a key built again). Rows
// left unclaimed (repeated keys) stay free for the promotion passes.
extern "C" __global__ void uvm_place(
    const hps_key* __restrict__ keys, const long long n, const long long first_row,
    const u32 gpu_rows, const hps_key* __restrict__ slot_keys,
    const hps_row_t* __restrict__ host_vecs, const u32 num_buckets, const int* __restrict__ flags,
    u32* __restrict__ gpu_row, hps_row_t* __restrict__ gpu_vecs, u32* __restrict__ owner) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const int leader = lane & ~(GROUP - 1);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    for (long long i = group; i < n; i += ngroups) {
        const long long slot = static_slot_of(keys[i], slot_keys, num_buckets, flags, gl, gmask);
        if (slot < 0) continue;
        u32 target = NO_ROW;
        if (gl == 0) {
            target = gpu_row[LINK(slot)];
            const long long row = first_row + i;
            if (target == NO_ROW && row < (long long)gpu_rows &&
                atomicCAS(owner + row, NO_ROW, (u32)slot) == NO_ROW) {  // the row was free
                const u32 old = atomicCAS(gpu_row + LINK(slot), NO_ROW, (u32)row);
                target = old == NO_ROW ? (u32)row : old;
                if (old != NO_ROW) owner[row] = NO_ROW;  // a repeat of the key took one
            }
        }
        target = __shfl_sync(gmask, target, leader);
        if (target != NO_ROW)
            uvm_copy_row(gpu_vecs + (u64)target * ROW_STRIDE, host_vecs + slot * ROW_STRIDE, gl);
    }
}

// Step 1 of a move: the slots lose their GPU rows (queries read their host rows).
extern "C" __global__ void uvm_demote(const long long* __restrict__ slots, const long long m,
                                      u32* __restrict__ gpu_row) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x)
        gpu_row[LINK(slots[i])] = NO_ROW;
}

// Step 2: copies the host rows of slots[i] into GPU rows rows[i] (free or unlinked by
// step 1, and read by no query in flight). One thread per row unit (hps_row_t).
extern "C" __global__ void uvm_fill(const long long* __restrict__ slots,
                                    const long long* __restrict__ rows, const long long m,
                                    const hps_row_t* __restrict__ host_vecs,
                                    hps_row_t* __restrict__ gpu_vecs) {
    const long long total = m * ROW_STRIDE;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long i = t / ROW_STRIDE;
        const int c = (int)(t - i * ROW_STRIDE);
        gpu_vecs[rows[i] * ROW_STRIDE + c] = host_vecs[slots[i] * ROW_STRIDE + c];
    }
}

// Step 3 (a kernel of its own, so every filled row is visible before it is linked).
extern "C" __global__ void uvm_publish(const long long* __restrict__ slots,
                                       const long long* __restrict__ rows, const long long m,
                                       u32* __restrict__ gpu_row, u32* __restrict__ owner) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x) {
        gpu_row[LINK(slots[i])] = (u32)rows[i];
        owner[rows[i]] = (u32)slots[i];
    }
}

// Promotion on the lookup path (hps/gpu/uvm_table.py says when it runs): after a grouped
// query of n keys that read at most n / 2 rows from host memory (skewed traffic: a uniform
// batch reads most of its rows there, and promoting some of them costs it more reads of
// host memory than it saves the next batch), the host rows the batch read for keys with
// min_hits accesses or more take GPU rows at once, so the next batch reads them from GPU
// memory; at most `budget` of them, counted in listed[1] (zeroed by uvm_region_scan). One
// warp per entry of the region order:
//   1. the entry's slot is claimed (gpu_row NO_ROW -> CLAIMED), so a key repeated in the
//      batch is promoted once, and counted (a claim past the budget is dropped);
//   2. its victim is the GPU row with the fewest hits (a free row first; ties: the lower
//      lane) in a window of 32 consecutive rows at the clock hand, which moves 32 rows a
//      claim: with budget * 32 <= gpu_rows no two warps of a launch share a row, so the
//      rows need no locks;
//   3. a key with more hits than its victim's key takes the row: the victim's slot is
//      unlinked, the host row copied in and the key's slot linked to it; otherwise the
//      claim is dropped.
// No query or write runs beside this kernel (hps/gpu/uvm_table.py orders them after it),
// so none sees CLAIMED or a half-copied row, and the host row it copies is current.
// clock: [0] the hand, [1] the rows promoted so far.
//
// The copy's source: where the output holds the stored row bit for bit (float32 rows
// written as float32) and from_out is set, the row uvm_gather just wrote to out[order_pos]
// in GPU memory; else the host row again, a second random read over the bus per promoted
// row (a 1M-key batch may promote 31K rows, 8 MB read at the sparse rate).
#define CLAIMED 0xfffffffeu
#if STORAGE == HPS_F32 && OUT_TYPE == HPS_F32
#define HPS_PROMOTE_FROM_OUT 1
#else
#define HPS_PROMOTE_FROM_OUT 0
#endif

extern "C" __global__ void uvm_promote_read_rows(
    u32* listed, const long long n, const u32* __restrict__ order_slot, const u32 budget,
    const u32 min_hits, const hps_row_t* __restrict__ host_vecs, u32* gpu_row, u32* hits,
    hps_row_t* __restrict__ gpu_vecs, u32* __restrict__ owner, const u32 gpu_rows,
    unsigned long long* __restrict__ clock, const u32* __restrict__ order_pos,
    const hps_out_t* __restrict__ out, const int from_out, int* __restrict__ ctl,
    int* host_count) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long m = listed[0];
    const long long todo = m * 2 <= n ? m : 0;  // none where over half the batch read host rows
    const volatile u32* claims = listed + 1;
    for (long long i = warp; i < todo; i += nwarps) {  // warp-uniform
        const u32 slot = order_slot[i];
        const u32 h = hits[LINK(slot)];
        int step = 0;  // lane 0 decides: 0 skip the entry, 1 promote it, 2 the budget is spent
        if (lane == 0) {
            if (*claims >= budget) {
                step = 2;
            } else if (h >= min_hits &&
                       atomicCAS(gpu_row + LINK(slot), NO_ROW, CLAIMED) == NO_ROW) {
                step = atomicAdd(listed + 1, 1u) < budget ? 1 : 2;
                if (step == 2) gpu_row[LINK(slot)] = NO_ROW;
            }
        }
        step = __shfl_sync(full, step, 0);
        if (step == 2) break;
        if (step == 0) continue;
        unsigned long long hand = 0;
        if (lane == 0) hand = atomicAdd(clock, 32ull);
        hand = __shfl_sync(full, hand, 0);
        const u32 row = (u32)((hand + (unsigned long long)lane) % gpu_rows);
        const u32 held_by = owner[row];
        // victim hits + 1 (0: a free row), then the lane: the smallest wins
        unsigned long long best =
            ((held_by == NO_ROW ? 0ull : (unsigned long long)hits[LINK(held_by)] + 1ull) << 5) |
            (unsigned long long)lane;
        for (int off = 16; off > 0; off >>= 1) best = min(best, __shfl_xor_sync(full, best, off));
        const int at = (int)(best & 31ull);
        const u32 target = __shfl_sync(full, row, at);
        const u32 victim = __shfl_sync(full, held_by, at);
        if ((unsigned long long)h + 1ull > (best >> 5)) {  // more hits than the victim's key
            if (lane == 0 && victim != NO_ROW) gpu_row[LINK(victim)] = NO_ROW;
            hps_row_t* dst = gpu_vecs + (u64)target * ROW_STRIDE;
#if HPS_PROMOTE_FROM_OUT
            if (from_out) {
                const float* src = out + (u64)order_pos[i] * DIM;
                for (int c = lane; c < ROW_STRIDE; c += 32) {
                    float4 v;  // zero past DIM, as stored rows are padded
                    v.x = src[4 * c];
                    v.y = 4 * c + 1 < DIM ? src[4 * c + 1] : 0.f;
                    v.z = 4 * c + 2 < DIM ? src[4 * c + 2] : 0.f;
                    v.w = 4 * c + 3 < DIM ? src[4 * c + 3] : 0.f;
                    dst[c] = v;
                }
            } else
#endif
            {
                for (int c = lane; c < ROW_STRIDE; c += 32)
                    dst[c] = host_vecs[(u64)slot * ROW_STRIDE + c];
            }
            if (lane == 0) {
                owner[target] = slot;
                gpu_row[LINK(slot)] = target;
                atomicAdd(clock + 1, 1ull);
            }
        } else if (lane == 0) {
            gpu_row[LINK(slot)] = NO_ROW;
        }
    }
    // the grouped query's miss count, published here rather than by uvm_gather: a caller
    // that sees it may overwrite its output at once, and this kernel may read the output
    hps_finish_query(ctl, host_count);
}

// Sets the access counts of held keys (placement by known counts, e.g. a model's `meta`
// access counts, before the first promotion pass); absent keys are skipped.
extern "C" __global__ void uvm_seed_hits(
    const hps_key* __restrict__ keys, const u32* __restrict__ counts, const long long n,
    const hps_key* __restrict__ slot_keys, const u32 num_buckets, const int* __restrict__ flags,
    u32* __restrict__ hits) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    for (long long i = group; i < n; i += ngroups) {
        const long long slot = static_slot_of(keys[i], slot_keys, num_buckets, flags, gl, gmask);
        if (slot >= 0 && gl == 0) hits[LINK(slot)] = counts[i];
    }
}
