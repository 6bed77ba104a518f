// One kernel for every writer entry (docs/kernels/writer.md): RoPE, NVFP4 quantization and the
// insertion of KV rows, and the query's RoPE and head padding, specialized at compile time by the
// -D constants PAGE_SIZE, SLOT_INT64, IDENTITY_SLOTS, KV_ROPE, COMPRESS_RATIO, Q_MODE (0: no
// query work, 1: the head-padded q_out, 2: q in place), NUM_HEADS, Q_HEADS, APPLY_Q_ROPE,
// Q_ROWS_PER_UNIT and KV_ROWS_PER_WARP. The first kv_blocks blocks insert the KV rows, the blocks
// after them write the query.
#include "nvfp4_numerics.cuh"
#include "nvfp4_mla_params.cuh"  // Params: writer_spec.WRITE_PARAMS
#include "nvfp4_mla_ptx.cuh"

// THREADS, UNIT_THREADS and the record ABI (HEAD_DIM, NOPE_DIM, ROPE_PAIRS, DATA_BYTES,
// NOPE_BYTES, SCALE_BYTES, NUM_GROUPS) come from nvfp4_mla/abi.py and jit.py as -D options too.
#define UNITS_PER_BLOCK (THREADS / UNIT_THREADS)
#define KV_ROWS_PER_UNIT (UNIT_THREADS / 32 * KV_ROWS_PER_WARP)
#define CHUNKS (HEAD_DIM * 2 / 16)       // 16-byte chunks in a BF16 row
#define NOPE_CHUNKS (NOPE_DIM * 2 / 16)  // a group of 16 is chunks 2g (half 0) and 2g+1 (half 1)
#define ROPE_DIM (2 * ROPE_PAIRS)        // a cos_sin_cache row: cos[ROPE_PAIRS] | sin[ROPE_PAIRS]

// The cos and sin of chunk k (pairs 4k..4k+3) of RoPE row r.
struct CosSin {
    float4 c, s;
};

__device__ __forceinline__ CosSin load_cos_sin(const Params& p, i64 r, int k) {
    const float* row = p.cos_sin + r * ROPE_DIM + 4 * k;
    return {*reinterpret_cast<const float4*>(row), *reinterpret_cast<const float4*>(row + ROPE_PAIRS)};
}

// The KV loop is bound by the ALU pipe (docs/performance.md), where the compiler puts 64-bit
// index and address arithmetic (IADD3, LEA and ISETP pairs). So row and slot indices are 32 bits
// (the host refuses 2^30 rows or cache slots and more) and addresses are mad.wide.u32 from the
// page or a per-lane base computed once: IMAD.WIDE, the FMA pipe, at twice the ALU pipe's rate
// (ptxas still turns those by a power of two into one LEA pair).

// a * b + c, c 64-bit: one IMAD.WIDE.U32.
__device__ __forceinline__ u64 mad_wide(u32 a, u32 b, u64 c) {
    u64 r;
    asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(r) : "r"(a), "r"(b), "l"(c));
    return r;
}

// base + page * stride for a 64-bit stride: two multiply-adds.
__device__ __forceinline__ u64 page_address(u32 page, i64 stride, u64 base) {
    u64 r;
    asm("{\n\t.reg .u32 lo, hi;\n\tmad.wide.u32 %0, %1, %2, %4;\n\tmov.b64 {lo, hi}, %0;\n\t"
        "mad.lo.u32 hi, %1, %3, hi;\n\tmov.b64 %0, {lo, hi};\n\t}"
        : "=l"(r)
        : "r"(page), "r"(static_cast<u32>(stride)), "r"(static_cast<u32>(static_cast<u64>(stride) >> 32)), "l"(base));
    return r;
}

// Global loads and stores at such an address (an integer: C++ would use generic addressing).
// Volatile: the loads stay before the previous row's stores, in flight during its quantizer.
__device__ __forceinline__ uint4 ld_global_v4(u64 a) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
    return v;
}

__device__ __forceinline__ u32 ld_global_u32(u64 a) {
    u32 v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(a));
    return v;
}

__device__ __forceinline__ void st_global_v2(u64 a, uint2 v) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(a), "r"(v.x), "r"(v.y) : "memory");
}

__device__ __forceinline__ void st_global_u32(u64 a, u32 v) {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(a), "r"(v) : "memory");
}

__device__ __forceinline__ void st_global_u8(u64 a, u32 v) {
    asm volatile("st.global.u8 [%0], %1;" ::"l"(a), "r"(v) : "memory");
}

// A lane's addresses in row 0 of kv: its NoPE group (32 bytes at 32 * lane) and its RoPE pair.
struct LaneBases {
    u64 group, rope;
};

// One warp's KV_ROWS_PER_WARP rows of a unit, loaded: lane g < NUM_GROUPS holds NoPE group g
// whole (its two 16-byte halves), and every lane holds RoPE pair `lane` (one word).
struct KvRows {
    i64 slot[KV_ROWS_PER_WARP], pos[KV_ROWS_PER_WARP];
    uint4 h0[KV_ROWS_PER_WARP], h1[KV_ROWS_PER_WARP];
    u32 rope[KV_ROWS_PER_WARP];
};

// Row `row`'s slot and position (position 0 without KV_ROPE), or -1 and -1 when it does not exist.
__device__ __forceinline__ void load_slot_position(const Params& p, u32 row, bool exists, i64& slot, i64& pos) {
#if IDENTITY_SLOTS
    slot = exists ? row : -1;
#elif SLOT_INT64
    slot = exists ? static_cast<const i64*>(p.slots)[row] : -1;
#else
    slot = exists ? static_cast<const int*>(p.slots)[row] : -1;
#endif
#if KV_ROPE
    pos = exists ? p.positions[row] : -1;
#else
    pos = 0;
#endif
}

// Issues every load of the rows (slots, positions, data) and returns without waiting for them.
// Rows at or past num_kv_rows get slot -1 and the last row's data (never used): every lane loads
// unpredicated, lanes past the groups part of the RoPE dims.
__device__ __forceinline__ KvRows load_kv_rows(const Params& p, u32 first_row, const LaneBases& b) {
    KvRows r;
#pragma unroll
    for (int j = 0; j < KV_ROWS_PER_WARP; ++j) {
        const u32 row = first_row + j;
        load_slot_position(p, row, row < static_cast<u32>(p.num_kv_rows), r.slot[j], r.pos[j]);
        const u32 data_row = min(row, static_cast<u32>(p.num_kv_rows) - 1u);
        const u64 group = mad_wide(data_row, CHUNKS * 16, b.group);
        r.h0[j] = ld_global_v4(group);
        r.h1[j] = ld_global_v4(group + 16);
        r.rope[j] = ld_global_u32(mad_wide(data_row, CHUNKS * 16, b.rope));
    }
    return r;
}

// Quantizes one loaded row and writes its record at valid_slot (< capacity): lane g < NUM_GROUPS
// holds NoPE group g (halves h0, h1), every lane RoPE pair `lane` (`rope`), rotated by cos and sin
// with KV_ROPE, after the quantizer, so that they may still be in flight when it starts. No lane
// waits on another: no shuffles, and the RoPE work is spread over the whole warp instead of
// running beside the quantizer in a few lanes. Each store instruction writes whole 32-byte
// sectors: codes 224 bytes, RoPE 128 bytes, the 32-byte scale slot one byte a lane.
__device__ __forceinline__ void store_kv_record(const Params& p, uint4 h0, uint4 h1, u32 rope, float cos, float sin,
                                                u32 valid_slot, int lane) {
    static_assert(NUM_GROUPS <= 32 && ROPE_PAIRS == 32 && SCALE_BYTES == 32,
                  "one warp a row: a lane a group, a RoPE pair and a scale byte");
    // valid_slot < capacity < 2^30: 32-bit unsigned division by the page size.
    const u32 entry = valid_slot % PAGE_SIZE, ulane = lane;
    const u64 page = page_address(valid_slot / PAGE_SIZE, p.page_stride, reinterpret_cast<u64>(p.cache));
    u32 scale = 0u;  // lanes past the groups write the slot's zero bytes
    if (lane < NUM_GROUPS) {
        const GroupAmax a = group_amax(h0, h1);
        scale = scale_code(a.amax.x);                             // the group's scale byte is half 0's
        const u32 scale1 = a.nan ? scale_code(a.amax.y) : scale;  // the halves' amax differ only with a NaN
        const uint2 codes = group_codes(h0, h1, a, scale, scale1);
        st_global_v2(mad_wide(entry * (DATA_BYTES / 8) + ulane, 8, page), codes);  // data + 8 * lane
    }
#if KV_ROPE
    const u32 rope_out = rope_pair_bits(rope, cos, sin);
#else
    const u32 rope_out = rope;
#endif
    st_global_u32(mad_wide(entry * (DATA_BYTES / 4) + ulane, 4, page) + NOPE_BYTES, rope_out);
    st_global_u8(mad_wide(entry * SCALE_BYTES + ulane, 1, page) + PAGE_SIZE * DATA_BYTES, scale);
}

#if KV_ROPE
// Whether a row of this slot and position is inserted, and its RoPE row: the slot is in
// [0, capacity) (a negative one too is out), the position is nonnegative and the last of its
// compression window, and the RoPE row, position / COMPRESS_RATIO * COMPRESS_RATIO, is inside
// cos_sin_cache (never read outside it).
__device__ __forceinline__ bool inserted_row(const Params& p, i64 slot, i64 pos, i64& rope_row) {
    rope_row = pos / COMPRESS_RATIO * COMPRESS_RATIO;
    return static_cast<u64>(slot) < static_cast<u64>(p.capacity) && pos >= 0 && (pos + 1) % COMPRESS_RATIO == 0 &&
        rope_row < p.max_position;
}
#endif

// Inserts loaded rows, one warp a row.
__device__ __forceinline__ void insert_kv_rows(const Params& p, const KvRows& r, int lane) {
#pragma unroll
    for (int j = 0; j < KV_ROWS_PER_WARP; ++j) {
        // Uniform across the warp (one row).
#if KV_ROPE
        i64 rope_row;
        if (!inserted_row(p, r.slot[j], r.pos[j], rope_row)) continue;
        // Loaded here, used after the quantizer: this second round trip overlaps its work.
        const float* cos_sin = p.cos_sin + rope_row * ROPE_DIM;
        const float cos = cos_sin[lane], sin = cos_sin[ROPE_PAIRS + lane];
#else
        if (static_cast<u64>(r.slot[j]) >= static_cast<u64>(p.capacity)) continue;  // negative too
        const float cos = 0.0f, sin = 0.0f;
#endif
        store_kv_record(p, r.h0[j], r.h1[j], r.rope[j], cos, sin, static_cast<u32>(r.slot[j]), lane);
    }
}

// The KV units unit, unit + stride, ... below kv_units, software-pipelined: the next unit's loads
// are in flight while this one is quantized, so a warp waits for memory once, not once a unit.
__device__ __forceinline__ void insert_kv_units(const Params& p, u32 unit, u32 stride, u32 kv_units, int c) {
    const int warp = c / 32, lane = c % 32;
    const u64 kv = reinterpret_cast<u64>(p.kv);
    const LaneBases b = {kv + 32u * lane, kv + NOPE_CHUNKS * 16 + 4u * lane};
    KvRows rows = load_kv_rows(p, unit * KV_ROWS_PER_UNIT + warp * KV_ROWS_PER_WARP, b);
    for (;;) {
        const u32 next = unit + stride;
        const KvRows next_rows = load_kv_rows(p, next * KV_ROWS_PER_UNIT + warp * KV_ROWS_PER_WARP, b);
        insert_kv_rows(p, rows, lane);
        if (next >= kv_units) return;
        rows = next_rows;
        unit = next;
    }
}

#if COMPRESS_RATIO > 1
// The KV entry with compress ratio R inserts about one row in R, which ones depending on their
// positions. A KV block takes tiles of up to THREADS consecutive rows (grid-stride): each thread
// reads one row's slot and position, the block lists the tile's inserted rows in shared memory,
// and its warps take them in turn (warp w: entries w, w + WARPS, ...). So the block's warps insert
// equally many rows however the inserted rows fall: with a batch of rows a warp, random positions
// gave the warps unequal counts and the fullest set the time (docs/kernels/writer.md). A warp reads only its rows' data, with
// their cos and sin, the next row's while it quantizes one; the next tile's slots and positions
// are in flight meanwhile. Tiles are as small as spreads the rows over every block.
static_assert(KV_ROPE && !IDENTITY_SLOTS && Q_MODE == 0, "compress ratios belong to the KV entry");
#define WARPS (THREADS / 32)

// A tile's inserted rows in row order: each one's row, slot and RoPE row.
struct TileList {
    u32 row[THREADS], slot[THREADS], rope_row[THREADS];
    u32 warp_count[WARPS];  // inserted rows among each warp's 32 rows of the tile
};

struct KvTiles {
    u32 size, first,
        stride;        // rows a tile (1..THREADS); the tile's first row; rows from one of the block's tiles to the next
    u32 taken, count;  // this warp's next entry of the list; the list's entries
    i64 next_slot, next_pos;  // this thread's row of the next tile, as loaded (-1 past the rows)
};

__device__ __forceinline__ void load_tile_heads(const Params& p, KvTiles& q, u32 first) {
    const u32 row = first + threadIdx.x;
    load_slot_position(p, row, threadIdx.x < q.size && row < static_cast<u32>(p.num_kv_rows), q.next_slot, q.next_pos);
}

// Lists the inserted rows (inserted_row) of the tile at q.first, from its loaded slots and
// positions, and returns their count; RoPE rows fit 32 bits (max_position rows of 256 bytes).
// Every thread of the block calls it once a tile, when its warp has taken its entries of the
// previous tile's list: the first barrier orders those reads before this tile's writes.
__device__ __forceinline__ u32 list_tile(const Params& p, const KvTiles& q, TileList& list, int lane, int warp) {
    i64 window_row;
    const bool inserted = inserted_row(p, q.next_slot, q.next_pos, window_row);
    const u32 ballot = __ballot_sync(NVFP4_FULL_MASK, inserted);
    if (lane == 0) list.warp_count[warp] = __popc(ballot);
    __syncthreads();
    u32 index = __popc(ballot & ((1u << lane) - 1u)), count = 0u;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const u32 n = list.warp_count[w];
        index += w < warp ? n : 0u;
        count += n;
    }
    if (inserted) {
        list.row[index] = q.first + threadIdx.x;
        list.slot[index] = static_cast<u32>(q.next_slot);
        list.rope_row[index] = static_cast<u32>(window_row);
    }
    __syncthreads();
    return count;
}

// The warp's next inserted row (the same row, slot and RoPE row in every lane); false when no
// row is left, once the warp has passed as many barriers as every other warp of the block.
__device__ __forceinline__ bool next_inserted_row(const Params& p, KvTiles& q, TileList& list, int lane, int warp,
                                                  u32& row, u32& slot, u32& rope_row) {
    while (q.taken >= q.count) {
        q.first += q.stride;
        if (q.first >= static_cast<u32>(p.num_kv_rows)) return false;
        q.count = list_tile(p, q, list, lane, warp);
        q.taken = warp;
        load_tile_heads(p, q, q.first + q.stride);
    }
    row = list.row[q.taken];
    slot = list.slot[q.taken];
    rope_row = list.rope_row[q.taken];
    q.taken += WARPS;
    return true;
}

struct KvRow {
    uint4 h0, h1;
    u32 rope;
    float cos, sin;
};

// Issues the loads of an inserted row and its cos and sin. The lane's addresses are recomputed
// from the parameters each row: kept in registers (LaneBases), they made ptxas spill for sm_120.
// Ratio 1 keeps its LaneBases: recomputing there made append slower (docs/performance.md#writer-launch-grid).
__device__ __forceinline__ KvRow load_inserted_row(const Params& p, int lane, u32 row, u32 rope_row) {
    KvRow r;
    const u64 row_start = mad_wide(row, CHUNKS * 16, reinterpret_cast<u64>(p.kv));
    const u64 group = mad_wide(lane, 32, row_start);
    r.h0 = ld_global_v4(group);
    r.h1 = ld_global_v4(group + 16);
    r.rope = ld_global_u32(mad_wide(lane, 4, row_start + NOPE_CHUNKS * 16));
    const u64 cos_sin = mad_wide(rope_row * ROPE_DIM + lane, 4, reinterpret_cast<u64>(p.cos_sin));
    r.cos = __uint_as_float(ld_global_u32(cos_sin));
    r.sin = __uint_as_float(ld_global_u32(cos_sin + ROPE_PAIRS * 4));
    return r;
}

// Run by every thread of the block, to its end (list_tile's barriers).
__device__ __forceinline__ void insert_kv_tiles(const Params& p) {
    __shared__ TileList list;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 blocks = static_cast<u32>(p.kv_blocks);
    KvTiles q;
    q.size = min(static_cast<u32>(THREADS), max(1u, (static_cast<u32>(p.num_kv_rows) + blocks - 1) / blocks));
    q.stride = q.size * blocks;
    q.first = q.size * blockIdx.x - q.stride;  // modulo 2^32: the first call of next_inserted_row adds the stride
    q.taken = q.count = 0u;
    load_tile_heads(p, q, q.size * blockIdx.x);
    u32 row, slot, rope_row;
    if (!next_inserted_row(p, q, list, lane, warp, row, slot, rope_row)) return;
    KvRow r = load_inserted_row(p, lane, row, rope_row);
    for (;;) {
        u32 next_slot;
        const bool more = next_inserted_row(p, q, list, lane, warp, row, next_slot, rope_row);
        // Assigned even without a next row: left unassigned, the first tiles ran slower
        // (docs/performance.md#writer-launch-grid).
        KvRow next = r;
        if (more) next = load_inserted_row(p, lane, row, rope_row);
        store_kv_record(p, r.h0, r.h1, r.rope, r.cos, r.sin, slot, lane);
        if (!more) return;
        r = next;
        slot = next_slot;
    }
}
#endif

#if Q_MODE == 1
// Rows first .. first + rows - 1 (rows: 1 or Q_ROWS_PER_UNIT) of q_out, one token's (Q_HEADS is
// a multiple of 8): live heads rotated or copied, padded heads zero, and whole live heads of BF16
// NaN when the position is outside cos_sin_cache. All loads are issued before the first use.
__device__ __forceinline__ void write_q_out_rows(const Params& p, i64 first, int rows, int c) {
    const i64 token = first / Q_HEADS;
    const int head0 = static_cast<int>(first % Q_HEADS);
    uint4 out[Q_ROWS_PER_UNIT];
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) {
        out[r] = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows && head0 + r < NUM_HEADS) out[r] = p.q[(token * NUM_HEADS + head0 + r) * CHUNKS + c];
    }
#if APPLY_Q_ROPE
    const i64 pos = p.positions[token];
    const bool in_range = pos >= 0 && pos < p.max_position;
    if (c >= NOPE_CHUNKS && in_range) {
        const CosSin t = load_cos_sin(p, pos, c - NOPE_CHUNKS);
#pragma unroll
        for (int r = 0; r < Q_ROWS_PER_UNIT; ++r)
            if (r < rows && head0 + r < NUM_HEADS) out[r] = rope_chunk(out[r], t.c, t.s);
    }
    if (!in_range) {
#pragma unroll
        for (int r = 0; r < Q_ROWS_PER_UNIT; ++r)
            if (r < rows && head0 + r < NUM_HEADS)
                out[r] = make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
    }
#endif
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r)
        if (r < rows) p.q_out[(first + r) * CHUNKS + c] = out[r];
}
#endif

#if Q_MODE == 2
// In place: groups first .. first + count - 1 (count: 1 or Q_ROWS_PER_UNIT) of 8 heads
// (NUM_HEADS / 8 a token, so they may span tokens) x the 8 RoPE chunks of each head;
// out-of-range positions leave their heads untouched. All loads are issued before the first use.
__device__ __forceinline__ void rotate_q_in_place(const Params& p, i64 first, int count, int c) {
    constexpr int groups_per_token = NUM_HEADS / 8;
    const int k = c & 7;
    uint4* rows[Q_ROWS_PER_UNIT];
    uint4 x[Q_ROWS_PER_UNIT];
    i64 pos[Q_ROWS_PER_UNIT];
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) {
        const i64 group = first + r;
        const i64 token = group / groups_per_token;
        const i64 head = group % groups_per_token * 8 + (c >> 3);
        rows[r] = p.q_out + (token * NUM_HEADS + head) * CHUNKS + NOPE_CHUNKS + k;
        const bool exists = r < count && group < p.q_rows;  // uniform across the unit
        x[r] = exists ? *rows[r] : make_uint4(0u, 0u, 0u, 0u);
        pos[r] = exists ? p.positions[token] : -1;
    }
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) {
        if (pos[r] < 0 || pos[r] >= p.max_position) continue;
        const CosSin t = load_cos_sin(p, pos[r], k);
        *rows[r] = rope_chunk(x[r], t.c, t.s);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_write(const Params p) {
    // The stream's next kernel may launch now (a decode's attention after a layer's write: its setup
    // runs under this kernel's end, then it waits for this kernel's memory before any read).
    launch_dependents();
    const int c = threadIdx.x % UNIT_THREADS;
    const i64 unit_of_block = threadIdx.x / UNIT_THREADS;
    if (blockIdx.x < p.kv_blocks) {
#if COMPRESS_RATIO > 1
        insert_kv_tiles(p);
#else
        const i64 kv_units = (p.num_kv_rows + KV_ROWS_PER_UNIT - 1) / KV_ROWS_PER_UNIT;
        const i64 unit = static_cast<i64>(blockIdx.x) * UNITS_PER_BLOCK + unit_of_block;
        // The host's row limit (2^30) keeps unit indices in 32 bits.
        if (unit < kv_units)
            insert_kv_units(p, static_cast<u32>(unit), static_cast<u32>(p.kv_blocks * UNITS_PER_BLOCK),
                            static_cast<u32>(kv_units), c);
#endif
        return;
    }
#if Q_MODE != 0
    // variant.grid's layouts, told apart by the number of blocks: a block a row or a unit (small
    // queries, spread over more SMs), or UNITS_PER_BLOCK units a block.
    const i64 q_blocks = static_cast<i64>(gridDim.x) - p.kv_blocks;
    const int rows = q_blocks >= p.q_rows ? 1 : Q_ROWS_PER_UNIT;
    const int units_per_block = q_blocks * Q_ROWS_PER_UNIT >= p.q_rows ? 1 : UNITS_PER_BLOCK;
    if (unit_of_block >= units_per_block) return;
    const i64 first = ((static_cast<i64>(blockIdx.x) - p.kv_blocks) * units_per_block + unit_of_block) * rows;
    if (first >= p.q_rows) return;
#if Q_MODE == 1
    write_q_out_rows(p, first, rows, c);
#else
    rotate_q_in_place(p, first, rows, c);
#endif
#endif
}
