// Gate/up GEMM of the expert FFN with SwiGLU in its epilogue: h = silu(x W_gate^T) * (x W_up^T).
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& a, int32_t sm_count,
                                      cudaStream_t stream) {
  constexpr int kStages = 4;  // 4 x 48 KB of tiles in flight + 32 KB staging: 224 KB of 227
  // gate and up [E, I, H] as 3-D maps, so a tile past I reads zeros, never the next expert.
  CUtensorMap map_gate, map_up;
  const uint64_t w_dims[3] = {uint64_t(a.hidden), uint64_t(a.intermediate), uint64_t(a.experts)};
  const uint32_t w_box[3] = {gemm::kBlockK, gemm::kBlockNMma / 2, 1};
  if (!encode_bf16_tensor_map(&map_gate, a.w_gate, 3, w_dims, w_box).ok() ||
      !encode_bf16_tensor_map(&map_up, a.w_up, 3, w_dims, w_box).ok())
    return cudaErrorInvalidValue;
  gemm::GemmParams p;
  p.seg_offset = a.seg_offset;
  p.expert_rows = a.expert_rows;
  p.experts = a.experts;
  p.n_out = static_cast<int32_t>(a.intermediate);
  p.k = static_cast<int32_t>(a.hidden);
  return gemm::launch_grouped_gemm<gemm::Epilogue::kSwiGLU, kStages>(
      a.x, a.max_rows, map_gate, map_up, a.h, p, sm_count, stream);
}

}  // namespace epflow::kernels
