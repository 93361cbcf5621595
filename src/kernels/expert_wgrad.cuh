// The backward's weight-gradient grouped GEMM over the expert-grouped routed rows (one kernel:
// expert_wgrad.cu), and the segments every grouped GEMM over those rows runs on.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tile.h"

namespace epflow::kernels {

// The expert-grouped rows the backward's GEMMs run over (the routing schedule's): segments
// seg_offset[e] .. seg_offset[e + 1] padded to kTileRows, buffers of max_rows rows.
struct ExpertSegments {
  int32_t experts = 0;
  int64_t max_rows = 0;                  // multiple of kTileRows
  const int64_t* seg_offset = nullptr;   // device [experts + 1]
  const int32_t* expert_rows = nullptr;  // optional, device [experts]: real rows per expert
  bool valid() const {
    return experts >= 0 && max_rows >= 0 && max_rows % kTileRows == 0;
  }
  bool empty() const { return experts == 0 || max_rows == 0; }
};

// The number of SMs of the current device (the persistent GEMMs' grid).
inline cudaError_t current_device_sm_count(int32_t* sm_count) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
}

// The backward's weight gradients: for every local expert e, dw[e] = lhs_eᵀ rhs_e summed over
// the expert's rows seg_offset[e] .. seg_offset[e + 1] (K = its rows, padded to the tile; the
// padding rows of lhs or rhs must be zero, as the layer leaves them). With expert_rows, K ends
// at the first multiple of 64 at or past the real rows: only those padding rows must be zero.
// The layer's: dW_down = dyᵀ (w h) (lhs = dy [rows, H], rhs = w h [rows, I], dw [E, H, I]); dW_gate = dgᵀ x and
// dW_up = duᵀ x (lhs = [dg | du] with lhs_ld 2I, dw [E, I, H]).
// Written in bf16 or fp32, or added to what dw holds (an expert without rows gets zeros, or
// adds nothing); the same order of additions on every run.
struct ExpertWgradArgs {
  ExpertSegments segments;              // expert_rows optional: K stops near the real rows
  int64_t m = 0, n = 0;                 // dw[e] is [m, n]; both multiples of 64
  const __nv_bfloat16* lhs = nullptr;   // [max_rows, lhs_ld], the first m columns used
  const __nv_bfloat16* rhs = nullptr;   // [max_rows, rhs_ld], the first n columns used
  int64_t lhs_ld = 0, rhs_ld = 0;       // row strides in elements (0: m, n); multiples of 8
  void* dw = nullptr;                   // [experts, m, n], bf16 or (fp32_out) float
  // Elements from dw[e] to dw[e + 1] (0: m * n; negative: experts laid out from the last to the
  // first); a 16-byte multiple.
  int64_t dw_expert_stride = 0;
  bool fp32_out = false;
  bool accumulate = false;              // dw += lhsᵀ rhs instead of dw = lhsᵀ rhs
  int32_t max_ctas = 0;  // 0: one CTA per SM; fewer leaves SMs to a kernel running beside it
};
cudaError_t launch_expert_wgrad(const ExpertWgradArgs& args, cudaStream_t stream);

// The weight gradients in FP8 (docs/design/fp8_backward.md): dw[e] = A_eᵀ B_e over expert e's
// rows with both operands transposed, contiguous along the rows, as launch_quantize_transposed
// writes them: a_t [m, fp8::packed_row_bytes(max_rows)] (k128x1: a scale per row of a_t per 128
// rows of the table), b_t [n, max_rows] e4m3 with b_scales [n / 128, max_rows / 128] (k128x128).
// K: the expert's rows (expert_rows if given, else its segment) rounded up to 128, whose padding
// must hold zeros. Output as ExpertWgradArgs' (m and n multiples of 128).
struct Fp8ExpertWgradArgs {
  ExpertSegments segments;
  int64_t m = 0, n = 0;
  const uint8_t* a_t = nullptr;
  const uint8_t* b_t = nullptr;
  const float* b_scales = nullptr;
  void* dw = nullptr;
  int64_t dw_expert_stride = 0;
  bool fp32_out = false;
  bool accumulate = false;
  int32_t max_ctas = 0;
};
cudaError_t launch_fp8_expert_wgrad(const Fp8ExpertWgradArgs& args, cudaStream_t stream);

}  // namespace epflow::kernels
