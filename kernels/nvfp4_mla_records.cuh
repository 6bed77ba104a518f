// How the decode kernels find and read a row's records (docs/format.md sections 3 and 9): the live
// entries of a slot table's row, an entry's slot, its record's address, and the exact
// dequantization of a record's values. An entry n of a query row counts over both tables: the
// sliding-window pool's k entries, then the extra pool's. Params is the attention kernels'
// (decode_backend.ATTEND_PARAMS); its pools' fields are read one by one, never as a Pool reference
// (which would copy Params to the stack where Params is not __grid_constant__).
#pragma once

#include "nvfp4_mla_params.cuh"
#include "nvfp4_mla_work.cuh"  // live_count, live_tiles

// Whether entry n's slot table holds int64 slots (else int32).
__device__ __forceinline__ bool slot_is_int64(const Params& p, i64 n) {
    return n < p.swa.k ? p.swa.slot_int64 : p.extra.slot_int64;
}

// A query row's tiles of 2^tile_shift live entries (the work list's count: live_tiles of both
// tables' clamped lengths).
__device__ __forceinline__ u32 row_tiles(const Params& p, int row, u32 tile_shift) {
    return live_tiles(static_cast<u32>(live_count(p.swa.lens, p.swa.lens_int64, p.swa.k, row) +
                                       live_count(p.extra.lens, p.extra.lens_int64, p.extra.k, row)),
                      tile_shift);
}

// Live entry c of a query row as the work list counts them (the window's first swa_live entries,
// then the extra table's) as an entry index n (which counts the window's k entries first). Past
// both live counts c maps past them too: a dead entry.
__device__ __forceinline__ i64 live_entry(const Params& p, i64 c, i64 swa_live) {
    return c < swa_live ? c : c + (p.swa.k - swa_live);
}

// Where the slot of entry n of query row `row` lies in its table: its word (int32) or words
// (int64), and whether the entry is live, below its table's live count (swa_live, extra_live).
// A dead entry's slot is never read: past lens, or past both tables (extra_live <= extra.k).
struct SlotRef {
    const u32* words;
    bool int64;
    bool live;
};

__device__ __forceinline__ SlotRef slot_ref(const Params& p, i64 row, i64 n, i64 swa_live, i64 extra_live) {
    const bool in_swa = n < p.swa.k;
    const i64 j = in_swa ? n : n - p.swa.k;
    const bool int64 = slot_is_int64(p, n);
    const u8* const table = static_cast<const u8*>(in_swa ? p.swa.slots : p.extra.slots);
    return {reinterpret_cast<const u32*>(table + (row * (in_swa ? p.swa.k : p.extra.k) + j) * (int64 ? 8 : 4)), int64,
            j < (in_swa ? swa_live : extra_live)};
}

// A slot from its table words (an int32 slot is the low word, sign-extended).
__device__ __forceinline__ i64 slot_of_words(u32 lo, u32 hi, bool int64) {
    return int64 ? static_cast<i64>(static_cast<u64>(hi) << 32 | lo) : static_cast<i64>(static_cast<int>(lo));
}

// The record of entry n whose slot is `slot`: its data row and scale slot, or null for an invalid
// slot (negative, or past the pool's capacity).
struct RecordAddress {
    const u8* data;
    const u8* scale;
};

__device__ __forceinline__ RecordAddress record_address(const Params& p, i64 n, i64 slot) {
    const bool in_swa = n < p.swa.k;
    if (slot < 0 || slot >= (in_swa ? p.swa.capacity : p.extra.capacity)) return {nullptr, nullptr};
    const i64 page_size = in_swa ? p.swa.page_size : p.extra.page_size;
    i64 page, entry;
    if (((slot | page_size) >> 31) == 0) {  // the common case: a 32-bit division
        const u32 s = static_cast<u32>(slot), ps = static_cast<u32>(page_size);
        page = s / ps;
        entry = s - static_cast<u32>(page) * ps;
    } else {
        page = slot / page_size;
        entry = slot - page * page_size;
    }
    const u8* base = (in_swa ? p.swa.cache : p.extra.cache) + page * (in_swa ? p.swa.page_stride : p.extra.page_stride);
    return {base + entry * DATA_BYTES, base + page_size * DATA_BYTES + entry * SCALE_BYTES};
}

// The table of every E4M3 scale byte as a BF16 pair (e4m3_bf16x2), filled by `threads` threads
// of the block (thread `tid` of them) before the block's first barrier.
__device__ __forceinline__ void fill_scale_pairs(u32* scale_pairs, int tid, int threads) {
    for (int byte = tid; byte < 256; byte += threads) scale_pairs[byte] = e4m3_bf16x2(byte);
}

constexpr int RECORD = DATA_BYTES + SCALE_BYTES;  // a record: its data row, then its scale slot
constexpr int NOPE_CHUNKS = NOPE_DIM / 8;         // 16-byte chunks (8 BF16) of a row's NoPE dims

// 16-byte chunk c (8 BF16 values) of a record's row, exactly: a NoPE half group (chunks 0..55:
// e2m1 codes times the group's scale, as its pair from `scale_pairs`) or RoPE dims. A NaN scale
// gives NaN values (not canonical: the products carry them whatever their bits). `record` holds
// the data row and, DATA_BYTES on, the scale slot.
__device__ __forceinline__ uint4 dequantize_chunk(const u8* record, const u32* scale_pairs, int c) {
    if (c >= NOPE_CHUNKS) return *reinterpret_cast<const uint4*>(record + NOPE_BYTES + (c - NOPE_CHUNKS) * 16);
    return e2m1x8_scaled(*reinterpret_cast<const u32*>(record + c * 4), scale_pairs[record[DATA_BYTES + c / 2]]);
}
