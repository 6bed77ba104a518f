// The Hopper decode kernel's K/V buffers between the producer and the consumers: a consumer's
// acquire and release of a tile's buffer, and of the buffer that holds an item's staged outputs.
#pragma once

#include "nvfp4_mla_sm90_config.cuh"

// A consumer waits until the producer has filled K/V buffer tile & 1 with `tile`, and gets the
// tile's live tokens (a bit each). Lane 0, the lane that later gives the buffer back
// (release_tile), reads the masks for its warp: the reads and that arrival are one thread's.
__device__ __forceinline__ u64 acquire_tile(u32 bars, const u32* tile_masks, int tile, int lane) {
    const int b = tile & 1;
    mbar_wait(bars + (BAR_FULL + b) * 8, (tile >> 1) & 1);
    // The peer's half came with st.async (counted by the barrier's transactions): ordered before
    // this thread's wgmma reads (async proxy).
    if constexpr (CLUSTER == 2) fence_proxy_async();
    u64 live = 0;
    if (lane == 0) {
        const uint4 lo = *reinterpret_cast<const uint4*>(tile_masks + 8 * b);
        const uint4 hi = *reinterpret_cast<const uint4*>(tile_masks + 8 * b + 4);
        live = (lo.x | lo.y << 8 | lo.z << 16 | lo.w << 24) | static_cast<u64>(hi.x | hi.y << 8 | hi.z << 16 | hi.w << 24) << 32;
    }
    return __shfl_sync(NVFP4_FULL_MASK, live, 0);
}

// A consumer warp is done with K/V buffer b: one arrival a warp for the producer, and with a
// cluster for the peer's producer too (it stores into this block's buffer).
__device__ __forceinline__ void release_tile(u32 bars, u32 peer_bars, int b, int lane) {
    __syncwarp();
    if (lane == 0) {
        mbar_arrive(bars + (BAR_EMPTY + b) * 8);
        if constexpr (CLUSTER == 2) mbar_arrive_cluster(peer_bars + (BAR_EMPTY + b) * 8);
    }
}

// Every consumer thread, once the outputs staged in K/V buffer b (the item's last tile) are out:
// its reads are done (the held barrier, which the producer waits on before it stores there again),
// and the warp gives the buffer back like a tile.
__device__ __forceinline__ void release_held(u32 bars, u32 peer_bars, int b, int lane) {
    mbar_arrive(bars + (BAR_HELD + b) * 8);
    release_tile(bars, peer_bars, b, lane);
}

// Consumer 0: the first tile from `tile` on with a live token, acquiring and releasing those
// without one (nothing to add; consumer 1 skips them too; the item's last tile, `hold`, stays
// held for the outputs); tile_end when none is left before it. Called holding no tile but `hold`:
// it may wait for any other buffer.
__device__ __forceinline__ int next_live_tile(u32 bars, u32 peer_bars, const u32* tile_masks, int tile, int tile_end,
                                              int hold, int lane, u64& live) {
    for (; tile < tile_end; ++tile) {
        live = acquire_tile(bars, tile_masks, tile, lane);
        if (live != 0) break;  // warpgroup-uniform
        if (tile != hold) release_tile(bars, peer_bars, tile & 1, lane);
    }
    return tile;
}
