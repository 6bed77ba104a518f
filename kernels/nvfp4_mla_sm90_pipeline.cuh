// The Hopper decode kernel's pipelines: its mbarriers (their arrival counts and phases) and the K/V
// buffers between the producer and the consumers.
#pragma once

#include "nvfp4_mla_sm90_config.cuh"

// The address of mbarrier `index` (a Barrier) of the array at `bars` (this block's, or the peer's).
__device__ __forceinline__ u32 barrier_at(u32 bars, int index) { return bars + index * 8; }

// Tiles alternate between the two K/V buffers, as a producer warp's gather units between its two
// raw buffers: count n (run on across the block's items) is fill n >> 1 of buffer n & 1, the
// phase of that buffer's barriers whose parity fill_parity gives.
__device__ __forceinline__ int buffer_of(int n) { return n & 1; }
__device__ __forceinline__ u32 fill_parity(int n) { return (n >> 1) & 1; }

// Thread 0, before the block's first barrier: every mbarrier with the arrivals of its phase.
__device__ __forceinline__ void init_barriers(u32 bars) {
    for (int b = 0; b < 2; ++b) {
        mbar_init(barrier_at(bars, BAR_FULL + b), WARPGROUP_THREADS * PRODUCERS);  // every producer thread
    }
    for (int b = 0; b < 2; ++b) {
        // A consumer warp of each block of the cluster.
        mbar_init(barrier_at(bars, BAR_EMPTY + b), CONSUMER_THREADS / 32 * CLUSTER);
    }
    // Each thread of a producer warp: once itself, once when its copies land.
    for (int i = 0; i < 8 * PRODUCERS; ++i) mbar_init(barrier_at(bars, BAR_RAW + i), RAW_ARRIVALS);
    if constexpr (!NARROW) {
        mbar_init(barrier_at(bars, BAR_P_FULL), WARPGROUP_THREADS);   // consumer 0's threads
        mbar_init(barrier_at(bars, BAR_P_EMPTY), WARPGROUP_THREADS);  // consumer 1's threads
    }
    for (int b = 0; b < 2; ++b) mbar_init(barrier_at(bars, BAR_HELD + b), CONSUMER_THREADS);  // every consumer thread
    mbar_init(barrier_at(bars, BAR_Q), 1);  // consumer 0's thread 0, expecting the tensor copies' bytes
    fence_barrier_init();
}

// Every consumer thread of the block meets the others.
__device__ __forceinline__ void sync_consumers() { named_barrier(CONSUMERS_BARRIER, CONSUMER_THREADS); }

// The K/V buffers as a consumer warp takes and gives them back: this block's barriers, the peer
// block's (with a cluster: its producer stores into this block's buffers too) and the tiles' live
// masks.
struct KvPipeline {
    u32 bars;
    u32 peer_bars;
    const u32* tile_masks;

    // Waits until the producer has filled `tile`'s buffer, and gets the tile's live tokens (a bit
    // each). Lane 0, the lane that later gives the buffer back (release), reads the masks for its
    // warp: the reads and that arrival are one thread's.
    __device__ __forceinline__ u64 acquire(int tile, int lane) const {
        const int b = buffer_of(tile);
        mbar_wait(barrier_at(bars, BAR_FULL + b), fill_parity(tile));
        // The peer's half came with st.async (counted by the barrier's transactions): ordered before
        // this thread's wgmma reads (async proxy).
        if constexpr (CLUSTER == 2) fence_proxy_async();
        u64 live = 0;
        if (lane == 0) {
            const uint4 lo = *reinterpret_cast<const uint4*>(tile_masks + 8 * b);
            const uint4 hi = *reinterpret_cast<const uint4*>(tile_masks + 8 * b + 4);
            live = (lo.x | lo.y << 8 | lo.z << 16 | lo.w << 24) |
                static_cast<u64>(hi.x | hi.y << 8 | hi.z << 16 | hi.w << 24) << 32;
        }
        return __shfl_sync(NVFP4_FULL_MASK, live, 0);
    }

    // The warp is done with buffer b: one arrival a warp for the producer, and with a cluster for
    // the peer's producer too.
    __device__ __forceinline__ void release(int b, int lane) const {
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(barrier_at(bars, BAR_EMPTY + b));
            // Written out, as the producer's barrier addresses are (nvfp4_mla_sm90_producer.cuh).
            if constexpr (CLUSTER == 2) mbar_arrive_cluster(peer_bars + (BAR_EMPTY + b) * 8);
        }
    }

    // Every consumer thread, once the outputs staged in buffer b (the item's last tile) are out: its
    // reads are done (the held barrier, which the producer waits on before it stores there again),
    // and the warp gives the buffer back like a tile.
    __device__ __forceinline__ void release_held(int b, int lane) const {
        mbar_arrive(barrier_at(bars, BAR_HELD + b));
        release(b, lane);
    }

    // The first tile from `tile` on with a live token, acquiring and releasing those without one
    // (nothing to add; the other consumer skips them too; the item's last tile, `hold`, stays held
    // for the outputs); tile_end when none is left before it. Called holding no tile but `hold`:
    // it may wait for any other buffer.
    __device__ __forceinline__ int next_live(int tile, int tile_end, int hold, int lane, u64& live) const {
        for (; tile < tile_end; ++tile) {
            live = acquire(tile, lane);
            if (live != 0) break;  // warpgroup-uniform
            if (tile != hold) release(buffer_of(tile), lane);
        }
        return tile;
    }
};
