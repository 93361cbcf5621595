// The gate/up GEMM of the rows a SavedContext does not keep (gate_up_recompute.cuh): tiles of
// 128 rows x 256 columns of one matrix (gate or up), m fastest, over the rows first_row .. (the
// call's rows, read on the device); each output tile goes through the warpgroup's staging as
// TMA stores into out viewed as [rows, 2 (gate, up), I], so a tile past I is clipped at its
// matrix.
#include "kernels/gate_up_recompute.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {

using gemm::Epilogue;
using gemm::kBlockK;

constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging
using Smem = gemm::SharedStorage<Epilogue::kStore, kStages>;

struct RecomputeParams {
  const int64_t* seg_offset;
  const int32_t* expert_rows;
  int32_t experts, half_tiles, k_blocks;  // half_tiles: n tiles of one matrix
  int32_t first_tile;
  gemm::ExpertOrder gate_order, up_order;
};

struct OverflowStoreSink : gemm::DirectStoreSink<Epilogue::kStore> {
  int32_t matrix = 0;     // 0 gate, 1 up
  int32_t first_row = 0;  // of the table: out's row 0
  __device__ void publish(int wg, int tid, const uint8_t* staging, const gemm::TileCoord& c) {
    if (tid != 0) return;
#pragma unroll
    for (int box = 0; box < kTileCols / 64; ++box)
      ptx::tma_store_3d(map_out, staging + box * 64 * 128, c.n_tile * kTileCols + box * 64, matrix,
                        c.a_row - first_row + wg * 64);
    ptx::tma_store_commit();
  }
};

// Tile t: m = first_tile + t % m_tiles, then (matrix, n tile) = divmod(t / m_tiles, half_tiles).
__device__ __forceinline__ gemm::TileCoord recompute_tile(const RecomputeParams& p, int64_t t,
                                                          int32_t m_tiles, int32_t* matrix) {
  const int32_t m = p.first_tile + static_cast<int32_t>(t % m_tiles);
  const int32_t n = static_cast<int32_t>(t / m_tiles);
  *matrix = n / p.half_tiles;
  gemm::TileCoord c;
  c.m_tile = m;
  c.n_tile = n % p.half_tiles;
  c.a_row = m * kTileRows;
  c.expert = sched::expert_of_row(p.seg_offset, p.experts, int64_t{c.a_row});
  const int64_t left = p.seg_offset[c.expert] + p.expert_rows[c.expert] - c.a_row;
  c.rows = static_cast<int32_t>(left < kTileRows ? left : kTileRows);
  return c;
}

__global__ void __launch_bounds__(gemm::kThreads, 1)
    gate_up_recompute_kernel(const __grid_constant__ CUtensorMap map_a,
                             const __grid_constant__ CUtensorMap map_a_rows,
                             const __grid_constant__ CUtensorMap map_gate,
                             const __grid_constant__ CUtensorMap map_up,
                             const __grid_constant__ CUtensorMap map_out, const RecomputeParams p) {
  auto& s = gemm::dynamic_smem<Smem>();
  const int wg = gemm::warpgroup_index();
  if (threadIdx.x == 0) {
    gemm::check_dynamic_smem_alignment();
    gemm::init_stage_barriers(s);
    for (const CUtensorMap* m : {&map_a, &map_a_rows, &map_gate, &map_up, &map_out})
      ptx::prefetch_tensor_map(m);
  }
  __syncthreads();
  const int32_t m_tiles =
      static_cast<int32_t>(p.seg_offset[p.experts] / kTileRows) - p.first_tile;
  if (m_tiles <= 0) return;  // every routed row is kept
  const int64_t tiles = int64_t{m_tiles} * 2 * p.half_tiles;
  gemm::PipelineState<kStages> ps;
  int32_t matrix = 0;
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const gemm::TileCoord c = recompute_tile(p, t, m_tiles, &matrix);
      const CUtensorMap* w = matrix == 0 ? &map_gate : &map_up;
      const gemm::ExpertOrder order = matrix == 0 ? p.gate_order : p.up_order;
      gemm::produce_tile<Epilogue::kStore, kStages, gemm::kStagingBytes<Epilogue::kStore>>(
          s, ps, c, p.k_blocks, &map_a, &map_a_rows, w, w, {}, 0, 0, 0, {},
          gemm::WeightOrders{order, order});
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    OverflowStoreSink sink;
    sink.map_out = &map_out;
    sink.first_row = p.first_tile * kTileRows;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const gemm::TileCoord c = recompute_tile(p, t, m_tiles, &sink.matrix);
      gemm::consume_tile<Epilogue::kStore, kStages, gemm::kStagingBytes<Epilogue::kStore>,
                         OverflowStoreSink>(s, ps, c, p.k_blocks, wg - 1, sink);
    }
    if (threadIdx.x % 128 == 0) ptx::tma_store_wait_all();  // staging must outlive the stores
  }
}

}  // namespace

cudaError_t launch_gate_up_recompute(const GateUpRecomputeArgs& a, int32_t sm_count,
                                     cudaStream_t stream) {
  const int64_t H = a.hidden, I = a.intermediate;
  if (H <= 0 || H % kBlockK != 0 || I <= 0 || I % 64 != 0 || a.first_row < 0 ||
      a.first_row % kTileRows != 0 || a.first_row > a.max_rows || a.max_rows % kTileRows != 0 ||
      a.experts <= 0 || !a.seg_offset || !a.expert_rows || !a.rows || !a.w_gate || !a.w_up ||
      !a.out)
    return cudaErrorInvalidValue;
  const int64_t out_rows = a.max_rows - a.first_row;
  if (out_rows == 0) return cudaSuccess;
  CUtensorMap map_a, map_a_rows, map_gate, map_up, map_out;
  RecomputeParams p;
  // out as [rows, 2, I]: (column, matrix, row), boxes of 64 columns x 1 x 64 rows.
  const uint64_t out_dims[3] = {uint64_t(I), 2, uint64_t(out_rows)};
  const uint64_t out_strides[2] = {uint64_t(I) * 2, uint64_t(I) * 4};
  const uint32_t out_box[3] = {64, 1, 64};
  if (!gemm::encode_row_operand_maps(a.rows, H, a.max_rows, &map_a, &map_a_rows) ||
      !gemm::encode_weight_map(a.w_gate, a.experts, I, H, kTileCols, &map_gate,
                               a.w_gate_stride, &p.gate_order) ||
      !gemm::encode_weight_map(a.w_up, a.experts, I, H, kTileCols, &map_up, a.w_up_stride,
                               &p.up_order) ||
      !encode_bf16_tensor_map(&map_out, a.out, 3, out_dims, out_box, out_strides).ok())
    return cudaErrorInvalidValue;
  p.seg_offset = a.seg_offset;
  p.expert_rows = a.expert_rows;
  p.experts = a.experts;
  p.half_tiles = static_cast<int32_t>((I + kTileCols - 1) / kTileCols);
  p.k_blocks = static_cast<int32_t>(H / kBlockK);
  p.first_tile = static_cast<int32_t>(a.first_row / kTileRows);
  const int64_t max_tiles = out_rows / kTileRows * 2 * p.half_tiles;
  const int grid = static_cast<int>(max_tiles < sm_count ? max_tiles : sm_count);
  constexpr size_t smem = sizeof(Smem);
  if (cudaError_t e = cudaFuncSetAttribute(gate_up_recompute_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  gate_up_recompute_kernel<<<grid, gemm::kThreads, smem, stream>>>(map_a, map_a_rows, map_gate,
                                                                   map_up, map_out, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
