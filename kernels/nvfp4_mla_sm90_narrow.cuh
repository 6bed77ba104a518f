// The Hopper decode kernel's NARROW build (HEAD_TILE 16): its one consumer warpgroup, with the 16
// heads as wgmma's N (docs/kernels/decode_sm90.md).
#pragma once

#include "nvfp4_mla_sm90_consumer.cuh"

// A thread's fragment of S^T (64 tokens x 16 heads) or of one m-block of O^T (64 dims x 16 heads)
// is rows 16 w + g and 16 w + g + 8 of warp w by heads 8 j + 2 quad + {0, 1}: element 4 j + e is
// row 16 w + g + 8 (e >> 1) and head 8 j + 2 quad + (e & 1). The thread's 4 heads are its columns
// c = 2 j + (e & 1).
__device__ __forceinline__ int column_head(int c, int quad) { return 8 * (c >> 1) + 2 * quad + (c & 1); }

// Issues S^T = K.Q^T of a tile (32 k-steps of 16 dims: K's k-step is 2 groups of 8 dims further,
// Q's 32 bytes into the rows of slab k / 4) as one wgmma group.
__device__ __forceinline__ void issue_scores_t(float (&s)[8], u64 desc_k, u64 desc_q) {
    constexpr u64 QK_K_STEP = (2 * GROUP_STRIDE) >> 4;
    fence_registers(s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < QK_STEPS; ++k)  // k-step 0 overwrites s: only the wgmma writes S^T's registers
        wgmma_m64n16<0>(s, desc_k + k * QK_K_STEP, desc_q + (((k >> 2) * Q_SLAB + (k & 3) * 32) >> 4), k > 0);
    wgmma_commit();
}

// Every consumer thread: the max (MAX) or sum over the block's 64 rows of what each thread holds
// for its 4 heads, returned to every thread. Over a warp's rows by shuffles (every lane gets the
// same bits), then over the 4 warps through `exchange` (4 warps x 16 heads) in warp order.
template <bool MAX>
__device__ __forceinline__ void reduce_heads(float (&v)[4], float* exchange, int warp, int lane) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) {
            const float other = __shfl_xor_sync(NVFP4_FULL_MASK, v[c], x);
            v[c] = MAX ? fmaxf(v[c], other) : v[c] + other;
        }
    const int quad = lane & 3;
    if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
            *reinterpret_cast<float2*>(exchange + warp * HT + 8 * j + 2 * quad) = make_float2(v[2 * j], v[2 * j + 1]);
    }
    sync_consumers();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float2 t = *reinterpret_cast<const float2*>(exchange + 8 * j + 2 * quad);
#pragma unroll
        for (int w = 1; w < 4; ++w) {
            const float2 u = *reinterpret_cast<const float2*>(exchange + w * HT + 8 * j + 2 * quad);
            t = MAX ? make_float2(fmaxf(t.x, u.x), fmaxf(t.y, u.y)) : make_float2(t.x + u.x, t.y + u.y);
        }
        v[2 * j] = t.x;
        v[2 * j + 1] = t.y;
    }
}

// The item's outputs from O^T, staged in K/V buffer `held` as whole rows (a head's 512 dims: BF16
// times the head's factor for out (slot -1), the raw fp32 for the partial outputs at `slot`), chunk c of row h at
// ((c ^ h) & 7 | c & ~7) * 16 as copy_rows_out reads them, then copied out. A thread's dims 64 i + 16 warp + g + 8 r
// keep their swizzled place in every m-block i, which only moves them by a whole number of chunks: each (j, r)
// address is computed once, m-block i adds a constant, and the output type is chosen once, not at every store (run
// once a segment, this code is fetched cold: docs/performance.md#against-flashmla).
__device__ __forceinline__ void write_rows_narrow(const Params& p, const float (&o)[8 * DIM_BLOCKS], u8* smem, i64 row,
                                                  i64 head0, i64 slot, int held, int warp, int g, int quad,
                                                  const float (&factor)[4], int tid) {
    u8* const region = smem + SM_KV + held * KV_BYTES;
    if (slot >= 0) {  // fp32: dim d in chunk d / 4 = 16 i + 4 warp + 2 r + g / 4, at byte (d % 4) * 4 = (g % 4) * 4
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // heads h and h + 1
                const int h = column_head(2 * j, quad), chunk = 4 * warp + 2 * r + (g >> 2);
                const int at = (((chunk ^ h) & 7) | (chunk & 8)) * 16 + (g & 3) * 4;
                u8* const at_h = region + h * STAGED_ROW_BYTES<true> + at;
                u8* const at_h1 = region + (h + 1) * STAGED_ROW_BYTES<true> + (at ^ 16);
#pragma unroll
                for (int i = 0; i < DIM_BLOCKS; ++i) {  // m-block i: 16 i chunks further
                    *reinterpret_cast<float*>(at_h + 256 * i) = o[8 * i + 4 * j + 2 * r];
                    *reinterpret_cast<float*>(at_h1 + 256 * i) = o[8 * i + 4 * j + 2 * r + 1];
                }
            }
        copy_rows_out<true>(p, region, row, head0, slot, 0, tid);
        return;
    }
    // BF16: dim d in chunk d / 8 = 8 i + 2 warp + r, at byte (d % 8) * 2 = g * 2; torch's NaN in copy_rows_out
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int h = column_head(2 * j, quad), chunk = 2 * warp + r;
            const int at = ((chunk ^ h) & 7) * 16 + g * 2;
            u8* const at_h = region + h * STAGED_ROW + at;
            u8* const at_h1 = region + (h + 1) * STAGED_ROW + (at ^ 16);
#pragma unroll
            for (int i = 0; i < DIM_BLOCKS; ++i) {  // m-block i: 8 i chunks further
                const u32 pair = bf16x2_rn(o[8 * i + 4 * j + 2 * r] * factor[2 * j],
                                           o[8 * i + 4 * j + 2 * r + 1] * factor[2 * j + 1]);
                *reinterpret_cast<u16*>(at_h + 128 * i) = static_cast<u16>(pair);
                *reinterpret_cast<u16*>(at_h1 + 128 * i) = static_cast<u16>(pair >> 16);
            }
        }
    copy_rows_out<false>(p, region, row, head0, slot, 0, tid);
}

// NARROW, the consumer warpgroup, one item: per tile S^T, the online softmax of the 16 heads
// (their maxima over the block's 64 tokens through shared memory), P^T in shared memory and
// O^T += V^T.P^T over all 512 dims, then the item's outputs (the arguments as consume_item0's;
// `processed` counts the block's exchanges, whose parity picks the half of the exchange buffer).
__device__ __forceinline__ void consume_item_narrow(const Params& p, u8* smem, i64 row, i64 head0, i64 slot, int tile0,
                                                    int num_tiles, u32 ordinal, bool last, i64 next_row, u32& processed,
                                                    int tid) {
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, quad = lane & 3;
    const int token_lo = warp * 16 + g;  // the thread's rows of S^T: tokens token_lo and token_lo + 8
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const KvPipeline kv = {bars, 0u, reinterpret_cast<const u32*>(smem + SM_TILE_MASK)};
    float* const exchange = reinterpret_cast<float*>(smem + SM_EXCHANGE);
    u8* const sp = smem + SM_P;
    const float score_scale = static_cast<float>(p.score_scale);
    const u32 base = shared_address(smem);
    const u64 desc_q = swizzled_descriptor(base + SM_Q);                     // S^T's B: Q, K-major (dims contiguous)
    const u64 desc_k0 = matrix_descriptor(base + SM_KV, GROUP_STRIDE, 128);  // S^T's A: K, K-major
    const u64 desc_v0 = matrix_descriptor(base + SM_KV, 128, GROUP_STRIDE);  // O^T's A: V^T, MN-major (transposed A)
    const u64 desc_p = matrix_descriptor(base + SM_P, P_GROUP_STRIDE, 128);  // O^T's B: P, K-major (tokens contiguous)
    constexpr u64 KV_STEP = KV_BYTES >> 4, PV_K_STEP = (16 * 16) >> 4, P_K_STEP = (2 * P_GROUP_STRIDE) >> 4,
                  DIM_BLOCK_STEP = (8 * GROUP_STRIDE) >> 4;

    float o[8 * DIM_BLOCKS];  // O^T: m-block i (dims 64 i .. 64 i + 63) in o[8 i .. 8 i + 7]
#pragma unroll
    for (int i = 0; i < 8 * DIM_BLOCKS; ++i) o[i] = 0.0f;
    // The thread's 4 heads: the softmax base m (the same in every thread) and its own rows' share of
    // the sum l (added over the block at the end).
    float m[4], l[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) m[c] = neg_inf(), l[c] = 0.0f;
    const u32 bar_q = barrier_at(bars, BAR_Q);
    if (ordinal == 0 && tid == 0) issue_q(p, base + SM_Q, bar_q, row, head0);
    mbar_wait(bar_q, ordinal & 1);

    float s[8] = {};
    u64 live = 0;
    const int tile_end = tile0 + num_tiles, hold = tile_end - 1;
    int tile = kv.next_live(tile0, tile_end, hold, lane, live);
    if (tile < tile_end) {
        issue_scores_t(s, desc_k0 + buffer_of(tile) * KV_STEP, desc_q);
        wgmma_wait_all();
        fence_registers(s);
    }
    while (tile < tile_end) {
        const int b = buffer_of(tile);
        const bool live_lo = (live >> token_lo) & 1u, live_hi = (live >> (token_lo + 8)) & 1u;
        // The scaled scores in registers of their own: an instruction that writes s, which only the
        // wgmma defines, makes ptxas serialize every wgmma of the kernel (C7515).
        float x[8], tile_max[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int lo = 4 * (c >> 1) + (c & 1), hi = lo + 2;
            x[lo] = live_lo ? s[lo] * score_scale : neg_inf();
            x[hi] = live_hi ? s[hi] * score_scale : neg_inf();
            tile_max[c] = fmaxf(x[lo], x[hi]);
        }
        reduce_heads<true>(tile_max, exchange + (processed & 1) * 4 * HT, warp, lane);
        ++processed;
        float alpha[4], pr[8];
        bool moved = false;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int lo = 4 * (c >> 1) + (c & 1), hi = lo + 2;
            const bool move = base_moves(tile_max[c], m[c]);
            const float new_m = move ? tile_max[c] : m[c];
            const float base_c = softmax_base(new_m);
            alpha[c] = move ? exp2_approx(m[c] - base_c) : 1.0f;
            moved = moved || move;
            pr[lo] = exp2_approx(x[lo] - base_c);
            pr[hi] = exp2_approx(x[hi] - base_c);
            l[c] = l[c] * alpha[c] + (pr[lo] + pr[hi]);
            m[c] = new_m;
        }
        // P^T as O^T's B operand: (head h, token t) at (t / 8) * P_GROUP_STRIDE + h * 16 + (t % 8) * 2.
        // p is never NaN for finite or -inf scores: the plain conversion.
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int t = token_lo + 8 * r, h = column_head(2 * j, quad);
                const u32 pair = bf16x2_rn(pr[4 * j + 2 * r], pr[4 * j + 2 * r + 1]);  // heads h, h + 1
                u8* const at = sp + (t >> 3) * P_GROUP_STRIDE + h * 16 + (t & 7) * 2;
                *reinterpret_cast<u16*>(at) = static_cast<u16>(pair);
                *reinterpret_cast<u16*>(at + 16) = static_cast<u16>(pair >> 16);
            }
        if (__any_sync(NVFP4_FULL_MASK, moved)) {  // rare once the maxima settle
#pragma unroll
            for (int i = 0; i < 8 * DIM_BLOCKS; ++i) o[i] *= alpha[2 * ((i >> 2) & 1) + (i & 1)];
        }
        fence_proxy_async();
        sync_consumers();  // P^T is whole (every warp's wgmma reads all of it)
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k)
#pragma unroll
            for (int i = 0; i < DIM_BLOCKS; ++i)
                wgmma_m64n16<1>(o + 8 * i, desc_v0 + b * KV_STEP + i * DIM_BLOCK_STEP + k * PV_K_STEP,
                                desc_p + k * P_K_STEP, 1);
        wgmma_commit();

        // The next tile's S^T behind the O^T (tile + 1 only: its buffer is the other one).
        int next = tile + 1;
        u64 next_live = 0;
        if (next < tile_end) next_live = kv.acquire(next, lane);
        if (next_live != 0) {
            issue_scores_t(s, desc_k0 + buffer_of(next) * KV_STEP, desc_q);
            wgmma_wait<1>();  // O^T done (S^T may still run): this tile's buffer goes back to the producers now
        } else {
            wgmma_wait_all();
        }
        fence_registers(o);
        if (tile != hold) kv.release(b, lane);
        wgmma_wait_all();
        fence_registers(s);
        if (next < tile_end && next_live == 0) {  // nothing live in tile + 1: on to the next live tile, unpipelined
            if (next != hold) kv.release(buffer_of(next), lane);
            next = kv.next_live(next + 1, tile_end, hold, lane, next_live);
            if (next < tile_end) {
                issue_scores_t(s, desc_k0 + buffer_of(next) * KV_STEP, desc_q);
                wgmma_wait_all();
                fence_registers(s);
            }
        }
        tile = next;
        live = next_live;
    }

    // The heads' sums over the block (its barrier also means every S^T is done: Q is free).
    reduce_heads<false>(l, exchange + (processed & 1) * 4 * HT, warp, lane);
    ++processed;
    if (!last && tid == 0) issue_q(p, base + SM_Q, bar_q, next_row, head0);
    const i64 num_heads = p.num_heads;
    float factor[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const i64 head = head0 + column_head(c, quad);
        const float lse = row_lse(m[c], l[c]);
        factor[c] = slot < 0 && head < num_heads ? output_factor(l[c], lse, p.sinks, head) : 0.0f;
        if (tid >= 4 || head >= num_heads) continue;  // warp 0's lanes 0..3 write the heads' (m, l) or lse
        if (slot < 0)
            p.lse[row * num_heads + head] = lse;
        else
            reinterpret_cast<float2*>(p.partial_ml)[slot * num_heads + head] = make_float2(m[c], l[c]);
    }
    write_rows_narrow(p, o, smem, row, head0, slot, buffer_of(hold), warp, g, quad, factor, tid);
    kv.release_held(buffer_of(hold), lane);
}
