// The backward megakernel (moe_megakernel.cuh; docs/design/backward_megakernel.md): pull dy
// rows; dhp = dy W_down with the SwiGLU and router-weight backward in its epilogue (DhSink);
// dx = [dg | du] [W_gate; W_up] pushed into the owners' (token, k) slots (PushCombineSink); the
// communication CTAs also pull the x rows the weight gradients read. This file holds the pass's
// traits, its weights' TMA maps and launch_backward_megakernel; the kernel is kernel.cuh's,
// shared with the forward.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/kernel.cuh"
#include "kernels/moe_megakernel.cuh"

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

}  // namespace
}  // namespace megakernel

cudaError_t launch_backward_megakernel(const MegakernelArgs& a, int32_t sm_count,
                                       cudaStream_t stream) {
  using megakernel::BackwardPass;
  if (!megakernel::valid_args(a, sm_count) || !a.gate_up_in || !a.wh_out || !a.dw_partial ||
      !a.x_out || a.gate_up_out)
    return cudaErrorInvalidValue;
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
