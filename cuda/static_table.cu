// The static table: a whole embedding table on the GPU, built once, then read-only
// (rows may be overwritten in place by a refresh, keys never move).
//
// Open addressing over buckets of SET_SIZE slots with linear probing from bucket to
// bucket: a key lives in the first bucket, counting from hps_set_of(key, num_buckets), that
// had a free slot when it was inserted. Nothing is ever removed, so a lookup may stop at the
// first bucket that has an empty slot. Rows are stored in slot order (no indirection), so
// a hit costs one bucket read (64 B at SET_SIZE 8) and one row read; at the default load
// factor 0.8 a lookup reads 1.15 buckets on average.
//
// Layout: slot_keys int64 [num_buckets * SET_SIZE], vecs hps_row_t [(slots + 1) * ROW_STRIDE] (last
// row: the special slot of HPS_EMPTY_KEY), flags int32 [3]: special present, keys held,
// keys that found no slot (table full).
//
// The uvm table (cuda/uvm_table.cu) includes this file: its index is this layout, built,
// probed and dumped by these kernels, with the rows kept elsewhere.
#include "hps_common.cuh"

// Inserts keys (one lane group per key; its leader claims a slot with atomicCAS, the group
// copies the row). A key already present has its row overwritten; repeated keys in one
// batch leave one of their rows, unspecified which.
extern "C" __global__ void static_build(
    const hps_key* __restrict__ keys, const long long n, const float* __restrict__ src,
    const int src_vec4, hps_key* slot_keys, hps_row_t* vecs, const u32 num_buckets, int* flags) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const int leader = lane & ~(GROUP - 1);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    const long long special_slot = (long long)num_buckets * SET_SIZE;
    for (long long i = group; i < n; i += ngroups) {
        const hps_key key = keys[i];
        long long target = -1;
        if (gl == 0) {
            if (key == HPS_EMPTY_KEY) {
                target = special_slot;
                if (atomicExch(&flags[0], 1) == 0) atomicAdd(&flags[1], 1);
            } else {
                u32 b = hps_set_of(key, num_buckets);
                for (u32 p = 0; p < num_buckets && target < 0; ++p) {
                    volatile hps_key* bk = slot_keys + (u64)b * SET_SIZE;
                    for (int s = 0; s < SET_SIZE; ++s) {
                        const hps_key cur = bk[s];
                        if (cur == key) {
                            target = (long long)b * SET_SIZE + s;
                            break;
                        }
                        if (cur == HPS_EMPTY_KEY) {
                            const u64 old = atomicCAS((u64*)(slot_keys + (u64)b * SET_SIZE + s),
                                                      (u64)HPS_EMPTY_KEY, (u64)key);
                            if (old == (u64)HPS_EMPTY_KEY) atomicAdd(&flags[1], 1);
                            if (old == (u64)HPS_EMPTY_KEY || old == (u64)key) {
                                target = (long long)b * SET_SIZE + s;
                                break;
                            }
                        }
                    }
                    b = b + 1 == num_buckets ? 0 : b + 1;
                }
                if (target < 0) atomicAdd(&flags[2], 1);
            }
        }
        target = __shfl_sync(gmask, target, leader);
        if (target >= 0) hps_copy_in(vecs + target * ROW_STRIDE, src + i * DIM, gl, src_vec4 != 0);
    }
}

#ifndef PROBE_WINDOW
#error "PROBE_WINDOW must be passed by hps/gpu/kernels.py"
#endif

// Probes from bucket b on, PROBE_WINDOW buckets at a time (their loads in flight together);
// returns the slot of key or -1 (group-cooperative). A key never lies past a bucket that
// has an empty slot, so a window that shows one ends the search.
__device__ __forceinline__ long long static_probe(const hps_key* __restrict__ slot_keys,
                                                  u32 num_buckets, u32 b, hps_key key, int gl,
                                                  u32 gmask) {
    for (u32 p = 0; p < num_buckets; p += PROBE_WINDOW) {
        hps_key k[PROBE_WINDOW][KPL];
        u32 at[PROBE_WINDOW];
#pragma unroll
        for (int w = 0; w < PROBE_WINDOW; ++w) {
            at[w] = (b + w) % num_buckets;
            hps_load_index_keys(slot_keys + (u64)at[w] * SET_SIZE, gl, k[w]);
        }
#pragma unroll
        for (int w = 0; w < PROBE_WINDOW; ++w) {
            const int way = __reduce_max_sync(gmask, hps_match(k[w], key, gl));
            if (way >= 0) return (long long)at[w] * SET_SIZE + way;
            bool empty = false;
#pragma unroll
            for (int q = 0; q < KPL; ++q) empty |= k[w][q] == HPS_EMPTY_KEY;
            if (__any_sync(gmask, empty)) return -1;
        }
        b = (b + PROBE_WINDOW) % num_buckets;
    }
    return -1;
}

// The slots of one lane group's keys in one query round: keys[base + u * KPW + g] for
// u < UNROLL (g: the group's index in its warp). pos, key and slot of each (slot -1: not
// held; positions past n get key HPS_EMPTY_KEY and slot -1). Every lane of the warp must
// call it. Shared with the uvm table's query (cuda/uvm_table.cu includes this file).
__device__ __forceinline__ void static_find_slots(
    const hps_key* __restrict__ keys, const long long n, const long long base, const int g,
    const int gl, const u32 gmask, const hps_key* __restrict__ slot_keys,
    const u32 num_buckets, const bool special_present, long long (&pos)[UNROLL],
    hps_key (&key)[UNROLL], long long (&slot)[UNROLL]) {
    const long long special_slot = (long long)num_buckets * SET_SIZE;
    u32 bucket[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        pos[u] = base + u * KPW + g;
        key[u] = pos[u] < n ? keys[pos[u]] : HPS_EMPTY_KEY;
        bucket[u] = hps_set_of(key[u], num_buckets);
    }
#if PROBE_WINDOW > 1
    // small batches (latency): windows of buckets per step, one key at a time
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        slot[u] = -1;
        if (key[u] != HPS_EMPTY_KEY)
            slot[u] = static_probe(slot_keys, num_buckets, bucket[u], key[u], gl, gmask);
        else if (pos[u] < n && special_present)
            slot[u] = special_slot;
    }
#else
    // large batches (throughput): the first bucket of every key at once (loads in
    // flight together); the rarer longer probes continue one key at a time
    hps_key k[UNROLL][KPL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        if (key[u] != HPS_EMPTY_KEY) hps_load_index_keys(slot_keys + (u64)bucket[u] * SET_SIZE, gl, k[u]);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        slot[u] = -1;
        if (key[u] != HPS_EMPTY_KEY) {
            const int way = __reduce_max_sync(gmask, hps_match(k[u], key[u], gl));
            bool empty = false;
#pragma unroll
            for (int q = 0; q < KPL; ++q) empty |= k[u][q] == HPS_EMPTY_KEY;
            if (way >= 0) {
                slot[u] = (long long)bucket[u] * SET_SIZE + way;
            } else if (!__any_sync(gmask, empty)) {
                const u32 next = bucket[u] + 1 == num_buckets ? 0 : bucket[u] + 1;
                slot[u] = static_probe(slot_keys, num_buckets, next, key[u], gl, gmask);
            }
        } else if (pos[u] < n && special_present) {
            slot[u] = special_slot;
        }
    }
#endif
}

// The end of one query round: hits' rows (loaded into r) to out[pos]; misses filled with
// default_value and appended to the miss lists (SYSTEM: hps_record_misses'). Every lane of
// the warp must call it.
template <bool SYSTEM = false>
__device__ __forceinline__ void static_answer_round(
    const long long n, const long long (&pos)[UNROLL], const hps_key (&key)[UNROLL],
    const long long (&slot)[UNROLL], const hps_lane_row (&r)[UNROLL], const int gl,
    const int lane, hps_out_t* __restrict__ out, const bool vec4, int* __restrict__ ctl,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const float default_value) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const bool valid = pos[u] < n;
        if (valid) {
            hps_out_t* orow = out + pos[u] * DIM;
            if (slot[u] >= 0) hps_store_out(orow, gl, r[u], vec4);
            else hps_fill_out(orow, gl, default_value, vec4);
        }
        hps_record_misses<SYSTEM>(gl == 0 && valid && slot[u] < 0, pos[u], key[u], lane,
                                  ctl, miss_pos, miss_keys);
    }
}

// Same contract as cache_query of the dynamic cache, without stamps: hits copied to
// out[pos], misses filled with default_value and appended to the miss lists.
extern "C" __global__ void static_query(
    const hps_key* __restrict__ keys, const long long n, const hps_key* __restrict__ slot_keys,
    const hps_row_t* __restrict__ vecs, const u32 num_buckets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const float default_value) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const bool special_present = flags[0] != 0;

    for (long long base = warp * (KPW * UNROLL); base < n; base += nwarps * (KPW * UNROLL)) {
        long long pos[UNROLL];
        hps_key key[UNROLL];
        long long slot[UNROLL];
        static_find_slots(keys, n, base, g, gl, gmask, slot_keys, num_buckets, special_present,
                          pos, key, slot);
        hps_lane_row r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_load_row(vecs + slot[u] * ROW_STRIDE, gl, r[u]);
        static_answer_round(n, pos, key, slot, r, gl, lane, out, out_vec4 != 0, ctl, miss_pos,
                            miss_keys, default_value);
    }
    hps_finish_query(ctl, host_count);
}

// The probes past the first bucket of one round's keys whose first bucket was full and
// did not hold them (`more`), for the one pass: every such key of the warp reads its next
// PROBE_STEP buckets in the same step, all those loads in flight together, until each is
// found or meets an empty slot. static_probe is a lane group's own loop, and the groups
// of a warp that probe diverge, so a warp's probes ran one after another: over NVLink,
// where each step is a round trip, they were most of a small batch's time (two H200s,
// 2,000 keys all of the peer's shard: 21.8 us a kernel, 10.2 us with no probe past the
// first bucket, 8.7 us with every key the caller's; CUPTI times). Every lane of the warp
// must call it.
#ifndef PROBE_STEP
#define PROBE_STEP 4
#endif
__device__ __forceinline__ void static_probe_on(
    const hps_shard* __restrict__ shards, const int (&s)[UNROLL],
    const hps_key (&key)[UNROLL], const u32 (&first)[UNROLL], bool (&more)[UNROLL],
    const int gl, const u32 gmask, long long (&slot)[UNROLL]) {
    u32 at[UNROLL], probed[UNROLL];
    bool any = false;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        at[u] = first[u];
        probed[u] = 1;
        any |= more[u];
    }
    while (__any_sync(0xffffffffu, any)) {
        hps_key k[UNROLL][PROBE_STEP][KPL];
        u32 b[UNROLL][PROBE_STEP];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (!more[u]) continue;
            const u32 num_buckets = (u32)shards[s[u]].num_sets;
#pragma unroll
            for (int w = 0; w < PROBE_STEP; ++w) {
                b[u][w] = (u32)(((u64)at[u] + 1 + w) % num_buckets);
                hps_load_index_keys(shards[s[u]].slot_keys + (u64)b[u][w] * SET_SIZE, gl,
                                    k[u][w]);
            }
        }
        any = false;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (!more[u]) continue;
#pragma unroll
            for (int w = 0; w < PROBE_STEP; ++w) {
                if (!more[u]) continue;
                const int way = __reduce_max_sync(gmask, hps_match(k[u][w], key[u], gl));
                bool empty = false;
#pragma unroll
                for (int q = 0; q < KPL; ++q) empty |= k[u][w][q] == HPS_EMPTY_KEY;
                if (way >= 0) {
                    slot[u] = (long long)b[u][w] * SET_SIZE + way;
                    more[u] = false;
                } else if (__any_sync(gmask, empty)) {
                    more[u] = false;  // a key never lies past a bucket with an empty slot
                }
            }
            at[u] = b[u][PROBE_STEP - 1];
            probed[u] += PROBE_STEP;
            if (probed[u] >= (u32)shards[s[u]].num_sets) more[u] = false;  // every bucket
            any |= more[u];
        }
    }
}

// The keys of one lane group in the round at `base` of static_query_sharded (`now`: read
// a round before, see there), with each key's shard (hps_sharded_round_keys), after the
// probe of the launching device's entry `num_shards` (hps/gpu/hot_rows.py) where `hot`,
// one bucket read on this device:
// - a hot copy (it has rows): the caller's device's copy of its peers' hottest rows. A key
//   of a remote shard found in it is read from it (its shard becomes `num_shards`, its
//   slot the copy's); one not found is read where it lives if its shard is `mine`, else
//   left to the launch that serves its shard (a pushed query's peer).
// - a mirror (no rows): a peer's copy of the caller's copy's index, in a pushed query's
//   launch on that peer. A key of `mine` found in it is left to the caller's launch, which
//   reads it from its copy.
// Keys outside `mine` and not asked of a copy get pos n and key HPS_EMPTY_KEY. The copy
// and its mirrors are built so that a key lies in its first bucket or counts as absent
// (one past it is read from its owner: the caller's launch and the peer's agree, both
// reading the first bucket alone), so one read is the whole probe. No sets: no probe.
__device__ __forceinline__ void static_load_round(const hps_key* __restrict__ keys,
                                                  const long long n, const long long base,
                                                  const int g, hps_key (&next)[UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const long long at = base + u * KPW + g;
        next[u] = at < n ? keys[at] : HPS_EMPTY_KEY;
    }
}
__device__ __forceinline__ void static_round_keys(
    const hps_key (&now)[UNROLL], const long long n, const long long base, const int g,
    const hps_shard* __restrict__ shards, const long long num_shards, const u32 mine,
    const bool hot, const int gl, const u32 gmask, long long (&pos)[UNROLL],
    hps_key (&key)[UNROLL], int (&s)[UNROLL], long long (&slot)[UNROLL]) {
    const u32 sets = hot ? (u32)shards[num_shards].num_sets : 0u;
    const bool copy = shards[num_shards].vecs != nullptr;
    const hps_key* __restrict__ hot_keys = shards[num_shards].slot_keys;
    hps_key k[UNROLL][KPL];
    u32 bucket[UNROLL];
    bool ask[UNROLL], in_mine[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        pos[u] = base + u * KPW + g;
        key[u] = now[u];
        s[u] = hps_shard_of(key[u], num_shards);
        in_mine[u] = ((mine >> s[u]) & 1u) != 0u;
        ask[u] = sets != 0 && key[u] != HPS_EMPTY_KEY &&
                 (copy ? shards[s[u]].remote != 0 : in_mine[u]);
        if (!in_mine[u] && !ask[u]) pos[u] = n, key[u] = HPS_EMPTY_KEY;
        if (ask[u]) {
            bucket[u] = hps_set_of(key[u], sets);
            hps_load_index_keys(hot_keys + (u64)bucket[u] * SET_SIZE, gl, k[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        if (!ask[u]) continue;
        const int way = __reduce_max_sync(gmask, hps_match(k[u], key[u], gl));
        if (way >= 0 && copy) {
            slot[u] = (long long)bucket[u] * SET_SIZE + way;
            s[u] = (int)num_shards;
        } else if (way >= 0 || !in_mine[u]) {
            pos[u] = n, key[u] = HPS_EMPTY_KEY;
        }
    }
}

// static_query of a sharded table in one pass (cache_query_sharded in
// cuda/embedding_cache.cu says how, `mine` and `blocks` included), without stamps: UNROLL
// keys per lane group and round, each of its own shard, every key's first bucket read at
// once (static_find_slots' large-batch probe); a key of a shard outside `mine` is read
// and left to the launch that serves it.
//
// Batches of up to PROBE_AHEAD_KEYS keys (latency-bound: each step over NVLink is a round
// trip) also read each key's second bucket in the first step: buckets of 8 slots fill
// often enough that a 2,000-key batch nearly always had a key past its first, and the
// kernel waited for that key's second round trip (two H200s: 14.0 us all remote against
// 9.1 local and 7.7 on one GPU, after static_probe_on). Larger batches are bandwidth-
// bound and skip it (64 more bytes a key), and they alone read the hot copy: a small
// batch waits for its slowest key, which the copy does not make faster, and its probe is
// one more step before the link (2,000 power-law keys, two H200s: 0.89 of one GPU with
// it, 0.94 without).
//
// Large batches take a build of their own (hps/gpu/sharded_query.py LARGE_BUILD): no second
// bucket read ahead (PROBE_AHEAD_KEYS 0) and one bucket a probe step (PROBE_STEP 1), which
// leaves 94 registers, and 3 blocks an SM (80 registers: 32 bytes spilled). Two H200s, 1M
// keys, pushed with hot copies: in 120 registers and 2 blocks an SM the caller's launch ran
// 195 us against the whole table's 144 on one GPU, with nearly every row it served local
// (CUPTI); with this build the bench's power-law row went from 0.74 to 0.94 of the link
// bound, uniform from 0.78 to 0.84 (`hps bench gpu --profile sharded`, two calls).
//
// Each warp reads its next round's keys before it works on this one's, so their load (a
// round trip over the link in a pushed query's peer launch: the keys are the caller's)
// is in flight during the round rather than first in its chain of dependent loads.
#ifndef PROBE_AHEAD_KEYS
#define PROBE_AHEAD_KEYS 65536
#endif
#ifndef SHARDED_MIN_BLOCKS
#define SHARDED_MIN_BLOCKS 1
#endif
extern "C" __global__ void __launch_bounds__(256, SHARDED_MIN_BLOCKS) static_query_sharded(
    const hps_shard* __restrict__ shards, const long long num_shards, const hps_ticks ticks,
    const hps_key* __restrict__ keys, const long long n, hps_out_t* __restrict__ out,
    const int out_vec4, int* __restrict__ ctl, int* host_count, int* __restrict__ miss_pos,
    hps_key* __restrict__ miss_keys, const float default_value, const u32 mine,
    const u32 blocks) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    // small batches read each key's second bucket with its first (PROBE_AHEAD_KEYS)
    const bool ahead = PROBE_AHEAD_KEYS > 0 && n <= PROBE_AHEAD_KEYS;

    const long long stride = nwarps * (KPW * UNROLL);
    hps_key next[UNROLL];
    static_load_round(keys, n, warp * (KPW * UNROLL), g, next);
    for (long long base = warp * (KPW * UNROLL); base < n; base += stride) {
        long long pos[UNROLL], slot[UNROLL];
        hps_key key[UNROLL], now[UNROLL];
        int s[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) now[u] = next[u];
        static_load_round(keys, n, base + stride, g, next);
        static_round_keys(now, n, base, g, shards, num_shards, mine, !ahead, gl, gmask, pos,
                          key, s, slot);
        u32 bucket[UNROLL];
        hps_key k[UNROLL][KPL], next[UNROLL][KPL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 num_buckets = (u32)shards[s[u]].num_sets;
            bucket[u] = hps_set_of(key[u], num_buckets);
            if (key[u] != HPS_EMPTY_KEY && s[u] != (int)num_shards) {
                hps_load_index_keys(shards[s[u]].slot_keys + (u64)bucket[u] * SET_SIZE, gl, k[u]);
                if (ahead)
                    hps_load_index_keys(
                        shards[s[u]].slot_keys + (u64)((bucket[u] + 1) % num_buckets) * SET_SIZE,
                        gl, next[u]);
            }
        }
        bool more[UNROLL];  // the buckets read were full and did not hold the key
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            more[u] = false;
            if (s[u] == (int)num_shards) continue;  // the hot copy's (its slot found)
            slot[u] = -1;
            if (key[u] != HPS_EMPTY_KEY) {
                int way = __reduce_max_sync(gmask, hps_match(k[u], key[u], gl));
                bool empty = false;
#pragma unroll
                for (int q = 0; q < KPL; ++q) empty |= k[u][q] == HPS_EMPTY_KEY;
                if (way >= 0) {
                    slot[u] = (long long)bucket[u] * SET_SIZE + way;
                } else if (!__any_sync(gmask, empty)) {  // full: the key may lie past it
                    more[u] = true;
                    if (ahead) {  // the next bucket, read in the same step
                        bucket[u] = (bucket[u] + 1) % (u32)shards[s[u]].num_sets;
                        way = __reduce_max_sync(gmask, hps_match(next[u], key[u], gl));
                        empty = false;
#pragma unroll
                        for (int q = 0; q < KPL; ++q) empty |= next[u][q] == HPS_EMPTY_KEY;
                        if (way >= 0) slot[u] = (long long)bucket[u] * SET_SIZE + way;
                        more[u] = way < 0 && !__any_sync(gmask, empty);
                    }
                }
            } else if (pos[u] < n && shards[s[u]].flags[0] != 0) {
                slot[u] = shards[s[u]].num_sets * SET_SIZE;
            }
        }
        static_probe_on(shards, s, key, bucket, more, gl, gmask, slot);
        hps_lane_row r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_load_row(shards[s[u]].vecs + slot[u] * ROW_STRIDE, gl, r[u]);
        static_answer_round<true>(n, pos, key, slot, r, gl, lane, out, out_vec4 != 0, ctl,
                                  miss_pos, miss_keys, default_value);
    }
    hps_finish_query_of<true>(ctl, host_count, blocks);
}

// static_query software-pipelined (hps_pipelined_rounds), for large batches into 16-bit
// outputs: every warp loops over the batch (a grid of one wave, sized by occupancy in
// hps/gpu/device_table.py) and issues the row reads of one round before it probes the
// next. In static_query a warp has rows in flight only after its probe, and 256-byte rows
// in and out left too few bytes in flight to keep the memory busy (H100, 1M keys at dim
// 128: 59% of DRAM bandwidth, occupancy 3 blocks an SM by registers). At most 51
// registers (5 blocks of 256 an SM). Kernel time on the H100, 1M keys at dim 128, float16
// rows into float16 outputs: 226 against 254-262 us, bfloat16 227-230 against 240-243
// (scripts/query_time_breakdown.py); into float32 outputs it gained nothing (323-329
// against 316), nor for float32 rows (417-424 against 408), so those keep static_query.
extern "C" __global__ void __launch_bounds__(256, 5) static_query_pipelined(
    const hps_key* __restrict__ keys, const long long n, const hps_key* __restrict__ slot_keys,
    const hps_row_t* __restrict__ vecs, const u32 num_buckets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const float default_value) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const bool special_present = flags[0] != 0;
    hps_pipelined_rounds(
        n, vecs, gl,
        [&](long long base, long long (&pos)[UNROLL], hps_key (&key)[UNROLL],
            long long (&slot)[UNROLL]) {
            static_find_slots(keys, n, base, g, gl, gmask, slot_keys, num_buckets,
                              special_present, pos, key, slot);
        },
        [&](const long long (&pos)[UNROLL], const hps_key (&key)[UNROLL],
            const long long (&slot)[UNROLL], const hps_lane_row (&r)[UNROLL]) {
            static_answer_round(n, pos, key, slot, r, gl, lane, out, out_vec4 != 0, ctl,
                                miss_pos, miss_keys, default_value);
        });
    hps_finish_query(ctl, host_count);
}

// The slot of a key (the special slot for HPS_EMPTY_KEY when present), or -1.
__device__ __forceinline__ long long static_slot_of(const hps_key key,
                                                    const hps_key* __restrict__ slot_keys,
                                                    const u32 num_buckets,
                                                    const int* __restrict__ flags, int gl,
                                                    u32 gmask) {
    if (key == HPS_EMPTY_KEY) return flags[0] != 0 ? (long long)num_buckets * SET_SIZE : -1;
    return static_probe(slot_keys, num_buckets, hps_set_of(key, num_buckets), key, gl, gmask);
}

// Overwrites the rows of present keys (refresh); absent keys are skipped.
extern "C" __global__ void static_update(
    const hps_key* __restrict__ keys, const long long n, const float* __restrict__ src,
    const int src_vec4, const hps_key* __restrict__ slot_keys, hps_row_t* __restrict__ vecs,
    const u32 num_buckets, const int* __restrict__ flags, int* __restrict__ updated) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    for (long long i = group; i < n; i += ngroups) {
        const long long slot = static_slot_of(keys[i], slot_keys, num_buckets, flags, gl, gmask);
        if (slot < 0) continue;
        hps_copy_in(vecs + slot * ROW_STRIDE, src + i * DIM, gl, src_vec4 != 0);
        if (gl == 0) atomicAdd(updated, 1);
    }
}

// Keys held in buckets [start, stop), order unspecified; count[0] receives how many.
extern "C" __global__ void static_dump(
    const hps_key* __restrict__ slot_keys, const u32 num_buckets, const u32 start,
    const u32 stop, const int* __restrict__ flags, int* __restrict__ count,
    hps_key* __restrict__ out) {
    hps_dump_slots(slot_keys, (long long)start * SET_SIZE, (long long)stop * SET_SIZE, count, out);
    if (blockIdx.x == 0 && threadIdx.x == 0 && flags[0] != 0) {
        const u32 s = hps_set_of(HPS_EMPTY_KEY, num_buckets);
        if (s >= start && s < stop) out[atomicAdd(count, 1)] = HPS_EMPTY_KEY;
    }
}
