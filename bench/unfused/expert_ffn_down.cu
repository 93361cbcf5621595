// The unfused forward's down GEMM, y = h W_downᵀ (no epilogue).
#include "unfused/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& a, int32_t sm_count,
                                   cudaStream_t stream) {
  constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
  CUtensorMap map_w;          // [E, H, I]
  if (!gemm::encode_weight_map(a.w_down, a.experts, a.hidden, a.intermediate, kTileCols,
                               &map_w))
    return cudaErrorInvalidValue;
  const gemm::GemmParams p =
      gemm::GemmParams::of(a.seg_offset, a.expert_rows, a.experts, a.hidden, a.intermediate);
  return gemm::launch_grouped_gemm<gemm::Epilogue::kStore, kStages>(a.h, a.max_rows, map_w, map_w,
                                                                    a.y, p, sm_count, stream);
}

}  // namespace epflow::kernels
