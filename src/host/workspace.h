// What the calls of a layer share (and, later, every layer of a model on one communicator):
// the communicator, the symmetric window with its layout and the peers' addresses, the
// megakernels' rings and the backward's row buffers, the barrier epoch, the diagnostics the
// device leaves behind, and what all of it costs (MemoryReport). Created once; a call never
// allocates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>

#include "epflow/config.h"
#include "epflow/layer.h"
#include "epflow/status.h"
#include "host/runtime_plan.h"
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
};

// Where the device says what went wrong, in host-mapped memory the host reads without touching
// the device (a timed-out wait traps its kernel and the CUDA context with it).
struct DeviceReports {
  kernels::MegakernelDiagnostic* megakernel = nullptr;  // host pointer
  kernels::MegakernelDiagnostic* megakernel_device = nullptr;
  kernels::BarrierTimeout* barrier = nullptr;
  kernels::BarrierTimeout* barrier_device = nullptr;
  kernels::RoutingCheck* routing = nullptr;  // bad topk_idx slots the weighted sums found
  kernels::RoutingCheck* routing_device = nullptr;
  kernels::RoutingTally* routing_tally = nullptr;  // device memory: the current call's counts
};

struct Workspace {
  LayerConfig config;
  ncclComm_t comm = nullptr;
  int32_t sm_count = 0;
  runtime::LayerPlan plan;

  comm::LsaWindow window;
  kernels::WindowLayout layout;
  kernels::PeerWindows peers;
  kernels::ScheduleLaunch schedule;  // the routing schedule's shape (its buffers: SavedActivations)
  int64_t max_rows = 0;              // pull-table capacity, a multiple of the tile

  const int32_t** peer_topk_idx = nullptr;  // device [world]: each rank's topk_idx in its window
  int64_t* tokens = nullptr;                // device [world]: each rank's T of the current call
  uint64_t* epoch = nullptr;                // device: the barrier epoch
  RingBuffers ring;                         // the forward megakernel's
  BackwardRows backward;                    // LayerConfig::with_backward only
  DeviceReports reports;
  MemoryReport memory;  // symmetric, ring, schedule (epoch, counters) and backward bytes

  // Collective over comm: every rank creates its workspace with the same shape (checked).
  static Status create(const LayerConfig& config, ncclComm_t comm, std::unique_ptr<Workspace>* out);
  ~Workspace();

  char* local_window() const { return static_cast<char*>(window.local()); }

  // The barrier that publishes what this rank put into its window (peers read it after it) and
  // gathers every rank's T into `tokens`.
  Status publish_barrier(int64_t T, cudaStream_t stream);
  // The barrier after every rank pushed its rows into the owners' combine slots (it also proves
  // every peer is done reading this call's window), then out[t] = sum_k w[t,k] combine[t, k]
  // (w = 1 without topk_weights); check_routing: the sum also counts bad topk_idx slots.
  Status barrier_and_sum(int64_t T, const int32_t* topk_idx, const float* topk_weights,
                         bool check_routing, __nv_bfloat16* out, cudaStream_t stream);

  // The megakernel's timed-out wait, else the barrier's, else ok. Host memory only.
  Status device_failure() const;
  // What the weighted sums found wrong in topk_idx since the last report, then cleared.
  Status routing_report();

 private:
  Workspace() = default;
  Status allocate();
  Status allocate_backward();
  kernels::BarrierArgs barrier_args(int64_t T, kernels::BarrierPhase phase) const;
  void* local_ = nullptr;             // schedule scalars, counters and the forward ring
  void* backward_buffers_ = nullptr;  // BackwardRows
};

}  // namespace epflow
