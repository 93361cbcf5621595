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

// Time a spin-wait has spent, immune to steps of %globaltimer. NOTES: %globaltimer follows the
// host's clock and is not guaranteed monotonic: stepped backwards, `now - start` would wrap to a
// huge value and a healthy wait "time out" at once; forwards, it would count time nobody waited.
// Each poll adds its own step, a negative step counting 0 and a step over kMaxStepNs counting
// kMaxStepNs (a real poll step is a few microseconds), so a wait gives up after at least its
// timeout of real time.
class WaitClock {
 public:
  static constexpr int64_t kMaxStepNs = 1000000;
  __device__ WaitClock() : last_(global_timer_ns()) {}
  // Adds the time since the last call; true once more than timeout_ns have been counted.
  __device__ bool expired(int64_t timeout_ns) {
    const uint64_t now = global_timer_ns();
    const int64_t step = static_cast<int64_t>(now - last_);
    last_ = now;
    waited_ += step <= 0 ? 0 : (step > kMaxStepNs ? kMaxStepNs : step);
    return waited_ > timeout_ns;
  }

 private:
  uint64_t last_;
  int64_t waited_ = 0;
};

// Spins until counter >= target (acquire, device scope) and returns true, or returns false once
// timeout_ns have passed (the caller reports and traps). `seen` gets the last value read.
__device__ __forceinline__ bool wait_counter_at_least(const uint32_t* counter, uint32_t target,
                                                      int64_t timeout_ns, uint32_t* seen) {
  cuda::atomic_ref<const uint32_t, cuda::thread_scope_device> c(*counter);
  if ((*seen = c.load(cuda::memory_order_acquire)) >= target) return true;
  WaitClock clock;
  while ((*seen = c.load(cuda::memory_order_acquire)) < target) {
    if (clock.expired(timeout_ns)) return false;
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
