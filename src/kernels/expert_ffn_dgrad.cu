// Input-gradient GEMM of the expert FFN's backward: out = rows W, W read N-major
// (expert_ffn.cuh, ExpertDgradArgs).
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_dgrad(const ExpertDgradArgs& a, cudaStream_t stream) {
  const int64_t k0 = a.k0 == 0 ? a.k : a.k0;
  const bool split = k0 != a.k;
  if (a.experts < 0 || a.max_rows < 0 || a.max_rows % kExpertFfnTileM != 0 || a.k <= 0 ||
      a.k % 64 != 0 || a.n <= 0 || a.n % 64 != 0 || k0 < 0 || k0 > a.k || k0 % 64 != 0)
    return cudaErrorInvalidValue;
  if (a.experts == 0 || a.max_rows == 0) return cudaSuccess;
  if (!a.seg_offset || !a.rows || !a.w0 || (split && !a.w1) || !a.out)
    return cudaErrorInvalidValue;
  int device = 0, sm_count = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess)
    return e;
  constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
  CUtensorMap map_w0, map_w1;
  if (!gemm::encode_weight_map_n_major(a.w0, a.experts, k0, a.n, &map_w0) ||
      (split && !gemm::encode_weight_map_n_major(a.w1, a.experts, a.k - k0, a.n, &map_w1)))
    return cudaErrorInvalidValue;
  gemm::GemmParams p;
  p.seg_offset = a.seg_offset;
  p.expert_rows = a.expert_rows;
  p.experts = a.experts;
  p.n_out = static_cast<int32_t>(a.n);
  p.k = static_cast<int32_t>(a.k);
  p.b0_k_blocks = split ? static_cast<int32_t>(k0 / gemm::kBlockK) : 0;
  return gemm::launch_grouped_gemm<gemm::Epilogue::kStore, kStages, gemm::WeightMajor::kN>(
      a.rows, a.max_rows, map_w0, split ? map_w1 : map_w0, a.out, p, sm_count, stream);
}

}  // namespace epflow::kernels
