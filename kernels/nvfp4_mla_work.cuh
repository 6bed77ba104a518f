// The work list of a decode call (docs/format.md, "Plans"): what the scheduler
// (nvfp4_mla_scheduler.cu) writes and the attention and combine kernels walk. It counts a query
// row's work in tiles of its live entries: the sliding-window table's first swa_live entries, then
// the extra table's first extra_live, cut into tiles of the attention kernel's tile size (the
// last one partly live; a row with no live entry has one dead tile, whose outputs are the empty
// row's). The row's tiles, row after row, are dealt into parts of equal cost; a part's blocks
// walk its segments (the part's tiles of one row) in order.
#pragma once

#include "nvfp4_numerics.cuh"

// A length from its words, clamped to [0, k]: the low word at words[0] and, for int64 lengths
// (high_word 1), the high word at words[1]; for int32 ones (high_word 0) the low word's sign. One
// load a word and a select, no branch: the scheduling reads every row's lengths through it.
__device__ __forceinline__ i64 clamp_length(const int* words, int high_word, i64 k) {
    const int low = words[0], other = words[high_word];
    const int int64_mask = -high_word;
    const int high = (other & int64_mask) | ((low >> 31) & ~int64_mask);
    const i64 n = static_cast<i64>((static_cast<u64>(static_cast<u32>(high)) << 32) | static_cast<u32>(low));
    return max(i64(0), min(n, k));
}

// Live entries of a row of a pool's table: lens clamped to [0, k], or k without lens.
__device__ __forceinline__ i64 live_count(const void* lens, i64 lens_int64, i64 k, i64 row) {
    if (k == 0 || lens == nullptr) return k;
    return clamp_length(static_cast<const int*>(lens) + (row << lens_int64), static_cast<int>(lens_int64), k);
}

// A row's tiles: its live entries (at most 2^25, the host's cap on the tables' widths) in tiles of
// 2^tile_shift tokens, at least one.
__device__ __forceinline__ u32 live_tiles(u32 live, u32 tile_shift) {
    return live > 0 ? (live + (1u << tile_shift) - 1) >> tile_shift : 1u;
}

// A part: the tiles from (begin_row, begin_tile) up to, not including, (end_row, end_tile), in row
// order. A segment that holds every tile of its row writes the row's out and lse itself; the others
// write their partial outputs at a slot, which the combine merges. begin_slot is the slot of the
// part's first segment (-1: a whole row); end_slot, the slot of its last one when that begins a
// later row than begin_row and ends inside it (end_tile > 0); every other segment is a whole row.
struct WorkPart {
    int begin_row, begin_tile;
    int end_row, end_tile;
    int begin_slot, end_slot;
    int unused[2];  // zero: a part is 32 bytes, two aligned 16-byte loads
};

// A row whose tiles lie in more than one part: its segments' slots are first_slot on, one a
// segment in tile order, up to the next split row's first_slot. Past the last split row, row is
// -1 and first_slot the number of slots.
struct SplitRow {
    int row, first_slot;
};

// A part's tiles of one row, [tile_begin, tile_end), writing at `slot` (-1: the row's out and
// lse); `valid` false past the part's last one.
struct Segment {
    int row, tile_begin, tile_end, slot;
    bool valid;
};

// The part's segment from (row, tile_begin): the rest of the row's tiles in the part.
// tiles_of(row): a row's tiles (live_tiles of its lengths), read only for a row the part ends after.
template <typename TilesOf>
__device__ __forceinline__ Segment segment_from(const WorkPart& w, int row, int tile_begin, TilesOf tiles_of) {
    Segment s;
    s.row = row;
    s.tile_begin = tile_begin;
    s.valid = row < w.end_row || (row == w.end_row && tile_begin < w.end_tile);
    s.tile_end = row == w.end_row ? w.end_tile : (s.valid ? static_cast<int>(tiles_of(row)) : 0);
    s.slot = row == w.begin_row ? w.begin_slot : (row == w.end_row ? w.end_slot : -1);
    return s;
}

// The part's segments in the order its blocks walk them (decode_scheduler.segments): the first,
// then each one's next, while valid.
template <typename TilesOf>
__device__ __forceinline__ Segment first_segment(const WorkPart& w, TilesOf tiles_of) {
    return segment_from(w, w.begin_row, w.begin_tile, tiles_of);
}

template <typename TilesOf>
__device__ __forceinline__ Segment next_segment(const WorkPart& w, const Segment& s, TilesOf tiles_of) {
    return segment_from(w, s.row + 1, 0, tiles_of);
}

// Part q of the list at `work` (two aligned 16-byte loads).
__device__ __forceinline__ WorkPart load_part(const void* work, u32 q) {
    const int4* const at = static_cast<const int4*>(work) + 2 * q;
    const int4 a = at[0], b = at[1];
    WorkPart w;
    w.begin_row = a.x, w.begin_tile = a.y, w.end_row = a.z, w.end_tile = a.w;
    w.begin_slot = b.x, w.end_slot = b.y, w.unused[0] = w.unused[1] = 0;
    return w;
}
