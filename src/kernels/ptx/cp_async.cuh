// Thin inline-PTX wrappers for cp.async (sm_80+): asynchronous 16-byte global -> shared copies
// that bypass the register file, grouped so a multi-stage pipeline can wait for the oldest stage.
#pragma once

#include <cstdint>

namespace epflow::ptx {

// Shared-state-space address of a pointer into shared memory (what cp.async, ldmatrix take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global `src` to shared `dst_smem` (16-byte aligned both). .cg caches in
// L2 only: the tile is staged in shared memory, so L1 would hold a useless second copy.
// With valid == false nothing is read (src-size 0) and the 16 bytes are zero-filled; src must
// still be a mapped address, so callers pass a clamped in-bounds pointer.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst_smem, const void* src, bool valid) {
  const uint32_t src_bytes = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem),
               "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
               : "memory");
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `Pending` of this thread's committed groups are still in flight. Other
// threads' copies become visible only after a following barrier (__syncthreads).
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

}  // namespace epflow::ptx
