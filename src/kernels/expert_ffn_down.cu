// The FFN's plain GEMM, out = rows Wᵀ (no epilogue): the forward's down GEMM y = h W_downᵀ, and
// the backward's recomputed g = x W_gateᵀ, u = x W_upᵀ (expert_ffn.cuh, ExpertLinearArgs).
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {

cudaError_t linear(const ExpertLinearArgs& a, int32_t sm_count, cudaStream_t stream) {
  constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
  CUtensorMap map_w;  // [E, n, k]
  const ExpertSegments& seg = a.segments;
  if (!gemm::encode_weight_map(a.w, seg.experts, a.n, a.k, gemm::kBlockNMma, &map_w))
    return cudaErrorInvalidValue;
  const gemm::GemmParams p =
      gemm::GemmParams::of(seg.seg_offset, seg.expert_rows, seg.experts, a.n, a.k);
  return gemm::launch_grouped_gemm<gemm::Epilogue::kStore, kStages>(a.rows, seg.max_rows, map_w,
                                                                    map_w, a.out, p, sm_count,
                                                                    stream);
}

}  // namespace

cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& a, int32_t sm_count,
                                   cudaStream_t stream) {
  ExpertLinearArgs l;
  l.segments = ExpertSegments{a.experts, a.max_rows, a.seg_offset, a.expert_rows};
  l.k = a.intermediate;
  l.n = a.hidden;
  l.rows = a.h;
  l.w = a.w_down;
  l.out = a.y;
  return linear(l, sm_count, stream);
}

cudaError_t launch_expert_linear(const ExpertLinearArgs& a, cudaStream_t stream) {
  if (!a.segments.valid() || a.k <= 0 || a.k % 64 != 0 || a.n <= 0 || a.n % 64 != 0)
    return cudaErrorInvalidValue;
  if (a.segments.empty()) return cudaSuccess;
  if (!a.segments.seg_offset || !a.rows || !a.w || !a.out) return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  return linear(a, sm_count, stream);
}

}  // namespace epflow::kernels
