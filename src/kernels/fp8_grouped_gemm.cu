// The standalone block-scaled FP8 grouped GEMM (fp8_grouped_gemm.cuh): grouped_gemm.cuh's
// persistent kernel with Operands::kFP8, the mainloop the FP8 megakernel runs (its K loop
// unrolled further, kKUnroll), and its kStore epilogue (bf16 through staging, TMA stores). Here
// for the GEMM's tests and benchmarks.
#include "kernels/fp8_grouped_gemm.cuh"
#include "kernels/grouped_gemm.cuh"
#include "kernels/tensor_map.h"

namespace epflow::kernels {

namespace {

using gemm::Epilogue;
using gemm::Operands;
using gemm::WeightMajor;

// 3 x (48 KB of tiles + 2 KB of row scales) + 64 KB of staging + 8 KB of weight scales: 222 KB
// of 227.
constexpr int kStages = 3;
// The K loop unrolled by 4 (gemm::consume_tile): the one way this GEMM's code differs from the
// FP8 megakernel's mainloop, which keeps 1 (consume_tile's NOTES say why).
constexpr int kKUnroll = 4;

}  // namespace

cudaError_t launch_fp8_grouped_gemm(const Fp8GroupedGemmArgs& a, cudaStream_t stream) {
  const ExpertSegments& seg = a.segments;
  if (!seg.valid() || a.n <= 0 || a.n % fp8::kBlock != 0 || a.k <= 0 || a.k % fp8::kBlock != 0 ||
      a.k / fp8::kBlock > fp8::kMaxKBlocks)
    return cudaErrorInvalidValue;
  if (seg.empty()) return cudaSuccess;
  if (!seg.seg_offset || !a.a || !a.a_scales || !a.w || !a.w_scales || !a.out)
    return cudaErrorInvalidValue;
  const int64_t k_blocks = a.k / fp8::kBlock;
  const int64_t a_scale_stride = a.a_scale_stride > 0 ? a.a_scale_stride : (k_blocks + 3) / 4 * 4;
  if (a_scale_stride % 4 != 0 || a_scale_stride < k_blocks ||
      reinterpret_cast<uintptr_t>(a.a_scales) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.w_scales) % 16 != 0)
    return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (a.max_ctas > 0 && a.max_ctas < sm_count) sm_count = a.max_ctas;
  const uint64_t a_dims[2] = {uint64_t(a.k), uint64_t(seg.max_rows)};
  const uint32_t a_box[2] = {fp8::kBlock, kTileRows};
  const uint32_t a_few_box[2] = {fp8::kBlock, gemm::kRowBoxM};
  const uint64_t w_dims[3] = {uint64_t(a.k), uint64_t(a.n), uint64_t(seg.experts)};
  const uint32_t w_box[3] = {fp8::kBlock, kTileCols, 1};
  // The rows' scales as bytes: four K blocks' scales of each of a tile's rows per box.
  const uint64_t as_dims[2] = {uint64_t(k_blocks * 4), uint64_t(seg.max_rows)};
  const uint64_t as_stride[1] = {uint64_t(a_scale_stride * 4)};
  const uint32_t as_box[2] = {16, kTileRows};
  const uint64_t w_scales = uint64_t(seg.experts) * (a.n / fp8::kBlock) * k_blocks;
  CUtensorMap map_a, map_a_rows, map_a_scales, map_w, map_w_scales, map_out;
  if (!encode_u8_tensor_map_unswizzled(&map_a_scales, a.a_scales, 2, as_dims, as_box, as_stride)
           .ok() ||
      !encode_f32_vector_map(&map_w_scales, a.w_scales, w_scales,
                             gemm::fp8_weight_scale_box(static_cast<int32_t>(k_blocks)))
           .ok() ||
      !encode_u8_tensor_map(&map_a, a.a, 2, a_dims, a_box).ok() ||
      !encode_u8_tensor_map(&map_a_rows, a.a, 2, a_dims, a_few_box).ok() ||
      !encode_u8_tensor_map(&map_w, a.w, 3, w_dims, w_box).ok() ||
      !gemm::encode_output_map(a.out, a.n, seg.max_rows, &map_out))
    return cudaErrorInvalidValue;
  gemm::GemmParams p = gemm::GemmParams::of(seg.seg_offset, nullptr, seg.experts, a.n, a.k);
  p.fp8.n_blocks = static_cast<int32_t>(a.n / fp8::kBlock);
  const int64_t max_tiles = seg.max_rows / kTileRows * ((a.n + kTileCols - 1) / kTileCols);
  const int grid = static_cast<int>(max_tiles < sm_count ? max_tiles : sm_count);
  auto* kernel =
      gemm::grouped_gemm_kernel<Epilogue::kStore, kStages, WeightMajor::kK, Operands::kFP8,
                                kKUnroll>;
  constexpr size_t smem = gemm::shared_bytes<Epilogue::kStore, kStages, Operands::kFP8>();
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, gemm::kThreads, smem, stream>>>(map_a, map_a_rows, map_w, map_w, map_out,
                                                 map_a_scales, map_w_scales, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
