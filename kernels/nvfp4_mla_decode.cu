// Sparse MLA decode attention read straight from the NVFP4 records (semantics: docs/format.md, the
// reference nvfp4_mla.reference.sparse_mla_decode). Two kernels, one per compile (-D COMBINE):
//
// nvfp4_mla_decode (COMBINE 0): one block per (query row, head tile of HEAD_TILE heads, split).
//   The block walks its split's tiles of BLOCK_N = 32 selected tokens (the sliding-window table's
//   entries, then the extra pool's). Per tile:
//     1. 32 threads turn the tile's slots into record addresses (0: masked: an invalid slot or an
//        entry past lens; its record and even its slot beyond lens are never read), and the block
//        starts cp.async copies of the live records' 384 bytes; the copies of tile t+1 fly while
//        tile t is computed. A tile with no live token is skipped.
//     2. Dequantize: one warp per token, lane g < 28 group g (e2m1 x e4m3 to BF16, exact), lanes
//        28..31 the BF16 RoPE dims; masked tokens become zero rows. K = V = this [32, 512] tile.
//     3. S = Q.K^T with mma.sync m16n8k16 (BF16 in, fp32 accumulate): warp w takes row block w/4
//        (16 heads) and dims slice w%4 (128 dims) for all 32 tokens; the 4 slices' partial sums
//        are added in a fixed order in step 4.
//     4. Online softmax in base 2, one warp per 4 heads, one lane per token: masked scores are
//        -inf, p = 2^(s - m) in fp32, row sums of the fp32 p, P rounded to BF16 for step 5.
//     5. O = alpha * O + P.V: warp w owns output dims [w * 512 / WARPS, ...) for all heads of
//        the tile (64 fp32 accumulators a thread, whatever HEAD_TILE).
//   Without splits the block finishes the rows (1/l, sink factor, BF16, lse); with splits it
//   writes its unnormalized O and (m, l) to the workspace.
// nvfp4_mla_decode_combine (COMBINE 1): one block per (query row, head) merges the splits in
//   split order (deterministic) and finishes the row the same way.
//
// -D constants: HEAD_TILE (16, 32 or 64), BLOCK_N, SMEM_BYTES (the host's count of the shared
// layout below, checked), COMBINE; THREADS and the record ABI come from jit.py/abi.py.
#include "nvfp4_numerics.cuh"

typedef unsigned long long u64;

#define LN2 0.693147180559945309f

// 2^x, fp32 (ex2.approx: about 2 ulp; 2^-inf = +0).
__device__ __forceinline__ float exp2_approx(float x) {
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7f800000u); }

// The natural-log LSE of a row from its running max m (log2 units) and sum l of 2^(s - m): +inf
// for a lonely row (l == 0: the row's max token alone adds 1 to l).
__device__ __forceinline__ float row_lse(float m, float l) { return l == 0.0f ? pos_inf() : (m + log2f(l)) * LN2; }

// The factor of a row's unnormalized output: 1 / l times the sink factor 1 / (1 + e^(sink - lse));
// 0 for a lonely row.
__device__ __forceinline__ float output_factor(float l, float lse, const float* sinks, i64 head) {
    if (l == 0.0f) return 0.0f;
    const float inv_l = 1.0f / l;
    return sinks ? inv_l / (1.0f + expf(sinks[head] - lse)) : inv_l;
}

#if !COMBINE

// ---------------------------------------------------------------- attention kernel

constexpr int HT = HEAD_TILE;                  // heads of a block: the M of the MMAs
constexpr int BN = BLOCK_N;                    // tokens of a tile
constexpr int WARPS = THREADS / 32;
constexpr int ROW_BLOCKS = HT / 16;            // MMA row blocks of 16 heads
constexpr int SLICES = 4;                      // Q.K^T: dims split over the warps of a row block
constexpr int SLICE_STEPS = HEAD_DIM / 16 / SLICES;
constexpr int COLS_PER_WARP = HEAD_DIM / WARPS;  // P.V: output dims of a warp
constexpr int NT_PER_WARP = COLS_PER_WARP / 8;   // ... as MMA n-tiles of 8
constexpr int ROWS_PER_WARP = HT / WARPS;        // softmax rows of a warp
constexpr int RECORD = DATA_BYTES + SCALE_BYTES; // 384
constexpr int RECORD_CHUNKS = RECORD / 16;
constexpr int DATA_CHUNKS = DATA_BYTES / 16;
constexpr int ROW_ELEMS = HEAD_DIM + 8;  // BF16 a shared Q or K row: 16 bytes of padding make ldmatrix conflict-free
constexpr int S_STRIDE = BN + 4;         // floats a row of a partial score slice
constexpr int P_STRIDE = BN + 8;         // BF16 a row of P (80 bytes: conflict-free ldmatrix)

static_assert(WARPS == SLICES * ROW_BLOCKS, "one warp per (row block, dims slice)");
static_assert(ROWS_PER_WARP * WARPS == HT && BN == 32, "softmax: whole rows a warp, one lane a token");
static_assert(NT_PER_WARP % 2 == 0 && NT_PER_WARP * 8 * WARPS == HEAD_DIM, "P.V: n-tile pairs per warp");
static_assert(NT_PER_WARP * ROW_BLOCKS == 16, "64 accumulators a thread");
static_assert(NOPE_DIM / 16 == NUM_GROUPS && NUM_GROUPS + (HEAD_DIM - NOPE_DIM) / 16 == 32,
              "dequantize: lane g < 28 one group, lanes 28..31 16 RoPE dims each");

// Shared memory, in bytes (decode.shared_bytes counts the same).
constexpr int SM_Q = 0;                                  // BF16 [HT][ROW_ELEMS]
constexpr int SM_K = SM_Q + HT * ROW_ELEMS * 2;          // BF16 [BN][ROW_ELEMS]: K and V
constexpr int SM_RAW = SM_K + BN * ROW_ELEMS * 2;        // u8 [BN][384]: records (data row, scale slot)
constexpr int SM_S = SM_RAW + BN * RECORD;               // fp32 [SLICES][HT][S_STRIDE]: partial scores
constexpr int SM_P = SM_S + SLICES * HT * S_STRIDE * 4;  // BF16 [HT][P_STRIDE]
constexpr int SM_M = SM_P + HT * P_STRIDE * 2;           // fp32 [HT]: running max (log2 units)
constexpr int SM_L = SM_M + HT * 4;                      // fp32 [HT]: running sum
constexpr int SM_ALPHA = SM_L + HT * 4;                  // fp32 [HT]: this tile's rescale of O
constexpr int SM_TOKEN = SM_ALPHA + HT * 4;              // u64 [2][BN]: data-row address (0: masked)
constexpr int SM_SCALE = SM_TOKEN + 2 * BN * 8;          // u64 [BN]: scale-slot address
static_assert(SM_SCALE + BN * 8 == SMEM_BYTES, "shared layout must match decode.shared_bytes");
static_assert(SM_K % 16 == 0 && SM_RAW % 16 == 0 && SM_S % 16 == 0 && SM_P % 16 == 0 && SM_TOKEN % 16 == 0,
              "16-byte aligned regions");

struct Pool {             // one cache and its slot table; k == 0: no such pool
    const u8* cache;      // page 0
    const void* slots;    // [rows, k] int32 or int64
    const int* lens;      // [rows] or null (every entry counts)
    i64 page_stride;      // bytes
    i64 page_size;
    i64 capacity;         // num_pages * page_size: valid slots are [0, capacity)
    i64 k;
    i64 slot_int64;
};

struct Params {  // 8-byte fields only: packed on the host with one struct format
    const uint4* q;       // BF16 [rows, num_heads, 512]
    u32* out;             // BF16 [rows, num_heads, 512] (no splits)
    float* lse;           // [rows, num_heads] (no splits)
    float* partial_o;     // [rows, num_heads, num_splits, 512] (splits)
    float* partial_ml;    // [rows, num_heads, num_splits, 2]: m, l (splits)
    const float* sinks;   // [num_heads] or null
    Pool swa, extra;
    i64 num_heads;
    i64 num_splits;
    i64 tiles_per_split;
    double score_scale;   // sm_scale * log2(e)
};
static_assert(sizeof(Params) == PARAMS_BYTES, "Params must match the host's struct format (decode.ATTEND_PARAMS)");

__device__ __forceinline__ u32 shared_address(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldmatrix_x4(u32 address, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 address, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}

// d += a (16x16 BF16, row-major fragment) * b (16x8 BF16, column-major fragment), fp32.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The lane's ldmatrix row address of a 16x16 A fragment at (row0, col0) of a BF16 matrix with
// `stride` elements a row: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15) in a0..a3 order.
__device__ __forceinline__ u32 a_fragment_address(const u16* base, int stride, int row0, int col0, int lane) {
    const int m = lane >> 3;
    return shared_address(base + (row0 + (lane & 7) + (m & 1) * 8) * stride + col0 + (m >> 1) * 8);
}

// Tile t's record addresses: tokens is double-buffered by the parity of the tile index (the
// copies of tile t + 1 start while tile t is computed), so every writer and reader of tile t
// must pick its half here, the first tile of a split included (splits may begin on an odd tile).
__device__ __forceinline__ u64* tile_tokens(u64* tokens, i64 tile) { return tokens + (tile & 1) * BN; }

// Live entries of a row of a pool's table: lens clamped to [0, k], or k without lens.
__device__ __forceinline__ i64 live_count(const int* lens, i64 k, i64 row) {
    if (k == 0 || lens == nullptr) return k;
    const i64 n = lens[row];
    return n < 0 ? 0 : (n > k ? k : n);
}

// Step 1 for `tile`: the record addresses of its tokens (tokens[t] = 0 when masked) and the
// copies of the live records into `raw`. Returns whether any token is live (block-uniform).
// Every thread must call it (it synchronises the block).
__device__ __forceinline__ bool start_tile(const Params& p, i64 row, i64 tile, i64 swa_live, i64 extra_live,
                                           u64* tokens, u64* scales, u8* raw) {
    const int tid = threadIdx.x;
    u64 data = 0;
    if (tid < BN) {
        const i64 n = tile * BN + tid;
        const bool in_swa = n < p.swa.k;
        // Fields picked one by one: a reference to a Params member would copy Params to the stack.
        const i64 j = in_swa ? n : n - p.swa.k;
        const i64 k = in_swa ? p.swa.k : p.extra.k;
        u64 scale = 0;
        if (j < (in_swa ? swa_live : extra_live)) {  // false past both tables too (extra_live <= extra.k)
            const void* slots = in_swa ? p.swa.slots : p.extra.slots;
            const i64 slot = (in_swa ? p.swa.slot_int64 : p.extra.slot_int64)
                                 ? static_cast<const i64*>(slots)[row * k + j]
                                 : static_cast<const int*>(slots)[row * k + j];
            if (slot >= 0 && slot < (in_swa ? p.swa.capacity : p.extra.capacity)) {
                const i64 page_size = in_swa ? p.swa.page_size : p.extra.page_size;
                const i64 page = slot / page_size, entry = slot - page * page_size;
                const u8* base = (in_swa ? p.swa.cache : p.extra.cache) +
                                 page * (in_swa ? p.swa.page_stride : p.extra.page_stride);
                data = reinterpret_cast<u64>(base + entry * DATA_BYTES);
                scale = reinterpret_cast<u64>(base + page_size * DATA_BYTES + entry * SCALE_BYTES);
            }
        }
        tokens[tid] = data;
        scales[tid] = scale;
    }
    const bool any = __syncthreads_or(data != 0);
    if (any) {
        for (int c = tid; c < BN * RECORD_CHUNKS; c += THREADS) {
            const int t = c / RECORD_CHUNKS, part = c - t * RECORD_CHUNKS;
            const u64 address = tokens[t];
            if (address) {
                const u8* src = part < DATA_CHUNKS ? reinterpret_cast<const u8*>(address) + part * 16
                                                   : reinterpret_cast<const u8*>(scales[t]) + (part - DATA_CHUNKS) * 16;
                cp_async16(raw + t * RECORD + part * 16, src);
            }
        }
    }
    return any;
}

// Step 2: the records in `raw` as BF16 rows of `ks` (zero rows for masked tokens). Lane g writes
// bytes 32g..32g+31 of a row: group g's 16 NoPE values (g < 28) or 16 RoPE values.
__device__ __forceinline__ void dequantize_tile(const u8* raw, const u64* tokens, u16* ks, int warp, int lane) {
#pragma unroll 1
    for (int i = 0; i < BN / WARPS; ++i) {
        const int t = warp * (BN / WARPS) + i;
        const u8* record = raw + t * RECORD;
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
        if (tokens[t]) {
            if (lane < NUM_GROUPS) {
                const uint2 codes = *reinterpret_cast<const uint2*>(record + lane * 8);
                const u32 scale_byte = record[DATA_BYTES + lane];
                lo = nvfp4_bf16x8(codes.x, scale_byte);
                hi = nvfp4_bf16x8(codes.y, scale_byte);
            } else {
                const uint4* rope = reinterpret_cast<const uint4*>(record + NOPE_BYTES + (lane - NUM_GROUPS) * 32);
                lo = rope[0];
                hi = rope[1];
            }
        }
        uint4* dst = reinterpret_cast<uint4*>(ks + t * ROW_ELEMS + lane * 16);
        dst[0] = lo;
        dst[1] = hi;
    }
}

// Step 3: this warp's partial scores (row block w/4, dims slice w%4) for the 32 tokens.
__device__ __forceinline__ void partial_scores(const u16* qs, const u16* ks, float* ss, int warp, int lane) {
    const int row_block = warp / SLICES, slice = warp % SLICES;
    float s[BN / 8][4] = {};
    const int m = lane >> 3;
#pragma unroll
    for (int step = 0; step < SLICE_STEPS; ++step) {
        const int k0 = (slice * SLICE_STEPS + step) * 16;
        u32 a[4];
        ldmatrix_x4(a_fragment_address(qs, ROW_ELEMS, row_block * 16, k0, lane), a);
#pragma unroll
        for (int pair = 0; pair < BN / 16; ++pair) {
            // B fragments of two n-tiles: matrices (tokens 0-7 | 8-15) x (dims 0-7 | 8-15), K rows are tokens.
            u32 b[4];
            const int token = pair * 16 + (lane & 7) + (m >> 1) * 8;
            ldmatrix_x4(shared_address(ks + token * ROW_ELEMS + k0 + (m & 1) * 8), b);
            mma_bf16(s[2 * pair], a, b[0], b[1]);
            mma_bf16(s[2 * pair + 1], a, b[2], b[3]);
        }
    }
    // C fragment: rows lane/4 and lane/4 + 8, tokens 2 (lane % 4) + {0, 1} of each n-tile.
    float* out = ss + (slice * HT + row_block * 16 + (lane >> 2)) * S_STRIDE + (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
        *reinterpret_cast<float2*>(out + nt * 8) = make_float2(s[nt][0], s[nt][1]);
        *reinterpret_cast<float2*>(out + 8 * S_STRIDE + nt * 8) = make_float2(s[nt][2], s[nt][3]);
    }
}

// Step 4 for this warp's rows: lane = token.
__device__ __forceinline__ void online_softmax(const float* ss, const u64* tokens, u16* ps, float* row_m, float* row_l,
                                               float* row_alpha, float score_scale, int warp, int lane) {
    const bool live = tokens[lane] != 0;
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const int r = warp * ROWS_PER_WARP + i;
        float x = ss[r * S_STRIDE + lane];
#pragma unroll
        for (int slice = 1; slice < SLICES; ++slice) x += ss[(slice * HT + r) * S_STRIDE + lane];
        const float s = live ? x * score_scale : neg_inf();
        float tile_max = s;
#pragma unroll
        for (int o = 16; o; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(NVFP4_FULL_MASK, tile_max, o));
        const float m_old = row_m[r];
        const float m_new = fmaxf(m_old, tile_max);
        const float m_base = m_new == neg_inf() ? 0.0f : m_new;  // nothing live yet: every p and alpha is 0
        const float prob = exp2_approx(s - m_base);
        float sum = prob;
#pragma unroll
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(NVFP4_FULL_MASK, sum, o);
        ps[r * P_STRIDE + lane] = static_cast<u16>(bf16_bits(prob));
        __syncwarp();
        if (lane == 0) {
            const float alpha = exp2_approx(m_old - m_base);
            row_m[r] = m_new;
            row_l[r] = row_l[r] * alpha + sum;
            row_alpha[r] = alpha;
        }
    }
}

// Step 5: acc = alpha * acc + P.V for this warp's output dims.
__device__ __forceinline__ void accumulate(const u16* ps, const u16* ks, const float* row_alpha,
                                           float (&acc)[ROW_BLOCKS][NT_PER_WARP][4], int warp, int lane) {
#pragma unroll
    for (int rb = 0; rb < ROW_BLOCKS; ++rb) {
        const float lo = row_alpha[rb * 16 + (lane >> 2)], hi = row_alpha[rb * 16 + (lane >> 2) + 8];
#pragma unroll
        for (int nt = 0; nt < NT_PER_WARP; ++nt) {
            acc[rb][nt][0] *= lo;
            acc[rb][nt][1] *= lo;
            acc[rb][nt][2] *= hi;
            acc[rb][nt][3] *= hi;
        }
    }
    const int m = lane >> 3;
#pragma unroll
    for (int step = 0; step < BN / 16; ++step) {
        u32 a[ROW_BLOCKS][4];
#pragma unroll
        for (int rb = 0; rb < ROW_BLOCKS; ++rb) ldmatrix_x4(a_fragment_address(ps, P_STRIDE, rb * 16, step * 16, lane), a[rb]);
#pragma unroll
        for (int pair = 0; pair < NT_PER_WARP / 2; ++pair) {
            // V rows are tokens (the MMA's k): transposed matrices (tokens 0-7 | 8-15) x (dims 0-7 | 8-15).
            const int dim = warp * COLS_PER_WARP + pair * 16 + (m >> 1) * 8;
            const int token = step * 16 + (lane & 7) + (m & 1) * 8;
            u32 b[4];
            ldmatrix_x4_trans(shared_address(ks + token * ROW_ELEMS + dim), b);
#pragma unroll
            for (int rb = 0; rb < ROW_BLOCKS; ++rb) {
                mma_bf16(acc[rb][2 * pair], a[rb], b[0], b[1]);
                mma_bf16(acc[rb][2 * pair + 1], a[rb], b[2], b[3]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 512 / THREADS) nvfp4_mla_decode(const Params p) {
    extern __shared__ __align__(16) u8 smem[];
    u16* const qs = reinterpret_cast<u16*>(smem + SM_Q);
    u16* const ks = reinterpret_cast<u16*>(smem + SM_K);
    u8* const raw = smem + SM_RAW;
    float* const ss = reinterpret_cast<float*>(smem + SM_S);
    u16* const ps = reinterpret_cast<u16*>(smem + SM_P);
    float* const row_m = reinterpret_cast<float*>(smem + SM_M);
    float* const row_l = reinterpret_cast<float*>(smem + SM_L);
    float* const row_alpha = reinterpret_cast<float*>(smem + SM_ALPHA);
    u64* const tokens = reinterpret_cast<u64*>(smem + SM_TOKEN);
    u64* const scales = reinterpret_cast<u64*>(smem + SM_SCALE);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 num_heads = p.num_heads, num_splits = p.num_splits;
    const i64 head_tiles = (num_heads + HT - 1) / HT;
    const i64 head0 = static_cast<i64>(blockIdx.x % head_tiles) * HT;
    const i64 split = static_cast<i64>(blockIdx.x / head_tiles) % num_splits;
    const i64 row = static_cast<i64>(blockIdx.x / head_tiles) / num_splits;  // batch * q_len + position
    const i64 num_tiles = (p.swa.k + p.extra.k + BN - 1) / BN;
    const i64 tile_begin = split * p.tiles_per_split;
    const i64 tile_end = tile_begin + p.tiles_per_split < num_tiles ? tile_begin + p.tiles_per_split : num_tiles;
    const i64 swa_live = live_count(p.swa.lens, p.swa.k, row), extra_live = live_count(p.extra.lens, p.extra.k, row);
    const float score_scale = static_cast<float>(p.score_scale);

    // The query heads of the tile (zero rows past num_heads) and empty row statistics.
    for (int c = tid; c < HT * 64; c += THREADS) {
        const int h = c >> 6, part = c & 63;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (head0 + h < num_heads) v = __ldg(p.q + (row * num_heads + head0 + h) * 64 + part);
        *reinterpret_cast<uint4*>(qs + h * ROW_ELEMS + part * 8) = v;
    }
    if (tid < HT) {
        row_m[tid] = neg_inf();
        row_l[tid] = 0.0f;
    }
    float acc[ROW_BLOCKS][NT_PER_WARP][4] = {};

    bool live = tile_begin < tile_end &&
                start_tile(p, row, tile_begin, swa_live, extra_live, tile_tokens(tokens, tile_begin), scales, raw);
    for (i64 tile = tile_begin; tile < tile_end; ++tile) {
        const u64* const this_tokens = tile_tokens(tokens, tile);
        cp_async_wait_all();
        __syncthreads();  // this tile's records and addresses are in; the last P.V is done with ks and ps
        if (live) dequantize_tile(raw, this_tokens, ks, warp, lane);
        __syncthreads();  // ks is ready and raw is free for the next tile's copies
        const bool live_now = live;
        live = tile + 1 < tile_end &&
               start_tile(p, row, tile + 1, swa_live, extra_live, tile_tokens(tokens, tile + 1), scales, raw);
        if (live_now) {  // block-uniform
            partial_scores(qs, ks, ss, warp, lane);
            __syncthreads();
            online_softmax(ss, this_tokens, ps, row_m, row_l, row_alpha, score_scale, warp, lane);
            __syncthreads();
            accumulate(ps, ks, row_alpha, acc, warp, lane);
        }
    }
    __syncthreads();  // row statistics final (also with no tile at all)

    // C fragment: rows rb*16 + lane/4 (+8), dims warp*COLS_PER_WARP + nt*8 + 2 (lane % 4) + {0, 1}.
#pragma unroll
    for (int rb = 0; rb < ROW_BLOCKS; ++rb) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = rb * 16 + (lane >> 2) + half * 8;
            const i64 head = head0 + r;
            if (head >= num_heads) continue;
            const float m = row_m[r], l = row_l[r];
            const int col0 = warp * COLS_PER_WARP + (lane & 3) * 2;
            if (num_splits == 1) {
                const float factor = output_factor(l, row_lse(m, l), p.sinks, head);
                u32* out = p.out + ((row * num_heads + head) * HEAD_DIM + col0) / 2;
#pragma unroll
                for (int nt = 0; nt < NT_PER_WARP; ++nt) {
                    const float x = acc[rb][nt][2 * half] * factor, y = acc[rb][nt][2 * half + 1] * factor;
                    out[nt * 4] = bf16_bits(x) | (bf16_bits(y) << 16);
                }
            } else {
                float* out = p.partial_o + ((row * num_heads + head) * num_splits + split) * HEAD_DIM + col0;
#pragma unroll
                for (int nt = 0; nt < NT_PER_WARP; ++nt)
                    *reinterpret_cast<float2*>(out + nt * 8) = make_float2(acc[rb][nt][2 * half], acc[rb][nt][2 * half + 1]);
            }
        }
    }
    if (tid < HT && head0 + tid < num_heads) {
        const i64 head = head0 + tid;
        const float m = row_m[tid], l = row_l[tid];
        if (num_splits == 1)
            p.lse[row * num_heads + head] = row_lse(m, l);
        else
            reinterpret_cast<float2*>(p.partial_ml)[(row * num_heads + head) * num_splits + split] = make_float2(m, l);
    }
}

#else

// ---------------------------------------------------------------- split combine kernel

struct Params {  // 8-byte fields only: packed on the host with one struct format
    const float4* partial_o;   // [rows, num_heads, num_splits, 512]
    const float2* partial_ml;  // [rows, num_heads, num_splits]: m (log2 units), l
    const float* sinks;        // [num_heads] or null
    uint2* out;                // BF16 [rows, num_heads, 512]
    float* lse;                // [rows, num_heads]
    i64 num_heads;
    i64 num_splits;
};
static_assert(sizeof(Params) == PARAMS_BYTES, "Params must match the host's struct format (decode.COMBINE_PARAMS)");
static_assert(THREADS * 4 == HEAD_DIM, "one thread per 4 output dims");

// One block per (row, head): O = sum_s 2^(m_s - M) O_s, l = sum_s 2^(m_s - M) l_s, in split order.
extern "C" __global__ void __launch_bounds__(THREADS) nvfp4_mla_decode_combine(const Params p) {
    const i64 row_head = blockIdx.x;  // row * num_heads + head
    const i64 num_splits = p.num_splits;
    const float2* ml = p.partial_ml + row_head * num_splits;
    float m = neg_inf();
    for (i64 s = 0; s < num_splits; ++s) m = fmaxf(m, ml[s].x);
    const float m_base = m == neg_inf() ? 0.0f : m;  // lonely: every weight below is 0
    float l = 0.0f;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4* partial = p.partial_o + row_head * num_splits * (HEAD_DIM / 4) + threadIdx.x;
    for (i64 s = 0; s < num_splits; ++s) {
        const float2 split = ml[s];
        const float w = exp2_approx(split.x - m_base);
        const float4 x = partial[s * (HEAD_DIM / 4)];
        l += split.y * w;
        o.x += x.x * w;
        o.y += x.y * w;
        o.z += x.z * w;
        o.w += x.w * w;
    }
    const float lse = row_lse(m, l);
    const float factor = output_factor(l, lse, p.sinks, row_head % p.num_heads);
    p.out[row_head * (HEAD_DIM / 4) + threadIdx.x] =
        make_uint2(bf16_bits(o.x * factor) | (bf16_bits(o.y * factor) << 16),
                   bf16_bits(o.z * factor) | (bf16_bits(o.w * factor) << 16));
    if (threadIdx.x == 0) p.lse[row_head] = lse;
}

#endif
