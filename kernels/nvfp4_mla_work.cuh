// The work list of a decode call (docs/format.md, "Plans"): what the scheduler
// (nvfp4_mla_scheduler.cu) writes and the attention and combine kernels walk. It counts a query
// row's work in tiles of its live entries: the sliding-window table's first swa_live entries, then
// the extra table's first extra_live, cut into tiles of the attention kernel's tile size (the
// last one partly live; a row with no live entry has one dead tile, whose outputs are the empty
// row's). The row's tiles, row after row, are dealt into parts of equal cost; a part's blocks
// walk its segments (the part's tiles of one row) in order.
#pragma once

#include "nvfp4_numerics.cuh"

// Live entries of a row of a pool's table: lens clamped to [0, k], or k without lens.
__device__ __forceinline__ i64 live_count(const void* lens, i64 lens_int64, i64 k, i64 row) {
    if (k == 0 || lens == nullptr) return k;
    const i64 n = lens_int64 ? static_cast<const i64*>(lens)[row] : static_cast<const int*>(lens)[row];
    return n < 0 ? 0 : (n > k ? k : n);
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
