// The megakernel itself, for a pass P, and what both passes' launchers share: the argument
// checks, the ring's row-operand maps and the cooperative launch. P is a traits struct, one per
// pass (ForwardPass in forward_megakernel.cu, BackwardPass in backward_megakernel.cu):
//   kBackward               the pass (MegakernelDiagnostic::backward; the gate/up-kind tiles'
//                           sink: DhSink, or RingSink in the forward);
//   kGateUpEpilogue         the first GEMM's epilogue (the second GEMM's is always kStore);
//   kWeights                both GEMMs' weight layout (gemm::WeightMajor);
//   kDownKParts             the second GEMM's K in units of I (1: h; 2: [dg | du]);
//   kDownNFastestWhenSuited whether the compute list may order down-kind tiles n tile fastest;
//   kForWeightGradients     whether dispatch writes padding rows as zeros and also pulls x;
//   kOperands               both GEMMs' operands (gemm::Operands: bf16, or FP8 with block
//                           scales; then both GEMMs' rows are packed rows, MegakernelArgs::fp8).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/megakernel_tasks.h"
#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/compute.cuh"
#include "kernels/megakernel/counters.cuh"
#include "kernels/megakernel/dispatch.cuh"
#include "kernels/megakernel/smem.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/tma.cuh"

namespace epflow::kernels::megakernel {

template <class P>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    moe_megakernel(const __grid_constant__ Maps maps, const __grid_constant__ MegakernelArgs a) {
  auto& smem = gemm::dynamic_smem<MegaSmem>();
  if (threadIdx.x == 0) gemm::check_dynamic_smem_alignment();
  const mega::TaskShape s = task_shape<P>(a);
  // The first pull_warps warps dispatch (the head, then a communication CTA's tiles); the CTA's
  // other warps wait for them: dispatch uses the stage memory. NOTES: a communication CTA whose
  // comm list is done joins the compute partition (its SM would idle for the rest of the call:
  // the last macrobatch, or most of a call whose routed rows fit the ring). It claims compute
  // tasks from the same counter, in list order, and owes no dispatch any more, so the
  // no-deadlock argument is unchanged (docs/ARCHITECTURE.md).
  int32_t traced = 0;
  const int32_t warp = threadIdx.x / 32;
  if (warp < pull_warps(a)) {
    RowPipe pipe = make_row_pipe(a, smem, warp);
    if (threadIdx.x % 32 == 0)
      for (uint32_t b = 0; b < pipe.slots; ++b) ptx::mbarrier_init(&pipe.full[b], 1);
    ptx::mbarrier_init_fence();
    traced = dispatch_head<P>(a, s, pipe, smem.head_claimed);
    if (blockIdx.x < a.comm_ctas) traced = comm_role<P>(a, s, traced, pipe);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The compute partition's trace records follow the dispatch's, in every thread that writes one.
    smem.dispatch_records = traced;
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&smem.gemm.full[i], 1);
      ptx::mbarrier_init(&smem.gemm.empty[i], 2);  // one arrival per consumer warpgroup
    }
    for (int w = 0; w < 2; ++w) {
      ptx::mbarrier_init(&smem.staging_full[w], 1);
      ptx::mbarrier_init(&smem.staging_empty[w], 1);
    }
    for (int i = 0; i < kStages; ++i) ptx::mbarrier_init(&smem.tag_read[i], gemm::kTagReaders);
    ptx::mbarrier_init(&smem.next_full, 1);
    ptx::mbarrier_init(&smem.next_empty, 1);
    ptx::mbarrier_init_fence();
    for (const CUtensorMap* map : {&maps.rows1, &maps.rows1_few, &maps.w1a, &maps.w1b, &maps.rows2,
                                   &maps.rows2_few, &maps.w2a, &maps.w2b})
      ptx::prefetch_tensor_map(map);
    if constexpr (!P::kBackward) ptx::prefetch_tensor_map(&maps.h_out);
    if constexpr (P::kOperands == gemm::Operands::kFP8) {
      for (const CUtensorMap* map : {&maps.rows1_scales, &maps.rows2_scales, &maps.w1a_scales,
                                     &maps.w1b_scales, &maps.w2_scales})
        ptx::prefetch_tensor_map(map);
    }
  }
  __syncthreads();
  compute_role<P>(maps, a, s, smem, smem.dispatch_records);
}

// The argument checks both passes share.
inline bool valid_args(const MegakernelArgs& a, int32_t sm_count) {
  return a.hidden % 64 == 0 && a.intermediate % 64 == 0 && a.ring_tiles > 0 &&
         a.minibatch_tiles > 0 && a.ring_tiles % a.minibatch_tiles == 0 && a.comm_ctas >= 1 &&
         a.comm_ctas < sm_count;
}

// FP8 (P::kOperands): H and I whole 128-wide K blocks (so [dg | du]'s blocks do not straddle dg
// and du either), and both GEMMs' K (H, and P::kDownKParts * I) within the K blocks a tile's
// weight scales keep in shared memory.
template <class P>
inline bool fp8_shape_ok(const MegakernelArgs& a) {
  return a.hidden % fp8::kBlock == 0 && a.intermediate % fp8::kBlock == 0 &&
         a.hidden / fp8::kBlock <= fp8::kMaxKBlocks &&
         P::kDownKParts * a.intermediate / fp8::kBlock <= fp8::kMaxKBlocks;
}

// FP8 packed rows [n_rows, packed_row_bytes(cols)] as a GEMM's row operand: the e4m3 values in
// boxes of one 128-wide K block by 128 rows and by 16 rows (grouped_gemm.cuh's row maps), and
// the scales after them as bytes, four K blocks' of a tile's rows per box (gemm::Fp8ScaleLoads).
inline bool encode_fp8_row_maps(const void* rows, int64_t cols, int64_t n_rows, CUtensorMap* map,
                                CUtensorMap* map_few_rows, CUtensorMap* map_scales) {
  const uint64_t dims[2] = {uint64_t(cols), uint64_t(n_rows)};
  const uint64_t stride[1] = {uint64_t(fp8::packed_row_bytes(cols))};
  const uint32_t box[2] = {fp8::kBlock, kTileRows};
  const uint32_t few_box[2] = {fp8::kBlock, gemm::kRowBoxM};
  const uint64_t scale_dims[2] = {uint64_t(cols / fp8::kBlock * 4), uint64_t(n_rows)};
  const uint32_t scale_box[2] = {16, kTileRows};
  return encode_u8_tensor_map(map, rows, 2, dims, box, stride).ok() &&
         encode_u8_tensor_map(map_few_rows, rows, 2, dims, few_box, stride).ok() &&
         encode_u8_tensor_map_unswizzled(map_scales, static_cast<const uint8_t*>(rows) + cols, 2,
                                         scale_dims, scale_box, stride)
             .ok();
}

// The ring's rows in both GEMMs: ring_x (K = H) and ring_h (K = kDownKParts * I), packed rows
// in FP8.
template <class P>
bool encode_ring_maps(const MegakernelArgs& a, Maps* m) {
  const int64_t ring_rows = int64_t{a.ring_tiles} * kTileRows;
  if constexpr (P::kOperands == gemm::Operands::kFP8)
    return encode_fp8_row_maps(a.ring_x, a.hidden, ring_rows, &m->rows1, &m->rows1_few,
                               &m->rows1_scales) &&
           encode_fp8_row_maps(a.ring_h, P::kDownKParts * int64_t{a.intermediate}, ring_rows,
                               &m->rows2, &m->rows2_few, &m->rows2_scales);
  return gemm::encode_row_operand_maps(a.ring_x, a.hidden, ring_rows, &m->rows1, &m->rows1_few) &&
         gemm::encode_row_operand_maps(a.ring_h, P::kDownKParts * int64_t{a.intermediate},
                                       ring_rows, &m->rows2, &m->rows2_few);
}

// One CTA per SM, cooperative (moe_megakernel.cuh).
template <class P>
cudaError_t launch(const Maps& m, const MegakernelArgs& a, int32_t sm_count, cudaStream_t stream) {
  auto* kernel = moe_megakernel<P>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmemBytes));
      e != cudaSuccess)
    return e;
  // NOTES: cooperative, so the launch fails instead of leaving CTAs that others wait for
  // unscheduled (the two partitions wait on each other).
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(sm_count);
  config.blockDim = dim3(gemm::kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, m, a);
}

}  // namespace epflow::kernels::megakernel
