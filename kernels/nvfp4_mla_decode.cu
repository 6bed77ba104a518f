// Sparse MLA decode attention read straight from the NVFP4 records, on every GPU from sm_80: a
// block per (part of the work list, head tile of HEAD_TILE heads), walking its part's segments,
// with mma.sync tensor-core products (docs/kernels/decode_mma.md; semantics: docs/format.md
// section 9; the work list: nvfp4_mla_work.cuh). -D constants: HEAD_TILE (16, 32 or 64),
// DIM_SPLIT, BLOCK_N, SMEM_BYTES; THREADS and the record ABI come from jit.py/abi.py.
#include "nvfp4_mla_params.cuh"  // Params: decode_backend.ATTEND_PARAMS
#include "nvfp4_mla_ptx.cuh"
#include "nvfp4_mla_records.cuh"
#include "nvfp4_mla_schedule.cuh"
#include "nvfp4_mla_softmax.cuh"

constexpr int HT = HEAD_TILE;  // heads of a block
constexpr int BN = BLOCK_N;    // tokens of a tile
constexpr u32 TILE_SHIFT = 5;  // log2(BN): the work list counts a row's live entries in tiles of BN
constexpr int WARPS = THREADS / 32;
constexpr int ROW_BLOCKS = HT / 16;         // MMA row blocks of 16 heads
constexpr int COLS = HEAD_DIM / DIM_SPLIT;  // dims of a warp's slice (both products)
constexpr int K_STEPS = COLS / 16;          // Q.K^T: MMA k-steps of the slice
constexpr int N_TILES = COLS / 8;           // P.V: MMA n-tiles of the slice
constexpr int S_TILES = BN / 8;             // Q.K^T: n-tiles of the tile's tokens
constexpr int RECORD_CHUNKS = RECORD / 16;
constexpr int DATA_CHUNKS = DATA_BYTES / 16;
// Blocks an SM should hold: 128 registers a thread with 4 warps a row block (64 accumulators),
// up to 255 with 2 (128 accumulators).
constexpr int MIN_BLOCKS = 1;
// Tokens a warp dequantizes together: 2 where registers allow (4 warps a row block: 64 accumulators).
constexpr int DEQUANTIZE_UNROLL = DIM_SPLIT == 2 ? 1 : 2;
constexpr int TOKEN_THREADS = THREADS / BLOCK_N;  // threads copying one record
constexpr int ROW_ELEMS = HEAD_DIM + 8;  // BF16 a shared K row: 16 bytes of padding make ldmatrix conflict-free
// Q in registers where a warp's dims slice is 128 (32 registers a thread); with 256 (64 heads a
// block: 128 accumulators a thread) it is read from shared memory each tile.
constexpr bool Q_IN_REGISTERS = DIM_SPLIT == 4;

static_assert(WARPS == ROW_BLOCKS * DIM_SPLIT && HT % 16 == 0, "one warp per (row block, dims slice)");
static_assert(BN == 32 && BN == 1 << TILE_SHIFT && S_TILES == 4, "a lane per token when addressing; two P.V k-steps");
static_assert(TOKEN_THREADS * BN == THREADS && RECORD_CHUNKS % TOKEN_THREADS == 0, "whole records a thread group");
static_assert(N_TILES % 2 == 0 && K_STEPS >= 1, "P.V: n-tile pairs per ldmatrix");
static_assert(HEAD_DIM / 8 == 64 && NOPE_CHUNKS == 56, "dequantize: lane L chunks L and L + 32, RoPE from 56");

// Q's MMA fragments in shared memory [warp][k-step][lane], or nothing with Q in registers (an
// empty base takes no room).
template <bool IN_REGISTERS>
struct SharedQ {
    uint4 q[WARPS][K_STEPS][32];
};
template <>
struct SharedQ<true> {};

// The block's shared memory: SMEM_BYTES, the host's count (ops/decode_mma.shared_bytes).
struct SharedStorage : SharedQ<Q_IN_REGISTERS> {
    u16 k[BN][ROW_ELEMS];               // BF16 K and V of the tile
    u8 raw[BN][RECORD];                 // the tile's records (data row, scale slot)
    float4 scores[WARPS][S_TILES][32];  // partial scores of each warp's dims slice
    u64 tokens[BN];                     // data-row addresses (0: masked)
    u64 scales[BN];                     // scale-slot addresses
    i64 slots[2][BN];                   // slots of two tiles
    u32 live[4];                        // live-token masks of two tiles (and padding)
    u32 scale_pairs[256];               // e4m3_bf16x2 of every scale byte
};
static_assert(sizeof(SharedStorage) == SMEM_BYTES, "the shared layout must match the host's count");
static_assert(SCHEDULE_BYTES <= sizeof(SharedStorage::k), "a block's own list is dealt in its K buffer");

// The regions' byte offsets, for the address arithmetic of the code that fills and reads them.
constexpr int SM_Q = 0;
constexpr int SM_K = offsetof(SharedStorage, k);
constexpr int SM_RAW = offsetof(SharedStorage, raw);
constexpr int SM_X = offsetof(SharedStorage, scores);
constexpr int SM_TOKEN = offsetof(SharedStorage, tokens);
constexpr int SM_SCALE = offsetof(SharedStorage, scales);
constexpr int SM_SLOT = offsetof(SharedStorage, slots);
constexpr int SM_LIVE = offsetof(SharedStorage, live);
constexpr int SM_SCALES = offsetof(SharedStorage, scale_pairs);
static_assert(SM_RAW % 16 == 0 && SM_X % 16 == 0 && SM_TOKEN % 16 == 0, "16-byte aligned regions");

// Tile t's live mask is double-buffered by the parity of the tile index (tile t + 1's is written
// while tile t is dequantized), so every writer and reader of tile t must pick its word here, the
// first tile of a segment included (segments may begin on an odd tile). The record addresses need
// one buffer: only the copies read them, between the barriers that follow their writes.
__device__ __forceinline__ int parity(int tile) { return tile & 1; }

// Token `lane` of `tile` (a thread of warp 0), two tiles ahead: starts the copy of its slot into
// the tile's half of `slot_words` (-1 when the entry is past its table's live count: then its slot
// is never read). The copy lands with the records' copies, so no register waits for it. A tile
// counts the row's live entries (live_entry).
__device__ __forceinline__ void fetch_slot(const Params& p, i64 row, int tile, i64 swa_live, i64 extra_live,
                                           i64* slot_words, int lane) {
    i64* const dst = slot_words + parity(tile) * BN + lane;
    const SlotRef ref = slot_ref(p, row, live_entry(p, tile * BN + lane, swa_live), swa_live, extra_live);
    if (!ref.live)
        *dst = -1;
    else if (ref.int64)
        cp_async_small<8>(dst, ref.words);
    else
        cp_async_small<4>(dst, ref.words);  // the low word (little-endian)
}

// Step 1 for `tile` (warp 0, a lane per token): the record addresses of its slot, which fetch_slot
// copied, into `tokens` (0 when masked) and `scales`, and the tile's live mask. Returns the lane's
// live bit.
__device__ __forceinline__ bool address_tile(const Params& p, int tile, i64 swa_live, const i64* slot_words,
                                             u64* tokens, u64* scales, u32* live_masks, int lane) {
    const i64 n = live_entry(p, tile * BN + lane, swa_live);
    const u32* const words = reinterpret_cast<const u32*>(slot_words + parity(tile) * BN + lane);
    const RecordAddress record = record_address(p, n, slot_of_words(words[0], words[1], slot_is_int64(p, n)));
    const u64 data = reinterpret_cast<u64>(record.data);
    tokens[lane] = data;
    scales[lane] = reinterpret_cast<u64>(record.scale);
    const u32 mask = __ballot_sync(NVFP4_FULL_MASK, data != 0);
    if (lane == 0) live_masks[parity(tile)] = mask;
    return data != 0;
}

// Step 1, the copies of `tile`'s live records into `raw` (every thread, after the barrier that
// publishes the addresses): TOKEN_THREADS threads a record, thread i its 16-byte chunks i,
// i + TOKEN_THREADS, ... (consecutive threads, consecutive chunks).
__device__ __forceinline__ void copy_tile(const u64* tokens, const u64* scales, u8* raw) {
    const int t = threadIdx.x / TOKEN_THREADS, first = threadIdx.x % TOKEN_THREADS;
    const u8* const data = reinterpret_cast<const u8*>(tokens[t]);
    if (data == nullptr) return;
    const u8* const scale = reinterpret_cast<const u8*>(scales[t]);
    u8* const dst = raw + t * RECORD;
#pragma unroll
    for (int part = first; part < RECORD_CHUNKS; part += TOKEN_THREADS)
        cp_async16(dst + part * 16, part < DATA_CHUNKS ? data + part * 16 : scale + (part - DATA_CHUNKS) * 16);
}

// Step 2: the live records in `raw` as BF16 rows of `ks` (zero rows for masked tokens). Lane L
// writes chunks L and L + 32 of a row: consecutive 16-byte stores, free of bank conflicts.
__device__ __forceinline__ void dequantize_tile(const u8* raw, const u32* scale_pairs, u32 live, u16* ks, int warp,
                                                int lane) {
#pragma unroll DEQUANTIZE_UNROLL
    for (int t = warp; t < BN; t += WARPS) {
        const u8* record = raw + t * RECORD;
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
        if ((live >> t) & 1u) {
            lo = dequantize_chunk(record, scale_pairs, lane);
            hi = dequantize_chunk(record, scale_pairs, lane + 32);
        }
        uint4* dst = reinterpret_cast<uint4*>(ks + t * ROW_ELEMS);
        dst[lane] = lo;
        dst[lane + 32] = hi;
    }
}

// A warp's running attention over a segment: O's C fragments (rows g and g + 8 of its row block,
// its dims slice) and each row's softmax base m and sum l.
struct RowState {
    float acc[N_TILES][4];
    float m_lo, m_hi, l_lo, l_hi;
};

// Q's fragments of the warp's rows and dims slice for query row `row`: fragment k is the A operand
// of k-step k (rows g and g + 8, dims 2 quad + {0, 1} and + 8), into q_regs or at qf[32 k]. Heads
// past num_heads are zero rows.
__device__ __forceinline__ void load_q(const Params& p, i64 row, i64 head0, int slice, int lane, uint4* qf,
                                       uint4 (&q_regs)[Q_IN_REGISTERS ? K_STEPS : 1]) {
    const int g = lane >> 2, quad = lane & 3;
    const i64 num_heads = p.num_heads;
    const bool lo_ok = head0 + g < num_heads, hi_ok = head0 + g + 8 < num_heads;
    const u32* q_lo = reinterpret_cast<const u32*>(p.q + ((row * num_heads + head0 + g) * HEAD_DIM + slice * COLS));
    const u32* q_hi = q_lo + 8 * HEAD_DIM / 2;
#pragma unroll
    for (int k = 0; k < K_STEPS; ++k) {
        const uint4 q =
            make_uint4(lo_ok ? __ldg(q_lo + k * 8 + quad) : 0u, hi_ok ? __ldg(q_hi + k * 8 + quad) : 0u,
                       lo_ok ? __ldg(q_lo + k * 8 + 4 + quad) : 0u, hi_ok ? __ldg(q_hi + k * 8 + 4 + quad) : 0u);
        if constexpr (Q_IN_REGISTERS)
            q_regs[k] = q;
        else
            qf[k * 32] = q;
    }
}

// Steps 3-5 for the tile dequantized in ks, whose live tokens are `live_mask`: the warp's partial
// scores, their sum over the row block's dims slices (through xs), the online softmax and O += P.V.
// k_lane and v_lane: the lane's ldmatrix row addresses in ks, every fragment at a constant offset.
__device__ __forceinline__ void attend_tile(const uint4 (&q_regs)[Q_IN_REGISTERS ? K_STEPS : 1], const uint4* qf,
                                            float4* xs, u32 k_lane, u32 v_lane, u32 live_mask, float score_scale,
                                            int warp, int lane, RowState& st) {
    const int row_block = warp / DIM_SPLIT, quad = lane & 3;
    float (&acc)[N_TILES][4] = st.acc;
    float &m_lo = st.m_lo, &m_hi = st.m_hi, &l_lo = st.l_lo, &l_hi = st.l_hi;
    // 3. Partial scores of the warp's slice: s[n] is n-tile n (tokens 8n..8n+7).
    //    Even and odd k-steps accumulate apart: two independent MMA chains per n-tile.
    float s[S_TILES][4] = {}, s_odd[S_TILES][4] = {};
#pragma unroll
    for (int k = 0; k < K_STEPS; ++k) {
        uint4 q;
        if constexpr (Q_IN_REGISTERS)
            q = q_regs[k];
        else
            q = qf[k * 32];
        const u32 qa[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int pair = 0; pair < S_TILES / 2; ++pair) {
            // B fragments of two n-tiles: matrices (tokens 0-7 | 8-15) x (dims 0-7 | 8-15), K rows are tokens.
            u32 b[4];
            ldmatrix_x4(k_lane + (pair * 16 * ROW_ELEMS + k * 16) * 2, b);
            mma_bf16(k & 1 ? s_odd[2 * pair] : s[2 * pair], qa, b[0], b[1]);
            mma_bf16(k & 1 ? s_odd[2 * pair + 1] : s[2 * pair + 1], qa, b[2], b[3]);
        }
    }
#pragma unroll
    for (int n = 0; n < S_TILES; ++n)
        xs[(warp * S_TILES + n) * 32 + lane] =
            make_float4(s[n][0] + s_odd[n][0], s[n][1] + s_odd[n][1], s[n][2] + s_odd[n][2], s[n][3] + s_odd[n][3]);
    named_barrier_aligned(1 + row_block, DIM_SPLIT * 32);
#pragma unroll
    for (int n = 0; n < S_TILES; ++n) {
        float4 x = xs[(row_block * DIM_SPLIT * S_TILES + n) * 32 + lane];
#pragma unroll
        for (int d = 1; d < DIM_SPLIT; ++d) {  // slice order: the same sum in every warp of the row block
            const float4 y = xs[((row_block * DIM_SPLIT + d) * S_TILES + n) * 32 + lane];
            x = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
        }
        // C fragment: rows g (x, y) and g + 8 (z, w), tokens 8n + 2 quad + {0, 1}.
        const bool live0 = (live_mask >> (8 * n + 2 * quad)) & 1u, live1 = (live_mask >> (8 * n + 2 * quad + 1)) & 1u;
        s[n][0] = live0 ? x.x * score_scale : neg_inf();
        s[n][1] = live1 ? x.y * score_scale : neg_inf();
        s[n][2] = live0 ? x.z * score_scale : neg_inf();
        s[n][3] = live1 ? x.w * score_scale : neg_inf();
    }

    // 4. Online softmax of rows g (elements 0, 1) and g + 8 (2, 3): the quad's 4 lanes hold a row's 32 tokens.
    //    m is a base at most RESCALE_SLACK below the running max, so p <= 2^RESCALE_SLACK; O and l
    //    always share it, and lse = m + log2(l) whatever it is.
    float max_lo = fmaxf(s[0][0], s[0][1]), max_hi = fmaxf(s[0][2], s[0][3]);
#pragma unroll
    for (int n = 1; n < S_TILES; ++n) {
        max_lo = fmaxf(max_lo, fmaxf(s[n][0], s[n][1]));
        max_hi = fmaxf(max_hi, fmaxf(s[n][2], s[n][3]));
    }
    quad_max(max_lo, max_hi);
    const bool move_lo = base_moves(max_lo, m_lo), move_hi = base_moves(max_hi, m_hi);
    const float new_lo = move_lo ? max_lo : m_lo, new_hi = move_hi ? max_hi : m_hi;
    const float base_lo = softmax_base(new_lo), base_hi = softmax_base(new_hi);
    u32 pa[2][4];  // P as the A operands of the two P.V k-steps (tokens 0-15, 16-31)
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int n = 0; n < S_TILES; ++n) {
        const float p0 = exp2_approx(s[n][0] - base_lo), p1 = exp2_approx(s[n][1] - base_lo);
        const float p2 = exp2_approx(s[n][2] - base_hi), p3 = exp2_approx(s[n][3] - base_hi);
        sum_lo += p0 + p1;
        sum_hi += p2 + p3;
        // p is never NaN (finite scores or -inf): the plain conversion.
        pa[n / 2][(n & 1) * 2] = bf16x2_rn(p0, p1);      // row g, tokens 8n + 2 quad + {0, 1}
        pa[n / 2][(n & 1) * 2 + 1] = bf16x2_rn(p2, p3);  // row g + 8
    }
    quad_sum(sum_lo, sum_hi);
    if (__any_sync(NVFP4_FULL_MASK, move_lo || move_hi)) {  // rare once the max settles
        const float alpha_lo = move_lo ? exp2_approx(m_lo - base_lo) : 1.0f;
        const float alpha_hi = move_hi ? exp2_approx(m_hi - base_hi) : 1.0f;
        l_lo *= alpha_lo;
        l_hi *= alpha_hi;
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
            acc[n][0] *= alpha_lo;
            acc[n][1] *= alpha_lo;
            acc[n][2] *= alpha_hi;
            acc[n][3] *= alpha_hi;
        }
    }
    m_lo = new_lo;
    m_hi = new_hi;
    l_lo += sum_lo;
    l_hi += sum_hi;

    // 5. O += P.V over the warp's output dims.
#pragma unroll
    for (int step = 0; step < 2; ++step) {
#pragma unroll
        for (int pair = 0; pair < N_TILES / 2; ++pair) {
            // V rows are tokens (the MMA's k): transposed matrices (tokens 0-7 | 8-15) x (dims 0-7 | 8-15).
            u32 b[4];
            ldmatrix_x4_trans(v_lane + (step * 16 * ROW_ELEMS + pair * 16) * 2, b);
            mma_bf16(acc[2 * pair], pa[step], b[0], b[1]);
            mma_bf16(acc[2 * pair + 1], pa[step], b[2], b[3]);
        }
    }
}

// The warp's rows of a segment, finished: the row's out and lse (slot -1), or the segment's
// unnormalized fp32 partial outputs and (m, l) at `slot` (partial entry slot * num_heads + head),
// which the combine merges. C fragment: rows g (elements 0, 1) and g + 8 (2, 3), dims
// slice * COLS + 8 n + 2 quad + {0, 1}.
__device__ __forceinline__ void write_segment(const Params& p, i64 row, int slot, i64 head0, int slice, int lane,
                                              const RowState& st) {
    const int g = lane >> 2, quad = lane & 3;
    const i64 num_heads = p.num_heads;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 head = head0 + g + half * 8;
        if (head >= num_heads) continue;
        const float m = half ? st.m_hi : st.m_lo, l = half ? st.l_hi : st.l_lo;
        const int col0 = slice * COLS + quad * 2;
        if (slot < 0) {
            const float lse = row_lse(m, l);
            const float factor = output_factor(l, lse, p.sinks, head);
            u32* out = p.out + ((row * num_heads + head) * HEAD_DIM + col0) / 2;
#pragma unroll
            for (int n = 0; n < N_TILES; ++n)
                out[n * 4] = bf16x2_bits(st.acc[n][2 * half] * factor, st.acc[n][2 * half + 1] * factor);
            if (slice == 0 && quad == 0) p.lse[row * num_heads + head] = lse;
        } else {
            const i64 entry = static_cast<i64>(slot) * num_heads + head;
            float* out = p.partial_o + entry * HEAD_DIM + col0;
#pragma unroll
            for (int n = 0; n < N_TILES; ++n)
                *reinterpret_cast<float2*>(out + n * 8) = make_float2(st.acc[n][2 * half], st.acc[n][2 * half + 1]);
            if (slice == 0 && quad == 0) reinterpret_cast<float2*>(p.partial_ml)[entry] = make_float2(m, l);
        }
    }
}

// One segment of the block's part: tiles [tile_begin, tile_end) of the row's live entries for
// the block's head tile, through steps 1-5 a tile (the records of tile t + 1 copied while tile t
// is dequantized and multiplied), then its outputs. Every thread of the block, which leaves its
// shared memory free for the next segment's first writes (the caller's barrier).
__device__ __forceinline__ void attend_segment(const Params& p, u8* smem, const Segment& seg, i64 head0, u32 k_lane,
                                               u32 v_lane, float score_scale) {
    u16* const ks = reinterpret_cast<u16*>(smem + SM_K);
    u8* const raw = smem + SM_RAW;
    float4* const xs = reinterpret_cast<float4*>(smem + SM_X);
    u64* const tokens = reinterpret_cast<u64*>(smem + SM_TOKEN);
    u64* const scales = reinterpret_cast<u64*>(smem + SM_SCALE);
    i64* const slot_words = reinterpret_cast<i64*>(smem + SM_SLOT);
    u32* const live_masks = reinterpret_cast<u32*>(smem + SM_LIVE);
    const u32* const scale_pairs = reinterpret_cast<const u32*>(smem + SM_SCALES);
    // Thread values read afresh a segment: derived in the segment loop, they would be held over it
    // in the registers the 64-head build's accumulators need.
    const int tid = thread_index_in_pass(), lane = tid & 31, warp = tid >> 5, slice = warp % DIM_SPLIT;
    const i64 row = seg.row;
    const int tile_begin = seg.tile_begin, tile_end = seg.tile_end;
    const i64 swa_live = live_count(p.swa.lens, p.swa.lens_int64, p.swa.k, row),
              extra_live = live_count(p.extra.lens, p.extra.lens_int64, p.extra.k, row);

    // Slots two tiles ahead (warp 0), then Q.
    if (warp == 0) {
        for (int t = tile_begin; t < tile_end && t < tile_begin + 2; ++t)
            fetch_slot(p, row, t, swa_live, extra_live, slot_words, lane);
    }
    uint4* const qf = reinterpret_cast<uint4*>(smem + SM_Q) + warp * K_STEPS * 32 + lane;  // not Q_IN_REGISTERS
    uint4 q_regs[Q_IN_REGISTERS ? K_STEPS : 1];
    load_q(p, row, head0, slice, lane, qf, q_regs);
    RowState st = {};
    st.m_lo = st.m_hi = neg_inf();

    cp_async_wait_all();
    __syncwarp();
    const bool lane_live =
        warp == 0 && address_tile(p, tile_begin, swa_live, slot_words, tokens, scales, live_masks, lane);
    bool live = __syncthreads_or(lane_live);
    if (live) copy_tile(tokens, scales, raw);
    for (int tile = tile_begin; tile < tile_end; ++tile) {
        cp_async_wait_all();
        __syncthreads();  // this tile's records are in; the last tile's products are done with ks and xs
        const u32 live_mask = live_masks[parity(tile)];
        if (live) dequantize_tile(raw, scale_pairs, live_mask, ks, warp, lane);
        bool next_live = false;
        if (warp == 0 && tile + 1 < tile_end) {
            next_live = address_tile(p, tile + 1, swa_live, slot_words, tokens, scales, live_masks, lane);
            if (tile + 2 < tile_end) fetch_slot(p, row, tile + 2, swa_live, extra_live, slot_words, lane);
        }
        const bool live_now = live;
        live = __syncthreads_or(next_live);  // ks is ready, raw is free, tile + 1's addresses are out
        if (live) copy_tile(tokens, scales, raw);
        if (live_now)
            attend_tile(q_regs, qf, xs, k_lane, v_lane, live_mask, score_scale, warp, lane, st);  // block-uniform
    }
    write_segment(p, row, seg.slot, head0, slice, lane, st);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) nvfp4_mla_decode(const Params p) {
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row_block = warp / DIM_SPLIT, slice = warp % DIM_SPLIT, m8 = lane >> 3;
    // The block's part of the work list and its head tile (the fastest index); this warp's first head.
    const u32 head_tiles = static_cast<u32>((p.num_heads + HT - 1) / HT);
    const u32 part = blockIdx.x / head_tiles;
    const i64 head0 = static_cast<i64>(blockIdx.x - part * head_tiles) * HT + row_block * 16;
    fill_scale_pairs(reinterpret_cast<u32*>(smem + SM_SCALES), tid, THREADS);  // read after the first barrier

    // No launch_dependents: the split combine launching at this kernel's start was slower than at
    // its end (docs/performance.md#programmatic-dependent-launch). The host's list was written
    // before the call: its part loads under the wait; the scheduler's comes from the stream's
    // previous kernel: after it; so do the lengths a block deals its own list from, in the K
    // buffer (first written after the first segment's first barrier).
    const bool early = p.static_list != 0;
    if (!early) wait_for_prior_grids();
    const WorkPart work = p.own_list ? schedule_own_part(p, smem + SM_K, part) : load_part(p.work, part);
    if (early) wait_for_prior_grids();
    const auto tiles_of = [&](int row) { return row_tiles(p, row, TILE_SHIFT); };

    // The lane's ldmatrix row addresses in ks; every fragment is at a constant offset from them.
    u16* const ks = reinterpret_cast<u16*>(smem + SM_K);
    const u32 k_lane = shared_address(ks + ((lane & 7) + (m8 >> 1) * 8) * ROW_ELEMS + slice * COLS + (m8 & 1) * 8);
    const u32 v_lane = shared_address(ks + ((lane & 7) + (m8 & 1) * 8) * ROW_ELEMS + slice * COLS + (m8 >> 1) * 8);
    const float score_scale = static_cast<float>(p.score_scale);
    for (Segment s = first_segment(work, tiles_of); s.valid; s = next_segment(work, s, tiles_of)) {
        attend_segment(p, smem, s, head0, k_lane, v_lane, score_scale);
        __syncthreads();  // the segment's last products and slot reads are done: the next may write Q and slots
    }
}
