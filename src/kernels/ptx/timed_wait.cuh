// Time budget of spin-waits on other SMs or GPUs: the %globaltimer clock (ns), so every wait can
// give up with a message naming who waited for what instead of hanging.
#pragma once

#include <cuda/atomic>

#include <cstdint>

namespace epflow::ptx {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until counter >= target (acquire, device scope) and returns true, or returns false once
// timeout_ns have passed (the caller reports and traps). `seen` gets the last value read.
__device__ __forceinline__ bool wait_counter_at_least(const uint32_t* counter, uint32_t target,
                                                      int64_t timeout_ns, uint32_t* seen) {
  cuda::atomic_ref<const uint32_t, cuda::thread_scope_device> c(*counter);
  if ((*seen = c.load(cuda::memory_order_acquire)) >= target) return true;
  const uint64_t start = global_timer_ns();
  while ((*seen = c.load(cuda::memory_order_acquire)) < target) {
    if (global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) return false;
    __nanosleep(32);
  }
  return true;
}

// Adds one to counter with release semantics at device scope.
__device__ __forceinline__ void signal_counter(uint32_t* counter) {
  cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(*counter).fetch_add(
      1, cuda::memory_order_release);
}

}  // namespace epflow::ptx
