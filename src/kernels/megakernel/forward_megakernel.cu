// The forward megakernel (moe_megakernel.cuh): pull x rows; gate/up GEMM + SwiGLU into the
// ring's h rows (RingSink); down GEMM whose epilogue pushes each output row into its owner's
// (token, k) slot (PushCombineSink). This file holds the pass's traits, its weights' TMA maps and
// launch_forward_megakernel; the kernel is kernel.cuh's, shared with the backward.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/kernel.cuh"
#include "kernels/moe_megakernel.cuh"

namespace epflow::kernels {

namespace megakernel {
namespace {

// The forward's traits (kernel.cuh says what each means).
struct ForwardPass {
  static constexpr bool kBackward = false;
  static constexpr gemm::Epilogue kGateUpEpilogue = gemm::Epilogue::kSwiGLU;
  static constexpr gemm::WeightMajor kWeights = gemm::WeightMajor::kK;
  static constexpr int kDownKParts = 1;
  static constexpr bool kDownNFastestWhenSuited = false;
  static constexpr bool kForWeightGradients = false;
};

}  // namespace
}  // namespace megakernel

cudaError_t launch_forward_megakernel(const MegakernelArgs& a, int32_t sm_count,
                                      cudaStream_t stream) {
  using megakernel::ForwardPass;
  if (!megakernel::valid_args(a, sm_count)) return cudaErrorInvalidValue;
  // w1a, w1b = W_gate, W_up [E, I, H] (128-row boxes: a tile is 128 gate + 128 up rows); h_out =
  // ring h as the SwiGLU output (64 x 64 boxes); w2a = w2b = W_down [E, H, I] (256-row boxes).
  megakernel::Maps m;
  const int64_t ring_rows = int64_t{a.ring_tiles} * kTileRows;
  const int64_t E = a.experts, H = a.hidden, I = a.intermediate;
  constexpr uint32_t kHalf = kTileCols / 2;
  const bool ok = megakernel::encode_ring_maps<ForwardPass>(a, &m) &&
                  gemm::encode_weight_map(a.w_gate, E, I, H, kHalf, &m.w1a) &&
                  gemm::encode_weight_map(a.w_up, E, I, H, kHalf, &m.w1b) &&
                  gemm::encode_output_map(a.ring_h, I, ring_rows, &m.h_out) &&
                  gemm::encode_weight_map(a.w_down, E, H, I, kTileCols, &m.w2a);
  m.w2b = m.w2a;
  if (!ok) return cudaErrorInvalidValue;
  return megakernel::launch<ForwardPass>(m, a, sm_count, stream);
}

}  // namespace epflow::kernels
