// Expert FFN over the expert-grouped routed rows: gate/up GEMM with SwiGLU in its epilogue, then
// the down GEMM, both on the persistent wgmma + TMA grouped GEMM of grouped_gemm.cuh.
//
// Rows of local expert e are [seg_offset[e], seg_offset[e+1]), each segment padded to a multiple
// of kExpertFfnTileM (so no M tile spans two experts). seg_offset lives on the device (no host
// sync): the grid is sized for max_rows and tiles past seg_offset[experts] exit at once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace epflow::kernels {

inline constexpr int kExpertFfnTileM = 128;

struct ExpertFfnArgs {
  int32_t experts = 0;          // E_local
  int64_t hidden = 0;           // H, multiple of 64
  int64_t intermediate = 0;     // I, multiple of 64
  int64_t max_rows = 0;         // rows the buffers hold (multiple of kExpertFfnTileM)
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

// The two halves (one kernel per file), on a device with sm_count SMs.
cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& args, int32_t sm_count,
                                      cudaStream_t stream);
cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& args, int32_t sm_count,
                                   cudaStream_t stream);

}  // namespace epflow::kernels
