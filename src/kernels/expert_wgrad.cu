// Weight-gradient GEMM of the expert FFN's backward (expert_ffn.cuh, ExpertWgradArgs): one
// output tile (128 rows of dw[e] x 256 columns) per task, its K the expert's rows. Both operands
// come from row-major activations whose rows are the reduction: A = lhsᵀ is M-major, B = rhs is
// N-major, each loaded as boxes of 64 columns x 64 rows (grouped_gemm.cuh's consume_tile with
// RowsMajor::kM and WeightMajor::kN). Tiles are walked statically, m fastest (the CTAs running
// at once share the expert's rhs rows through L2).
#include "kernels/expert_wgrad.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {

using gemm::Epilogue;
using gemm::kBlockK;

constexpr int kStages = 3;  // 3 x 48 KB of tiles + 64 KB of output staging: 208 KB of 227
using Smem = gemm::SharedStorage<Epilogue::kStore, kStages>;

struct WgradParams {
  const int64_t* seg_offset;
  const int32_t* expert_rows;  // optional: K ends at the first 64-row block past the real rows
  int32_t experts, m_tiles, n_tiles;
  bool accumulate;  // dw += lhsᵀ rhs (a TMA reduce-add) instead of dw = lhsᵀ rhs (a TMA store)
  gemm::ExpertOrder dw_order;
};

// The output tile of a consumer warpgroup (64 rows x 256 columns) goes through its staging
// buffer (64 rows x 256 bf16) to dw[e] as TMA stores or TMA reduce-adds into what dw holds:
// the gradient leaves the SM once, whole 128-byte rows, and accumulating reads nothing back into
// the SM. Every element has one writer per call, so the sum is deterministic; bf16 accumulation
// rounds the tile to bf16 and then the sum (what adding a fresh bf16 gradient does). fp32 tiles
// take twice the bytes: two passes of 128 columns. The 3-D map over [E, m, n] clips a tile past
// m or n at its expert.
template <class T>  // __nv_bfloat16 or float
struct WgradSink {
  static constexpr bool kDirect = true;
  static constexpr int kWritePasses = static_cast<int>(sizeof(T)) / 2;
  static constexpr int kPassCols = kTileCols / kWritePasses;
  static constexpr int kBoxCols = 128 / static_cast<int>(sizeof(T));  // a 128-byte swizzle span
  static_assert(gemm::kStagingBytes<Epilogue::kStore> == 64 * kPassCols * sizeof(T));
  const CUtensorMap* map_dw = nullptr;
  gemm::ExpertOrder dw_order;
  uint8_t* staging = nullptr;  // this warpgroup's
  bool accumulate = false;
  gemm::TileCoord c;
  int pass = 0;
  __device__ __forceinline__ void prepare(const gemm::TileCoord& tile, int, int) {
    c = tile;
    pass = 0;
  }
  __device__ __forceinline__ void begin(int wg, int tid) {
    if (tid == 0) ptx::tma_store_wait_read();  // the previous pass's TMA has read the staging
    ptx::named_barrier_sync(1 + wg, 128);
  }
  // NOTES: a row's 128-byte box rows are 16-byte chunks swizzled by the row (chunk ^ row % 8),
  // so a warp's stores (8 rows x 4 lanes) spread over the banks.
  __device__ __forceinline__ void write(int j, int half, float v0, float v1) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
    const int row = warp * 16 + lane / 4 + 8 * half;
    const int col = 8 * j + 2 * (lane % 4) - pass * kPassCols;
    const int byte = col * static_cast<int>(sizeof(T));
    const int box = byte / 128, in_row = byte % 128;
    uint8_t* at = staging + box * 64 * 128 + row * 128 + ((in_row / 16) ^ (row % 8)) * 16 + in_row % 16;
    if constexpr (sizeof(T) == 2)
      *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(v0, v1);
    else
      *reinterpret_cast<float2*>(at) = make_float2(v0, v1);
  }
  __device__ __forceinline__ void end(int wg, int tid) {
    ptx::fence_shared_to_async_proxy();
    ptx::named_barrier_sync(1 + wg, 128);
    if (tid == 0) {
      const int32_t row = c.m_tile * kTileRows + wg * 64, expert = dw_order(c.expert);
#pragma unroll
      for (int box = 0; box < kPassCols / kBoxCols; ++box) {
        const int32_t col = c.n_tile * kTileCols + pass * kPassCols + box * kBoxCols;
        if (accumulate)
          ptx::tma_reduce_add_3d(map_dw, staging + box * 64 * 128, col, row, expert);
        else
          ptx::tma_store_3d(map_dw, staging + box * 64 * 128, col, row, expert);
      }
      ptx::tma_store_commit();
    }
    ++pass;
  }
  __device__ __forceinline__ void skip(int, int) {}  // (a wgrad tile's rows are never padding)
};

__device__ __forceinline__ gemm::TileCoord wgrad_tile(const WgradParams& p, int64_t t) {
  const int64_t per_expert = int64_t{p.m_tiles} * p.n_tiles;
  gemm::TileCoord c;
  c.expert = static_cast<int32_t>(t / per_expert);
  const int32_t in_expert = static_cast<int32_t>(t % per_expert);
  c.m_tile = in_expert % p.m_tiles;
  c.n_tile = in_expert / p.m_tiles;
  c.rows = kTileRows;  // every row of dw's tile is real (stores past m are clipped)
  c.a_row = static_cast<int32_t>(p.seg_offset[c.expert]);  // the expert's first row: K origin
  return c;
}

template <class Sink>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    expert_wgrad_kernel(const __grid_constant__ CUtensorMap map_lhs,
                        const __grid_constant__ CUtensorMap map_rhs,
                        const __grid_constant__ CUtensorMap map_dw, const WgradParams p) {
  auto& s = gemm::dynamic_smem<Smem>();
  const int wg = gemm::warpgroup_index();
  if (threadIdx.x == 0) {
    gemm::check_dynamic_smem_alignment();
    gemm::init_stage_barriers(s);
    ptx::prefetch_tensor_map(&map_lhs);
    ptx::prefetch_tensor_map(&map_rhs);
    ptx::prefetch_tensor_map(&map_dw);
  }
  __syncthreads();
  const int64_t tiles = int64_t{p.experts} * p.m_tiles * p.n_tiles;
  gemm::PipelineState<kStages> ps;
  // NOTES: at 512 tokens/rank an expert has ~128 rows, padded to 128 or 256: the padding's
  // k-blocks would be a third of the loads and MMAs. Past the real rows only the k-block they end
  // in is read (its padding rows are zero).
  auto k_blocks_of = [&](const gemm::TileCoord& c) {
    const int64_t k = p.expert_rows ? p.expert_rows[c.expert]
                                    : p.seg_offset[c.expert + 1] - p.seg_offset[c.expert];
    return static_cast<int32_t>((k + kBlockK - 1) / kBlockK);
  };
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    constexpr uint32_t kBytes = (kTileRows + kTileCols) * kBlockK * 2;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const gemm::TileCoord c = wgrad_tile(p, t);
      const int32_t k_blocks = k_blocks_of(c);
      for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance()) {
        ptx::mbarrier_wait(&s.empty[ps.stage], ps.phase ^ 1);
        uint64_t* full = &s.full[ps.stage];
        ptx::mbarrier_arrive_expect_tx(full, kBytes);
        const int32_t row = c.a_row + kb * kBlockK;
#pragma unroll
        for (int box = 0; box < kTileRows / 64; ++box)
          ptx::tma_load_2d(s.a[ps.stage] + box * 64 * kBlockK * 2, &map_lhs,
                           c.m_tile * kTileRows + box * 64, row, full);
#pragma unroll
        for (int box = 0; box < kTileCols / 64; ++box)
          ptx::tma_load_2d(s.b[ps.stage] + box * 64 * kBlockK * 2, &map_rhs,
                           c.n_tile * kTileCols + box * 64, row, full);
      }
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    Sink sink;
    sink.map_dw = &map_dw;
    sink.dw_order = p.dw_order;
    sink.staging = s.out[wg - 1];
    sink.accumulate = p.accumulate;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const gemm::TileCoord c = wgrad_tile(p, t);
      gemm::consume_tile<Epilogue::kStore, kStages, gemm::kStagingBytes<Epilogue::kStore>,
                         Sink, gemm::WeightMajor::kN, gemm::RowsMajor::kM>(
          s, ps, c, k_blocks_of(c), wg - 1, sink);
    }
    if (threadIdx.x % 128 == 0) ptx::tma_store_wait_all();  // staging must outlive the stores
  }
}

}  // namespace

cudaError_t launch_expert_wgrad(const ExpertWgradArgs& a, cudaStream_t stream) {
  const int64_t lhs_ld = a.lhs_ld == 0 ? a.m : a.lhs_ld, rhs_ld = a.rhs_ld == 0 ? a.n : a.rhs_ld;
  const ExpertSegments& seg = a.segments;
  if (!seg.valid() || a.m <= 0 || a.m % 64 != 0 || a.n <= 0 || a.n % 64 != 0 || lhs_ld < a.m ||
      lhs_ld % 8 != 0 || rhs_ld < a.n || rhs_ld % 8 != 0)
    return cudaErrorInvalidValue;
  if (seg.experts == 0) return cudaSuccess;  // (no rows at all still writes zero gradients)
  if (!seg.seg_offset || !a.lhs || !a.rhs || !a.dw) return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (a.max_ctas > 0 && a.max_ctas < sm_count) sm_count = a.max_ctas;
  // lhs and rhs as [max_rows, m | n] with their row strides, in boxes of 64 columns x 64 rows;
  // dw as [E, m, n] in boxes of 64 rows x 128 bytes (the staging's layout). A max_rows of 0
  // still maps one (never read) row.
  const uint64_t rows = seg.max_rows > 0 ? seg.max_rows : 1;
  const uint64_t lhs_dims[2] = {uint64_t(a.m), rows}, rhs_dims[2] = {uint64_t(a.n), rows};
  const uint64_t lhs_strides[1] = {uint64_t(lhs_ld) * 2}, rhs_strides[1] = {uint64_t(rhs_ld) * 2};
  const uint64_t dw_dims[3] = {uint64_t(a.n), uint64_t(a.m), uint64_t(seg.experts)};
  const int64_t dw_elem = a.fp32_out ? 4 : 2;
  WgradParams p;
  uint64_t dw_strides[2] = {uint64_t(a.n * dw_elem), 0};
  const void* dw = gemm::expert_map_base(a.dw, seg.experts, a.m * a.n, dw_elem,
                                         a.dw_expert_stride, &dw_strides[1], &p.dw_order);
  const uint32_t box2[2] = {64, kBlockK};
  const uint32_t dw_box[3] = {a.fp32_out ? 32u : 64u, 64, 1};  // 128-byte rows of the staging
  CUtensorMap map_lhs, map_rhs, map_dw;
  if (!encode_bf16_tensor_map(&map_lhs, a.lhs, 2, lhs_dims, box2, lhs_strides).ok() ||
      !encode_bf16_tensor_map(&map_rhs, a.rhs, 2, rhs_dims, box2, rhs_strides).ok() ||
      !(a.fp32_out ? encode_f32_tensor_map(&map_dw, dw, 3, dw_dims, dw_box, dw_strides)
                   : encode_bf16_tensor_map(&map_dw, dw, 3, dw_dims, dw_box, dw_strides))
           .ok())
    return cudaErrorInvalidValue;
  p.seg_offset = seg.seg_offset;
  p.expert_rows = seg.expert_rows;
  p.experts = seg.experts;
  p.accumulate = a.accumulate;
  p.m_tiles = static_cast<int32_t>((a.m + kTileRows - 1) / kTileRows);
  p.n_tiles = static_cast<int32_t>((a.n + kTileCols - 1) / kTileCols);
  const int64_t tiles = int64_t{seg.experts} * p.m_tiles * p.n_tiles;
  const int grid = static_cast<int>(tiles < sm_count ? tiles : sm_count);
  constexpr size_t smem = sizeof(Smem);
  auto* kernel = a.fp32_out ? expert_wgrad_kernel<WgradSink<float>>
                            : expert_wgrad_kernel<WgradSink<__nv_bfloat16>>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, gemm::kThreads, smem, stream>>>(map_lhs, map_rhs, map_dw, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
