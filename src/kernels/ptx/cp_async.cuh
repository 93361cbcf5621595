// Thin wrappers over per-thread asynchronous copies into shared memory (cp.async, sm_80+): a
// thread's 16-byte copies, committed in groups it later waits for. Completion is per thread: a
// barrier after the wait makes the data visible to the others.
#pragma once

#include <cstdint>

namespace epflow::ptx {

// 16 bytes from global memory into shared memory, cached in L2 only (.cg).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_dst), "l"(src) : "memory");
}

// Closes the thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most `pending` of the thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}

}  // namespace epflow::ptx
