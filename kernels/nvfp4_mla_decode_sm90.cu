// Sparse MLA decode attention on Hopper (sm_90a) through wgmma, read straight from the NVFP4
// records: the kernel's entry, which sets up the block and runs each warpgroup's role over the
// segments of the block's part of the work list. docs/kernels/decode_sm90.md describes the kernel;
// its parts are the nvfp4_mla_sm90_*.cuh headers.
#include "nvfp4_mla_sm90_consumer.cuh"
#include "nvfp4_mla_sm90_narrow.cuh"
#include "nvfp4_mla_sm90_producer.cuh"
#include "nvfp4_mla_schedule.cuh"

#if CLUSTER == 2
#define CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#else
#define CLUSTER_DIMS
#endif

static_assert(SCHEDULE_BYTES <= sizeof(SharedStorage::q), "a block's own list is dealt in its Q buffer");

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(THREADS, 1)
    nvfp4_mla_decode_sm90(const __grid_constant__ Params p) {
    extern __shared__ __align__(1024) u8 smem[];  // Q's swizzle: 1024-byte periods
    const int tid = threadIdx.x;
    // The block's part of the work list and its (head tile, dim part), the head tile fastest: with
    // a cluster both blocks take the same part, the two head tiles of its rows, or with one head
    // tile the two halves of their output dims. A block walks its part's segments (its tiles of one
    // row each) in turn, with its barriers, buffers and scale table set up and its producer
    // gathering a segment's first tiles while its consumers finish the one before.
    const u32 head_tiles = static_cast<u32>((p.num_heads + HT - 1) / HT);
    const u32 part_index = blockIdx.x / (head_tiles * DIM_PARTS), rest = blockIdx.x % (head_tiles * DIM_PARTS);
    const i64 head0 = static_cast<i64>(rest % head_tiles * HT);
    const int part = static_cast<int>(rest / head_tiles);

    u32* const scale_pairs = reinterpret_cast<u32*>(smem + SM_SCALES);
    fill_scale_pairs(scale_pairs, tid, THREADS);
    if (tid == 0) init_barriers(shared_address(smem + SM_BARRIERS));
    const u32 rank = CLUSTER == 2 ? cluster_rank() : 0u;  // the block's parity: its head tile's, or its part's
    const u32 peer_bars = CLUSTER == 2 ? cluster_address(shared_address(smem + SM_BARRIERS), rank ^ 1u) : 0u;
    if constexpr (CLUSTER == 2)
        cluster_sync();
    else
        __syncthreads();
    // The stream's next kernel (the combine, or the next call) may launch now, except after more
    // than EARLY_DEPENDENTS_MAX_SPLITS splits of a row (decode_sm90.py says why).
    // The host's list was written before the call: its part loads under the wait. The
    // scheduler's comes from the stream's previous kernel: after it; so do the lengths a block
    // deals its own list from, in its Q buffer, which only its own first Q copy writes (a peer's
    // producer may already store into its K/V buffers): the block's threads meet before that copy.
    const bool early = p.static_list != 0;
    if (p.num_splits <= EARLY_DEPENDENTS_MAX_SPLITS) launch_dependents();
    if (!early) wait_for_prior_grids();
    const WorkPart work = p.own_list ? schedule_own_part(p, smem + SM_Q, part_index) : load_part(p.work, part_index);
    if (early) wait_for_prior_grids();  // the setup above touched no memory a kernel before this one writes
    if (p.own_list) {
        fence_proxy_async();  // the dealing's stores, before the tensor copy's into the same bytes
        __syncthreads();
    }
    const auto tiles_of = [&](int row) { return row_tiles(p, row, TILE_SHIFT); };

    const int warpgroup = tid >> 7;  // tid / WARPGROUP_THREADS (a shift: tid is not negative)
    // The block's tiles of its earlier segments, modulo 4: a tile's K/V buffer and phase, and a
    // unit's raw buffer and phase, are the low two bits of their counts. And the consumers' count
    // of live tiles, whose parity is the phase of P.
    int tiles_before = 0;
    u32 processed = 0;
    if (warpgroup >= CONSUMERS) {  // a producer warpgroup
        if constexpr (!NARROW) regs_decrease<REGS_PRODUCER>();
        // Its share of every tile: with a cluster the unit of the block's rank, with NARROW its own
        // unit of the block's tiles, else both units.
        const int share = NARROW ? warpgroup - CONSUMERS : static_cast<int>(rank);
        u32 held = 0;
        for (Segment s = first_segment(work, tiles_of); s.valid; s = next_segment(work, s, tiles_of)) {
            const int num_tiles = s.tile_end - s.tile_begin;
            produce_item(p, smem, s.row, s.tile_begin, num_tiles, UNITS_PER_TILE * tiles_before, tiles_before,
                         tid - WARPGROUP_THREADS * warpgroup, share, held);
            tiles_before = (tiles_before + num_tiles) & 3;
            held |= 1u << ((tiles_before + 3) & 1);  // the segment's last tile (at least one) holds its outputs
        }
    } else if (warpgroup == 0) {
        if constexpr (!NARROW) regs_increase<REGS_CONSUMER0>();
        u32 ordinal = 0;
        for (Segment s = first_segment(work, tiles_of); s.valid; ++ordinal) {
            const Segment next = next_segment(work, s, tiles_of);
            const int num_tiles = s.tile_end - s.tile_begin;
            if constexpr (NARROW)
                consume_item_narrow(p, smem, s.row, head0, s.slot, tiles_before, num_tiles, ordinal, !next.valid,
                                    next.row, processed, tid);
            else
                consume_item0(p, smem, s.row, head0, s.slot, part, tiles_before, num_tiles, ordinal, !next.valid,
                              next.row, processed, tid, peer_bars);
            tiles_before = (tiles_before + num_tiles) & 3;
            s = next;
        }
    } else if constexpr (!NARROW) {  // consumer 1
        regs_decrease<REGS_CONSUMER1>();
        for (Segment s = first_segment(work, tiles_of); s.valid; s = next_segment(work, s, tiles_of)) {
            const int num_tiles = s.tile_end - s.tile_begin;
            consume_item1(p, smem, s.row, head0, s.slot, part, tiles_before, num_tiles, processed,
                          tid - WARPGROUP_THREADS, peer_bars);
            tiles_before = (tiles_before + num_tiles) & 3;
        }
    }
    if constexpr (CLUSTER == 2) cluster_sync();  // the peer may still store into this block or arrive on its barriers
}
