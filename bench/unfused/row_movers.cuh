// The unfused chains' row movers (a warp per routed row): pull dispatch, push combine and the
// SwiGLU backward as separate kernels over buffers of every routable row. Kept beside the
// library, built with the benchmark, only to compare the megakernels against.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/routing_schedule.h"
#include "kernels/layer_kernels.cuh"

namespace epflow::kernels {

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

}  // namespace epflow::kernels
