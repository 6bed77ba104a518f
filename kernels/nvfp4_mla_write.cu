// One kernel for every writer entry, specialized at compile time (-D) by the geometry:
//   PAGE_SIZE       tokens per page
//   SLOT_INT64      slot_mapping is int64 (else int32)
//   IDENTITY_SLOTS  row i goes to slot i (the pack entry; no slot_mapping)
//   KV_ROPE         rotate the KV row's RoPE dims with cos_sin_cache[positions[i]] (else they are
//                   already roped and copied bitwise: append/pack)
//   COMPRESS_RATIO  KV entry: insert only when (pos + 1) % ratio == 0, RoPE row pos / ratio * ratio
//   Q_MODE          0: no query work, 1: write the head-padded q_out, 2: rotate q in place
//   NUM_HEADS       live query heads; Q_HEADS: heads of q_out (the padded count)
//   APPLY_Q_ROPE    rotate the live heads (else copy them bitwise)
//   Q_ROWS_PER_UNIT 16-byte query loads in flight per thread (see jit.num_units)
//   KV_ROWS_PER_UNIT KV rows a unit inserts, their loads in flight together
//
// Work is cut into units of 64 threads, each thread one 16-byte chunk of a 512-dim BF16 row:
// the first ceil(num_kv_rows / KV_ROWS_PER_UNIT) units quantize and insert KV rows; the units
// after them write the query
// (Q_ROWS_PER_UNIT (token, head) rows of q_out each, or in place Q_ROWS_PER_UNIT x 8 heads x 8
// RoPE chunks each). A unit is two whole warps, so early exits never split a warp before its
// shuffles.
#include "nvfp4_numerics.cuh"

// THREADS, UNIT_THREADS and the record ABI (HEAD_DIM, NOPE_DIM, ROPE_PAIRS, DATA_BYTES,
// NOPE_BYTES, SCALE_BYTES, NUM_GROUPS) come from nvfp4_mla/abi.py and jit.py as -D options too.
#define UNITS_PER_BLOCK (THREADS / UNIT_THREADS)
#define CHUNKS (HEAD_DIM * 2 / 16)       // 16-byte chunks in a BF16 row: one a thread
#define NOPE_CHUNKS (NOPE_DIM * 2 / 16)  // a group of 16 is chunks 2g (half 0) and 2g+1 (half 1)
#define ROPE_DIM (2 * ROPE_PAIRS)        // a cos_sin_cache row: cos[ROPE_PAIRS] | sin[ROPE_PAIRS]

struct Params {  // 8-byte fields only: packed on the host with one struct format
    const uint4* q;         // [num_tokens, NUM_HEADS, 64 chunks]
    uint4* q_out;           // [num_tokens, Q_HEADS, 64 chunks]; q itself in place
    const uint4* kv;        // [rows, 64 chunks]
    u8* cache;              // page 0
    const void* slots;      // [num_kv_rows] int32 or int64
    const i64* positions;   // [num_tokens]
    const float* cos_sin;   // [max_position, 64]: cos[32] | sin[32]
    i64 page_stride;        // bytes
    i64 capacity;           // num_pages * PAGE_SIZE: valid slots are [0, capacity)
    i64 max_position;
    i64 num_kv_rows;        // rows that may be inserted (slot_mapping.numel())
    i64 num_units;
};
static_assert(sizeof(Params) == PARAMS_BYTES, "Params must match the host's struct format (variant.WRITE_TEMPLATE)");

// The cos and sin of chunk k (pairs 4k..4k+3) of RoPE row r.
struct CosSin {
    float4 c, s;
};

__device__ __forceinline__ CosSin load_cos_sin(const Params& p, i64 r, int k) {
    const float* row = p.cos_sin + r * ROPE_DIM + 4 * k;
    return {*reinterpret_cast<const float4*>(row), *reinterpret_cast<const float4*>(row + ROPE_PAIRS)};
}

// Quantizes and inserts KV_ROWS_PER_UNIT rows. All their loads (slots, positions, data) are
// issued before the first is used: they are independent, and one round trip to memory instead
// of a chain of them is what short calls wait for.
__device__ __forceinline__ void insert_kv_rows(const Params& p, i64 unit, int c) {
    i64 slot[KV_ROWS_PER_UNIT], pos[KV_ROWS_PER_UNIT];
    uint4 x[KV_ROWS_PER_UNIT];
#pragma unroll
    for (int j = 0; j < KV_ROWS_PER_UNIT; ++j) {
        const i64 row = unit * KV_ROWS_PER_UNIT + j;
        const bool exists = row < p.num_kv_rows;
#if IDENTITY_SLOTS
        slot[j] = row;
#elif SLOT_INT64
        slot[j] = exists ? static_cast<const i64*>(p.slots)[row] : -1;
#else
        slot[j] = exists ? static_cast<const int*>(p.slots)[row] : -1;
#endif
#if KV_ROPE
        pos[j] = exists ? p.positions[row] : -1;
#else
        pos[j] = 0;
#endif
        x[j] = exists ? p.kv[row * CHUNKS + c] : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < KV_ROWS_PER_UNIT; ++j) {
        // Uniform across the unit (one row), so skipping never splits a warp's shuffles.
        if (slot[j] < 0 || slot[j] >= p.capacity) continue;
#if KV_ROPE
        if (pos[j] < 0 || (pos[j] + 1) % COMPRESS_RATIO != 0) continue;
        const i64 rope_row = pos[j] / COMPRESS_RATIO * COMPRESS_RATIO;
        if (rope_row >= p.max_position) continue;  // never read outside cos_sin_cache
#endif
        u8* page = p.cache + (slot[j] / PAGE_SIZE) * p.page_stride;
        const i64 entry = slot[j] % PAGE_SIZE;
        u8* data = page + entry * DATA_BYTES;
        u8* scale_slot = page + PAGE_SIZE * DATA_BYTES + entry * SCALE_BYTES;
        // Every lane takes part in the shuffles (RoPE lanes on data they discard); only NoPE
        // lanes compute codes.
        const float amax = half_amax(x[j]);
        const u32 scale = scale_code(amax);
        const u32 codes = c < NOPE_CHUNKS ? half_codes(x[j], amax, scale) : 0u;
        // Four lanes' code words make one 16-byte store; lanes 8w, 8w+2, 8w+4, 8w+6 hold the
        // scales of groups 4w..4w+3, one 4-byte store.
        const u32 c1 = __shfl_down_sync(NVFP4_FULL_MASK, codes, 1);
        const u32 c2 = __shfl_down_sync(NVFP4_FULL_MASK, codes, 2);
        const u32 c3 = __shfl_down_sync(NVFP4_FULL_MASK, codes, 3);
        const u32 s1 = __shfl_down_sync(NVFP4_FULL_MASK, scale, 2);
        const u32 s2 = __shfl_down_sync(NVFP4_FULL_MASK, scale, 4);
        const u32 s3 = __shfl_down_sync(NVFP4_FULL_MASK, scale, 6);
        if (c < NOPE_CHUNKS) {
            if ((c & 3) == 0) *reinterpret_cast<uint4*>(data + 4 * c) = make_uint4(codes, c1, c2, c3);
            if ((c & 7) == 0) *reinterpret_cast<u32*>(scale_slot + c / 2) = scale | (s1 << 8) | (s2 << 16) | (s3 << 24);
        } else {
            const int k = c - NOPE_CHUNKS;
#if KV_ROPE
            const CosSin t = load_cos_sin(p, rope_row, k);
            const uint4 out = rope_chunk(x[j], t.c, t.s);
#else
            const uint4 out = x[j];
#endif
            *reinterpret_cast<uint4*>(data + NOPE_BYTES + 16 * k) = out;
            if (k == 0) *reinterpret_cast<u32*>(scale_slot + NUM_GROUPS) = 0u;  // the slot's 4 zero bytes
        }
    }
}

#if Q_MODE == 1
// Q_ROWS_PER_UNIT consecutive (token, head) rows of q_out, one token's (Q_HEADS is a multiple
// of 8): live heads rotated or copied, padded heads zero, and whole live heads of BF16 NaN when
// the position is outside cos_sin_cache. All loads are issued before the first use.
__device__ __forceinline__ void write_q_out_rows(const Params& p, i64 qunit, int c) {
    const i64 first = qunit * Q_ROWS_PER_UNIT;
    const i64 token = first / Q_HEADS;
    const int head0 = static_cast<int>(first % Q_HEADS);
    uint4 out[Q_ROWS_PER_UNIT];
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) {
        out[r] = make_uint4(0u, 0u, 0u, 0u);
        if (head0 + r < NUM_HEADS) out[r] = p.q[(token * NUM_HEADS + head0 + r) * CHUNKS + c];
    }
#if APPLY_Q_ROPE
    const i64 pos = p.positions[token];
    const bool in_range = pos >= 0 && pos < p.max_position;
    if (c >= NOPE_CHUNKS && in_range) {
        const CosSin t = load_cos_sin(p, pos, c - NOPE_CHUNKS);
#pragma unroll
        for (int r = 0; r < Q_ROWS_PER_UNIT; ++r)
            if (head0 + r < NUM_HEADS) out[r] = rope_chunk(out[r], t.c, t.s);
    }
    if (!in_range) {
#pragma unroll
        for (int r = 0; r < Q_ROWS_PER_UNIT; ++r)
            if (head0 + r < NUM_HEADS) out[r] = make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
    }
#endif
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) p.q_out[(first + r) * CHUNKS + c] = out[r];
}
#endif

#if Q_MODE == 2
// In place: Q_ROWS_PER_UNIT groups of 8 heads x the 8 RoPE chunks of one token; out-of-range
// positions leave q untouched.
__device__ __forceinline__ void rotate_q_in_place(const Params& p, i64 qunit, int c) {
    constexpr int heads_per_unit = 8 * Q_ROWS_PER_UNIT;
    const i64 token = qunit / (NUM_HEADS / heads_per_unit);
    const i64 head0 = (qunit % (NUM_HEADS / heads_per_unit)) * heads_per_unit + (c >> 3);
    const int k = c & 7;
    uint4* rows = p.q_out + (token * NUM_HEADS + head0) * CHUNKS + NOPE_CHUNKS + k;  // heads head0 + 8r
    uint4 x[Q_ROWS_PER_UNIT];
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) x[r] = rows[8 * r * CHUNKS];
    const i64 pos = p.positions[token];
    if (pos < 0 || pos >= p.max_position) return;
    const CosSin t = load_cos_sin(p, pos, k);
#pragma unroll
    for (int r = 0; r < Q_ROWS_PER_UNIT; ++r) rows[8 * r * CHUNKS] = rope_chunk(x[r], t.c, t.s);
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_write(const Params p) {
    const i64 unit = static_cast<i64>(blockIdx.x) * UNITS_PER_BLOCK + (threadIdx.x / UNIT_THREADS);
    const int c = threadIdx.x % UNIT_THREADS;
    const i64 kv_units = (p.num_kv_rows + KV_ROWS_PER_UNIT - 1) / KV_ROWS_PER_UNIT;
    if (unit >= p.num_units) return;
    if (unit < kv_units) {
        insert_kv_rows(p, unit, c);
        return;
    }
#if Q_MODE == 1
    write_q_out_rows(p, unit - kv_units, c);
#elif Q_MODE == 2
    rotate_q_in_place(p, unit - kv_units, c);
#endif
}
