// The split combine of every sparse-decode backend: one block per (split row of the work list, head)
// merges the row's partial outputs in slot order (deterministic) and finishes the row as the attention kernels
// do (docs/kernels/combine.md). -D constants: MAX_SPLITS, PREFETCH; THREADS and the record ABI come
// from jit.py/abi.py.
#include "nvfp4_mla_params.cuh"  // Params: decode_combine.COMBINE_PARAMS
#include "nvfp4_mla_ptx.cuh"
#include "nvfp4_mla_softmax.cuh"
#include "nvfp4_mla_work.cuh"  // SplitRow

constexpr int SPLITS_PER_THREAD = MAX_SPLITS / THREADS;
static_assert(THREADS * 4 == HEAD_DIM && MAX_SPLITS % THREADS == 0,
              "one thread per 4 output dims, whole splits a thread");

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

// One block per (row, head): O = sum_s 2^(m_s - M) O_s, l = sum_s 2^(m_s - M) l_s, in slot order.
// Every partial's (m, l) is loaded at once (SPLITS_PER_THREAD a thread) and its weight shared, and
// with them the first PREFETCH partial rows, so up to PREFETCH partials the block waits for one
// round trip of loads, not two. The host builds PREFETCH 4 (no more registers than 0) and 16,
// whose registers cost blocks an SM, so it takes that one only for a combine that fits the GPU in
// one wave (decode_combine.launcher).
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_decode_combine(const Params p) {
    __shared__ float weights[MAX_SPLITS], sums[MAX_SPLITS], warp_max[THREADS / 32];
    const int tid = threadIdx.x;
    // Block b is (split row b / num_heads, head b % num_heads), in 32 bits (a 64-bit division is a
    // long call on the way to the first loads): the grid and the heads fit them.
    const u32 heads = static_cast<u32>(p.num_heads), split_row = blockIdx.x / heads;
    const i64 head = blockIdx.x - split_row * heads;
    // With the host's list (written before the call) the block's partials are known before the
    // wait; the scheduler's split rows come from the kernels before.
    const bool known = p.static_list != 0;
    launch_dependents();
    if (!known) wait_for_prior_grids();
    const RowPartials rp = row_partials(p, split_row, head);
    if (known) wait_for_prior_grids();  // the partials come from the attention kernel
    if (rp.row < 0) return;
    const int count = rp.count;
    const float4* partial = reinterpret_cast<const float4*>(p.partial_o) + rp.first * (HEAD_DIM / 4) + tid;
    const i64 step = rp.stride * (HEAD_DIM / 4);
    float4 early[PREFETCH > 0 ? PREFETCH : 1];
#pragma unroll
    for (int s = 0; s < PREFETCH; ++s) early[s] = s < count ? partial[s * step] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float2 ml[SPLITS_PER_THREAD];
    float m = neg_inf();
#pragma unroll
    for (int k = 0; k < SPLITS_PER_THREAD; ++k) {
        const int s = tid + k * THREADS;
        ml[k] = s < count ? p.partial_ml[rp.first + s * rp.stride] : make_float2(neg_inf(), 0.0f);
        m = fmaxf(m, ml[k].x);
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(NVFP4_FULL_MASK, m, o));
    if ((tid & 31) == 0) warp_max[tid >> 5] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) m = fmaxf(m, warp_max[w]);
    const float m_base = softmax_base(m);  // lonely: every weight below is 0
#pragma unroll
    for (int k = 0; k < SPLITS_PER_THREAD; ++k) {
        const int s = tid + k * THREADS;
        if (s < count) {
            weights[s] = exp2_approx(ml[k].x - m_base);
            sums[s] = ml[k].y;
        }
    }
    __syncthreads();
    float l = 0.0f;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const auto add = [&](int s, float4 x) {
        const float w = weights[s];
        l += sums[s] * w;
        o.x += x.x * w;
        o.y += x.y * w;
        o.z += x.z * w;
        o.w += x.w * w;
    };
#pragma unroll
    for (int s = 0; s < PREFETCH; ++s)
        if (s < count) add(s, early[s]);
    const float4* at = partial + PREFETCH * step;  // advanced, not multiplied: a 64-bit product a load costs registers
    // 16 partial loads in flight a round trip
#pragma unroll 16
    for (int s = PREFETCH; s < count; ++s, at += step) add(s, *at);
    const float lse = row_lse(m, l);
    const float factor = output_factor(l, lse, p.sinks, head);
    const i64 row_head = rp.row * p.num_heads + head;
    p.out[row_head * (HEAD_DIM / 4) + tid] =
        make_uint2(bf16x2_bits(o.x * factor, o.y * factor), bf16x2_bits(o.z * factor, o.w * factor));
    if (tid == 0) p.lse[row_head] = lse;
}
