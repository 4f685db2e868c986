// The dynamic GPU embedding cache: set-associative, least-recently-used eviction inside a set.
//
// Layout (one cache, `num_sets` sets of SET_SIZE slots, slot s = set * SET_SIZE + way):
//   slot_keys  int64 [num_sets * SET_SIZE]          HPS_EMPTY_KEY where free; a set's keys are
//                                                  contiguous (SET_SIZE 8 = 64 B = two sectors)
//   stamps     uint64 [num_sets * SET_SIZE]         tick << RANK_BITS | rank of the slot's
//                                                  last query hit (rank 0) or insert
//   vecs       hps_row_t [(num_sets * SET_SIZE + 1) * ROW_STRIDE]  rows in STORAGE (hps_common.cuh); the last is
//                                                  the special slot of the key HPS_EMPTY_KEY
//   flags      int32 [2]                            [0] special slot present, [1] keys held
// A key's set is hps_set_of(key, num_sets). A group of GROUP lanes serves one key: it reads
// the set's keys (KPL per lane, 16-byte loads), agrees on the matching way with a group
// reduction, then copies the row with 16-byte (float32 rows) or smaller loads spread over its
// lanes, widening compact rows in registers.
//
// Mutating kernels (insert, update, remove) and queries never run at the same time:
// hps/gpu/device_table.py orders them with CUDA events. Queries only write stamps, so concurrent
// queries are harmless to each other.
#include "hps_common.cuh"

#ifndef STAMP_SHIFT
#error "STAMP_SHIFT must be passed by hps/gpu/kernels.py"
#endif
#define HPS_RANK_MAX ((1LL << RANK_BITS) - 1)

// The slots of one lane group's keys in one query round: keys[base + u * KPW + g] for
// u < UNROLL (g: the group's index in its warp). pos, key and slot of each (slot -1: not
// held; positions past n get key HPS_EMPTY_KEY and slot -1). Every lane of the warp must
// call it.
__device__ __forceinline__ void cache_find_slots(
    const hps_key* __restrict__ keys, const long long n, const long long base, const int g,
    const int gl, const u32 gmask, const hps_key* __restrict__ slot_keys, const u32 num_sets,
    const bool special_present, long long (&pos)[UNROLL], hps_key (&key)[UNROLL],
    long long (&slot)[UNROLL]) {
    u32 set[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        pos[u] = base + u * KPW + g;
        key[u] = pos[u] < n ? keys[pos[u]] : HPS_EMPTY_KEY;
        set[u] = hps_set_of(key[u], num_sets);
    }
    hps_key k[UNROLL][KPL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        if (key[u] != HPS_EMPTY_KEY) hps_load_index_keys(slot_keys + (u64)set[u] * SET_SIZE, gl, k[u]);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        int way = key[u] != HPS_EMPTY_KEY ? hps_match(k[u], key[u], gl) : -1;
        way = __reduce_max_sync(gmask, way);
        slot[u] = way >= 0 ? (long long)set[u] * SET_SIZE + way : -1;
        if (key[u] == HPS_EMPTY_KEY && pos[u] < n && special_present)
            slot[u] = (long long)num_sets * SET_SIZE;
    }
}

// A hit's LRU stamp, by lane 0 of its group: `tick` into its slot (never the special slot,
// which is in no set); with STAMP_SHIFT s > 0 only one hit in 2^s, those whose
// hps_murmur3_fmix64(key ^ tick) has its low s bits zero (sampled LRU).
__device__ __forceinline__ void cache_stamp_hit(u64* __restrict__ stamps, const long long slot,
                                                const long long special_slot, const hps_key key,
                                                const u64 tick, const int gl) {
    bool stamp = gl == 0 && slot != special_slot;
#if STAMP_SHIFT > 0
    stamp = stamp && (hps_murmur3_fmix64((u64)key ^ tick) & ((1ULL << STAMP_SHIFT) - 1)) == 0;
#endif
    if (stamp) stamps[slot] = tick;
}

// The end of one query round: hits' rows (loaded into r) to out[pos], their slots stamped;
// misses filled with default_value and appended to the miss lists. Every lane of the warp
// must call it.
__device__ __forceinline__ void cache_answer_round(
    const long long n, const long long (&pos)[UNROLL], const hps_key (&key)[UNROLL],
    const long long (&slot)[UNROLL], const hps_lane_row (&r)[UNROLL], const int gl,
    const int lane, const long long special_slot, u64* __restrict__ stamps,
    hps_out_t* __restrict__ out, const bool vec4, int* __restrict__ ctl,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys, const u64 tick,
    const float default_value) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const bool valid = pos[u] < n;
        if (valid) {
            hps_out_t* orow = out + pos[u] * DIM;
            if (slot[u] >= 0) {
                hps_store_out(orow, gl, r[u], vec4);
                cache_stamp_hit(stamps, slot[u], special_slot, key[u], tick, gl);
            } else {
                hps_fill_out(orow, gl, default_value, vec4);
            }
        }
        hps_record_misses(gl == 0 && valid && slot[u] < 0, pos[u], key[u], lane, ctl,
                          miss_pos, miss_keys);
    }
}

// Hits: the row is copied to out[pos] and the slot stamped with `tick` (the query's tick
// shifted left by RANK_BITS); with STAMP_SHIFT s > 0, only hits whose
// hps_murmur3_fmix64(key ^ tick) has its low s bits zero are stamped (sampled LRU: 1 in 2^s).
// Misses: out[pos] gets default_value and (pos, key) is appended to the miss lists.
// ctl/host_count: see hps_finish_query.
extern "C" __global__ void cache_query(
    const hps_key* __restrict__ keys, const long long n,
    const hps_key* __restrict__ slot_keys, u64* __restrict__ stamps,
    const hps_row_t* __restrict__ vecs, const u32 num_sets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys,
    const u64 tick, const float default_value) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long special_slot = (long long)num_sets * SET_SIZE;
    const bool special_present = flags[0] != 0;

    // warp-uniform loop: every lane runs every round, so warp-wide ballots are legal
    for (long long base = warp * (KPW * UNROLL); base < n; base += nwarps * (KPW * UNROLL)) {
        long long pos[UNROLL];
        hps_key key[UNROLL];
        long long slot[UNROLL];
        cache_find_slots(keys, n, base, g, gl, gmask, slot_keys, num_sets, special_present,
                         pos, key, slot);
        hps_lane_row r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_load_row(vecs + slot[u] * ROW_STRIDE, gl, r[u]);
        cache_answer_round(n, pos, key, slot, r, gl, lane, special_slot, stamps, out,
                           out_vec4 != 0, ctl, miss_pos, miss_keys, tick, default_value);
    }
    hps_finish_query(ctl, host_count);
}

// cache_query of a sharded table (gpu_sharding row_wise) in one pass: each key's shard by
// its hash, that shard's set probed and its row read where it lives, hits stamped with that
// shard's tick; misses and the count as cache_query. It serves the keys of the shards in
// `mine` (bit s: shard s) alone, so one query runs it two ways (hps/gpu/sharded_query.py):
// once on the caller's device for every shard, reading peers' sets and rows over NVLink
// (pull), or once on each device for the shards it holds, reading its own memory and
// writing the rows into the caller's output over NVLink (push: no remote reads but the
// keys', and writes need no round trip). The launches of one query share ctl, the miss
// lists and the count: `blocks` is their blocks in all. UNROLL keys per lane group and
// round, each of its own shard.
extern "C" __global__ void cache_query_sharded(
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
    const bool vec4 = out_vec4 != 0;

    // warp-uniform loop: every lane runs every round, so warp-wide ballots are legal
    for (long long base = warp * (KPW * UNROLL); base < n; base += nwarps * (KPW * UNROLL)) {
        long long pos[UNROLL], slot[UNROLL];
        hps_key key[UNROLL];
        int s[UNROLL];
        hps_sharded_round_keys(keys, n, base, g, num_shards, mine, pos, key, s);
        u32 set[UNROLL];
        hps_key k[UNROLL][KPL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            set[u] = hps_set_of(key[u], (u32)shards[s[u]].num_sets);
            if (key[u] != HPS_EMPTY_KEY)
                hps_load_index_keys(shards[s[u]].slot_keys + (u64)set[u] * SET_SIZE, gl, k[u]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int way = key[u] != HPS_EMPTY_KEY ? hps_match(k[u], key[u], gl) : -1;
            way = __reduce_max_sync(gmask, way);
            slot[u] = way >= 0 ? (long long)set[u] * SET_SIZE + way : -1;
            if (key[u] == HPS_EMPTY_KEY && pos[u] < n && shards[s[u]].flags[0] != 0)
                slot[u] = shards[s[u]].num_sets * SET_SIZE;
        }
        hps_lane_row r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (slot[u] >= 0) hps_load_row(shards[s[u]].vecs + slot[u] * ROW_STRIDE, gl, r[u]);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const bool valid = pos[u] < n;
            if (valid) {
                hps_out_t* orow = out + pos[u] * DIM;
                if (slot[u] >= 0) {
                    hps_store_out(orow, gl, r[u], vec4);
                    cache_stamp_hit(shards[s[u]].stamps, slot[u],
                                    shards[s[u]].num_sets * SET_SIZE, key[u],
                                    hps_tick_of(ticks, s[u]), gl);
                } else {
                    hps_fill_out(orow, gl, default_value, vec4);
                }
            }
            hps_record_misses<true>(gl == 0 && valid && slot[u] < 0, pos[u], key[u], lane, ctl,
                                    miss_pos, miss_keys);
        }
    }
    hps_finish_query_of<true>(ctl, host_count, blocks);
}

// cache_query software-pipelined (hps_pipelined_rounds), for large batches into 16-bit
// outputs of short rows, in a grid of one wave (static_query_pipelined in
// cuda/static_table.cu says why). At most 51 registers (5 blocks of 256 an SM).
extern "C" __global__ void __launch_bounds__(256, 5) cache_query_pipelined(
    const hps_key* __restrict__ keys, const long long n,
    const hps_key* __restrict__ slot_keys, u64* __restrict__ stamps,
    const hps_row_t* __restrict__ vecs, const u32 num_sets, const int* __restrict__ flags,
    hps_out_t* __restrict__ out, const int out_vec4, int* __restrict__ ctl, int* host_count,
    int* __restrict__ miss_pos, hps_key* __restrict__ miss_keys,
    const u64 tick, const float default_value) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const int g = lane / GROUP;
    const u32 gmask = hps_group_mask(lane);
    const long long special_slot = (long long)num_sets * SET_SIZE;
    const bool special_present = flags[0] != 0;
    hps_pipelined_rounds(
        n, vecs, gl,
        [&](long long base, long long (&pos)[UNROLL], hps_key (&key)[UNROLL],
            long long (&slot)[UNROLL]) {
            cache_find_slots(keys, n, base, g, gl, gmask, slot_keys, num_sets, special_present,
                             pos, key, slot);
        },
        [&](const long long (&pos)[UNROLL], const hps_key (&key)[UNROLL],
            const long long (&slot)[UNROLL], const hps_lane_row (&r)[UNROLL]) {
            cache_answer_round(n, pos, key, slot, r, gl, lane, special_slot, stamps, out,
                               out_vec4 != 0, ctl, miss_pos, miss_keys, tick, default_value);
        });
    hps_finish_query(ctl, host_count);
}

// codes[i] = set(keys[i]) << 32 | i, for a sort that groups an insert batch by set while
// keeping batch order inside a set.
extern "C" __global__ void cache_set_codes(const hps_key* __restrict__ keys, const long long n,
                                           const u32 num_sets, u64* __restrict__ codes) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        codes[i] = ((u64)hps_set_of(keys[i], num_sets) << 32) | (u64)i;
}

// Inserts the batch whose sorted set codes are `codes`. The group that owns the first code
// of a set inserts all of that set's keys in batch order, so no two groups touch one set
// and no lock is needed. Per key: a present key is overwritten in place; else the first
// empty way is taken; else the way with the smallest stamp (the lowest way on ties) is
// evicted. The r-th key of a set in the batch is stamped tick | r (`tick` comes shifted
// left by RANK_BITS), so a batch that overflows a set evicts its own earliest keys.
// Run by blocks [block, blocks) of a grid (cache_insert: all of them). `at`: where this
// batch starts in a larger one whose parts the same groups insert one after another
// (cache_insert_sharded): key i is taken by the group of (at + i) modulo the groups, so
// the parts of the larger batch go to different groups and run side by side, not each
// group inserting one key of every part in turn (0 for a batch of its own).
__device__ __forceinline__ void cache_insert_blocks(
    const u32 block, const u32 blocks,
    const u64* __restrict__ codes, const long long n, const hps_key* __restrict__ keys,
    const float* __restrict__ src, const int src_vec4,
    hps_key* slot_keys, u64* stamps, hps_row_t* vecs, const u32 num_sets, int* flags, const u64 tick,
    const long long at = 0) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const long long group = ((long long)block * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)blocks * blockDim.x) / GROUP;
    const long long special_slot = (long long)num_sets * SET_SIZE;
    const bool vec4 = src_vec4 != 0;

    for (long long i = ((group - at) % ngroups + ngroups) % ngroups; i < n; i += ngroups) {
        const u32 set = (u32)(codes[i] >> 32);
        if (i > 0 && (u32)(codes[i - 1] >> 32) == set) continue;  // not the first of its set
        for (long long j = i; j < n; ++j) {
            const u64 code = codes[j];
            if ((u32)(code >> 32) != set) break;
            const long long p = (long long)(code & 0xffffffffULL);
            const hps_key key = keys[p];
            long long target;
            bool fresh = false;
            if (key == HPS_EMPTY_KEY) {
                target = special_slot;
                if (gl == 0 && atomicExch(&flags[0], 1) == 0) atomicAdd(&flags[1], 1);
            } else {
                const u64 first = (u64)set * SET_SIZE;
                hps_key k[KPL];
                hps_load_set_keys(slot_keys + first, gl, k);
                const int present = __reduce_max_sync(gmask, hps_match(k, key, gl));
                if (present >= 0) {
                    target = (long long)first + present;
                } else {
                    int empty = SET_SIZE;
#pragma unroll
                    for (int q = KPL - 1; q >= 0; --q)
                        if (k[q] == HPS_EMPTY_KEY) empty = gl * KPL + q;
                    empty = __reduce_min_sync(gmask, empty);
                    if (empty < SET_SIZE) {
                        target = (long long)first + empty;
                        fresh = true;
                    } else {
                        // least recently used: smallest stamp, lowest way among equals
                        u64 best = ~0ULL;
                        int best_way = SET_SIZE;
#pragma unroll
                        for (int q = 0; q < KPL; ++q) {
                            const u64 st = stamps[first + gl * KPL + q];
                            if (st < best) {
                                best = st;
                                best_way = gl * KPL + q;
                            }
                        }
                        u64 least = best;
#pragma unroll
                        for (int off = GROUP / 2; off > 0; off >>= 1) {
                            const u64 o = __shfl_xor_sync(gmask, least, off);
                            least = o < least ? o : least;
                        }
                        const int way = __reduce_min_sync(gmask, best == least ? best_way : SET_SIZE);
                        target = (long long)first + way;
                    }
                }
            }
            hps_copy_in(vecs + target * ROW_STRIDE, src + p * DIM, gl, vec4);
            if (gl == 0 && key != HPS_EMPTY_KEY) {
                slot_keys[target] = key;
                stamps[target] = tick | (u64)(j - i < HPS_RANK_MAX ? j - i : HPS_RANK_MAX);
                if (fresh) atomicAdd(&flags[1], 1);
            }
            __syncwarp(gmask);  // the next key of this set reads what this one wrote
        }
    }
}

extern "C" __global__ void cache_insert(
    const u64* __restrict__ codes, const long long n, const hps_key* __restrict__ keys,
    const float* __restrict__ src, const int src_vec4,
    hps_key* slot_keys, u64* stamps, hps_row_t* vecs, const u32 num_sets, int* flags, const u64 tick) {
    cache_insert_blocks(blockIdx.x, gridDim.x, codes, n, keys, src, src_vec4, slot_keys, stamps,
                        vecs, num_sets, flags, tick);
}

// The miss path's last step in one launch: blocks below `insert_blocks` insert the fetched
// rows (cache_insert), the others scatter them into the lookup's output (scatter_rows:
// out[pos[j]] = src[inv[j]] for j < count). Both only read `src`.
extern "C" __global__ void cache_insert_scatter(
    const u64* __restrict__ codes, const long long n, const hps_key* __restrict__ keys,
    const float* __restrict__ src, const int src_vec4,
    hps_key* slot_keys, u64* stamps, hps_row_t* vecs, const u32 num_sets, int* flags, const u64 tick,
    const u32 insert_blocks, const int* __restrict__ pos, const int* __restrict__ inv,
    const long long count, hps_out_t* __restrict__ out, const int out_vec4) {
    if (blockIdx.x < insert_blocks)
        cache_insert_blocks(blockIdx.x, insert_blocks, codes, n, keys, src, src_vec4, slot_keys,
                            stamps, vecs, num_sets, flags, tick);
    else
        hps_scatter_rows(blockIdx.x - insert_blocks, gridDim.x - insert_blocks, pos, inv, count,
                         src, out, out_vec4);
}

// Where each shard's group of a sharded miss batch starts (cache_insert_sharded), by value.
struct hps_starts {
    long long at[HPS_MAX_SHARDS + 1];
};

// A sharded table's miss path in one launch (hps/gpu/sharded_misses.py): the staged batch
// is grouped by shard (group s at [starts.at[s], starts.at[s + 1]), its set codes sorted
// within the group, positions relative to its start); blocks below `insert_blocks` insert
// every group into its own shard as cache_insert does (one lane group a set: the shards'
// memory is disjoint, so the groups need no order between them), a peer's shard over
// NVLink, each with its shard's tick; the other blocks scatter the rows into the lookup's
// output, as cache_insert_scatter's do. A key's lane group is by its place in the whole
// batch (`at`), so the shards' groups are inserted side by side: each from the first
// lane group, a lane group inserted one key into every shard in turn, a chain of round
// trips over the link each (4 H200s, a quarter cached, 2,000 keys with 120-155 misses,
// CUPTI: 14.0 us against one GPU's 3.3; by place, 8.4-9.0 us).
extern "C" __global__ void cache_insert_sharded(
    const hps_shard* __restrict__ shards, const long long num_shards, const hps_ticks ticks,
    const hps_starts starts, const u64* __restrict__ codes, const hps_key* __restrict__ keys,
    const float* __restrict__ src, const int src_vec4, const u32 insert_blocks,
    const int* __restrict__ pos, const int* __restrict__ inv, const long long count,
    hps_out_t* __restrict__ out, const int out_vec4) {
    if (blockIdx.x >= insert_blocks) {
        hps_scatter_rows(blockIdx.x - insert_blocks, gridDim.x - insert_blocks, pos, inv, count,
                         src, out, out_vec4);
        return;
    }
#pragma unroll
    for (int s = 0; s < HPS_MAX_SHARDS; ++s) {  // unrolled: no indexed read of the parameters
        if (s >= num_shards) break;
        const long long a = starts.at[s], b = starts.at[s + 1];
        if (a == b) continue;
        const hps_shard shard = shards[s];
        cache_insert_blocks(blockIdx.x, insert_blocks, codes + a, b - a, keys + a,
                            src + a * DIM, src_vec4, const_cast<hps_key*>(shard.slot_keys),
                            shard.stamps, const_cast<hps_row_t*>(shard.vecs),
                            (u32)shard.num_sets, const_cast<int*>(shard.flags), ticks.t[s], a);
    }
}

// Finds the slot of `key` (group-cooperative), -1 when absent.
__device__ __forceinline__ long long cache_find(const hps_key* slot_keys, u32 num_sets, hps_key key,
                                                bool special_present, int gl, u32 gmask) {
    if (key == HPS_EMPTY_KEY) return special_present ? (long long)num_sets * SET_SIZE : -1;
    const u32 set = hps_set_of(key, num_sets);
    hps_key k[KPL];
    hps_load_set_keys(slot_keys + (u64)set * SET_SIZE, gl, k);
    const int way = __reduce_max_sync(gmask, hps_match(k, key, gl));
    return way >= 0 ? (long long)set * SET_SIZE + way : -1;
}

// Overwrites the rows of present keys; absent keys are skipped. Stamps are left alone.
// `updated` counts the keys found.
extern "C" __global__ void cache_update(
    const hps_key* __restrict__ keys, const long long n, const float* __restrict__ src,
    const int src_vec4, const hps_key* __restrict__ slot_keys, hps_row_t* __restrict__ vecs,
    const u32 num_sets, const int* __restrict__ flags, int* __restrict__ updated) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    const bool special_present = flags[0] != 0;
    for (long long i = group; i < n; i += ngroups) {
        const long long slot = cache_find(slot_keys, num_sets, keys[i], special_present, gl, gmask);
        if (slot < 0) continue;
        hps_copy_in(vecs + slot * ROW_STRIDE, src + i * DIM, gl, src_vec4 != 0);
        if (gl == 0) atomicAdd(updated, 1);
    }
}

// Frees the slots of present keys (repeated keys are freed once).
extern "C" __global__ void cache_remove(
    const hps_key* __restrict__ keys, const long long n, hps_key* slot_keys, u64* stamps,
    const u32 num_sets, int* flags) {
    const int lane = threadIdx.x & 31;
    const int gl = lane & (GROUP - 1);
    const u32 gmask = hps_group_mask(lane);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
    const long long ngroups = ((long long)gridDim.x * blockDim.x) / GROUP;
    for (long long i = group; i < n; i += ngroups) {
        const hps_key key = keys[i];
        if (key == HPS_EMPTY_KEY) {
            if (gl == 0 && atomicExch(&flags[0], 0) == 1) atomicSub(&flags[1], 1);
            continue;
        }
        const long long slot = cache_find(slot_keys, num_sets, key, false, gl, gmask);
        if (slot >= 0 && gl == 0) {
            const u64 old = atomicCAS(reinterpret_cast<u64*>(slot_keys + slot), (u64)key,
                                      (u64)HPS_EMPTY_KEY);
            if (old == (u64)key) {
                stamps[slot] = 0ULL;
                atomicSub(&flags[1], 1);
            }
        }
    }
}

// Keys held in sets [start_set, stop_set), order unspecified; count[0] receives how many.
extern "C" __global__ void cache_dump(
    const hps_key* __restrict__ slot_keys, const u32 num_sets, const u32 start_set,
    const u32 stop_set, const int* __restrict__ flags, int* __restrict__ count,
    hps_key* __restrict__ out) {
    hps_dump_slots(slot_keys, (long long)start_set * SET_SIZE, (long long)stop_set * SET_SIZE,
                   count, out);
    if (blockIdx.x == 0 && threadIdx.x == 0 && flags[0] != 0) {
        const u32 s = hps_set_of(HPS_EMPTY_KEY, num_sets);
        if (s >= start_set && s < stop_set) out[atomicAdd(count, 1)] = HPS_EMPTY_KEY;
    }
}
