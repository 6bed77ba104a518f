// The Hopper decode kernel's producer warpgroup(s): slots, record gather and exact
// dequantization into the K/V buffers (docs/kernels/decode_sm90.md).
#pragma once

#include "nvfp4_mla_sm90_pipeline.cuh"

// The slot of an entry, loaded two units before its use as the table's words, unconverted: any
// conversion or select here would wait for the loads. Both words all ones (the slot -1 as int32
// and int64) when the entry is past its table's live count (also past both tables): its slot is
// never read. int32 slots use the low word only.
struct SlotWords {
    u32 lo, hi;
};

constexpr SlotWords NO_SLOT = {~0u, ~0u};

// The entry's table word(s) are where slot_ref (nvfp4_mla_records.cuh) finds them. Written out
// here, as produce_item's barrier addresses and phases are (barrier_at's and fill_parity's
// arithmetic): this kernel's machine code follows their exact form, and through the shared
// helpers it ran slower (docs/performance.md#hopper-register-split).
__device__ __forceinline__ SlotWords load_slot(const Params& p, i64 row, i64 n, i64 swa_live, i64 extra_live) {
    const bool in_swa = n < p.swa.k;
    const i64 j = in_swa ? n : n - p.swa.k;
    const bool int64 = in_swa ? p.swa.slot_int64 : p.extra.slot_int64;
    const u32* const words = reinterpret_cast<const u32*>(static_cast<const u8*>(in_swa ? p.swa.slots : p.extra.slots) +
                                                          (row * (in_swa ? p.swa.k : p.extra.k) + j) * (int64 ? 8 : 4));
    SlotWords s = NO_SLOT;
    const bool live = j < (in_swa ? swa_live : extra_live);
    if (live) s.lo = __ldg(words);
    if (live && int64) s.hi = __ldg(words + 1);
    return s;
}

// Every producer thread: token t of the unit (entry n, its slot's load_slot words), part c0 of
// its record: the 16-byte chunks c0, c0 + 4, ..., c0 + 20 of its 24 (22 of the data row, 2 of the scale slot),
// copied with cp.async (a warp's instruction: 8 records x 64 contiguous bytes), arriving on the
// warp's barrier `bar` of the unit. Returns the live mask of the warp's 8 tokens.
__device__ __forceinline__ u32 gather_unit(const Params& p, i64 n, SlotWords slot, u8* raw_unit, u32 bar, int t,
                                           int c0) {
    const RecordAddress record = record_address(p, n, slot_of_words(slot.lo, slot.hi, slot_is_int64(p, n)));
    const u32 mask = __ballot_sync(NVFP4_FULL_MASK, record.data != nullptr) & 0xFFu;  // lanes 0..7: the warp's tokens
    if (record.data != nullptr) {
        u8* const dst = raw_unit + t * RAW_STRIDE;
#pragma unroll
        for (int k = 0; k < RECORD / 16 / 4; ++k) {
            const int part = c0 + 4 * k;
            cp_async16(dst + part * 16,
                       part < DATA_BYTES / 16 ? record.data + part * 16 : record.scale + (part - DATA_BYTES / 16) * 16);
        }
    }
    mbar_arrive(bar);
    mbar_arrive_on_copies(bar);
    return mask;
}

constexpr int THREAD_NOPE = NOPE_CHUNKS / 4;  // NoPE chunks of a dequantizing thread (14), then 2 RoPE chunks
// With a cluster, the bytes a producer stores into the peer block per tile: its unit's BF16 rows
// and its warps' words of the tile's live mask.
constexpr u32 PEER_TILE_BYTES = UNIT * CHUNKS * 16 + 4 * 4;

// Where a producer thread stores: its token's row in a K/V buffer of this block and, with a
// cluster, the same bytes of the peer block (shared::cluster address) with the peer's barrier
// that counts them.
struct KvDestination {
    u8* local;
    u32 peer;
    u32 peer_bar;
};

// One 16-byte chunk at `offset` bytes from the destination, into this block and the peer's.
__device__ __forceinline__ void store_kv(const KvDestination& dst, int offset, uint4 v) {
    *reinterpret_cast<uint4*>(dst.local + offset) = v;
    if constexpr (CLUSTER == 2) store_cluster16(dst.peer + offset, v, dst.peer_bar);
}

// A producer thread's part of a record: its 16-byte chunks c = 4 i + c0 (i = 0..15) of the BF16
// row, 8 values each. Chunks 0..55 are NoPE half groups (e2m1 codes times the group's scale:
// scale byte c / 2 = 2 i + c0 / 2, as its BF16 pair from `scale_pairs`; a NaN scale gives NaN
// values), 56..63 the BF16 RoPE dims. read_part copies what the part needs out of the raw record
// (so its raw buffer can be refilled at once), store_part converts and stores it. A masked token's
// part is all zeros, which convert to +0 rows (scale byte 0 is +0).
struct RecordPart {
    u32 codes[THREAD_NOPE], scale_words[7];  // scale bytes 0..27
    uint4 rope0, rope1;
};

__device__ __forceinline__ void read_part(const u8* record, int c0, RecordPart& part) {
    const uint4 s_lo = *reinterpret_cast<const uint4*>(record + DATA_BYTES);
    const uint4 s_hi = *reinterpret_cast<const uint4*>(record + DATA_BYTES + 16);
    part.scale_words[0] = s_lo.x, part.scale_words[1] = s_lo.y, part.scale_words[2] = s_lo.z,
    part.scale_words[3] = s_lo.w;
    part.scale_words[4] = s_hi.x, part.scale_words[5] = s_hi.y, part.scale_words[6] = s_hi.z;
#pragma unroll
    for (int i = 0; i < THREAD_NOPE; ++i) part.codes[i] = *reinterpret_cast<const u32*>(record + (4 * i + c0) * 4);
    part.rope0 = *reinterpret_cast<const uint4*>(record + NOPE_BYTES + c0 * 16);        // chunk 56 + c0
    part.rope1 = *reinterpret_cast<const uint4*>(record + NOPE_BYTES + (4 + c0) * 16);  // chunk 60 + c0
}

__device__ __forceinline__ void store_part(const RecordPart& part, const u32* scale_pairs, int c0,
                                           const KvDestination& dst) {
    const u32 byte_in_pair = static_cast<u32>(c0 >> 1);
    u32 pairs[THREAD_NOPE];
#pragma unroll
    for (int i = 0; i < THREAD_NOPE; ++i)  // scale byte 2 i + c0 / 2: byte (i & 1) * 2 + c0 / 2 of word i / 2
        pairs[i] = scale_pairs[__byte_perm(part.scale_words[i / 2], 0u, 0x4440u | ((i & 1) * 2 + byte_in_pair))];
#pragma unroll
    for (int i = 0; i < THREAD_NOPE; ++i)
        store_kv(dst, (4 * i + c0) * GROUP_STRIDE, e2m1x8_scaled(part.codes[i], pairs[i]));
    store_kv(dst, (NOPE_CHUNKS + c0) * GROUP_STRIDE, part.rope0);
    store_kv(dst, (NOPE_CHUNKS + 4 + c0) * GROUP_STRIDE, part.rope1);
}

// The producer warpgroup, one item: tiles tile_begin .. tile_begin + num_tiles - 1 of the row's
// live entries (the window's first swa_live, then the extra table's first extra_live, as the work
// list counts them; past those, dead entries). A gather unit is 32 tokens of a tile: both of a
// tile's units alone, or with a cluster the unit of the block's rank (the peer block handles the
// other one).
// unit0 and tile0 count the units and tiles of the block's earlier items: the raw and K/V buffers
// and their barrier phases run on across items, so the first units of an item are gathered while
// the consumers still work on the item before.
// `held`: bit b, K/V buffer b holds an earlier item's outputs (its consumers release it on
// BAR_HELD + b before the producer stores into it again); bit 2 + b, that barrier's phase.
__device__ __forceinline__ void produce_item(const Params& p, u8* smem, i64 row, int tile_begin, int num_tiles,
                                             int unit0, int tile0, int ptid, int share, u32& held) {
    const int warp = ptid >> 5, lane = ptid & 31;
    const int group = NARROW ? share : 0;  // the block's producer warpgroup: its raw buffers and barriers
    u8* const raw = smem + SM_RAW + group * RAW_BYTES;
    const u32* const scale_pairs = reinterpret_cast<const u32*>(smem + SM_SCALES);
    u32* const tile_masks = reinterpret_cast<u32*>(smem + SM_TILE_MASK);
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const u32 peer = CLUSTER == 2 ? cluster_address(shared_address(smem), share ^ 1) : 0u;  // the peer's smem
    const int units = UNITS_PER_TILE * num_tiles;
    const i64 swa_live = live_count(p.swa.lens, p.swa.lens_int64, p.swa.k, row),
              extra_live = live_count(p.extra.lens, p.extra.lens_int64, p.extra.k, row);
    const auto entry = [&](i64 c) { return live_entry(p, c, swa_live); };  // live entry c's index n

    // Dequantization: token t of a unit (8 a warp), chunks 4 i + c0 (i = 0..15) of its row.
    const int t = warp * 8 + (lane & 7), c0 = lane >> 3;
    // Every thread gathers a quarter of token t's record: the slots of units 0 and 1 now, of
    // u + 2 and u + 3 in flight while unit u is dequantized. Unit u's entries start UNIT_STEP u
    // after unit 0's.
    constexpr int UNIT_STEP = UNIT * SHARERS;
    const i64 first = static_cast<i64>(tile_begin) * BN + share * UNIT + t;  // this thread's entry in unit 0
    // A warp gathers, dequantizes and reuses the raw records of its own 8 tokens: it waits on its
    // own raw barriers and only for itself (the warps proceed independently).
    // Unit u of the item is the block's unit unit0 + u: its raw buffer is that count's.
#define GATHER(unit, slot)                                                                                             \
    gather_unit(p, entry(first + (unit) * UNIT_STEP), slot, raw + ((unit0 + (unit)) & 1) * UNIT * RAW_STRIDE,          \
                bars + (BAR_RAW + 8 * group + 2 * warp + ((unit0 + (unit)) & 1)) * 8, t, c0)
    SlotWords slot_a = NO_SLOT, slot_b = NO_SLOT;
    u32 unit_mask[2] = {0u, 0u};  // the warp's live tokens of the units in raw buffers 0 and 1
    if (units > 0) {
        const SlotWords s0 = load_slot(p, row, entry(first), swa_live, extra_live);
        const SlotWords s1 = units > 1 ? load_slot(p, row, entry(first + UNIT_STEP), swa_live, extra_live) : NO_SLOT;
        if (units > 2) slot_a = load_slot(p, row, entry(first + 2 * UNIT_STEP), swa_live, extra_live);
        if (units > 3) slot_b = load_slot(p, row, entry(first + 3 * UNIT_STEP), swa_live, extra_live);
        const u32 mask0 = GATHER(0, s0);
        const u32 mask1 = units > 1 ? GATHER(1, s1) : 0u;
        const bool odd = unit0 & 1;  // selects, not an index: the masks stay in registers
        unit_mask[0] = odd ? mask1 : mask0;
        unit_mask[1] = odd ? mask0 : mask1;
    }

    for (int u = 0; u < units; ++u) {
        const int raw_half = (unit0 + u) & 1, tile = tile0 + u / UNITS_PER_TILE, b = tile & 1;
        const int half = SHARERS == 2 ? share : u & 1;  // the unit's half of the tile
        const u32 full = bars + (BAR_FULL + b) * 8;
        const u32 peer_full = peer + SM_BARRIERS + (BAR_FULL + b) * 8;  // with a cluster: the peer's full barrier
        mbar_wait(bars + (BAR_RAW + 8 * group + 2 * warp + raw_half) * 8,
                  ((unit0 + u) >> 1) & 1);  // the warp's records are in
        const u32 mask = raw_half ? unit_mask[1] : unit_mask[0];
        RecordPart part = {};
        if ((mask >> (t & 7)) & 1u)  // the warp's mask: its 8 tokens
            read_part(raw + raw_half * UNIT * RAW_STRIDE + t * RAW_STRIDE, c0, part);
        __syncwarp();  // the warp has read its raw records of unit u out: refill the buffer with unit u + 2
        if (u + 2 < units) {
            const u32 next_mask = GATHER(u + 2, slot_a);
            if (raw_half)
                unit_mask[1] = next_mask;
            else
                unit_mask[0] = next_mask;
            slot_a = slot_b;
            slot_b =
                u + 4 < units ? load_slot(p, row, entry(first + (u + 4) * UNIT_STEP), swa_live, extra_live) : NO_SLOT;
        }
        if (half == 0 || SHARERS == 2) {  // the consumers (of both blocks) are done with buffer b
            mbar_wait(bars + (BAR_EMPTY + b) * 8, ((tile >> 1) & 1) ^ 1);
            if ((held >> b) & 1u) {  // and this block's consumers with the outputs staged there
                mbar_wait(bars + (BAR_HELD + b) * 8, (held >> (2 + b)) & 1u);
                held ^= (1u << b) | (1u << (2 + b));
            }
        }
        if (lane == 0) {
            const int word = (b * 2 + half) * 4 + warp;
            tile_masks[word] = mask;
            if constexpr (CLUSTER == 2) store_cluster4(peer + SM_TILE_MASK + word * 4, mask, peer_full);
        }
        const int row_offset = SM_KV + b * KV_BYTES + (half * UNIT + t) * 16;
        store_part(part, scale_pairs, c0, {smem + row_offset, peer + row_offset, peer_full});
        if (half == 1 ||
            SHARERS ==
                2) {  // this warpgroup's part of the tile is complete: publish it to the consumers' wgmma (async proxy)
            fence_proxy_async();
            if (CLUSTER == 2 && ptid == 0)
                mbar_arrive_expect_bytes(full, PEER_TILE_BYTES);  // and the phase waits for the peer's stores
            else
                mbar_arrive(full);
        }
    }
#undef GATHER
}
