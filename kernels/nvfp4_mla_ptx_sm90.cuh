// PTX wrappers of Hopper (sm_90a) that the decode kernel of nvfp4_mla_decode_sm90.cu uses:
// mbarriers, clusters and their stores, the async proxy's fence, setmaxnreg, tensor copies (TMA),
// shared-memory matrix descriptors and wgmma.
#pragma once

// clang-format off: the inline assembly keeps its hand-laid PTX strings and operand tables.

#include "nvfp4_mla_ptx.cuh"

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the mbarriers this thread initialized visible to the block and its cluster.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

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
// The P.V products of a consumer: O (64 x N dims, fp32, N / 2 accumulators a thread) with N = 256
// (whole rows: m64n256k16, the other operands from %128) or 128 (half rows: m64n128k16, from %64).
#define PV256_LIST WGMMA_D_LO_LIST ", " WGMMA_D_HI_LIST
#define PV256_OUTPUTS WGMMA_D_LO_OUTPUTS, WGMMA_D_HI_OUTPUTS
#define PV128_LIST WGMMA_D_LO_LIST
#define PV128_OUTPUTS WGMMA_D_LO_OUTPUTS

// O (64 x N, fp32) += A (64 x 16, shared, K-major) * V (16 x N, shared, MN-major: wgmma's transposed B).
template <int N>
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b) {
    static_assert(N == 256 || N == 128, "a consumer's 256 dims, or 128 with half rows");
    if constexpr (N == 256)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" PV256_LIST "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
            : PV256_OUTPUTS
            : "l"(desc_a), "l"(desc_b), "r"(1)
            : "memory");
    else
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" PV128_LIST "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
            : PV128_OUTPUTS
            : "l"(desc_a), "l"(desc_b), "r"(1)
            : "memory");
}

// O (64 x N, fp32) += A (64 x 16, registers: the m16n8k16 A fragment of the warp's 16 rows) *
// V (16 x N, shared, MN-major).
template <int N>
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b) {
    static_assert(N == 256 || N == 128, "a consumer's 256 dims, or 128 with half rows");
    if constexpr (N == 256)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" PV256_LIST "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
            : PV256_OUTPUTS
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
            : "memory");
    else
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" PV128_LIST "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : PV128_OUTPUTS
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
            : "memory");
}
