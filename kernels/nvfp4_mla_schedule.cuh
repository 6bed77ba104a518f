// The scheduling of a decode call's work list (nvfp4_mla_work.cuh) by one block of THREADS
// threads: from the rows' live lengths, the rows' tiles dealt into `parts` parts of equal cost,
// and the rows split between parts with their partial slots, or whole rows a part where that
// costs no part more than the cut list's bound and the combine's cost (always with whole_rows).
// The scheduler kernel (nvfp4_mla_scheduler.cu) runs it for a list that calls reuse; an attention
// kernel runs it in each block for a list of its own call. ops/decode_scheduler.py holds its CPU
// model (the same integer results); docs/kernels/scheduler.md describes the steps.
#pragma once

#include "nvfp4_mla_ptx.cuh"
#include "nvfp4_mla_work.cuh"

static_assert(THREADS % 32 == 0 && THREADS <= 1024,
              "whole warps, a thread a boundary between parts: up to THREADS - 1 parts");

namespace schedule_detail {

constexpr int WARPS = THREADS / 32;
constexpr int LOADS = ROW_LOADS;  // decode_scheduler.ROW_LOADS: rows whose lengths a thread loads at once

// An attention block runs this once a call before its first tile, so it is a short chain of
// dependent steps (five barriers; ballots, not block scans, where the values are bits) in little
// machine code (loops not unrolled, the lengths' loads without branches): docs/kernels/scheduler.md.

// The rows' lengths, as both kinds of Params hold them.
struct Rows {
    const void *swa_lens, *extra_lens;
    i64 swa_lens_int64, extra_lens_int64, swa_k, extra_k, rows;
};

// A table's live counts as the scheduling reads them, with no branch on whether it has lengths or
// of which type (the compiler would copy the loads' loop for each case, and load a high word before
// its low one): row r's words at words[r * stride] (clamp_length). Without lengths (or k = 0)
// words is a thread's own INT_MAX, at stride 0: clamped to k.
struct TableLengths {
    const int* words;
    int stride, high_word;
    i64 k;

    __device__ __forceinline__ u32 live(int row) const {
        return static_cast<u32>(clamp_length(words + row * stride, high_word, k));
    }
};

__device__ __forceinline__ TableLengths table_lengths(const void* lens, i64 lens_int64, i64 k, const int* unlimited) {
    if (k == 0 || lens == nullptr) return {unlimited, 0, 0, k};
    return {static_cast<const int*>(lens), 1 + static_cast<int>(lens_int64), static_cast<int>(lens_int64), k};
}

// A row's cost: its live tiles (at least one) and the cost of a segment besides its tiles. In 32
// bits: the host caps a table's width at 2^24 entries.
struct Costs {
    TableLengths swa, extra;
    u32 tile_shift, segment_cost;

    __device__ __forceinline__ u32 of(int row) const {
        return live_tiles(swa.live(row) + extra.live(row), tile_shift) + segment_cost;
    }

    // The costs of rows r .. r + LOADS - 1 below r_end (0 past it), their lengths loaded together:
    // a thread's rows are a contiguous run, and one at a time their loads would wait in turn. From
    // `kept` instead where `from_kept`.
    __device__ __forceinline__ void load(int r, int r_end, const u32* kept, bool from_kept, u32 (&c)[LOADS]) const {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) c[i] = r + i >= r_end ? 0u : (from_kept ? kept[r + i] : of(r + i));
    }

    // The same costs summed, each also written at its row of `kept` unless that is null or they
    // came from there. The stores come after every load: the loads are generic (a table without
    // lengths is read from shared memory), so a store between them would order them.
    __device__ __forceinline__ u32 sum(int r, int r_end, u32* kept, bool from_kept) const {
        u32 c[LOADS];
        load(r, r_end, kept, from_kept, c);
        u32 total = 0;
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            if (kept != nullptr && !from_kept && r + i < r_end) kept[r + i] = c[i];
            total += c[i];
        }
        return total;
    }
};

// A thread's rows: a contiguous run [begin, end), so the prefix of the costs is one block sum.
struct Run {
    int begin, end;
};

__device__ __forceinline__ Run thread_rows(int rows) {
    const int per_thread = (rows + THREADS - 1) / THREADS;
    const int begin = min(rows, static_cast<int>(threadIdx.x) * per_thread);
    return {begin, min(rows, begin + per_thread)};
}

// No 64-bit division here: it is a call, whose stack frame ptxas reports as a spill on sm_80.
// ceil(a / d) for a >= 0 and 0 < d < 2^16: one 32-bit division where a fits, else a long division
// in 16-bit digits, each step in 32 bits.
__device__ __forceinline__ i64 ceil_div_small_divisor(i64 a, u32 d) {
    if ((a >> 32) == 0) {
        const u32 q = static_cast<u32>(a) / d;
        return q + (static_cast<u32>(a) != q * d);
    }
    u64 q = 0;
    u32 r = 0;
#pragma unroll 1
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
#pragma unroll 1
    for (i64 step = i64(1) << 10; step > 0; step >>= 1)
        if ((below + step) * b < a) below += step;
    return below + 1;
}

// A warp's inclusive sum of one value a lane.
__device__ __forceinline__ i64 warp_inclusive_sum(i64 v) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int o = 1; o < 32; o <<= 1) {
        const i64 x = __shfl_up_sync(NVFP4_FULL_MASK, v, o);
        if (lane >= o) v += x;
    }
    return v;
}

// The block's inclusive sum of one value a thread, and the whole sum, through one barrier: each
// warp sums the warps' totals (`warp_totals`, WARPS values) itself.
struct Scan {
    i64 upto, total;
};

__device__ __forceinline__ Scan block_inclusive_sum(i64 v, i64* warp_totals) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_inclusive_sum(v);
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    const i64 totals = warp_inclusive_sum(lane < WARPS ? warp_totals[lane] : i64(0));
    const i64 before = __shfl_sync(NVFP4_FULL_MASK, totals, max(warp - 1, 0));
    return {warp > 0 ? before + v : v, __shfl_sync(NVFP4_FULL_MASK, totals, WARPS - 1)};
}

// The lanes of a warp up to and including this one.
__device__ __forceinline__ u32 lanes_up_to_mine() { return (2u << (threadIdx.x & 31)) - 1u; }

// A boundary: its row, its tile, and where its row's costs begin.
struct Bound {
    int row, tile;
    i64 row_start;
};

// The rows whose costs a block keeps in shared memory: up to LOADS a thread, one batch of loads.
constexpr int KEPT_ROWS = THREADS * LOADS;

}  // namespace schedule_detail

// The shared memory of a block's scheduling. Boundary q (0 <= q <= parts) begins part q and ends
// part q - 1.
struct ScheduleScratch {
    // The rows' costs a list was dealt from, where the rows fit: a thread's own run of rows.
    u32 row_costs[schedule_detail::KEPT_ROWS];
    // The first boundary inside a row, marked with the row and the cost its row begins at; -1: no
    // row's first.
    int mark_row[THREADS];
    i64 mark_start[THREADS];
    int unlimited[THREADS];                    // a thread's length of a table without lengths (TableLengths)
    i64 warp_costs[schedule_detail::WARPS];    // each warp's sum of its threads' costs
    u32 mark_ballots[schedule_detail::WARPS];  // each warp's marked boundaries, a bit a thread
    u32 cut_counts[schedule_detail::WARPS];    // each warp's cuts and first cuts (as `counted` below)
};

// What a thread of the dealing block holds of the list: part threadIdx.x (valid below the parts),
// the split row whose first cut ends that part (at index `split`; -1: none), and the list's numbers
// of split rows and slots.
struct Dealt {
    WorkPart part;
    SplitRow first;
    int split, split_rows, slots;
};

// The rows' costs as a block reads them from the lengths (the thread's own INT_MAX in `x` for a
// table without lengths).
__device__ __forceinline__ schedule_detail::Costs row_costs(const Schedule& s, const schedule_detail::Rows& rows_in,
                                                            ScheduleScratch& x) {
    using namespace schedule_detail;
    x.unlimited[threadIdx.x] = 0x7FFFFFFF;
    return {table_lengths(rows_in.swa_lens, rows_in.swa_lens_int64, rows_in.swa_k, &x.unlimited[threadIdx.x]),
            table_lengths(rows_in.extra_lens, rows_in.extra_lens_int64, rows_in.extra_k, &x.unlimited[threadIdx.x]),
            static_cast<u32>(s.tile_shift), static_cast<u32>(s.segment_cost)};
}

// The list of a call's rows in s.parts parts (at most THREADS - 1), every thread of the block
// taking part (it holds __syncthreads); it writes no global memory. Where the rows fit
// (KEPT_ROWS), their costs are kept in x.row_costs, read from the lengths or, with `from_kept`,
// already there; else read from the lengths twice (the second pass from the L1).
__device__ __forceinline__ Dealt schedule_parts(const Schedule& s, const schedule_detail::Rows& rows_in,
                                                ScheduleScratch& x, bool from_kept) {
    using namespace schedule_detail;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, parts = static_cast<int>(s.parts);
    x.mark_row[tid] = -1;
    const Costs costs_of = row_costs(s, rows_in, x);
    const int rows = static_cast<int>(rows_in.rows);  // the list's rows are int
    u32* const kept = rows <= KEPT_ROWS ? x.row_costs : nullptr;

    // A thread's run of rows, LOADS rows at a time, summed in one block sum.
    const Run run = thread_rows(rows);
    i64 mine = 0;
#pragma unroll 1
    for (int r = run.begin; r < run.end; r += LOADS) mine += costs_of.sum(r, run.end, kept, from_kept);
    const Scan costs = block_inclusive_sum(mine, x.warp_costs);
    const i64 total = costs.total;
    i64 start = costs.upto - mine;

    // Part q takes the costs [q payload, (q + 1) payload): boundary q lies at cost q payload, in the
    // row whose costs hold it, or at the end. Each row marks its first boundary.
    const i64 payload = ceil_div_small_divisor(total, static_cast<u32>(parts));
    i64 q = boundary_at(start, payload);  // the first boundary at or past `start`
#pragma unroll 1
    for (int r = run.begin; r < run.end; ++r) {
        const i64 end = start + (kept != nullptr ? x.row_costs[r] : costs_of.of(r));
        if (q * payload < end) {
            x.mark_row[q] = r;
            x.mark_start[q] = start;
            if (r + 1 < run.end) q = boundary_at(end, payload);  // the next row's first boundary
        }
        start = end;
    }
    __syncthreads();

    // A boundary's row is the latest mark at or before it: in this thread's warp, or else in the
    // latest earlier warp with a mark (boundary 0 always has one), from the warps' ballots.
    const u32 marks = __ballot_sync(NVFP4_FULL_MASK, tid <= parts && x.mark_row[tid] >= 0);
    if (lane == 0) x.mark_ballots[warp] = marks;
    __syncthreads();
    const u32 warp_marks = lane < WARPS ? x.mark_ballots[lane] : 0u;
    const u32 earlier_warps = __ballot_sync(NVFP4_FULL_MASK, warp_marks != 0) & ((1u << warp) - 1u);
    const int earlier = earlier_warps != 0 ? 31 - __clz(earlier_warps) : 0;
    const u32 earlier_marks = __shfl_sync(NVFP4_FULL_MASK, warp_marks, earlier);
    const u32 mine_up_to = marks & lanes_up_to_mine();
    const int marked = mine_up_to != 0 ? warp * 32 + 31 - __clz(mine_up_to) : earlier * 32 + 31 - __clz(earlier_marks);

    // Boundaries tid and tid + 1 (this thread's part's ends), each with its latest mark; a tile is
    // counted after its row's segment cost.
    const auto bound_at = [&](int b, int mark) -> Bound {
        const i64 at = b * payload;
        if (b > parts || at >= total) return {rows, 0, total};
        const i64 row_start = x.mark_start[mark];
        return {x.mark_row[mark], static_cast<int>(max(at - row_start - s.segment_cost, i64(0))), row_start};
    };
    Bound here = bound_at(tid, marked);
    Bound next = bound_at(tid + 1, tid < parts && x.mark_row[tid + 1] >= 0 ? tid + 1 : marked);

    // Whole rows (every boundary moved back to its row's start, so no row is cut) where the costliest
    // part they make costs at most a cut list's bound (the payload and a segment) and the combine's
    // cost, or always with whole_rows.
    const i64 bound = payload + s.segment_cost + s.combine_cost;
    if (s.whole_rows || !__syncthreads_or(tid < parts && next.row_start - here.row_start > bound))
        here.tile = next.tile = 0;

    // Boundary tid + 1 is a cut where it lies inside a row at a tile no earlier boundary took, and
    // its row's first cut where boundary tid is not inside that row. Counted up to each boundary:
    // the cuts in the low 16 bits, the first cuts (the split rows) in the high 16.
    u32 cut = 0;  // 1: a cut; 0x10001: its row's first
    if (tid < parts && next.tile > 0 && (here.row != next.row || here.tile != next.tile))
        cut = here.row == next.row && here.tile > 0 ? 1u : 0x10001u;
    const u32 cuts_of_warp = __ballot_sync(NVFP4_FULL_MASK, cut != 0);
    const u32 firsts_of_warp = __ballot_sync(NVFP4_FULL_MASK, cut >> 16);
    if (lane == 0) x.cut_counts[warp] = __popc(cuts_of_warp) | (__popc(firsts_of_warp) << 16);
    __syncthreads();
    const u32 warp_counted = lane < WARPS ? x.cut_counts[lane] : 0u;
    const u32 all = __reduce_add_sync(NVFP4_FULL_MASK, warp_counted);
    const u32 counted_next = __reduce_add_sync(NVFP4_FULL_MASK, lane < warp ? warp_counted : 0u) +
        __popc(cuts_of_warp & lanes_up_to_mine()) +
        (__popc(firsts_of_warp & lanes_up_to_mine()) << 16);  // up to boundary tid + 1
    const u32 counted = counted_next - cut;                   // up to boundary tid
    const int cuts = static_cast<int>(counted & 0xFFFFu), splits = static_cast<int>(counted >> 16);
    const int cuts_next = static_cast<int>(counted_next & 0xFFFFu), splits_next = static_cast<int>(counted_next >> 16);

    // Split row s, whose first cut is cut j (both counted from 0), has the slots j + s on: before
    // it, s rows and j cuts made j + s segments of split rows.
    Dealt d = {};
    d.first = {next.row, cuts_next + splits_next - 2};
    d.split = cut >> 16 ? splits_next - 1 : -1;
    d.split_rows = static_cast<int>(all >> 16);
    d.slots = static_cast<int>((all & 0xFFFFu) + (all >> 16));
    if (tid < parts) {
        WorkPart& w = d.part;
        w.begin_row = here.row, w.begin_tile = here.tile, w.end_row = next.row, w.end_tile = next.tile;
        // Past a cut: the slot after that cut's. At a row's start: a whole row, or the first slot of
        // the split row whose first cut ends this part.
        w.begin_slot = here.tile > 0 ? cuts + splits - 1 : (next.row == here.row && next.tile > 0 ? cuts + splits : -1);
        w.end_slot = next.row > here.row && next.tile > 0 ? cuts_next + splits_next - 2 : -1;
    }
    return d;
}

// After the dependent-launch wait: whether a row's cost differs from the one the list was dealt
// from (its lengths changed since the block read them), keeping the new one. Each thread reads its
// own run of rows (at most LOADS where the costs are kept), the costs it kept itself.
__device__ __forceinline__ bool kept_costs_changed(const Schedule& s, const schedule_detail::Rows& rows_in,
                                                   ScheduleScratch& x) {
    using namespace schedule_detail;
    const Costs costs_of = row_costs(s, rows_in, x);
    const Run run = thread_rows(static_cast<int>(rows_in.rows));
    u32 c[LOADS];
    costs_of.load(run.begin, run.end, nullptr, false, c);
    bool changed = false;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
        if (run.begin + i < run.end) {
            changed |= c[i] != x.row_costs[run.begin + i];
            x.row_costs[run.begin + i] = c[i];
        }
    }
    return changed;
}

// The scheduler kernel's list, dealt across the wait for the stream's previous kernel, which may
// write the lengths. Where the rows' costs fit in shared memory, the block deals it from the
// lengths as they are before the wait, while that kernel ends, then waits, reads every row's
// lengths again and deals again only where a cost changed, from the new costs; else it waits
// first. The same list either way: a list is a function of the rows' costs. The attention
// kernels' blocks deal theirs after the wait: dealt before it, the check after it made a decode
// step slower, its dealing ending about when the writer before it does (docs/performance_history.md).
__device__ __forceinline__ Dealt schedule_across_wait(const Schedule& s, const schedule_detail::Rows& rows,
                                                      ScheduleScratch& x) {
    const bool early = rows.rows <= schedule_detail::KEPT_ROWS;
    if (!early) wait_for_prior_grids();
    bool from_kept = false;
    Dealt d;
#pragma unroll 1
    for (;;) {  // at most twice, one copy of the dealing's code
        d = schedule_parts(s, rows, x, from_kept);
        if (!early || from_kept) return d;
        wait_for_prior_grids();
        if (!__syncthreads_or(kept_costs_changed(s, rows, x))) return d;
        from_kept = true;
    }
}

// The list's records, written by the dealing block: each part's, each first cut's split row, and
// (-1, slots) past the last split row.
__device__ __forceinline__ void write_list(const Dealt& d, u32 parts, WorkPart* parts_out, SplitRow* split_rows) {
    if (threadIdx.x < parts) parts_out[threadIdx.x] = d.part;
    if (d.split >= 0) split_rows[d.split] = d.first;
    for (u32 r = d.split_rows + threadIdx.x; r < parts; r += THREADS) split_rows[r] = {-1, d.slots};
}

// An attention kernel's own list (Params::own_list): each block deals the whole list after the
// wait and takes its part; block 0 also writes the list at `work`, where the combine reads the
// split rows. `scratch`: shared memory the block writes nothing else to until the caller's next
// barrier, with room for SCHEDULE_BYTES. Not inlined: inlined, the attention kernels ran slower
// also on calls that do not take this path (docs/performance_history.md).
constexpr int SCHEDULE_BYTES = sizeof(ScheduleScratch) + sizeof(WorkPart);

__device__ __noinline__ WorkPart schedule_own_part(const Schedule s, const schedule_detail::Rows rows, const void* work,
                                                   u8* scratch, u32 part) {
    ScheduleScratch& x = *reinterpret_cast<ScheduleScratch*>(scratch);
    WorkPart* const mine = reinterpret_cast<WorkPart*>(scratch + sizeof(ScheduleScratch));
    const u32 parts = static_cast<u32>(s.parts);
    const Dealt d = schedule_parts(s, rows, x, false);
    if (blockIdx.x == 0) {  // the workspace the host passes as the list (const for the blocks that only read it)
        WorkPart* const list = static_cast<WorkPart*>(const_cast<void*>(work));
        write_list(d, parts, list, reinterpret_cast<SplitRow*>(list + parts));
    }
    if (threadIdx.x == part) *mine = d.part;
    __syncthreads();
    return *mine;
}

// The same for an attention kernel's Params.
template <typename AttendParams>
__device__ __forceinline__ WorkPart schedule_own_part(const AttendParams& p, u8* scratch, u32 part) {
    const schedule_detail::Rows rows = {p.swa.lens, p.extra.lens, p.swa.lens_int64, p.extra.lens_int64, p.swa.k,
                                        p.extra.k,  p.rows};
    return schedule_own_part(p.schedule, rows, p.work, scratch, part);
}
