// The work items of a decode kernel whose blocks walk them in turn (the Hopper kernel).
#pragma once

#include "nvfp4_mla_sm90_config.cuh"

// The block's work items: (query row, head tile, split, dim part) in the order of a grid of a block
// each (the head tile fastest, then the part), item blockIdx.x, then every gridDim.x-th. The host
// launches at most as many blocks as the GPU holds at once, so a block that finishes an item goes
// on to the next one with its barriers, buffers and scale table set up and its producer already
// gathering: the fill and the output phase of a block's items overlap. With a cluster the grid is
// even, so both blocks of a cluster walk neighbouring items: the two head tiles of the same (row,
// split, part), or with one head tile the two parts of the same (row, split).
struct Item {
    i64 row, head0, split;
    int part, tile_begin, num_tiles;
};

__device__ __forceinline__ Item item_at(const Params& p, u32 item, u32 head_tiles, int total_tiles) {
    const u32 num_splits = static_cast<u32>(p.num_splits);
    Item it;
    const u32 rest = item / head_tiles;  // (row, split, part), the part fastest
    it.head0 = static_cast<i64>(item % head_tiles * HT);
    it.part = static_cast<int>(rest % DIM_PARTS);
    it.split = static_cast<i64>(rest / DIM_PARTS % num_splits);
    it.row = static_cast<i64>(rest / DIM_PARTS / num_splits);  // batch * q_len + position
    it.tile_begin = static_cast<int>(it.split * p.tiles_per_split);
    it.num_tiles = max(min(it.tile_begin + static_cast<int>(p.tiles_per_split), total_tiles) - it.tile_begin, 0);
    return it;
}
