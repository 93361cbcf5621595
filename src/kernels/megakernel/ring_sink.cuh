// The forward's gate/up epilogue sink (grouped_gemm.cuh's staged sink interface): SwiGLU tiles
// handed through the staging buffers to the store warps, which write h into the ring. Its
// own file: one file per epilogue sink. Both passes' compute loops stop their store warps
// through the staging handshake it shares with PushCombineSink (StagingHandshake, smem.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/smem.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"
#include "kernels/ptx/tma.cuh"

namespace epflow::kernels::megakernel {

// Gate/up tiles: the consumers' epilogue output goes to a store warp of the producer
// warpgroup, which issues the TMA stores of h into the ring, waits for them to land and signals
// the tile's counter: the consumer warpgroups go straight on to their next tile's MMAs. A
// warpgroup whose rows are all padding signals itself once it has consumed the tile's stages.
// NOTES: never earlier (say, by the store warp as soon as it reaches the task): the producer
// may not have passed the task's waits yet, and an early signal of round r + 1 would complete a
// target meant for round r.
struct RingSink {
  static constexpr bool kDirect = false;
  StagingHandshake* staging;
  const MegakernelArgs* a;
  uint32_t* counter = nullptr;  // the current tile's counter
  int64_t task = 0;             // the current tile's task
  __device__ __forceinline__ void acquire(int wg, int) { staging->acquire(wg); }
  __device__ __forceinline__ void publish(int wg, int tid, const uint8_t*,
                                          const gemm::TileCoord& c) {
    if (tid == 0) staging->publish(wg, task, mega::TaskKind::kGateUp, c);
  }
  // FP8: the scale of h row `row` (of the warpgroup's 64) of the tile's 128-column block, after
  // its packed row's values; the store warp's signal publishes it with the values.
  __device__ __forceinline__ void put_scale(const gemm::TileCoord& c, int wg, int row, float v) {
    uint8_t* packed = reinterpret_cast<uint8_t*>(a->ring_h) +
                      (int64_t{c.a_row} + wg * 64 + row) * h_row_bytes(*a) + a->intermediate;
    reinterpret_cast<float*>(packed)[c.n_tile] = v;
  }
  __device__ __forceinline__ void skip(int, int tid) {
    if (tid == 0) ptx::signal_counter(counter);
  }
  // Training: g and u of the tile's routed rows, bf16, into gate_up_out at the rows' pull-table
  // positions (the backward reads them there; the ring slot is reused). NOTES: straight from
  // the accumulators, 16 bytes per lane, before the SwiGLU staging: the stores drain while the
  // warpgroup writes staging and runs the next mainloop.
  __device__ __forceinline__ void keep_gate_up(const float* acc, const gemm::TileCoord& c, int wg,
                                               int tid) {
    if (!a->gate_up_out) return;
    constexpr int kHalfCols = kTileCols / 2;  // gate columns, then as many up columns
    constexpr int kUp = kHalfCols / 8 * 4;    // register offset of the up half
    const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
    const int64_t I = a->intermediate;
    const int32_t cols = static_cast<int32_t>(I - int64_t{c.n_tile} * kHalfCols);
    __nv_bfloat16* dst[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wg * 64 + warp * 16 + g + 8 * half;
      const int64_t table_row = int64_t{c.m_tile} * kTileRows + row;
      dst[half] = row < c.rows && table_row < a->gate_up_rows
                      ? a->gate_up_out + table_row * 2 * I + int64_t{c.n_tile} * kHalfCols
                      : nullptr;
    }
#pragma unroll
    for (int part = 0; part < 2; ++part) {  // gate into [0, I), up into [I, 2I)
#pragma unroll
      for (int i = 0; i < kHalfCols / 32; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t pairs[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float* v = acc + part * kUp + 4 * (4 * i + r) + 2 * half;
            pairs[r] = gemm::bf16_pair(v[0], v[1]);
          }
          const uint4 block = gemm::quad_gather_block(pairs, q);
          const int col = 8 * (4 * i + q);
          if (dst[half] && col < cols)
            *reinterpret_cast<uint4*>(dst[half] + part * I + col) = block;
        }
      }
    }
  }
};

}  // namespace epflow::kernels::megakernel
