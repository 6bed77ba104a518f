// The split combine of every sparse-decode backend: one block per (query row, head) merges the
// row's split partial outputs in split order (deterministic) and finishes the row as the attention
// kernels do (docs/kernels/combine.md). -D constants: MAX_SPLITS, PREFETCH; THREADS and the record
// ABI come from jit.py/abi.py.
#include "nvfp4_mla_params.cuh"  // Params: decode_combine.COMBINE_PARAMS
#include "nvfp4_mla_ptx.cuh"
#include "nvfp4_mla_softmax.cuh"

static_assert(THREADS * 4 == HEAD_DIM && THREADS >= MAX_SPLITS, "one thread per 4 output dims and per split");

// One block per (row, head): O = sum_s 2^(m_s - M) O_s, l = sum_s 2^(m_s - M) l_s, in split order.
// Every split's (m, l) is loaded at once (a thread each) and its weight shared, and with them the
// first PREFETCH splits' partial rows, so up to PREFETCH splits the block waits for one round trip
// of loads, not two. The host builds PREFETCH 4 (no more registers than 0) and 16, whose registers
// cost blocks an SM, so it takes that one only for a combine that fits the GPU in one wave
// (decode.plan).
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_decode_combine(const Params p) {
    __shared__ float weights[MAX_SPLITS], sums[MAX_SPLITS], warp_max[THREADS / 32];
    launch_dependents();
    wait_for_prior_grids();
    const int tid = threadIdx.x;
    const i64 row_head = blockIdx.x;  // row * num_heads + head
    const int num_splits = static_cast<int>(p.num_splits);
    const float4* partial = p.partial_o + row_head * num_splits * (HEAD_DIM / 4) + tid;
    float4 early[PREFETCH > 0 ? PREFETCH : 1];
#pragma unroll
    for (int s = 0; s < PREFETCH; ++s)
        early[s] = s < num_splits ? partial[s * (HEAD_DIM / 4)] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float2 ml = tid < num_splits ? p.partial_ml[row_head * num_splits + tid] : make_float2(neg_inf(), 0.0f);
    float m = ml.x;
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(NVFP4_FULL_MASK, m, o));
    if ((tid & 31) == 0) warp_max[tid >> 5] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) m = fmaxf(m, warp_max[w]);
    const float m_base = softmax_base(m);  // lonely: every weight below is 0
    if (tid < num_splits) {
        weights[tid] = exp2_approx(ml.x - m_base);
        sums[tid] = ml.y;
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
        if (s < num_splits) add(s, early[s]);
#pragma unroll 16  // 16 partial loads in flight a round trip
    for (int s = PREFETCH; s < num_splits; ++s) add(s, partial[s * (HEAD_DIM / 4)]);
    const float lse = row_lse(m, l);
    const float factor = output_factor(l, lse, p.sinks, row_head % p.num_heads);
    p.out[row_head * (HEAD_DIM / 4) + tid] = make_uint2(bf16x2_bits(o.x * factor, o.y * factor),
                                                        bf16x2_bits(o.z * factor, o.w * factor));
    if (tid == 0) p.lse[row_head] = lse;
}
