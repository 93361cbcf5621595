// The kernel's side of the task lists (src/common/megakernel_tasks.h): the call's TaskShape, a
// compute task's tile, the counters region (counter_layout.h), the timed waits on the counters
// and what they leave behind (progress words, MegakernelDiagnostic), and the trace records.
// Separate because both partitions, the sinks and both passes use them alike.
#pragma once

#include <cstdint>

#include "common/megakernel_tasks.h"
#include "common/routing_schedule.h"
#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/counter_layout.h"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"

namespace epflow::kernels::megakernel {

// P: the pass's traits (forward_megakernel.cu, backward_megakernel.cu).
template <class P>
__device__ __forceinline__ mega::TaskShape task_shape(const MegakernelArgs& a) {
  mega::TaskShape s;
  s.m_tiles = static_cast<int32_t>(a.seg_offset[a.experts] / kTileRows);
  s.ring_tiles = a.ring_tiles;
  s.minibatch_tiles = a.minibatch_tiles;
  // Output columns of a first-GEMM tile: 128 of h (256 accumulator columns: gate and up), or
  // 256 of dhp.
  constexpr int kCols1 = gemm::kOutCols<P::kGateUpEpilogue>;
  s.n_gate_up = (a.intermediate + kCols1 - 1) / kCols1;
  s.n_down = (a.hidden + gemm::kOutCols<gemm::Epilogue::kStore> - 1) /
             gemm::kOutCols<gemm::Epilogue::kStore>;
  s.head_tiles = mega::head_tiles_of(s.m_tiles, s.minibatch_tiles);
  s.down_n_fastest = P::kDownNFastestWhenSuited && mega::down_n_fastest_suits(s.m_tiles, a.experts);
  return s;
}

// The GEMM tile of a compute task: its expert, its routed rows (a prefix of the tile: segments
// are padded at their end) and its rows in the ring.
__device__ __forceinline__ gemm::TileCoord tile_of(const MegakernelArgs& a,
                                                   const mega::TaskShape& s, const mega::Task& t) {
  gemm::TileCoord c;
  c.m_tile = t.m_tile;
  c.n_tile = t.n_tile;
  const int64_t first_row = int64_t{t.m_tile} * kTileRows;
  c.expert = sched::expert_of_row(a.seg_offset, a.experts, first_row);
  const int64_t left = a.seg_offset[c.expert] + a.expert_rows[c.expert] - first_row;
  c.rows = static_cast<int32_t>(left < kTileRows ? left : kTileRows);
  c.a_row = mega::ring_slot_of_tile(s, t.m_tile) * kTileRows;
  return c;
}

__device__ __forceinline__ uint32_t* counter_of(const MegakernelArgs& a, int32_t slot,
                                                mega::Counter c) {
  return a.counters + slot * mega::kCounters + static_cast<int>(c);
}

// The claim words after the slots' counters (counter_layout.h).
__device__ __forceinline__ uint32_t* claim_counter(const MegakernelArgs& a) {
  return a.counters + mega::kCounters * a.ring_tiles;
}
__device__ __forceinline__ uint32_t* timeout_election(const MegakernelArgs& a) {
  return claim_counter(a) + 1;
}
__device__ __forceinline__ uint32_t* head_claim_counter(const MegakernelArgs& a) {
  return claim_counter(a) + 2;
}
__device__ __forceinline__ volatile uint64_t* progress_of(const MegakernelArgs& a, int cta) {
  const int32_t words = (mega::kCounters * a.ring_tiles + kClaimWords + 1) / 2;
  return reinterpret_cast<volatile uint64_t*>(a.counters) + words + cta * kProgressWords;
}
__device__ __forceinline__ void record_progress(const MegakernelArgs& a, int word, int64_t task) {
  progress_of(a, blockIdx.x)[word] = static_cast<uint64_t>(task + 1);
}

// Blocks (one thread) until the task's slot is ready; on timeout records who waited for what
// (MegakernelDiagnostic) and traps.
template <class P>
__device__ __forceinline__ void wait_for_task(const MegakernelArgs& a, const mega::TaskShape& s,
                                              const mega::Task& t, bool compute) {
  mega::WaitTarget w[2];
  const int n = mega::wait_targets(s, t, w);
  const int32_t slot = mega::ring_slot_of_tile(s, t.m_tile);
  for (int i = 0; i < n; ++i) {
    uint32_t seen = 0;
    if (!ptx::wait_counter_at_least(counter_of(a, slot, w[i].counter), w[i].at_least, a.timeout_ns,
                                    &seen)) {
      // NOTES: the first waiter to give up is elected in device memory (an atomic on the
      // host-mapped record would need PCIe atomics, which a host may lack); `set` goes last.
      if (atomicCAS(timeout_election(a), 0u, 1u) == 0u) {
        volatile MegakernelDiagnostic* v = a.diagnostic;
        v->backward = P::kBackward;
        v->rank = a.rank;
        v->cta = blockIdx.x;
        v->compute = compute;
        v->task_kind = static_cast<int32_t>(t.kind);
        v->m_tile = t.m_tile;
        v->n_tile = t.n_tile;
        v->counter = static_cast<int32_t>(w[i].counter);
        v->slot = slot;
        v->m_tiles = s.m_tiles;
        v->ring_tiles = s.ring_tiles;
        v->want = w[i].at_least;
        v->have = seen;
        v->seconds = a.timeout_ns * 1e-9;
        v->minibatch_tiles = s.minibatch_tiles;
        v->n_gate_up = s.n_gate_up;
        v->n_down = s.n_down;
        v->down_n_fastest = s.down_n_fastest;
        v->comm_ctas = a.comm_ctas;
        v->ctas = gridDim.x < kMaxDiagnosedCtas ? gridDim.x : kMaxDiagnosedCtas;
        for (int c = 0; c < v->ctas; ++c)
          for (int w = 0; w < kProgressWords; ++w) v->progress[c][w] = progress_of(a, c)[w];
        __threadfence_system();
        v->set = 1;
        __threadfence_system();
        __trap();
      }
      // NOTES: another waiter is writing the record: trapping now would end the kernel before
      // its last write (waiters on one stuck counter give up within nanoseconds of each other,
      // so the record would be lost). Its trap ends this thread too.
      for (;;) __nanosleep(1 << 20);
    }
  }
}

// The consumers' times of this CTA's n-th traced task (one thread of the first consumer
// warpgroup; trace_task fills the rest of the record): when it started waiting for the tile's
// first stage and had it, then when it handed its epilogue off.
__device__ __forceinline__ void trace_consumer_begin(const MegakernelArgs& a, int32_t n,
                                                     uint64_t wait, uint64_t begin) {
  if (!a.trace || n >= kTraceRecordsPerCta) return;
  MegakernelTraceRecord& r = a.trace[int64_t{blockIdx.x} * kTraceRecordsPerCta + n];
  r.consumer_wait_ns = wait;
  r.consumer_begin_ns = begin;
}
__device__ __forceinline__ void trace_consumer_end(const MegakernelArgs& a, int32_t n) {
  if (!a.trace || n >= kTraceRecordsPerCta) return;
  a.trace[int64_t{blockIdx.x} * kTraceRecordsPerCta + n].consumer_end_ns = ptx::global_timer_ns();
}

// Records task i of this CTA's n-th traced task (one thread per CTA calls it).
__device__ __forceinline__ void trace_task(const MegakernelArgs& a, int32_t n, int64_t i,
                                           const mega::Task& t, uint64_t taken, uint64_t ready) {
  if (!a.trace || n >= kTraceRecordsPerCta) return;
  MegakernelTraceRecord& r = a.trace[int64_t{blockIdx.x} * kTraceRecordsPerCta + n];
  r.task = static_cast<int32_t>(i);
  r.cta = static_cast<int16_t>(blockIdx.x);
  r.kind = static_cast<int16_t>(t.kind);
  r.taken_ns = taken;
  r.ready_ns = ready;
  r.done_ns = ptx::global_timer_ns();
}

}  // namespace epflow::kernels::megakernel
