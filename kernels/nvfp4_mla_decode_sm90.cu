// Sparse MLA decode attention on Hopper (sm_90a) through wgmma, read straight from the NVFP4
// records: the kernel's entry, which sets up the block and runs each warpgroup's role over the
// block's work items. docs/kernels/decode_sm90.md describes the kernel; its parts are the
// nvfp4_mla_sm90_*.cuh headers.
#include "nvfp4_mla_sm90_consumer.cuh"
#include "nvfp4_mla_sm90_narrow.cuh"
#include "nvfp4_mla_sm90_producer.cuh"
#include "nvfp4_mla_schedule.cuh"

#if CLUSTER == 2
#define CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#else
#define CLUSTER_DIMS
#endif

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(THREADS, 1) nvfp4_mla_decode_sm90(const __grid_constant__ Params p) {
    extern __shared__ __align__(1024) u8 smem[];  // Q's swizzle: 1024-byte periods
    const int tid = threadIdx.x;
    // Items fit 31 bits: at 2^31 items q alone would pass 1 TB (a row has at least 1 KB; two dim
    // parts double the items), and with splits the workspace.
    const u32 head_tiles = static_cast<u32>((p.num_heads + HT - 1) / HT);
    const u32 items = static_cast<u32>(p.rows) * head_tiles * DIM_PARTS * static_cast<u32>(p.num_splits);
    // Tile indices fit an int: the host caps a table's width (validation.decode).
    const int total_tiles = static_cast<int>((p.swa.k + p.extra.k + BN - 1) / BN);

    u32* const scale_pairs = reinterpret_cast<u32*>(smem + SM_SCALES);
    fill_scale_pairs(scale_pairs, tid, THREADS);
    if (tid == 0) init_barriers(shared_address(smem + SM_BARRIERS));
    const u32 rank = CLUSTER == 2 ? cluster_rank() : 0u;  // the item's parity: its head tile's, or its part's
    const u32 peer_bars = CLUSTER == 2 ? cluster_address(shared_address(smem + SM_BARRIERS), rank ^ 1u) : 0u;
    if constexpr (CLUSTER == 2)
        cluster_sync();
    else
        __syncthreads();
    // The stream's next kernel (the combine, or the next call) may launch now, except after many
    // splits: then the combine's blocks, each long, would pile onto the few SMs this grid leaves free
    // and end last (docs/performance.md#programmatic-dependent-launch).
    if (p.num_splits <= EARLY_DEPENDENTS_MAX_SPLITS) launch_dependents();
    wait_for_prior_grids();  // the setup above touched no global memory

    const int warpgroup = tid >> 7;  // tid / WARPGROUP_THREADS (a shift: tid is not negative)
    // The block's tiles of its earlier items, modulo 4: a tile's K/V buffer and phase, and a unit's
    // raw buffer and phase, are the low two bits of their counts. And the consumers' count of live
    // tiles, whose parity is the phase of P.
    int tiles_before = 0;
    u32 processed = 0;
    if (warpgroup >= CONSUMERS) {  // a producer warpgroup
        if constexpr (!NARROW) regs_decrease<REGS_PRODUCER>();
        // Its share of every tile: with a cluster the unit of the block's rank, with NARROW its own
        // unit of the block's tiles, else both units.
        const int share = NARROW ? warpgroup - CONSUMERS : static_cast<int>(rank);
        u32 held = 0;
        for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
            const Item it = item_at(p, item, head_tiles, total_tiles);
            produce_item(p, smem, it.row, it.tile_begin, it.num_tiles, UNITS_PER_TILE * tiles_before, tiles_before,
                         tid - WARPGROUP_THREADS * warpgroup, share, held);
            tiles_before = (tiles_before + it.num_tiles) & 3;
            held |= 1u << ((tiles_before + 3) & 1);  // the item's last tile (at least one) holds its outputs
        }
    } else if (warpgroup == 0) {
        if constexpr (!NARROW) regs_increase<REGS_CONSUMER0>();
        Item it = item_at(p, blockIdx.x, head_tiles, total_tiles);
        u32 ordinal = 0;
        for (u32 item = blockIdx.x; item < items; item += gridDim.x, ++ordinal) {
            const bool last = item + gridDim.x >= items;
            const Item next = last ? it : item_at(p, item + gridDim.x, head_tiles, total_tiles);
            if constexpr (NARROW)
                consume_item_narrow(p, smem, it.row, it.head0, it.split, tiles_before, it.num_tiles, ordinal, last,
                                    next.row, next.head0, processed, tid);
            else
                consume_item0(p, smem, it.row, it.head0, it.split, it.part, tiles_before, it.num_tiles, ordinal, last,
                              next.row, next.head0, processed, tid, peer_bars);
            tiles_before = (tiles_before + it.num_tiles) & 3;
            it = next;
        }
    } else if constexpr (!NARROW) {  // consumer 1
        regs_decrease<REGS_CONSUMER1>();
        for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
            const Item it = item_at(p, item, head_tiles, total_tiles);
            consume_item1(p, smem, it.row, it.head0, it.split, it.part, tiles_before, it.num_tiles, processed,
                          tid - WARPGROUP_THREADS, peer_bars);
            tiles_before = (tiles_before + it.num_tiles) & 3;
        }
    }
    if constexpr (CLUSTER == 2) cluster_sync();  // the peer may still store into this block or arrive on its barriers
}
