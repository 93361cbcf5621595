// Gate/up GEMM of the expert FFN with SwiGLU in its epilogue: h = silu(x W_gate^T) * (x W_up^T).
#include "unfused/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& a, int32_t sm_count,
                                      cudaStream_t stream) {
  constexpr int kStages = 4;  // 4 x 48 KB of tiles in flight + 32 KB staging: 224 KB of 227
  CUtensorMap map_gate, map_up;
  constexpr uint32_t kHalf = kTileCols / 2;
  if (!gemm::encode_weight_map(a.w_gate, a.experts, a.intermediate, a.hidden, kHalf, &map_gate) ||
      !gemm::encode_weight_map(a.w_up, a.experts, a.intermediate, a.hidden, kHalf, &map_up))
    return cudaErrorInvalidValue;
  const gemm::GemmParams p = gemm::GemmParams::of(a.seg_offset, a.expert_rows, a.experts,
                                                  a.intermediate, a.hidden);
  return gemm::launch_grouped_gemm<gemm::Epilogue::kSwiGLU, kStages>(
      a.x, a.max_rows, map_gate, map_up, a.h, p, sm_count, stream);
}

}  // namespace epflow::kernels
