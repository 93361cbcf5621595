// The down-kind epilogue sink of both passes (grouped_gemm.cuh's direct sink interface): each
// output row pushed from the accumulators into its owner's (token, k) slot, y in the forward and
// dx in the backward. Its own file: one file per epilogue sink.
#pragma once

#include <cstdint>

#include "common/routing_schedule.h"
#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"

namespace epflow::kernels::megakernel {

// Down tiles: push combine in the epilogue, straight from the accumulators into the owners'
// (token, k) combine slots (local HBM or a peer over NVLink; no atomics: every slot has one
// writer), skipping padding rows and columns past H, 16 bytes per lane (quad_gather_block).
// The rows' destinations are read from the pull table before the mainloop (prepare), so the
// epilogue starts without a dependent load. The tile's counter only says its h rows were read
// (the MMAs are done), so the warpgroup signals before its stores: the signal's release then
// has no stores of this tile to wait for (over NVLink, a long wait in which warp 0 would hold
// back the warpgroup's next MMAs).
struct PushCombineSink {
  static constexpr bool kDirect = true;
  const MegakernelArgs* a;
  uint32_t* counter = nullptr;
  char* dst[2] = {nullptr, nullptr};  // the thread's rows in their combine slots at this n tile
  int32_t cols = 0;                   // columns of this n tile inside H
  int32_t q = 0;
  uint32_t pairs[2][4];  // bf16 pairs of blocks j = 4i .. 4i+3, per row half
  __device__ __forceinline__ void prepare(const gemm::TileCoord& c, int wg, int tid) {
    const int warp = tid / 32, g = tid % 32 / 4;
    q = tid % 4;
    cols = a->hidden - c.n_tile * kTileCols;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wg * 64 + warp * 16 + g + 8 * half;
      dst[half] = nullptr;
      if (row < c.rows) {
        const sched::PullRow r = a->table[int64_t{c.m_tile} * kTileRows + row];
        dst[half] = a->peers.base[r.src_rank] + a->combine_offset +
                    (int64_t{r.src_slot} * a->hidden + int64_t{c.n_tile} * kTileCols) * 2;
      }
    }
  }
  // Called for j = 0 .. 31 in order (unrolled: every index below is a compile-time constant).
  __device__ __forceinline__ void write(int j, int half, float v0, float v1) {
    pairs[half][j % 4] = gemm::bf16_pair(v0, v1);
    if (j % 4 != 3 || half != 1) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 block = gemm::quad_gather_block(pairs[h], q);
      const int col = 8 * (j - 3 + q);
      if (dst[h] && col < cols) *reinterpret_cast<uint4*>(dst[h] + col * 2) = block;
    }
  }
  __device__ __forceinline__ void begin(int, int tid) {
    if (tid == 0) ptx::signal_counter(counter);
  }
  __device__ __forceinline__ void skip(int, int tid) {
    if (tid == 0) ptx::signal_counter(counter);
  }
};

}  // namespace epflow::kernels::megakernel
