// The memory every layer on one communicator shares (the public epflow::Workspace): the
// symmetric window with the barrier's flags and epoch, the megakernels' ring, the backward's row
// buffers, the inference forwards' schedule and the device's reports. Each layer sees it through
// its LayerWorkspace (layer_workspace.h), which lays its own shape over these allocations; the
// allocations grow to the largest layer created on the workspace (at layer creation, never in a
// call). Calls of all its layers run one at a time: a call on another stream than the previous
// one is ordered behind it with an event.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>

#include "epflow/layer.h"
#include "epflow/status.h"
#include "kernels/comm/lsa_shim.cuh"
#include "kernels/layer_kernels.cuh"
#include "kernels/moe_megakernel.cuh"

namespace epflow {

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

class SharedWorkspace {
 public:
  // The bytes one layer needs of each allocation.
  struct Needs {
    size_t window = 0;    // symmetric: the same on every rank for the same shapes
    size_t ring = 0;      // the forward megakernel's counters and rows
    size_t backward = 0;  // the backward's rows (0 without a backward)
    size_t schedule = 0;  // the inference forwards' routing schedule
  };

  // Queries comm (world, rank) and the device; allocates only the reports.
  static Status create(ncclComm_t comm, std::shared_ptr<SharedWorkspace>* out);
  ~SharedWorkspace();
  SharedWorkspace(const SharedWorkspace&) = delete;
  SharedWorkspace& operator=(const SharedWorkspace&) = delete;

  // Grows every allocation smaller than `needs` (collective when the window grows: every rank
  // creates the same layers in the same order). Waits for the device first: it frees memory the
  // earlier layers' calls used. Bumps generation() when anything moved.
  Status reserve(const Needs& needs);
  uint64_t generation() const { return generation_; }
  // What each allocation holds now (the window's bytes as allocated).
  const Needs& capacity() const { return have_; }

  ncclComm_t comm() const { return comm_; }
  int32_t world() const { return world_; }
  int32_t rank() const { return rank_; }
  int32_t sm_count() const { return sm_count_; }
  int32_t device() const { return device_; }
  const comm::LsaWindow& window() const { return window_; }
  char* ring() const { return static_cast<char*>(ring_); }
  char* backward() const { return static_cast<char*>(backward_); }
  char* schedule() const { return static_cast<char*>(schedule_); }
  // Device [world]: each rank's topk_idx in its window; each rank's T of the current call; the
  // barrier epoch.
  const int32_t** peer_topk_idx() const { return peer_topk_idx_; }
  int64_t* tokens() const { return tokens_; }
  uint64_t* epoch() const { return epoch_; }
  const DeviceReports& reports() const { return reports_; }
  MemoryReport memory() const;

  // Orders a call on `stream` behind the workspace's previous call when that ran on another
  // stream (an event wait: no host sync), then, after the call is enqueued, end_call records
  // where it ends. Captured calls (stream capture) are left to the graph's order.
  Status begin_call(cudaStream_t stream);
  Status end_call(cudaStream_t stream);

  // The megakernel's timed-out wait, else the barrier's, else ok. Host memory only.
  Status device_failure() const;

 private:
  SharedWorkspace() = default;
  Status grow_window(size_t bytes);

  ncclComm_t comm_ = nullptr;
  int32_t world_ = 0, rank_ = 0, sm_count_ = 0, device_ = 0;
  comm::LsaWindow window_;
  void* small_ = nullptr;  // peer_topk_idx, tokens, epoch
  const int32_t** peer_topk_idx_ = nullptr;
  int64_t* tokens_ = nullptr;
  uint64_t* epoch_ = nullptr;
  void* ring_ = nullptr;
  void* backward_ = nullptr;
  void* schedule_ = nullptr;
  Needs have_;
  uint64_t generation_ = 0;
  DeviceReports reports_;
  cudaEvent_t last_call_ = nullptr;
  cudaStream_t last_stream_ = nullptr;
  bool any_call_ = false;
};

}  // namespace epflow
