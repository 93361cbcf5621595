// The forward megakernel (moe_megakernel.cuh): pull x rows; gate/up GEMM + SwiGLU into the
// ring's h rows (RingSink); down GEMM whose epilogue pushes each output row into its owner's
// (token, k) slot (PushCombineSink). In bf16, or in FP8 (MegakernelArgs::fp8: e4m3 rows with
// their scales pulled, block-scaled GEMMs, h quantized in the SwiGLU epilogue; the combine stays
// bf16). This file holds the passes' traits, their weights' TMA maps and
// launch_forward_megakernel; the kernel is kernel.cuh's, shared with the backward.
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

// The forward's traits (kernel.cuh says what each means).
struct ForwardPass {
  static constexpr bool kBackward = false;
  static constexpr gemm::Epilogue kGateUpEpilogue = gemm::Epilogue::kSwiGLU;
  static constexpr gemm::WeightMajor kWeights = gemm::WeightMajor::kK;
  static constexpr int kDownKParts = 1;
  static constexpr bool kDownNFastestWhenSuited = false;
  static constexpr bool kForWeightGradients = false;
  static constexpr gemm::Operands kOperands = gemm::Operands::kBF16;
};
struct Fp8ForwardPass : ForwardPass {
  static constexpr gemm::Operands kOperands = gemm::Operands::kFP8;
};

// The FP8 pass's maps: e4m3 weights in the bf16 boxes' bytes (128 K wide), h as one box of 128
// e4m3 columns per consumer warpgroup's 64 rows.
bool encode_fp8_forward_maps(const MegakernelArgs& a, Maps* m) {
  const int64_t ring_rows = int64_t{a.ring_tiles} * kTileRows;
  const uint64_t E = a.experts, H = a.hidden, I = a.intermediate;
  constexpr uint32_t kK = fp8::kBlock, kHalf = kTileCols / 2;
  const uint64_t gate_dims[3] = {H, I, E}, down_dims[3] = {I, H, E};
  const uint32_t gate_box[3] = {kK, kHalf, 1}, down_box[3] = {kK, kTileCols, 1};
  const uint64_t h_dims[2] = {I, uint64_t(ring_rows)};
  const uint64_t h_stride[1] = {uint64_t(h_row_bytes(a))};
  const uint32_t h_box[2] = {kK, 64};
  const bool ok = encode_ring_maps<Fp8ForwardPass>(a, m) &&
                  encode_u8_tensor_map(&m->w1a, a.w_gate_fp8, 3, gate_dims, gate_box).ok() &&
                  encode_u8_tensor_map(&m->w1b, a.w_up_fp8, 3, gate_dims, gate_box).ok() &&
                  encode_u8_tensor_map(&m->h_out, a.ring_h, 2, h_dims, h_box, h_stride).ok() &&
                  encode_u8_tensor_map(&m->w2a, a.w_down_fp8, 3, down_dims, down_box).ok() &&
                  encode_f32_vector_map(&m->w1a_scales, a.w_gate_scales, E * I * H / (kK * kK),
                                        gemm::fp8_weight_scale_box(int32_t(H / kK)))
                      .ok() &&
                  encode_f32_vector_map(&m->w1b_scales, a.w_up_scales, E * I * H / (kK * kK),
                                        gemm::fp8_weight_scale_box(int32_t(H / kK)))
                      .ok() &&
                  encode_f32_vector_map(&m->w2_scales, a.w_down_scales, E * H * I / (kK * kK),
                                        gemm::fp8_weight_scale_box(int32_t(I / kK)))
                      .ok();
  m->w2b = m->w2a;
  return ok;
}

}  // namespace
}  // namespace megakernel

cudaError_t launch_forward_megakernel(const MegakernelArgs& a, int32_t sm_count,
                                      cudaStream_t stream) {
  using megakernel::ForwardPass;
  if (!megakernel::valid_args(a, sm_count)) return cudaErrorInvalidValue;
  if (a.fp8) {
    megakernel::Maps m;
    if (!megakernel::fp8_shape_ok<megakernel::Fp8ForwardPass>(a) || !a.w_gate_scales ||
        !a.w_up_scales || !a.w_down_scales || !megakernel::encode_fp8_forward_maps(a, &m))
      return cudaErrorInvalidValue;
    return megakernel::launch<megakernel::Fp8ForwardPass>(m, a, sm_count, stream);
  }
  // w1a, w1b = W_gate, W_up [E, I, H] (128-row boxes: a tile is 128 gate + 128 up rows); h_out =
  // ring h as the SwiGLU output (64 x 64 boxes); w2a = w2b = W_down [E, H, I] (256-row boxes).
  megakernel::Maps m;
  const int64_t ring_rows = int64_t{a.ring_tiles} * kTileRows;
  const int64_t E = a.experts, H = a.hidden, I = a.intermediate;
  constexpr uint32_t kHalf = kTileCols / 2;
  const bool ok = megakernel::encode_ring_maps<ForwardPass>(a, &m) &&
                  gemm::encode_weight_map(a.w_gate, E, I, H, kHalf, &m.w1a, a.w_gate_stride,
                                          &m.w1.b0) &&
                  gemm::encode_weight_map(a.w_up, E, I, H, kHalf, &m.w1b, a.w_up_stride,
                                          &m.w1.b1) &&
                  gemm::encode_output_map(a.ring_h, I, ring_rows, &m.h_out) &&
                  gemm::encode_weight_map(a.w_down, E, H, I, kTileCols, &m.w2a, a.w_down_stride,
                                          &m.w2.b0);
  m.w2b = m.w2a;
  m.w2.b1 = m.w2.b0;
  if (!ok) return cudaErrorInvalidValue;
  return megakernel::launch<ForwardPass>(m, a, sm_count, stream);
}

}  // namespace epflow::kernels
