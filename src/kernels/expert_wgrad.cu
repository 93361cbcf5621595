// Weight-gradient GEMM of the expert FFN's backward (expert_ffn.cuh, ExpertWgradArgs): one
// output tile (128 rows of dw[e] x 256 columns) per task, its K the expert's rows. Both operands
// come from row-major activations whose rows are the reduction: A = lhsᵀ is M-major, B = rhs is
// N-major, each loaded as boxes of 64 columns x 64 rows (grouped_gemm.cuh's consume_tile with
// RowsMajor::kM and WeightMajor::kN). Tiles are walked statically, m fastest (the CTAs running
// at once share the expert's rhs rows through L2). The FP8 form (launch_fp8_expert_wgrad) reads
// both operands transposed, K-major (launch_quantize_transposed's), through the FP8 mainloop.
#include "common/fp8_blocks.h"
#include "kernels/expert_wgrad.cuh"
#include "kernels/grouped_gemm.cuh"
#include "kernels/tensor_map.h"

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
  // bf16: blocks j (even) and j + 1 of the thread's rows as bf16 pairs, by stmatrix (a quarter
  // of the store instructions; the same bytes in the same places as write()): lane 8i + r
  // addresses row r of matrix i = (block j + i / 2, rows g or g + 8 by i % 2), the 16-byte chunk
  // (j + i / 2) % 8 of its box row, swizzled by the row.
  __device__ __forceinline__ void write_blocks(int j, uint32_t j_top, uint32_t j_bottom,
                                               uint32_t next_top, uint32_t next_bottom)
    requires(sizeof(T) == 2)
  {
    const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
    const int mat = lane / 8, row = warp * 16 + lane % 8 + 8 * (mat % 2);
    ptx::stmatrix_x4(ptx::smem_addr(staging) + (j / 8) * 64 * 128 + row * 128 +
                         (((j % 8) + mat / 2) ^ (row % 8)) * 16,
                     j_top, j_bottom, next_top, next_bottom);
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

// --- FP8 (launch_fp8_expert_wgrad) -----------------------------------------------------------

// An expert's K blocks in chunks of at most kFp8ChunkBlocks: a chunk's B scale rows fit a
// weight-scale slot (fp8_weight_scale_box), and the pipeline counts each chunk as a tile (its
// scales come with its first stage).
constexpr int32_t kFp8ChunkBlocks = 248;
// The FP8 K loop unrolled by 4, as the standalone FP8 GEMM's (fp8_grouped_gemm.cu): the
// compiler schedules the next block's stage wait and scale loads into the previous block's
// promotion. (The megakernels keep 1: their code size is what limits them.)
constexpr int kFp8KUnroll = 4;
constexpr int32_t kFp8ChunkScaleBox = gemm::fp8_weight_scale_box(kFp8ChunkBlocks);
static_assert(kFp8ChunkScaleBox <= 256 &&
              kFp8ChunkScaleBox * 4 <= gemm::kFp8WeightScaleRowBytes);
// The tiles of a CTA, read ahead into a ring in shared memory by a warp of their own (the tile
// reader: the producer warpgroup's second warp, otherwise idle); the producer and the consumers
// take them from it. NOTES: a tile's K origin and K come from global memory (seg_offset,
// expert_rows), and the compiler consumes loaded values within the iteration that loads them, so
// a thread that looked its tiles up itself waited one global load at each tile's start, and the
// producer issued the tile's first loads that much later. The reader runs up to kTileRingSlots
// tiles ahead, off every path that feeds the tensor cores.
constexpr int kTileRingSlots = 8;
struct TileRing {
  gemm::TileCoord tile[kTileRingSlots];
  int32_t k_blocks[kTileRingSlots];
  uint64_t full[kTileRingSlots];   // the reader's arrival: the slot holds the next tile
  uint64_t empty[kTileRingSlots];  // kTileRingReaders arrivals: every reader took it
};
constexpr uint32_t kTileRingReaders = 1 + 2 * 128;  // the producer thread and every consumer
// One reader's walk over the ring: take() waits for the next tile and arrives once read.
struct TileRingCursor {
  TileRing* ring;
  int slot = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ int32_t take(gemm::TileCoord* c) {
    ptx::mbarrier_wait(&ring->full[slot], parity);
    const volatile TileRing* r = ring;
    c->m_tile = r->tile[slot].m_tile;
    c->n_tile = r->tile[slot].n_tile;
    c->expert = r->tile[slot].expert;
    c->rows = r->tile[slot].rows;
    c->a_row = r->tile[slot].a_row;
    const int32_t k_blocks = r->k_blocks[slot];
    ptx::mbarrier_arrive(&ring->empty[slot]);
    if (++slot == kTileRingSlots) slot = 0, parity ^= 1;
    return k_blocks;
  }
};

// The FP8 storage: the bf16 form's, then the stages' row-scale boxes and the weight-scale slots,
// then the tile ring.
constexpr size_t kFp8RingOffset =
    sizeof(Smem) + kStages * gemm::kFp8ScaleBoxBytes + gemm::kFp8WeightScaleBytes<kStages>;
constexpr size_t kFp8SmemBytes = kFp8RingOffset + sizeof(TileRing);
static_assert(kFp8SmemBytes <= 227 * 1024);

struct Fp8WgradParams {
  WgradParams base;
  int32_t k_cap_blocks;  // max_rows / 128: a B scale row's length
  int32_t n_blocks;      // n / 128
};

// One tile: its expert's K blocks (real rows, rounded up to 128) from the expert's first row.
__device__ __forceinline__ int32_t fp8_k_blocks(const WgradParams& p, const gemm::TileCoord& c) {
  const int64_t k = p.expert_rows ? p.expert_rows[c.expert]
                                  : p.seg_offset[c.expert + 1] - p.seg_offset[c.expert];
  return static_cast<int32_t>((k + fp8::kBlock - 1) / fp8::kBlock);
}

// Where chunk [first, first + n) of tile c's K blocks has its two B scale rows.
__device__ __forceinline__ void fp8_b_rows(const Fp8WgradParams& p, const gemm::TileCoord& c,
                                           int32_t first, int32_t* row0, int32_t* row1) {
  const int32_t k0 = c.a_row / fp8::kBlock + first;
  const int32_t b0 = 2 * c.n_tile, b1 = min(2 * c.n_tile + 1, p.n_blocks - 1);
  *row0 = b0 * p.k_cap_blocks + k0;
  *row1 = b1 * p.k_cap_blocks + k0;
}

// The FP8 weight gradients: dw[e] = A_eᵀ B_e with A and B given transposed and K-major (A: packed
// rows, a scale per row and 128 K; B: e4m3 with 128 x 128 block scales), K = the expert's rows
// in chunks (each a pipeline tile); the consumers keep their accumulators across the chunks and
// write through WgradSink as the bf16 form does. An expert without rows writes zeros.
template <class Sink>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    fp8_expert_wgrad_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_a_scales,
                            const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_b_scales,
                            const __grid_constant__ CUtensorMap map_dw, const Fp8WgradParams fp) {
  auto& s = gemm::dynamic_smem<Smem>();
  uint8_t* row_scale_boxes = reinterpret_cast<uint8_t*>(&s) + sizeof(s);
  uint8_t* weight_scale_slots = row_scale_boxes + kStages * gemm::kFp8ScaleBoxBytes;
  auto* ring = reinterpret_cast<TileRing*>(reinterpret_cast<uint8_t*>(&s) + kFp8RingOffset);
  const WgradParams& p = fp.base;
  const int wg = gemm::warpgroup_index();
  if (threadIdx.x == 0) {
    gemm::check_dynamic_smem_alignment();
    for (int i = 0; i < kTileRingSlots; ++i) {
      ptx::mbarrier_init(&ring->full[i], 1);
      ptx::mbarrier_init(&ring->empty[i], kTileRingReaders);
    }
    gemm::init_stage_barriers(s);  // and the fence that publishes every barrier
    for (const CUtensorMap* m : {&map_a, &map_a_scales, &map_b, &map_b_scales, &map_dw})
      ptx::prefetch_tensor_map(m);
  }
  __syncthreads();
  const int64_t tiles = int64_t{p.experts} * p.m_tiles * p.n_tiles;
  gemm::PipelineState<kStages> ps;
  TileRingCursor cursor{ring};
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 32) {  // the tile reader
      int slot = 0;
      uint32_t parity = 0;
      for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        ptx::mbarrier_wait(&ring->empty[slot], parity ^ 1);
        const gemm::TileCoord c = wgrad_tile(p, t);
        ring->tile[slot] = c;
        ring->k_blocks[slot] = fp8_k_blocks(p, c);
        ptx::mbarrier_arrive(&ring->full[slot]);
        if (++slot == kTileRingSlots) slot = 0, parity ^= 1;
      }
      return;
    }
    if (threadIdx.x != 0) return;
    constexpr uint32_t kBytes =
        (kTileRows + kTileCols) * fp8::kBlock + gemm::kFp8ScaleBoxBytes;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      gemm::TileCoord c;
      const int32_t k_blocks = cursor.take(&c);
      for (int32_t first = 0; first < k_blocks; first += kFp8ChunkBlocks) {
        const int32_t n = min(kFp8ChunkBlocks, k_blocks - first);
        int32_t row0, row1;
        fp8_b_rows(fp, c, first, &row0, &row1);
        for (int32_t kb = 0; kb < n; ++kb, ps.advance()) {
          ptx::mbarrier_wait(&s.empty[ps.stage], ps.phase ^ 1);
          uint64_t* full = &s.full[ps.stage];
          const int32_t k = c.a_row / fp8::kBlock + first + kb;  // the K block
          if (kb == 0) {
            ptx::mbarrier_arrive_expect_tx(full, kBytes + 2 * 4 * kFp8ChunkScaleBox);
            uint8_t* slot = weight_scale_slots + ps.scale_slot * 2 * gemm::kFp8WeightScaleRowBytes;
            ptx::tma_load_1d(slot, &map_b_scales, row0 & ~3, full);
            ptx::tma_load_1d(slot + gemm::kFp8WeightScaleRowBytes, &map_b_scales, row1 & ~3,
                             full);
          } else {
            ptx::mbarrier_arrive_expect_tx(full, kBytes);
          }
          ptx::tma_load_2d(s.a[ps.stage], &map_a, k * fp8::kBlock, c.m_tile * kTileRows, full);
          ptx::tma_load_2d(row_scale_boxes + ps.stage * gemm::kFp8ScaleBoxBytes, &map_a_scales,
                           (k & ~3) * 4, c.m_tile * kTileRows, full);
          ptx::tma_load_2d(s.b[ps.stage], &map_b, k * fp8::kBlock, c.n_tile * kTileCols, full);
        }
        ps.next_tile();
      }
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    const int tid = threadIdx.x % 128;
    Sink sink;
    sink.map_dw = &map_dw;
    sink.dw_order = p.dw_order;
    sink.staging = s.out[wg - 1];
    sink.accumulate = p.accumulate;
    gemm::fp8_turns_begin(wg - 1);
    gemm::Fp8Scales sc;
    sc.a_smem = row_scale_boxes;
    sc.b_smem = weight_scale_slots;
    sc.n_blocks = fp.n_blocks;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      gemm::TileCoord c;
      const int32_t k_blocks = cursor.take(&c);
      float acc[kTileCols / 2];
#pragma unroll
      for (int i = 0; i < kTileCols / 2; ++i) acc[i] = 0.0f;
      for (int32_t first = 0; first < k_blocks; first += kFp8ChunkBlocks) {
        const int32_t n = min(kFp8ChunkBlocks, k_blocks - first);
        sc.k0 = c.a_row / fp8::kBlock + first;
        fp8_b_rows(fp, c, first, &sc.b_row0, &sc.b_row1);
        gemm::fp8_mainloop<Epilogue::kStore, kFp8KUnroll, kStages,
                           gemm::kStagingBytes<Epilogue::kStore>, true>(s, ps, c, n, wg - 1, sc,
                                                                        acc);
        ps.next_tile();
      }
      sink.prepare(c, wg - 1, tid);
      gemm::write_direct_passes(sink, acc, wg - 1, tid);
    }
    if (tid == 0) ptx::tma_store_wait_all();  // staging must outlive the stores
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

cudaError_t launch_fp8_expert_wgrad(const Fp8ExpertWgradArgs& a, cudaStream_t stream) {
  const ExpertSegments& seg = a.segments;
  constexpr int64_t kB = fp8::kBlock;
  if (!seg.valid() || a.m <= 0 || a.m % kB != 0 || a.n <= 0 || a.n % kB != 0 ||
      seg.max_rows / kB > (int64_t{1} << 30) / kB)
    return cudaErrorInvalidValue;
  if (seg.experts == 0) return cudaSuccess;
  if (!seg.seg_offset || !a.a_t || !a.b_t || !a.b_scales || !a.dw ||
      reinterpret_cast<uintptr_t>(a.b_scales) % 16 != 0)
    return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (a.max_ctas > 0 && a.max_ctas < sm_count) sm_count = a.max_ctas;
  // A_t: packed rows [m, packed_row_bytes(max_rows)] (the rows' maps of the FP8 GEMMs); B_t
  // [n, max_rows] e4m3 in boxes of one K block x 256 rows; its scales [n / 128, max_rows / 128]
  // as a 1-D array; dw as in the bf16 form. A max_rows of 0 still maps one (never read) block.
  const int64_t k_cap = seg.max_rows > 0 ? seg.max_rows : kB;
  const uint64_t a_dims[2] = {uint64_t(k_cap), uint64_t(a.m)};
  const uint64_t a_stride[1] = {uint64_t(fp8::packed_row_bytes(k_cap))};
  const uint32_t a_box[2] = {uint32_t(kB), uint32_t(kTileRows)};
  const uint64_t as_dims[2] = {uint64_t(k_cap / kB * 4), uint64_t(a.m)};
  const uint32_t as_box[2] = {16, uint32_t(kTileRows)};
  const uint64_t b_dims[2] = {uint64_t(k_cap), uint64_t(a.n)};
  const uint32_t b_box[2] = {uint32_t(kB), uint32_t(kTileCols)};
  const uint64_t dw_dims[3] = {uint64_t(a.n), uint64_t(a.m), uint64_t(seg.experts)};
  const int64_t dw_elem = a.fp32_out ? 4 : 2;
  Fp8WgradParams p;
  uint64_t dw_strides[2] = {uint64_t(a.n * dw_elem), 0};
  const void* dw = gemm::expert_map_base(a.dw, seg.experts, a.m * a.n, dw_elem,
                                         a.dw_expert_stride, &dw_strides[1], &p.base.dw_order);
  const uint32_t dw_box[3] = {a.fp32_out ? 32u : 64u, 64, 1};
  CUtensorMap map_a, map_a_scales, map_b, map_b_scales, map_dw;
  if (!encode_u8_tensor_map(&map_a, a.a_t, 2, a_dims, a_box, a_stride).ok() ||
      !encode_u8_tensor_map_unswizzled(&map_a_scales, a.a_t + k_cap, 2, as_dims, as_box,
                                       a_stride)
           .ok() ||
      !encode_u8_tensor_map(&map_b, a.b_t, 2, b_dims, b_box).ok() ||
      !encode_f32_vector_map(&map_b_scales, a.b_scales, uint64_t(a.n / kB) * (k_cap / kB),
                             kFp8ChunkScaleBox)
           .ok() ||
      !(a.fp32_out ? encode_f32_tensor_map(&map_dw, dw, 3, dw_dims, dw_box, dw_strides)
                   : encode_bf16_tensor_map(&map_dw, dw, 3, dw_dims, dw_box, dw_strides))
           .ok())
    return cudaErrorInvalidValue;
  p.base.seg_offset = seg.seg_offset;
  p.base.expert_rows = seg.expert_rows;
  p.base.experts = seg.experts;
  p.base.accumulate = a.accumulate;
  p.base.m_tiles = static_cast<int32_t>((a.m + kTileRows - 1) / kTileRows);
  p.base.n_tiles = static_cast<int32_t>((a.n + kTileCols - 1) / kTileCols);
  p.k_cap_blocks = static_cast<int32_t>(k_cap / kB);
  p.n_blocks = static_cast<int32_t>(a.n / kB);
  const int64_t tiles = int64_t{seg.experts} * p.base.m_tiles * p.base.n_tiles;
  const int grid = static_cast<int>(tiles < sm_count ? tiles : sm_count);
  auto* kernel = a.fp32_out ? fp8_expert_wgrad_kernel<WgradSink<float>>
                            : fp8_expert_wgrad_kernel<WgradSink<__nv_bfloat16>>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kFp8SmemBytes));
      e != cudaSuccess)
    return e;
  kernel<<<grid, gemm::kThreads, kFp8SmemBytes, stream>>>(map_a, map_a_scales, map_b,
                                                          map_b_scales, map_dw, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
