// The split combine of every sparse-decode backend: WARPS_A_HEAD warps per (split row of the work
// list, head) merge the row's partial outputs in slot order (deterministic) and finish the row as the
// attention kernels do (docs/kernels/combine.md); a block holds HEADS_A_BLOCK heads of one split row.
// -D constants: MAX_SPLITS, PREFETCH, IN_FLIGHT, TAIL_CHUNK, WARPS_A_HEAD; THREADS and the record
// ABI come from jit.py/abi.py.
#include "nvfp4_mla_params.cuh"  // Params: decode_combine.COMBINE_PARAMS
#include "nvfp4_mla_ptx.cuh"
#include "nvfp4_mla_softmax.cuh"
#include "nvfp4_mla_work.cuh"  // SplitRow

constexpr int WARPS = THREADS / 32;
constexpr int HEAD_THREADS = 32 * WARPS_A_HEAD;
constexpr int HEADS_A_BLOCK = WARPS / WARPS_A_HEAD;
constexpr int VECS = HEAD_DIM / 4 / HEAD_THREADS;  // a thread's float4 of a head's row, HEAD_THREADS apart
static_assert(WARPS % WARPS_A_HEAD == 0 && VECS * HEAD_THREADS * 4 == HEAD_DIM && IN_FLIGHT % VECS == 0 &&
                  TAIL_CHUNK >= 1,
              "whole heads a block, whole float4 a thread, a partial a chunk at least");

// A block's row and its partials: the row's `count` partial entries start at entry `first` of the
// workspace (an entry is a head's partial row and its (m, l)), `stride` entries apart.
struct RowPartials {
    i64 row, first, stride;
    int count;
};

// Split row i's partials for `head`: its slots' entries slot * num_heads + head (row -1: no such
// split row, nothing to do).
__device__ __forceinline__ RowPartials row_partials(const Params& p, i64 i, i64 head) {
    const SplitRow r = p.split_rows[i], next = p.split_rows[i + 1];
    return {r.row, r.first_slot * p.num_heads + head, p.num_heads, next.first_slot - r.first_slot};
}

// A head's warps per (row, head): O = sum_s 2^(m_s - M) O_s, l = sum_s 2^(m_s - M) l_s, in slot
// order (every thread's sums in the same order, whatever the build). Each warp weighs the row's
// partials itself, so no warp waits for another. The first PREFETCH partial rows are loaded with the
// (m, l), so up to PREFETCH partials a warp waits for one round trip of loads, not two; past them a
// thread keeps IN_FLIGHT float4 loads in flight, then loads the last partials TAIL_CHUNK at a time.
// The host's builds and which a call takes: decode_combine.launcher.
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_decode_combine(const Params p) {
    __shared__ float2 weighted[WARPS][MAX_SPLITS];  // a warp's partials' (m, l), then (weight, l)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = threadIdx.x % HEAD_THREADS;
    // Block b is (split row b / groups, heads (b % groups) HEADS_A_BLOCK on), in 32 bits (a 64-bit
    // division is a long call on the way to the first loads): the grid and the heads fit them.
    const u32 groups = (static_cast<u32>(p.num_heads) + HEADS_A_BLOCK - 1) / HEADS_A_BLOCK;
    const u32 split_row = blockIdx.x / groups;
    const i64 head = static_cast<i64>(blockIdx.x - split_row * groups) * HEADS_A_BLOCK + threadIdx.x / HEAD_THREADS;
    // With the host's list (written before the call) the warp's partials are known before the wait;
    // the scheduler's split rows come from the kernels before.
    const bool known = p.static_list != 0;
    launch_dependents();
    if (!known) wait_for_prior_grids();
    if (head >= p.num_heads) return;  // the last group's missing heads
    const RowPartials rp = row_partials(p, split_row, head);
    if (known) wait_for_prior_grids();  // the partials come from the attention kernel
    if (rp.row < 0) return;
    const int count = rp.count;
    const float4* partial = reinterpret_cast<const float4*>(p.partial_o) + rp.first * (HEAD_DIM / 4) + t;
    const i64 step = rp.stride * (HEAD_DIM / 4);
    float4 early[PREFETCH > 0 ? PREFETCH : 1][VECS];
#pragma unroll
    for (int s = 0; s < PREFETCH; ++s)
#pragma unroll
        for (int v = 0; v < VECS; ++v)
            early[s][v] = s < count ? partial[s * step + v * HEAD_THREADS] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The (m, l) are copied (cp.async), not loaded: no register waits for one, so a lane's copies
    // go out together and the row's take one round trip however many partials it has. A lane takes
    // one pass of each loop below up to 32 partials: unrolled, their remainder code costs more
    // instructions than the passes.
    const float2* ml = p.partial_ml + rp.first + lane * rp.stride;
#pragma unroll 1
    for (int s = lane; s < count; s += 32, ml += 32 * rp.stride) cp_async_small<8>(&weighted[warp][s], ml);
    cp_async_wait_all();  // a lane reads only its own copies before the __syncwarp below
    float m = neg_inf();
#pragma unroll 1
    for (int s = lane; s < count; s += 32) m = fmaxf(m, weighted[warp][s].x);
    for (int d = 16; d; d >>= 1) m = fmaxf(m, __shfl_xor_sync(NVFP4_FULL_MASK, m, d));
    const float m_base = softmax_base(m);  // lonely: every weight below is 0
#pragma unroll 1
    for (int s = lane; s < count; s += 32) weighted[warp][s].x = exp2_approx(weighted[warp][s].x - m_base);
    __syncwarp();
    float l = 0.0f;
    float4 o[VECS];
#pragma unroll
    for (int v = 0; v < VECS; ++v) o[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const auto add = [&](int s, const float4(&x)[VECS]) {
        const float2 wl = weighted[warp][s];
        const float w = wl.x;
        l += wl.y * w;
#pragma unroll
        for (int v = 0; v < VECS; ++v) {
            o[v].x += x[v].x * w;
            o[v].y += x[v].y * w;
            o[v].z += x[v].z * w;
            o[v].w += x[v].w * w;
        }
    };
#pragma unroll
    for (int s = 0; s < PREFETCH; ++s)
        if (s < count) add(s, early[s]);
    // Past the prefetched partials, whole batches of BATCH partials (IN_FLIGHT loads a thread) a
    // round trip, then the rest in predicated chunks of TAIL_CHUNK partials (a chunk as large as a
    // batch costs registers). Pointers are advanced, not multiplied: a 64-bit product a load costs
    // registers.
    constexpr int BATCH = IN_FLIGHT / VECS;
    const float4* at = partial + PREFETCH * step;
    int s = PREFETCH;
#pragma unroll 1
    for (; s + BATCH <= count; s += BATCH) {
        float4 x[BATCH][VECS];
#pragma unroll
        for (int b = 0; b < BATCH; ++b, at += step)
#pragma unroll
            for (int v = 0; v < VECS; ++v) x[b][v] = at[v * HEAD_THREADS];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) add(s + b, x[b]);
    }
#pragma unroll 1
    for (; s < count; s += TAIL_CHUNK) {
        float4 x[TAIL_CHUNK][VECS];
#pragma unroll
        for (int c = 0; c < TAIL_CHUNK; ++c, at += step)
#pragma unroll
            for (int v = 0; v < VECS; ++v)
                x[c][v] = s + c < count ? at[v * HEAD_THREADS] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int c = 0; c < TAIL_CHUNK; ++c)
            if (s + c < count) add(s + c, x[c]);
    }
    const float lse = row_lse(m, l);
    const float factor = output_factor(l, lse, p.sinks, head);
    uint2* out = p.out + (rp.row * p.num_heads + head) * (HEAD_DIM / 4) + t;
#pragma unroll
    for (int v = 0; v < VECS; ++v)
        out[v * HEAD_THREADS] =
            make_uint2(bf16x2_bits(o[v].x * factor, o[v].y * factor), bf16x2_bits(o[v].z * factor, o[v].w * factor));
    if (t == 0) p.lse[rp.row * p.num_heads + head] = lse;
}
