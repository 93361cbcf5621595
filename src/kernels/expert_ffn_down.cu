// Down GEMM of the expert FFN: y = h W_down^T.
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& a, int32_t sm_count,
                                   cudaStream_t stream) {
  constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
  CUtensorMap map_down;  // [E, H, I]
  if (!gemm::encode_weight_map(a.w_down, a.experts, a.hidden, a.intermediate, gemm::kBlockNMma,
                               &map_down))
    return cudaErrorInvalidValue;
  gemm::GemmParams p;
  p.seg_offset = a.seg_offset;
  p.expert_rows = a.expert_rows;
  p.experts = a.experts;
  p.n_out = static_cast<int32_t>(a.hidden);
  p.k = static_cast<int32_t>(a.intermediate);
  return gemm::launch_grouped_gemm<gemm::Epilogue::kStore, kStages>(
      a.h, a.max_rows, map_down, map_down, a.y, p, sm_count, stream);
}

}  // namespace epflow::kernels
