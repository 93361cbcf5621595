// Block-scaled FP8 grouped GEMM over expert-grouped rows, standalone (tests and benchmarks of the
// mainloop the FP8 megakernel runs, grouped_gemm.cuh): for every expert e's rows r
// (ExpertSegments), out[r, :] = sum over 128-deep K blocks kb of (a[r, kb] · w[e, :, kb]ᵀ) *
// a_scales[r, kb] * w_scales[e, n / 128, kb], bf16 out. The DeepSeek-V3 recipe: a in 1 x 128
// blocks, w in 128 x 128 (src/common/fp8_blocks.h); each block's products are summed by the
// tensor cores and promoted into fp32 accumulators with the two scales (Hopper's FP8 MMA keeps
// too few accumulator bits for a whole K).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/expert_wgrad.cuh"

namespace epflow::kernels {

struct Fp8GroupedGemmArgs {
  ExpertSegments segments;           // expert_rows unused: whole tiles are computed
  int64_t n = 0, k = 0;              // multiples of 128; k at most 128 * fp8::kMaxKBlocks
  const uint8_t* a = nullptr;        // [segments.max_rows, k] e4m3
  const float* a_scales = nullptr;   // [segments.max_rows, a_scale_stride], 16-byte aligned
  int64_t a_scale_stride = 0;        // floats per row: a multiple of 4 (rows TMA loads are
                                     // 16-byte aligned), >= k / 128; 0: the smallest such
  const uint8_t* w = nullptr;        // [experts, n, k] e4m3 (nn.Linear layout)
  const float* w_scales = nullptr;   // [experts, n / 128, k / 128], 16-byte aligned
  __nv_bfloat16* out = nullptr;      // [segments.max_rows, n]
  int32_t max_ctas = 0;              // 0: one CTA per SM
};
cudaError_t launch_fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace epflow::kernels
