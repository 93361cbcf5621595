// Expert FFN over the expert-grouped routed rows: gate/up GEMM with SwiGLU in its epilogue, then
// the down GEMM, both on the persistent wgmma + TMA grouped GEMM of grouped_gemm.cuh.
//
// Rows of local expert e are [seg_offset[e], seg_offset[e+1]), each segment padded to a multiple
// of kTileRows (so no M tile spans two experts). seg_offset lives on the device (no host
// sync): the grid is sized for max_rows and tiles past seg_offset[experts] exit at once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tile.h"
#include "kernels/expert_wgrad.cuh"

namespace epflow::kernels {

struct ExpertFfnArgs {
  int32_t experts = 0;          // E_local
  int64_t hidden = 0;           // H, multiple of 64
  int64_t intermediate = 0;     // I, multiple of 64
  int64_t max_rows = 0;         // rows the buffers hold (multiple of kTileRows)
  const int64_t* seg_offset = nullptr;  // device [experts + 1]
  // Optional, device [experts]: real (unpadded) rows of each expert. Where given, a warpgroup
  // whose 64 rows of a tile are all padding skips its MMAs and stores, and those rows of h and
  // y are left unwritten (no consumer reads them); halves the tensor work of decode-size batches.
  const int32_t* expert_rows = nullptr;
  const __nv_bfloat16* x = nullptr;       // [max_rows, H]
  const __nv_bfloat16* w_gate = nullptr;  // [experts, I, H]
  const __nv_bfloat16* w_up = nullptr;    // [experts, I, H]
  const __nv_bfloat16* w_down = nullptr;  // [experts, H, I]
  __nv_bfloat16* h = nullptr;             // [max_rows, I] out: silu(x W_gate^T) * (x W_up^T)
  __nv_bfloat16* y = nullptr;             // [max_rows, H] out: h W_down^T
};

// h then y, stream-ordered. Rows at or past seg_offset[experts] are not touched.
cudaError_t launch_expert_ffn(const ExpertFfnArgs& args, cudaStream_t stream);

// The backward's input gradients through one of the FFN's weights, on the same grouped rows:
// out = rows W with W read N-major (wgmma's transposed B: no transposed copy of the weights).
// The down GEMM's dh = dz W_down ([rows, H] x [H, I]: k = H, n = I, w0 = W_down) and the gate/up
// GEMM's dx = [dg | du] [W_gate; W_up] ([rows, 2I] x [2I, H]: k = 2I, k0 = I, w0 = W_gate,
// w1 = W_up, n = H). Rows at or past seg_offset[experts] are not touched; with expert_rows, rows
// of a tile that are all padding are left unwritten, as in the forward.
struct ExpertDgradArgs {
  ExpertSegments segments;
  int64_t k = 0;                        // columns of `rows`, multiple of 64
  int64_t n = 0;                        // output columns, multiple of 64
  int64_t k0 = 0;                       // K served by w0 (multiple of 64); 0 or k: all of it
  const __nv_bfloat16* rows = nullptr;  // [max_rows, k]
  const __nv_bfloat16* w0 = nullptr;    // [experts, k0, n]
  const __nv_bfloat16* w1 = nullptr;    // [experts, k - k0, n]; unused when k0 is 0 or k
  __nv_bfloat16* out = nullptr;         // [max_rows, n]
  int32_t max_ctas = 0;  // 0: one CTA per SM; fewer leaves SMs to a kernel running beside it
};
cudaError_t launch_expert_dgrad(const ExpertDgradArgs& args, cudaStream_t stream);

// The two halves (one kernel per file), on a device with sm_count SMs.
cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& args, int32_t sm_count,
                                      cudaStream_t stream);
cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& args, int32_t sm_count,
                                   cudaStream_t stream);

}  // namespace epflow::kernels
