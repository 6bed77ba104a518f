// The decode scheduler: one block reads the rows' live lengths on the GPU and writes the work list
// of a call (nvfp4_mla_work.cuh): the rows' tiles dealt into `parts` parts of equal cost, and the
// rows split between parts with their partial slots, or whole rows a part where that costs no part
// more than the cut list's bound and the combine's cost (always with whole_rows).
// ops/decode_scheduler.py holds its CPU model (the same integer results); docs/kernels/scheduler.md
// describes the steps.
#include "nvfp4_mla_params.cuh"  // Params: decode_scheduler.SCHEDULER_PARAMS
#include "nvfp4_mla_ptx.cuh"
#include "nvfp4_mla_work.cuh"

static_assert(THREADS % 32 == 0 && THREADS <= 1024,
              "whole warps, a thread a boundary between parts: up to THREADS - 1 parts");
constexpr int WARPS = THREADS / 32;

// A row's cost: its live tiles (at least one) and the cost of a segment besides its tiles. In 32
// bits: the host caps a table's width at 2^24 entries.
__device__ __forceinline__ u32 row_cost(const Params& p, i64 row) {
    const u32 live = static_cast<u32>(live_count(p.swa_lens, p.swa_lens_int64, p.swa_k, row)) +
        static_cast<u32>(live_count(p.extra_lens, p.extra_lens_int64, p.extra_k, row));
    return live_tiles(live, static_cast<u32>(p.tile_shift)) + static_cast<u32>(p.segment_cost);
}

// The costs of rows r .. r + LOADS - 1 (0 from r_end on), their lengths loaded together: a
// thread's rows are a contiguous run, and one at a time their loads would wait in turn.
constexpr int LOADS = ROW_LOADS;  // decode_scheduler.ROW_LOADS

__device__ __forceinline__ void load_costs(const Params& p, i64 r, i64 r_end, u32 (&cost)[LOADS]) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) cost[i] = r + i < r_end ? row_cost(p, r + i) : 0u;
}

// No 64-bit division here: it is a call, whose stack frame ptxas reports as a spill on sm_80.
// ceil(a / d) for a >= 0 and 0 < d < 2^16: a long division in 16-bit digits, each step in 32 bits.
__device__ __forceinline__ i64 ceil_div_small_divisor(i64 a, u32 d) {
    u64 q = 0;
    u32 r = 0;
#pragma unroll
    for (int shift = 48; shift >= 0; shift -= 16) {
        const u32 x = (r << 16) | static_cast<u32>((static_cast<u64>(a) >> shift) & 0xFFFFu);
        q = (q << 16) | (x / d);
        r = x % d;
    }
    return static_cast<i64>(q) + (r != 0);
}

// ceil(a / b) for a >= 0, b > 0 and a quotient of at most 2^11 (a boundary's index: at most
// parts): in 32 bits where both fit, else the smallest q with q b >= a, by bisection.
__device__ __forceinline__ i64 boundary_at(i64 a, i64 b) {
    if (((a | b) >> 31) == 0) return (static_cast<u32>(a) + static_cast<u32>(b) - 1) / static_cast<u32>(b);
    if (a == 0) return 0;
    i64 below = 0;  // the largest q found with q b < a
    for (i64 step = i64(1) << 10; step > 0; step >>= 1)
        if ((below + step) * b < a) below += step;
    return below + 1;
}

// The block's inclusive scan under `op` of one value a thread; `total` gets the last thread's.
// `warp_totals` holds 32 values, and each call needs its own.
template <typename T, typename Op>
__device__ __forceinline__ T block_inclusive_scan(T v, T* warp_totals, Op op, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const T x = __shfl_up_sync(NVFP4_FULL_MASK, v, o);
        if (lane >= o) v = op(x, v);
    }
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = lane < WARPS ? warp_totals[lane] : T(0);
        for (int o = 1; o < WARPS; o <<= 1) {
            const T x = __shfl_up_sync(NVFP4_FULL_MASK, w, o);
            if (lane >= o) w = op(x, w);
        }
        if (lane < WARPS) warp_totals[lane] = w;
    }
    __syncthreads();
    total = warp_totals[WARPS - 1];
    return warp > 0 ? op(warp_totals[warp - 1], v) : v;
}

struct Sum {
    template <typename T>
    __device__ T operator()(T a, T b) const {
        return a + b;
    }
};
struct Max {
    template <typename T>
    __device__ T operator()(T a, T b) const {
        return a > b ? a : b;
    }
};

// One block a call: at least one block an SM lets ptxas use the registers of one (for two 1,024-thread
// blocks it keeps 32 a thread, and spills on sm_80).
extern "C" __global__ void __launch_bounds__(THREADS, 1) nvfp4_mla_decode_scheduler(const Params p) {
    // Boundary q (0 <= q <= parts) begins part q and ends part q - 1. The first boundary inside a
    // row is marked with the row and the cost its row begins at; -1: no row's first.
    __shared__ int mark_row[THREADS];
    __shared__ i64 mark_start[THREADS];
    // Each boundary's row and tile.
    __shared__ int bound_row[THREADS], bound_tile[THREADS];
    // Each boundary's row's first cost: where the boundary lies when rows are kept whole.
    __shared__ i64 bound_start[THREADS];
    // Up to boundary q: the cuts (a boundary inside a row, at a tile no earlier boundary took) in
    // the low 16 bits, and the split rows (those cuts that are their row's first) in the high 16.
    __shared__ u32 counts[THREADS];
    __shared__ i64 cost_totals[WARPS];
    __shared__ int mark_totals[WARPS];
    __shared__ i64 longest_totals[WARPS];
    __shared__ u32 count_totals[WARPS];
    launch_dependents();
    mark_row[threadIdx.x] = -1;
    wait_for_prior_grids();  // the lengths may come from the stream's previous kernel
    const int tid = threadIdx.x, parts = static_cast<int>(p.parts);

    // A thread's rows: a contiguous run, so the prefix of the costs is one scan. Up to LOADS rows
    // a thread, their costs stay in registers for the second pass.
    const i64 per_thread = (p.rows + THREADS - 1) / THREADS;
    const i64 r0 = min(p.rows, tid * per_thread), r1 = min(p.rows, r0 + per_thread);
    i64 mine = 0;
    u32 cost[LOADS];
    for (i64 r = r0; r < r1; r += LOADS) {
        load_costs(p, r, r1, cost);
#pragma unroll
        for (int i = 0; i < LOADS; ++i) mine += cost[i];
    }
    i64 total;
    i64 start = block_inclusive_scan(mine, cost_totals, Sum(), total) - mine;

    // Part q takes the costs [q payload, (q + 1) payload): boundary q lies at cost q payload, in the
    // row whose costs hold it, or at the end. Each row marks its first boundary.
    const i64 payload = ceil_div_small_divisor(total, static_cast<u32>(parts));
    i64 q = boundary_at(start, payload);  // the first boundary at or past `start`
    for (i64 r = r0; r < r1; r += LOADS) {
        if (per_thread > LOADS) load_costs(p, r, r1, cost);
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const i64 end = start + cost[i];
            if (q * payload < end) {
                mark_row[q] = static_cast<int>(r + i);
                mark_start[q] = start;
                q = boundary_at(end, payload);
            }
            start = end;
        }
    }
    __syncthreads();

    // A boundary's row is the latest mark at or before it; its tile is counted after the row's
    // segment cost.
    int row = static_cast<int>(p.rows), tile = 0, latest_mark;
    const int marked =
        block_inclusive_scan(tid <= parts && mark_row[tid] >= 0 ? tid : -1, mark_totals, Max(), latest_mark);
    const i64 at = tid * payload;
    i64 row_start = total;
    if (tid <= parts && at < total) {
        row = mark_row[marked];
        row_start = mark_start[marked];
        tile = static_cast<int>(max(at - row_start - p.segment_cost, i64(0)));
    }
    bound_start[tid] = row_start;
    __syncthreads();

    // Whole rows (every boundary moved back to its row's start, so no row is cut) where the costliest
    // part they make costs at most a cut list's bound (the payload and a segment) and the combine's
    // cost, or always with whole_rows.
    i64 longest;
    block_inclusive_scan(tid < parts ? bound_start[tid + 1] - row_start : i64(0), longest_totals, Max(), longest);
    if (p.whole_rows || longest <= payload + p.segment_cost + p.combine_cost) tile = 0;
    bound_row[tid] = row;
    bound_tile[tid] = tile;
    __syncthreads();

    u32 mark = 0;  // 1: a cut; 1 << 16 too: its row's first
    if (tid > 0 && tid <= parts && tile > 0) {
        const int before_row = bound_row[tid - 1], before_tile = bound_tile[tid - 1];
        if (before_row != row || before_tile != tile) mark = before_row == row && before_tile > 0 ? 1u : 0x10001u;
    }
    u32 all;
    const u32 upto = block_inclusive_scan(mark, count_totals, Sum(), all);
    counts[tid] = upto;
    __syncthreads();

    // Split row s, whose first cut is cut j (both counted from 0), has the slots j + s on: before
    // it, s rows and j cuts made j + s segments of split rows.
    const int cuts = static_cast<int>(upto & 0xFFFFu), splits = static_cast<int>(upto >> 16);
    if (mark >> 16) p.split_rows[splits - 1] = {row, cuts + splits - 2};
    const int num_split_rows = static_cast<int>(all >> 16), slots = static_cast<int>((all & 0xFFFFu) + (all >> 16));
    for (int s = num_split_rows + tid; s < parts; s += THREADS) p.split_rows[s] = {-1, slots};
    if (tid < parts) {
        const int next_row = bound_row[tid + 1], next_tile = bound_tile[tid + 1];
        const u32 next = counts[tid + 1];
        WorkPart w;
        w.begin_row = row, w.begin_tile = tile, w.end_row = next_row, w.end_tile = next_tile;
        // Past a cut: the slot after that cut's. At a row's start: a whole row, or the first slot of
        // the split row whose first cut ends this part.
        w.begin_slot = tile > 0 ? cuts + splits - 1 : (next_row == row && next_tile > 0 ? cuts + splits : -1);
        w.end_slot = next_row > row && next_tile > 0 ? static_cast<int>((next & 0xFFFFu) + (next >> 16)) - 2 : -1;
        w.unused[0] = w.unused[1] = 0;
        p.parts_out[tid] = w;
    }
}
