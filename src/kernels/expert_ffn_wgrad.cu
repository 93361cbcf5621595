// Weight-gradient GEMM of the expert FFN's backward (expert_ffn.cuh, ExpertWgradArgs): one
// output tile (128 rows of dw[e] x 256 columns) per task, its K the expert's rows. Both operands
// come from row-major activations whose rows are the reduction: A = lhsᵀ is M-major, B = rhs is
// N-major, each loaded as boxes of 64 columns x 64 rows (grouped_gemm.cuh's consume_tile with
// RowsMajor::kM and WeightMajor::kN). Tiles are walked statically, m fastest (the CTAs running
// at once share the expert's rhs rows through L2).
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {

using gemm::Epilogue;
using gemm::kBlockK;
using gemm::kBlockM;
using gemm::kBlockNMma;

constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
using Smem = gemm::SharedStorage<Epilogue::kStore, kStages>;

struct WgradParams {
  const int64_t* seg_offset;
  int32_t experts, m_tiles, n_tiles;
};

// The staged output goes to dw[e] (a 3-D map: a tile past m or n is clipped at the expert).
struct WgradStoreSink : gemm::DirectStoreSink<Epilogue::kStore> {
  __device__ void publish(int wg, int tid, const uint8_t* staging, const gemm::TileCoord& c) {
    if (tid != 0) return;
#pragma unroll
    for (int box = 0; box < kBlockNMma / 64; ++box)
      ptx::tma_store_3d(map_out, staging + box * 64 * 128, c.n_tile * kBlockNMma + box * 64,
                        c.m_tile * kBlockM + wg * 64, c.expert);
    ptx::tma_store_commit();
  }
};

__device__ __forceinline__ gemm::TileCoord wgrad_tile(const WgradParams& p, int64_t t) {
  const int64_t per_expert = int64_t{p.m_tiles} * p.n_tiles;
  gemm::TileCoord c;
  c.expert = static_cast<int32_t>(t / per_expert);
  const int32_t in_expert = static_cast<int32_t>(t % per_expert);
  c.m_tile = in_expert % p.m_tiles;
  c.n_tile = in_expert / p.m_tiles;
  c.rows = kBlockM;  // every row of dw's tile is real (stores past m are clipped)
  c.a_row = static_cast<int32_t>(p.seg_offset[c.expert]);  // the expert's first row: K origin
  return c;
}

__global__ void __launch_bounds__(gemm::kThreads, 1)
    expert_wgrad_kernel(const __grid_constant__ CUtensorMap map_lhs,
                        const __grid_constant__ CUtensorMap map_rhs,
                        const __grid_constant__ CUtensorMap map_dw, const WgradParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    gemm::init_stage_barriers(s);
    for (const CUtensorMap* map : {&map_lhs, &map_rhs, &map_dw}) ptx::prefetch_tensor_map(map);
  }
  __syncthreads();
  const int64_t tiles = int64_t{p.experts} * p.m_tiles * p.n_tiles;
  gemm::PipelineState<kStages> ps;
  auto k_blocks_of = [&](const gemm::TileCoord& c) {
    return static_cast<int32_t>((p.seg_offset[c.expert + 1] - p.seg_offset[c.expert]) / kBlockK);
  };
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    constexpr uint32_t kBytes = (kBlockM + kBlockNMma) * kBlockK * 2;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const gemm::TileCoord c = wgrad_tile(p, t);
      const int32_t k_blocks = k_blocks_of(c);
      for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance()) {
        ptx::mbarrier_wait(&s.empty[ps.stage], ps.phase ^ 1);
        uint64_t* full = &s.full[ps.stage];
        ptx::mbarrier_arrive_expect_tx(full, kBytes);
        const int32_t row = c.a_row + kb * kBlockK;
#pragma unroll
        for (int box = 0; box < kBlockM / 64; ++box)
          ptx::tma_load_2d(s.a[ps.stage] + box * 64 * kBlockK * 2, &map_lhs,
                           c.m_tile * kBlockM + box * 64, row, full);
#pragma unroll
        for (int box = 0; box < kBlockNMma / 64; ++box)
          ptx::tma_load_2d(s.b[ps.stage] + box * 64 * kBlockK * 2, &map_rhs,
                           c.n_tile * kBlockNMma + box * 64, row, full);
      }
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    WgradStoreSink sink;
    sink.map_out = &map_dw;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const gemm::TileCoord c = wgrad_tile(p, t);
      gemm::consume_tile<Epilogue::kStore, kStages, gemm::kStagingBytes<Epilogue::kStore>,
                         WgradStoreSink, gemm::WeightMajor::kN, gemm::RowsMajor::kM>(
          s, ps, c, k_blocks_of(c), wg - 1, sink);
    }
    if (threadIdx.x % 128 == 0) ptx::tma_store_wait_all();  // staging must outlive the stores
  }
}

}  // namespace

cudaError_t launch_expert_wgrad(const ExpertWgradArgs& a, cudaStream_t stream) {
  if (a.experts < 0 || a.max_rows < 0 || a.max_rows % kExpertFfnTileM != 0 || a.m <= 0 ||
      a.m % 64 != 0 || a.n <= 0 || a.n % 64 != 0)
    return cudaErrorInvalidValue;
  if (a.experts == 0) return cudaSuccess;
  if (!a.seg_offset || !a.lhs || !a.rhs || !a.dw) return cudaErrorInvalidValue;
  int device = 0, sm_count = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess)
    return e;
  // lhs and rhs as [max_rows, cols] in boxes of 64 columns x 64 rows; dw as [E, m, n] in boxes
  // of 64 x 64 (the staging's layout). A max_rows of 0 still maps one (never read) row.
  const uint64_t rows = a.max_rows > 0 ? a.max_rows : 1;
  const uint64_t lhs_dims[2] = {uint64_t(a.m), rows}, rhs_dims[2] = {uint64_t(a.n), rows};
  const uint64_t dw_dims[3] = {uint64_t(a.n), uint64_t(a.m), uint64_t(a.experts)};
  const uint32_t box2[2] = {64, kBlockK}, box3[3] = {64, 64, 1};
  CUtensorMap map_lhs, map_rhs, map_dw;
  if (!encode_bf16_tensor_map(&map_lhs, a.lhs, 2, lhs_dims, box2).ok() ||
      !encode_bf16_tensor_map(&map_rhs, a.rhs, 2, rhs_dims, box2).ok() ||
      !encode_bf16_tensor_map(&map_dw, a.dw, 3, dw_dims, box3).ok())
    return cudaErrorInvalidValue;
  WgradParams p;
  p.seg_offset = a.seg_offset;
  p.experts = a.experts;
  p.m_tiles = static_cast<int32_t>((a.m + kBlockM - 1) / kBlockM);
  p.n_tiles = static_cast<int32_t>((a.n + kBlockNMma - 1) / kBlockNMma);
  const int64_t tiles = int64_t{a.experts} * p.m_tiles * p.n_tiles;
  const int grid = static_cast<int>(tiles < sm_count ? tiles : sm_count);
  constexpr size_t smem = sizeof(Smem) + 1024;  // + alignment slack
  if (cudaError_t e = cudaFuncSetAttribute(expert_wgrad_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  expert_wgrad_kernel<<<grid, gemm::kThreads, smem, stream>>>(map_lhs, map_rhs, map_dw, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
