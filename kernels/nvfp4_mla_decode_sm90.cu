// Sparse MLA decode attention on Hopper (sm_90a) through wgmma, read straight from the NVFP4 records.
// The semantics, Params and outputs of kernels/nvfp4_mla_decode.cu (whose split combine kernel
// merges this kernel's partial outputs unchanged); the blocks and their insides differ.
//
// Work items (query row, head tile of 64 heads, split, dim part), the head tile fastest, then the
// part, the split and the row; the grid holds at most as many blocks as the GPU at once, and block
// b takes items b, b + gridDim.x, ... in turn (item_at). Heads past num_heads are zero rows of Q
// whose outputs are never written. For an item the block walks its split's tiles of BLOCK_N = 64 selected tokens
// (the sliding-window table's entries, then the extra pool's; tiles_per_split counts these
// 64-token tiles), 384 threads in three warpgroups, split by setmaxnreg (168 registers a thread
// at launch; 240 for consumer 0, 160 for consumer 1, 104 for the producer). With CLUSTER 2 two
// neighbouring items that gather the same tiles run as a cluster of two blocks that share the
// dequantized tiles: the two head tiles of a (row, split) (an even number of head tiles), or with
// one head tile and DIM_PARTS 2 the two parts of a (row, split). Block r of the pair gathers and
// dequantizes gather unit r of every tile and stores it into both blocks' K/V buffer (the peer's
// copy with st.async, counted on the peer's full barrier), so each record is read and dequantized
// once for both items.
//
//   warpgroup 2, the producer: gathers and dequantizes the tiles. A tile is two gather units of
//     32 tokens (both this block's, or with a cluster the unit of its rank), 4 threads a token,
//     8 tokens a warp. Every thread loads its token's slot two units ahead (the words, converted
//     at their use: a conversion at the load would wait for it), turns it into the record's
//     addresses (masked: an invalid slot or an entry past lens, whose record and slot beyond
//     lens are never read) and copies a quarter of the live record (16-byte chunks c0, c0 + 4,
//     ..., c0 + 20 of the data row's 22 and the scale slot's 2) with cp.async into a raw buffer
//     (two units of them). A warp gathers and dequantizes only its own 8 tokens, so each warp
//     waits on its own raw barriers and runs independently of the others. Per unit a warp reads
//     its raw records out into registers, refills the raw buffer with unit u + 2 at once, then
//     (once the consumers freed the K/V buffer) dequantizes EXACTLY (e2m1 x e4m3 through a shared
//     table of every scale byte's BF16 pair, or the BF16 RoPE dims; masked tokens become zero
//     rows, so no NaN of a masked record can reach the products) into one of two K/V buffers.
//   warpgroup 0, consumer 0: S = Q.K^T with wgmma m64n64k16 (Q and K from shared memory,
//     32 k-steps), the online softmax in registers (base 2: score_scale = sm_scale * log2(e);
//     masked scores -inf; a row's base m moves only when its max passes it by more than 8, so
//     p <= 2^8; row sums of the fp32 p), P rounded to BF16 in registers, then O[:, 0:256] += P.V
//     with wgmma m64n256k16 (P from registers, fp32 accumulation). S of the next tile is issued
//     right behind this tile's P.V, and the tile's buffer goes back as soon as its P.V is done.
//     While its P.V runs it stores P (BF16) and each row's rescale factor in shared memory for
//     consumer 1. Its thread 0 also loads Q, with tensor copies (TMA) that no other instruction
//     waits behind: the next item's as soon as both consumers' loops over this item's tiles are done
//     (issue_q).
//   warpgroup 1, consumer 1: O[:, 256:512] += P.V with wgmma m64n256k16, P from shared memory.
//
// One shared layout serves as K (Q.K^T's B operand, K-major: dims contiguous) and V (P.V's B
// operand, MN-major: the same bytes read transposed, wgmma's transpose-B): the no-swizzle
// canonical layout of 8 x 16-byte core matrices, element (token t, dim d) at
// (d / 8) * 1024 + t * 16 + (d % 8) * 2. For K a core matrix is 8 tokens x 8 dims (leading byte
// offset 1024 between the two along k, stride byte offset 128 between 8-token groups); for V it
// is 8 tokens (k) x 8 dims (leading byte offset 128 between 8-token groups along k, stride byte
// offset 1024 between 8-dim groups). The shared copy of P uses the same K-major form with heads
// in place of tokens. Q lies as the tensor copies write it, in the 128-byte swizzle layout: slab
// d / 64 (8 KB) holds 64 dims of every head, head h's 128 bytes at h * 128 with 16-byte chunk c
// at (c ^ h % 8) * 16.
//
// Synchronization: mbarriers full[2] / empty[2] (the K/V buffers: the producer's 128 threads
// arrive after fence.proxy.async, with a cluster thread 0 also expecting the peer's st.async
// bytes; one lane per consumer warp of each block of the cluster after its wgmma completed),
// raw[4 warps][2] (a producer warp's raw units: each of its threads arrives, and again when its
// copies land), p_full / p_empty (the shared P and rescale factors: every thread of the writing
// or reading consumer arrives), held[2] (a K/V buffer that held an item's staged outputs: every
// consumer thread arrives once they are out, and the producer waits before it stores there
// again), q (an item's Q: consumer 0's thread 0 expects its bytes, the tensor copies complete
// them), named barrier 1 (the two consumers: Q loaded, loops done (so Q's buffer may take the next
// Q), final factors, staged outputs), and with
// a cluster a cluster barrier at the start (the peer's barriers are initialized) and at the end
// (the peer no longer stores into or arrives on this block). Every phase runs on across the
// block's items: a buffer's phase is the block's count of tiles (raw units) before it, and P's its
// count of live tiles. A tile with no live token is skipped by both consumers (after its buffer
// cycled); a lonely row ends with l = 0: out 0 and lse +inf.
//
// Without splits the block finishes the rows like the mma.sync kernel (row_lse; output_factor:
// 1/l times the sink factor; BF16; lse); with splits it writes its unnormalized O and (m in log2
// units, l) to the workspace for the combine kernel. Either way the output rows are staged in
// shared memory (the K/V buffer of the item's last tile, held until they are out) and leave as
// whole rows (write_rows). Meanwhile the producer gathers and dequantizes the next item's first
// tile, and the next item's Q lands: a block's fill and outputs overlap its next item's.
//
// With DIM_PARTS 2 an item's output rows are one half of the 512 dims (its part): both parts of a
// (row, head tile, split) gather the same tiles and compute the same S, softmax and (m, l), and each
// adds P.V over its 256 dims only (a consumer 128: wgmma m64n128k16), so a block writes half the
// output bytes. The host takes it where the doubled items fill at most 80% of the GPU's blocks
// (1-4 query rows): there a block's output rows, not its tiles, take most of its time; and with
// one head tile, where its cost model prefers the two parts as a cluster to more splits.
//
// NARROW (HEAD_TILE 16, the wgmma_sm90_narrow backend: calls of up to 16 heads from 6 query rows).
// The 16 heads are wgmma's N instead of 64 rows of its M (48 of them padding): S^T = K.Q^T and
// O^T = V^T.P^T with wgmma m64n16k16 (K and V^T from the same K/V buffer, V^T through wgmma's
// transposed A; Q and P as B, K-major). Warpgroup 0 is the one consumer: S^T in 8 registers a
// thread, O^T (512 dims x 16 heads) in 64, so its 168 registers at launch suffice and the two
// other warpgroups are producers, each gathering and dequantizing one of every tile's two units
// (the split a cluster makes across two blocks, made inside one). A head's softmax spans the 64
// tokens, which are the rows of all four consumer warps: their per-head maxima meet through shared
// memory every tile (the same base for every thread), and each thread keeps its own rows' share
// of a head's sum, added over the block at the item's end. The outputs are staged whole (a head's
// 512 dims: BF16, or fp32 with splits) and leave as the 64-head build's do.
//
// -D constants: BLOCK_N (64), HEAD_TILE (64 or 16: NARROW), SMEM_BYTES (232136 at 64 heads,
// 202488 with NARROW: the host's count of the shared layout below, checked: ops/decode_sm90.py
// counts it too), CLUSTER (1 or 2), DIM_PARTS (1 or 2; NARROW: 1 and 1); THREADS (384)
// and the record ABI come from jit.py/abi.py. What the attention kernels share (Params, the row finish, the softmax
// helpers) is in nvfp4_mla_decode.cuh.
#include "nvfp4_mla_decode.cuh"
#include "nvfp4_mla_params.cuh"  // Params: decode_sm90.PARAMS (the attention Params and the tensor map of q)

constexpr int HT = HEAD_TILE;                    // heads of a block: the M of every wgmma, or with NARROW its N
constexpr bool NARROW = HT == 16;                // one consumer warpgroup, two producers (the header comment)
constexpr int PRODUCERS = NARROW ? 2 : 1;        // producer warpgroups
constexpr int CONSUMERS = NARROW ? 1 : 2;        // consumer warpgroups
constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
constexpr int SHARERS = CLUSTER * PRODUCERS;     // producer warpgroups that split each tile (of the cluster or the block)
constexpr int UNITS_PER_TILE = 2 / SHARERS;      // gather units a producer warpgroup handles per tile
constexpr int BN = BLOCK_N;                      // tokens of a tile
constexpr int UNIT = 32;                         // tokens of a gather unit: 4 producer threads each
constexpr int RECORD = DATA_BYTES + SCALE_BYTES; // 384
constexpr int RAW_STRIDE = RECORD + 16;          // a raw record's bytes in shared memory (padded: conflict-free reads)
constexpr int RAW_BYTES = 2 * UNIT * RAW_STRIDE; // a producer warpgroup's two raw units
constexpr int NOPE_CHUNKS = NOPE_DIM / 8;        // 16-byte chunks (8 BF16) of a row's NoPE dims
constexpr int CHUNKS = HEAD_DIM / 8;             // 64
constexpr int GROUP_STRIDE = BN * 16;            // K/V: bytes between 8-dim groups (1024)
constexpr int KV_BYTES = BN * HEAD_DIM * 2;      // a K/V tile buffer
constexpr int Q_SLAB = HT * 128;                 // Q: bytes of 64 dims of the HT heads (128-byte swizzled rows)
constexpr int P_GROUP_STRIDE = HT * 16;          // P: bytes between 8-token groups
constexpr int OUT_DIMS = HEAD_DIM / DIM_PARTS;   // output dims of an item: all 512, or one of two parts
constexpr int HALF_DIMS = OUT_DIMS / 2;          // output dims of a consumer (not NARROW)
constexpr int STAGED_ROW = 1024;                 // bytes of an output row staged in a K/V buffer (64 rows)
constexpr int QK_STEPS = HEAD_DIM / 16;          // k-steps of Q.K^T
constexpr int PV_STEPS = BN / 16;                // k-steps of P.V
constexpr int S_BLOCKS = BN / 8;                 // n-blocks of 8 tokens in S
constexpr int O_BLOCKS = HALF_DIMS / 8;          // n-blocks of 8 dims in a consumer's O
constexpr int DIM_BLOCKS = HEAD_DIM / 64;        // NARROW: m-blocks of 64 dims in O^T
constexpr int EARLY_DEPENDENTS_MAX_SPLITS = 32;   // splits up to which the next kernel launches at the start
// Registers a thread of each warpgroup after setmaxnreg. The block starts with 168 a thread
// (__launch_bounds__(384, 1): 64 K registers over 384 threads, in steps of 8), and setmaxnreg.inc
// only takes what the others' setmaxnreg.dec gave back: the three sum to at most 3 x 168. NARROW
// keeps 168 everywhere (its consumer needs no more).
constexpr int REGS_AT_LAUNCH = 168;
constexpr int REGS_CONSUMER0 = 240, REGS_CONSUMER1 = 160, REGS_PRODUCER = 104;

static_assert(THREADS == 384, "three warpgroups: consumer 0, consumer 1, producer; or NARROW one consumer, two producers");
static_assert(HT == 64 || HT == 16, "64 heads a block (wgmma's M), or 16 (NARROW: wgmma's N)");
static_assert(CLUSTER == 1 || CLUSTER == 2, "a block alone, or two items that gather the same tiles");
static_assert(DIM_PARTS == 1 || DIM_PARTS == 2, "whole output rows, or halves");
static_assert(!NARROW || (CLUSTER == 1 && DIM_PARTS == 1), "NARROW: a block alone, whole rows");
static_assert(BN == 64 && BN == 2 * UNIT, "a tile is two gather units of 32 tokens");
static_assert(CHUNKS == 64 && NOPE_CHUNKS == 56 && NOPE_BYTES == 224 && DATA_BYTES == 352,
              "dequantize: thread chunks 4 i + lane / 8, RoPE from 56, the scale slot's 28 bytes after the data row");
static_assert(REGS_CONSUMER0 + REGS_CONSUMER1 + REGS_PRODUCER <= 3 * REGS_AT_LAUNCH, "the block's registers");

// Shared memory, in bytes.
constexpr int SM_Q = 0;                                // BF16 Q [8 slabs of 64 dims][HT heads][64 dims], 128-byte swizzle
constexpr int SM_P = SM_Q + HT * HEAD_DIM * 2;         // BF16 P [HT heads, 64 tokens], K-major core matrices
constexpr int SM_KV = SM_P + HT * BN * 2;              // BF16 K = V [2][64 tokens, 512]
constexpr int SM_RAW = SM_KV + 2 * KV_BYTES;           // u8 [PRODUCERS][2][32][RAW_STRIDE]: raw records (data row, scale slot)
constexpr int SM_SCALES = SM_RAW + PRODUCERS * RAW_BYTES;  // u32 [256]: e4m3_bf16x2 of every scale byte
// Not NARROW (consumer 0 to consumer 1, with P): float [HT] a row's rescale factor this tile, and its output factor.
constexpr int SM_ALPHA = SM_SCALES + 256 * 4;
constexpr int SM_FACTOR = SM_ALPHA + (NARROW ? 0 : HT * 4);
// NARROW: float [2][4 warps][HT]: each consumer warp's per-head maxima of a tile (two tiles' worth,
// so a warp may write the next tile's while another still reads this one's), and its sums at the end.
constexpr int SM_EXCHANGE = SM_FACTOR + (NARROW ? 0 : HT * 4);
constexpr int SM_TILE_MASK = SM_EXCHANGE + (NARROW ? 2 * 4 * HT * 4 : 0);  // u32 [2][2][4]: a K/V buffer's live tokens (per half, per producer warp)
constexpr int SM_BARRIERS = SM_TILE_MASK + 64;         // u64 [NUM_BARRIERS]: mbarriers
// BAR_RAW + 8 g + 2 w + h: warp w of producer warpgroup g, its raw unit h (each warp gathers and
// dequantizes its own 8 tokens). BAR_P_FULL, BAR_P_EMPTY (not NARROW): the shared P and factors
// from consumer 0 to consumer 1. BAR_HELD + b: K/V buffer b held for an item's outputs is free
// again (every consumer thread of the block arrives once its rows are out). BAR_Q: an item's Q has
// landed (its tensor copies' bytes).
constexpr int BAR_FULL = 0, BAR_EMPTY = 2, BAR_RAW = 4, BAR_P_FULL = BAR_RAW + 8 * PRODUCERS, BAR_P_EMPTY = BAR_P_FULL + 1,
              BAR_HELD = BAR_P_FULL + (NARROW ? 0 : 2), BAR_Q = BAR_HELD + 2, NUM_BARRIERS = BAR_Q + 1;
static_assert(SM_BARRIERS + NUM_BARRIERS * 8 == SMEM_BYTES, "shared layout must match the host's count");
static_assert(SM_RAW % 16 == 0 && RAW_STRIDE % 16 == 0 && SM_BARRIERS % 8 == 0, "aligned regions");

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// An arrival on `bar` once this thread's earlier cp.async copies have landed (counted in the
// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void mbar_arrive_on_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `parity` has completed (the phase before the current one
// counts as completed: parity 1 passes at once on a fresh barrier).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// The shared::cluster address of the same byte as `local` (a shared::cta address) in block `rank`
// of the cluster.
__device__ __forceinline__ u32 cluster_address(u32 local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// An arrival on a barrier of another block of the cluster (a shared::cluster address). A consumer
// warp's arrival after its wgmma reads of a K/V buffer completed: nothing to publish, so the
// default semantics, not a release at cluster scope (which costs a GPU-wide fence).
__device__ __forceinline__ void mbar_arrive_cluster(u32 remote_bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote_bar) : "memory");
}

// An arrival that also expects `bytes` of asynchronous stores (the peer's st.async) in this phase.
__device__ __forceinline__ void mbar_arrive_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Stores into another block's shared memory (shared::cluster addresses) that count their bytes on
// that block's barrier `remote_bar` when they land.
__device__ __forceinline__ void store_cluster16(u32 remote, uint4 v, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 ::"r"(remote), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
                 : "memory");
}

__device__ __forceinline__ void store_cluster4(u32 remote, u32 v, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(remote), "r"(v), "r"(remote_bar)
                 : "memory");
}

// Every thread of both blocks: the peer's barriers are initialized (at the start), or the peer
// no longer touches this block's shared memory (at the end).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones (the
// wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Waits at barrier `id` with `count` threads (whole warps). barrier.sync, not bar.sync (which is
// barrier.sync.aligned): the consumers reach barrier 1 from two different instructions.
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

template <int REGS>
__device__ __forceinline__ void regs_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

template <int REGS>
__device__ __forceinline__ void regs_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N of this warpgroup's committed wgmma groups are pending (they complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }

// Keeps the compiler from moving accesses of accumulator registers across the wgmma pipeline.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of the no-swizzle canonical layout: start address, leading and
// stride byte offsets (all in 16-byte units), layout type 0.
__device__ __forceinline__ u64 matrix_descriptor(u32 address, u32 leading, u32 stride) {
    return static_cast<u64>((address & 0x3FFFFu) >> 4) | static_cast<u64>(leading >> 4) << 16 |
           static_cast<u64>(stride >> 4) << 32;
}

// The descriptor of a K-major operand in the 128-byte swizzle layout (what the tensor copies of Q
// write): rows of 128 bytes (64 dims) whose 16-byte chunks are swizzled by the row's index mod 8,
// 1024 bytes between 8-row groups (the leading offset is unused: a k-step's 32 bytes lie in one
// row), layout type 1. The region starts on a 1024-byte boundary (the swizzle's period).
__device__ __forceinline__ u64 swizzled_descriptor(u32 address) {
    return matrix_descriptor(address, 16, 1024) | 1ull << 62;
}

// One thread: a tensor copy of box (x, y, z) of the tensor map `map` (a generic address of the
// kernel's Params) into this block's shared memory at `dst`, counting its bytes on barrier `bar`.
__device__ __forceinline__ void tensor_copy3(u32 dst, const void* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// d (64 x 64, fp32) += A (64 x 16, shared, K-major) * B (16 x 64, shared; TRANS_B 0: K-major).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B)
        : "memory");
}

// NARROW: d (64 x 16, fp32) += A (64 x 16, shared; TRANS_A 0: K-major, 1: MN-major) * B (16 x 16,
// shared, K-major); with scale_d 0, d = A * B (d's values ignored).
template <int TRANS_A>
__device__ __forceinline__ void wgmma_m64n16(float* d, u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A)
        : "memory");
}

// A thread's accumulators of a consumer's O (64 heads x HALF_DIMS, fp32) as wgmma's register list
// and as asm outputs: operands 0-63, and 64-127 for 256 dims.
#define WGMMA_D_LO_LIST \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D_HI_LIST \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WGMMA_D_LO_OUTPUTS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_D_HI_OUTPUTS \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#if DIM_PARTS == 1  // a consumer's 256 dims: m64n256k16, 128 accumulators; the other operands from 128
#define PV_SHAPE "m64n256k16"
#define PV_LIST WGMMA_D_LO_LIST ", " WGMMA_D_HI_LIST
#define PV_OUTPUTS WGMMA_D_LO_OUTPUTS, WGMMA_D_HI_OUTPUTS
#define PV_SS_OPERANDS "%128, %129, p"                    // desc_a, desc_b, scale_d (1: accumulate)
#define PV_SS_SCALE "%130"
#define PV_RS_OPERANDS "{%128, %129, %130, %131}, %132, p"  // a, desc_b, scale_d
#define PV_RS_SCALE "%133"
#else  // a consumer's 128 dims (half rows): m64n128k16, 64 accumulators; the other operands from 64
#define PV_SHAPE "m64n128k16"
#define PV_LIST WGMMA_D_LO_LIST
#define PV_OUTPUTS WGMMA_D_LO_OUTPUTS
#define PV_SS_OPERANDS "%64, %65, p"
#define PV_SS_SCALE "%66"
#define PV_RS_OPERANDS "{%64, %65, %66, %67}, %68, p"
#define PV_RS_SCALE "%69"
#endif

// O (64 x HALF_DIMS, fp32) += A (64 x 16, shared, K-major) * V (16 x HALF_DIMS, shared, MN-major:
// wgmma's transposed B).
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[4 * O_BLOCKS], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, " PV_SS_SCALE ", 0;\n"
        "wgmma.mma_async.sync.aligned." PV_SHAPE ".f32.bf16.bf16 {" PV_LIST "}, " PV_SS_OPERANDS ", 1, 1, 0, 1;\n}\n"
        : PV_OUTPUTS
        : "l"(desc_a), "l"(desc_b), "r"(1)
        : "memory");
}

// O (64 x HALF_DIMS, fp32) += A (64 x 16, registers: the m16n8k16 A fragment of the warp's 16 rows) *
// V (16 x HALF_DIMS, shared, MN-major).
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[4 * O_BLOCKS], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, " PV_RS_SCALE ", 0;\n"
        "wgmma.mma_async.sync.aligned." PV_SHAPE ".f32.bf16.bf16 {" PV_LIST "}, " PV_RS_OPERANDS ", 1, 1, 1;\n}\n"
        : PV_OUTPUTS
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
        : "memory");
}

// ---------------------------------------------------------------- the producer

// The slot of an entry, loaded two units before its use as the table's words, unconverted: any
// conversion or select here would wait for the loads. Both words all ones (the slot -1 as int32
// and int64) when the entry is past its table's live count (also past both tables): its slot is
// never read. int32 slots use the low word only.
struct SlotWords {
    u32 lo, hi;
};

constexpr SlotWords NO_SLOT = {~0u, ~0u};

__device__ __forceinline__ SlotWords load_slot(const Params& p, i64 row, i64 n, i64 swa_live, i64 extra_live) {
    const bool in_swa = n < p.swa.k;
    // Fields picked one by one, as in the mma.sync kernel, whose Params are not __grid_constant__
    // (there a reference to a Params member copies Params to the stack).
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

// The slot of entry n from its load_slot words (int32 slots sign-extended).
__device__ __forceinline__ i64 slot_value(const Params& p, i64 n, SlotWords s) {
    const bool int64 = n < p.swa.k ? p.swa.slot_int64 : p.extra.slot_int64;
    return int64 ? static_cast<i64>(static_cast<u64>(s.hi) << 32 | s.lo) : static_cast<i64>(static_cast<int>(s.lo));
}

// The record of entry n (slot `slot`, -1 when masked) of the row's tables: its data row and scale
// slot, or null when masked (an invalid slot).
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

constexpr int RAW_ARRIVALS = 2 * 32;  // each thread of the warp: once itself, once when its copies land

// Every producer thread: token t of the unit (entry n, its slot's load_slot words), part c0 of
// its record: the 16-byte chunks c0, c0 + 4, ..., c0 + 20 of its 24 (22 of the data row, 2 of the scale slot),
// copied with cp.async (a warp's instruction: 8 records x 64 contiguous bytes), arriving on the
// warp's barrier `bar` of the unit. Returns the live mask of the warp's 8 tokens.
__device__ __forceinline__ u32 gather_unit(const Params& p, i64 n, SlotWords slot, u8* raw_unit, u32 bar, int t, int c0) {
    const RecordAddress record = record_address(p, n, slot_value(p, n, slot));
    const u32 mask = __ballot_sync(NVFP4_FULL_MASK, record.data != nullptr) & 0xFFu;  // lanes 0..7: the warp's tokens
    if (record.data != nullptr) {
        u8* const dst = raw_unit + t * RAW_STRIDE;
#pragma unroll
        for (int k = 0; k < RECORD / 16 / 4; ++k) {
            const int part = c0 + 4 * k;
            cp_async16(dst + part * 16, part < DATA_BYTES / 16 ? record.data + part * 16 : record.scale + (part - DATA_BYTES / 16) * 16);
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
    part.scale_words[0] = s_lo.x, part.scale_words[1] = s_lo.y, part.scale_words[2] = s_lo.z, part.scale_words[3] = s_lo.w;
    part.scale_words[4] = s_hi.x, part.scale_words[5] = s_hi.y, part.scale_words[6] = s_hi.z;
#pragma unroll
    for (int i = 0; i < THREAD_NOPE; ++i) part.codes[i] = *reinterpret_cast<const u32*>(record + (4 * i + c0) * 4);
    part.rope0 = *reinterpret_cast<const uint4*>(record + NOPE_BYTES + c0 * 16);        // chunk 56 + c0
    part.rope1 = *reinterpret_cast<const uint4*>(record + NOPE_BYTES + (4 + c0) * 16);  // chunk 60 + c0
}

__device__ __forceinline__ void store_part(const RecordPart& part, const u32* scale_pairs, int c0, const KvDestination& dst) {
    const u32 byte_in_pair = static_cast<u32>(c0 >> 1);
    u32 pairs[THREAD_NOPE];
#pragma unroll
    for (int i = 0; i < THREAD_NOPE; ++i)  // scale byte 2 i + c0 / 2: byte (i & 1) * 2 + c0 / 2 of word i / 2
        pairs[i] = scale_pairs[__byte_perm(part.scale_words[i / 2], 0u, 0x4440u | ((i & 1) * 2 + byte_in_pair))];
#pragma unroll
    for (int i = 0; i < THREAD_NOPE; ++i) store_kv(dst, (4 * i + c0) * GROUP_STRIDE, e2m1x8_scaled(part.codes[i], pairs[i]));
    store_kv(dst, (NOPE_CHUNKS + c0) * GROUP_STRIDE, part.rope0);
    store_kv(dst, (NOPE_CHUNKS + 4 + c0) * GROUP_STRIDE, part.rope1);
}

// The producer warpgroup, one item. A gather unit is 32 tokens of a tile: both of a tile's units
// alone, or with a cluster the unit of the block's rank (the peer block handles the other one).
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

    // Dequantization: token t of a unit (8 a warp), chunks 4 i + c0 (i = 0..15) of its row.
    const int t = warp * 8 + (lane & 7), c0 = lane >> 3;
    // Every thread gathers a quarter of token t's record: the slots of units 0 and 1 now, of
    // u + 2 and u + 3 in flight while unit u is dequantized. Unit u's entries start UNIT_STEP u
    // after unit 0's.
    constexpr int UNIT_STEP = UNIT * SHARERS;
    const i64 first = static_cast<i64>(tile_begin) * BN + share * UNIT + t;  // this thread's entry in unit 0
    // A warp gathers, dequantizes and reuses the raw records of its own 8 tokens: it waits on its
    // own raw barriers and only for itself (the warps proceed independently).
    // Unit u of the item is the block's unit unit0 + u: its raw buffer is that count's parity.
#define GATHER(unit, slot) gather_unit(p, first + (unit) * UNIT_STEP, slot, raw + ((unit0 + (unit)) & 1) * UNIT * RAW_STRIDE, \
                                       bars + (BAR_RAW + 8 * group + 2 * warp + ((unit0 + (unit)) & 1)) * 8, t, c0)
    SlotWords slot_a = NO_SLOT, slot_b = NO_SLOT;
    u32 unit_mask[2] = {0u, 0u};  // the warp's live tokens of the units in raw buffers 0 and 1
    if (units > 0) {
        const SlotWords s0 = load_slot(p, row, first, swa_live, extra_live);
        const SlotWords s1 = units > 1 ? load_slot(p, row, first + UNIT_STEP, swa_live, extra_live) : NO_SLOT;
        if (units > 2) slot_a = load_slot(p, row, first + 2 * UNIT_STEP, swa_live, extra_live);
        if (units > 3) slot_b = load_slot(p, row, first + 3 * UNIT_STEP, swa_live, extra_live);
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
        mbar_wait(bars + (BAR_RAW + 8 * group + 2 * warp + raw_half) * 8, ((unit0 + u) >> 1) & 1);  // the warp's records are in
        const u32 mask = raw_half ? unit_mask[1] : unit_mask[0];
        RecordPart part = {};
        if ((mask >> (t & 7)) & 1u)  // the warp's mask: its 8 tokens
            read_part(raw + raw_half * UNIT * RAW_STRIDE + t * RAW_STRIDE, c0, part);
        __syncwarp();  // the warp has read its raw records of unit u out: refill the buffer with unit u + 2
        if (u + 2 < units) {
            const u32 next_mask = GATHER(u + 2, slot_a);
            if (raw_half) unit_mask[1] = next_mask; else unit_mask[0] = next_mask;
            slot_a = slot_b;
            slot_b = u + 4 < units ? load_slot(p, row, first + (u + 4) * UNIT_STEP, swa_live, extra_live) : NO_SLOT;
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
        if (half == 1 || SHARERS == 2) {  // this warpgroup's part of the tile is complete: publish it to the consumers' wgmma (async proxy)
            fence_proxy_async();
            if (CLUSTER == 2 && ptid == 0)
                mbar_arrive_expect_bytes(full, PEER_TILE_BYTES);  // and the phase waits for the peer's stores
            else
                mbar_arrive(full);
        }
    }
#undef GATHER
}

// ---------------------------------------------------------------- the consumers

// A consumer waits until the producer has filled K/V buffer tile & 1 with `tile`, and gets the
// tile's live tokens (a bit each). Lane 0, the lane that later gives the buffer back
// (release_tile), reads the masks for its warp: the reads and that arrival are one thread's.
__device__ __forceinline__ u64 acquire_tile(u32 bars, const u32* tile_masks, int tile, int lane) {
    const int b = tile & 1;
    mbar_wait(bars + (BAR_FULL + b) * 8, (tile >> 1) & 1);
    // The peer's half came with st.async (counted by the barrier's transactions): ordered before
    // this thread's wgmma reads (async proxy).
    if constexpr (CLUSTER == 2) fence_proxy_async();
    u64 live = 0;
    if (lane == 0) {
        const uint4 lo = *reinterpret_cast<const uint4*>(tile_masks + 8 * b);
        const uint4 hi = *reinterpret_cast<const uint4*>(tile_masks + 8 * b + 4);
        live = (lo.x | lo.y << 8 | lo.z << 16 | lo.w << 24) | static_cast<u64>(hi.x | hi.y << 8 | hi.z << 16 | hi.w << 24) << 32;
    }
    return __shfl_sync(NVFP4_FULL_MASK, live, 0);
}

// A consumer warp is done with K/V buffer b: one arrival a warp for the producer, and with a
// cluster for the peer's producer too (it stores into this block's buffer).
__device__ __forceinline__ void release_tile(u32 bars, u32 peer_bars, int b, int lane) {
    __syncwarp();
    if (lane == 0) {
        mbar_arrive(bars + (BAR_EMPTY + b) * 8);
        if constexpr (CLUSTER == 2) mbar_arrive_cluster(peer_bars + (BAR_EMPTY + b) * 8);
    }
}

// Every consumer thread, once the outputs staged in K/V buffer b (the item's last tile) are out:
// its reads are done (the held barrier, which the producer waits on before it stores there again),
// and the warp gives the buffer back like a tile.
__device__ __forceinline__ void release_held(u32 bars, u32 peer_bars, int b, int lane) {
    mbar_arrive(bars + (BAR_HELD + b) * 8);
    release_tile(bars, peer_bars, b, lane);
}

// Scales a consumer's output rows g and g + 8 (its accumulators of the C fragment layout: rows
// g in elements 0, 1 of each 4, g + 8 in 2, 3) by their rescale factors (the softmax base moved).
__device__ __forceinline__ void rescale_rows(float (&o)[4 * O_BLOCKS], float alpha_lo, float alpha_hi) {
#pragma unroll
    for (int j = 0; j < O_BLOCKS; ++j) {
        o[4 * j + 0] *= alpha_lo;
        o[4 * j + 1] *= alpha_lo;
        o[4 * j + 2] *= alpha_hi;
        o[4 * j + 3] *= alpha_hi;
    }
}

// Consumer 0: the first tile from `tile` on with a live token, acquiring and releasing those
// without one (nothing to add; consumer 1 skips them too; the item's last tile, `hold`, stays
// held for the outputs); tile_end when none is left before it. Called holding no tile but `hold`:
// it may wait for any other buffer.
__device__ __forceinline__ int next_live_tile(u32 bars, u32 peer_bars, const u32* tile_masks, int tile, int tile_end,
                                              int hold, int lane, u64& live) {
    for (; tile < tile_end; ++tile) {
        live = acquire_tile(bars, tile_masks, tile, lane);
        if (live != 0) break;  // warpgroup-uniform
        if (tile != hold) release_tile(bars, peer_bars, tile & 1, lane);
    }
    return tile;
}

// Issues k-steps K0 .. K1 - 1 (16 dims each) of S = Q.K^T of a tile as one wgmma group (from
// K0 = 0: S starts at zero). The whole S, or in the loop its first QK_EARLY k-steps and then the rest.
// Q's k-step k is 32 bytes into the rows of slab k / 4; K's is 2 groups of 8 dims further.
constexpr int QK_EARLY = 8;
template <int K0 = 0, int K1 = QK_STEPS>
__device__ __forceinline__ void issue_scores(float (&s)[4 * S_BLOCKS], u64 desc_q, u64 desc_k) {
    constexpr u64 QK_K_STEP = (2 * GROUP_STRIDE) >> 4;
    if constexpr (K0 == 0) {
#pragma unroll
        for (int i = 0; i < 4 * S_BLOCKS; ++i) s[i] = 0.0f;
    }
    fence_registers(s);
    wgmma_fence();
#pragma unroll
    for (int k = K0; k < K1; ++k)
        wgmma_m64n64<0>(s, desc_q + (((k >> 2) * Q_SLAB + (k & 3) * 32) >> 4), desc_k + k * QK_K_STEP, 1);
    wgmma_commit();
}

// Consumer 0's thread 0 loads the Q of an item's heads (64 heads from head0 of query row `row`)
// with 8 tensor copies, a slab of 64 dims each; heads past num_heads come as zero rows (outside
// the map). The next item's Q is issued as soon as both consumers' loops over this item's tiles are
// done (so are its S), so it lands under the item's outputs; wait_q waits for it before the item's
// first S.
__device__ __forceinline__ void issue_q(const Params& p, u32 smem_q, u32 bar_q, i64 row, i64 head0) {
    mbar_arrive_expect_bytes(bar_q, HT * HEAD_DIM * 2);
#pragma unroll
    for (int slab = 0; slab < HEAD_DIM / 64; ++slab)
        tensor_copy3(smem_q + slab * Q_SLAB, p.q_map, slab * 64, static_cast<int>(head0), static_cast<int>(row), bar_q);
}

// Consumer 0: the item's Q has landed (phase: the block's count of items before it, mod 2); then
// both consumers meet (consumer 1 passes the barrier at its item's start too).
__device__ __forceinline__ void wait_q(u32 bar_q, u32 phase) {
    mbar_wait(bar_q, phase);
    named_barrier(1, 256);
}

// The outputs leave through shared memory: each consumer stages its half of every row (BF16 times
// the row's factor without splits, the raw fp32 with), then the 256 consumer threads copy whole
// rows out, a warp's store 512 contiguous bytes of a row. (Stores straight from the fragment
// layout touch 8 rows an instruction: a block's 128 KB of fp32 partials took 3.7 us, against
// 2.1 us at the 60 GB/s one SM stores.) The rows are staged in the K/V buffer of the item's last
// tile, which the consumers hold until the rows are out (the producer fills the other buffer with
// the next item's first tile meanwhile, and Q's buffer takes the next item's Q): 64 rows of 1 KB,
// each the row's BF16, or in two passes one consumer's fp32 half. Chunk c (16 bytes) of staged row
// r lies at (c ^ (r & 7)) * 16 within its 128 bytes: a fragment store's 8 rows hit 8 different
// chunk columns (fp32: 2 wavefronts for 256 bytes, BF16: 1 for 128), and a warp reads a row
// conflict-free. The staging code is unrolled over the 128 accumulators, so it is kept to one
// store an accumulator pair (the addresses precomputed, NaNs made torch's in the copy loop): the
// kernel's instruction footprint costs issue slots (ncu: "no instruction" stalls).
template <bool SPLIT>
__device__ __forceinline__ void stage_rows(const float (&o)[4 * O_BLOCKS], u8* region, int byte0, int row_lo, int quad,
                                           float factor_lo, float factor_hi) {
    // Pair j of a fragment row (dims j * 8 + quad * 2, + 1) is at byte j * 16 + quad * 4 of a BF16
    // row, j * 32 + quad * 8 of an fp32 half: chunk j (BF16) or 2 j + quad / 2 (fp32), whose
    // swizzled column depends on j & 7 (BF16) or j & 3 (fp32) and the row's r & 7 = row_lo & 7.
    constexpr int COLUMNS = SPLIT ? 4 : 8;
    u8* at[2][COLUMNS];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int k = 0; k < COLUMNS; ++k) {
            const int chunk = SPLIT ? 2 * k + (quad >> 1) : k, in_chunk = SPLIT ? (quad & 1) * 8 : quad * 4;
            at[half][k] = region + (row_lo + 8 * half) * STAGED_ROW + byte0 + ((chunk ^ row_lo) & 7) * 16 + in_chunk;
        }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float factor = half ? factor_hi : factor_lo;
#pragma unroll
        for (int j = 0; j < O_BLOCKS; ++j) {
            const float x = o[4 * j + 2 * half], y = o[4 * j + 2 * half + 1];
            if constexpr (SPLIT)
                *reinterpret_cast<float2*>(at[half][j & 3] + (j >> 2) * 128) = make_float2(x, y);
            else  // torch's NaN in copy_rows_out
                *reinterpret_cast<u32*>(at[half][j & 7] + (j >> 3) * 128) = bf16x2_rn(x * factor, y * factor);
        }
    }
}

// The bytes of a staged output row: BF16 rows are 1 KB; fp32 rows are staged 256 dims (1 KB) a
// pass, or with NARROW (16 rows) whole (2 KB).
template <bool SPLIT>
constexpr int STAGED_ROW_BYTES = SPLIT && NARROW ? 2 * STAGED_ROW : STAGED_ROW;

// Every consumer thread (ctid 0..CONSUMER_THREADS - 1), once the rows are staged in `region`: the
// staged rows to dims d0.. of the block's rows (heads below num_heads) of out, or of the split's
// partial outputs.
template <bool SPLIT>
__device__ __forceinline__ void copy_rows_out(const Params& p, const u8* region, i64 row, i64 head0, i64 split, int d0,
                                              int ctid) {
    constexpr int ROW_BYTES = STAGED_ROW_BYTES<SPLIT>;
    constexpr int WARP_STORES = (SPLIT ? ROW_BYTES : OUT_DIMS * 2) / 512;  // of a staged row
    named_barrier(1, CONSUMER_THREADS);  // every row is staged
    const i64 num_heads = p.num_heads, num_splits = p.num_splits;
    const int rows = static_cast<int>(min(static_cast<i64>(HT), num_heads - head0));
    const int warp = ctid >> 5, lane = ctid & 31;
    for (int r = warp; r < rows; r += CONSUMER_THREADS / 32) {  // a warp a row
        const i64 entry = row * num_heads + head0 + r;
        uint4* const dst = (SPLIT ? reinterpret_cast<uint4*>(p.partial_o + (entry * num_splits + split) * HEAD_DIM + d0)
                                  : reinterpret_cast<uint4*>(p.out + entry * (HEAD_DIM / 2) + d0 / 2)) + lane;
        const u8* const src = region + r * ROW_BYTES + (((lane ^ r) & 7) | (lane & ~7)) * 16;
        uint4 v[WARP_STORES];
#pragma unroll
        for (int c = 0; c < WARP_STORES; ++c) v[c] = *reinterpret_cast<const uint4*>(src + c * 512);
#pragma unroll
        for (int c = 0; c < WARP_STORES; ++c) {
            if constexpr (!SPLIT)
                v[c] = make_uint4(torch_nan_halves(v[c].x), torch_nan_halves(v[c].y), torch_nan_halves(v[c].z),
                                  torch_nan_halves(v[c].w));
            dst[c * 32] = v[c];  // a warp's store: 512 contiguous bytes
        }
    }
}

// A consumer's half of the item's outputs, its dims from d0 of the item's (after both loops: named
// barrier 1; the item's dims from part * OUT_DIMS), staged in K/V buffer `held`. Both consumers pass
// the same barriers. fp32 partials leave 256 dims (a staged row of 1 KB) a pass: both consumers'
// halves at once with half rows (DIM_PARTS 2), else each consumer's in a pass of its own.
__device__ __forceinline__ void write_rows(const Params& p, const float (&o)[4 * O_BLOCKS], u8* smem, i64 row, i64 head0,
                                           i64 split, int part, int held, int d0, int row_lo, int quad, float factor_lo,
                                           float factor_hi, int ctid) {
    u8* const region = smem + SM_KV + held * KV_BYTES;
    const int item_d0 = part * OUT_DIMS;
    if (p.num_splits == 1) {
        stage_rows<false>(o, region, d0 * 2, row_lo, quad, factor_lo, factor_hi);
        copy_rows_out<false>(p, region, row, head0, split, item_d0, ctid);
        return;
    }
    constexpr int PASS_DIMS = STAGED_ROW / 4, PASSES = OUT_DIMS / PASS_DIMS;
#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {  // one copy of the staging code
        if (pass > 0) named_barrier(1, 256);  // the pass before is read out
        const int pass_d0 = pass * PASS_DIMS;
        if (d0 >= pass_d0 && d0 < pass_d0 + PASS_DIMS)
            stage_rows<true>(o, region, (d0 - pass_d0) * 4, row_lo, quad, factor_lo, factor_hi);
        copy_rows_out<true>(p, region, row, head0, split, item_d0 + pass_d0, ctid);
    }
}

// Consumer 0, one item: S, the softmax, P, and O over the first half of the item's dims (0..255 of
// whole rows), then its half of the outputs.
// The item's tiles (at least one) are the block's tiles tile0 .. tile0 + num_tiles - 1 (their
// buffers and phases); the last one's buffer is held for the outputs. `processed` counts the
// block's tiles with a live token (the phases of P); `ordinal`: the block's items before this one
// (0: its Q is not issued yet); `last`: the block has no item after this one, else next_row and
// next_head0 are the next item's (its Q is issued here).
__device__ __forceinline__ void consume_item0(const Params& p, u8* smem, i64 row, i64 head0, i64 split, int part,
                                              int tile0, int num_tiles, u32 ordinal, bool last, i64 next_row, i64 next_head0,
                                              u32& processed, int tid, u32 peer_bars) {
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, quad = lane & 3;
    const int row_lo = warp * 16 + g, row_hi = row_lo + 8;  // the thread's rows of every fragment
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const u32* const tile_masks = reinterpret_cast<const u32*>(smem + SM_TILE_MASK);
    float* const alphas = reinterpret_cast<float*>(smem + SM_ALPHA);
    float* const factors = reinterpret_cast<float*>(smem + SM_FACTOR);
    u8* const sp = smem + SM_P;
    const float score_scale = static_cast<float>(p.score_scale);
    const u32 base = shared_address(smem);
    const u64 desc_q = swizzled_descriptor(base + SM_Q);
    const u64 desc_k0 = matrix_descriptor(base + SM_KV, GROUP_STRIDE, 128);
    const u64 desc_v0 = matrix_descriptor(base + SM_KV + part * (OUT_DIMS / 8) * GROUP_STRIDE, 128, GROUP_STRIDE);
    constexpr u64 KV_STEP = KV_BYTES >> 4, PV_K_STEP = (16 * 16) >> 4;

    float o[4 * O_BLOCKS];
#pragma unroll
    for (int i = 0; i < 4 * O_BLOCKS; ++i) o[i] = 0.0f;
    float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.0f, l_hi = 0.0f;
    const u32 bar_q = bars + BAR_Q * 8;
    if (ordinal == 0 && tid == 0) issue_q(p, base + SM_Q, bar_q, row, head0);
    wait_q(bar_q, ordinal & 1);

    // The live tiles in order. A tile's S is issued right behind the previous tile's P.V, so the
    // tensor cores run both (and consumer 1's half of P.V) back to back.
    float s[4 * S_BLOCKS];
    u64 live = 0;
    const int tile_end = tile0 + num_tiles, hold = tile_end - 1;
    int tile = next_live_tile(bars, peer_bars, tile_masks, tile0, tile_end, hold, lane, live);
    if (tile < tile_end) {
        issue_scores(s, desc_q, desc_k0 + (tile & 1) * KV_STEP);
        wgmma_wait_all();
        fence_registers(s);
    }
    while (tile < tile_end) {
        const int b = tile & 1;

        // The online softmax of rows lo (elements 0, 1 of an n-block) and hi (2, 3); the quad's 4
        // lanes hold a row's 64 tokens, n-block j tokens 8 j + 2 quad + {0, 1}.
        const u64 mine = live >> (2 * quad);  // bit 8 j + e: token 8 j + 2 quad + e
#pragma unroll
        for (int j = 0; j < S_BLOCKS; ++j) {
            const bool live0 = (mine >> (8 * j)) & 1u, live1 = (mine >> (8 * j + 1)) & 1u;
            s[4 * j + 0] = live0 ? s[4 * j + 0] * score_scale : neg_inf();
            s[4 * j + 1] = live1 ? s[4 * j + 1] * score_scale : neg_inf();
            s[4 * j + 2] = live0 ? s[4 * j + 2] * score_scale : neg_inf();
            s[4 * j + 3] = live1 ? s[4 * j + 3] * score_scale : neg_inf();
        }
        float max_lo = fmaxf(s[0], s[1]), max_hi = fmaxf(s[2], s[3]);
#pragma unroll
        for (int j = 1; j < S_BLOCKS; ++j) {
            max_lo = fmaxf(max_lo, fmaxf(s[4 * j], s[4 * j + 1]));
            max_hi = fmaxf(max_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        quad_max(max_lo, max_hi);
        const bool move_lo = base_moves(max_lo, m_lo), move_hi = base_moves(max_hi, m_hi);
        const float new_lo = move_lo ? max_lo : m_lo, new_hi = move_hi ? max_hi : m_hi;
        const float base_lo = softmax_base(new_lo), base_hi = softmax_base(new_hi);
        u32 pa[PV_STEPS][4];  // P as the A operands of the P.V k-steps (tokens 16 k .. 16 k + 15)
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < S_BLOCKS; ++j) {
            const float p0 = exp2_approx(s[4 * j + 0] - base_lo), p1 = exp2_approx(s[4 * j + 1] - base_lo);
            const float p2 = exp2_approx(s[4 * j + 2] - base_hi), p3 = exp2_approx(s[4 * j + 3] - base_hi);
            sum_lo += p0 + p1;
            sum_hi += p2 + p3;
            // p is never NaN for finite or -inf scores: the plain conversion.
            pa[j / 2][(j & 1) * 2] = bf16x2_rn(p0, p1);      // row lo, tokens 8 j + 2 quad + {0, 1}
            pa[j / 2][(j & 1) * 2 + 1] = bf16x2_rn(p2, p3);  // row hi
        }
        quad_sum(sum_lo, sum_hi);
        const float alpha_lo = move_lo ? exp2_approx(m_lo - base_lo) : 1.0f;
        const float alpha_hi = move_hi ? exp2_approx(m_hi - base_hi) : 1.0f;
        m_lo = new_lo;
        m_hi = new_hi;
        l_lo = l_lo * alpha_lo + sum_lo;
        l_hi = l_hi * alpha_hi + sum_hi;

        // Consumer 1's copy of P: the P.V wgmma reads pa until it completes, and PTX forbids touching
        // a running wgmma's registers, so P is stored for consumer 1 from this copy while it runs.
        u32 pc[PV_STEPS][4];
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k)
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("mov.b32 %0, %1;" : "=r"(pc[k][i]) : "r"(pa[k][i]));

        // O += P.V, issued before P is handed over: the tensor cores start on it without
        // waiting for consumer 1 to be done with the last P, nor for P's stores. The rescale first
        // (rare once the max settles).
        if (__any_sync(NVFP4_FULL_MASK, move_lo || move_hi)) rescale_rows(o, alpha_lo, alpha_hi);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k) wgmma_pv_rs(o, pa[k], desc_v0 + b * KV_STEP + k * PV_K_STEP);
        wgmma_commit();

        // P and the rescale factors for consumer 1 (once it is done with the last ones).
        mbar_wait(bars + BAR_P_EMPTY * 8, (processed & 1) ^ 1);
#pragma unroll
        for (int j = 0; j < S_BLOCKS; ++j) {
            u8* const at = sp + j * P_GROUP_STRIDE + quad * 4;
            *reinterpret_cast<u32*>(at + row_lo * 16) = pc[j / 2][(j & 1) * 2];
            *reinterpret_cast<u32*>(at + row_hi * 16) = pc[j / 2][(j & 1) * 2 + 1];
        }
        if (quad == 0) {
            alphas[row_lo] = alpha_lo;
            alphas[row_hi] = alpha_hi;
        }
        fence_proxy_async();
        mbar_arrive(bars + BAR_P_FULL * 8);

        // The next tile's S behind the P.V: only tile + 1, whose buffer is the other one (tile + 2
        // would wait for this tile's buffer). Its first k-steps queue behind the P.V; the rest are
        // issued once the P.V is done and this tile's buffer is back with the producer, which can
        // then refill it while S runs (issuing all of S first kept consumer 0 issuing, and the
        // buffer held, until the tensor cores had taken most of S: some 1,100 cycles at 128 heads).
        int next = tile + 1;
        u64 next_live = 0;
        if (next < tile_end) next_live = acquire_tile(bars, tile_masks, next, lane);
        if (next_live != 0) {
            issue_scores<0, QK_EARLY>(s, desc_q, desc_k0 + (next & 1) * KV_STEP);
            wgmma_wait<1>();  // P.V done (S may still run): this tile's buffer goes back to the producer now
        } else {
            wgmma_wait_all();
        }
        fence_registers(o);
        if (tile != hold) release_tile(bars, peer_bars, b, lane);
        if (next_live != 0) issue_scores<QK_EARLY, QK_STEPS>(s, desc_q, desc_k0 + (next & 1) * KV_STEP);
        wgmma_wait_all();
        fence_registers(s);
        ++processed;
        if (next < tile_end && next_live == 0) {  // nothing live in tile + 1: on to the next live tile, unpipelined
            if (next != hold) release_tile(bars, peer_bars, next & 1, lane);
            next = next_live_tile(bars, peer_bars, tile_masks, next + 1, tile_end, hold, lane, next_live);
            if (next < tile_end) {
                issue_scores(s, desc_q, desc_k0 + (next & 1) * KV_STEP);
                wgmma_wait_all();
                fence_registers(s);
            }
        }
        tile = next;
        live = next_live;
    }

    // The rows' factors for consumer 1, then this half of the outputs.
    const i64 num_heads = p.num_heads, num_splits = p.num_splits;
    float factor_lo = 0.0f, factor_hi = 0.0f, lse_lo = 0.0f, lse_hi = 0.0f;
    if (num_splits == 1) {
        lse_lo = row_lse(m_lo, l_lo);
        lse_hi = row_lse(m_hi, l_hi);
        if (head0 + row_lo < num_heads) factor_lo = output_factor(l_lo, lse_lo, p.sinks, head0 + row_lo);
        if (head0 + row_hi < num_heads) factor_hi = output_factor(l_hi, lse_hi, p.sinks, head0 + row_hi);
        if (quad == 0) {
            factors[row_lo] = factor_lo;
            factors[row_hi] = factor_hi;
        }
    }
    named_barrier(1, 256);  // both consumers' loops are done (the held buffer is free), the factors are in
    if (!last && tid == 0) issue_q(p, base + SM_Q, bar_q, next_row, next_head0);  // every S is done: Q is free
    if (quad == 0 && part == 0) {  // both parts of a row have the same (m, l)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const i64 head = head0 + (half ? row_hi : row_lo);
            if (head >= num_heads) continue;
            if (num_splits == 1)
                p.lse[row * num_heads + head] = half ? lse_hi : lse_lo;
            else
                reinterpret_cast<float2*>(p.partial_ml)[(row * num_heads + head) * num_splits + split] =
                    half ? make_float2(m_hi, l_hi) : make_float2(m_lo, l_lo);
        }
    }
    write_rows(p, o, smem, row, head0, split, part, hold & 1, 0, row_lo, quad, factor_lo, factor_hi, tid);
    release_held(bars, peer_bars, hold & 1, lane);
}

// Consumer 1, one item: O over the second half of the item's dims (256..511 of whole rows) with
// consumer 0's P and rescale factors (the arguments as consume_item0's).
__device__ __forceinline__ void consume_item1(const Params& p, u8* smem, i64 row, i64 head0, i64 split, int part,
                                              int tile0, int num_tiles, u32& processed, int tid, u32 peer_bars) {
    const int hold = tile0 + num_tiles - 1;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, quad = lane & 3;
    const int row_lo = warp * 16 + g, row_hi = row_lo + 8;
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const u32* const tile_masks = reinterpret_cast<const u32*>(smem + SM_TILE_MASK);
    const float* const alphas = reinterpret_cast<const float*>(smem + SM_ALPHA);
    const float* const factors = reinterpret_cast<const float*>(smem + SM_FACTOR);
    const u32 base = shared_address(smem);
    const u64 desc_p = matrix_descriptor(base + SM_P, P_GROUP_STRIDE, 128);
    const u64 desc_v0 =
        matrix_descriptor(base + SM_KV + (part * OUT_DIMS + HALF_DIMS) / 8 * GROUP_STRIDE, 128, GROUP_STRIDE);
    constexpr u64 KV_STEP = KV_BYTES >> 4, P_K_STEP = (2 * P_GROUP_STRIDE) >> 4, PV_K_STEP = (16 * 16) >> 4;

    float o[4 * O_BLOCKS];
#pragma unroll
    for (int i = 0; i < 4 * O_BLOCKS; ++i) o[i] = 0.0f;
    named_barrier(1, 256);  // consumer 0's wait_q
    for (int tile = tile0; tile < tile0 + num_tiles; ++tile) {
        const int b = tile & 1;
        const u64 live = acquire_tile(bars, tile_masks, tile, lane);
        if (live == 0) {
            if (tile != hold) release_tile(bars, peer_bars, b, lane);
            continue;
        }
        mbar_wait(bars + BAR_P_FULL * 8, processed & 1);
        const float alpha_lo = alphas[row_lo], alpha_hi = alphas[row_hi];
        if (__any_sync(NVFP4_FULL_MASK, alpha_lo != 1.0f || alpha_hi != 1.0f)) rescale_rows(o, alpha_lo, alpha_hi);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k)
            wgmma_pv_ss(o, desc_p + k * P_K_STEP, desc_v0 + b * KV_STEP + k * PV_K_STEP);
        wgmma_commit();
        wgmma_wait_all();
        fence_registers(o);
        mbar_arrive(bars + BAR_P_EMPTY * 8);  // every thread: its reads of the factors come before consumer 0's next writes
        if (tile != hold) release_tile(bars, peer_bars, b, lane);
        ++processed;
    }

    named_barrier(1, 256);  // both consumers' loops are done (the held buffer is free), consumer 0's factors are in
    const bool split_outputs = p.num_splits > 1;  // then no factors were written: raw fp32 rows
    const float factor_lo = split_outputs ? 0.0f : factors[row_lo], factor_hi = split_outputs ? 0.0f : factors[row_hi];
    write_rows(p, o, smem, row, head0, split, part, hold & 1, HALF_DIMS, row_lo, quad, factor_lo, factor_hi, tid + 128);
    release_held(bars, peer_bars, hold & 1, lane);
}

// ---------------------------------------------------------------- NARROW: one consumer, 16 heads

// A thread's fragment of S^T (64 tokens x 16 heads) or of one m-block of O^T (64 dims x 16 heads)
// is rows 16 w + g and 16 w + g + 8 of warp w by heads 8 j + 2 quad + {0, 1}: element 4 j + e is
// row 16 w + g + 8 (e >> 1) and head 8 j + 2 quad + (e & 1). The thread's 4 heads are its columns
// c = 2 j + (e & 1).
__device__ __forceinline__ int column_head(int c, int quad) { return 8 * (c >> 1) + 2 * quad + (c & 1); }

// Issues S^T = K.Q^T of a tile (32 k-steps of 16 dims: K's k-step is 2 groups of 8 dims further,
// Q's 32 bytes into the rows of slab k / 4) as one wgmma group.
__device__ __forceinline__ void issue_scores_t(float (&s)[8], u64 desc_k, u64 desc_q) {
    constexpr u64 QK_K_STEP = (2 * GROUP_STRIDE) >> 4;
    fence_registers(s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < QK_STEPS; ++k)  // k-step 0 overwrites s: only the wgmma writes S^T's registers
        wgmma_m64n16<0>(s, desc_k + k * QK_K_STEP, desc_q + (((k >> 2) * Q_SLAB + (k & 3) * 32) >> 4), k > 0);
    wgmma_commit();
}

// Every consumer thread: the max (MAX) or sum over the block's 64 rows of what each thread holds
// for its 4 heads, returned to every thread. Over a warp's rows by shuffles (every lane gets the
// same bits), then over the 4 warps through `exchange` (4 warps x 16 heads) in warp order.
template <bool MAX>
__device__ __forceinline__ void reduce_heads(float (&v)[4], float* exchange, int warp, int lane) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) {
            const float other = __shfl_xor_sync(NVFP4_FULL_MASK, v[c], x);
            v[c] = MAX ? fmaxf(v[c], other) : v[c] + other;
        }
    const int quad = lane & 3;
    if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
            *reinterpret_cast<float2*>(exchange + warp * HT + 8 * j + 2 * quad) = make_float2(v[2 * j], v[2 * j + 1]);
    }
    named_barrier(1, CONSUMER_THREADS);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float2 t = *reinterpret_cast<const float2*>(exchange + 8 * j + 2 * quad);
#pragma unroll
        for (int w = 1; w < 4; ++w) {
            const float2 u = *reinterpret_cast<const float2*>(exchange + w * HT + 8 * j + 2 * quad);
            t = MAX ? make_float2(fmaxf(t.x, u.x), fmaxf(t.y, u.y)) : make_float2(t.x + u.x, t.y + u.y);
        }
        v[2 * j] = t.x;
        v[2 * j + 1] = t.y;
    }
}

// The item's outputs from O^T, staged in K/V buffer `held` as whole rows (a head's 512 dims: BF16
// times the head's factor without splits, the raw fp32 with), chunk c of row h at
// ((c ^ h) & 7 | c & ~7) * 16 as copy_rows_out reads them, then copied out.
__device__ __forceinline__ void write_rows_narrow(const Params& p, const float (&o)[8 * DIM_BLOCKS], u8* smem, i64 row,
                                                  i64 head0, i64 split, int held, int warp, int g, int quad,
                                                  const float (&factor)[4], int tid) {
    u8* const region = smem + SM_KV + held * KV_BYTES;
    const bool split_outputs = p.num_splits > 1;
#pragma unroll
    for (int i = 0; i < DIM_BLOCKS; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // rows (dims) 16 w + g + 8 r of m-block i, heads h and h + 1
                const int d = 64 * i + 16 * warp + g + 8 * r, h = column_head(2 * j, quad);
                const float x = o[8 * i + 4 * j + 2 * r], y = o[8 * i + 4 * j + 2 * r + 1];
                if (split_outputs) {
                    const int chunk = d >> 2, at = (((chunk ^ h) & 7) | (chunk & ~7)) * 16 + (d & 3) * 4;
                    *reinterpret_cast<float*>(region + h * STAGED_ROW_BYTES<true> + at) = x;
                    *reinterpret_cast<float*>(region + (h + 1) * STAGED_ROW_BYTES<true> + (at ^ 16)) = y;
                } else {  // torch's NaN in copy_rows_out
                    const u32 pair = bf16x2_rn(x * factor[2 * j], y * factor[2 * j + 1]);
                    const int chunk = d >> 3, at = (((chunk ^ h) & 7) | (chunk & ~7)) * 16 + (d & 7) * 2;
                    *reinterpret_cast<u16*>(region + h * STAGED_ROW + at) = static_cast<u16>(pair);
                    *reinterpret_cast<u16*>(region + (h + 1) * STAGED_ROW + (at ^ 16)) = static_cast<u16>(pair >> 16);
                }
            }
    if (split_outputs)
        copy_rows_out<true>(p, region, row, head0, split, 0, tid);
    else
        copy_rows_out<false>(p, region, row, head0, split, 0, tid);
}

// NARROW, the consumer warpgroup, one item: per tile S^T, the online softmax of the 16 heads
// (their maxima over the block's 64 tokens through shared memory), P^T in shared memory and
// O^T += V^T.P^T over all 512 dims, then the item's outputs (the arguments as consume_item0's;
// `processed` counts the block's exchanges, whose parity picks the half of the exchange buffer).
__device__ __forceinline__ void consume_item_narrow(const Params& p, u8* smem, i64 row, i64 head0, i64 split, int tile0,
                                                    int num_tiles, u32 ordinal, bool last, i64 next_row, i64 next_head0,
                                                    u32& processed, int tid) {
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, quad = lane & 3;
    const int token_lo = warp * 16 + g;  // the thread's rows of S^T: tokens token_lo and token_lo + 8
    const u32 bars = shared_address(smem + SM_BARRIERS);
    const u32* const tile_masks = reinterpret_cast<const u32*>(smem + SM_TILE_MASK);
    float* const exchange = reinterpret_cast<float*>(smem + SM_EXCHANGE);
    u8* const sp = smem + SM_P;
    const float score_scale = static_cast<float>(p.score_scale);
    const u32 base = shared_address(smem);
    const u64 desc_q = swizzled_descriptor(base + SM_Q);                    // S^T's B: Q, K-major (dims contiguous)
    const u64 desc_k0 = matrix_descriptor(base + SM_KV, GROUP_STRIDE, 128);  // S^T's A: K, K-major
    const u64 desc_v0 = matrix_descriptor(base + SM_KV, 128, GROUP_STRIDE);  // O^T's A: V^T, MN-major (transposed A)
    const u64 desc_p = matrix_descriptor(base + SM_P, P_GROUP_STRIDE, 128);  // O^T's B: P, K-major (tokens contiguous)
    constexpr u64 KV_STEP = KV_BYTES >> 4, PV_K_STEP = (16 * 16) >> 4, P_K_STEP = (2 * P_GROUP_STRIDE) >> 4,
                  DIM_BLOCK_STEP = (8 * GROUP_STRIDE) >> 4;

    float o[8 * DIM_BLOCKS];  // O^T: m-block i (dims 64 i .. 64 i + 63) in o[8 i .. 8 i + 7]
#pragma unroll
    for (int i = 0; i < 8 * DIM_BLOCKS; ++i) o[i] = 0.0f;
    // The thread's 4 heads: the softmax base m (the same in every thread) and its own rows' share of
    // the sum l (added over the block at the end).
    float m[4], l[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) m[c] = neg_inf(), l[c] = 0.0f;
    const u32 bar_q = bars + BAR_Q * 8;
    if (ordinal == 0 && tid == 0) issue_q(p, base + SM_Q, bar_q, row, head0);
    mbar_wait(bar_q, ordinal & 1);

    float s[8] = {};
    u64 live = 0;
    const int tile_end = tile0 + num_tiles, hold = tile_end - 1;
    int tile = next_live_tile(bars, 0u, tile_masks, tile0, tile_end, hold, lane, live);
    if (tile < tile_end) {
        issue_scores_t(s, desc_k0 + (tile & 1) * KV_STEP, desc_q);
        wgmma_wait_all();
        fence_registers(s);
    }
    while (tile < tile_end) {
        const int b = tile & 1;
        const bool live_lo = (live >> token_lo) & 1u, live_hi = (live >> (token_lo + 8)) & 1u;
        // The scaled scores in registers of their own: an instruction that writes s, which only the
        // wgmma defines, makes ptxas serialize every wgmma of the kernel (C7515).
        float x[8], tile_max[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int lo = 4 * (c >> 1) + (c & 1), hi = lo + 2;
            x[lo] = live_lo ? s[lo] * score_scale : neg_inf();
            x[hi] = live_hi ? s[hi] * score_scale : neg_inf();
            tile_max[c] = fmaxf(x[lo], x[hi]);
        }
        reduce_heads<true>(tile_max, exchange + (processed & 1) * 4 * HT, warp, lane);
        ++processed;
        float alpha[4], pr[8];
        bool moved = false;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int lo = 4 * (c >> 1) + (c & 1), hi = lo + 2;
            const bool move = base_moves(tile_max[c], m[c]);
            const float new_m = move ? tile_max[c] : m[c];
            const float base_c = softmax_base(new_m);
            alpha[c] = move ? exp2_approx(m[c] - base_c) : 1.0f;
            moved = moved || move;
            pr[lo] = exp2_approx(x[lo] - base_c);
            pr[hi] = exp2_approx(x[hi] - base_c);
            l[c] = l[c] * alpha[c] + (pr[lo] + pr[hi]);
            m[c] = new_m;
        }
        // P^T as O^T's B operand: (head h, token t) at (t / 8) * P_GROUP_STRIDE + h * 16 + (t % 8) * 2.
        // p is never NaN for finite or -inf scores: the plain conversion.
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int t = token_lo + 8 * r, h = column_head(2 * j, quad);
                const u32 pair = bf16x2_rn(pr[4 * j + 2 * r], pr[4 * j + 2 * r + 1]);  // heads h, h + 1
                u8* const at = sp + (t >> 3) * P_GROUP_STRIDE + h * 16 + (t & 7) * 2;
                *reinterpret_cast<u16*>(at) = static_cast<u16>(pair);
                *reinterpret_cast<u16*>(at + 16) = static_cast<u16>(pair >> 16);
            }
        if (__any_sync(NVFP4_FULL_MASK, moved)) {  // rare once the maxima settle
#pragma unroll
            for (int i = 0; i < 8 * DIM_BLOCKS; ++i) o[i] *= alpha[2 * ((i >> 2) & 1) + (i & 1)];
        }
        fence_proxy_async();
        named_barrier(1, CONSUMER_THREADS);  // P^T is whole (every warp's wgmma reads all of it)
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < PV_STEPS; ++k)
#pragma unroll
            for (int i = 0; i < DIM_BLOCKS; ++i)
                wgmma_m64n16<1>(o + 8 * i, desc_v0 + b * KV_STEP + i * DIM_BLOCK_STEP + k * PV_K_STEP, desc_p + k * P_K_STEP,
                                1);
        wgmma_commit();

        // The next tile's S^T behind the O^T (tile + 1 only: its buffer is the other one).
        int next = tile + 1;
        u64 next_live = 0;
        if (next < tile_end) next_live = acquire_tile(bars, tile_masks, next, lane);
        if (next_live != 0) {
            issue_scores_t(s, desc_k0 + (next & 1) * KV_STEP, desc_q);
            wgmma_wait<1>();  // O^T done (S^T may still run): this tile's buffer goes back to the producers now
        } else {
            wgmma_wait_all();
        }
        fence_registers(o);
        if (tile != hold) release_tile(bars, 0u, b, lane);
        wgmma_wait_all();
        fence_registers(s);
        if (next < tile_end && next_live == 0) {  // nothing live in tile + 1: on to the next live tile, unpipelined
            if (next != hold) release_tile(bars, 0u, next & 1, lane);
            next = next_live_tile(bars, 0u, tile_masks, next + 1, tile_end, hold, lane, next_live);
            if (next < tile_end) {
                issue_scores_t(s, desc_k0 + (next & 1) * KV_STEP, desc_q);
                wgmma_wait_all();
                fence_registers(s);
            }
        }
        tile = next;
        live = next_live;
    }

    // The heads' sums over the block (its barrier also means every S^T is done: Q is free).
    reduce_heads<false>(l, exchange + (processed & 1) * 4 * HT, warp, lane);
    ++processed;
    if (!last && tid == 0) issue_q(p, base + SM_Q, bar_q, next_row, next_head0);
    const i64 num_heads = p.num_heads, num_splits = p.num_splits;
    float factor[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const i64 head = head0 + column_head(c, quad);
        const float lse = row_lse(m[c], l[c]);
        factor[c] = num_splits == 1 && head < num_heads ? output_factor(l[c], lse, p.sinks, head) : 0.0f;
        if (tid >= 4 || head >= num_heads) continue;  // warp 0's lanes 0..3 write the heads' (m, l) or lse
        if (num_splits == 1)
            p.lse[row * num_heads + head] = lse;
        else
            reinterpret_cast<float2*>(p.partial_ml)[(row * num_heads + head) * num_splits + split] = make_float2(m[c], l[c]);
    }
    write_rows_narrow(p, o, smem, row, head0, split, hold & 1, warp, g, quad, factor, tid);
    release_held(bars, 0u, hold & 1, lane);
}

// The block's work items: (query row, head tile, split, dim part) in the order of a grid of a block
// each (the head tile fastest, then the part), item blockIdx.x, then every gridDim.x-th. The host
// launches at most as many blocks as the GPU holds at once, so a block that finishes an item goes
// on to the next one with its barriers, buffers and scale table set up and its producer already
// gathering: the fill and the output phase of a block's items overlap. With a cluster the grid is
// even, so both blocks of a cluster walk neighbouring items: the two head tiles of the same (row,
// split, part), or with one head tile the two parts of the same (row, split).
struct Item {
    i64 row, head0, split;
    int part, tile_begin, num_tiles;
};

__device__ __forceinline__ Item item_at(const Params& p, u32 item, u32 head_tiles, int total_tiles) {
    const u32 num_splits = static_cast<u32>(p.num_splits);
    Item it;
    const u32 rest = item / head_tiles;  // (row, split, part), the part fastest
    it.head0 = static_cast<i64>(item % head_tiles * HT);
    it.part = static_cast<int>(rest % DIM_PARTS);
    it.split = static_cast<i64>(rest / DIM_PARTS % num_splits);
    it.row = static_cast<i64>(rest / DIM_PARTS / num_splits);  // batch * q_len + position
    it.tile_begin = static_cast<int>(it.split * p.tiles_per_split);
    it.num_tiles = max(min(it.tile_begin + static_cast<int>(p.tiles_per_split), total_tiles) - it.tile_begin, 0);
    return it;
}

#if CLUSTER == 2
#define CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#else
#define CLUSTER_DIMS
#endif

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(THREADS, 1) nvfp4_mla_decode_sm90(const __grid_constant__ Params p) {
    extern __shared__ __align__(1024) u8 smem[];  // Q's swizzle: 1024-byte periods
    const int tid = threadIdx.x;
    // Items fit 31 bits: at 2^31 items q alone would pass 1 TB (a row has at least 1 KB; two dim
    // parts double the items), and with splits the workspace.
    const u32 head_tiles = static_cast<u32>((p.num_heads + HT - 1) / HT);
    const u32 items = static_cast<u32>(p.rows) * head_tiles * DIM_PARTS * static_cast<u32>(p.num_splits);
    // Tile indices fit an int: the host caps a table's width (validation.decode).
    const int total_tiles = static_cast<int>((p.swa.k + p.extra.k + BN - 1) / BN);

    u32* const scale_pairs = reinterpret_cast<u32*>(smem + SM_SCALES);
    for (int byte = tid; byte < 256; byte += THREADS) scale_pairs[byte] = e4m3_bf16x2(byte);
    if (tid == 0) {
        const u32 bars = shared_address(smem + SM_BARRIERS);
        mbar_init(bars + (BAR_FULL + 0) * 8, 128 * PRODUCERS);  // every producer thread of the block
        mbar_init(bars + (BAR_FULL + 1) * 8, 128 * PRODUCERS);
        mbar_init(bars + (BAR_EMPTY + 0) * 8, CONSUMER_THREADS / 32 * CLUSTER);  // a consumer warp of each block
        mbar_init(bars + (BAR_EMPTY + 1) * 8, CONSUMER_THREADS / 32 * CLUSTER);
        for (int i = 0; i < 8 * PRODUCERS; ++i) mbar_init(bars + (BAR_RAW + i) * 8, RAW_ARRIVALS);
        if constexpr (!NARROW) {
            mbar_init(bars + BAR_P_FULL * 8, 128);
            mbar_init(bars + BAR_P_EMPTY * 8, 128);
        }
        mbar_init(bars + (BAR_HELD + 0) * 8, CONSUMER_THREADS);
        mbar_init(bars + (BAR_HELD + 1) * 8, CONSUMER_THREADS);
        mbar_init(bars + BAR_Q * 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    const u32 rank = CLUSTER == 2 ? cluster_rank() : 0u;  // the item's parity: its head tile's, or its part's
    const u32 peer_bars = CLUSTER == 2 ? cluster_address(shared_address(smem + SM_BARRIERS), rank ^ 1u) : 0u;
    if constexpr (CLUSTER == 2)
        cluster_sync();
    else
        __syncthreads();
    // The stream's next kernel (the combine, or the next call) may launch now, except after many
    // splits: then the combine's blocks, each long, would pile onto the few SMs this grid leaves free
    // and end last (H200, 1 row, 128 heads, 65 splits: 0.85x; 18 splits and fewer gain).
    if (p.num_splits <= EARLY_DEPENDENTS_MAX_SPLITS) launch_dependents();
    wait_for_prior_grids();  // the setup above touched no global memory

    const int warpgroup = tid >> 7;
    // The block's tiles of its earlier items, modulo 4: a tile's K/V buffer and phase, and a unit's
    // raw buffer and phase, are the low two bits of their counts. And the consumers' count of live
    // tiles, whose parity is the phase of P.
    int tiles_before = 0;
    u32 processed = 0;
    if (warpgroup >= CONSUMERS) {  // a producer warpgroup
        if constexpr (!NARROW) regs_decrease<REGS_PRODUCER>();
        // Its share of every tile: with a cluster the unit of the block's rank, with NARROW its own
        // unit of the block's tiles, else both units.
        const int share = NARROW ? warpgroup - CONSUMERS : static_cast<int>(rank);
        u32 held = 0;
        for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
            const Item it = item_at(p, item, head_tiles, total_tiles);
            produce_item(p, smem, it.row, it.tile_begin, it.num_tiles, UNITS_PER_TILE * tiles_before, tiles_before,
                         tid - 128 * warpgroup, share, held);
            tiles_before = (tiles_before + it.num_tiles) & 3;
            held |= 1u << ((tiles_before + 3) & 1);  // the item's last tile (at least one) holds its outputs
        }
    } else if (warpgroup == 0) {
        if constexpr (!NARROW) regs_increase<REGS_CONSUMER0>();
        Item it = item_at(p, blockIdx.x, head_tiles, total_tiles);
        u32 ordinal = 0;
        for (u32 item = blockIdx.x; item < items; item += gridDim.x, ++ordinal) {
            const bool last = item + gridDim.x >= items;
            const Item next = last ? it : item_at(p, item + gridDim.x, head_tiles, total_tiles);
            if constexpr (NARROW)
                consume_item_narrow(p, smem, it.row, it.head0, it.split, tiles_before, it.num_tiles, ordinal, last,
                                    next.row, next.head0, processed, tid);
            else
                consume_item0(p, smem, it.row, it.head0, it.split, it.part, tiles_before, it.num_tiles, ordinal, last,
                              next.row, next.head0, processed, tid, peer_bars);
            tiles_before = (tiles_before + it.num_tiles) & 3;
            it = next;
        }
    } else if constexpr (!NARROW) {  // consumer 1
        regs_decrease<REGS_CONSUMER1>();
        for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
            const Item it = item_at(p, item, head_tiles, total_tiles);
            consume_item1(p, smem, it.row, it.head0, it.split, it.part, tiles_before, it.num_tiles, processed,
                          tid - 128, peer_bars);
            tiles_before = (tiles_before + it.num_tiles) & 3;
        }
    }
    if constexpr (CLUSTER == 2) cluster_sync();  // the peer may still store into this block or arrive on its barriers
}
