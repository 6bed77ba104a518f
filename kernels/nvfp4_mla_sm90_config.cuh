// The Hopper decode kernel's build (nvfp4_mla_decode_sm90.cu): its constants, from the -D
// options BLOCK_N, HEAD_TILE, SMEM_BYTES, CLUSTER, DIM_PARTS, EARLY_DEPENDENTS_MAX_SPLITS and
// THREADS; its shared-memory layout; its barriers. docs/kernels/decode_sm90.md describes the
// block's work.
#pragma once

#include "nvfp4_mla_params.cuh"
#include "nvfp4_mla_ptx_sm90.cuh"
#include "nvfp4_mla_records.cuh"
#include "nvfp4_mla_softmax.cuh"

constexpr int HT = HEAD_TILE;              // heads of a block: the M of every wgmma, or with NARROW its N
constexpr bool NARROW = HT == 16;          // one consumer warpgroup, two producers (the header comment)
constexpr int PRODUCERS = NARROW ? 2 : 1;  // producer warpgroups
constexpr int CONSUMERS = NARROW ? 1 : 2;  // consumer warpgroups
constexpr int WARPGROUP_THREADS = 128;
constexpr int CONSUMER_THREADS = WARPGROUP_THREADS * CONSUMERS;
constexpr int SHARERS = CLUSTER * PRODUCERS;  // producer warpgroups that split each tile (of the cluster or the block)
constexpr int UNITS_PER_TILE = 2 / SHARERS;   // gather units a producer warpgroup handles per tile
constexpr int BN = BLOCK_N;                   // tokens of a tile
constexpr u32 TILE_SHIFT = 6;                 // log2(BN)
constexpr int UNIT = 32;                      // tokens of a gather unit: 4 producer threads each
constexpr int RAW_STRIDE = RECORD + 16;       // a raw record's bytes in shared memory (padded: conflict-free reads)
constexpr int RAW_BYTES = 2 * UNIT * RAW_STRIDE;  // a producer warpgroup's two raw units
constexpr int CHUNKS = HEAD_DIM / 8;              // 64
constexpr int GROUP_STRIDE = BN * 16;             // K/V: bytes between 8-dim groups (1024)
constexpr int KV_BYTES = BN * HEAD_DIM * 2;       // a K/V tile buffer
constexpr int Q_SLAB = HT * 128;                  // Q: bytes of 64 dims of the HT heads (128-byte swizzled rows)
constexpr int P_GROUP_STRIDE = HT * 16;           // P: bytes between 8-token groups
constexpr int OUT_DIMS = HEAD_DIM / DIM_PARTS;    // output dims of an item: all 512, or one of two parts
constexpr int HALF_DIMS = OUT_DIMS / 2;           // output dims of a consumer (not NARROW)
constexpr int STAGED_ROW = 1024;                  // bytes of an output row staged in a K/V buffer (64 rows)
constexpr int QK_STEPS = HEAD_DIM / 16;           // k-steps of Q.K^T
constexpr int PV_STEPS = BN / 16;                 // k-steps of P.V
constexpr int S_BLOCKS = BN / 8;                  // n-blocks of 8 tokens in S
constexpr int O_BLOCKS = HALF_DIMS / 8;           // n-blocks of 8 dims in a consumer's O
constexpr int DIM_BLOCKS = HEAD_DIM / 64;         // NARROW: m-blocks of 64 dims in O^T
constexpr int RAW_ARRIVALS = 2 * 32;              // a raw unit's barrier: each thread of the warp, twice
// Registers a thread of each warpgroup after setmaxnreg. The block starts with 168 a thread
// (__launch_bounds__(384, 1): 64 K registers over 384 threads, in steps of 8), and setmaxnreg.inc
// only takes what the others' setmaxnreg.dec gave back: the three sum to at most 3 x 168. NARROW
// keeps 168 everywhere (its consumer needs no more).
constexpr int REGS_AT_LAUNCH = 168;
constexpr int REGS_CONSUMER0 = 240, REGS_CONSUMER1 = 160, REGS_PRODUCER = 104;

static_assert(THREADS == 384,
              "three warpgroups: consumer 0, consumer 1, producer; or NARROW one consumer, two producers");
static_assert(HT == 64 || HT == 16, "64 heads a block (wgmma's M), or 16 (NARROW: wgmma's N)");
static_assert(CLUSTER == 1 || CLUSTER == 2, "a block alone, or two items that gather the same tiles");
static_assert(DIM_PARTS == 1 || DIM_PARTS == 2, "whole output rows, or halves");
static_assert(!NARROW || (CLUSTER == 1 && DIM_PARTS == 1), "NARROW: a block alone, whole rows");
static_assert(BN == 64 && BN == 2 * UNIT && BN == 1 << TILE_SHIFT, "a tile is two gather units of 32 tokens");
static_assert(CHUNKS == 64 && NOPE_CHUNKS == 56 && NOPE_BYTES == 224 && DATA_BYTES == 352,
              "dequantize: thread chunks 4 i + lane / 8, RoPE from 56, the scale slot's 28 bytes after the data row");
static_assert(REGS_CONSUMER0 + REGS_CONSUMER1 + REGS_PRODUCER <= 3 * REGS_AT_LAUNCH, "the block's registers");

// The block's mbarriers, indices into SharedStorage::barriers. FULL + b, EMPTY + b, HELD + b: K/V
// buffer b filled by the producer(s), emptied by the consumer warps (of both blocks of a
// cluster), and released by every consumer thread once an item's outputs staged there are out
// (nvfp4_mla_sm90_pipeline.cuh). BAR_RAW + 8 g + 2 w + h: warp w of producer warpgroup g, its raw
// unit h (each warp gathers and dequantizes its own 8 tokens). P_FULL, P_EMPTY (not NARROW): the
// shared P and factors from consumer 0 to consumer 1. Q: an item's Q has landed (its tensor
// copies' bytes).
enum Barrier : int {
    BAR_FULL = 0,
    BAR_EMPTY = 2,
    BAR_RAW = 4,
    BAR_P_FULL = BAR_RAW + 8 * PRODUCERS,
    BAR_P_EMPTY = BAR_P_FULL + 1,
    BAR_HELD = BAR_P_FULL + (NARROW ? 0 : 2),
    BAR_Q = BAR_HELD + 2,
    NUM_BARRIERS = BAR_Q + 1,
};

// The named barriers (0 is __syncthreads'): the consumer warpgroups' meetings.
enum NamedBarrier : int { CONSUMERS_BARRIER = 1 };

// The block's shared memory: SMEM_BYTES, the host's count (ops/decode_sm90.shared_bytes). Q comes
// first: the dynamic shared memory starts on a 1024-byte boundary, the period of Q's swizzle.
struct SharedStorage {
    u8 q[HT * HEAD_DIM * 2];       // BF16 Q [8 slabs of 64 dims][HT heads][64 dims], 128-byte swizzle
    u8 p[HT * BN * 2];             // BF16 P [HT heads, 64 tokens], K-major core matrices
    u8 kv[2][KV_BYTES];            // BF16 K = V, two tile buffers [64 tokens, 512]
    u8 raw[PRODUCERS][RAW_BYTES];  // a producer warpgroup's raw records [2 units][32][RAW_STRIDE]: data row, scale slot
    u32 scale_pairs[256];          // e4m3_bf16x2 of every scale byte
    // Not NARROW (consumer 0 to consumer 1, with P): a row's rescale factor this tile [HT], then its
    // output factor [HT]. NARROW: [2][4 warps][HT], each consumer warp's per-head maxima of a tile (two
    // tiles' worth, so a warp may write the next tile's while another still reads this one's), and
    // its sums at the end.
    float exchange[NARROW ? 2 * 4 * HT : 2 * HT];
    u32 tile_masks[2][2][4];     // a K/V buffer's live tokens, per half, per producer warp
    u64 barriers[NUM_BARRIERS];  // Barrier
};
static_assert(sizeof(SharedStorage) == SMEM_BYTES, "the shared layout must match the host's count");

// The regions' byte offsets, for the address arithmetic of the code that fills and reads them.
constexpr int SM_Q = offsetof(SharedStorage, q);
constexpr int SM_P = offsetof(SharedStorage, p);
constexpr int SM_KV = offsetof(SharedStorage, kv);
constexpr int SM_RAW = offsetof(SharedStorage, raw);
constexpr int SM_SCALES = offsetof(SharedStorage, scale_pairs);
constexpr int SM_ALPHA = offsetof(SharedStorage, exchange);
constexpr int SM_FACTOR = SM_ALPHA + HT * 4;
constexpr int SM_EXCHANGE = SM_ALPHA;
constexpr int SM_TILE_MASK = offsetof(SharedStorage, tile_masks);
constexpr int SM_BARRIERS = offsetof(SharedStorage, barriers);
static_assert(SM_Q == 0 && SM_RAW % 16 == 0 && RAW_STRIDE % 16 == 0 && SM_TILE_MASK % 16 == 0, "aligned regions");
