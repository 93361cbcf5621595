// The tile machinery both expert-FFN GEMMs share (device code, include from .cu files only).
//
// Each block computes one kExpertFfnTileM x BN tile of C = A B^T, A = [rows, K] (x or h) and
// B = [N, K] (one expert's weight in nn.Linear layout): both operands are K-major ("TN"), so
// ldmatrix without .trans yields the mma fragments of both. kNumB B operands share one A tile
// (2 for gate and up). Mainloop: cp.async into a kStages-deep ring of shared-memory stages,
// ldmatrix.x4 into registers, mma.sync m16n8k16 bf16 -> fp32. Epilogue: fp32 fragments ->
// bf16, staged through shared memory, stored as 16-byte chunks.
//
// NOTES: tile index -> (M tile, N tile) with N fastest, so the blocks resident at once share a
// few M tiles (their A rows stay in L2 across the N tiles) and read each expert's weight tile
// for all of that expert's M tiles at about the same time (weights are read from DRAM ~once).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "common/routing_schedule.h"
#include "kernels/expert_ffn.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/mma_sync.cuh"

namespace epflow::kernels::ffn {

using bf16 = __nv_bfloat16;

template <int BN, int BK, int Stages, int WarpsM, int WarpsN, int MinBlocksPerSm, int NumB>
struct TileConfig {
  static constexpr int kBM = kExpertFfnTileM;
  static constexpr int kBN = BN;
  static constexpr int kBK = BK;
  static constexpr int kStages = Stages;
  static constexpr int kWarpsM = WarpsM;
  static constexpr int kWarpsN = WarpsN;
  static constexpr int kThreads = 32 * WarpsM * WarpsN;
  static constexpr int kMinBlocksPerSm = MinBlocksPerSm;  // for __launch_bounds__
  static constexpr int kNumB = NumB;

  static constexpr int kWM = kBM / kWarpsM;  // rows of one warp's tile
  static constexpr int kWN = kBN / kWarpsN;  // columns of one warp's tile (per B operand)
  static constexpr int kMI = kWM / 16;       // m16 MMA tiles per warp
  static constexpr int kNI = kWN / 8;        // n8 MMA tiles per warp
  static constexpr int kChunks = kBK / 8;    // 16-byte chunks per shared-memory tile row

  static constexpr int kAElems = kBM * kBK;
  static constexpr int kBElems = kBN * kBK;
  static constexpr int kStageElems = kAElems + kNumB * kBElems;
  // Epilogue staging row stride: +8 elements (16 bytes) moves each row 4 banks over, so the
  // 8 rows x 4 column pairs of one fragment store hit 32 distinct banks.
  static constexpr int kOutLd = kBN + 8;
  static constexpr size_t kPipelineBytes = sizeof(bf16) * kStages * kStageElems;
  static constexpr size_t kStagingBytes = sizeof(bf16) * kBM * kOutLd;
  static constexpr size_t kSmemBytes =
      kPipelineBytes > kStagingBytes ? kPipelineBytes : kStagingBytes;

  static_assert(kBK % 64 == 0, "swizzle assumes whole 128-byte groups of 8 chunks per row");
  static_assert(kBM % (16 * kWarpsM) == 0, "warp tile rows: whole m16 tiles");
  static_assert(kBN % (16 * kWarpsN) == 0, "warp tile cols: whole n16 pairs (one ldmatrix.x4)");
  static_assert(kBN % 64 == 0, "N is a multiple of 64: a partial N tile is whole 64-col blocks");
  static_assert(kBM * kChunks % kThreads == 0 && kBN * kChunks % kThreads == 0,
                "every thread issues the same number of cp.async per tile");
  static_assert(kBM * (kBN / 8) % kThreads == 0, "every thread stores the same chunk count");
  static_assert(kStages >= 2, "a pipeline needs at least two stages");
  static_assert(kSmemBytes <= 227 * 1024, "Hopper: at most 227 KiB of shared memory a block");
};

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][BK] K-major tile. The chunk
// index is XORed with row % 8: rows are whole multiples of 128 bytes, so without it the 8 rows
// one ldmatrix phase reads (same logical chunk) would all sit in the same 4 banks; with it they
// sit in 8 distinct 16-byte bank groups, and the 8 chunks of one row that 8 consecutive threads
// fill with cp.async do too.
template <int BK>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * BK + ((chunk ^ (row & 7)) << 3);
}

// Issues this thread's cp.async for a [Rows][kBK] tile whose row r is src + r * ld. Rows at or
// past valid_rows (the N tail) are zero-filled and not read (their source is clamped to row 0).
template <class Cfg, int Rows>
__device__ __forceinline__ void load_tile_async(bf16* dst, const bf16* src, int64_t ld,
                                                int valid_rows) {
  constexpr int kPerThread = Rows * Cfg::kChunks / Cfg::kThreads;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * Cfg::kThreads;
    const int row = i / Cfg::kChunks;
    const int chunk = i % Cfg::kChunks;
    const bool valid = row < valid_rows;
    const bf16* g = src + (valid ? row : 0) * ld + chunk * 8;
    ptx::cp_async_16_zfill(ptx::smem_u32(dst + swizzled<Cfg::kBK>(row, chunk)), g, valid);
  }
}

// Where a block works, from its linear index; false if its M tile starts at or past the last
// segment (the grid is sized for max_rows, the routed row count lives on the device).
struct TileCoords {
  int64_t m_base;  // first row of the M tile
  int64_t n_base;  // first output column of the N tile
  int32_t expert;  // local expert whose segment holds the M tile
  int valid_n;     // output columns of this N tile inside N (kBN except in the tail)
};

template <class Cfg>
__device__ __forceinline__ bool locate_tile(const int64_t* seg_offset, int32_t experts,
                                            int64_t n_dim, int n_tiles, TileCoords* t) {
  const int64_t tile = blockIdx.x;
  t->m_base = tile / n_tiles * Cfg::kBM;
  if (t->m_base >= seg_offset[experts]) return false;
  t->n_base = tile % n_tiles * Cfg::kBN;
  // Segments are padded to kBM, so the whole M tile lies in this one expert's segment.
  t->expert = sched::expert_of_row(seg_offset, experts, t->m_base);
  const int64_t left = n_dim - t->n_base;
  t->valid_n = static_cast<int>(left < Cfg::kBN ? left : Cfg::kBN);
  return true;
}

// acc[b] = A B_b^T over the whole K for this block's tile: a = first row of the M tile,
// b[i] = first row of the N tile of operand i, both with row stride k_dim (a multiple of kBK).
// Rows of B at or past valid_n read as zeros.
template <class Cfg>
__device__ __forceinline__ void mainloop(float (&acc)[Cfg::kNumB][Cfg::kMI][Cfg::kNI][4],
                                         bf16* smem, const bf16* a,
                                         const bf16* const (&b)[Cfg::kNumB], int64_t k_dim,
                                         int valid_n) {
  constexpr int kBK = Cfg::kBK;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_m = warp / Cfg::kWarpsN;
  const int warp_n = warp % Cfg::kWarpsN;

#pragma unroll
  for (int bi = 0; bi < Cfg::kNumB; ++bi)
#pragma unroll
    for (int mi = 0; mi < Cfg::kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < Cfg::kNI; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[bi][mi][ni][r] = 0.0f;

  // ldmatrix.x4 row addresses of this lane (lane supplies row lane % 8 of matrix lane / 8; see
  // ptx/mma_sync.cuh). A, one m16 x k16 tile: matrices 0..3 = (m +0, k +0), (m +8, k +0),
  // (m +0, k +8), (m +8, k +8) = a[0..3].
  const int a_row = warp_m * Cfg::kWM + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chunk = lane >> 4;  // + 2 * (k16 step): chunk = 8 k
  // B, two n8 tiles x k16 (smem rows are n): matrices 0..3 = (n +0, k +0), (n +0, k +8),
  // (n +8, k +0), (n +8, k +8) = b[0], b[1] of n8 tile 2j, then b[0], b[1] of n8 tile 2j+1.
  const int b_row = warp_n * Cfg::kWN + (lane & 7) + (lane >> 4) * 8;
  const int b_chunk = (lane >> 3) & 1;

  const uint32_t smem_base = ptx::smem_u32(smem);
  const int k_tiles = static_cast<int>(k_dim / kBK);

  auto load_stage = [&](int stage, int kt) {
    bf16* s = smem + stage * Cfg::kStageElems;
    const int64_t k0 = int64_t{kt} * kBK;
    load_tile_async<Cfg, Cfg::kBM>(s, a + k0, k_dim, Cfg::kBM);
#pragma unroll
    for (int bi = 0; bi < Cfg::kNumB; ++bi)
      load_tile_async<Cfg, Cfg::kBN>(s + Cfg::kAElems + bi * Cfg::kBElems, b[bi] + k0, k_dim,
                                     valid_n);
  };

  // Prologue: stages 0 .. kStages-2 in flight, one commit group each (empty past k_tiles, so
  // the group count, which cp.async.wait_group counts, stays the same for any K).
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    ptx::cp_async_commit();
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    // Groups committed so far: kStages-1 + kt; allowing kStages-2 pending means groups
    // 0..kt are complete, i.e. tile kt has landed (for this thread; the barrier makes every
    // thread's copies visible, and also ends every warp's reads of the stage refilled below,
    // which held tile kt-1).
    ptx::cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();
    const int next = kt + Cfg::kStages - 1;
    if (next < k_tiles) load_stage(next % Cfg::kStages, next);
    ptx::cp_async_commit();

    const uint32_t sa = smem_base + sizeof(bf16) * (kt % Cfg::kStages) * Cfg::kStageElems;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[Cfg::kMI][4];
#pragma unroll
      for (int mi = 0; mi < Cfg::kMI; ++mi)
        ptx::ldmatrix_x4(af[mi],
                         sa + sizeof(bf16) * swizzled<kBK>(a_row + mi * 16, 2 * ks + a_chunk));
#pragma unroll
      for (int bi = 0; bi < Cfg::kNumB; ++bi) {
        const uint32_t sb = sa + sizeof(bf16) * (Cfg::kAElems + bi * Cfg::kBElems);
        uint32_t bf[Cfg::kNI][2];
#pragma unroll
        for (int nj = 0; nj < Cfg::kNI / 2; ++nj) {
          uint32_t r[4];
          ptx::ldmatrix_x4(r, sb + sizeof(bf16) * swizzled<kBK>(b_row + nj * 16, 2 * ks + b_chunk));
          bf[2 * nj][0] = r[0];
          bf[2 * nj][1] = r[1];
          bf[2 * nj + 1][0] = r[2];
          bf[2 * nj + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < Cfg::kMI; ++mi)
#pragma unroll
          for (int ni = 0; ni < Cfg::kNI; ++ni)
            ptx::mma_m16n8k16_bf16(acc[bi][mi][ni], af[mi], bf[ni]);
      }
    }
  }
}

// Stores this warp's fp32 fragments v as bf16 to out[row * ldo + col] for all kBM rows of the
// tile and its first valid_n columns. Staged through shared memory (reusing the pipeline's) so
// the global stores are 16-byte chunks, consecutive threads covering whole rows.
template <class Cfg>
__device__ __forceinline__ void store_tile(const float (&v)[Cfg::kMI][Cfg::kNI][4], bf16* smem,
                                           bf16* out, int64_t ldo, int valid_n) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_m = warp / Cfg::kWarpsN;
  const int warp_n = warp % Cfg::kWarpsN;

  // Only empty groups can still be pending, but wait anyway; the barrier ends every warp's
  // ldmatrix reads of the pipeline stages before they are overwritten.
  ptx::cp_async_wait<0>();
  __syncthreads();

  // Fragment (see ptx/mma_sync.cuh): v[mi][ni][0..1] at (row g, cols 2t, 2t+1), [2..3] at row
  // g + 8, of the m16 x n8 tile (mi, ni) of this warp.
  const int g = lane >> 2;
  const int t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < Cfg::kMI; ++mi) {
#pragma unroll
    for (int ni = 0; ni < Cfg::kNI; ++ni) {
      const int row = warp_m * Cfg::kWM + mi * 16 + g;
      const int col = warp_n * Cfg::kWN + ni * 8 + 2 * t;
      *reinterpret_cast<__nv_bfloat162*>(smem + row * Cfg::kOutLd + col) =
          __floats2bfloat162_rn(v[mi][ni][0], v[mi][ni][1]);
      *reinterpret_cast<__nv_bfloat162*>(smem + (row + 8) * Cfg::kOutLd + col) =
          __floats2bfloat162_rn(v[mi][ni][2], v[mi][ni][3]);
    }
  }
  __syncthreads();

  constexpr int kChunksPerRow = Cfg::kBN / 8;
  constexpr int kPerThread = Cfg::kBM * kChunksPerRow / Cfg::kThreads;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * Cfg::kThreads;
    const int row = i / kChunksPerRow;
    const int col = (i % kChunksPerRow) * 8;
    if (col < valid_n)
      *reinterpret_cast<uint4*>(out + row * ldo + col) =
          *reinterpret_cast<const uint4*>(smem + row * Cfg::kOutLd + col);
  }
}

}  // namespace epflow::kernels::ffn

namespace epflow::kernels {

// The two halves of launch_expert_ffn, each with its shipped tile configuration.
cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& args, cudaStream_t stream);
cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& args, cudaStream_t stream);

}  // namespace epflow::kernels
