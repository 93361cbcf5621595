// Gate/up GEMM of the expert FFN with SwiGLU in its epilogue: h = silu(x W_gate^T) * (x W_up^T).
#include "host/tensor_map.h"
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {
constexpr int kStages = 4;  // 4 x 48 KB of tiles in flight + 32 KB staging: 224 KB of 227
constexpr auto kEpi = gemm::Epilogue::kSwiGLU;
}  // namespace

cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& a, int32_t sm_count,
                                      cudaStream_t stream) {
  CUtensorMap map_x, map_x_rows, map_gate, map_up, map_h;
  const uint64_t x_dims[2] = {uint64_t(a.hidden), uint64_t(a.max_rows)};
  const uint32_t x_box[2] = {gemm::kBlockK, gemm::kBlockM};
  const uint64_t w_dims[3] = {uint64_t(a.hidden), uint64_t(a.intermediate), uint64_t(a.experts)};
  const uint32_t w_box[3] = {gemm::kBlockK, gemm::kBlockNMma / 2, 1};
  const uint64_t h_dims[2] = {uint64_t(a.intermediate), uint64_t(a.max_rows)};
  const uint32_t out_box[2] = {64, 64};
  const uint32_t x_rows_box[2] = {gemm::kBlockK, gemm::kRowBoxM};
  if (!encode_bf16_tensor_map(&map_x, a.x, 2, x_dims, x_box).ok() ||
      !encode_bf16_tensor_map(&map_x_rows, a.x, 2, x_dims, x_rows_box).ok() ||
      !encode_bf16_tensor_map(&map_gate, a.w_gate, 3, w_dims, w_box).ok() ||
      !encode_bf16_tensor_map(&map_up, a.w_up, 3, w_dims, w_box).ok() ||
      !encode_bf16_tensor_map(&map_h, a.h, 2, h_dims, out_box).ok())
    return cudaErrorInvalidValue;
  gemm::GemmParams p;
  p.seg_offset = a.seg_offset;
  p.expert_rows = a.expert_rows;
  p.experts = a.experts;
  p.n_out = static_cast<int32_t>(a.intermediate);
  p.k = static_cast<int32_t>(a.hidden);
  const int64_t max_tiles = a.max_rows / gemm::kBlockM *
                            ((a.intermediate + gemm::kOutCols<kEpi> - 1) / gemm::kOutCols<kEpi>);
  const int grid = static_cast<int>(max_tiles < sm_count ? max_tiles : sm_count);
  auto* kernel = gemm::grouped_gemm_kernel<kEpi, kStages>;
  constexpr size_t smem = gemm::shared_bytes<kEpi, kStages>();
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, gemm::kThreads, smem, stream>>>(map_x, map_x_rows, map_gate, map_up, map_h, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
