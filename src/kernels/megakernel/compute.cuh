// The compute partition's loop (compute_role) and the TMA maps its GEMMs read. The pass (P, see
// kernel.cuh) chooses the GEMMs' epilogues, weight layouts and K, and the gate/up-kind tiles'
// sink; each sink has its own file.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <cuda/ptx>

#include "common/megakernel_tasks.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/counters.cuh"
#include "kernels/megakernel/dh_sink.cuh"
#include "kernels/megakernel/push_combine_sink.cuh"
#include "kernels/megakernel/ring_sink.cuh"
#include "kernels/megakernel/smem.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"
#include "kernels/ptx/tma.cuh"

namespace epflow::kernels::megakernel {

// The TMA maps of the two GEMMs. First GEMM (gate/up-kind tasks): rows1 (128-row boxes) and
// rows1_few (16-row boxes) over ring_x; weights w1a, w1b; h_out, the store warps' map of the
// ring's h rows (forward only). Second GEMM (down-kind tasks): rows2, rows2_few over ring_h;
// weights w2a, w2b. Each pass's launcher encodes the weights' maps.
struct Maps {
  CUtensorMap rows1, rows1_few, w1a, w1b, h_out, rows2, rows2_few, w2a, w2b;
  // FP8 (gemm::Fp8ScaleLoads): the ring rows' scales; the weights' scales (gate, up, down).
  CUtensorMap rows1_scales, rows2_scales, w1a_scales, w1b_scales, w2_scales;
  gemm::WeightOrders w1, w2;               // of w1a / w1b and w2a / w2b
};

// The FP8 forward's block scales (grouped_gemm.cuh's Fp8Scales), all in shared memory: the rows'
// (loaded with each stage from the ring's packed rows, Maps::rows*_scales) and the weights' (with
// each tile's first stage, Maps::w*_scales).
__device__ __forceinline__ gemm::Fp8Scales fp8_scales(MegaSmem& smem, int32_t n) {
  gemm::Fp8Scales s;
  s.a_smem = smem.fp8_row_scales[0];
  s.b_smem = smem.fp8_weight_scales;
  s.n_blocks = n / fp8::kBlock;
  return s;
}
__device__ __forceinline__ gemm::Fp8ScaleLoads fp8_scale_loads(MegaSmem& smem,
                                                                const CUtensorMap* rows,
                                                                const CUtensorMap* weights0,
                                                                const CUtensorMap* weights1,
                                                                int32_t n) {
  return gemm::Fp8ScaleLoads{rows,     smem.fp8_row_scales[0],   weights0,
                             weights1, smem.fp8_weight_scales, n / fp8::kBlock};
}

// Compute partition: the GEMM CTA of grouped_gemm.cuh (producer warpgroup + two consumer
// warpgroups); two warps of the producer warpgroup store the consumers' staged output tiles
// (gate/up: h into the ring, then the tile's signal; down: rows into their combine slots), a
// third thread schedules. NOTES: compute tasks are claimed in list order from one
// counter (dynamic, not round-robin), so tasks next to each other in the list (the row tiles
// sharing a weight tile) start together on different SMs and share that weight tile through L2;
// with a static split, CTAs drift apart (gate/up and down tiles differ in length, waits differ)
// and each re-reads weights from HBM. The scheduler thread claims the next task, finds its tile
// and passes its waits while the producer still loads the current tile (the claim, the expert
// lookup and the counter reads are a chain of dependent global accesses per task, longer than
// the kStages-stage lookahead hides). It claims only once the producer took the previous task,
// so a CTA holds at most one task beyond the one it runs; tasks of a CTA are still taken in
// list order, which keeps the no-deadlock argument.
template <class P>
__device__ __forceinline__ void compute_role(const Maps& m, const MegakernelArgs& a,
                                             const mega::TaskShape& s, MegaSmem& smem,
                                             int32_t traced) {
  using gemm::Epilogue;
  using mega::Task;
  using mega::TaskKind;
  const int wg = gemm::warpgroup_index();
  const int64_t tasks = mega::num_compute_tasks(s);
  // K of the two GEMMs: H, then I (forward: h) or 2I (backward: [dg | du], W_gate's K first).
  constexpr gemm::Operands kOp = P::kOperands;
  const int32_t k_gate_up = a.hidden / gemm::kBlockKElems<kOp>;
  const int32_t k_down = P::kDownKParts * a.intermediate / gemm::kBlockKElems<kOp>;
  volatile gemm::StageTag* stage_tag = smem.stage_tag;
  const gemm::StageTags tags{smem.stage_tag, smem.tag_read};
  gemm::PipelineState<kStages> ps;
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 96) {
      uint32_t* next_task = claim_counter(a);
      for (uint32_t n = 0;; ++n) {
        ptx::mbarrier_wait(&smem.next_empty, (n & 1) ^ 1);
        const int64_t i = atomicAdd(next_task, 1u);
        const uint64_t taken = a.trace ? ptx::global_timer_ns() : 0;
        if (i < tasks) {
          const Task t = mega::compute_task(s, i);
          smem.next_tile = tile_of(a, s, t);
          smem.next_kind = static_cast<int32_t>(t.kind);
          wait_for_task<P>(a, s, t, true);
        }
        smem.next_task = i < tasks ? i : -1;
        smem.next_taken = taken;
        smem.next_ready = a.trace ? ptx::global_timer_ns() : 0;
        ptx::mbarrier_arrive(&smem.next_full);  // release: the fields above, and the waits
        if (i >= tasks) break;
      }
    } else if (threadIdx.x == 0) {
      for (uint32_t n = 0;; ++n) {
        ptx::mbarrier_wait(&smem.next_full, n & 1);
        const int64_t i = smem.next_task;
        const gemm::TileCoord c = smem.next_tile;
        const int32_t kind = smem.next_kind;
        const uint64_t taken = smem.next_taken, ready = smem.next_ready;
        ptx::mbarrier_arrive(&smem.next_empty);
        if (i < 0) break;
        cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // TMA reads what was waited for
        // The scheduler decoded the task (its index divided by the list's shape: 64-bit
        // divisions, a few hundred instructions): its kind and tile come with it.
        const Task t{static_cast<TaskKind>(kind), c.m_tile, c.n_tile};
        // A split K (the backward's [dg | du]) reads its first I columns' weights from w2a.
        if (t.kind == TaskKind::kGateUp)
          gemm::produce_tile<P::kGateUpEpilogue, kStages, kStaging, P::kWeights, kOp>(
              smem.gemm, ps, c, k_gate_up, &m.rows1, &m.rows1_few, &m.w1a, &m.w1b, tags, i, kind, 0,
              fp8_scale_loads(smem, &m.rows1_scales, &m.w1a_scales, &m.w1b_scales,
                              a.intermediate),
              m.w1);
        else
          gemm::produce_tile<Epilogue::kStore, kStages, kStaging, P::kWeights, kOp>(
              smem.gemm, ps, c, k_down, &m.rows2, &m.rows2_few, &m.w2a, &m.w2b, tags, i, kind,
              P::kDownKParts > 1 ? a.intermediate / gemm::kBlockK : 0,
              fp8_scale_loads(smem, &m.rows2_scales, &m.w2_scales, &m.w2_scales, a.hidden),
              m.w2);
        record_progress(a, kProducerLoaded, i);
        trace_task(a, traced + static_cast<int32_t>(n), i, t, taken, ready);
      }
      // The next stage tells the consumers there is nothing more (no data: a plain arrival).
      ptx::mbarrier_wait(&smem.gemm.empty[ps.stage], ps.phase ^ 1);
      gemm::wait_tag_read(tags, ps);
      stage_tag[ps.stage].task = -1;
      ptx::mbarrier_arrive(&smem.gemm.full[ps.stage]);
    } else if (threadIdx.x / 32 == 1 || threadIdx.x / 32 == 2) {
      const int w = threadIdx.x / 32 - 1;  // the consumer warpgroup this warp stores for
      const bool lane0 = threadIdx.x % 32 == 0;
      volatile gemm::StageTag* staged = smem.staged;
      for (uint32_t uses = 0;; ++uses) {
        ptx::mbarrier_wait(&smem.staging_full[w], uses & 1);
        const int64_t i = staged[w].task;
        if (i < 0) break;
        const TaskKind kind = static_cast<TaskKind>(staged[w].kind);
        // The consumers' tile (the scheduler looked it up once): no global loads before the stores.
        const volatile gemm::TileCoord& tag = staged[w].tile;
        const gemm::TileCoord c{tag.m_tile, tag.n_tile, tag.expert, tag.rows, tag.a_row};
        uint32_t* counter = counter_of(a, c.a_row / kTileRows, mega::signalled_counter(kind));
        if (kind != TaskKind::kGateUp) {
          // Down kind: the tile's MMAs are done (its signal), then the rows to their slots.
          if (lane0) {
            ptx::signal_counter(counter);
            record_progress(a, kStoreSignalled + w, i);
          }
          push_staged_rows(a, smem.gemm.out[w], c, w);
          __syncwarp();
          if (lane0) ptx::mbarrier_arrive(&smem.staging_empty[w]);
          continue;
        }
        // Gate/up kind (the forward's h, RingSink): into the ring, then the tile's signal.
        if (lane0) {
          gemm::store_staging<Epilogue::kSwiGLU, kOp>(&m.h_out, smem.gemm.out[w], c, w);
          ptx::tma_store_wait_read();
          ptx::mbarrier_arrive(&smem.staging_empty[w]);
          ptx::tma_store_wait_all();
          cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
          ptx::signal_counter(counter);
          record_progress(a, kStoreSignalled + w, i);
        }
        __syncwarp();
      }
      ptx::tma_store_wait_all();  // the combine rows' copies are complete before the CTA exits
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    const int tid = threadIdx.x % 128;
    StagingHandshake staging{&smem};  // the sinks', and the store warps' stop
    RingSink ring{&staging, &a};
    PushCombineSink push{&staging};
    DhSink<kOp == gemm::Operands::kFP8> dh{&a, &staging};
    gemm::Fp8Scales gate_up_scales = fp8_scales(smem, a.intermediate);
    gate_up_scales.power_of_two = a.fp8_pow2_scales;
    const gemm::Fp8Scales down_scales = fp8_scales(smem, a.hidden);
    if constexpr (kOp == gemm::Operands::kFP8) gemm::fp8_turns_begin(wg - 1);
    // The trace's consumer times: thread 0 of the first consumer warpgroup, tasks in the
    // producer's order (its record n is the producer's).
    const bool tracer = a.trace && wg == 1 && tid == 0;
    for (int32_t n = traced;; ++n) {
      const uint64_t waited = tracer ? ptx::global_timer_ns() : 0;
      ptx::mbarrier_wait(&smem.gemm.full[ps.stage], ps.phase);  // the tile's first stage
      const uint64_t began = tracer ? ptx::global_timer_ns() : 0;
      const int64_t i = stage_tag[ps.stage].task;
      const TaskKind kind = static_cast<TaskKind>(stage_tag[ps.stage].kind);
      const volatile gemm::TileCoord& tag = stage_tag[ps.stage].tile;
      const gemm::TileCoord c{tag.m_tile, tag.n_tile, tag.expert, tag.rows, tag.a_row};
      ptx::mbarrier_arrive(&smem.tag_read[ps.stage]);
      if (i < 0) break;
      // Written now: nothing of the trace stays live in registers across the tile.
      if (tracer) trace_consumer_begin(a, n, waited, began);
      // The tile's ring slot (its rows' place in the ring) and kind come with its tag: decoding
      // the task index here (64-bit divisions) held both warpgroups between tiles.
      uint32_t* counter = counter_of(a, c.a_row / kTileRows, mega::signalled_counter(kind));
      if (tid == 0) record_progress(a, kConsumerTaken + wg - 1, i);
      if (kind == TaskKind::kGateUp) {
        if constexpr (P::kBackward) {
          dh.counter = counter;
          dh.c = c;
          gemm::consume_tile<P::kGateUpEpilogue, kStages, kStaging, decltype(dh), P::kWeights,
                             gemm::RowsMajor::kK, kOp>(smem.gemm, ps, c, k_gate_up, wg - 1, dh,
                                                       gate_up_scales);
        } else {
          ring.counter = counter;
          ring.task = i;
          gemm::consume_tile<P::kGateUpEpilogue, kStages, kStaging, RingSink, P::kWeights,
                             gemm::RowsMajor::kK, kOp>(smem.gemm, ps, c, k_gate_up, wg - 1, ring,
                                                       gate_up_scales);
        }
      } else {
        push.counter = counter;
        push.task = i;
        gemm::consume_tile<Epilogue::kStore, kStages, kStaging, PushCombineSink, P::kWeights,
                           gemm::RowsMajor::kK, kOp>(smem.gemm, ps, c, k_down, wg - 1, push,
                                                     down_scales);
      }
      if (tid == 0) record_progress(a, kConsumerDone + wg - 1, i);
      if (tracer) trace_consumer_end(a, n);
    }
    // Stop this warpgroup's store warp (through its staging handshake, phases kept).
    staging.acquire(wg - 1);
    if (tid == 0) staging.publish(wg - 1, -1, TaskKind::kDispatch, gemm::TileCoord{});
  }
}

}  // namespace epflow::kernels::megakernel
