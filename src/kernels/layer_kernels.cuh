// Launchers of the layer's separate kernels: the barrier and weighted sum around the
// megakernels, the backward's router-weight gradient, and the unfused chains' dispatch, combine
// and SwiGLU backward (kept for comparison).
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

// Threads of a row-moving CTA: kRowMoverThreads when the kernel has the GPU to itself (a few
// waves of CTAs), up to kRowMoverMaxThreads when it runs beside a GEMM on a few SMs it leaves
// free (one big CTA per SM, so that the CTAs land on as many SMs as there are CTAs).
inline constexpr int kRowMoverThreads = 256;
inline constexpr int kRowMoverMaxThreads = 1024;

// Pull dispatch: routed_x[row] = x of row's (src_rank, token) read from src_rank's window.
// Rows at or past seg_offset[experts] are not touched, padding rows only with zero_padding_rows.
struct DispatchArgs {
  PeerWindows peers;
  size_t x_offset = 0;
  const sched::PullRow* table = nullptr;
  const int64_t* seg_offset = nullptr;  // device [experts + 1]
  int32_t experts = 0;
  int64_t hidden = 0;
  int32_t top_k = 0;
  __nv_bfloat16* routed_x = nullptr;  // [max_rows, H]
  // The backward's x rows: zero the padding rows (the weight-gradient GEMMs sum over them).
  bool zero_padding_rows = false;
};
// blocks x threads (a multiple of 32, at most kRowMoverMaxThreads): warp_row_copy.cuh.
cudaError_t launch_pull_dispatch(const DispatchArgs& args, int32_t blocks, cudaStream_t stream,
                                 int32_t threads = kRowMoverThreads);

// Push combine: expert output row -> the owner's combine slot (token * K + k) in its window.
struct CombineArgs {
  PeerWindows peers;
  size_t combine_offset = 0;
  const sched::PullRow* table = nullptr;
  const int64_t* seg_offset = nullptr;
  int32_t experts = 0;
  int64_t hidden = 0;
  const __nv_bfloat16* routed_y = nullptr;  // [max_rows, H]
};
cudaError_t launch_push_combine(const CombineArgs& args, int32_t blocks, cudaStream_t stream,
                                int32_t threads = kRowMoverThreads);

// Backward of the SwiGLU and of the router weight, routed row by routed row (a warp per row of
// the pull table). With w the owner's topk_weights[src_slot] (read from its window), g and u the
// gate/up outputs the forward kept and dhp = dy W_down (the down GEMM's input gradient before w):
//   h = silu(g) u, rounded to bf16 as the forward stored it; d w = <dhp, h>, written to the
//   owner's d_weights[src_slot] (its window); dh = w dhp; dg = dh u silu'(g); du = dh silu(g)
//   into dgu = [dg | du]; w h in place of dhp. NOTES: w h rather than dz = w dy, so that
//   dW_down = dzᵀ h = dyᵀ (w h) reads the dy rows as pulled: no pass over the [rows, H] dy.
// Padding rows of dgu and w h are zeroed: the weight-gradient GEMMs sum over them.
struct SwigluBackwardArgs {
  PeerWindows peers;
  size_t weights_offset = 0;    // WindowLayout::topk_weights
  size_t d_weights_offset = 0;  // WindowLayout::d_weights
  const sched::PullRow* table = nullptr;
  const int64_t* seg_offset = nullptr;  // device [experts + 1]
  int32_t experts = 0;
  int64_t intermediate = 0;
  const __nv_bfloat16* gate_up = nullptr;  // [max_rows, 2I]: g | u, as the forward kept them
  __nv_bfloat16* dhp_wh = nullptr;   // [max_rows, I]: dhp in, w h out
  __nv_bfloat16* dgu = nullptr;      // [max_rows, 2I] out
};
cudaError_t launch_swiglu_backward(const SwigluBackwardArgs& args, int32_t blocks,
                                   cudaStream_t stream);

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
// atomics, which compute-sanitizer memcheck showed this H200 machine lacks.
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
