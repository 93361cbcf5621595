// The backward megakernel (moe_megakernel.cuh; docs/design/backward_megakernel.md): pull dy
// rows; dhp = dy W_down with the SwiGLU and router-weight backward in its epilogue (DhSink);
// dx = [dg | du] [W_gate; W_up] pushed into the owners' (token, k) slots (PushCombineSink); the
// communication CTAs also pull the x rows the weight gradients read. In bf16, or in FP8
// (MegakernelArgs::fp8: dy and x pulled as packed rows, block-scaled GEMMs on the transposed
// e4m3 weights, [dg | du] quantized in DhSink; dx pushed in bf16). This file holds the passes'
// traits, their weights' TMA maps and launch_backward_megakernel; the kernel is kernel.cuh's,
// shared with the forward.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/kernel.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/tensor_map.h"

namespace epflow::kernels {

namespace megakernel {
namespace {

// The backward's traits (kernel.cuh says what each means). Both GEMMs read their weights
// N-major (the forward's weights in dy W); the dx GEMM's K is [dg | du], 2I; the dx tiles may be
// listed n tile fastest (mega::down_n_fastest_suits); the weight gradients after the kernel
// read the ring's dy rows, padding rows included, and the pulled x rows.
struct BackwardPass {
  static constexpr bool kBackward = true;
  static constexpr gemm::Epilogue kGateUpEpilogue = gemm::Epilogue::kStore;
  static constexpr gemm::WeightMajor kWeights = gemm::WeightMajor::kN;
  static constexpr int kDownKParts = 2;
  static constexpr bool kDownNFastestWhenSuited = true;
  static constexpr bool kForWeightGradients = true;
  static constexpr gemm::Operands kOperands = gemm::Operands::kBF16;
};
// FP8 (docs/design/fp8_backward.md): packed dy rows against W_down^T, packed [dg | du] rows
// against [W_gate; W_up]^T (one K-major matrix, K = 2I), both with block scales; DhSink
// quantizes [dg | du] into the ring.
struct Fp8BackwardPass : BackwardPass {
  static constexpr gemm::WeightMajor kWeights = gemm::WeightMajor::kK;
  static constexpr gemm::Operands kOperands = gemm::Operands::kFP8;
};

// The FP8 pass's weight maps: W_down^T [E, I, H] (dhp: n = I, K = H) and gate_up_t [E, H, 2I]
// (dx: n = H, K = 2I), e4m3 in boxes of one 128-wide K block by the tile's 256 n rows, and
// their transposed block scales.
bool encode_fp8_backward_maps(const MegakernelArgs& a, Maps* m) {
  const uint64_t E = a.experts, H = a.hidden, I = a.intermediate;
  constexpr uint32_t kK = fp8::kBlock;
  const uint64_t down_t_dims[3] = {H, I, E}, gate_up_t_dims[3] = {2 * I, H, E};
  const uint32_t box[3] = {kK, kTileCols, 1};
  const bool ok =
      encode_ring_maps<Fp8BackwardPass>(a, m) &&
      encode_u8_tensor_map(&m->w1a, a.w_down_t_fp8, 3, down_t_dims, box).ok() &&
      encode_u8_tensor_map(&m->w2a, a.w_gate_up_t_fp8, 3, gate_up_t_dims, box).ok() &&
      encode_f32_vector_map(&m->w1a_scales, a.w_down_t_scales, E * I * H / (kK * kK),
                            gemm::fp8_weight_scale_box(int32_t(H / kK)))
          .ok() &&
      encode_f32_vector_map(&m->w2_scales, a.w_gate_up_t_scales, E * H * 2 * I / (kK * kK),
                            gemm::fp8_weight_scale_box(int32_t(2 * I / kK)))
          .ok();
  m->w1b = m->w1a;
  m->w1b_scales = m->w1a_scales;
  m->w2b = m->w2a;
  m->h_out = {};
  return ok;
}

}  // namespace
}  // namespace megakernel

cudaError_t launch_backward_megakernel(const MegakernelArgs& a, int32_t sm_count,
                                       cudaStream_t stream) {
  using megakernel::BackwardPass;
  if (!megakernel::valid_args(a, sm_count) || !a.gate_up_in || !a.wh_out || !a.dw_partial ||
      !a.x_out || a.gate_up_out)
    return cudaErrorInvalidValue;
  if (a.fp8) {
    megakernel::Maps m;
    if (!megakernel::fp8_shape_ok<megakernel::Fp8BackwardPass>(a) || !a.w_gate_up_t_fp8 ||
        !a.w_down_t_fp8 || !a.w_gate_up_t_scales || !a.w_down_t_scales ||
        !megakernel::encode_fp8_backward_maps(a, &m))
      return cudaErrorInvalidValue;
    return megakernel::launch<megakernel::Fp8BackwardPass>(m, a, sm_count, stream);
  }
  // w1a = w1b = W_down read N-major ([E, H, I] as k = H, n = I); w2a, w2b = W_gate, W_up read
  // N-major (k = I each: the dx GEMM's K is [dg | du]); h_out unused.
  megakernel::Maps m;
  const int64_t E = a.experts, H = a.hidden, I = a.intermediate;
  m.h_out = {};
  const bool ok = megakernel::encode_ring_maps<BackwardPass>(a, &m) &&
                  gemm::encode_weight_map_n_major(a.w_down, E, H, I, &m.w1a, a.w_down_stride,
                                                  &m.w1.b0) &&
                  gemm::encode_weight_map_n_major(a.w_gate, E, I, H, &m.w2a, a.w_gate_stride,
                                                  &m.w2.b0) &&
                  gemm::encode_weight_map_n_major(a.w_up, E, I, H, &m.w2b, a.w_up_stride,
                                                  &m.w2.b1);
  m.w1b = m.w1a;
  m.w1.b1 = m.w1.b0;
  if (!ok) return cudaErrorInvalidValue;
  return megakernel::launch<BackwardPass>(m, a, sm_count, stream);
}

}  // namespace epflow::kernels
