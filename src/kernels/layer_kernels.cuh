// Launchers of the layer's kernels around the megakernels: the barrier between the ranks, the
// weighted sum, the backward's router-weight gradient; the symmetric window's layout.
// One kernel per file, all stream-ordered; none synchronises with the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/routing_schedule.h"

namespace epflow::kernels {

// The most ranks a window is shared by (epflow::Limits::kMaxEpSize, one NVL72 domain).
inline constexpr int kMaxPeers = 72;

// Every rank's copy of the layer's symmetric window, as this GPU addresses it (NVLink-mapped).
struct PeerWindows {
  char* base[kMaxPeers] = {};
};

// Where things sit inside the symmetric window (same offsets on every rank).
struct WindowLayout {
  size_t flags = 0;     // uint64_t[kMaxPeers]: flags[src] = last barrier epoch src signalled
  size_t tokens = 0;    // int64_t: this rank's T of the current call
  size_t topk_idx = 0;  // int32_t[T_max, K]
  size_t x = 0;         // bf16[T_max, H]: tokens the peers pull
  size_t combine = 0;   // bf16[T_max * K, H]: one slot per (token, k), pushed by expert owners
  // Backward: the router weights and dy the experts' GPUs pull, and d topk_weights they push
  // (one float per (token, k) slot; combine then holds the pushed dx rows).
  size_t topk_weights = 0;  // float[T_max, K]
  size_t dy = 0;            // bf16[T_max, H]
  size_t d_weights = 0;     // float[T_max, K]
  size_t bytes = 0;

  static WindowLayout make(int64_t max_tokens, int64_t hidden, int32_t top_k);
};

// Barrier over all ranks through flags in the symmetric windows, with a timeout that names the
// missing rank. If tokens_out is set, first publishes this rank's T and, once every rank has
// arrived, gathers all ranks' T into tokens_out[world].
enum class BarrierPhase : int32_t { kDispatch = 0, kCombine = 1 };
// Host-mapped: the first barrier wait of the layer that timed out (the kernel then traps, which
// the stream reports only as a launch failure). claimed: taken by the first timed-out thread;
// set: written last, once the other fields are.
struct BarrierTimeout {
  uint32_t claimed, set;
  int32_t rank, peer, phase;
  uint64_t epoch, seen;
  double seconds;
};
struct BarrierArgs {
  PeerWindows peers;
  WindowLayout layout;
  int32_t rank = 0;
  int32_t world = 1;
  uint64_t* epoch = nullptr;  // local device counter; advanced by every barrier launch
  int64_t timeout_ns = 0;
  BarrierPhase phase = BarrierPhase::kDispatch;
  int64_t my_tokens = 0;
  int64_t* tokens_out = nullptr;
  BarrierTimeout* timeout_report = nullptr;  // optional (device pointer of host-mapped memory)
};
cudaError_t launch_rank_barrier(const BarrierArgs& args, cudaStream_t stream);

// The backward megakernel's d topk_weights: for every routed row of the pull table, the sum of
// its n_tiles partial dot products <dhp, h> (dw_partial [rows, n_tiles], from the dhp tiles'
// epilogues) in tile order, written to the owner's d_weights[src_slot] (its window). A thread per
// row: fixed order, deterministic.
struct RouterWeightGradArgs {
  PeerWindows peers;
  size_t d_weights_offset = 0;  // WindowLayout::d_weights
  const sched::PullRow* table = nullptr;
  const int64_t* seg_offset = nullptr;  // device [experts + 1]
  int32_t experts = 0;
  const float* dw_partial = nullptr;
  int32_t n_tiles = 0;
  int64_t max_rows = 0;  // the grid covers this many rows
};
cudaError_t launch_router_weight_grad(const RouterWeightGradArgs& args, cudaStream_t stream);

// What the weighted sum found wrong in a call's topk_idx (host-mapped; the host reads and clears
// it): slots whose id is outside [-1, num_experts) (the schedule skipped them) or repeats an
// expert of an earlier slot of the same token (computed twice, as two slots). The first bad slot
// a thread counts (bad_slots 0 -> 1) fills token, k, id, duplicate and then sets published.
struct RoutingCheck {
  uint32_t bad_slots;
  uint32_t duplicated_slots;
  int64_t token;
  int32_t k, id, duplicate;
  uint32_t published;
};

// The check's running tally of one call, in device memory (zero before the first call; the
// call's last block copies it into the RoutingCheck and zeroes it again). NOTES: the counting
// atomics run here, not on the host-mapped record: atomics on host memory need the host's PCIe
// atomics, which not every host has (compute-sanitizer memcheck flags them where it lacks them).
struct RoutingTally {
  uint32_t bad_slots, duplicated_slots;
  int64_t token;
  int32_t k, id, duplicate;
  uint32_t blocks_done;
};

// y[t] = sum_k w[t,k] * combine[t*K + k], k ascending, fp32 sums, bf16 out; slots whose expert
// id is outside [0, num_experts) contribute nothing. Without topk_weights, w = 1 (the backward's
// dx, whose rows arrive already weighted). With check (and tally), the token's ids are checked
// too: the call's counts are added to check's and its first bad slot published there if check
// has none yet.
struct WeightedSumArgs {
  const __nv_bfloat16* combine = nullptr;  // local window [T * K, H]
  const int32_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int32_t top_k = 0;
  int32_t num_experts = 0;
  __nv_bfloat16* y = nullptr;
  RoutingCheck* check = nullptr;  // optional, host-mapped (device pointer)
  RoutingTally* tally = nullptr;  // with check: device memory
};
cudaError_t launch_weighted_sum(const WeightedSumArgs& args, cudaStream_t stream);

}  // namespace epflow::kernels
