// A layer's view of the workspace it shares with every layer on its communicator
// (shared_workspace.h): its shape's window layout, runtime plan and schedule shape, and where
// its window regions, ring and backward rows lie in the shared allocations. Created with the
// layer (which grows the shared allocations to fit it); refresh() re-derives the pointers after
// a later layer grew them. A call never allocates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <cstdint>
#include <memory>

#include "epflow/config.h"
#include "epflow/layer.h"
#include "epflow/status.h"
#include "host/runtime_plan.h"
#include "host/shared_workspace.h"
#include "kernels/comm/lsa_shim.cuh"
#include "kernels/layer_kernels.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/routing_schedule.cuh"

namespace epflow {

// Rows of one megakernel pass in flight: the routed rows it pulls (x, or the backward's dy), what
// its first GEMM leaves for its second (h, or [dg | du]) and the counters they hand over with.
struct RingBuffers {
  int64_t rows = 0;  // multiple of the minibatch
  __nv_bfloat16* x = nullptr;
  __nv_bfloat16* h = nullptr;
  uint32_t* counters = nullptr;
  size_t counter_bytes = 0;
};

// The backward's row buffers over every routed row (its megakernel's ring never wraps: the
// weight gradients after it read all rows), in pull-table order: ring.x = dy rows, ring.h =
// [dg | du] rows; x rows, w·h rows and the dhp tiles' partial <dhp, h>.
struct BackwardRows {
  RingBuffers ring;
  __nv_bfloat16* x = nullptr;   // [rows, H]
  __nv_bfloat16* wh = nullptr;  // [rows, I]
  float* dw_partial = nullptr;  // [rows, backward_dh_tiles(I)]
  // [max_rows - plan.saved_gate_up_rows, 2I]: g | u of the rows past what contexts keep,
  // recomputed by each backward (null when contexts keep every row).
  __nv_bfloat16* gate_up_overflow = nullptr;
  // FP8 only: the pulled x rows and the [dg | du] rows the dx GEMM reads, as packed rows
  // ([rows, fp8::packed_row_bytes(H)], [rows, packed_row_bytes(2I)]); ring.x then holds the
  // packed dy rows, ring.h the bf16 [dg | du] rows (for weight gradients in bf16).
  uint8_t* x_fp8 = nullptr;
  uint8_t* dgu_fp8 = nullptr;
  // FP8 only, the FP8 weight gradients' operands (launch_quantize_transposed): dy and [dg | du]
  // transposed as packed rows by 128 x 1 blocks ([H | 2I, packed_row_bytes(rows)]), w·h and x
  // transposed by 128 x 128 blocks ([I | H, rows] with scales [I | H / 128, rows / 128]). In x's
  // bytes (an FP8 layer's x rows are x_fp8: x holds only the g|u recompute's rows before the
  // megakernel, or the bf16 weight gradients' dequantized rows instead), d W_down's operands
  // (dy_t, wh_t, wh_t_scales) and then d W_gate's and d W_up's (x_t, dgu_t, x_t_scales) at the
  // same addresses: the pointers of a pair are equal.
  uint8_t* dy_t = nullptr;
  uint8_t* dgu_t = nullptr;
  uint8_t* wh_t = nullptr;
  uint8_t* x_t = nullptr;
  float* wh_t_scales = nullptr;
  float* x_t_scales = nullptr;
};

// An FP8 training layer's weight gradients: by runtime::fp8_weight_gradients_pay (kAuto), always
// in FP8, or always in bf16 on the dequantized rows (tests and the bench's comparison).
enum class WgradPrecision { kAuto, kFp8, kBf16 };

struct LayerWorkspace {
  LayerConfig config;
  std::shared_ptr<SharedWorkspace> shared;
  ncclComm_t comm = nullptr;
  int32_t sm_count = 0;
  runtime::LayerPlan plan;

  kernels::WindowLayout layout;
  kernels::PeerWindows peers;
  kernels::ScheduleLaunch schedule;  // the routing schedule's shape (its buffers: SavedActivations)
  int64_t max_rows = 0;              // pull-table capacity, a multiple of the tile

  const int32_t** peer_topk_idx = nullptr;  // device [world]: each rank's topk_idx in its window
  int64_t* tokens = nullptr;                // device [world]: each rank's T of the current call
  uint64_t* epoch = nullptr;                // device: the barrier epoch
  RingBuffers ring;                         // the forward megakernel's
  // FP8 training layers: the precision of the weight gradients (LayerCore::set_wgrad_precision),
  // and what the current backward runs (run_backward resolves kAuto by the call's T).
  WgradPrecision wgrad_precision = WgradPrecision::kAuto;
  bool fp8_weight_gradients = false;
  BackwardRows backward;                    // LayerConfig::with_backward only
  void* inference_schedule = nullptr;       // the schedule buffer of forwards that keep nothing
  DeviceReports reports;

  // Collective over the shared workspace's communicator: every rank creates its layers with the
  // same shapes in the same order (each shape checked).
  static Status create(const LayerConfig& config, std::shared_ptr<SharedWorkspace> shared,
                       std::unique_ptr<LayerWorkspace>* out);

  // The pointers into the shared allocations, again if a later layer grew them (host only).
  void refresh() {
    if (generation_ != shared->generation()) carve();
  }
  char* local_window() const { return static_cast<char*>(shared->window().local()); }
  // The bytes this shape needs of each shared allocation.
  SharedWorkspace::Needs needs() const;

  // The barrier that publishes what this rank put into its window (peers read it after it) and
  // gathers every rank's T into `tokens`.
  Status publish_barrier(int64_t T, cudaStream_t stream);
  // The barrier after every rank pushed its rows into the owners' combine slots (it also proves
  // every peer is done reading this call's window), then out[t] = sum_k w[t,k] combine[t, k]
  // (w = 1 without topk_weights); check_routing: the sum also counts bad topk_idx slots.
  Status barrier_and_sum(int64_t T, const int32_t* topk_idx, const float* topk_weights,
                         bool check_routing, __nv_bfloat16* out, cudaStream_t stream);

  // The megakernel's timed-out wait, else the barrier's, else ok (any layer of the workspace).
  // Host memory only.
  Status device_failure() const { return shared->device_failure(); }
  // What the weighted sums found wrong in topk_idx since the last report (calls of any layer of
  // the workspace), then cleared.
  Status routing_report();

 private:
  LayerWorkspace() = default;
  void carve();
  kernels::BarrierArgs barrier_args(int64_t T, kernels::BarrierPhase phase) const;
  uint64_t generation_ = 0;
  size_t ring_x_bytes_ = 0, ring_h_bytes_ = 0, ring_counter_bytes_ = 0;
  size_t backward_rows_bytes_ = 0, backward_partial_bytes_ = 0, overflow_bytes_ = 0;
  size_t backward_x_bytes_ = 0;  // BackwardRows::x's, and the FP8 weight gradients' operands'
  // FP8: bytes of the three slots of BackwardRows' FP8 weight-gradient operands: dy_t | x_t,
  // wh_t | dgu_t, wh_t_scales | x_t_scales.
  std::array<size_t, 3> fp8_wgrad_operand_bytes() const;
};

}  // namespace epflow
