// The Hopper decode kernel's epilogue: an item's output rows staged in shared memory and copied
// out as whole rows (docs/kernels/decode_sm90.md).
#pragma once

#include "nvfp4_mla_sm90_pipeline.cuh"

// The outputs leave through shared memory: each consumer stages its half of every row (BF16 times
// the row's factor without splits, the raw fp32 with), then the 256 consumer threads copy whole
// rows out, a warp's store 512 contiguous bytes of a row (stores straight from the fragment layout
// touch 8 rows an instruction: docs/performance.md#output-staging). The rows are staged in the K/V buffer of the item's last
// tile, which the consumers hold until the rows are out (the producer fills the other buffer with
// the next item's first tile meanwhile, and Q's buffer takes the next item's Q): 64 rows of 1 KB,
// each the row's BF16, or in two passes one consumer's fp32 half. Chunk c (16 bytes) of staged row
// r lies at (c ^ (r & 7)) * 16 within its 128 bytes: a fragment store's 8 rows hit 8 different
// chunk columns (fp32: 2 wavefronts for 256 bytes, BF16: 1 for 128), and a warp reads a row
// conflict-free. The staging code is unrolled over the 128 accumulators, so it is kept to one
// store an accumulator pair (the addresses precomputed, NaNs made torch's in the copy loop): the
// kernel's instruction footprint costs issue slots (ncu: "no instruction" stalls).
template <bool SPLIT>
__device__ __forceinline__ void stage_rows(const float (&o)[4 * O_BLOCKS], u8* region, int byte0, int row_lo, int quad,
                                           float factor_lo, float factor_hi) {
    // Pair j of a fragment row (dims j * 8 + quad * 2, + 1) is at byte j * 16 + quad * 4 of a BF16
    // row, j * 32 + quad * 8 of an fp32 half: chunk j (BF16) or 2 j + quad / 2 (fp32), whose
    // swizzled column depends on j & 7 (BF16) or j & 3 (fp32) and the row's r & 7 = row_lo & 7.
    constexpr int COLUMNS = SPLIT ? 4 : 8;
    u8* at[2][COLUMNS];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int k = 0; k < COLUMNS; ++k) {
            const int chunk = SPLIT ? 2 * k + (quad >> 1) : k, in_chunk = SPLIT ? (quad & 1) * 8 : quad * 4;
            at[half][k] = region + (row_lo + 8 * half) * STAGED_ROW + byte0 + ((chunk ^ row_lo) & 7) * 16 + in_chunk;
        }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float factor = half ? factor_hi : factor_lo;
#pragma unroll
        for (int j = 0; j < O_BLOCKS; ++j) {
            const float x = o[4 * j + 2 * half], y = o[4 * j + 2 * half + 1];
            if constexpr (SPLIT)
                *reinterpret_cast<float2*>(at[half][j & 3] + (j >> 2) * 128) = make_float2(x, y);
            else  // torch's NaN in copy_rows_out
                *reinterpret_cast<u32*>(at[half][j & 7] + (j >> 3) * 128) = bf16x2_rn(x * factor, y * factor);
        }
    }
}

// The bytes of a staged output row: BF16 rows are 1 KB; fp32 rows are staged 256 dims (1 KB) a
// pass, or with NARROW (16 rows) whole (2 KB).
template <bool SPLIT>
constexpr int STAGED_ROW_BYTES = SPLIT && NARROW ? 2 * STAGED_ROW : STAGED_ROW;

// Every consumer thread (ctid 0..CONSUMER_THREADS - 1), once the rows are staged in `region`: the
// staged rows to dims d0.. of the block's rows (heads below num_heads) of out (SPLIT false), or of
// the partial outputs at `slot`.
template <bool SPLIT>
__device__ __forceinline__ void copy_rows_out(const Params& p, const u8* region, i64 row, i64 head0, i64 slot, int d0,
                                              int ctid) {
    constexpr int ROW_BYTES = STAGED_ROW_BYTES<SPLIT>;
    constexpr int WARP_STORES = (SPLIT ? ROW_BYTES : OUT_DIMS * 2) / 512;  // of a staged row
    sync_consumers();                                                      // every row is staged
    const i64 num_heads = p.num_heads;
    const int rows = static_cast<int>(min(static_cast<i64>(HT), num_heads - head0));
    const int warp = ctid >> 5, lane = ctid & 31;
    for (int r = warp; r < rows; r += CONSUMER_THREADS / 32) {  // a warp a row
        const i64 entry = (SPLIT ? slot : row) * num_heads + head0 + r;
        uint4* const dst = (SPLIT ? reinterpret_cast<uint4*>(p.partial_o + entry * HEAD_DIM + d0)
                                  : reinterpret_cast<uint4*>(p.out + entry * (HEAD_DIM / 2) + d0 / 2)) +
            lane;
        const u8* const src = region + r * ROW_BYTES + (((lane ^ r) & 7) | (lane & ~7)) * 16;
        uint4 v[WARP_STORES];
#pragma unroll
        for (int c = 0; c < WARP_STORES; ++c) v[c] = *reinterpret_cast<const uint4*>(src + c * 512);
#pragma unroll
        for (int c = 0; c < WARP_STORES; ++c) {
            if constexpr (!SPLIT)
                v[c] = make_uint4(torch_nan_halves(v[c].x), torch_nan_halves(v[c].y), torch_nan_halves(v[c].z),
                                  torch_nan_halves(v[c].w));
            dst[c * 32] = v[c];  // a warp's store: 512 contiguous bytes
        }
    }
}

// A consumer's half of the item's outputs, its dims from d0 of the item's (after both loops: named
// barrier 1; the item's dims from part * OUT_DIMS), staged in K/V buffer `held`: the row's out
// (slot -1), or its partial outputs at `slot`. Both consumers pass the same barriers. fp32 partials
// leave 256 dims (a staged row of 1 KB) a pass: both consumers' halves at once with half rows
// (DIM_PARTS 2), else each consumer's in a pass of its own.
__device__ __forceinline__ void write_rows(const Params& p, const float (&o)[4 * O_BLOCKS], u8* smem, i64 row,
                                           i64 head0, i64 slot, int part, int held, int d0, int row_lo, int quad,
                                           float factor_lo, float factor_hi, int ctid) {
    u8* const region = smem + SM_KV + held * KV_BYTES;
    const int item_d0 = part * OUT_DIMS;
    if (slot < 0) {
        stage_rows<false>(o, region, d0 * 2, row_lo, quad, factor_lo, factor_hi);
        copy_rows_out<false>(p, region, row, head0, slot, item_d0, ctid);
        return;
    }
    constexpr int PASS_DIMS = STAGED_ROW / 4, PASSES = OUT_DIMS / PASS_DIMS;
#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {  // one copy of the staging code
        if (pass > 0) sync_consumers();          // the pass before is read out
        const int pass_d0 = pass * PASS_DIMS;
        if (d0 >= pass_d0 && d0 < pass_d0 + PASS_DIMS)
            stage_rows<true>(o, region, (d0 - pass_d0) * 4, row_lo, quad, factor_lo, factor_hi);
        copy_rows_out<true>(p, region, row, head0, slot, item_d0 + pass_d0, ctid);
    }
}
