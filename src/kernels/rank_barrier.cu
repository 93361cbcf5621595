#include <cuda/atomic>

#include <cstdio>

#include "kernels/layer_kernels.cuh"
#include "kernels/ptx/timed_wait.cuh"

namespace epflow::kernels {

namespace {

__device__ const char* phase_name(BarrierPhase p) {
  return p == BarrierPhase::kDispatch ? "dispatch (before pulling tokens)"
                                      : "combine (after pushing results)";
}

// NOTES: one thread per peer; each signals "I reached epoch e" into the peer's window, then
// waits until the peer's signal for e lands in its own window. Epochs only grow (a local counter
// advanced by every launch), so the flags never need resetting and graph replays stay valid.
__global__ void rank_barrier_kernel(BarrierArgs a) {
  const int peer = threadIdx.x;
  char* mine = a.peers.base[a.rank];
  if (a.tokens_out && peer == 0)
    *reinterpret_cast<int64_t*>(mine + a.layout.tokens) = a.my_tokens;
  const uint64_t e = *a.epoch + 1;
  __syncthreads();
  if (peer < a.world) {
    // Everything this rank wrote before (earlier kernels, the copies into the window, T above)
    // becomes visible to the peer before the flag does.
    __threadfence_system();
    auto* peer_flag = reinterpret_cast<uint64_t*>(a.peers.base[peer] + a.layout.flags) + a.rank;
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*peer_flag).store(
        e, cuda::memory_order_release);

    auto* my_flag = reinterpret_cast<uint64_t*>(mine + a.layout.flags) + peer;
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> flag(*my_flag);
    ptx::WaitClock clock;
    uint64_t seen;
    while ((seen = flag.load(cuda::memory_order_acquire)) < e) {
      if (clock.expired(a.timeout_ns)) {
        BarrierTimeout* r = a.timeout_report;
        if (r && atomicCAS_system(&r->claimed, 0u, 1u) == 0u) {
          r->rank = a.rank;
          r->peer = peer;
          r->phase = static_cast<int32_t>(a.phase);
          r->epoch = e;
          r->seen = seen;
          r->seconds = a.timeout_ns * 1e-9;
          __threadfence_system();
          atomicExch_system(&r->set, 1u);
        }
        printf("EPFlow: rank %d timed out after %.3f s in the %s barrier, epoch %llu: rank %d "
               "never arrived (its last epoch here: %llu)\n",
               a.rank, a.timeout_ns * 1e-9, phase_name(a.phase),
               static_cast<unsigned long long>(e), peer, static_cast<unsigned long long>(seen));
        __trap();
      }
      __nanosleep(64);
    }
    if (a.tokens_out)
      a.tokens_out[peer] = *reinterpret_cast<const volatile int64_t*>(a.peers.base[peer] +
                                                                      a.layout.tokens);
  }
  __syncthreads();
  if (peer == 0) *a.epoch = e;
}

}  // namespace

cudaError_t launch_rank_barrier(const BarrierArgs& args, cudaStream_t stream) {
  static_assert(kMaxPeers <= 128, "one thread per peer");
  rank_barrier_kernel<<<1, 128, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
