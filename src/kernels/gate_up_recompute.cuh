// The backward's g | u of the routed rows a SavedContext does not keep (the pull table's rows
// from LayerConfig::saved_gate_up_rows on): their x rows gathered from their owners' windows
// (row_gather.cu), then [g | u] = x [W_gate; W_up]ᵀ for those rows (gate_up_recompute.cu) with
// the forward's tiles and K order, so the values are those the forward would have kept. Both
// launch over the table's capacity and read the call's row count on the device: no host sync.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/routing_schedule.h"
#include "kernels/layer_kernels.cuh"

namespace epflow::kernels {

// x rows of the pull table's rows first_row .. (the call's routed rows) into rows[r] (padding
// rows zero).
struct RowGatherArgs {
  PeerWindows peers;
  size_t src_offset = 0;  // window offset of the rows (x [T, H])
  int32_t top_k = 0;
  const sched::PullRow* table = nullptr;
  const int64_t* seg_offset = nullptr;  // device [experts + 1]: the call's rows end at [experts]
  int32_t experts = 0;
  int64_t hidden = 0;
  int64_t first_row = 0;
  int64_t max_rows = 0;  // the table's capacity (rows' rows)
  __nv_bfloat16* rows = nullptr;  // [max_rows, H]
};
cudaError_t launch_row_gather(const RowGatherArgs& args, int32_t sm_count, cudaStream_t stream);

// out[r - first_row] = [x_r W_gateᵀ | x_r W_upᵀ] (bf16, [max_rows - first_row, 2I]) for the
// call's rows r >= first_row, x_r = rows[r]; first_row a multiple of the tile height.
struct GateUpRecomputeArgs {
  const int64_t* seg_offset = nullptr;   // device [experts + 1]
  const int32_t* expert_rows = nullptr;  // device [experts]
  int32_t experts = 0;
  int64_t hidden = 0, intermediate = 0;
  int64_t first_row = 0, max_rows = 0;
  const __nv_bfloat16* rows = nullptr;    // [max_rows, H]
  const __nv_bfloat16* w_gate = nullptr;  // [experts, I, H]
  const __nv_bfloat16* w_up = nullptr;    // [experts, I, H]
  // Elements from one expert's matrix to the next one's (0: densely packed; negative: experts
  // laid out from the last to the first).
  int64_t w_gate_stride = 0, w_up_stride = 0;
  __nv_bfloat16* out = nullptr;           // [max_rows - first_row, 2I]
};
cudaError_t launch_gate_up_recompute(const GateUpRecomputeArgs& args, int32_t sm_count,
                                     cudaStream_t stream);

}  // namespace epflow::kernels
