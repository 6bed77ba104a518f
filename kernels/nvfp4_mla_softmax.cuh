// The online softmax of every decode kernel (docs/format.md section 9): its base-2 helpers and a
// row's finish (lse, output factor), so every backend computes them the same way and the split
// combine merges any backend's partial rows.
#pragma once

#include "nvfp4_numerics.cuh"

#define LN2 0.693147180559945309f

// The online softmax moves a row's base only when its max grew by more than this (log2 units), so
// the output is rescaled a few times a row instead of at most tiles: p stays below 2^8, far from
// fp32 or BF16 overflow.
constexpr float RESCALE_SLACK = 8.0f;

// 2^x, fp32 (ex2.approx: about 2 ulp; 2^-inf = +0).
__device__ __forceinline__ float exp2_approx(float x) {
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7f800000u); }

// The online softmax of rows lo and hi of an MMA fragment, whose tokens a quad's 4 lanes share:
// their maxima (quad_max) and sums (quad_sum) over the quad, in place.
__device__ __forceinline__ void quad_max(float& lo, float& hi) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        lo = fmaxf(lo, __shfl_xor_sync(NVFP4_FULL_MASK, lo, x));
        hi = fmaxf(hi, __shfl_xor_sync(NVFP4_FULL_MASK, hi, x));
    }
}

__device__ __forceinline__ void quad_sum(float& lo, float& hi) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        lo += __shfl_xor_sync(NVFP4_FULL_MASK, lo, x);
        hi += __shfl_xor_sync(NVFP4_FULL_MASK, hi, x);
    }
}

// A row's base m moves to the tile's max only when that passes it by more than RESCALE_SLACK.
__device__ __forceinline__ bool base_moves(float tile_max, float m) { return tile_max > m + RESCALE_SLACK; }

// What p = 2^(s - base) subtracts for a row of base m: 0 while nothing is live (m = -inf), so
// every p and rescale factor is 0.
__device__ __forceinline__ float softmax_base(float m) { return m == neg_inf() ? 0.0f : m; }

// The natural-log LSE of a row from its running max m (log2 units) and sum l of 2^(s - m): +inf
// for a lonely row (l == 0: the row's max token alone adds 1 to l).
__device__ __forceinline__ float row_lse(float m, float l) { return l == 0.0f ? pos_inf() : (m + log2f(l)) * LN2; }

// The factor of a row's unnormalized output: 1 / l times the sink factor 1 / (1 + e^(sink - lse));
// 0 for a lonely row.
__device__ __forceinline__ float output_factor(float l, float lse, const float* sinks, i64 head) {
    if (l == 0.0f) return 0.0f;
    const float inv_l = 1.0f / l;
    return sinks ? inv_l / (1.0f + expf(sinks[head] - lse)) : inv_l;
}
