// Thin wrappers over TMA tile loads and shared-memory mbarriers (sm_90), on top of libcu++'s
// cuda::ptx, named for how the GEMM pipeline uses them.
#pragma once

#include <cuda.h>
#include <cuda/ptx>

#include <cstdint>

namespace epflow::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A float a TMA load wrote into shared memory; volatile with a memory clobber, so it stays after
// the mbarrier wait that made the data visible.
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  cuda::ptx::mbarrier_init(bar, arrivals);
}

// Makes initialised barriers visible to the async proxy (TMA) before anyone uses them.
__device__ __forceinline__ void mbarrier_init_fence() {
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
}

// Spins until the barrier's phase of the given parity has completed. A freshly initialised
// barrier counts its (never run) previous phase, parity 1, as complete.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  cuda::ptx::mbarrier_arrive(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                             cuda::ptx::space_shared, bar);
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                       cuda::ptx::space_shared, bar, bytes);
}

// Tile loads: coordinates innermost first, in elements; completion counted on `bar` in bytes.
__device__ __forceinline__ void tma_load_1d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                           uint64_t* bar) {
  const int32_t coords[1] = {c0};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_shared, cuda::ptx::space_global, smem_dst, map,
                                  coords, bar);
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                           int32_t c1, uint64_t* bar) {
  const int32_t coords[2] = {c0, c1};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_shared, cuda::ptx::space_global, smem_dst, map,
                                  coords, bar);
}

__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                           int32_t c1, int32_t c2, uint64_t* bar) {
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_shared, cuda::ptx::space_global, smem_dst, map,
                                  coords, bar);
}

// Tile store from shared memory (bulk-group completion); rows/columns past the tensor are clipped.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src,
                                            int32_t c0, int32_t c1) {
  const int32_t coords[2] = {c0, c1};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords,
                                  smem_src);
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* smem_src,
                                            int32_t c0, int32_t c1, int32_t c2) {
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords,
                                  smem_src);
}
// Tile reduction into global memory: each element of the box is added to what the tensor holds
// (in its type: bf16 or fp32), out-of-range elements clipped; bulk-group completion like a store.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* smem_src,
                                                 int32_t c0, int32_t c1, int32_t c2) {
  const int32_t coords[3] = {c0, c1, c2};
  cuda::ptx::cp_reduce_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared,
                                         cuda::ptx::op_add, map, coords, smem_src);
}
__device__ __forceinline__ void tma_store_commit() { cuda::ptx::cp_async_bulk_commit_group(); }
// Waits until the committed stores have finished reading shared memory (it may be rewritten).
__device__ __forceinline__ void tma_store_wait_read() {
  cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
}
// Waits until the committed stores are complete (before the CTA exits).
__device__ __forceinline__ void tma_store_wait_all() {
  cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
}
// Bulk (non-tensor) copies of `bytes` contiguous bytes (multiple of 16, 16-byte aligned ends):
// global (local HBM or a peer's NVLink-mapped memory) into shared memory, completion counted on
// `bar` in bytes; and shared memory into global memory, completion by bulk group (commit/wait as
// for tile stores).
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, smem_dst, src, bytes,
                           bar);
}
__device__ __forceinline__ void bulk_store(void* dst, const void* smem_src, uint32_t bytes) {
  cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, dst, smem_src, bytes);
}
// Waits until at most `pending` committed bulk groups still read shared memory.
template <int pending>
__device__ __forceinline__ void bulk_wait_read() {
  cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<pending>{});
}
// Makes this thread's ordinary shared-memory writes visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_shared_to_async_proxy() {
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
}
// Barrier over `threads` threads (multiple of 32) on hardware barrier `id` (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at hardware barrier `id` (of `threads` in all) without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Brings the 128-byte line holding p into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Register budget per warpgroup (only honoured under __launch_bounds__(threads, 1)).
template <uint32_t regs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(regs));
}
template <uint32_t regs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(regs));
}

}  // namespace epflow::ptx
