// What a forward keeps for its backward: the routing schedule of the call (pull table, segments,
// per-expert rows; the backward runs on the same rows) and, when the forward keeps them, every
// routed row's gate/up pre-activations g | u. One per layer today (a context is valid until the
// layer's next forward); its own type so that contexts can own theirs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "epflow/status.h"
#include "kernels/routing_schedule.cuh"

namespace epflow {

struct Workspace;

struct SavedActivations {
  kernels::ScheduleBuffers schedule;
  __nv_bfloat16* gate_up = nullptr;  // [ws.max_rows, 2I] in pull-table order; with_backward only
  int64_t schedule_bytes = 0, gate_up_bytes = 0;

  // Sized for ws's shape (the schedule always; g | u with LayerConfig::with_backward).
  static Status create(const Workspace& ws, std::unique_ptr<SavedActivations>* out);
  ~SavedActivations();

  // The device schedule of this rank's experts from every rank's topk_idx and T (in their
  // windows and ws.tokens once the publish barrier passed), stream-ordered.
  Status build_schedule(const Workspace& ws, cudaStream_t stream);

 private:
  SavedActivations() = default;
  void* schedule_buffers_ = nullptr;
};

}  // namespace epflow
