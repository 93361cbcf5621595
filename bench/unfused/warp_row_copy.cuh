// Moving routed rows between GPUs: a warp per pull-table row, each row copied as 16-byte vectors
// (local HBM or a peer's NVLink-mapped memory) with several loads in flight per lane before the
// first store so the link stays busy.
#pragma once

#include <cstdint>

#include "common/routing_schedule.h"
#include "unfused/row_movers.cuh"

namespace epflow::kernels {

// Calls move(row, entry, lane) for every non-padding row below seg_offset[experts] and
// pad(row, lane) for every padding row, a warp per row. NOTES: warps take rows in table order,
// so the rows in flight at one moment are neighbours in the table, which the schedule
// interleaved across source ranks: the NVLink traffic of one moment spreads over all peers.
template <typename Move, typename Pad>
__device__ __forceinline__ void for_each_table_row(const sched::PullRow* table,
                                                   const int64_t* seg_offset, int32_t experts,
                                                   Move move, Pad pad) {
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t total = seg_offset[experts];
  for (int64_t row = int64_t{blockIdx.x} * warps + threadIdx.x / 32; row < total;
       row += int64_t{gridDim.x} * warps) {
    const sched::PullRow r = table[row];
    if (r.src_rank != sched::kPaddingRow)
      move(row, r, lane);
    else
      pad(row, lane);
  }
}

template <typename Move>
__device__ __forceinline__ void for_each_routed_row(const sched::PullRow* table,
                                                    const int64_t* seg_offset, int32_t experts,
                                                    Move move) {
  for_each_table_row(table, seg_offset, experts, move, [](int64_t, int) {});
}

// A row as batches of kUnroll 16-byte vectors per lane: all loads of a batch are issued before
// its stores, and the last batch is predicated rather than copied vector by vector, so a row costs
// ceil(vecs / (32 kUnroll)) memory round trips (NVLink latency is paid per round trip).
template <int kUnroll = 4>
__device__ __forceinline__ void warp_copy_row(const int4* __restrict__ src, int4* __restrict__ dst,
                                              int64_t vecs, int lane) {
  for (int64_t base = lane; base < vecs; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + 32 * u;
      if (i < vecs) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < vecs) dst[base + 32 * u] = v[u];
  }
}

}  // namespace epflow::kernels
