// The fused megakernel, in two passes of one persistent, cooperative launch whose CTAs are split
// into a communication partition (the first comm_ctas CTAs: pull token rows over NVLink into the
// ring) and a compute partition (the rest: the warp-specialised wgmma GEMM of grouped_gemm.cuh,
// fed tile by tile), handing tiles to each other only through per-slot counters in local memory
// (src/common/megakernel_tasks.h: the same task lists and waits for both passes).
//   Forward: pull x rows; gate/up GEMM + SwiGLU into the ring's h rows; down GEMM whose epilogue
//   pushes each output row into its owner's (token, k) slot. Routed x and h rows live in a ring
//   of ring_tiles row tiles reused macrobatch by macrobatch.
//   Backward (the input-gradient half of the layer's backward): pull dy rows; dhp = dy W_down
//   with the SwiGLU and router-weight backward in its epilogue (from the forward's kept g | u),
//   writing w·h and [dg | du]; dx = [dg | du] [W_gate; W_up] pushed from the epilogue into the
//   owners' (token, k) slots; the communication CTAs also pull the x rows the weight gradients
//   read. Its "ring" holds every routed row (ring_tiles >= the pull table's tiles: no wrap),
//   because the weight-gradient GEMMs that follow read all of them.
// The code: src/kernels/megakernel/ (one .cu per pass; the shared device code in its headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/fp8_blocks.h"
#include "common/hd.h"
#include "common/routing_schedule.h"
#include "kernels/layer_kernels.cuh"

namespace epflow::kernels {

// What a timed-out wait inside the megakernel leaves behind before it traps, in host-mapped
// memory (readable by the host after the trap, without touching the dead context). NOTES: the
// kernel cannot printf: any call in a kernel makes ptxas serialise every wgmma in it.
// Per CTA, what each of its compute agents last got to (compute task index + 1; 0: none yet),
// kept in device memory during the launch and copied into the diagnostic on a timeout, so the
// message can say which CTA holds the work the waiter waited for and where it stopped.
enum ProgressWord : int {
  kProducerLoaded = 0,   // the producer issued every load of this task
  kConsumerTaken = 1,    // consumer warpgroup 0 started this task (+1: warpgroup 1)
  kConsumerDone = 3,     // consumer warpgroup 0 finished this task's epilogue (+1: warpgroup 1)
  kStoreSignalled = 5,   // store warp 0 signalled this task (+1: warp 1); gate/up: stored too
  kProgressWords = 8,
};
inline constexpr int kMaxDiagnosedCtas = 160;

struct MegakernelDiagnostic {
  uint32_t set;  // 0 until a wait times out; the first one to time out fills the rest
  int32_t backward;  // the pass: 0 forward, 1 backward
  int32_t rank, cta, compute;  // compute: 1 compute partition, 0 communication partition
  int32_t task_kind, m_tile, n_tile, counter, slot, m_tiles, ring_tiles;
  int32_t minibatch_tiles, n_gate_up, n_down, comm_ctas, ctas;
  int32_t down_n_fastest;  // TaskShape::down_n_fastest: the compute list's order
  uint32_t want, have;
  double seconds;
  uint64_t progress[kMaxDiagnosedCtas][kProgressWords];  // per CTA
};

// The message of a filled diagnostic ("" when none).
std::string describe(const MegakernelDiagnostic& d);

// One task as the megakernel ran it (epflow-bench --trace), %globaltimer nanoseconds. taken:
// claimed; ready: its waits passed; done: communication: rows copied and signalled, compute: all
// of the tile's loads issued (the producer's view; its MMAs finish up to kStages stages later).
struct MegakernelTraceRecord {
  int32_t task;  // index in its partition's list; -1: unused record
  int16_t cta;
  int16_t kind;  // mega::TaskKind
  uint64_t taken_ns, ready_ns, done_ns;  // the producer's view: claimed, waits passed, loads issued
  // GEMM tasks, the first consumer warpgroup's view: it starts waiting for the tile's first stage,
  // has it, has handed its epilogue off (all bits set: not recorded, as for dispatch tasks).
  uint64_t consumer_wait_ns, consumer_begin_ns, consumer_end_ns;
};
inline constexpr int kTraceRecordsPerCta = 2048;  // later tasks of a CTA are not recorded

struct MegakernelArgs {
  PeerWindows peers;
  size_t x_offset = 0;        // window offset of the rows peers pull (forward: x; backward: dy)
  size_t combine_offset = 0;  // window offset of the (token, k) result slots (y, or dx)
  const sched::PullRow* table = nullptr;
  const int64_t* seg_offset = nullptr;   // device [experts + 1]
  const int32_t* expert_rows = nullptr;  // device [experts]: real rows per expert
  int32_t experts = 0;
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t top_k = 0;
  int32_t ring_tiles = 0;       // ring capacity in 128-row tiles
  int32_t minibatch_tiles = 0;  // divides ring_tiles
  // Forward: x [ring_tiles * 128, H] and h [.., I]. Backward: dy [.., H] and [dg | du] [.., 2I],
  // padding rows of every tile written as zeros (the weight gradients sum over them).
  __nv_bfloat16* ring_x = nullptr;
  __nv_bfloat16* ring_h = nullptr;
  uint32_t* counters = nullptr;  // megakernel_counter_bytes, zero before each launch
  const __nv_bfloat16* w_gate = nullptr;  // [experts, I, H]
  const __nv_bfloat16* w_up = nullptr;    // [experts, I, H]
  const __nv_bfloat16* w_down = nullptr;  // [experts, H, I]
  // Elements from one expert's matrix to the next one's (0: densely packed; negative: experts
  // laid out from the last to the first).
  int64_t w_gate_stride = 0, w_up_stride = 0, w_down_stride = 0;
  // The FP8 forward (launch_forward_megakernel with fp8): x rows in the window and the ring, and
  // h rows in the ring, are packed rows (fp8::packed_row_bytes: e4m3 values, then their 1 x 128
  // scales); the weights are e4m3 in the bf16 layouts with fp32 128 x 128 block scales
  // [experts, rows / 128, cols / 128]; h's scales are powers of two with fp8_pow2_scales.
  bool fp8 = false;
  bool fp8_pow2_scales = false;
  const uint8_t* w_gate_fp8 = nullptr;
  const uint8_t* w_up_fp8 = nullptr;
  const uint8_t* w_down_fp8 = nullptr;
  const float* w_gate_scales = nullptr;
  const float* w_up_scales = nullptr;
  const float* w_down_scales = nullptr;
  // The FP8 backward (launch_backward_megakernel with fp8): dy and x rows are packed rows too,
  // ring_h holds the packed [dg | du] rows the dx GEMM reads (dgu_out, if not null, their bf16
  // values, for weight gradients in bf16), and the GEMMs read the weights transposed
  // (Fp8ExpertWeights::gate_up_t, down_t: e4m3 wgmma reads K-major operands only).
  const uint8_t* w_gate_up_t_fp8 = nullptr;   // [experts, H, 2I]
  const uint8_t* w_down_t_fp8 = nullptr;      // [experts, I, H]
  const float* w_gate_up_t_scales = nullptr;  // [experts, H / 128, 2I / 128]
  const float* w_down_t_scales = nullptr;     // [experts, I / 128, H / 128]
  __nv_bfloat16* dgu_out = nullptr;           // [ring rows, 2I] or null
  int32_t comm_ctas = 0;  // communication partition; the other CTAs compute
  int32_t rank = 0;       // for diagnostics
  int64_t timeout_ns = 0;
  MegakernelDiagnostic* diagnostic = nullptr;  // host-mapped
  MegakernelTraceRecord* trace = nullptr;      // optional: [grid][kTraceRecordsPerCta]
  // Forward, optional (training): [gate_up_rows, 2I], the g | u (bf16) of the routed rows of
  // the pull table's first gate_up_rows rows (a multiple of the tile); later rows keep nothing.
  __nv_bfloat16* gate_up_out = nullptr;
  int64_t gate_up_rows = 0;
  // Backward only.
  const __nv_bfloat16* gate_up_in = nullptr;  // the forward's gate_up_out (gate_up_rows rows)
  // [pull-table rows - gate_up_rows, 2I]: the later rows' g | u, recomputed before the launch.
  const __nv_bfloat16* gate_up_overflow = nullptr;
  size_t weights_offset = 0;    // window offset of the owners' router weights [T, K] (fp32)
  __nv_bfloat16* wh_out = nullptr;   // [ring rows, I]: w·h (the down weight gradient's rhs)
  float* dw_partial = nullptr;       // [ring rows, backward_dh_tiles(I)]: <dhp, h> per n tile
  size_t x_pull_offset = 0;          // window offset of x, pulled into x_out
  void* x_out = nullptr;             // [ring rows, x_row_bytes]: x rows (padding rows zero)
};

// Bytes of one x (or dy) row in the window and the ring (bf16, or an FP8 packed row), and of
// one h row of the forward.
EPFLOW_HD int64_t x_row_bytes(const MegakernelArgs& a) {
  return a.fp8 ? fp8::packed_row_bytes(a.hidden) : int64_t{a.hidden} * 2;
}
EPFLOW_HD int64_t h_row_bytes(const MegakernelArgs& a) {
  return a.fp8 ? fp8::packed_row_bytes(a.intermediate) : int64_t{a.intermediate} * 2;
}

// N tiles of the backward's dhp GEMM (the columns of dw_partial).
EPFLOW_HD int32_t backward_dh_tiles(int64_t intermediate) {
  return static_cast<int32_t>((intermediate + 255) / 256);
}

// Bytes of counters (and per-CTA progress words) for a ring of ring_tiles tiles and sm_count
// CTAs.
size_t megakernel_counter_bytes(int32_t ring_tiles, int32_t sm_count);

// One CTA per SM (sm_count CTAs), cooperative so that every CTA is resident (the partitions
// wait on each other). Expects the counters zeroed (cudaMemsetAsync before, stream-ordered).
cudaError_t launch_forward_megakernel(const MegakernelArgs& args, int32_t sm_count,
                                      cudaStream_t stream);
cudaError_t launch_backward_megakernel(const MegakernelArgs& args, int32_t sm_count,
                                       cudaStream_t stream);

}  // namespace epflow::kernels
