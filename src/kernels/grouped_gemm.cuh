// Grouped GEMM over the expert-grouped rows: for every 128-row tile (inside one expert's segment,
// the schedule pads segments to the tile) and every N tile, out = rows * W_e^T, where W_e is the
// tile's expert's [N, K] weight (nn.Linear layout, K-major like the rows: the "TN" GEMM).
//
// Hopper design (sm_90a): persistent CTAs of three warpgroups. Warpgroup 0 is the producer: one
// thread issues TMA tile loads (rows 128 x 64, weights 256 x 64, both 128B-swizzled) into a
// kStages-deep shared-memory ring guarded by full/empty mbarriers. Warpgroups 1 and 2 are
// consumers: each owns 64 rows of the tile and runs wgmma m64n256k16 from shared memory into 128
// fp32 accumulators per thread, then the epilogue: bf16 into a 128B-swizzled staging tile in
// shared memory (bank-conflict free), then TMA stores that drain while the warpgroup already
// runs the next tile's mainloop. setmaxnreg moves registers from the producer to the consumers.
// The producer runs ahead into the next tile while consumers finish the epilogue.
//
// Weights: kK, [N, K] per expert with K contiguous (nn.Linear's weight in x W^T: the forward);
// kN, [K, N] per expert with N contiguous (the same weight in dy W: the backward's input
// gradients, wgmma's transposed B). A kN tile's K may come from two weights, the first
// b0_k_blocks k-blocks from map_b0 and the rest from map_b1 ([dg | du] [W_gate; W_up]).
//
// Epilogues: kSwiGLU (gate/up): the 256 B rows are 128 gate rows then the same 128 up rows of
// expert e, so each thread holds gate and up of the same columns and writes silu(g) * u as bf16
// (no [rows, 2I] tensor); kStore (down): writes the 256 columns as bf16.
//
// Operands::kFP8 (the FP8 layer): e4m3 rows and weights with block scales (DeepSeek-V3's 1 x 128
// and 128 x 128, Fp8Scales). A K block is then 128 elements, one scale block and again 128 bytes
// a row, so stages, boxes and swizzle are the bf16 ones byte for byte. Each consumer warpgroup
// multiplies its 64 rows by the tile's two 128-column halves in turn, m64n128k32 e4m3 wgmmas
// into 64 partial sums per half, and promotes them into the fp32 accumulators with the row's
// and the half's weight-block scale (the tensor cores' FP8 accumulation keeps too few bits for a
// whole K). The partial sums land in the same registers a bf16 m64n256 tile's accumulators
// would, so the epilogues are shared; kSwiGLU also quantizes h 1 x 128 in its epilogue.
//
// The tile loop is split into produce_tile / consume_tile so a persistent megakernel can feed
// tiles one at a time ("compute tile (m, n) once its rows are ready"); grouped_gemm_kernel is the
// standalone persistent driver.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/fp8_blocks.h"
#include "common/routing_schedule.h"
#include "common/tile.h"
#include "kernels/tensor_map.h"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace epflow::kernels::gemm {

enum class Epilogue { kSwiGLU, kStore };
enum class WeightMajor { kK, kN };
// The row operand A: kK, rows [M, K] with K contiguous (activations times weights); kM, the
// reduction runs down the rows (weight gradients: A = dyᵀ over an expert's rows, M contiguous),
// loaded like an N-major weight tile: 64 M x 64 K boxes, one per consumer warpgroup.
enum class RowsMajor { kK, kM };
enum class Operands { kBF16, kFP8 };

inline constexpr int kBlockK = 64;   // one 128-byte swizzle row of bf16
inline constexpr int kThreads = 384;  // producer + 2 consumer warpgroups
inline constexpr int kGroupM = 8;     // tiles are walked in bands of kGroupM row tiles
// Elements of a K block: 128 bytes of a row either way.
template <Operands kOp>
inline constexpr int kBlockKElems = kOp == Operands::kFP8 ? fp8::kBlock : kBlockK;

template <Epilogue kEpi>
inline constexpr int kOutCols = kEpi == Epilogue::kSwiGLU ? kTileCols / 2 : kTileCols;

// Where an FP8 tile's fp32 block scales are, for its consumers. A (1 x 128): in shared memory,
// a box of kFp8ScaleBoxBytes per stage at a_smem (the producer loads it with the stage's tiles,
// Fp8ScaleLoads): stage kb's box holds the tile's row r's scales of the four K blocks from
// kb & ~3 at bytes 16 r .. 16 r + 15. B (128 x 128; in global memory [experts, n_blocks,
// k_blocks] each): in shared memory too, the tile's two rows of k_blocks scales in one of the
// weight-scale slots at b_smem (fp8_weight_scale_row says which blocks). power_of_two: h's scales
// in the kSwiGLU epilogue.
struct Fp8Scales {
  const uint8_t* a_smem = nullptr;
  const uint8_t* b_smem = nullptr;
  int32_t n_blocks = 0;
  bool power_of_two = false;
  // K-grouped tiles (fp8_mainloop's kKGrouped: the FP8 weight gradients, K = an expert's rows):
  // the tile's first K block k0 (the rows' scale boxes hold blocks from a multiple of 4), and
  // where its two B scale rows start in their 1-D arrays.
  int32_t k0 = 0, b_row0 = 0, b_row1 = 0;
};

// The rows' scales (Operands::kFP8) as the producer loads them: a TMA map of the rows' scale bytes
// (u8, unswizzled, dims {k_blocks * 4, rows}, boxes of {16, kTileRows}: four K blocks' scales of
// every row of a tile, 2 KB; out-of-range blocks read as zeros) into per-stage boxes
// (Fp8Scales::a_smem). NOTES: the rows' scales as per-thread global loads (a load per row and K
// block) cost ~8% of the FP8 GEMM; through shared memory they come with the stage, as DeepGEMM's
// do. Each stage loads its group's whole box again: one box per four K blocks, or loaded ahead
// in quarters, ran the GEMM slower (docs/benchmarks.md).
inline constexpr uint32_t kFp8ScaleBoxBytes = kTileRows * 16;

// The weights' scales of a tile: a row of k_blocks fp32 per 128-column half (kSwiGLU: the gate
// and the up matrix's block row n_tile; kStore: block rows 2 n_tile and 2 n_tile + 1), loaded by
// the producer with the tile's first stage into a slot of kFp8WeightScaleSlots, read by the
// consumers with ld.shared. A slot outlives its tile: the producer refills it kStages + 1 tiles
// later, when the stage it fills proves both consumers released a stage of a later tile (every
// tile has at least one K block). Each row comes as a 1-D box of fp8_weight_scale_box(k_blocks)
// floats starting at the 16-byte boundary below the row (a TMA box starts on one), so the row sits
// (index % 4) floats into its slot; boxes past the array read zeros. NOTES: per-thread loads of
// the weights' scales (one per half and K block, issued a block ahead) cost ~2% of the FP8 GEMM
// (docs/design/fp8_forward.md); loading them per stage (two more TMA issues each) cost more than
// it saved; per tile the producer issues two.
inline constexpr int kFp8WeightScaleRowBytes = 1024;
template <int kStages>
inline constexpr int kFp8WeightScaleSlots = kStages + 1;
template <int kStages>
inline constexpr uint32_t kFp8WeightScaleBytes =
    kFp8WeightScaleSlots<kStages> * 2 * kFp8WeightScaleRowBytes;
__host__ __device__ constexpr int32_t fp8_weight_scale_box(int32_t k_blocks) {
  return (k_blocks + 6) / 4 * 4;  // covers k_blocks floats from any of the first 4 positions
}
static_assert(fp8_weight_scale_box(fp8::kMaxKBlocks) <= 256 &&
              fp8_weight_scale_box(fp8::kMaxKBlocks) * 4 <= kFp8WeightScaleRowBytes);

// The producer's side of both kinds of scales (Operands::kFP8): rows, the rows' scale map and
// rows_smem its per-stage boxes; weights0 / weights1, 1-D maps over the scales of the halves'
// weight matrices (kSwiGLU: gate, up; kStore: down twice), weights_smem the slots.
struct Fp8ScaleLoads {
  const CUtensorMap* rows = nullptr;
  uint8_t* rows_smem = nullptr;
  const CUtensorMap* weights0 = nullptr;
  const CUtensorMap* weights1 = nullptr;
  uint8_t* weights_smem = nullptr;
  int32_t n_blocks = 0;
};

struct GemmParams {
  const int64_t* seg_offset = nullptr;   // device [experts + 1]
  const int32_t* expert_rows = nullptr;  // device [experts], optional: real rows per expert
  int32_t experts = 0;
  int32_t n_out = 0;  // output columns (I for gate/up, H for down); multiple of 64
  int32_t k = 0;      // reduction length, multiple of kBlockK
  int32_t b0_k_blocks = 0;  // WeightMajor::kN: k-blocks read from map_b0 (0: all of them)
  Fp8Scales fp8;            // Operands::kFP8 only

  static GemmParams of(const int64_t* seg_offset, const int32_t* expert_rows, int32_t experts,
                       int64_t n_out, int64_t k) {
    GemmParams p;
    p.seg_offset = seg_offset;
    p.expert_rows = expert_rows;
    p.experts = experts;
    p.n_out = static_cast<int32_t>(n_out);
    p.k = static_cast<int32_t>(k);
    return p;
  }
};

// Output staging of one consumer warpgroup: its 64 rows as kOutCols / 64 boxes of 64 rows x
// 128 B (64 bf16), each 128B-swizzled like the output tensor map.
template <Epilogue kEpi>
inline constexpr int kStagingBytes = 64 * kOutCols<kEpi> * 2;

// Shared memory of one GEMM CTA: kStages A/B stages and one output staging buffer per consumer
// warpgroup. A megakernel that runs both epilogues sizes the staging for the larger (kStore).
template <int kStages, int kStaging>
struct alignas(1024) GemmSmem {
  uint8_t a[kStages][kTileRows * kBlockK * 2];
  uint8_t b[kStages][kTileCols * kBlockK * 2];
  uint8_t out[2][kStaging];
  uint64_t full[kStages];
  uint64_t empty[kStages];
};
template <Epilogue kEpi, int kStages>
using SharedStorage = GemmSmem<kStages, kStagingBytes<kEpi>>;

// The calling thread's warpgroup (threadIdx.x / 128). NOTES: computed from threadIdx.x it is not
// provably warp-uniform to the compiler, which then kept the stage and descriptor arithmetic
// derived from it in per-thread registers and moved each wgmma's descriptors into uniform
// registers (R2UR) inside the K loops; taken from lane 0 by a shuffle it is uniform by
// construction, and that arithmetic runs on the uniform datapath.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

// Position in the ring of stages, with the phase parity of its barriers (and, for a
// megakernel's producer, bit i: the parity of stage i's next StageTags::read wait).
// scale_slot: the FP8 weight-scale slot of the current tile (kFp8WeightScaleSlots), advanced
// per tile by both sides, which see the same tiles in the same order.
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  uint32_t tag_parity = 0;
  int scale_slot = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  __device__ void next_tile() {
    if (++scale_slot == kFp8WeightScaleSlots<kStages>) scale_slot = 0;
  }
};

struct TileCoord {
  int32_t m_tile, n_tile, expert;
  int32_t rows;   // rows of the tile that hold routed data (kTileRows when not known)
  int32_t a_row;  // first row of the tile in the row operand and output tensors
};

// The expert coordinate of a weight map: expert e's matrix sits at coordinate e, or at last - e
// in a map of experts laid out from the last to the first (a negative expert stride: the map
// starts at the last expert's matrix and runs forward, since TMA strides are positive).
struct ExpertOrder {
  int32_t last = -1;  // < 0: in order
  __host__ __device__ __forceinline__ int32_t operator()(int32_t e) const {
    return last < 0 ? e : last - e;
  }
};
struct WeightOrders {
  ExpertOrder b0, b1;  // of produce_tile's map_b0, map_b1
};

// Where the scales of the weight block row feeding half `half` of tile c start, in floats of the
// [experts, n_blocks, k_blocks] array (Operands::kFP8).
template <Epilogue kEpi>
__device__ __forceinline__ int32_t fp8_weight_scale_row(const TileCoord& c, int half,
                                                        int32_t n_blocks, int32_t k_blocks) {
  // kStore: a last tile past n reads zero weights (TMA), so any block's scale does for its
  // second half.
  const int32_t block =
      kEpi == Epilogue::kSwiGLU ? c.n_tile : min(2 * c.n_tile + half, n_blocks - 1);
  return (c.expert * n_blocks + block) * k_blocks;
}

inline constexpr int kRowBoxM = 16;  // granularity of partial row loads (decode-size tiles)

// Direct epilogues: thread (warp w, lane g*4+q) holds, per n8 block j, columns 8j+2q, +1 of its
// rows (the wgmma accumulator layout). `pairs` holds its bf16 pairs of blocks 4i .. 4i+3; the
// four lanes of the quad swap them so that lane q returns block 4i+q whole (8 columns, 16
// bytes): a quad then writes 64 contiguous bytes of a row, whole 32-byte sectors, with a quarter
// of the stores of writing pairs.
__device__ __forceinline__ uint4 quad_gather_block(const uint32_t (&pairs)[4], int q) {
  uint32_t out[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int want = q ^ r;  // the block lane q ^ r needs from this lane
    const uint32_t send = want == 0   ? pairs[0]
                          : want == 1 ? pairs[1]
                          : want == 2 ? pairs[2]
                                      : pairs[3];
    const uint32_t got = __shfl_xor_sync(0xffffffffu, send, r);
    // `got` is lane (q ^ r)'s pair of block 4i + q: columns 2 (q ^ r), +1 of the block.
    out[0] = (q ^ r) == 0 ? got : out[0];
    out[1] = (q ^ r) == 1 ? got : out[1];
    out[2] = (q ^ r) == 2 ? got : out[2];
    out[3] = (q ^ r) == 3 ? got : out[3];
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// SwiGLU's sigmoid, shared by the forward's epilogues and the backward's recompute (so both
// round h alike). NOTES: __fdividef (an approximate reciprocal) rather than '/': the correctly
// rounded division costs a reciprocal, its correction and a slow-path check per element while
// the epilogue keeps the tensor cores idle; it differs by a few ulp (within the CPU reference's
// tolerances) and gives 0 where 1 + exp(-g) overflows, as the exact value rounds to anyway.
__device__ __forceinline__ float sigmoid(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }

// silu(g) = g * sigmoid(g) = x + x tanh(x) with x = g / 2: one MUFU operation (tanh.approx,
// relative error ~2^-11) instead of sigmoid's two (exp, reciprocal). The FP8 epilogue's h is
// quantized to e4m3 (3 mantissa bits) right after, so the approximation stays below its rounding.
__device__ __forceinline__ float silu_tanh(float g) {
  const float x = 0.5f * g;
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
  return fmaf(x, t, x);
}

__device__ __forceinline__ uint32_t bf16_pair(float v0, float v1) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(v0, v1);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float2 bf16_pair_to_float2(uint32_t pair) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
}

// Tile t of the walk: bands of kGroupM row tiles; inside a band, row tiles vary fastest, so the
// CTAs running at once share weight tiles (same expert, same n) through L2.
__device__ __forceinline__ TileCoord tile_coord(int64_t t, int32_t m_tiles, int32_t n_tiles,
                                                const int64_t* seg_offset,
                                                const int32_t* expert_rows, int32_t experts) {
  const int64_t band_tiles = int64_t{kGroupM} * n_tiles;
  const int32_t band = static_cast<int32_t>(t / band_tiles);
  const int32_t in_band = static_cast<int32_t>(t % band_tiles);
  const int32_t band_m = min(kGroupM, m_tiles - band * kGroupM);
  TileCoord c;
  c.m_tile = band * kGroupM + in_band % band_m;
  c.n_tile = in_band / band_m;
  c.expert = sched::expert_of_row(seg_offset, experts, int64_t{c.m_tile} * kTileRows);
  c.rows = kTileRows;
  c.a_row = c.m_tile * kTileRows;
  if (expert_rows) {
    const int64_t left =
        seg_offset[c.expert] + expert_rows[c.expert] - int64_t{c.m_tile} * kTileRows;
    c.rows = static_cast<int32_t>(left < kTileRows ? left : kTileRows);  // >= 1: no all-padding tile
  }
  return c;
}

// What a megakernel's dynamic schedule tells the consumers about the tile whose first stage is
// stage i: its task (-1: no more tasks) and the tile the producer already looked up, so the
// consumers start their MMAs without dependent global loads of their own.
struct StageTag {
  int64_t task;
  int32_t kind;  // the task's kind (the megakernel's mega::TaskKind)
  TileCoord tile;
};

// The tags of a megakernel's stages, and per stage an mbarrier every consumer thread arrives on
// once it has read the stage's tag (kTagReaders arrivals), which the producer waits for before it
// writes that stage's next tag. NOTES: the consumers' release of a stage already implies they
// read its tag (the wgmma they issue after reading it must finish first), but compute-sanitizer
// racecheck cannot see that ordering and reported the overwrite as a race; this edge it sees.
struct StageTags {
  StageTag* tag = nullptr;
  uint64_t* read = nullptr;
};
inline constexpr uint32_t kTagReaders = 256;  // the two consumer warpgroups

// Producer: wait until the consumers have read the last tag of the current stage.
template <int kStages>
__device__ __forceinline__ void wait_tag_read(const StageTags& tags, PipelineState<kStages>& ps) {
  ptx::mbarrier_wait(&tags.read[ps.stage], ((ps.tag_parity >> ps.stage) & 1) ^ 1);
  ps.tag_parity ^= 1u << ps.stage;
}

template <Epilogue kEpi, int kStages, int kStaging, WeightMajor kMajor = WeightMajor::kK,
          Operands kOp = Operands::kBF16>
__device__ __forceinline__ void produce_tile(GemmSmem<kStages, kStaging>& s,
                                             PipelineState<kStages>& ps, const TileCoord& c,
                                             int32_t k_blocks, const CUtensorMap* map_a,
                                             const CUtensorMap* map_a_rows,
                                             const CUtensorMap* map_b0, const CUtensorMap* map_b1,
                                             const StageTags& tags = {}, int64_t task_id = 0,
                                             int32_t task_kind = 0, int32_t b0_k_blocks = 0,
                                             const Fp8ScaleLoads& scales = {},
                                             const WeightOrders& orders = {}) {
  // tags (a megakernel's dynamic schedule): the tile's tag, written next to its first stage for
  // the consumers to read once that stage is full.
  // NOTES: a full tile loads its 128 rows in one box; a tile with few routed rows (decode
  // sizes) loads only whole 16-row boxes covering them: the rest of the A stage keeps stale
  // data, which only feeds output rows that are padding (never read: combine skips them).
  constexpr int kKElems = kBlockKElems<kOp>;
  const bool full_rows = c.rows == kTileRows;
  const int32_t row_boxes = (c.rows + kRowBoxM - 1) / kRowBoxM;
  const uint32_t a_bytes = (full_rows ? kTileRows : row_boxes * kRowBoxM) * kBlockK * 2;
  const uint32_t bytes =
      a_bytes + kTileCols * kBlockK * 2 + (kOp == Operands::kFP8 ? kFp8ScaleBoxBytes : 0);
  const int32_t w_scale_box = fp8_weight_scale_box(k_blocks);
  for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance()) {
    ptx::mbarrier_wait(&s.empty[ps.stage], ps.phase ^ 1);
    if (tags.tag && kb == 0) {
      wait_tag_read(tags, ps);
      tags.tag[ps.stage] = StageTag{task_id, task_kind, c};
    }
    uint64_t* full = &s.full[ps.stage];
    if (kOp == Operands::kFP8 && kb == 0) {
      // The tile's weight scales, counted in its first stage (Fp8ScaleLoads).
      ptx::mbarrier_arrive_expect_tx(full, bytes + 2 * 4 * w_scale_box);
      uint8_t* slot = scales.weights_smem + ps.scale_slot * 2 * kFp8WeightScaleRowBytes;
      const int32_t row0 = fp8_weight_scale_row<kEpi>(c, 0, scales.n_blocks, k_blocks);
      const int32_t row1 = fp8_weight_scale_row<kEpi>(c, 1, scales.n_blocks, k_blocks);
      ptx::tma_load_1d(slot, scales.weights0, row0 & ~3, full);
      ptx::tma_load_1d(slot + kFp8WeightScaleRowBytes, scales.weights1, row1 & ~3, full);
    } else {
      ptx::mbarrier_arrive_expect_tx(full, bytes);
    }
    if (full_rows) {
      ptx::tma_load_2d(s.a[ps.stage], map_a, kb * kKElems, c.a_row, full);
    } else {
      for (int32_t box = 0; box < row_boxes; ++box)
        ptx::tma_load_2d(s.a[ps.stage] + box * kRowBoxM * kBlockK * 2, map_a_rows, kb * kKElems,
                         c.a_row + box * kRowBoxM, full);
    }
    // All 128 rows (rows past the routed ones feed padding). NOTES: a TMA box must start on a
    // 16-byte boundary in its innermost dimension (otherwise: illegal instruction), so each stage
    // loads the aligned group of four K blocks holding its own.
    if constexpr (kOp == Operands::kFP8)
      ptx::tma_load_2d(scales.rows_smem + ps.stage * kFp8ScaleBoxBytes, scales.rows,
                       (kb & ~3) * 4, c.a_row, full);
    if constexpr (kMajor == WeightMajor::kN) {
      // Four boxes of 64 N x 64 K, 8 KB apart (the layout smem_desc_n_major_sw128 describes).
      static_assert(kEpi == Epilogue::kStore && kOp == Operands::kBF16,
                    "N-major weights feed plain bf16 outputs");
      const bool first = b0_k_blocks == 0 || kb < b0_k_blocks;
      const CUtensorMap* map_b = first ? map_b0 : map_b1;
      const int32_t k = (first ? kb : kb - b0_k_blocks) * kBlockK;
      const int32_t expert = first ? orders.b0(c.expert) : orders.b1(c.expert);
#pragma unroll
      for (int box = 0; box < kTileCols / 64; ++box)
        ptx::tma_load_3d(s.b[ps.stage] + box * 64 * kBlockK * 2, map_b,
                         c.n_tile * kTileCols + box * 64, k, expert, full);
    } else if constexpr (kEpi == Epilogue::kSwiGLU) {
      constexpr int kHalf = kTileCols / 2;
      ptx::tma_load_3d(s.b[ps.stage], map_b0, kb * kKElems, c.n_tile * kHalf, orders.b0(c.expert),
                       full);
      ptx::tma_load_3d(s.b[ps.stage] + kHalf * kBlockK * 2, map_b1, kb * kKElems, c.n_tile * kHalf,
                       orders.b1(c.expert), full);
    } else {
      ptx::tma_load_3d(s.b[ps.stage], map_b0, kb * kKElems, c.n_tile * kTileCols,
                       orders.b0(c.expert), full);
    }
  }
  ps.next_tile();
}

// TMA stores of one consumer warpgroup's staged output rows (64 rows x kOutCols columns: bf16
// in boxes of 64 columns, or e4m3 in one box of 128).
template <Epilogue kEpi, Operands kOut = Operands::kBF16>
__device__ __forceinline__ void store_staging(const CUtensorMap* map_out, const uint8_t* staging,
                                              const TileCoord& c, int wg) {
  constexpr int kBoxCols = kOut == Operands::kFP8 ? 128 : 64;
#pragma unroll
  for (int box = 0; box < kOutCols<kEpi> / kBoxCols; ++box)
    ptx::tma_store_2d(map_out, staging + box * 64 * 128, c.n_tile * kOutCols<kEpi> + box * kBoxCols,
                      c.a_row + wg * 64);
  ptx::tma_store_commit();
}

// Where a consumer warpgroup's epilogue output goes. Staged sinks (kDirect = false):
// acquire(): every thread of the warpgroup, before it writes the staging buffer; publish(): every
// thread, once the staging is written and fenced for the async proxy. Direct sinks (kDirect,
// kStore only) take the values from registers: prepare(c, wg, tid) before the mainloop (where
// the rows go: its loads land while the MMAs run), begin(wg, tid) once the MMAs are done, then
// write(j, half, v0, v1) for columns 8j + 2q, 8j + 2q + 1 of row warp*16 + g + 8*half of the
// warpgroup's 64 (lane = 4g + q) or, if the sink has it, write_blocks(j, ...) for even j with
// blocks j and j + 1 as bf16 pairs (ptx::stmatrix_x4's order), then end(wg, tid) if it has one.
// A sink with kWritePasses = P gets begin, the writes of blocks j of one P-th of the columns and
// end, P times in column order (a staging buffer smaller than the tile); with kRolledPasses (such
// a sink has end()), the passes run as a loop and write(j, ...) numbers the n8 blocks within the
// pass (the sink counts its passes). skip(): every thread, in
// place of all of these when the warpgroup's rows are all padding (after it consumed the tile's
// stages).
template <class Sink>
__host__ __device__ constexpr int direct_write_passes() {
  if constexpr (requires { Sink::kWritePasses; })
    return Sink::kWritePasses;
  else
    return 1;
}
template <class Sink>
__host__ __device__ constexpr bool rolled_write_passes() {
  if constexpr (requires { Sink::kRolledPasses; })
    return Sink::kRolledPasses;
  else
    return false;
}
// DirectStoreSink: the standalone GEMM stores its tiles itself.
template <Epilogue kEpi>
struct DirectStoreSink {
  static constexpr bool kDirect = false;
  const CUtensorMap* map_out;
  __device__ void acquire(int wg, int tid) {
    if (tid == 0) ptx::tma_store_wait_read();  // the previous tile's stores are done reading
    ptx::named_barrier_sync(1 + wg, 128);
  }
  __device__ void publish(int wg, int tid, const uint8_t* staging, const TileCoord& c) {
    if (tid == 0) store_staging<kEpi>(map_out, staging, c, wg);
  }
  __device__ void skip(int, int) {}
};

// The FP8 consumers take turns on the tensor cores: warpgroup w issues a group of wgmmas only
// after the other issued its previous one (hardware barriers kTurnBarrier + w, 256 threads: the
// waiting warpgroup syncs, the other arrives). NOTES: each warpgroup must wait for its group
// before promoting it (its partial sums are reused), and warpgroups that issue together finish
// together and promote together, leaving the tensor cores idle meanwhile; in turns, one
// promotes while the other's group runs. fp8_turns_begin: warpgroup 1, once before its first
// tile, gives warpgroup 0 the first turn (the last arrival of warpgroup 1 stays unmatched when
// the CTA ends, which leaves nothing waiting).
inline constexpr uint32_t kTurnBarrier = 4;  // 1, 2: the consumers' own; 3: dispatch
__device__ __forceinline__ void fp8_turns_begin(int wg) {
  if (wg == 1) ptx::named_barrier_arrive(kTurnBarrier + 0, 256);
}
__device__ __forceinline__ void fp8_turn_wait(int wg) {
  ptx::named_barrier_sync(kTurnBarrier + wg, 256);
}
__device__ __forceinline__ void fp8_turn_pass(int wg) {
  ptx::named_barrier_arrive(kTurnBarrier + (wg ^ 1), 256);
}

// The FP8 mainloop of one consumer warpgroup (Operands::kFP8): per K block, each 128-column
// half of the tile as four m64n128k32 e4m3 wgmmas into `part` (in turns with the other
// warpgroup), then promoted into acc (the half's registers of an m64n256 accumulator) scaled by
// the row's and the half's block scale, both read from shared memory (Fp8Scales). kKGrouped: K
// starts at block sc.k0 and the B scale rows at sc.b_row0 / b_row1; acc adds to what it holds
// (a K range in chunks, the caller zeroes it first).
template <Epilogue kEpi, int kKUnroll, int kStages, int kStaging, bool kKGrouped = false>
__device__ __forceinline__ void fp8_mainloop(GemmSmem<kStages, kStaging>& s,
                                             PipelineState<kStages>& ps, const TileCoord& c,
                                             int32_t k_blocks, int wg, const Fp8Scales& sc,
                                             float (&acc)[kTileCols / 2]) {
  const int tid = threadIdx.x % 128, warp = tid / 32, g = tid % 32 / 4;
  const uint32_t row_scale0 = ptx::smem_addr(sc.a_smem) + (wg * 64 + warp * 16 + g) * 16;
  const uint32_t slot =
      ptx::smem_addr(sc.b_smem) + ps.scale_slot * 2 * kFp8WeightScaleRowBytes;
  const int32_t b_row0 =
      kKGrouped ? sc.b_row0 : fp8_weight_scale_row<kEpi>(c, 0, sc.n_blocks, k_blocks);
  const int32_t b_row1 =
      kKGrouped ? sc.b_row1 : fp8_weight_scale_row<kEpi>(c, 1, sc.n_blocks, k_blocks);
  const uint32_t b0s = slot + (b_row0 & 3) * 4;
  const uint32_t b1s = slot + kFp8WeightScaleRowBytes + (b_row1 & 3) * 4;
  const uint64_t a_desc0 = ptx::smem_desc_k_major_sw128(ptx::smem_addr(s.a[0]) + wg * 64 * 128);
  const uint64_t b_desc0 = ptx::smem_desc_k_major_sw128(ptx::smem_addr(s.b[0]));
  constexpr uint32_t kHalfBytes = kTileCols / 2 * 128;  // a half's 128 weight rows of 128 B
  // NOTES: acc starts at zero so every K block promotes with one FFMA per value: a first block
  // written as a product made ptxas predicate both forms, issuing both in every block.
  if constexpr (!kKGrouped) {
#pragma unroll
    for (int i = 0; i < kTileCols / 2; ++i) acc[i] = 0.0f;
  }
  float part[kTileCols / 4];
#pragma unroll kKUnroll
  for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance()) {
    ptx::mbarrier_wait(&s.full[ps.stage], ps.phase);
    const uint32_t box =
        row_scale0 + ps.stage * kFp8ScaleBoxBytes + (((kKGrouped ? sc.k0 : 0) + kb) & 3) * 4;
    const float sa0 = ptx::ld_shared_f32(box), sa1 = ptx::ld_shared_f32(box + 8 * 16);
    const float sb0 = ptx::ld_shared_f32(b0s + kb * 4), sb1 = ptx::ld_shared_f32(b1s + kb * 4);
    const uint64_t a_desc = ptx::smem_desc_advance(a_desc0, ps.stage * sizeof(s.a[0]));
    const uint64_t b_desc = ptx::smem_desc_advance(b_desc0, ps.stage * sizeof(s.b[0]));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      fp8_turn_wait(wg);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        ptx::wgmma_m64n128k32_e4m3(part, ptx::smem_desc_advance(a_desc, kk * 32),
                                   ptx::smem_desc_advance(b_desc, half * kHalfBytes + kk * 32),
                                   kk > 0);
      ptx::wgmma_commit_group();
      fp8_turn_pass(wg);
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(part);
      if (half == 1 && tid == 0) ptx::mbarrier_arrive(&s.empty[ps.stage]);
      const float sb = half == 0 ? sb0 : sb1;
      const float s0 = sa0 * sb, s1 = sa1 * sb;
      float* d = acc + half * (kTileCols / 4);
#pragma unroll
      for (int j = 0; j < kTileCols / 16; ++j) {
        const float* v = part + 4 * j;
        d[4 * j] = fmaf(v[0], s0, d[4 * j]), d[4 * j + 1] = fmaf(v[1], s0, d[4 * j + 1]);
        d[4 * j + 2] = fmaf(v[2], s1, d[4 * j + 2]), d[4 * j + 3] = fmaf(v[3], s1, d[4 * j + 3]);
      }
    }
  }
}

// Blocks j (even) and j + 1 of plain accumulators as four bf16 pairs (rows g, g + 8 of block j,
// then of j + 1: ptx::stmatrix_x4's order), for blocks [from, to): put(j, pairs...).
template <class Put>
__device__ __forceinline__ void put_block_pairs(const float* acc, int from, int to, Put&& put) {
#pragma unroll
  for (int j = from; j < to; j += 2) {
    const float* r = acc + 4 * j;
    put(j, bf16_pair(r[0], r[1]), bf16_pair(r[2], r[3]), bf16_pair(r[4], r[5]),
        bf16_pair(r[6], r[7]));
  }
}

// A direct sink's writes of a tile's plain accumulators (acc[kTileCols / 2], the warpgroup's 64
// rows), pass by pass, unrolled, as described above consume_tile: write_blocks by block pairs
// where the sink has it, else write per block.
template <class Sink>
__device__ __forceinline__ void write_direct_passes(Sink& sink, const float* acc, int wg,
                                                    int tid) {
  constexpr int kPasses = direct_write_passes<Sink>();
  constexpr int kPassBlocks = kTileCols / 8 / kPasses;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    sink.begin(wg, tid);
    if constexpr (requires { sink.write_blocks(0, 0u, 0u, 0u, 0u); }) {
      static_assert(kPassBlocks % 2 == 0);
      put_block_pairs(acc, pass * kPassBlocks, (pass + 1) * kPassBlocks,
                      [&](int j, uint32_t p0, uint32_t p1, uint32_t p2, uint32_t p3) {
                        sink.write_blocks(j, p0, p1, p2, p3);
                      });
    } else {
#pragma unroll
      for (int j = pass * kPassBlocks; j < (pass + 1) * kPassBlocks; ++j) {
        sink.write(j, 0, acc[4 * j], acc[4 * j + 1]);
        sink.write(j, 1, acc[4 * j + 2], acc[4 * j + 3]);
      }
    }
    if constexpr (requires { sink.end(wg, tid); }) sink.end(wg, tid);
  }
}

// One consumer warpgroup (wg = 0 or 1: rows 64 wg .. 64 wg + 63 of the tile). kFp8KUnroll
// (Operands::kFP8): the mainloop's K loop unrolled that far. NOTES: unrolled by 4, the standalone
// FP8 GEMM ran 3.5-6% faster (the next block's stage wait, scale loads and descriptors scheduled
// into the previous block's promotion); the megakernels keep 1: unrolled by 4 the FP8 layer ran
// slower (docs/benchmarks.md), though none of its spills (16 / 24 -> 96 / 176 bytes) lands
// inside the K loops; its larger code is the suspect.
template <Epilogue kEpi, int kStages, int kStaging, class Sink,
          WeightMajor kMajor = WeightMajor::kK, RowsMajor kRows = RowsMajor::kK,
          Operands kOp = Operands::kBF16, int kFp8KUnroll = 1>
__device__ __forceinline__ void consume_tile(GemmSmem<kStages, kStaging>& s,
                                             PipelineState<kStages>& ps, const TileCoord& c,
                                             int32_t k_blocks, int wg, Sink& sink,
                                             const Fp8Scales& fp8_scales = {}) {
  const int tid = threadIdx.x % 128;
  if (c.rows <= wg * 64) {
    // NOTES: all 64 rows are segment padding (decode-size batches): keep the pipeline's
    // protocol (every stage consumed and released) without touching the tensor cores. The
    // warpgroup barrier before the release matters: with no wgmma to hold the four warps
    // together, warp 0 would release stages and run on while the other warps still wait, and
    // a warp that falls a whole ring behind waits on a reused stage's next phase of the same
    // parity: it misses its phase and the CTA deadlocks (small token counts, whose small experts
    // leave many padding halves, hit it within a few calls).
    for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance()) {
      ptx::mbarrier_wait(&s.full[ps.stage], ps.phase);
      ptx::named_barrier_sync(1 + wg, 128);
      if (tid == 0) ptx::mbarrier_arrive(&s.empty[ps.stage]);
      if constexpr (kOp == Operands::kFP8)
        for (int half = 0; half < 2; ++half) {  // the other warpgroup's turns go on
          fp8_turn_wait(wg);
          fp8_turn_pass(wg);
        }
    }
    sink.skip(wg, tid);
    ps.next_tile();
    return;
  }
  if constexpr (Sink::kDirect) sink.prepare(c, wg, tid);
  float acc[kTileCols / 2];
  if constexpr (kOp == Operands::kFP8) {
    static_assert(kMajor == WeightMajor::kK && kRows == RowsMajor::kK, "FP8: the forward's GEMMs");
    fp8_mainloop<kEpi, kFp8KUnroll>(s, ps, c, k_blocks, wg, fp8_scales, acc);
  } else {
    constexpr bool kMMajor = kRows == RowsMajor::kM;
    if constexpr (kMMajor) {
      // A weight gradient of an expert with no rows is zero (no wgmma writes the accumulators).
      if (k_blocks == 0)
#pragma unroll
        for (int i = 0; i < kTileCols / 2; ++i) acc[i] = 0.0f;
    }
    // Stage 0's descriptors; a stage and a 16-element step along K are fixed offsets from them.
    const uint64_t a_desc0 =
        kMMajor ? ptx::smem_desc_n_major_sw128(ptx::smem_addr(s.a[0]) + wg * 64 * kBlockK * 2)
                : ptx::smem_desc_k_major_sw128(ptx::smem_addr(s.a[0]) + wg * 64 * 128);
    constexpr uint32_t kAStepBytes = kMMajor ? 16 * 128 : 32;
    constexpr bool kNMajor = kMajor == WeightMajor::kN;
    const uint64_t b_desc0 = kNMajor ? ptx::smem_desc_n_major_sw128(ptx::smem_addr(s.b[0]))
                                     : ptx::smem_desc_k_major_sw128(ptx::smem_addr(s.b[0]));
    // A 16-deep K step: 32 B along a K-major row, or 16 rows of 128 B down an N-major box.
    constexpr uint32_t kBStepBytes = kNMajor ? 16 * 128 : 32;
    // NOTES: release stage kb-1 only after the wgmma group of kb is issued and kb-1's has
    // retired (wait_group 1): the tensor cores always have the next k-block queued.
    PipelineState<kStages> release = ps;
    for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance()) {
      ptx::mbarrier_wait(&s.full[ps.stage], ps.phase);
      const uint64_t a_desc = ptx::smem_desc_advance(a_desc0, ps.stage * sizeof(s.a[0]));
      const uint64_t b_desc = ptx::smem_desc_advance(b_desc0, ps.stage * sizeof(s.b[0]));
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        ptx::wgmma_m64n256k16_bf16<kMMajor ? 1 : 0, kNMajor ? 1 : 0>(
            acc, ptx::smem_desc_advance(a_desc, kk * kAStepBytes),
            ptx::smem_desc_advance(b_desc, kk * kBStepBytes), kb > 0 || kk > 0);
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_fence_operands(acc);
      if (kb > 0) {
        ptx::wgmma_wait_group<1>();
        if (tid == 0) ptx::mbarrier_arrive(&s.empty[release.stage]);
        release.advance();
      }
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(acc);
    if (k_blocks > 0 && tid == 0) ptx::mbarrier_arrive(&s.empty[release.stage]);
  }
  ps.next_tile();

  if constexpr (Sink::kDirect) {
    static_assert(kEpi == Epilogue::kStore, "direct sinks take plain outputs");
    constexpr int kPasses = direct_write_passes<Sink>();
    constexpr int kPassBlocks = kTileCols / 8 / kPasses;
    if constexpr (rolled_write_passes<Sink>()) {
      // The passes as a loop (the sink's code once, not kPasses times: a long epilogue unrolled
      // outgrows the instruction cache): each pass's accumulators into the same registers, by
      // selects on the pass (every index a compile-time constant, so acc stays in registers).
      static_assert(!requires { sink.write_blocks(0, 0u, 0u, 0u, 0u); });
      constexpr int kPassValues = kTileCols / 2 / kPasses;
#pragma unroll 1
      for (int pass = 0; pass < kPasses; ++pass) {
        auto value = [&](int i) {  // acc[pass * kPassValues + i]
          float v = acc[i];
#pragma unroll
          for (int p = 1; p < kPasses; ++p) v = pass == p ? acc[p * kPassValues + i] : v;
          return v;
        };
        sink.begin(wg, tid);
#pragma unroll
        for (int j = 0; j < kPassBlocks; ++j) {
          sink.write(j, 0, value(4 * j), value(4 * j + 1));
          sink.write(j, 1, value(4 * j + 2), value(4 * j + 3));
        }
        sink.end(wg, tid);
      }
    } else {
      write_direct_passes(sink, acc, wg, tid);
    }
  } else {
    // Epilogue. NOTES: thread (warp w, lane g*4+q) holds rows w*16+g (+8) and, per n8 block j,
    // columns 8j+2q+{0,1}: as bf16x2 they go to 16-byte chunk j%8 of a 128-byte staging row,
    // swizzled by the row (chunk ^ row%8). The bf16 outputs go two n8 blocks at a time by
    // stmatrix (ptx::stmatrix_x4: a quarter of the store instructions): lane 8i + r addresses
    // row r of matrix i = (block j + i/2, rows g or g + 8 by i%2), whose 8 rows land in 8
    // different chunks, so every phase is conflict-free.
    uint8_t* staging = s.out[wg];
    sink.acquire(wg, tid);
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    const int mat = lane / 8, mat_row = lane % 8;
    const uint32_t mat_addr =
        ptx::smem_addr(staging) + (warp * 16 + mat_row + 8 * (mat % 2)) * 128;
    const int mat_chunk = (mat / 2) ^ mat_row;  // j even: chunk (j + mat/2) ^ row = j ^ this
    // Blocks j (even) and j + 1, rows g and g + 8 of each, as four bf16 pairs.
    auto put_blocks = [&](int j, uint32_t j_top, uint32_t j_bottom, uint32_t next_top,
                          uint32_t next_bottom) {
      ptx::stmatrix_x4(mat_addr + (j / 8) * 64 * 128 + ((j % 8) ^ mat_chunk) * 16, j_top,
                       j_bottom, next_top, next_bottom);
    };
    if constexpr (kEpi == Epilogue::kSwiGLU && kOp == Operands::kFP8) {
      // h = silu(g) * u in place of g; a row's 128 columns of h are one 1 x 128 block, spread
      // over the four lanes of a quad: its amax by two shuffles, then e4m3 bytes into the
      // 128B-swizzled staging (one box of 128 columns) and the scale to the sink. A sink that
      // keeps the pre-activations for the backward gets them first, as in bf16.
      if constexpr (requires { sink.keep_gate_up(acc, c, wg, tid); })
        sink.keep_gate_up(acc, c, wg, tid);
      constexpr int kUp = kTileCols / 2 / 8 * 4;
      float amax[2] = {0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < kOutCols<kEpi> / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float gate = acc[4 * j + i], up = acc[kUp + 4 * j + i];
          acc[4 * j + i] = silu_tanh(gate) * up;
          amax[i / 2] = fp8::amax_nan(amax[i / 2], fabsf(acc[4 * j + i]));
        }
      float scale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        amax[half] = fp8::amax_nan(amax[half], __shfl_xor_sync(0xffffffffu, amax[half], 1));
        amax[half] = fp8::amax_nan(amax[half], __shfl_xor_sync(0xffffffffu, amax[half], 2));
        scale[half] = fp8::block_scale(amax[half], fp8_scales.power_of_two);
      }
#pragma unroll
      for (int j = 0; j < kOutCols<kEpi> / 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = warp * 16 + g + 8 * half;
          const float* v = acc + 4 * j + 2 * half;
          const uint16_t pair = fp8::quantize_pair(v[0], v[1], scale[half]);
          *reinterpret_cast<uint16_t*>(staging + row * 128 + ((j / 2) ^ (row % 8)) * 16 +
                                       (j % 2) * 8 + 2 * q) = pair;
        }
      if (q == 0)
#pragma unroll
        for (int half = 0; half < 2; ++half) sink.put_scale(c, wg, warp * 16 + g + 8 * half,
                                                           scale[half]);
    } else if constexpr (kEpi == Epilogue::kSwiGLU) {
      // A sink that keeps the pre-activations for the backward gets them first.
      if constexpr (requires { sink.keep_gate_up(acc, c, wg, tid); })
        sink.keep_gate_up(acc, c, wg, tid);
      constexpr int kUp = kTileCols / 2 / 8 * 4;  // register offset of the up half
      auto swiglu = [](float gate, float up) { return gate * sigmoid(gate) * up; };
#pragma unroll
      for (int j = 0; j < kOutCols<kEpi> / 8; j += 2) {
        const float* r = acc + 4 * j;
        put_blocks(j, bf16_pair(swiglu(r[0], r[kUp + 0]), swiglu(r[1], r[kUp + 1])),
                   bf16_pair(swiglu(r[2], r[kUp + 2]), swiglu(r[3], r[kUp + 3])),
                   bf16_pair(swiglu(r[4], r[kUp + 4]), swiglu(r[5], r[kUp + 5])),
                   bf16_pair(swiglu(r[6], r[kUp + 6]), swiglu(r[7], r[kUp + 7])));
      }
    } else {
      put_block_pairs(acc, 0, kOutCols<kEpi> / 8, put_blocks);
    }
    ptx::fence_shared_to_async_proxy();
    ptx::named_barrier_sync(1 + wg, 128);
    sink.publish(wg, tid, staging, c);
  }
}

// The CTA's dynamic shared memory as a T (every GEMM kernel's and the megakernel's storage).
// NOTES: the declaration's __align__(1024) puts it on the 1024-byte boundary that 128-byte
// swizzled TMA boxes need. Rounding the address up in generic space instead kept ptxas from
// folding the generic-to-shared conversions: it recomputed the shared window and the rounding
// for every barrier in the K loops (and spilled more). check_dynamic_smem_alignment() traps if
// the boundary ever fails to hold.
template <class T>
__device__ __forceinline__ T& dynamic_smem() {
  extern __shared__ __align__(1024) uint8_t dynamic_smem_bytes[];
  return *reinterpret_cast<T*>(dynamic_smem_bytes);
}
// One thread, once per CTA.
__device__ __forceinline__ void check_dynamic_smem_alignment() {
  extern __shared__ __align__(1024) uint8_t dynamic_smem_bytes[];
  if (ptx::smem_addr(dynamic_smem_bytes) % 1024 != 0) __trap();
}

// Thread 0 of a GEMM CTA: the stage ring's barriers, before anyone uses them.
template <int kStages, int kStaging>
__device__ __forceinline__ void init_stage_barriers(GemmSmem<kStages, kStaging>& s) {
  for (int i = 0; i < kStages; ++i) {
    ptx::mbarrier_init(&s.full[i], 1);
    ptx::mbarrier_init(&s.empty[i], 2);  // one arrival per consumer warpgroup
  }
  ptx::mbarrier_init_fence();
}

// The standalone driver's stage tags (StageTags): the producer looks each tile up (the tile
// index's 64-bit divisions, the expert's search through seg_offset) while it runs ahead, and the
// consumers read the tile with its first stage instead of repeating that between tiles.
template <int kStages>
struct StandaloneTags {
  StageTag tag[kStages];
  uint64_t read[kStages];
};
// Where the tags sit: after the storage and, for FP8, the scale boxes and slots.
template <Epilogue kEpi, int kStages, Operands kOp>
__host__ __device__ constexpr size_t standalone_tags_offset() {
  static_assert(kFp8ScaleBoxBytes % 128 == 0 && sizeof(SharedStorage<kEpi, kStages>) % 128 == 0);
  return sizeof(SharedStorage<kEpi, kStages>) +
         (kOp == Operands::kFP8 ? kStages * kFp8ScaleBoxBytes + kFp8WeightScaleBytes<kStages> : 0);
}

// Standalone persistent driver: every CTA walks tiles blockIdx.x, + gridDim.x, ...
// kFp8KUnroll: how far the FP8 mainloop's K loop is unrolled (consume_tile).
template <Epilogue kEpi, int kStages, WeightMajor kMajor, Operands kOp = Operands::kBF16,
          int kFp8KUnroll = 1>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_a_rows,
                        const __grid_constant__ CUtensorMap map_b0,
                        const __grid_constant__ CUtensorMap map_b1,
                        const __grid_constant__ CUtensorMap map_out,
                        const __grid_constant__ CUtensorMap map_a_scales,
                        const __grid_constant__ CUtensorMap map_b_scales, const GemmParams p) {
  auto& s = dynamic_smem<SharedStorage<kEpi, kStages>>();
  // Operands::kFP8: the stages' row-scale boxes, then the weight-scale slots, after the storage
  // (shared_bytes counts them).
  uint8_t* row_scale_boxes = reinterpret_cast<uint8_t*>(&s) + sizeof(s);
  uint8_t* weight_scale_slots = row_scale_boxes + kStages * kFp8ScaleBoxBytes;
  Fp8Scales fp8 = p.fp8;
  fp8.a_smem = row_scale_boxes;
  fp8.b_smem = weight_scale_slots;
  auto* tags = reinterpret_cast<StandaloneTags<kStages>*>(
      reinterpret_cast<uint8_t*>(&s) + standalone_tags_offset<kEpi, kStages, kOp>());
  const int wg = warpgroup_index();
  if (threadIdx.x == 0) {
    check_dynamic_smem_alignment();
    for (int i = 0; i < kStages; ++i) ptx::mbarrier_init(&tags->read[i], kTagReaders);
    init_stage_barriers(s);  // and the fence that publishes every barrier
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_a_rows);
    ptx::prefetch_tensor_map(&map_b0);
    if constexpr (kEpi == Epilogue::kSwiGLU) ptx::prefetch_tensor_map(&map_b1);
    ptx::prefetch_tensor_map(&map_out);
    if constexpr (kOp == Operands::kFP8) {
      ptx::prefetch_tensor_map(&map_a_scales);
      ptx::prefetch_tensor_map(&map_b_scales);
    }
  }
  __syncthreads();

  const int64_t total_rows = p.seg_offset[p.experts];
  const int32_t m_tiles = static_cast<int32_t>(total_rows / kTileRows);
  const int32_t n_tiles = (p.n_out + kOutCols<kEpi> - 1) / kOutCols<kEpi>;
  const int64_t tiles = int64_t{m_tiles} * n_tiles;
  const int32_t k_blocks = p.k / kBlockKElems<kOp>;
  PipelineState<kStages> ps;

  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x)
        produce_tile<kEpi, kStages, kStagingBytes<kEpi>, kMajor, kOp>(
            s, ps, tile_coord(t, m_tiles, n_tiles, p.seg_offset, p.expert_rows, p.experts),
            k_blocks, &map_a, &map_a_rows, &map_b0, &map_b1, StageTags{tags->tag, tags->read}, t,
            0, p.b0_k_blocks,
            Fp8ScaleLoads{&map_a_scales, row_scale_boxes, &map_b_scales, &map_b_scales,
                          weight_scale_slots, p.fp8.n_blocks});
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    if constexpr (kOp == Operands::kFP8) fp8_turns_begin(wg - 1);
    DirectStoreSink<kEpi> sink{&map_out};
    volatile StageTag* tag = tags->tag;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      ptx::mbarrier_wait(&s.full[ps.stage], ps.phase);  // the tile's first stage, and its tag
      const volatile TileCoord& v = tag[ps.stage].tile;
      const TileCoord c{v.m_tile, v.n_tile, v.expert, v.rows, v.a_row};
      ptx::mbarrier_arrive(&tags->read[ps.stage]);
      consume_tile<kEpi, kStages, kStagingBytes<kEpi>, DirectStoreSink<kEpi>, kMajor,
                   RowsMajor::kK, kOp, kFp8KUnroll>(s, ps, c, k_blocks, wg - 1, sink, fp8);
    }
    if (threadIdx.x % 128 == 0) ptx::tma_store_wait_all();  // staging must outlive the stores
  }
}

template <Epilogue kEpi, int kStages, Operands kOp = Operands::kBF16>
constexpr size_t shared_bytes() {
  // + the FP8 row-scale boxes and weight-scale slots (both 128-byte multiples: TMA
  // destinations), then the stage tags
  return standalone_tags_offset<kEpi, kStages, kOp>() + sizeof(StandaloneTags<kStages>);
}

// Host side: the TMA maps the GEMM reads and writes (false if the driver refuses one).
// Row operand [max_rows, k]: whole 128-row boxes and the 16-row boxes of decode-size tiles.
inline bool encode_row_operand_maps(const void* rows, int64_t k, int64_t max_rows,
                                    CUtensorMap* map, CUtensorMap* map_few_rows) {
  const uint64_t dims[2] = {uint64_t(k), uint64_t(max_rows)};
  const uint32_t box[2] = {kBlockK, kTileRows};
  const uint32_t few_box[2] = {kBlockK, kRowBoxM};
  return encode_bf16_tensor_map(map, rows, 2, dims, box).ok() &&
         encode_bf16_tensor_map(map_few_rows, rows, 2, dims, few_box).ok();
}
// Output [max_rows, n], stored in 64 x 64 boxes from the epilogue's staging.
inline bool encode_output_map(void* out, int64_t n, int64_t max_rows, CUtensorMap* map) {
  const uint64_t dims[2] = {uint64_t(n), uint64_t(max_rows)};
  const uint32_t box[2] = {64, 64};
  return encode_bf16_tensor_map(map, out, 2, dims, box).ok();
}
// Where a map over one matrix per expert starts: expert e's matrix lies at w + e * expert_stride
// elements of elem_bytes (0: matrix_elems, densely packed). A negative stride (experts laid out
// from the last to the first) maps from the last expert's matrix forward and sets *order;
// *stride_bytes is the map's (positive) expert stride.
inline const void* expert_map_base(const void* w, int64_t experts, int64_t matrix_elems,
                                   int64_t elem_bytes, int64_t expert_stride,
                                   uint64_t* stride_bytes, ExpertOrder* order) {
  if (expert_stride == 0) expert_stride = matrix_elems;
  *order = {};
  if (expert_stride > 0) {
    *stride_bytes = uint64_t(expert_stride * elem_bytes);
    return w;
  }
  order->last = static_cast<int32_t>(experts - 1);
  *stride_bytes = uint64_t(-expert_stride * elem_bytes);
  return static_cast<const char*>(w) + (experts - 1) * expert_stride * elem_bytes;
}

// Expert weights [experts, n, k] (nn.Linear layout per expert) in boxes of box_rows rows; 3-D,
// so a tile past n reads zeros, never the next expert. Expert e's matrix starts expert_stride
// elements after expert 0's (0: n * k, densely packed; a multiple of 8, 16 bytes; negative:
// *order says so). The same weights read N-major (dy W): encode_weight_map_n_major maps
// [experts, k, n] in boxes of 64 n x 64 k. Gate and up: kTileCols / 2 rows each (a gate/up tile
// is 128 gate + the same 128 up rows); down: kTileCols.
inline bool encode_weight_map(const void* w, int64_t experts, int64_t n, int64_t k,
                              uint32_t box_rows, CUtensorMap* map, int64_t expert_stride = 0,
                              ExpertOrder* order = nullptr) {
  ExpertOrder in_order;
  uint64_t strides[2] = {uint64_t(k) * 2, 0};
  const void* base = expert_map_base(w, experts, n * k, 2, expert_stride, &strides[1],
                                     order ? order : &in_order);
  if (!order && in_order.last >= 0) return false;  // a reversed map needs its order
  const uint64_t dims[3] = {uint64_t(k), uint64_t(n), uint64_t(experts)};
  const uint32_t box[3] = {kBlockK, box_rows, 1};
  return encode_bf16_tensor_map(map, base, 3, dims, box, strides).ok();
}

inline bool encode_weight_map_n_major(const void* w, int64_t experts, int64_t k, int64_t n,
                                      CUtensorMap* map, int64_t expert_stride = 0,
                                      ExpertOrder* order = nullptr) {
  ExpertOrder in_order;
  uint64_t strides[2] = {uint64_t(n) * 2, 0};
  const void* base = expert_map_base(w, experts, k * n, 2, expert_stride, &strides[1],
                                     order ? order : &in_order);
  if (!order && in_order.last >= 0) return false;
  const uint64_t dims[3] = {uint64_t(n), uint64_t(k), uint64_t(experts)};
  const uint32_t box[3] = {64, kBlockK, 1};
  return encode_bf16_tensor_map(map, base, 3, dims, box, strides).ok();
}

// Host side: maps the row operand `rows` [max_rows, p.k] and the output `out` [max_rows,
// p.n_out], then launches the persistent kernel on at most sm_count CTAs. map_b0/map_b1: the
// weight tiles (kSwiGLU: gate and up, 128 rows each; kStore: one map of 256-row tiles; kN: the
// N-major maps of the weights feeding K's two parts, or the same one twice).
template <Epilogue kEpi, int kStages, WeightMajor kMajor = WeightMajor::kK>
cudaError_t launch_grouped_gemm(const void* rows, int64_t max_rows, const CUtensorMap& map_b0,
                                const CUtensorMap& map_b1, void* out, const GemmParams& p,
                                int32_t sm_count, cudaStream_t stream) {
  CUtensorMap map_a, map_a_rows, map_out;
  if (!encode_row_operand_maps(rows, p.k, max_rows, &map_a, &map_a_rows) ||
      !encode_output_map(out, p.n_out, max_rows, &map_out))
    return cudaErrorInvalidValue;
  const int64_t max_tiles =
      max_rows / kTileRows * ((p.n_out + kOutCols<kEpi> - 1) / kOutCols<kEpi>);
  const int grid = static_cast<int>(max_tiles < sm_count ? max_tiles : sm_count);
  auto* kernel = grouped_gemm_kernel<kEpi, kStages, kMajor>;
  constexpr size_t smem = shared_bytes<kEpi, kStages>();
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  // bf16 has no scale maps: map_a fills their unused slots.
  kernel<<<grid, kThreads, smem, stream>>>(map_a, map_a_rows, map_b0, map_b1, map_out, map_a,
                                           map_a, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels::gemm
