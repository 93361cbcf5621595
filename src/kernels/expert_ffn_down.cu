// Down GEMM of the expert FFN: y = h W_down^T.
#include "host/tensor_map.h"
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {
constexpr int kStages = 3;  // + 64 KB of output staging: 208 KB of 227
constexpr auto kEpi = gemm::Epilogue::kStore;
}  // namespace

cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& a, int32_t sm_count,
                                   cudaStream_t stream) {
  CUtensorMap map_h, map_h_rows, map_down, map_y;
  const uint64_t h_dims[2] = {uint64_t(a.intermediate), uint64_t(a.max_rows)};
  const uint32_t h_box[2] = {gemm::kBlockK, gemm::kBlockM};
  const uint64_t w_dims[3] = {uint64_t(a.intermediate), uint64_t(a.hidden), uint64_t(a.experts)};
  const uint32_t w_box[3] = {gemm::kBlockK, gemm::kBlockNMma, 1};
  const uint64_t y_dims[2] = {uint64_t(a.hidden), uint64_t(a.max_rows)};
  const uint32_t out_box[2] = {64, 64};
  const uint32_t h_rows_box[2] = {gemm::kBlockK, gemm::kRowBoxM};
  if (!encode_bf16_tensor_map(&map_h, a.h, 2, h_dims, h_box).ok() ||
      !encode_bf16_tensor_map(&map_h_rows, a.h, 2, h_dims, h_rows_box).ok() ||
      !encode_bf16_tensor_map(&map_down, a.w_down, 3, w_dims, w_box).ok() ||
      !encode_bf16_tensor_map(&map_y, a.y, 2, y_dims, out_box).ok())
    return cudaErrorInvalidValue;
  gemm::GemmParams p;
  p.seg_offset = a.seg_offset;
  p.expert_rows = a.expert_rows;
  p.experts = a.experts;
  p.n_out = static_cast<int32_t>(a.hidden);
  p.k = static_cast<int32_t>(a.intermediate);
  const int64_t max_tiles = a.max_rows / gemm::kBlockM *
                            ((a.hidden + gemm::kOutCols<kEpi> - 1) / gemm::kOutCols<kEpi>);
  const int grid = static_cast<int>(max_tiles < sm_count ? max_tiles : sm_count);
  auto* kernel = gemm::grouped_gemm_kernel<kEpi, kStages>;
  constexpr size_t smem = gemm::shared_bytes<kEpi, kStages>();
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, gemm::kThreads, smem, stream>>>(map_h, map_h_rows, map_down, map_down, map_y, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
