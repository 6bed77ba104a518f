// PTX wrappers every decode kernel may use, sm_80 on: shared addresses, asynchronous copies,
// named barriers, the mma.sync tensor-core product and its ldmatrix loads, and programmatic
// dependent launch. The Hopper-only ones are in nvfp4_mla_ptx_sm90.cuh.
#pragma once

// clang-format off: the inline assembly keeps its hand-laid PTX strings and operand tables.

#include "nvfp4_numerics.cuh"

__device__ __forceinline__ u32 shared_address(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// Starts a 16-byte global -> shared copy (cp.async, cached in L2 only); both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* shared_dst, const void* global_src) {
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
}

// Starts a 4- or 8-byte global -> shared copy (cp.async, cached in L1 and L2); both addresses aligned to it.
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void* shared_dst, const void* global_src) {
    static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(global_src), "n"(BYTES) : "memory");
}

// Waits for this thread's cp.async copies; other threads see them after a barrier (__syncwarp).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Waits at named barrier `id` with `count` threads (whole warps) that all reach it at the same
// instruction (bar.sync is barrier.sync.aligned).
__device__ __forceinline__ void named_barrier_aligned(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Waits at named barrier `id` with `count` threads (whole warps), which may reach it from
// different instructions (barrier.sync, not bar.sync).
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

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

// Programmatic dependent launch (sm_90 on; the host launches these kernels with it there, see
// launch.Launcher): a kernel's blocks may start while the stream's previous kernel still runs, so
// each thread waits for that kernel (its completion and its memory) before its first global
// access, read or write. Both are no-ops in a kernel launched without it, and below sm_90.
__device__ __forceinline__ void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the stream's next kernel launch before this one ends (it waits as above).
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// threadIdx.x read afresh (an opaque value to the compiler): what a loop body derives from it is
// computed in each pass, where it is used, instead of hoisted out of the loop and held in
// registers over every pass.
__device__ __forceinline__ int thread_index_in_pass() {
    u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return static_cast<int>(tid);
}
