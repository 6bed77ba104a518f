// Gather-dequantize: records back to rows of values by slot (docs/format.md section 8;
// docs/kernels/reader.md). A team of 16 threads reads ROWS_PER_TEAM rows: their records into
// shared memory with cp.async, then whole output rows out. -D constants: PAGE_SIZE, SLOT_INT64,
// IDENTITY_SLOTS, OUT_FP32, ROWS_PER_TEAM.
#include "nvfp4_mla_params.cuh"  // Params: reader.READ_PARAMS
#include "nvfp4_mla_ptx.cuh"

// THREADS and the record ABI (HEAD_DIM, NOPE_DIM, DATA_BYTES, NOPE_BYTES, SCALE_BYTES) come from
// nvfp4_mla/abi.py and jit.py as -D options.
#define TEAM 16
#define TEAMS_PER_BLOCK (THREADS / TEAM)
#define RECORD_BYTES (DATA_BYTES + SCALE_BYTES)
#define OUT_VALUES (OUT_FP32 ? 4 : 8)       // values in a 16-byte output chunk
#define OUT_CHUNKS (HEAD_DIM / OUT_VALUES)  // 16-byte chunks in an output row
#define NOPE_OUT_CHUNKS (NOPE_DIM / OUT_VALUES)
#define STORES (OUT_CHUNKS / TEAM)                // a thread's stores per row
#define SECOND_COPIES (RECORD_BYTES / 16 - TEAM)  // threads 0..7 copy a second chunk of each record
// A team's staging area. The two teams of a warp stage 64 bytes apart modulo 128, so the same
// offset in both teams falls in different shared-memory banks.
#define TEAM_STAGE (ROWS_PER_TEAM * RECORD_BYTES + 64)

static_assert(DATA_BYTES % 16 == 0 && SCALE_BYTES == 32 && SECOND_COPIES <= TEAM, "a record is 24 chunks");
static_assert(OUT_CHUNKS % TEAM == 0 && NOPE_DIM % OUT_VALUES == 0, "whole chunks per thread");

__device__ __forceinline__ i64 load_slot(const Params& p, i64 row) {
#if IDENTITY_SLOTS
    return row;
#elif SLOT_INT64
    return static_cast<const i64*>(p.slots)[row];
#else
    return static_cast<const int*>(p.slots)[row];
#endif
}

// Output chunk c of the row whose record (data row, then scale slot) is staged at `record`.
__device__ __forceinline__ uint4 row_chunk(const u8* record, int c) {
    if (c < NOPE_OUT_CHUNKS) {  // NoPE: codes of OUT_VALUES elements, all in group c * OUT_VALUES / 16
#if OUT_FP32
        return nvfp4_f32x4(*reinterpret_cast<const unsigned short*>(record + 2 * c), record[DATA_BYTES + c / 4]);
#else
        return nvfp4_bf16x8(*reinterpret_cast<const u32*>(record + 4 * c), record[DATA_BYTES + c / 2]);
#endif
    }
    const int k = c - NOPE_OUT_CHUNKS;  // RoPE: stored BF16, NaN made canonical (then widened)
#if OUT_FP32
    const uint2 x = *reinterpret_cast<const uint2*>(record + NOPE_BYTES + 8 * k);
    const u32 a = bf16x2_canonical(x.x), b = bf16x2_canonical(x.y);
    return make_uint4(a << 16, a & 0xFFFF0000u, b << 16, b & 0xFFFF0000u);
#else
    const uint4 x = *reinterpret_cast<const uint4*>(record + NOPE_BYTES + 16 * k);
    return make_uint4(bf16x2_canonical(x.x), bf16x2_canonical(x.y), bf16x2_canonical(x.z), bf16x2_canonical(x.w));
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_read(const Params p) {
    __shared__ __align__(16) u8 stage[TEAMS_PER_BLOCK * TEAM_STAGE];
    const int team = threadIdx.x / TEAM, t = threadIdx.x % TEAM;
    const i64 first = (static_cast<i64>(blockIdx.x) * TEAMS_PER_BLOCK + team) * ROWS_PER_TEAM;
    if (first >= p.num_rows) return;  // uniform across the team
    u8* const staged = stage + team * TEAM_STAGE;

    // Every slot load first, then every record copy: one round trip to memory for each, whatever
    // ROWS_PER_TEAM is.
    i64 slot[ROWS_PER_TEAM];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TEAM; ++r) slot[r] = first + r < p.num_rows ? load_slot(p, first + r) : -1;
    bool valid[ROWS_PER_TEAM];
#pragma unroll
    for (int r = 0; r < ROWS_PER_TEAM; ++r) {
        valid[r] = slot[r] >= 0 && slot[r] < p.capacity;
        if (!valid[r]) continue;
        const unsigned long long s = static_cast<unsigned long long>(slot[r]);
        const u8* page = p.cache + static_cast<i64>(s / PAGE_SIZE) * p.page_stride;
        const u8* data = page + (s % PAGE_SIZE) * DATA_BYTES;
        const u8* scales = page + PAGE_SIZE * DATA_BYTES + (s % PAGE_SIZE) * SCALE_BYTES;
        u8* record = staged + r * RECORD_BYTES;
        cp_async16(record + 16 * t, data + 16 * t);
        if (t < SECOND_COPIES) {  // data chunks 16..21, then the scale slot's two chunks
            const int k = TEAM + t;
            cp_async16(record + 16 * k, 16 * k < DATA_BYTES ? data + 16 * k : scales + (16 * k - DATA_BYTES));
        }
    }
    cp_async_wait_all();
    __syncwarp(0xFFFFu << (threadIdx.x & 16));  // the team's copies are visible to the whole team

    const u32 fill = static_cast<u32>(p.fill);
#pragma unroll
    for (int r = 0; r < ROWS_PER_TEAM; ++r) {
        const i64 row = first + r;
        if (row >= p.num_rows) break;
        uint4* out = p.out + row * OUT_CHUNKS;
        const u8* record = staged + r * RECORD_BYTES;
#pragma unroll
        for (int j = 0; j < STORES; ++j) {
            const int c = j * TEAM + t;
            out[c] = valid[r] ? row_chunk(record, c) : make_uint4(fill, fill, fill, fill);
        }
    }
}
