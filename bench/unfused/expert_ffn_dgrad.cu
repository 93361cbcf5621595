// Input-gradient GEMM of the expert FFN's backward: out = rows W, W read N-major
// (expert_ffn.cuh, ExpertDgradArgs).
#include "unfused/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_dgrad(const ExpertDgradArgs& a, cudaStream_t stream) {
  const int64_t k0 = a.k0 == 0 ? a.k : a.k0;
  const bool split = k0 != a.k;
  const ExpertSegments& seg = a.segments;
  if (!seg.valid() || a.k <= 0 || a.k % 64 != 0 || a.n <= 0 || a.n % 64 != 0 || k0 < 0 ||
      k0 > a.k || k0 % 64 != 0)
    return cudaErrorInvalidValue;
  if (seg.empty()) return cudaSuccess;
  if (!seg.seg_offset || !a.rows || !a.w0 || (split && !a.w1) || !a.out)
    return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (a.max_ctas > 0 && a.max_ctas < sm_count) sm_count = a.max_ctas;
  constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
  CUtensorMap map_w0, map_w1;
  if (!gemm::encode_weight_map_n_major(a.w0, seg.experts, k0, a.n, &map_w0) ||
      (split && !gemm::encode_weight_map_n_major(a.w1, seg.experts, a.k - k0, a.n, &map_w1)))
    return cudaErrorInvalidValue;
  gemm::GemmParams p =
      gemm::GemmParams::of(seg.seg_offset, seg.expert_rows, seg.experts, a.n, a.k);
  p.b0_k_blocks = split ? static_cast<int32_t>(k0 / gemm::kBlockK) : 0;
  return gemm::launch_grouped_gemm<gemm::Epilogue::kStore, kStages, gemm::WeightMajor::kN>(
      a.rows, seg.max_rows, map_w0, split ? map_w1 : map_w0, a.out, p, sm_count, stream);
}

}  // namespace epflow::kernels
