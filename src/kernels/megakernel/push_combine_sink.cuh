// The down-kind epilogue sink of both passes (grouped_gemm.cuh's direct sink interface, writing
// shared memory): each output row pushed into its owner's (token, k) slot, y in the forward and
// dx in the backward. Its own file: one file per epilogue sink.
#pragma once

#include <cstdint>

#include "common/routing_schedule.h"
#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/smem.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"
#include "kernels/ptx/tma.cuh"

namespace epflow::kernels::megakernel {

// Down tiles: push combine. The epilogue writes the tile's bf16 rows into the warpgroup's
// staging (padded rows, kPushRowBytes apart) and hands it to its store warp, which bulk-copies
// each routed row into its owner's (token, k) combine slot (local HBM or a peer over NVLink; no
// atomics: every slot has one writer), skipping padding rows and columns past H
// (push_staged_rows). NOTES: pushing from registers (a quad's shuffles gathering 16 bytes per
// lane, then global stores) kept the tensor cores idle for the whole epilogue, about a sixth of
// a down tile at H = 7168 (docs/benchmarks.md); shared memory takes the rows in a fraction of
// that. The tile's counter only says its h rows were read (the MMAs are done): the store warp
// signals it as it takes the staging, before its copies, so the consumers' epilogue holds no
// GPU-scope release.
struct PushCombineSink {
  static constexpr bool kDirect = true;
  StagingHandshake* staging;
  uint32_t* counter = nullptr;  // signalled here only for a warpgroup whose rows are all padding
  int64_t task = 0;
  gemm::TileCoord tile{};
  // The shared address of the 16-byte row this lane gives stmatrix: row r = lane % 8 of matrix
  // i = lane / 8, i.e. of block j + i / 2, row g or g + 8 by i % 2 (kPushRowBytes is 16 bytes
  // past a multiple of 128, so a matrix's 8 rows hit 8 different bank groups).
  uint32_t matrix_row_addr = 0;
  __device__ __forceinline__ void prepare(const gemm::TileCoord& c, int w, int t) {
    tile = c;
    const int warp = t / 32, lane = t % 32;
    matrix_row_addr = ptx::smem_addr(staging->s->gemm.out[w]) +
                      (warp * 16 + lane % 8 + 8 * (lane / 8 % 2)) * kPushRowBytes +
                      16 * (lane / 16);
  }
  __device__ __forceinline__ void begin(int w, int) { staging->acquire(w); }
  // Blocks j (even) and j + 1 of the thread's rows, as bf16 pairs (stmatrix's four matrices).
  __device__ __forceinline__ void write_blocks(int j, uint32_t j_top, uint32_t j_bottom,
                                               uint32_t next_top, uint32_t next_bottom) {
    ptx::stmatrix_x4(matrix_row_addr + 16 * j, j_top, j_bottom, next_top, next_bottom);
  }
  __device__ __forceinline__ void end(int w, int t) {
    ptx::fence_shared_to_async_proxy();
    ptx::named_barrier_sync(1 + w, 128);
    if (t == 0) staging->publish(w, task, mega::TaskKind::kDown, tile);
  }
  __device__ __forceinline__ void skip(int, int t) {
    if (t == 0) ptx::signal_counter(counter);
  }
};

// The store warp's side (all 32 lanes): bulk copies of consumer warpgroup w's staged rows of
// down tile c into their combine slots, two rows per lane; returns once they have read the
// staging (the caller then frees it).
__device__ __forceinline__ void push_staged_rows(const MegakernelArgs& a, const uint8_t* staging,
                                                 const gemm::TileCoord& c, int w) {
  const int lane = threadIdx.x % 32;
  const int32_t cols = min(kTileCols, a.hidden - c.n_tile * kTileCols);
#pragma unroll
  for (int r = lane; r < 64; r += 32) {
    const int row = w * 64 + r;
    if (row >= c.rows) continue;
    const sched::PullRow pr = a.table[int64_t{c.m_tile} * kTileRows + row];
    char* dst = a.peers.base[pr.src_rank] + a.combine_offset +
                (int64_t{pr.src_slot} * a.hidden + int64_t{c.n_tile} * kTileCols) * 2;
    ptx::bulk_store(dst, staging + r * kPushRowBytes, static_cast<uint32_t>(cols) * 2);
  }
  ptx::tma_store_commit();
  ptx::tma_store_wait_read();
}

}  // namespace epflow::kernels::megakernel
