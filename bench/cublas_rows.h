// The one dense cuBLAS GEMM the benchmarks need, in the layer's row-major terms:
// out[rows, N] (leading dim ld_out) = in[rows, K] (ld_in) * W[N, K]^T (nn.Linear layout), bf16 in
// and out, fp32 accumulation. cuBLAS is column-major, so this is out^T = W^T(op T) * in^T.
// Sizes must fit in int (the callers check their shapes).
#pragma once

#include <cublas_v2.h>

#include <cstdint>

namespace epflow::bench {

inline cublasStatus_t gemm_rows_wt(cublasHandle_t h, int64_t rows, int64_t N, int64_t K,
                                   const void* in, int64_t ld_in, const void* w, void* out,
                                   int64_t ld_out) {
  const float one = 1.0f, zero = 0.0f;
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(rows),
                      static_cast<int>(K), &one, w, CUDA_R_16BF, static_cast<int>(K), in,
                      CUDA_R_16BF, static_cast<int>(ld_in), &zero, out, CUDA_R_16BF,
                      static_cast<int>(ld_out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace epflow::bench
