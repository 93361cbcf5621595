#include "host/saved_activations.h"

#include <cuda_runtime.h>

#include "common/status_util.h"
#include "host/layer_workspace.h"

namespace epflow {

namespace {

int64_t aligned(int64_t bytes) {
  return (bytes + SavedActivations::kAlignment - 1) / SavedActivations::kAlignment *
         SavedActivations::kAlignment;
}

}  // namespace

int64_t SavedActivations::schedule_bytes(const LayerWorkspace& ws) {
  return aligned(static_cast<int64_t>(kernels::routing_schedule_workspace_bytes(ws.schedule)));
}

int64_t SavedActivations::bytes(const LayerWorkspace& ws, bool with_gate_up) {
  const int64_t gate_up =
      sizeof(__nv_bfloat16) * ws.plan.saved_gate_up_rows * 2 * ws.config.intermediate;
  return schedule_bytes(ws) + (with_gate_up ? aligned(gate_up) : 0);
}

SavedActivations SavedActivations::carve(const LayerWorkspace& ws, void* buffer, bool with_gate_up) {
  SavedActivations acts;
  acts.schedule = kernels::carve_schedule_buffers(ws.schedule, buffer);
  if (with_gate_up)
    acts.gate_up =
        reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(buffer) + schedule_bytes(ws));
  return acts;
}

Status SavedActivations::build_schedule(const LayerWorkspace& ws, cudaStream_t stream) const {
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(schedule.invalid_slots, 0, sizeof(int32_t), stream));
  EPFLOW_CUDA_RETURN(kernels::launch_routing_schedule(ws.schedule, ws.peer_topk_idx, ws.tokens,
                                                      schedule, stream));
  return Status::ok_status();
}

}  // namespace epflow
