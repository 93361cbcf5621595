// Dispatch: the pulls of routed rows from their source ranks into the ring (or, in the
// backward, of x rows into x_out) by the first warps of a CTA, through row buffers in the
// GEMM's stage memory; the head's dispatch parts, which every CTA claims before its role, and
// the communication partition's loop. Separate from the compute partition: it runs before a CTA
// computes, and shares only the stage memory and the counters with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda/ptx>

#include "common/megakernel_tasks.h"
#include "common/routing_schedule.h"
#include "common/tile.h"
#include "kernels/megakernel/counters.cuh"
#include "kernels/megakernel/smem.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"
#include "kernels/ptx/tma.cuh"

namespace epflow::kernels::megakernel {

// One dispatching warp's share of the CTA's row buffers (lane 0 issues its copies). A row's
// bytes are x_row_bytes (multiples of 16: H * 2 with H a multiple of 64, or an FP8 packed row).
struct RowPipe {
  uint8_t* buf;    // slots x row_bytes of shared memory
  uint64_t* full;  // per slot, one arrival + the row's bytes
  uint32_t slots;  // >= 2
  uint32_t row_bytes;
  uint32_t seq = 0;  // rows through the pipe so far: row q uses slot q % slots, phase q / slots
  int32_t warp;      // this warp, and how many warps of the CTA dispatch
  int32_t warps;
};

// x rows that fit the GEMM's stage and staging memory.
__device__ __forceinline__ int32_t row_buffers(const MegakernelArgs& a) {
  return static_cast<int32_t>(offsetof(decltype(MegaSmem::gemm), full) /
                              static_cast<size_t>(x_row_bytes(a)));
}

// The dispatching warps of a CTA: kPullWarps when each gets two row buffers or more, else as
// many as do (one at worst: Limits::kMaxHidden leaves room for three rows).
__device__ __forceinline__ int32_t pull_warps(const MegakernelArgs& a) {
  const int32_t fit = row_buffers(a);
  return fit / 2 < kPullWarps ? fit / 2 : kPullWarps;
}

__device__ __forceinline__ RowPipe make_row_pipe(const MegakernelArgs& a, MegaSmem& smem,
                                                 int32_t warp) {
  RowPipe p;
  p.warp = warp;
  p.warps = pull_warps(a);
  p.row_bytes = static_cast<uint32_t>(x_row_bytes(a));
  const uint32_t per_warp = static_cast<uint32_t>(row_buffers(a) / p.warps);
  p.slots = per_warp < kMaxPullRows / kPullWarps ? per_warp : kMaxPullRows / kPullWarps;
  p.buf = reinterpret_cast<uint8_t*>(&smem.gemm) + size_t{p.slots} * warp * p.row_bytes;
  p.full = smem.pull_full + p.slots * warp;
  return p;
}

// Named barrier of a CTA's dispatching warps (the GEMM's warpgroups use ids 1 and 2, later).
__device__ __forceinline__ void pull_warps_sync(const RowPipe& pipe) {
  ptx::named_barrier_sync(3, 32 * pipe.warps);
}

// What one pull copies: rows [begin, end) of a row tile, from the window region at src_offset
// ([T, H] per rank: x or dy) into the tile's rows at dst; rows [zero_from, kTileRows) of the tile
// are written as zeros (the backward's weight gradients sum over padding rows: kTileRows, none);
// signal: the slot's counter says the rows are in (a pull the GEMMs do not wait for: none).
struct PullJob {
  size_t src_offset;
  uint8_t* dst;
  int32_t begin, end, zero_from;
  bool signal;
};

// The pull of dispatch task t: the tile's rows (or a head part's share) into its ring slot.
// A pass that feeds the weight gradients also zeroes the padding rows, in the part that starts
// at row 0 (or the whole tile).
template <class P>
__device__ __forceinline__ PullJob dispatch_job(const MegakernelArgs& a, const mega::TaskShape& s,
                                                const mega::Task& t) {
  const int32_t rows = tile_of(a, s, t).rows;
  PullJob job;
  job.src_offset = a.x_offset;
  job.dst = reinterpret_cast<uint8_t*>(a.ring_x) +
            int64_t{mega::ring_slot_of_tile(s, t.m_tile)} * kTileRows * x_row_bytes(a);
  mega::dispatch_rows(s, t, rows, &job.begin, &job.end);
  job.zero_from = P::kForWeightGradients && job.begin == 0 ? rows : kTileRows;
  job.signal = true;
  return job;
}

// The backward's x pull of row tile m (for the weight gradients, after the GEMMs' own pulls).
__device__ __forceinline__ PullJob x_job(const MegakernelArgs& a, const mega::TaskShape& s,
                                         int32_t m) {
  const int32_t rows = tile_of(a, s, mega::Task{mega::TaskKind::kDispatch, m, 0}).rows;
  uint8_t* dst = static_cast<uint8_t*>(a.x_out) + int64_t{m} * kTileRows * x_row_bytes(a);
  return PullJob{a.x_pull_offset, dst, 0, rows, rows, false};
}

// Pull job of task t (every dispatching warp, converged): copies its rows, waits until they
// have landed and signals the slot's x_ready; thread 0 traces it as record n.
// NOTES: row j goes to warp j % warps, which copies its rows in order through its own buffers,
// refilling the buffer of its row j - 1 with row j - 1 + slots once row j's store is issued and
// row j - 1's store has read it. Several warps, because one copy chain is latency-bound: its
// rate hardly depends on the row's size, so more chains move more rows (epflow-row-copy-probe).
// The lanes read the table 32 entries at a time, so the chain has no dependent global load per
// row.
__device__ __forceinline__ void pull_rows(const MegakernelArgs& a, const mega::TaskShape& s,
                                          const mega::Task& t, const PullJob& job, int64_t i,
                                          int32_t n, uint64_t taken, uint64_t ready,
                                          RowPipe& pipe) {
  const int lane = threadIdx.x % 32;
  // This warp's rows of the task: k = 0 .. mine-1 is the task's row begin + warp + k * warps.
  const int32_t first = job.begin + pipe.warp;
  const int32_t mine = job.end > first ? (job.end - first + pipe.warps - 1) / pipe.warps : 0;
  const sched::PullRow* table = a.table + int64_t{t.m_tile} * kTileRows;
  // Lane l holds the source of this warp's row window + l (loads come in increasing k).
  int32_t window = -32;
  uint64_t src = 0;
  auto load = [&](int32_t k) {  // every lane (the shuffle); lane 0 issues
    if (k >= window + 32) {
      window = k;
      const int32_t kk = k + lane;
      if (kk < mine) {
        const sched::PullRow r = table[first + kk * pipe.warps];
        src = reinterpret_cast<uint64_t>(a.peers.base[r.src_rank] + job.src_offset) +
              uint64_t{static_cast<uint32_t>(r.src_slot / a.top_k)} * pipe.row_bytes;
      }
    }
    const uint64_t from = __shfl_sync(0xffffffffu, src, k - window);
    if (lane != 0) return;
    const uint32_t b = (pipe.seq + k) % pipe.slots;
    ptx::mbarrier_arrive_expect_tx(&pipe.full[b], pipe.row_bytes);
    ptx::bulk_load(pipe.buf + b * pipe.row_bytes, reinterpret_cast<const void*>(from),
                   pipe.row_bytes, &pipe.full[b]);
  };
  const int32_t slots = static_cast<int32_t>(pipe.slots);
  // The previous round's gate/up tiles read this slot through TMA (the async proxy), as ours.
  if (lane == 0) cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  for (int32_t k = 0; k < mine && k < slots; ++k) load(k);
  for (int32_t k = 0; k < mine; ++k) {
    const bool refill = k >= 1 && k - 1 + slots < mine;
    if (lane == 0) {
      const uint32_t q = pipe.seq + k;
      ptx::mbarrier_wait(&pipe.full[q % pipe.slots], (q / pipe.slots) & 1);
      ptx::bulk_store(job.dst + int64_t{first + k * pipe.warps} * pipe.row_bytes,
                      pipe.buf + q % pipe.slots * pipe.row_bytes, pipe.row_bytes);
      ptx::tma_store_commit();
      if (refill) ptx::bulk_wait_read<1>();
    }
    __syncwarp();
    if (refill) load(k - 1 + slots);
  }
  pipe.seq += static_cast<uint32_t>(mine);
  if (job.zero_from < kTileRows) {
    const int32_t chunks = static_cast<int32_t>(pipe.row_bytes / 16);
    for (int32_t r = job.zero_from + pipe.warp; r < kTileRows; r += pipe.warps)
      for (int32_t c = lane; c < chunks; c += 32)
        reinterpret_cast<uint4*>(job.dst + int64_t{r} * pipe.row_bytes)[c] = make_uint4(0, 0, 0, 0);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // read by TMA, like the pulled rows
  }
  if (lane == 0) {
    // The gate/up GEMM reads the dispatched rows with TMA loads once the counter says so.
    ptx::tma_store_wait_all();
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  }
  __threadfence();
  pull_warps_sync(pipe);
  if (threadIdx.x == 0) {
    if (job.signal)
      ptx::signal_counter(
          counter_of(a, mega::ring_slot_of_tile(s, t.m_tile), mega::signalled_counter(t.kind)));
    trace_task(a, n, i, t, taken, ready);
  }
}

// Every CTA, before its role (the dispatching warps): claims the head tiles' dispatch parts one
// at a time until none is left (they wait for nothing). Returns how many it ran (its trace
// records so far).
template <class P>
__device__ __forceinline__ int32_t dispatch_head(const MegakernelArgs& a, const mega::TaskShape& s,
                                                 RowPipe& pipe, volatile int64_t& claimed) {
  const int64_t tasks = mega::num_head_tasks(s);
  int32_t n = 0;
  for (;; ++n) {
    if (threadIdx.x == 0) claimed = atomicAdd(head_claim_counter(a), 1u);
    pull_warps_sync(pipe);
    const int64_t i = claimed;
    if (i >= tasks) break;
    const uint64_t now = a.trace ? ptx::global_timer_ns() : 0;
    // Its closing barrier also orders this read of `claimed` before the next claim.
    const mega::Task t = mega::head_task(s, i);
    pull_rows(a, s, t, dispatch_job<P>(a, s, t), i, n, now, now, pipe);
  }
  return n;
}

// Communication partition after the head (the dispatching warps): the comm list's whole tiles,
// round-robin; in a pass that feeds the weight gradients, then the x rows of every tile (they
// wait for nothing and nothing in the kernel waits for them: the weight gradients after it read
// them). Returns the CTA's trace records so far.
template <class P>
__device__ __forceinline__ int32_t comm_role(const MegakernelArgs& a, const mega::TaskShape& s,
                                             int32_t traced, RowPipe& pipe) {
  const int64_t tasks = mega::num_comm_tasks(s);
  const int64_t x_tasks = P::kForWeightGradients ? s.m_tiles : 0;
  uint64_t taken = 0, ready = 0;
  for (int64_t i = blockIdx.x; i < tasks + x_tasks; i += a.comm_ctas) {
    if (i >= tasks) {
      const int32_t m = static_cast<int32_t>(i - tasks);
      if (a.trace) taken = ready = ptx::global_timer_ns();
      pull_rows(a, s, mega::Task{mega::TaskKind::kDispatch, m, 0}, x_job(a, s, m), i, traced++,
                taken, ready, pipe);
      continue;
    }
    const mega::Task t = mega::comm_task(s, i);
    if (threadIdx.x == 0) {
      if (a.trace) taken = ptx::global_timer_ns();
      wait_for_task<P>(a, s, t, false);
      if (a.trace) ready = ptx::global_timer_ns();
    }
    pull_warps_sync(pipe);
    pull_rows(a, s, t, dispatch_job<P>(a, s, t), i, traced++, taken, ready, pipe);
  }
  return traced;
}

}  // namespace epflow::kernels::megakernel
