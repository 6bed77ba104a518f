// The Hopper decode kernel's two consumer warpgroups of the 64-head build: S = Q.K^T, the online
// softmax, O += P.V and the item's outputs (docs/kernels/decode_sm90.md).
#pragma once

#include "nvfp4_mla_sm90_epilogue.cuh"
#include "nvfp4_mla_sm90_pipeline.cuh"

// Scales a consumer's output rows g and g + 8 (its accumulators of the C fragment layout: rows
// g in elements 0, 1 of each 4, g + 8 in 2, 3) by their rescale factors (the softmax base moved).
__device__ __forceinline__ void rescale_rows(float (&o)[4 * O_BLOCKS], float alpha_lo, float alpha_hi) {
#pragma unroll
    for (int j = 0; j < O_BLOCKS; ++j) {
        o[4 * j + 0] *= alpha_lo;
        o[4 * j + 1] *= alpha_lo;
        o[4 * j + 2] *= alpha_hi;
        o[4 * j + 3] *= alpha_hi;
    }
}

// Issues k-steps K0 .. K1 - 1 (16 dims each) of S = Q.K^T of a tile as one wgmma group (from
// K0 = 0: S starts at zero). The whole S, or in the loop its first QK_EARLY k-steps and then the rest.
// Q's k-step k is 32 bytes into the rows of slab k / 4; K's is 2 groups of 8 dims further.
constexpr int QK_EARLY = 8;
template <int K0 = 0, int K1 = QK_STEPS>
__device__ __forceinline__ void issue_scores(float (&s)[4 * S_BLOCKS], u64 desc_q, u64 desc_k) {
    constexpr u64 QK_K_STEP = (2 * GROUP_STRIDE) >> 4;
    if constexpr (K0 == 0) {
#pragma unroll
        for (int i = 0; i < 4 * S_BLOCKS; ++i) s[i] = 0.0f;
    }
    fence_registers(s);
    wgmma_fence();
#pragma unroll
    for (int k = K0; k < K1; ++k)
        wgmma_m64n64<0>(s, desc_q + (((k >> 2) * Q_SLAB + (k & 3) * 32) >> 4), desc_k + k * QK_K_STEP, 1);
    wgmma_commit();
}

// Consumer 0's thread 0 loads the Q of an item's heads (64 heads from head0 of query row `row`)
// with 8 tensor copies, a slab of 64 dims each; heads past num_heads come as zero rows (outside
// the map). The next item's Q is issued as soon as both consumers' loops over this item's tiles are
// done (so are its S), so it lands under the item's outputs; wait_q waits for it before the item's
// first S.
__device__ __forceinline__ void issue_q(const Params& p, u32 smem_q, u32 bar_q, i64 row, i64 head0) {
    mbar_arrive_expect_bytes(bar_q, HT * HEAD_DIM * 2);
#pragma unroll
    for (int slab = 0; slab < HEAD_DIM / 64; ++slab)
        tensor_copy3(smem_q + slab * Q_SLAB, p.q_map, slab * 64, static_cast<int>(head0), static_cast<int>(row), bar_q);
}

// Consumer 0: the item's Q has landed (phase: the block's count of items before it, mod 2); then
// both consumers meet (consumer 1 passes the barrier at its item's start too).
__device__ __forceinline__ void wait_q(u32 bar_q, u32 phase) {
    mbar_wait(bar_q, phase);
    sync_consumers();
}

// Consumer 0, one segment (an item): S, the softmax, P, and O over the first half of the item's
// dims (0..255 of whole rows), then its half of the outputs: the row's out and lse (slot -1), or
// its partial outputs at `slot`.
// The item's tiles (at least one) are the block's tiles tile0 .. tile0 + num_tiles - 1 (their
// buffers and phases); the last one's buffer is held for the outputs. `processed` counts the
// block's tiles with a live token (the phases of P); `ordinal`: the block's items before this one
// (0: its Q is not issued yet); `last`: the block has no item after this one, else next_row is the
// next item's (its Q, of the same heads, is issued here).
__device__ __forceinline__ void consume_item0(const Params& p, u8* smem, i64 row, i64 head0, i64 slot, int part,
                                              int tile0, int num_tiles, u32 ordinal, bool last, i64 next_row,
                                              u32& processed, int tid, u32 peer_bars) {
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, quad = lane & 3;
    const int row_lo = warp * 16 + g, row_hi = row_lo + 8;  // the thread's rows of every fragment
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const KvPipeline kv = {bars, peer_bars, reinterpret_cast<const u32*>(smem + SM_TILE_MASK)};
    float* const alphas = reinterpret_cast<float*>(smem + SM_ALPHA);
    float* const factors = reinterpret_cast<float*>(smem + SM_FACTOR);
    u8* const sp = smem + SM_P;
    const float score_scale = static_cast<float>(p.score_scale);
    const u32 base = shared_address(smem);
    const u64 desc_q = swizzled_descriptor(base + SM_Q);
    const u64 desc_k0 = matrix_descriptor(base + SM_KV, GROUP_STRIDE, 128);
    const u64 desc_v0 = matrix_descriptor(base + SM_KV + part * (OUT_DIMS / 8) * GROUP_STRIDE, 128, GROUP_STRIDE);
    constexpr u64 KV_STEP = KV_BYTES >> 4, PV_K_STEP = (16 * 16) >> 4;

    float o[4 * O_BLOCKS];
#pragma unroll
    for (int i = 0; i < 4 * O_BLOCKS; ++i) o[i] = 0.0f;
    float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.0f, l_hi = 0.0f;
    const u32 bar_q = barrier_at(bars, BAR_Q);
    if (ordinal == 0 && tid == 0) issue_q(p, base + SM_Q, bar_q, row, head0);
    wait_q(bar_q, ordinal & 1);

    // The live tiles in order. A tile's S is issued right behind the previous tile's P.V, so the
    // tensor cores run both (and consumer 1's half of P.V) back to back.
    float s[4 * S_BLOCKS];
    u64 live = 0;
    const int tile_end = tile0 + num_tiles, hold = tile_end - 1;
    int tile = kv.next_live(tile0, tile_end, hold, lane, live);
    if (tile < tile_end) {
        issue_scores(s, desc_q, desc_k0 + buffer_of(tile) * KV_STEP);
        wgmma_wait_all();
        fence_registers(s);
    }
    while (tile < tile_end) {
        const int b = buffer_of(tile);

        // The online softmax of rows lo (elements 0, 1 of an n-block) and hi (2, 3); the quad's 4
        // lanes hold a row's 64 tokens, n-block j tokens 8 j + 2 quad + {0, 1}.
        const u64 mine = live >> (2 * quad);  // bit 8 j + e: token 8 j + 2 quad + e
#pragma unroll
        for (int j = 0; j < S_BLOCKS; ++j) {
            const bool live0 = (mine >> (8 * j)) & 1u, live1 = (mine >> (8 * j + 1)) & 1u;
            s[4 * j + 0] = live0 ? s[4 * j + 0] * score_scale : neg_inf();
            s[4 * j + 1] = live1 ? s[4 * j + 1] * score_scale : neg_inf();
            s[4 * j + 2] = live0 ? s[4 * j + 2] * score_scale : neg_inf();
            s[4 * j + 3] = live1 ? s[4 * j + 3] * score_scale : neg_inf();
        }
        float max_lo = fmaxf(s[0], s[1]), max_hi = fmaxf(s[2], s[3]);
#pragma unroll
        for (int j = 1; j < S_BLOCKS; ++j) {
            max_lo = fmaxf(max_lo, fmaxf(s[4 * j], s[4 * j + 1]));
            max_hi = fmaxf(max_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        quad_max(max_lo, max_hi);
        const bool move_lo = base_moves(max_lo, m_lo), move_hi = base_moves(max_hi, m_hi);
        const float new_lo = move_lo ? max_lo : m_lo, new_hi = move_hi ? max_hi : m_hi;
        const float base_lo = softmax_base(new_lo), base_hi = softmax_base(new_hi);
        u32 pa[PV_STEPS][4];  // P as the A operands of the P.V k-steps (tokens 16 k .. 16 k + 15)
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < S_BLOCKS; ++j) {
            const float p0 = exp2_approx(s[4 * j + 0] - base_lo), p1 = exp2_approx(s[4 * j + 1] - base_lo);
            const float p2 = exp2_approx(s[4 * j + 2] - base_hi), p3 = exp2_approx(s[4 * j + 3] - base_hi);
            sum_lo += p0 + p1;
            sum_hi += p2 + p3;
            // p is never NaN for finite or -inf scores: the plain conversion.
            pa[j / 2][(j & 1) * 2] = bf16x2_rn(p0, p1);      // row lo, tokens 8 j + 2 quad + {0, 1}
            pa[j / 2][(j & 1) * 2 + 1] = bf16x2_rn(p2, p3);  // row hi
        }
        quad_sum(sum_lo, sum_hi);
        const float alpha_lo = move_lo ? exp2_approx(m_lo - base_lo) : 1.0f;
        const float alpha_hi = move_hi ? exp2_approx(m_hi - base_hi) : 1.0f;
        m_lo = new_lo;
        m_hi = new_hi;
        l_lo = l_lo * alpha_lo + sum_lo;
        l_hi = l_hi * alpha_hi + sum_hi;

        // Consumer 1's copy of P: the P.V wgmma reads pa until it completes, and PTX forbids touching
        // a running wgmma's registers, so P is stored for consumer 1 from this copy while it runs.
        u32 pc[PV_STEPS][4];
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("mov.b32 %0, %1;" : "=r"(pc[k][i]) : "r"(pa[k][i]));

        // O += P.V, issued before P is handed over: the tensor cores start on it without
        // waiting for consumer 1 to be done with the last P, nor for P's stores. The rescale first
        // (rare once the max settles).
        if (__any_sync(NVFP4_FULL_MASK, move_lo || move_hi)) rescale_rows(o, alpha_lo, alpha_hi);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k) wgmma_pv_rs<HALF_DIMS>(o, pa[k], desc_v0 + b * KV_STEP + k * PV_K_STEP);
        wgmma_commit();

        // P and the rescale factors for consumer 1 (once it is done with the last ones).
        mbar_wait(barrier_at(bars, BAR_P_EMPTY), (processed & 1) ^ 1);
#pragma unroll
        for (int j = 0; j < S_BLOCKS; ++j) {
            u8* const at = sp + j * P_GROUP_STRIDE + quad * 4;
            *reinterpret_cast<u32*>(at + row_lo * 16) = pc[j / 2][(j & 1) * 2];
            *reinterpret_cast<u32*>(at + row_hi * 16) = pc[j / 2][(j & 1) * 2 + 1];
        }
        if (quad == 0) {
            alphas[row_lo] = alpha_lo;
            alphas[row_hi] = alpha_hi;
        }
        fence_proxy_async();
        mbar_arrive(barrier_at(bars, BAR_P_FULL));

        // The next tile's S behind the P.V: only tile + 1, whose buffer is the other one (tile + 2
        // would wait for this tile's buffer). Its first k-steps queue behind the P.V; the rest are
        // issued once the P.V is done and this tile's buffer is back with the producer, which can
        // then refill it while S runs (issuing all of S first kept consumer 0 issuing, and the
        // buffer held, until the tensor cores had taken most of S: some 1,100 cycles at 128 heads).
        int next = tile + 1;
        u64 next_live = 0;
        if (next < tile_end) next_live = kv.acquire(next, lane);
        if (next_live != 0) {
            issue_scores<0, QK_EARLY>(s, desc_q, desc_k0 + buffer_of(next) * KV_STEP);
            wgmma_wait<1>();  // P.V done (S may still run): this tile's buffer goes back to the producer now
        } else {
            wgmma_wait_all();
        }
        fence_registers(o);
        if (tile != hold) kv.release(b, lane);
        if (next_live != 0) issue_scores<QK_EARLY, QK_STEPS>(s, desc_q, desc_k0 + buffer_of(next) * KV_STEP);
        wgmma_wait_all();
        fence_registers(s);
        ++processed;
        if (next < tile_end && next_live == 0) {  // nothing live in tile + 1: on to the next live tile, unpipelined
            if (next != hold) kv.release(buffer_of(next), lane);
            next = kv.next_live(next + 1, tile_end, hold, lane, next_live);
            if (next < tile_end) {
                issue_scores(s, desc_q, desc_k0 + buffer_of(next) * KV_STEP);
                wgmma_wait_all();
                fence_registers(s);
            }
        }
        tile = next;
        live = next_live;
    }

    // The rows' factors for consumer 1, then this half of the outputs.
    const i64 num_heads = p.num_heads;
    float factor_lo = 0.0f, factor_hi = 0.0f, lse_lo = 0.0f, lse_hi = 0.0f;
    if (slot < 0) {
        lse_lo = row_lse(m_lo, l_lo);
        lse_hi = row_lse(m_hi, l_hi);
        if (head0 + row_lo < num_heads) factor_lo = output_factor(l_lo, lse_lo, p.sinks, head0 + row_lo);
        if (head0 + row_hi < num_heads) factor_hi = output_factor(l_hi, lse_hi, p.sinks, head0 + row_hi);
        if (quad == 0) {
            factors[row_lo] = factor_lo;
            factors[row_hi] = factor_hi;
        }
    }
    sync_consumers();  // both consumers' loops are done (the held buffer is free), the factors are in
    if (!last && tid == 0) issue_q(p, base + SM_Q, bar_q, next_row, head0);  // every S is done: Q is free
    if (quad == 0 && part == 0) {                                            // both parts of a row have the same (m, l)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const i64 head = head0 + (half ? row_hi : row_lo);
            if (head >= num_heads) continue;
            if (slot < 0)
                p.lse[row * num_heads + head] = half ? lse_hi : lse_lo;
            else
                reinterpret_cast<float2*>(p.partial_ml)[slot * num_heads + head] =
                    half ? make_float2(m_hi, l_hi) : make_float2(m_lo, l_lo);
        }
    }
    write_rows(p, o, smem, row, head0, slot, part, buffer_of(hold), 0, row_lo, quad, factor_lo, factor_hi, tid);
    kv.release_held(buffer_of(hold), lane);
}

// Consumer 1, one item: O over the second half of the item's dims (256..511 of whole rows) with
// consumer 0's P and rescale factors (the arguments as consume_item0's).
__device__ __forceinline__ void consume_item1(const Params& p, u8* smem, i64 row, i64 head0, i64 slot, int part,
                                              int tile0, int num_tiles, u32& processed, int tid, u32 peer_bars) {
    const int hold = tile0 + num_tiles - 1;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, quad = lane & 3;
    const int row_lo = warp * 16 + g, row_hi = row_lo + 8;
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const KvPipeline kv = {bars, peer_bars, reinterpret_cast<const u32*>(smem + SM_TILE_MASK)};
    const float* const alphas = reinterpret_cast<const float*>(smem + SM_ALPHA);
    const float* const factors = reinterpret_cast<const float*>(smem + SM_FACTOR);
    const u32 base = shared_address(smem);
    const u64 desc_p = matrix_descriptor(base + SM_P, P_GROUP_STRIDE, 128);
    const u64 desc_v0 =
        matrix_descriptor(base + SM_KV + (part * OUT_DIMS + HALF_DIMS) / 8 * GROUP_STRIDE, 128, GROUP_STRIDE);
    constexpr u64 KV_STEP = KV_BYTES >> 4, P_K_STEP = (2 * P_GROUP_STRIDE) >> 4, PV_K_STEP = (16 * 16) >> 4;

    float o[4 * O_BLOCKS];
#pragma unroll
    for (int i = 0; i < 4 * O_BLOCKS; ++i) o[i] = 0.0f;
    sync_consumers();  // consumer 0's wait_q
    for (int tile = tile0; tile < tile0 + num_tiles; ++tile) {
        const int b = buffer_of(tile);
        const u64 live = kv.acquire(tile, lane);
        if (live == 0) {
            if (tile != hold) kv.release(b, lane);
            continue;
        }
        mbar_wait(barrier_at(bars, BAR_P_FULL), processed & 1);
        const float alpha_lo = alphas[row_lo], alpha_hi = alphas[row_hi];
        if (__any_sync(NVFP4_FULL_MASK, alpha_lo != 1.0f || alpha_hi != 1.0f)) rescale_rows(o, alpha_lo, alpha_hi);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k)
            wgmma_pv_ss<HALF_DIMS>(o, desc_p + k * P_K_STEP, desc_v0 + b * KV_STEP + k * PV_K_STEP);
        wgmma_commit();
        wgmma_wait_all();
        fence_registers(o);
        mbar_arrive(barrier_at(
            bars, BAR_P_EMPTY));  // every thread: its reads of the factors come before consumer 0's next writes
        if (tile != hold) kv.release(b, lane);
        ++processed;
    }

    sync_consumers();  // both consumers' loops are done (the held buffer is free), consumer 0's factors are in
    const bool split_outputs = slot >= 0;  // then no factors were written: raw fp32 rows
    const float factor_lo = split_outputs ? 0.0f : factors[row_lo], factor_hi = split_outputs ? 0.0f : factors[row_hi];
    write_rows(p, o, smem, row, head0, slot, part, buffer_of(hold), HALF_DIMS, row_lo, quad, factor_lo, factor_hi,
               tid + WARPGROUP_THREADS);
    kv.release_held(buffer_of(hold), lane);
}
